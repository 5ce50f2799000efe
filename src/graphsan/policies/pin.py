"""The pin policy: keep memory a live graph references alive for as long as the graph lives.

At capture end, the tensors among the youngest objects (the garbage collector's generations 0
and 1: inputs made just before the capture) are searched at once, cheaply, and the graph's other
blocks are queued.
Before the first replay after one or more captures, or earlier at the next `train()`/`eval()`
switch or `graphsan.phase` (validation is where caches get cleared), one scan of all tensors finds
those whose storage overlaps a queued block. The pinner holds a reference to each such
storage: eager code can drop its own references, re-point a tensor (`.data =`, `set_`) or clear a
cache, and the memory stays valid for the graph. One full scan serves every graph captured since
the last one, so a program capturing hundreds of graphs pays for it once per capture phase.

Two kinds of memory cannot be pinned this way:
- memory without a Python-visible owner (library workspaces, tensors held only by C++);
- storages resized in place (`untyped_storage().resize_()`), which free their old memory whoever
  holds them. `Tensor.resize_` on a pinned storage is redirected: the tensor gets a fresh storage
  (contents copied) and the pinned one stays with the graph.
What cannot be pinned falls back to "raise". `summary()` reports what was pinned, by capture site,
and what pinning retained: memory whose owners are gone and that only the pinner keeps alive.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from graphsan.core.graph_state import GraphState, WatchedBlock
from graphsan.core.tracker import Tracker
from graphsan.cuda.owners import gc_tensors, storages_of

if TYPE_CHECKING:
    from graphsan.cuda.context import Context

YOUNG_SCAN_LIMIT = 200_000  # tensors; past this (gc off for long) the capture-end scan waits


@runtime_checkable
class Resizes(Protocol):
    """A memory watch that sees `resize_` before it reallocates (the allocator watch; the
    driver's sees no resize)."""

    def redirect_resizes(self, how: Callable | None) -> None: ...

    @property
    def resizes_redirected_to(self) -> Callable | None: ...


class Pinner:
    """Holds the storages live graphs reference; `attach` routes resizes and phase changes to it."""

    def __init__(
        self,
        tracker: Tracker,
        memory: object,
        context: Context,
        on_error: Callable[[BaseException], None],
        device_type: str = "cuda",
    ) -> None:
        self.tracker = tracker
        self.memory = memory  # the memory watch: resizes are redirected where it sees them
        self.context = context
        self.on_error = on_error
        self.device_type = device_type  # tensors on other devices own no graph memory
        self.pending: list[GraphState] = []
        self.held: dict[int, list[tuple[WatchedBlock, torch.UntypedStorage, list]]] = {}
        self.unpinnable: dict[int, list[WatchedBlock]] = {}
        self.scans = 0  # full scans (all tensors)
        self.young_scans = 0  # capture-end scans of the youngest tensors
        self.scan_ms = 0.0
        self.tensors_scanned = 0
        self._pinned_ptrs: dict[int, int] = defaultdict(int)  # storage data_ptr -> holders
        self._pinned: set[tuple[int, int]] = set()  # (id(watched block), graph id)
        self._retain: dict[int, Callable] = {}  # graph id -> its retain_object
        self._retained: dict[int, list] = defaultdict(list)  # graph id -> retain handles
        self.attach()

    # -- capture / replay -----------------------------------------------------------------------
    def young_tensors(self) -> list | None:
        """The tensors in the garbage collector's two youngest generations (inputs made just
        before a capture), taken before the capture's own analysis allocates enough to promote
        them; None when there are too many to search cheaply (gc switched off for long)."""
        tensors = gc_tensors(0, 1)
        return tensors if len(tensors) <= YOUNG_SCAN_LIMIT else None

    def young_tensor_refs(self) -> list:
        """Weak references to the tensors among the youngest objects, taken when a capture
        begins: an input made just before it can be promoted out of the young generations by
        the allocations of the capture itself."""
        return [weakref.ref(t) for t in self.young_tensors() or ()]

    def pin(
        self, state: GraphState, young: list | None = None, retain: Callable | None = None
    ) -> None:
        """A graph was captured: pin what `young` tensors own now, queue the rest. `retain`
        (torch's `retain_object` for this graph, where it has one) holds each pinned storage
        for the graph as well, so that it outlives the graph's replays in flight."""
        if retain is not None:
            self._retain[state.info.id] = retain
        if young:
            self._scan([state], lambda: young, final=False)
        self.pending.append(state)
        self.tracker.recheck(
            state.info.id
        )  # its first replay goes through the sanitizer, which flushes

    def attach(self) -> None:
        """Redirect reallocating resizes of pinned storages (where the memory watch sees
        resizes), and flush at phase changes."""
        if isinstance(self.memory, Resizes):
            self.memory.redirect_resizes(self.redirect_resize)
        if self._flush_quietly not in self.context.on_phase_change:
            self.context.on_phase_change.append(self._flush_quietly)

    def detach(self) -> None:
        """Stop redirecting and listening (pins already held stay until `release_all`)."""
        memory = self.memory
        if isinstance(memory, Resizes) and memory.resizes_redirected_to == self.redirect_resize:
            memory.redirect_resizes(None)
        if self._flush_quietly in self.context.on_phase_change:
            self.context.on_phase_change.remove(self._flush_quietly)

    def release_all(self) -> None:
        """Drop every pin: the memory goes back to its owners (or to the allocator)."""
        for handles in self._retained.values():
            for handle in handles:
                if handle is not None:
                    handle.remove()
        for gid in list(self.held):
            self.release(gid)
        self.pending.clear()
        self.unpinnable.clear()

    def _flush_quietly(self) -> None:
        if self.pending:
            try:
                self.flush()
            except Exception as err:  # never break the user's train()/eval()
                self.on_error(err)

    def flush(self) -> None:
        """The full scan: every live object, for every block still waiting; what no object owns
        is unpinnable from then on."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        self._scan(pending, gc_tensors, final=True)

    def _scan(self, states: list[GraphState], list_tensors, final: bool) -> None:
        """Pin the blocks of `states` that tensors from `list_tensors()` own; with `final`, the
        blocks no tensor owns become unpinnable. Tensors are listed only when a block waits."""
        t0 = time.perf_counter()
        blocks = sorted(
            (
                (wb, st.info.id)
                for st in states
                if st.info.id in self.tracker.graphs
                for wb in st.blocks.values()
                if wb.freed is None and (id(wb), st.info.id) not in self._pinned
            ),
            key=lambda x: x[0].address,
        )
        if not blocks:
            return
        tensors = list_tensors()
        starts = [wb.address for wb, _ in blocks]
        found: dict[int, tuple[torch.UntypedStorage, list]] = {}
        for obj, storage in storages_of(tensors, self.device_type):
            lo = storage.data_ptr()
            hi = lo + storage.nbytes()
            i = bisect.bisect_right(starts, hi - 1) - 1
            while i >= 0 and blocks[i][0].address + blocks[i][0].size > lo:
                wb = blocks[i][0]
                if wb.address < hi:
                    entry = found.setdefault(wb.address, (storage, []))
                    entry[1].append(weakref.ref(obj))
                i -= 1
        for wb, gid in blocks:
            if wb.address in found:
                storage, owners = found[wb.address]
                self.held.setdefault(gid, []).append((wb, storage, owners))
                self._pinned.add((id(wb), gid))
                self._pinned_ptrs[storage.data_ptr()] += 1
                retain = self._retain.get(gid)
                if retain is not None:
                    self._retained[gid].append(retain(storage))
            elif final:
                self.unpinnable.setdefault(gid, []).append(wb)
        if final:
            self.scans += 1
        else:
            self.young_scans += 1
        self.tensors_scanned += len(tensors)
        self.scan_ms += (time.perf_counter() - t0) * 1e3

    def release(self, gid: int) -> None:
        """The graph is gone (reset or destroyed): what torch retains for it, torch lets go of
        after the graph's replays in flight."""
        self._retain.pop(gid, None)
        self._retained.pop(gid, None)
        for wb, storage, _ in self.held.pop(gid, []):
            self._pinned.discard((id(wb), gid))
            ptr = storage.data_ptr()
            self._pinned_ptrs[ptr] -= 1
            if self._pinned_ptrs[ptr] <= 0:
                del self._pinned_ptrs[ptr]
        self.unpinnable.pop(gid, None)

    # -- storage changes ------------------------------------------------------------------------
    def redirect_resize(self, tensor: torch.Tensor, sizes: tuple) -> torch.Tensor | None:
        """`tensor.resize_(*sizes)` on a pinned storage that must grow: give the tensor a fresh
        storage with its contents and leave the pinned one to the graph. None: not ours."""
        if (
            tensor.device.type != self.device_type
            or tensor.untyped_storage().data_ptr() not in self._pinned_ptrs
        ):
            return None
        shape = tuple(sizes[0]) if len(sizes) == 1 and not isinstance(sizes[0], int) else sizes
        fresh = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        if fresh.untyped_storage().nbytes() <= tensor.untyped_storage().nbytes() - (
            tensor.storage_offset() * tensor.element_size()
        ):
            return None  # fits: resize_ will not reallocate
        n = min(tensor.numel(), fresh.numel())
        if n:
            fresh.view(-1)[:n].copy_(tensor.reshape(-1)[:n])
        tensor.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
        return tensor

    # -- the price ------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        by_site: dict[str, dict[str, int]] = defaultdict(lambda: {"blocks": 0, "bytes": 0})
        retained = 0
        blocks = nbytes = 0
        for gid, entries in self.held.items():
            st = self.tracker.graphs.get(gid)
            site = st.info.label if st is not None else f"graph#{gid}"
            for wb, storage, owners in entries:
                blocks += 1
                nbytes += wb.size
                by_site[site]["blocks"] += 1
                by_site[site]["bytes"] += wb.size
                alive = [o() for o in owners]
                if all(
                    t is None or t.untyped_storage().data_ptr() != storage.data_ptr() for t in alive
                ):
                    retained += storage.nbytes()
        return {
            "blocks": blocks,
            "bytes": nbytes,
            "by_site": dict(by_site),
            "unpinnable_blocks": sum(len(v) for v in self.unpinnable.values()),
            "retained_bytes": retained,
            "scans": self.scans,
            "young_scans": self.young_scans,
            "scan_ms": round(self.scan_ms, 3),
            "tensors_scanned": self.tensors_scanned,
        }
