"""The caching allocator as graphsan sees it: snapshots, alloc/free events, storage changes and
cache releases, turned into calls on the pure `Tracker`.

- Allocation stacks come from the allocator's own history (`_record_memory_history` in "state"
  mode: a stack per live block, no event log), read from the snapshot taken at capture end.
- Frees arrive through PyTorch's GPU-trace callbacks. Only frees of *watched* blocks do more than
  a dict lookup: they record the Python stack, the phase and the step.
- Storage changes (`resize_`, `set_`, `.data =`, `untyped_storage().resize_`) are wrapped so a
  free they cause is known to be a *move*.
- `torch.cuda.empty_cache()` is wrapped to note releases to the driver.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import torch

from graphsan.analysis import FreeEvent, MemoryMap, Tracker
from graphsan.context import Context, python_stack, user_frames
from graphsan.report import Frame
from graphsan.timeline import Timeline

_op = threading.local()
_ABSENT = object()


def _current_op() -> str | None:
    return getattr(_op, "name", None)


def _wrap_op(name: str, orig: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        prev = getattr(_op, "name", None)
        _op.name = name
        try:
            return orig(self, *args, **kwargs)
        finally:
            _op.name = prev

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", name)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    return wrapper


def snapshot_map(device: int | None = None) -> MemoryMap:
    """The allocator's segments and blocks right now (a few ms; never per replay)."""
    return MemoryMap.from_snapshot(torch.cuda.memory._snapshot(device), device, user_frames)


class AllocatorWatch:
    """Feeds allocator events into a Tracker while started."""

    def __init__(
        self,
        tracker: Tracker,
        context: Context,
        on_error: Callable[[BaseException], None],
        alloc_stacks: bool = True,
    ) -> None:
        self.tracker = tracker
        self.context = context
        self.on_error = on_error
        self.alloc_stacks = alloc_stacks
        self.last_release: tuple[list[Frame], str, int] | None = None
        self.capture_pool: tuple[int, int] | None = None  # set while a capture is in progress
        # (tensor, sizes) -> tensor | None: the pin policy's way around a reallocating resize_
        self.redirect_resize: Callable[[torch.Tensor, tuple], torch.Tensor | None] | None = None
        self.timeline: Timeline | None = None  # gets watched frees and empty_cache releases
        self._active = False
        self._patches: list[tuple[object, str, object]] = []

    # -- callbacks (hot path) ------------------------------------------------------------------
    def _on_free(self, ptr: int) -> None:
        if not self._active or (ptr not in self.tracker.live and not self.tracker.freed_segments):
            return
        try:
            if self.tracker.on_free(ptr, self._free_event) and self.timeline is not None:
                ev = _op.freed  # the event _free_event just made, on this thread
                self.timeline.free(ptr, ev.time, ev.stack, ev.phase, ev.step, ev.op)
        except Exception as err:  # never let a callback break the user's free
            self.on_error(err)

    def _free_event(self) -> FreeEvent:
        phase, step = self.context.current()
        ev = FreeEvent(python_stack(), phase, step, _current_op(), self.capture_pool)
        ev.time = time.time()
        _op.freed = ev
        return ev

    def _on_alloc(self, ptr: int) -> None:
        if not self._active or not self.tracker.freed_segments:
            return
        try:
            self.tracker.on_alloc(ptr)
        except Exception as err:
            self.on_error(err)

    # -- start / stop --------------------------------------------------------------------------
    def start(self) -> None:
        if self._active:
            return
        if self.alloc_stacks:
            torch.cuda.memory._record_memory_history(
                enabled="state", context="alloc", stacks="python"
            )
        from torch.cuda import _gpu_trace

        torch._C._activate_gpu_trace()
        if not getattr(self, "_registered", False):
            _gpu_trace.register_callback_for_memory_deallocation(self._on_free)
            _gpu_trace.register_callback_for_memory_allocation(self._on_alloc)
            self._registered = True
        self._patch_storage_ops()
        self._patch_empty_cache()
        self._active = True

    def stop(self) -> None:
        self._active = False  # the gpu-trace callbacks cannot be unregistered; they go idle
        for owner, name, orig in reversed(self._patches):
            if orig is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        self._patches.clear()
        if self.alloc_stacks:
            with contextlib.suppress(Exception):
                torch.cuda.memory._record_memory_history(enabled=None)

    def _set(self, owner: object, name: str, value: object) -> None:
        self._patches.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    def _patch_storage_ops(self) -> None:
        for name in ("resize_as_", "set_"):
            self._set(torch.Tensor, name, _wrap_op(name, getattr(torch.Tensor, name)))
        tagged_resize = _wrap_op("resize_", torch.Tensor.resize_)
        watch = self

        def resize_(tensor, *sizes, **kwargs):
            if watch.redirect_resize is not None and watch._active:
                out = watch.redirect_resize(tensor, sizes)
                if out is not None:
                    return out
            return tagged_resize(tensor, *sizes, **kwargs)

        resize_.__wrapped__ = torch.Tensor.resize_
        resize_.__doc__ = torch.Tensor.resize_.__doc__
        self._set(torch.Tensor, "resize_", resize_)
        self._set(
            torch.UntypedStorage,
            "resize_",
            _wrap_op("storage.resize_", torch.UntypedStorage.resize_),
        )
        base = torch._C.TensorBase.data

        def set_data(self, value):
            prev = getattr(_op, "name", None)
            _op.name = ".data ="
            try:
                base.__set__(self, value)
            finally:
                _op.name = prev

        self._set(torch.Tensor, "data", property(base.__get__, set_data, doc=base.__doc__))

    def _patch_empty_cache(self) -> None:
        orig = torch.cuda.memory.empty_cache
        watch = self

        def empty_cache() -> None:
            orig()
            if watch._active:
                try:
                    phase, step = watch.context.current()
                    watch.last_release = (python_stack(), phase, step)
                    if watch.timeline is not None:
                        watch.timeline.release(*watch.last_release)
                    watch.tracker.on_release()
                except Exception as err:
                    watch.on_error(err)

        empty_cache.__wrapped__ = orig
        empty_cache.__doc__ = orig.__doc__
        self._set(torch.cuda.memory, "empty_cache", empty_cache)
        self._set(torch.cuda, "empty_cache", empty_cache)
