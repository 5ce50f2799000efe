"""Shared by the lab's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """The tiny model's operations are too small to share out between threads, and on a shared
    machine threads that wait for each other slow every step down."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
