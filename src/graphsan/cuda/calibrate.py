"""The startup probe of PyTorch's argument-struct layouts (`graphsan.core.calibration` solves
them): a handful of launches whose contents are known, each captured into a private graph of
its own on a side stream, walked, and thrown away. It runs once per device, before the first
capture there begins, in well under a second.

The probe's graphs bypass graphsan's hooks (they are captured through the base class) and
capture in thread-local mode; everything it allocates lives in one private pool, given back to
the driver before the user's capture starts. Its eager tensors reach that pool through a route
of the thread's allocations, which is paused while a graph captures into the pool: the
allocator refuses a capture into a pool that is already being allocated to. Its graphs all
live until the probe ends: the pinned host allocator counts a graph pool's uses apart, and a
pool whose graphs were all reset cannot be captured into again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from graphsan.core.argstructs import Layouts
from graphsan.core.calibration import Probe, solve
from graphsan.core.records import KernelArgs, PoolId

Walk = Callable[[int], list]  # a capturing stream's handle -> its graph's nodes so far
CHUNK = 65536  # elements per multi_tensor_apply block in every release so far (checked)


def calibrate(
    walk: Walk, release: Callable[[PoolId], str | None]
) -> tuple[Layouts, float, str | None]:
    """The confirmed layouts on the current device, the seconds the probe took, and why its
    memory could not be given back (None: it was). Never raises: whatever fails leaves its
    family unconfirmed, with the reason.

    Everything the probe allocates, its eager tensors as well as its graphs' memory, goes to
    one private pool, which `release` gives back to the driver once the probe is done: the
    program's snapshots, pools and `memory_reserved()` show nothing of it."""
    t0 = time.perf_counter()
    probes: list[Probe] = []
    failed: dict[str, str] = {}
    route = Route(torch.cuda.current_device())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    route.open()
    try:
        with torch.cuda.stream(side):
            for family, launch in _LAUNCHES:
                if route.broken is not None:  # a capture that cannot begin may leak: stop here
                    failed.setdefault(family, route.broken)
                    continue
                try:
                    probes += launch(walk, route)
                except Exception as err:  # a probe that cannot run leaves its family unconfirmed
                    why = route.broken or f"the probe failed: {type(err).__name__}: {err}"
                    failed.setdefault(family, why[:200])
            side.synchronize()
    finally:
        route.close()
    kept = release(route.pool)  # every tensor and graph of the probe is gone: the pool is unused
    if route.broken is not None and kept is None:
        kept = route.broken  # the failed capture's use of the pool was never given back
    return solve(probes, torch.__version__, failed), time.perf_counter() - t0, kept


_STRANDED: list = []  # probe pools something still used when the probe ended (kept alive)


def _uses(pool) -> int | None:
    """A MemPool's use count, None where torch cannot say (its pool is then kept)."""
    try:
        return int(pool.use_count())
    except (AttributeError, TypeError, RuntimeError):
        return None


