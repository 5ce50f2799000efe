"""Hooks on `torch.cuda.CUDAGraph`: every capture, replay, reset and deletion in the process.

`torch.cuda.graph(...)`, `torch.cuda.make_graphed_callables`, torch.compile's CUDA graph trees,
Transformer Engine and Megatron all capture through this class, so hooking it sees graphs
captured by code we do not control. The hooks only route calls to a `Listener`; they never change
what the original methods do.

graphsan attaches in one of two ways (`Seams.detect`; `GRAPHSAN_ATTACH=wrap` forces the second):
- **torch's hooks**, where the installed torch has per-graph replay hooks and an exception raised
  in a replay-start hook is confirmed to reach `replay()`'s caller before the launch (torch 2.14
  onwards). The module-level capture-end hook hands over each captured graph while its template
  is live, for the walk; each watched graph then gets its own replay-start hook (the judgement:
  raising aborts the launch), replay-end hook (the pool order's stamp) and destroy callback (the
  graph is forgotten on reset or collection). torch's module-level replay hooks are never used
  for the judgement: torch swallows whatever they raise, so they cannot stop a replay.
- **wrapping** `capture_end`, `replay` and `reset` elsewhere, with a finalizer per graph.
`capture_begin` is wrapped either way: the start-up probe must run before the capture is live,
and torch's capture-start hooks run inside it. `retain_object`, where torch has it, holds what
`pin` pins until the graph is gone, after its replays in flight.

When nothing is pending, a replay costs two attribute checks, and for a graph that carved memory
in a shared pool a clock tick and a stamp per range it writes that another graph reads (the
pool's replay order, `graphsan.core.pool_order`).
"""

from __future__ import annotations

import functools
import os
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from graphsan.core.patches import Patches
from graphsan.cuda.owners import no_collection

_SIDE = "_graphsan"  # the one attribute graphsan sets on a program's graph: its `GraphSide`


class Listener(Protocol):
    def before_capture_begin(self, graph: torch.cuda.CUDAGraph) -> object: ...
    def capture_begin(
        self, graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None, early: object = None
    ) -> int | None: ...
    def before_capture_end(self, graph: torch.cuda.CUDAGraph, handle: int | None) -> object: ...
    def after_capture_end(self, graph: torch.cuda.CUDAGraph, walked: object) -> None: ...
    def capture_failed(self, graph: torch.cuda.CUDAGraph) -> None: ...
    def before_replay(self, graph: torch.cuda.CUDAGraph, state: object) -> None: ...
    def reset(self, graph: torch.cuda.CUDAGraph) -> None: ...
    def graph_gone(self, gid: int) -> None: ...


@dataclass(eq=False)
class GraphSide:
    """What graphsan keeps on one of the program's graphs, under one attribute of it."""

    state: object | None = None  # the watched graph (`core.graph_state.GraphState`)
    pending: object | None = None  # its capture in progress (`runtime.capture.PendingCapture`)
    walked: object | None = None  # what the capture-end hook read, until capture_end returns
    replay_hooks: tuple = ()  # the handles of the graph's own replay hooks (torch's hooks)


def side(graph: torch.cuda.CUDAGraph, make: bool = False) -> GraphSide | None:
    """graphsan's side object of `graph`: None where graphsan keeps nothing on it (and
    `make` is off), or where the graph has no attributes of its own (a base-class graph)."""
    own = getattr(graph, "__dict__", None)
    if own is None:
        return None
    found = own.get(_SIDE)
    if found is None and make:
        found = own[_SIDE] = GraphSide()
    return found


def graph_state(graph: torch.cuda.CUDAGraph):
    """The watched graph of `graph`'s last capture, or None."""
    found = side(graph)
    return found.state if found is not None else None


def set_graph_state(graph: torch.cuda.CUDAGraph, state) -> None:
    side(graph, make=True).state = state


