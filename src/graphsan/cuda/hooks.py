"""Hooks on `torch.cuda.CUDAGraph`: every capture, replay, reset and deletion in the process.

`torch.cuda.graph(...)`, `torch.cuda.make_graphed_callables`, torch.compile's CUDA graph trees,
Transformer Engine and Megatron all capture through this class, so wrapping its methods sees
graphs captured by code we do not control. The wrappers only route calls to a `Listener`; they
never change what the original methods do. When nothing is pending, the replay wrapper costs two
attribute checks, and for a graph that carved memory in a shared pool a clock tick and a stamp
per range it writes that another graph reads (the pool's replay order, `graphsan.core.order`).
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from graphsan.core.patches import Patches

_ATTR = "_graphsan_state"


class Listener(Protocol):
    def before_capture_begin(self, graph: torch.cuda.CUDAGraph) -> None: ...
    def capture_begin(self, graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None) -> None: ...
    def before_capture_end(self, graph: torch.cuda.CUDAGraph) -> object: ...
    def after_capture_end(self, graph: torch.cuda.CUDAGraph, walked: object) -> None: ...
    def capture_failed(self, graph: torch.cuda.CUDAGraph) -> None: ...
    def before_replay(self, graph: torch.cuda.CUDAGraph, state: object) -> None: ...
    def reset(self, graph: torch.cuda.CUDAGraph) -> None: ...


def graph_state(graph: torch.cuda.CUDAGraph):
    return graph.__dict__.get(_ATTR)


def set_graph_state(graph: torch.cuda.CUDAGraph, state) -> None:
    graph.__dict__[_ATTR] = state


class GraphHooks:
    """Installs and removes the wrappers on `torch.cuda.CUDAGraph`."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self._patches = Patches()

    @property
    def installed(self) -> bool:
        return bool(self._patches)

    def install(self) -> None:
        if self.installed:
            return
        cls = torch.cuda.CUDAGraph
        listener = self.listener
        names = ("capture_begin", "capture_end", "replay", "reset")
        orig = {name: cls.__dict__[name] for name in names}

        @functools.wraps(orig["capture_begin"])
        def capture_begin(self, *args, **kwargs):
            listener.before_capture_begin(self)  # the stream is not capturing yet
            result = orig["capture_begin"](self, *args, **kwargs)
            pool = args[0] if args else kwargs.get("pool")  # None: a fresh pool of its own
            listener.capture_begin(self, pool)
            return result

        @functools.wraps(orig["capture_end"])
        def capture_end(self, *args, **kwargs):
            walked = listener.before_capture_end(self)
            try:
                result = orig["capture_end"](self, *args, **kwargs)
            except BaseException:
                listener.capture_failed(self)
                raise
            listener.after_capture_end(self, walked)
            return result

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

        for name, fn in (
            ("capture_begin", capture_begin),
            ("capture_end", capture_end),
            ("replay", replay),
            ("reset", reset),
        ):
            self._patches.set(cls, name, fn)

    def uninstall(self) -> None:
        self._patches.restore()
