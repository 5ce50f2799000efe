"""Shared test configuration: the `gpu` marker is skipped, with a reason, where CUDA is absent,
and there Triton runs its interpreter, so the quantize kernels' logic is tested on CPU too; the
`slow` tests run first."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # read when @triton.jit decorates, so before anything imports Triton (torch does not)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.fake_cuda import ATTACHMENTS, started  # noqa: E402  (after the Triton switch above)


@pytest.fixture(params=ATTACHMENTS)
def attach(request) -> str:
    """How graphsan attaches to the faked graphs (tests/fake_cuda.py `graph_class`): each test
    that takes it runs through graphsan's wrappers and through torch 2.14.1's hooks."""
    return request.param


@pytest.fixture
def fake_sanitizer():
    """`fake_sanitizer(state, policy="raise", hooks=True)`: a sanitizer over the fakes of
    tests/fake_cuda.py (`fake_cuda.started`), whose hooks go at the test's end."""
    made = []

    def start(state: dict, policy: str = "raise", hooks: bool = True):
        san = started(state, policy, hooks)
        made.append(san)
        return san

    yield start
    for san in made:
        san.hooks.uninstall()


def pytest_collection_modifyitems(config, items):
    # The `slow` tests first (xdist hands tests out in this order), so that none starts near the
    # end while the other workers run out of work. Tests of an xdist_group stay in place: they
    # share a module fixture, and xdist sends each group to one worker ahead of the rest.
    def later(item):
        return item.get_closest_marker("slow") is None or bool(
            item.get_closest_marker("xdist_group")
        )

    items.sort(key=later)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