@dataclass(frozen=True)
class Seams:
    """What graphsan takes from the installed torch: `capture_end`, the module-level
    capture-end hook's registrar, with `hooks` (per-graph replay hooks confirmed to stop a
    replay, and destroy callbacks) or neither; and `retain_object`."""

    capture_end: Callable | None = None
    hooks: bool = False
    retain_object: bool = False

    @classmethod
    def detect(cls, attach: str | None = None) -> Seams:
        """`attach`: "wrap" takes none of torch's hooks; "auto" (the default, from
        GRAPHSAN_ATTACH) takes them where they are all there and a raising replay-start hook
        is seen to stop a replay."""
        if attach is None:
            attach = os.environ.get("GRAPHSAN_ATTACH", "").strip().lower() or "auto"
        graph_cls = torch.cuda.CUDAGraph
        retain = callable(getattr(graph_cls, "retain_object", None))
        graphs = getattr(torch.cuda, "graphs", None)
        capture_end = getattr(graphs, "register_graph_capture_end_hook", None)
        usable = (
            attach != "wrap"
            and callable(capture_end)
            and callable(getattr(graph_cls, "register_destroy_callback", None))
            and callable(getattr(graph_cls, "register_replay_end_hook", None))
            and start_hook_stops_replay(graph_cls, graphs)
        )
        if not usable:
            return cls(retain_object=retain)
        return cls(capture_end=capture_end, hooks=True, retain_object=retain)

    def names(self) -> list[str]:
        """The hooks in use, as the report names them."""
        names = ["capture-end hook", "per-graph replay hooks"] if self.hooks else []
        return names + (["retain_object"] if self.retain_object else [])


class _Stop(Exception):
    """Raised by the probe's replay-start hook."""


def start_hook_stops_replay(graph_cls: type, graphs: object) -> bool:
    """Whether an exception raised in a per-graph replay-start hook reaches the caller of
    `graph_cls.replay` before the launch. Tried on a stand-in graph holding what torch's
    `replay()` reads before it launches, so no GPU is needed: were the exception swallowed,
    the replay would go on to the launch, which fails on the stand-in. Any other outcome (no
    such hook, an error of the stand-in, a swallowed exception) is no. Not tried, and no, while
    another consumer has module-level replay-start hooks: they would see the stand-in."""
    register = getattr(graph_cls, "register_replay_start_hook", None)
    if not callable(register) or getattr(graphs, "_global_replay_start_hooks", None):
        return False
    stand_in = types.SimpleNamespace(
        _tracker=None,
        _retained=types.SimpleNamespace(sync_before_fire=False, replay_streams=set()),
        _has_graph_exec=True,
        _replay_start_hooks=OrderedDict(),
        _replay_end_hooks=OrderedDict(),
    )

    def stop(graph):
        raise _Stop

    try:
        register(stand_in, stop)
        graph_cls.replay(stand_in)
    except _Stop:
        return True
    except Exception:
        return False
    return False


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


def _count_in_order(state) -> None:
    """A replay that went ahead wrote what its graph carved in its pool."""
    if state.order is not None:
        state.order.replayed(state.info.id)


