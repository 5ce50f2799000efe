"""Pinned host memory as graphsan sees it: which pinned storages are alive, where they were
allocated, and when they die.

PyTorch's caching host allocator offers statistics only, no per-block events. So the pinned
storages are followed from Python: `Tensor.pin_memory()` (what DataLoader's pinning thread
calls) is wrapped to record each new pinned storage (its address, size and the allocation stack)
with a `weakref.finalize` on the storage, which runs when the storage itself dies (its Python
object lives as long as the C++ storage: views and `.data` aliases keep it). The factories'
`pin_memory=True` are left alone (wrapping `torch.empty` would put Python on every allocation
and in torch.compile's way): a graph's memcpy node that touches pinned memory allocated so, or
by C++, or before `enable()`, is looked up once in the garbage collector's objects at capture
end, and then watched without an allocation stack.

A freed pinned block goes back to the allocator's cache, which hands it to the next
`pin_memory()` of a fitting size; the finalizer reports the free to the tracker, and a new pinned
storage over freed watched memory marks the graphs concerned for judgement.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graphsan.core.patches import Patches
from graphsan.core.records import DataPtr, Frame, FreeEvent
from graphsan.core.tracker import Tracker
from graphsan.cuda.context import python_stack
from graphsan.cuda.owners import gc_tensors


@dataclass(frozen=True)
class HostBlock:
    address: DataPtr
    size: int
    frames: tuple[Frame, ...]
    token: int  # tells this storage from a later one at the same address


class PinnedBlocks:
    """The registry of live pinned storages (address, size, allocation frames), in address order
    for lookups; thread-safe, since finalizers run on any thread."""

    def __init__(self) -> None:
        self.blocks: dict[DataPtr, HostBlock] = {}
        self._starts: list[DataPtr] | None = []  # sorted block addresses; None: rebuild
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()

    def add(self, address: DataPtr, size: int, frames) -> HostBlock:
        block = HostBlock(address, size, tuple(frames), next(self._tokens))
        with self._lock:
            self.blocks[address] = block
            self._starts = None
        return block

    def remove(self, address: DataPtr, token: int) -> bool:
        """Drop the block if it is still the one `token` names; whether it was."""
        with self._lock:
            block = self.blocks.get(address)
            if block is None or block.token != token:
                return False
            del self.blocks[address]
            self._starts = None
        return True

    def locate(self, address: DataPtr) -> HostBlock | None:
        """The live pinned block holding `address`."""
        with self._lock:
            if self._starts is None:
                self._starts = sorted(self.blocks)
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            block = self.blocks.get(self._starts[i])
        if block is not None and address < block.address + block.size:
            return block
        return None

    def owner(self, start: DataPtr, end: DataPtr) -> HostBlock | None:
        """A live pinned block overlapping [start, end) (the memory's new owner); live blocks
        never overlap each other."""
        block = self.locate(start)
        if block is not None:
            return block
        with self._lock:
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] < end:
                return self.blocks.get(self._starts[i])
        return None


@dataclass(eq=False)
class HostWatch:
    """Follows the pinned storages of the process into `pinned` while started, and tells the
    tracker of each new one and each death."""

    tracker: Tracker
    pinned: PinnedBlocks
    free_event: Callable[[], FreeEvent]
    on_error: Callable[[BaseException], None]
    _active: bool = field(default=False, init=False)
    _patches: Patches = field(default_factory=Patches, init=False)

    def note(self, address: DataPtr, size: int, frames, storage=None) -> HostBlock:
        """A new pinned storage; `storage` (when given) reports its death."""
        block = self.pinned.add(address, size, frames)
        if storage is not None:
            weakref.finalize(storage, self.freed, address, block.token)
        self.tracker.on_alloc(address)  # over freed watched memory: judge those graphs again
        return block

    def note_tensor(self, tensor: torch.Tensor, frames=None) -> None:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        known = self.pinned.blocks.get(address)
        if known is not None and known.size == storage.nbytes():
            return  # the same storage again (pin_memory of a pinned tensor returns it)
        self.note(address, storage.nbytes(), python_stack() if frames is None else frames, storage)

    def freed(self, address: DataPtr, token: int) -> None:
        """The storage died (its finalizer): its memory is back in the pinned cache."""
        try:
            if self.pinned.remove(address, token) and self._active:
                self.tracker.on_free(address, self.free_event)
        except Exception as err:  # a finalizer must never raise into the user's code
            self.on_error(err)

    def find(self, addresses: list[DataPtr]) -> None:
        """Addresses of a graph's memcpy nodes that no recorded pinned block holds: look for
        pinned CPU tensors holding them among the garbage collector's objects (once per
        capture that has any), and record those without an allocation stack."""
        missing = {a for a in addresses if self.pinned.locate(a) is None}
        if not missing:
            return
        for obj in gc_tensors():
            if not missing:
                break
            with contextlib.suppress(Exception):
                if obj.device.type != "cpu":
                    continue
                storage = obj.untyped_storage()
                start, size = storage.data_ptr(), storage.nbytes()
                hit = {a for a in missing if start <= a < start + size}
                if hit and obj.is_pinned():
                    self.note_tensor(obj, frames=())
                    missing -= hit

    # -- start / stop ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._active:
            return
        watch = self

        def wrap_method(orig):
            @functools.wraps(orig)
            def pin_memory(self, *args, **kwargs):
                out = orig(self, *args, **kwargs)
                if watch._active:
                    watch._noted(out)
                return out

            return pin_memory

        self._set(torch.Tensor, "pin_memory", wrap_method(torch.Tensor.pin_memory))
        self._active = True

    def _noted(self, tensor) -> None:
        try:
            if isinstance(tensor, torch.Tensor):
                self.note_tensor(tensor)
        except Exception as err:
            self.on_error(err)

    def stop(self) -> None:
        self._active = False
        self._patches.restore()

    def _set(self, owner: object, name: str, value: object) -> None:
        self._patches.set(owner, name, value)
