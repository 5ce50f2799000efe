"""Lays torch 2.14.1's graph hooks (tests/torch_hooks.py) over the installed torch's
`CUDAGraph` in every Python process of a test run that puts this folder first on PYTHONPATH
and sets GRAPHSAN_TEST_TORCH_HOOKS=1 (`scripts/gpu_check.sh` does both), so that the GPU tests,
their child processes and `graphsan selftest` run through the hooks on a torch that has none."""

import os
import sys

if os.environ.get("GRAPHSAN_TEST_TORCH_HOOKS") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    from tests.torch_hooks import lay_over_torch

    lay_over_torch()
    del sys.path[0]