class GraphHooks:
    """Installs and removes graphsan's hooks on `torch.cuda.CUDAGraph` (see the module)."""

    def __init__(
        self,
        listener: Listener,
        needs: Callable[[object], bool],
        seams: Seams | None = None,
        replayed: Callable[[object], None] | None = None,
    ) -> None:
        self.listener = listener
        self.needs = needs  # whether a replay of the graph is judged (core.judgement)
        # a watched graph's replay was launched (the pool's order and the stream's replays
        # in flight count it: core.judgement)
        self.replayed = replayed if replayed is not None else _count_in_order
        self.seams = seams if seams is not None else Seams.detect()
        self._patches = Patches()
        self._handles: list = []
        self._hooked: weakref.WeakSet = weakref.WeakSet()  # graphs holding replay hooks of ours

    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def install(self) -> None:
        if self.installed:
            return
        cls = torch.cuda.CUDAGraph
        listener, seams, needs, replayed = self.listener, self.seams, self.needs, self.replayed
        names = ("capture_begin", "capture_end") + (() if seams.hooks else ("replay", "reset"))
        orig = {name: cls.__dict__[name] for name in names}

        @functools.wraps(orig["capture_begin"])
        def capture_begin(graph, *args, **kwargs):
            early = listener.before_capture_begin(graph)  # the stream is not capturing yet
            result = orig["capture_begin"](graph, *args, **kwargs)
            pool = args[0] if args else kwargs.get("pool")  # None: a fresh pool of its own
            with no_collection():
                gid = listener.capture_begin(graph, pool, early)
            if gid is not None:
                self._follow(graph, gid)
            return result

        def on_capture_end(graph):  # torch's hook: the capture ended, its graph is still live
            found = side(graph)  # None: a graph graphsan did not see begin (the probe's)
            if found is None:
                return
            try:
                handle = graph.raw_cuda_graph()
            except Exception:  # never break the user's capture: no walk, no watched graph
                return
            found.walked = listener.before_capture_end(graph, handle)

        @functools.wraps(orig["capture_end"])
        def capture_end(graph, *args, **kwargs):
            found = side(graph, make=True)
            with no_collection():  # the walk's objects stay until the capture has ended
                if seams.capture_end is None:  # read the graph still being captured
                    found.walked = listener.before_capture_end(graph, None)
                try:
                    result = orig["capture_end"](graph, *args, **kwargs)
                except BaseException:
                    found.walked = None
                    listener.capture_failed(graph)
                    raise
            walked, found.walked = found.walked, None
            listener.after_capture_end(graph, walked)
            if seams.hooks and found.state is not None:
                self._hook_replays(graph, found)
            return result

        wrapped = [("capture_begin", capture_begin), ("capture_end", capture_end)]
        if not seams.hooks:

            @functools.wraps(orig["replay"])
            def replay(graph, *args, **kwargs):
                found = graph.__dict__.get(_SIDE)
                state = found.state if found is not None else None
                if state is None:
                    return orig["replay"](graph, *args, **kwargs)
                if needs(state):
                    listener.before_replay(graph, state)
                result = orig["replay"](graph, *args, **kwargs)
                replayed(state)  # it went ahead
                return result

            @functools.wraps(orig["reset"])
            def reset(graph, *args, **kwargs):
                listener.reset(graph)
                return orig["reset"](graph, *args, **kwargs)

            wrapped += [("replay", replay), ("reset", reset)]
        for name, fn in wrapped:
            self._patches.set(cls, name, fn)
        if seams.capture_end is not None:
            self._handles.append(seams.capture_end(on_capture_end))

    def _follow(self, graph, gid: int) -> None:
        """Tell the listener when the graph captured as `gid` is gone: reset or collected."""
        gone = functools.partial(self.listener.graph_gone, gid)
        if self.seams.hooks:
            graph.register_destroy_callback(gone)  # fires on reset too
        else:
            weakref.finalize(graph, gone)

    def _hook_replays(self, graph, found: GraphSide) -> None:
        """The graph's own replay hooks (once per graph object: a re-capture keeps them)."""
        if found.replay_hooks:
            return
        listener, needs, replayed = self.listener, self.needs, self.replayed

        def on_replay_start(g):  # torch lets what this raises through: the launch is aborted
            state = g.__dict__[_SIDE].state
            if state is not None and needs(state):
                listener.before_replay(g, state)

        def on_replay_end(g):  # torch runs this once the replay was launched
            state = g.__dict__[_SIDE].state
            if state is not None:
                replayed(state)

        found.replay_hooks = (
            graph.register_replay_start_hook(on_replay_start),
            graph.register_replay_end_hook(on_replay_end),
        )
        self._hooked.add(graph)

    def uninstall(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        for graph in list(self._hooked):
            found = side(graph)
            for handle in found.replay_hooks if found is not None else ():
                handle.remove()
            if found is not None:
                found.replay_hooks = ()
        self._hooked = weakref.WeakSet()
        self._patches.restore()