class Route:
    """This thread's allocations routed to the probe's private pool, as `torch.cuda.use_mem_pool`
    does it, through torch's own calls: graphsan's wrappers of them are passed by (they would
    count the probe's tensors as the program's).

    The pool is a `torch.cuda.MemPool` where torch has one: dropped at `close`, once nothing
    uses it, it empties itself, that pool alone, with or without graphsan's compiled library
    (where torch has none, a graph pool handle, which only that library can empty). The route
    holds one use of the pool, so the pool lives from `open` to `close`; `paused` lets a graph
    capture into the pool meanwhile (the allocator refuses a capture into a pool that is being
    allocated to) and keeps the use counts even. The probe's graphs are `kept` until `close`:
    each holds the pool's use in the pinned host allocator, which refuses a capture into a pool
    whose graphs were all reset."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._owner = None
        with contextlib.suppress(AttributeError, TypeError, RuntimeError):
            self._owner = torch.cuda.MemPool()
        handle = self._owner.id if self._owner is not None else torch.cuda.graph_pool_handle()
        self.pool: PoolId = tuple(int(x) for x in handle)
        self.broken: str | None = None  # why a capture could not begin (the probe stops)
        self.kept: list = []  # the probe's graphs, reset at `close`
        begin = torch._C._cuda_beginAllocateCurrentThreadToPool
        end = torch._C._cuda_endAllocateToPool
        self._begin, self._end = (getattr(fn, "__wrapped__", fn) for fn in (begin, end))

    def open(self) -> None:
        self._begin(self.device, self.pool)  # a use of the pool, and the thread's route to it

    def close(self) -> None:
        while self.kept:  # no name keeps the last graph: the generator's graph-safe state,
            self.kept.pop().reset()  # in this pool, goes with it
        self._end(self.device, self.pool)
        torch._C._cuda_releasePool(self.device, self.pool)  # the route's own use of the pool
        owner, self._owner = self._owner, None
        if owner is not None and _uses(owner) != 1:
            # something still uses the pool (a capture that failed to begin took a use): some
            # torch releases assert, in the MemPool's destructor, that its own use is the last
            _STRANDED.append(owner)
        # else the MemPool's own use goes with it, and the pool's segments

    @contextlib.contextmanager
    def paused(self):
        """The route stopped (the pool kept alive by its use) while the body runs."""
        self._end(self.device, self.pool)
        try:
            yield
        finally:
            self._begin(self.device, self.pool)
            torch._C._cuda_releasePool(self.device, self.pool)  # begin took a second use


def _captured(walk: Walk, route: Route, fn: Callable[[], object], known: Callable[[object], dict]):
    """Run `fn` once eagerly (kernels load outside the capture), then capture it into a graph
    of the probe's pool and walk that graph before the capture ends; (kernel nodes,
    `known(output)`). The output is dropped; the graph is kept by the route until the probe
    ends."""
    fn()
    graph = torch._C._CUDAGraph()
    # the generator's graph-safe seed and offset, made for the first graph that registers it,
    # land in the probe's pool while the route is open (and go with the probe's last graph)
    register = getattr(graph, "register_generator_state", None)
    if register is not None:
        register(torch.cuda.default_generators[route.device])
    stream = torch.cuda.current_stream()
    route.kept.append(graph)  # also a capture that fails to end holds uses of the pool
    with route.paused():
        try:
            graph.capture_begin(route.pool, "thread_local")  # other threads may run on
        except Exception as err:
            route.broken = (
                f"the probe stopped: a capture could not begin ({type(err).__name__}: {err})"[:200]
            )
            raise
        try:
            out = fn()
            nodes = walk(stream.cuda_stream)
        finally:
            graph.capture_end()
    what = known(out)
    del out
    return [n for n in nodes if isinstance(n, KernelArgs) and n.buffer], what


def _filled(*shape: int) -> torch.Tensor:
    """Probe data without random numbers: drawing them would move the program's CUDA
    generator, and graphsan must not change what a program computes."""
    return torch.linspace(
        -1.0, 1.0, steps=max(1, int(torch.Size(shape).numel())), device="cuda"
    ).view(shape)


def _named(nodes: list[KernelArgs], part: str) -> list[KernelArgs]:
    return [n for n in nodes if part in n.name]


def _ptrs(tensors) -> list[int]:
    return [t.data_ptr() for t in tensors]


# sizes that give each tensor 3, 2, 1 and 4 blocks: a block table no stale bytes imitate
_SIZES = (2 * CHUNK + 5, CHUNK + 1001, 3, 3 * CHUNK + 77)


def _mta(walk: Walk, route: Route) -> list[Probe]:
    lists = [[_filled(n) for n in _SIZES] for _ in range(4)]
    a, b, c, d = lists
    steps = [torch.zeros((), device="cuda") for _ in _SIZES]
    scalars = [0.5, 1.5, 2.5, 3.5]
    numel = list(_SIZES)
    probes = []
    nodes, _ = _captured(walk, route, lambda: torch._foreach_add_(a, b), lambda out: {})
    probes += [
        Probe(
            "multi_tensor_apply", n, {"lists": [_ptrs(a), _ptrs(b)], "numel": numel, "chunk": CHUNK}
        )
        for n in _named(nodes, "TensorListMetadata<2")
    ]
    nodes, _ = _captured(walk, route, lambda: torch._foreach_mul_(a, scalars), lambda out: {})
    probes += [
        Probe(
            "multi_tensor_apply",
            n,
            {"lists": [_ptrs(a)], "numel": numel, "chunk": CHUNK, "scalars": scalars},
        )
        for n in _named(nodes, "TensorListScalarListMetadata<float, 1")
    ]
    lr = torch.tensor(1e-3, device="cuda")

    def adam():
        torch._fused_adam_(
            a,
            b,
            c,
            d,
            [],
            steps,
            lr=lr,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.0,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )

    nodes, _ = _captured(walk, route, adam, lambda out: {})
    probes += [
        Probe(
            "multi_tensor_apply",
            n,
            {
                "lists": [_ptrs(t) for t in lists],
                "numel": numel,
                "chunk": CHUNK,
                "steps": _ptrs(steps),
            },
        )
        for n in _named(nodes, "FusedOptimizerTensorListMetadata<4")
    ]
    return probes


def _closure(walk: Walk, route: Route) -> list[Probe]:
    x = _filled(64, 258)  # rows of 258: its stepped views keep two dims
    line = _filled(4096)
    a, b = x[:, :256:2], x[:, 1:257:2]
    probes = []
    for dims, fn, inputs in (
        (2, lambda: a * 2.0, [a]),
        (1, lambda: line[::4] * 3.0, [line]),  # one dimension, divisor 1024
        (2, lambda: torch.addcmul(a, b, a), [a, b, a]),
    ):
        nodes, known = _captured(
            walk,
            route,
            fn,
            lambda out, inputs=inputs, dims=dims: {"data": _ptrs([out, *inputs]), "dims": dims},
        )
        probes += [Probe("closure", n, known) for n in _named(nodes, "elementwise_kernel<")]
    return probes


def _reduce(walk: Walk, route: Route) -> list[Probe]:
    red = _filled(256, 64)
    probes = []
    for fn in (lambda: red.t().sum(dim=1), lambda: red.t().max(dim=1)):
        nodes, known = _captured(
            walk,
            route,
            fn,
            lambda out: {
                "src": red.data_ptr(),
                "dst": _ptrs(out) if isinstance(out, tuple) else [out.data_ptr()],
            },
        )
        probes += [Probe("reduce", n, known) for n in _named(nodes, "reduce_kernel<")]
    return probes


def _cat(walk: Walk, route: Route) -> list[Probe]:
    parts = [_filled(3, 8) for _ in range(131)]  # a short last batch
    nodes, _ = _captured(walk, route, lambda: torch.cat(parts, dim=0), lambda out: {})
    return [Probe("cat", n, {"inputs": _ptrs(parts)}) for n in _named(nodes, "CatArrayBatchedCopy")]


def _pointer_list(walk: Walk, route: Route) -> list[Probe]:
    a = [_filled(n) for n in (7, 70000, 5)]
    nodes, known = _captured(
        walk, route, lambda: torch._foreach_norm(a), lambda out: {"addresses": _ptrs(out)}
    )
    return [Probe("pointer_list", n, known) for n in _named(nodes, "lpnorm_cleanup")]


def _tensor_info(walk: Walk, route: Route) -> list[Probe]:
    dst = torch.zeros(50, 8, device="cuda")
    idx = torch.arange(0, 40, 2, device="cuda")
    src = _filled(20, 8)
    nodes, _ = _captured(walk, route, lambda: dst.index_add_(0, idx, src), lambda out: {})
    return [
        Probe("tensor_info", n, {"data": dst.data_ptr(), "dims_at_most": dst.dim()})
        for n in nodes
        if "TensorInfo" in n.name
    ]


_LAUNCHES = (
    ("multi_tensor_apply", _mta),
    ("closure", _closure),
    ("reduce", _reduce),
    ("cat", _cat),
    ("pointer_list", _pointer_list),
    ("tensor_info", _tensor_info),
)
