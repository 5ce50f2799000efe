"""The CUDA-facing pieces of the sanitizer replaced by fakes, for CPU tests of its flow: one graph
of one kernel whose argument points at the start of a one-segment default pool, and an allocator
view the test sets (`state["map"]`), which the sanitizer's memory watch answers with (`FakeWatch`,
injected by `started`, or by the `fake_sanitizer` fixture of tests/conftest.py). A test may also set the nodes the next capture walks
(`state["nodes"]`), the allocations it made (`state["carves"]`), the device memory a pointer
table holds (`state["memory"]`), and use `graph_class` for a
`torch.cuda.CUDAGraph` as torch 2.11 or torch 2.14.1 has it."""

from __future__ import annotations

import contextlib
import types

import torch

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import KernelArgs, WalkStats
from graphsan.cuda import driver, streams
from graphsan.cuda.allocator import AllocatorWatch
from graphsan.runtime.sanitizer import Sanitizer
from tests import torch_hooks

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
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=stream)
    )
    # the stream replays launch on, as the race check names it, and whether it has work
    state["stream"] = (0, stream)
    state["busy"] = set()
    monkeypatch.setattr(streams, "current_stream_key", lambda: state["stream"])
    monkeypatch.setattr(streams, "busy", lambda key: key in state["busy"])
    return state


class FakeWatch(AllocatorWatch):
    """The allocator watch with the allocator's answers a test sets in `state` (see `install`):
    the view is `state["map"]`, and a capture's carves are `state["carves"]`."""

    def __init__(self, state: dict, *args) -> None:
        super().__init__(*args)
        self.state = state

    def view(self, device: int, sync: bool = True, own=(), own_pool=None):
        return self.state["map"]

    def sync(self) -> None:
        pass

    def capture_ended(self, tag: str, pool) -> list:
        self.capture_pool = None
        return list(self.state["carves"])


def answer_from(state: dict, watch: AllocatorWatch, monkeypatch) -> None:
    """A memory watch made elsewhere (by the pytest plugin's sanitizer) answers as a
    `FakeWatch` does, for the test's time."""
    for name in ("view", "sync", "capture_ended"):
        fake = getattr(FakeWatch, name).__get__(watch)
        monkeypatch.setattr(watch, name, fake)
    monkeypatch.setattr(watch, "state", state, raising=False)


def started(state: dict, policy: str = "raise", hooks: bool = True) -> Sanitizer:
    """A sanitizer over the fakes of `install` (its memory watch a `FakeWatch`), marked active
    as `start()` would (which needs CUDA), its graph hooks installed unless `hooks` is off."""
    san = Sanitizer(policy, memory=lambda *parts: FakeWatch(state, *parts))
    san.active = True
    if hooks:
        san.hooks.install()
    return san


def kernel(index: int, *addresses: int) -> KernelArgs:
    """A kernel node whose parameters are `addresses`, one 8-byte pointer each."""
    buf = b"".join(a.to_bytes(8, "little") for a in addresses)
    return KernelArgs(index, f"void k{index}(float*)", buf, [8 * i for i in range(len(addresses))])


ATTACHMENTS = ("wrapped", "torch hooks")


def captured(state: dict):
    """A graph of `state["cls"]` (a `graph_class`), captured once."""
    g = state["cls"]()
    g.capture_begin()
    g.capture_end()
    return g


