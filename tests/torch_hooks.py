"""Test-only: torch 2.14.1's CUDA-graph hooks laid over a `CUDAGraph` class that has none.

Two places use it: tests/fake_cuda.py lays it over its CPU stand-in of a graph, so the CPU tests
run graphsan through the hooks as torch 2.14.1 calls them; and on the GPU machine, whose torch
(2.11) predates the hooks, tests/torch_hooks_site/sitecustomize.py lays it over the real
`torch.cuda.CUDAGraph` in every Python process of a test run (`GRAPHSAN_TEST_TORCH_HOOKS=1`), so
the GPU tests and `graphsan selftest` run through them too.

What it reproduces is what a hook's caller observes in torch 2.14.1's `torch/cuda/graphs.py`:
- module-level hooks (`register_graph_{capture_start, capture_end, instantiate, replay_start,
  replay_end}_hook`, `register_graph_destroy_hook`) run before the graph's own, and swallow
  every exception they raise;
- per-graph hooks (`register_capture_start_hook`, `register_capture_end_hook`,
  `register_post_instantiate_hook`, `register_replay_start_hook`, `register_replay_end_hook`)
  let their exceptions through: a raising replay-start hook aborts the replay before launch, and
  then no end hook runs; end hooks run after the launch even when it raised;
- capture-end hooks run after the capture ended, with the captured template still readable
  through `raw_cuda_graph()` whatever `keep_graph` says; then the graph is instantiated (unless
  `keep_graph`), which runs the instantiate hooks; `replay()` instantiates a graph that is not
  yet, before the start hooks;
- `register_destroy_callback` and `retain_object` hold callbacks and objects for one capture
  cycle, released by `reset()` (callbacks first, before the graph's resources go) or when the
  graph is collected, after synchronizing the streams it replayed on where asked to.

The base class keeps its template past `capture_end` because the model builds every graph with
`keep_graph=True` underneath and instantiates it itself, as torch 2.14's split of `capture_end`
into `capture_end_pre` and `capture_end_post` does.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable

from torch.utils.hooks import RemovableHandle

GLOBAL_KINDS = ("capture_start", "capture_end", "instantiate", "replay_start", "replay_end")


class _Retained:
    """One capture cycle's destroy callbacks and retained objects (torch's _RetainedCallbacks):
    it never refers to the graph, so the finalizer that fires it cannot keep the graph alive."""

    def __init__(self, current_stream: Callable[[], object]) -> None:
        self.callbacks: OrderedDict = OrderedDict()
        self.objects: OrderedDict = OrderedDict()
        self.replay_streams: set = set()
        self.sync_before_fire = False
        self.current_stream = current_stream
        self.fired = False

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        if self.sync_before_fire:
            for stream in self.replay_streams:
                with contextlib.suppress(Exception):
                    stream.synchronize()
        for cb in list(self.callbacks.values()):
            with contextlib.suppress(Exception):
                cb()
        self.callbacks.clear()
        self.objects.clear()


def _swallowing(registry: OrderedDict, graph: object) -> None:
    for fn in list(registry.values()):
        with contextlib.suppress(Exception):
            fn(graph)


def _register(registry: OrderedDict, fn: Callable) -> RemovableHandle:
    handle = RemovableHandle(registry)
    registry[handle.id] = fn
    return handle


class Model:
    """The hooks laid over `cls` (and its module `graphs`) until `remove()`.

    `cls` must offer what torch 2.11's `CUDAGraph` does: `__init__(keep_graph)` (or a pybind
    base whose `__init__` takes it), `capture_begin(pool=None, capture_error_mode=...)`,
    `capture_end()`, `instantiate()`, `replay()`, `reset()` and `raw_cuda_graph()` (valid after
    `capture_end` when built with `keep_graph=True`)."""

    def __init__(
        self, graphs: object, cls: type, current_stream: Callable[[], object], init: Callable
    ) -> None:
        self.graphs, self.cls = graphs, cls
        self.globals = {kind: OrderedDict() for kind in GLOBAL_KINDS}
        self.destroy_hooks: OrderedDict = OrderedDict()
        self._saved: list[tuple[object, str, object]] = []
        orig = {name: cls.__dict__.get(name) for name in _METHODS}
        model = self

        def __init__(self, keep_graph: bool = False):
            init(self, True)  # the template outlives capture_end, as capture_end_pre leaves it
            d = self.__dict__
            d["_keep_graph"], d["_has_graph_exec"], d["_in_capture_end"] = keep_graph, False, False
            for name in _PER_GRAPH:
                d[name] = OrderedDict()  # RemovableHandle refers to it weakly: not a plain dict
            model._arm(self)

        def capture_begin(self, pool=None, capture_error_mode: str = "global", **kwargs):
            orig["capture_begin"](self, pool=pool, capture_error_mode=capture_error_mode)
            _swallowing(model.globals["capture_start"], self)
            for hook in list(self._capture_start_hooks.values()):
                hook(self)

        def capture_end(self):
            orig["capture_end"](self)  # the capture ends; the template stays readable
            self.__dict__["_in_capture_end"] = True
            try:
                _swallowing(model.globals["capture_end"], self)
                for hook in list(self._capture_end_hooks.values()):
                    hook(self)
            finally:
                self.__dict__["_in_capture_end"] = False
            if not self._keep_graph:
                self.instantiate()

        def instantiate(self):
            orig["instantiate"](self)
            self.__dict__["_has_graph_exec"] = True
            _swallowing(model.globals["instantiate"], self)
            for hook in list(self._post_instantiate_hooks.values()):
                hook(self)

        def replay(self):
            if self._retained.sync_before_fire:
                self._retained.replay_streams.add(current_stream())
            # a dict entry: torch 2.11 has no such property
            if not self.__dict__.get("_has_graph_exec"):
                self.instantiate()
            _swallowing(model.globals["replay_start"], self)
            for hook in list(self._replay_start_hooks.values()):
                hook(self)
            try:
                orig["replay"](self)
            finally:
                _swallowing(model.globals["replay_end"], self)
                for hook in list(self._replay_end_hooks.values()):
                    hook(self)

        def reset(self):
            self._retained.fire()
            self._retained_finalizer.detach()
            model._arm(self)
            self.__dict__["_has_graph_exec"] = False
            orig["reset"](self)

        def raw_cuda_graph(self):
            if not (self._keep_graph or self._in_capture_end):
                raise RuntimeError("the template is gone outside a capture-end hook")
            return orig["raw_cuda_graph"](self)

        def per_graph(table: str) -> Callable:
            def register(self, hook):
                return _register(getattr(self, table), hook)

            return register

        def register_destroy_callback(self, cb, *, synchronize_before_release=False):
            if synchronize_before_release:
                self._retained.sync_before_fire = True
            return _register(self._retained.callbacks, cb)

        def retain_object(self, obj, *, synchronize_before_release=False):
            if synchronize_before_release:
                self._retained.sync_before_fire = True
            return _register(self._retained.objects, obj)

        methods = {
            "__init__": __init__,
            "capture_begin": capture_begin,
            "capture_end": capture_end,
            "instantiate": instantiate,
            "replay": replay,
            "reset": reset,
            "raw_cuda_graph": raw_cuda_graph,
            "register_destroy_callback": register_destroy_callback,
            "retain_object": retain_object,
        }
        methods.update({f"register_{kind}": per_graph(f"_{kind}s") for kind in _PER_GRAPH_KINDS})
        self._current_stream = current_stream
        for name, fn in methods.items():
            self._set(cls, name, fn)
        for kind, registry in self.globals.items():
            self._set(graphs, f"register_graph_{kind}_hook", _registrar(registry))
            self._set(graphs, f"_global_{kind}_hooks", registry)  # torch's own name for it
        self._set(graphs, "register_graph_destroy_hook", _registrar(self.destroy_hooks))

    def _arm(self, graph) -> None:
        """A fresh holder for the next capture cycle, fired when the graph is collected."""
        holder = _Retained(self._current_stream)
        graph.__dict__["_retained"] = holder
        graph.__dict__["_retained_finalizer"] = weakref.finalize(graph, holder.fire)
        if self.destroy_hooks:
            hooks = self.destroy_hooks
            # the exec ids torch hands over exist only with its graph annotations: none here
            holder.callbacks[object()] = lambda: _swallowing_ids(hooks, set())

    def _set(self, owner: object, name: str, value: object) -> None:
        self._saved.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    def remove(self) -> None:
        while self._saved:
            owner, name, old = self._saved.pop()
            if old is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def _registrar(registry: OrderedDict) -> Callable:
    return lambda fn: _register(registry, fn)


def _swallowing_ids(registry: OrderedDict, ids: set) -> None:
    for fn in list(registry.values()):
        with contextlib.suppress(Exception):
            fn(ids)


_ABSENT = object()
_METHODS = ("capture_begin", "capture_end", "instantiate", "replay", "reset", "raw_cuda_graph")
_PER_GRAPH_KINDS = (
    "capture_start_hook",
    "capture_end_hook",
    "post_instantiate_hook",
    "replay_start_hook",
    "replay_end_hook",
)
_PER_GRAPH = tuple(f"_{kind}s" for kind in _PER_GRAPH_KINDS)


def lay_over_torch() -> Model | None:
    """The model over the real `torch.cuda.CUDAGraph`, where the installed torch has no graph
    hooks of its own (None where it has them, or is a CPU build). Asks nothing of CUDA, so a
    process that forks later can still initialise it in its children."""
    import torch

    graphs = torch.cuda.graphs
    if hasattr(graphs, "register_graph_replay_start_hook") or torch.version.cuda is None:
        return None
    base_init = torch._C._CUDAGraph.__init__
    return Model(graphs, torch.cuda.CUDAGraph, torch.cuda.current_stream, base_init)
