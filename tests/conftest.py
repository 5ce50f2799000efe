"""Shared test configuration: the `gpu` marker is skipped, with a reason, where CUDA is absent,
and there Triton runs its interpreter, so the quantize kernels' logic is tested on CPU too."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # read when @triton.jit decorates, so before anything imports Triton (torch does not)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
