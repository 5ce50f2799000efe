"""The compiled walk of a captured graph (graphwalk.cpp, through graphsan.cuda.graphwalk) without
a GPU: built here against the CUDA headers and driven by a stand-in driver over a fixed graph
(tests/native/fake_cuda_driver.c), it gives the records `cuda.driver.walk` would (the same
comparison against the cuda-bindings walk on real graphs is tests/test_gpu_graphwalk.py)."""

from __future__ import annotations

import ctypes
import functools
import os
import struct

import pytest

from graphsan.core.records import AllocArgs, CopyArgs, KernelArgs, WalkStats
from graphsan.cuda import graphwalk, tracebuild
from tests import native

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = {
    (0x1000, False): ("f1(int, float, float*)", (0, 4, 8)),
    (0x2000, False): ("f2(float*, int, float*)", (0, 8, 16)),
    (0x3000, True): ("k1", ()),
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    """graphwalk.cpp alone, and the stand-in driver, compiled here."""
    cxx, cuda = tracebuild.find_compiler(), tracebuild.cuda_include_dirs()
    if cxx is None or not cuda or not os.path.isfile(os.path.join(cuda[0], "cuda.h")):
        pytest.skip("needs a C++ compiler and the CUDA headers (cuda.h)")
    folder = tmp_path_factory.mktemp("graphwalk")
    walk, fake = str(folder / "graphwalk.so"), str(folder / "fake-driver.so")
    flags = tracebuild.TorchFlags("c++17", (), tuple(cuda))
    extra = native.COMPILE_FLAGS
    tracebuild.build(walk, cxx, flags, str(folder), [], [tracebuild.SOURCES[1]], extra)
    tracebuild.build(
        fake, cxx, flags, str(folder), [], [f"{HERE}/native/fake_cuda_driver.c"], extra
    )
    lib = ctypes.CDLL(walk)
    return lib, ctypes.CDLL(fake), graphwalk.bind(lib)  # before any stand-in driver is set


def test_without_libcuda_the_walk_says_why(libs):
    _, _, bound = libs
    if not isinstance(bound, str):
        pytest.skip("this machine has libcuda: the compiled walk found the driver")
    assert bound == "libcuda.so.1 cannot be loaded"


@pytest.fixture
def walker(libs):
    lib, fake, _ = libs
    fns = (ctypes.c_void_p * lib.gs_walk_driver_slots())()
    fake.fake_table.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    assert fake.fake_table(fns) == len(fns)
    assert lib.gs_walk_set_driver(fns, len(fns)) == 0
    fake.fake_root.restype = ctypes.c_uint64
    fake.fake_fail_get_nodes(0)
    return functools.partial(
        graphwalk.GraphWalk(lib).walk, describe=lambda h, k: NAMES[(h, k)]
    ), fake


def test_the_compiled_walk_reads_every_kind_of_node(walker):
    walk, fake = walker
    nodes, stats = walk(fake.fake_root())
    f1 = struct.pack("<ifQ", 4096, 1.5, 0x7F0000001000)
    child = struct.pack("<ifQ", 7, -2.0, 0x7F0000004000)
    f2 = struct.pack("<QI4xQ", 0x7F0000005000, 0, 0x7F0000006000)  # a null parameter: zeros
    assert nodes == [
        KernelArgs(0, "f1(int, float, float*)", f1, [0, 4, 8], (40, 2, 1)),
        KernelArgs(1, "k1", bytes(3 * i + 1 for i in range(40)), [], (7, 0, 0)),
        CopyArgs(2, "memcpy", [("src", 0x7F0000002010), ("dst", 0x555500000000)]),
        KernelArgs(3, "f1(int, float, float*)", child, [0, 4, 8]),  # inside the child graph
        CopyArgs(4, "memcpy", [("dst", 0x7F0000007008)]),  # an array source has no address
        CopyArgs(5, "memset", [("dst", 0x7F0000003000)]),
        KernelArgs(6, "f2(float*, int, float*)", f2, [0, 8, 16]),
        KernelArgs(7, "f1(int, float, float*)", b"", []),
        AllocArgs(8, 0x7F0000008000, 4096),  # memory the graph owns (cudaMallocAsync)
    ]
    # 13 nodes: the empty node and the child graph node count, two kernels are unreadable
    assert stats == WalkStats(nodes=13, kernels=7, copies=3, unreadable=2, child_graphs=1)


def test_a_failed_driver_call_is_one_error_and_the_next_walk_works(walker):
    walk, fake = walker
    fake.fake_fail_get_nodes(1)
    with pytest.raises(graphwalk.WalkError, match="^cuGraphGetNodes failed$"):
        walk(fake.fake_root())
    fake.fake_fail_get_nodes(0)
    assert len(walk(fake.fake_root())[0]) == 9


def test_a_record_the_parser_does_not_know_is_an_error():
    raw = graphwalk.HEAD.pack(99, 0, 0)
    with pytest.raises(graphwalk.WalkError, match="unknown node record 99"):
        graphwalk.parse(raw, lambda h, k: ("x", ()))