def graph_class(monkeypatch, pool=(1, 3), attach: str = "wrapped") -> type:
    """A stand-in for `torch.cuda.CUDAGraph` (CPU torch cannot make one); `launched` counts the
    replays that really ran. `attach` picks the torch it stands for:
    - "wrapped": a torch without graph hooks (torch 2.11, the GPU machine's), whose methods
      graphsan wraps;
    - "torch hooks": torch 2.14.1's hooks (tests/torch_hooks.py): module-level hooks that
      swallow what they raise, per-graph hooks that let it through (a raising replay-start hook
      aborts the launch), `register_destroy_callback` and `retain_object` (`retained(g)` lists
      (object, synchronize_before_release) while the graph holds them)."""
    if attach not in ATTACHMENTS:
        raise ValueError(f"attach={attach!r}: expected one of {ATTACHMENTS}")

    def __init__(self, keep_graph=False):  # what torch 2.11's pybind base does with keep_graph
        self.launched = 0
        self.keep_graph = keep_graph
        self.template = False  # the captured cudaGraph_t, until reset or instantiation drops it

    def capture_end(self):
        self.template = True

    def instantiate(self):
        if not self.keep_graph:
            self.template = False

    def raw_cuda_graph(self):
        assert self.keep_graph and self.template, "no template: keep_graph=False or no capture"
        return "graph"

    def replay(self):
        self.launched += 1

    methods = {
        "__init__": __init__,
        "capture_begin": lambda self, pool=None, capture_error_mode="global": None,
        "capture_end": capture_end,
        "instantiate": instantiate,
        "replay": replay,
        "reset": lambda self: setattr(self, "template", False),
        "raw_cuda_graph": raw_cuda_graph,
        "pool": lambda self: pool,
    }
    cls = type("FakeCUDAGraph", (), methods)
    graphs = types.SimpleNamespace()  # torch.cuda.graphs as graphsan reads it: the hooks only
    monkeypatch.setattr(torch.cuda, "graphs", graphs)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cls)
    if attach == "torch hooks":
        stream = types.SimpleNamespace(synchronize=lambda: None)
        cls.model = torch_hooks.Model(graphs, cls, lambda: stream, __init__)
    return cls


def retained(graph) -> list[tuple[object, bool]]:
    """What torch 2.14's `retain_object` holds for `graph` now: (object, synchronize)."""
    holder = graph._retained
    return [(obj, holder.sync_before_fire) for obj in holder.objects.values()]


