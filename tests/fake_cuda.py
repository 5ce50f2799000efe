"""The CUDA-facing pieces of the sanitizer replaced by fakes, for CPU tests of its flow: one graph
of one kernel whose argument points at the start of a one-segment default pool, and an allocator
view the test sets (`state["map"]`). A test may also set the nodes the next capture walks
(`state["nodes"]`), the allocations it made (`state["carves"]`), the device memory a pointer
table holds (`state["memory"]`), and use `graph_class` for a
`torch.cuda.CUDAGraph` whose methods the sanitizer's hooks can wrap."""

from __future__ import annotations

import types

import torch

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import KernelArgs, WalkStats
from graphsan.cuda import driver
from graphsan.cuda.allocator import AllocatorWatch

SEG = 0x7F00_0000_0000


def one_segment(blocks: list[tuple[int, str]], pool=(0, 0)) -> MemoryMap:
    """A segment of `pool` (default: the default pool) at SEG holding `blocks` ((size, state),
    in address order)."""
    return MemoryMap.from_snapshot(
        {
            "segments": [
                {
                    "address": SEG,
                    "total_size": sum(size for size, _ in blocks),
                    "segment_pool_id": pool,
                    "blocks": [
                        {
                            "address": SEG + sum(sz for sz, _ in blocks[:i]),
                            "size": size,
                            "state": st,
                        }
                        for i, (size, st) in enumerate(blocks)
                    ],
                }
            ]
        }
    )


def install(monkeypatch, kernel: str, stream: int) -> dict:
    """Fake the driver, the allocator view and the current device and stream; returns the state
    whose "map" the view answers with."""
    state = {"map": one_segment([(4096, "active_allocated"), (4096, "inactive")])}
    buf = SEG.to_bytes(8, "little") + (0).to_bytes(8, "little")
    monkeypatch.setattr(driver, "capturing_graph", lambda stream: "graph")
    state["nodes"] = [KernelArgs(0, kernel, buf, [0, 8])]
    state["carves"] = []
    monkeypatch.setattr(
        driver, "walk", lambda g: (state["nodes"], WalkStats(len(state["nodes"]), 1))
    )
    monkeypatch.setattr(
        AllocatorWatch, "capture_ended", lambda self, tag, pool: list(state["carves"])
    )
    # device memory the sanitizer reads (pointer tables): block address -> bytes, zeros elsewhere
    state["memory"] = {}
    monkeypatch.setattr(
        driver,
        "read_device",
        lambda spans, stream: [state["memory"].get(a, bytes(n))[:n] for a, n in spans],
    )
    monkeypatch.setattr(driver, "is_mapped", lambda ptr: True)
    monkeypatch.setattr(driver, "is_host", lambda ptr: False)
    monkeypatch.setattr(driver, "address_range", lambda ptr: None)
    monkeypatch.setattr(AllocatorWatch, "view", lambda self, device, sync=True, **kw: state["map"])
    monkeypatch.setattr(AllocatorWatch, "sync", lambda self: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=stream)
    )
    return state


def kernel(index: int, *addresses: int) -> KernelArgs:
    """A kernel node whose parameters are `addresses`, one 8-byte pointer each."""
    buf = b"".join(a.to_bytes(8, "little") for a in addresses)
    return KernelArgs(index, f"void k{index}(float*)", buf, [8 * i for i in range(len(addresses))])


def graph_class(monkeypatch, pool=(1, 3), seams: bool = False) -> type:
    """A stand-in for `torch.cuda.CUDAGraph` (CPU torch cannot make one) with the four methods
    the hooks wrap; `launched` counts the replays that really ran. With `seams`, torch's own
    graph hooks as PyTorch's main branch has them (no installable torch does yet): global
    capture-end, replay-start and replay-end hooks in `torch.cuda.graphs` (a capture-end hook
    sees the graph still live through `raw_cuda_graph()`; a replay-start hook that raises aborts
    the launch, and no end hook runs), and `retain_object`, which holds an object until the
    graph's `reset` (`retained` lists (object, synchronize_before_release))."""
    hooks: dict[str, dict] = {"capture_end": {}, "replay_start": {}, "replay_end": {}}

    class Handle:
        def __init__(self, table: dict, key: object):
            self.table, self.key = table, key

        def remove(self):
            self.table.pop(self.key, None)

    def register(kind):
        def add(fn):
            key = object()
            hooks[kind][key] = fn
            return Handle(hooks[kind], key)

        return add

    def __init__(self):
        self.launched = 0
        self.live = False  # the captured graph's template, readable in a capture-end hook
        self.retained: dict = {}

    def capture_end(self):
        self.live = True
        for fn in list(hooks["capture_end"].values()):
            fn(self)
        self.live = False

    def raw_cuda_graph(self):
        assert self.live, "the template is gone outside a capture-end hook"
        return "graph"

    def replay(self):
        for fn in list(hooks["replay_start"].values()):
            fn(self)
        self.launched += 1
        for fn in list(hooks["replay_end"].values()):
            fn(self)

    def retain_object(self, obj, *, synchronize_before_release=False):
        key = object()
        self.retained[key] = (obj, synchronize_before_release)
        return Handle(self.retained, key)

    methods = {
        "__init__": __init__,
        "capture_begin": lambda self, pool=None: None,
        "capture_end": capture_end if seams else (lambda self: None),
        "replay": replay if seams else (lambda self: setattr(self, "launched", self.launched + 1)),
        "reset": lambda self: self.retained.clear(),
        "pool": lambda self: pool,
    }
    if seams:
        methods.update(raw_cuda_graph=raw_cuda_graph, retain_object=retain_object)
        for kind in hooks:
            name = f"register_graph_{kind}_hook"
            monkeypatch.setattr(torch.cuda.graphs, name, register(kind), raising=False)
    cls = type("FakeCUDAGraph", (), methods)
    cls.hooks = hooks
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cls)
    return cls
