"""Hooks on `torch.cuda.CUDAGraph`: every capture, replay, reset and deletion in the process.

`torch.cuda.graph(...)`, `torch.cuda.make_graphed_callables`, torch.compile's CUDA graph trees,
Transformer Engine and Megatron all capture through this class, so hooking it sees graphs
captured by code we do not control. The hooks only route calls to a `Listener`; they never change
what the original methods do.

Where the installed torch has its own seams (`Seams.detect`: PyTorch's global graph hooks,
newer than the releases graphsan runs on today), graphsan uses them: the capture-end hook hands
over the captured graph while it is still live, for the walk; the replay-start hook judges
before launch (a start hook that raises aborts the replay), the replay-end hook stamps the pool's
order; `retain_object` holds what `pin` pins until the graph is gone, after its replays in
flight. Wrapping the class stays where torch has no hook that fits: `capture_begin` (the start-up
probe must run before the capture is live, and PyTorch's capture-start hook runs inside it),
`capture_end`'s failure (an invalidated capture runs no hook), `reset`, and every method on a
torch without the hooks. When nothing is pending, a replay costs two attribute checks, and for a
graph that carved memory in a shared pool a clock tick and a stamp per range it writes that
another graph reads (the pool's replay order, `graphsan.core.order`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from graphsan.core.patches import Patches

_ATTR = "_graphsan_state"


class Listener(Protocol):
    def before_capture_begin(self, graph: torch.cuda.CUDAGraph) -> None: ...
    def capture_begin(self, graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None) -> None: ...
    def before_capture_end(self, graph: torch.cuda.CUDAGraph, handle: int | None) -> object: ...
    def after_capture_end(self, graph: torch.cuda.CUDAGraph, walked: object) -> None: ...
    def capture_failed(self, graph: torch.cuda.CUDAGraph) -> None: ...
    def before_replay(self, graph: torch.cuda.CUDAGraph, state: object) -> None: ...
    def reset(self, graph: torch.cuda.CUDAGraph) -> None: ...


def graph_state(graph: torch.cuda.CUDAGraph):
    return graph.__dict__.get(_ATTR)


def set_graph_state(graph: torch.cuda.CUDAGraph, state) -> None:
    graph.__dict__[_ATTR] = state


@dataclass(frozen=True)
class Seams:
    """The graph hooks the installed torch offers (None where it has none): PyTorch's global
    capture-end, replay-start and replay-end hooks, and `CUDAGraph.retain_object`."""

    capture_end: Callable | None = None
    replay_start: Callable | None = None
    replay_end: Callable | None = None
    retain_object: bool = False

    @classmethod
    def detect(cls) -> Seams:
        graphs = getattr(torch.cuda, "graphs", None)
        start = getattr(graphs, "register_graph_replay_start_hook", None)
        end = getattr(graphs, "register_graph_replay_end_hook", None)
        return cls(
            capture_end=getattr(graphs, "register_graph_capture_end_hook", None),
            # the judgement needs both: the start aborts a stale replay, the end stamps the order
            replay_start=start if end is not None else None,
            replay_end=end if start is not None else None,
            retain_object=callable(getattr(torch.cuda.CUDAGraph, "retain_object", None)),
        )

    def names(self) -> list[str]:
        """The hooks in use, as the report names them."""
        used = [("capture-end hook", self.capture_end), ("replay hooks", self.replay_start)]
        names = [n for n, fn in used if fn is not None]
        return names + (["retain_object"] if self.retain_object else [])


def retainer(graph: torch.cuda.CUDAGraph, seams: Seams) -> Callable | None:
    """`hold(obj)` -> a handle whose `remove()` lets go early: `obj` stays alive until the graph
    is reset or destroyed, after its replays in flight finished; None without `retain_object`."""
    if not seams.retain_object:
        return None
    ref = weakref.ref(graph)  # a strong reference from the pinner would keep the graph alive

    def hold(obj):
        g = ref()
        return g.retain_object(obj, synchronize_before_release=True) if g is not None else None

    return hold


_WALKED = "_graphsan_walked"  # what the capture-end hook read, until capture_end returns


class GraphHooks:
    """Installs and removes graphsan's hooks on `torch.cuda.CUDAGraph` (see the module)."""

    def __init__(self, listener: Listener, seams: Seams | None = None) -> None:
        self.listener = listener
        self.seams = seams if seams is not None else Seams.detect()
        self._patches = Patches()
        self._handles: list = []

    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def install(self) -> None:
        if self.installed:
            return
        cls = torch.cuda.CUDAGraph
        listener, seams = self.listener, self.seams
        names = ("capture_begin", "capture_end", "replay", "reset")
        orig = {name: cls.__dict__[name] for name in names}

        @functools.wraps(orig["capture_begin"])
        def capture_begin(self, *args, **kwargs):
            listener.before_capture_begin(self)  # the stream is not capturing yet
            result = orig["capture_begin"](self, *args, **kwargs)
            pool = args[0] if args else kwargs.get("pool")  # None: a fresh pool of its own
            listener.capture_begin(self, pool)
            return result

        def on_capture_end(graph):  # torch's hook: the capture ended, its graph is still live
            own = getattr(graph, "__dict__", None)  # None: a base-class graph (the probe's)
            if own is None:
                return
            try:
                handle = graph.raw_cuda_graph()
            except Exception:  # never break the user's capture: no walk, no watched graph
                return
            own[_WALKED] = listener.before_capture_end(graph, handle)

        @functools.wraps(orig["capture_end"])
        def capture_end(self, *args, **kwargs):
            if seams.capture_end is None:  # read the graph still being captured, on its stream
                self.__dict__[_WALKED] = listener.before_capture_end(self, None)
            try:
                result = orig["capture_end"](self, *args, **kwargs)
            except BaseException:
                self.__dict__.pop(_WALKED, None)
                listener.capture_failed(self)
                raise
            listener.after_capture_end(self, self.__dict__.pop(_WALKED, None))
            return result

        def on_replay_start(graph):  # torch's hook: raising aborts the launch
            state = graph.__dict__.get(_ATTR)
            if state is not None and (
                state.dirty or (state.reads and not state.read_order.in_order(state.info.id))
            ):
                listener.before_replay(graph, state)

        def on_replay_end(graph):  # torch's hook: the replay was launched
            state = graph.__dict__.get(_ATTR)
            if state is not None and state.order is not None:
                state.order.replayed(state.info.id)

        @functools.wraps(orig["replay"])
        def replay(self, *args, **kwargs):
            state = self.__dict__.get(_ATTR)
            if state is None:
                return orig["replay"](self, *args, **kwargs)
            if state.dirty or (state.reads and not state.read_order.in_order(state.info.id)):
                listener.before_replay(self, state)
            result = orig["replay"](self, *args, **kwargs)
            if state.order is not None:  # it went ahead: it wrote what it carved in its pool
                state.order.replayed(state.info.id)
            return result

        @functools.wraps(orig["reset"])
        def reset(self, *args, **kwargs):
            listener.reset(self)
            return orig["reset"](self, *args, **kwargs)

        wrapped = [("capture_begin", capture_begin), ("capture_end", capture_end)]
        wrapped.append(("reset", reset))
        if seams.replay_start is None:
            wrapped.append(("replay", replay))
        for name, fn in wrapped:
            self._patches.set(cls, name, fn)
        if seams.capture_end is not None:
            self._handles.append(seams.capture_end(on_capture_end))
        if seams.replay_start is not None:
            self._handles.append(seams.replay_start(on_replay_start))
            self._handles.append(seams.replay_end(on_replay_end))

    def uninstall(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        self._patches.restore()