class FakeAllocator:
    """PyTorch's caching allocator as far as private pools go, refusing what it refuses:

    - `begin(device, pool)` (a thread's route, or a capture) takes a use of the pool (a new
      pool, or one still in use: reusing a pool nothing uses fails torch's internal assert),
      then refuses a pool that is already being allocated to ("already recording");
    - `end` refuses a pool that is not; `release` gives a use back;
    - every allocation is a segment of its own, in the pool allocated to last (else the
      default pool, (0, 0)), and `empty_cache(pool)` frees a private pool's segments only
      once nothing uses it and none of its blocks is alive;
    - a `MemPool` holds a use of its pool while it lives and empties the pool when dropped;
      dropped while anything else uses the pool, it aborts the process in some torch releases
      (`aborted` says so).

    `Graph` is `torch._C._CUDAGraph` over it: `capture_begin` registers the default generator
    (whose seed and offset holders, two blocks, are made for the first graph registered and
    freed with the last), enters the generator's capture, begins allocating to the pool, then
    takes a use of the same pool in the pinned host allocator, in that order, as torch 2.11
    does. The host allocator keeps a pool's use count apart (`host_uses`): a graph's reset gives
    its use back, and a pool whose last graph was reset cannot be captured into again (torch's
    internal assert). A capture that cannot begin leaves the generator capturing
    (`generator_capturing`) and, past the first step, the pool being allocated to."""

    def __init__(self) -> None:
        self.uses: dict[tuple, int] = {}
        self.host_uses: dict[tuple, int] = {}
        self.recording: list[tuple] = []
        self.segments: dict[tuple, int] = {}
        self.live: dict[tuple, int] = {}
        self.registered: set[int] = set()  # graphs registered with the default generator
        self.holders: list = []
        self.generator_capturing = False
        self.handles = 0
        self.aborted: str | None = None  # what would have aborted the process
        alloc = self

        class Tensor:
            def __init__(self) -> None:
                self.pool = alloc._allocate()

            def __del__(self) -> None:
                alloc.live[self.pool] -= 1

        class Graph:
            def __init__(self) -> None:
                self.pool, self.ended = None, False

            def register_generator_state(self, generator) -> None:
                alloc._register(self)

            def capture_begin(self, pool=None, capture_error_mode="global") -> None:
                alloc._register(self)
                alloc.generator_capturing = True
                pool = tuple(pool) if pool is not None else alloc.graph_pool_handle()
                alloc.begin(0, pool)
                alloc._use(alloc.host_uses, pool)
                self.pool = pool

            def capture_end(self) -> None:
                alloc.end(0, self.pool)
                alloc.generator_capturing = False
                self.ended = True

            def reset(self) -> None:
                if self.ended:
                    alloc.release(0, self.pool)
                    alloc.host_uses[self.pool] -= 1
                    self.ended = False

            def __del__(self) -> None:
                self.reset()
                alloc.registered.discard(id(self))
                if not alloc.registered:
                    alloc.holders.clear()

        class MemPool:
            """`torch.cuda.MemPool`: holds a use of its pool from birth; dropped, it gives the
            use back and empties its pool where nothing else uses it (torch's destructor)."""

            def __init__(self) -> None:
                self.id = alloc.graph_pool_handle()
                alloc._use(alloc.uses, self.id)

            def use_count(self) -> int:
                return alloc.uses.get(self.id, 0)

            def __del__(self) -> None:
                if self.use_count() != 1:  # torch's destructor asserts: the process aborts
                    alloc.aborted = f"MemPool {self.id} destroyed with {self.use_count()} uses"
                alloc.release(0, self.id)
                alloc.empty_cache(self.id)

        self.Tensor, self.Graph, self.MemPool = Tensor, Graph, MemPool

    def graph_pool_handle(self) -> tuple:
        self.handles += 1
        return (0, self.handles)

    def begin(self, device: int, pool) -> None:
        pool = tuple(pool)
        self._use(self.uses, pool)
        if pool in self.recording:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        self.recording.append(pool)

    def end(self, device: int, pool) -> None:
        if tuple(pool) not in self.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.recording.remove(tuple(pool))

    def release(self, device: int, pool) -> None:
        self.uses[tuple(pool)] -= 1
        assert self.uses[tuple(pool)] >= 0, "INTERNAL ASSERT FAILED: uc >= 0"

    def empty_cache(self, pool) -> str | None:
        """The pool's segments given back where nothing uses it; None, or why not."""
        pool = tuple(pool)
        if self.uses.get(pool, 0) or self.live.get(pool, 0):
            return f"{self.segments.get(pool, 0)} segment(s) stayed: the pool is in use"
        self.segments.pop(pool, None)
        self.uses.pop(pool, None)
        return None

    def pools_holding_segments(self) -> dict[tuple, int]:
        return {pool: n for pool, n in self.segments.items() if n}

    @staticmethod
    def _use(uses: dict, pool: tuple) -> None:
        """A new pool's first use, or one more of a pool still in use (torch's assert else)."""
        if pool in uses and uses[pool] <= 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        uses[pool] = uses.get(pool, 0) + 1

    def _allocate(self) -> tuple:
        pool = self.recording[-1] if self.recording else (0, 0)
        self.segments[pool] = self.segments.get(pool, 0) + 1
        self.live[pool] = self.live.get(pool, 0) + 1
        return pool

    def _register(self, graph) -> None:
        if not self.registered:
            self.holders = [self.Tensor(), self.Tensor()]
        self.registered.add(id(graph))


def install_allocator(monkeypatch) -> FakeAllocator:
    """`torch`'s device, streams, pool routing and graph class on a `FakeAllocator`."""
    alloc = FakeAllocator()
    stream = types.SimpleNamespace(
        cuda_stream=7, wait_stream=lambda other: None, synchronize=lambda: None
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", alloc.graph_pool_handle)
    monkeypatch.setattr(torch.cuda, "MemPool", alloc.MemPool)
    monkeypatch.setattr(torch.cuda, "default_generators", ("generator",), raising=False)
    for name, fn in (
        ("_cuda_beginAllocateCurrentThreadToPool", alloc.begin),
        ("_cuda_endAllocateToPool", alloc.end),
        ("_cuda_releasePool", alloc.release),
        ("_CUDAGraph", alloc.Graph),
    ):
        monkeypatch.setattr(torch._C, name, fn, raising=False)
    return alloc
