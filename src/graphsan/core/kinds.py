"""The kinds of finding and their likely causes, as a person reads them (pure: no CUDA, no
torch). The first eight are about memory a graph references; `mode`, `baked-value` and
`superseded` are about state a graph baked at capture that the program changed since."""

from __future__ import annotations

from graphsan.core.choice import Choice


class Kind(Choice):
    """What became of memory a graph references (a `str`, so JSON and `kind == "freed"` work)."""

    FREED = "freed"
    REOWNED = "reowned"
    MOVED = "moved"
    UNMAPPED = "unmapped"
    POOL_REUSE = "pool-reuse"
    REPLAY_ORDER = "replay-order"
    LIVE_OUTPUT = "live-output"
    REPLAY_RACE = "replay-race"
    MODE = "mode"
    BAKED_VALUE = "baked-value"
    SUPERSEDED = "superseded"

    @property
    def baked(self) -> bool:
        """About state the graph baked at capture, not about memory it references."""
        return self in (Kind.MODE, Kind.BAKED_VALUE, Kind.SUPERSEDED)

    @property
    def order(self) -> bool:
        """About the order of graphs' replays (in a shared pool, or across streams): memory
        another graph overwrites, not memory that was freed."""
        return self in (Kind.REPLAY_ORDER, Kind.LIVE_OUTPUT, Kind.REPLAY_RACE)

    @property
    def cause(self) -> str:
        """The likely cause, as a person reads it; `{op}` names the storage change."""
        return _CAUSES[self]


_CAUSES = {
    Kind.FREED: "eager code dropped the last reference to memory this graph still uses; the "
    "replay would read stale data or write into memory the allocator may hand out at any time",
    Kind.REOWNED: "the memory was freed and now belongs to another live tensor; the replay would "
    "silently corrupt that tensor (and read its data as if it were the graph's)",
    Kind.MOVED: "a tensor the graph uses changed its storage ({op}); the graph still points at "
    "the old memory",
    Kind.UNMAPPED: "the memory was freed and released to the driver (empty_cache, OOM retry or "
    "an expandable segment unmapping pages); the replay would fault with 'an illegal memory "
    "access'",
    Kind.POOL_REUSE: "a later capture re-carved memory of a shared graph pool that this graph "
    "still uses; the graphs now overwrite each other's data",
    Kind.REPLAY_ORDER: "graphs sharing a memory pool replayed out of capture order: another "
    "graph of the pool carved memory this graph reads and ran after the graph that writes it; "
    "the replay would read the later graph's data (replay the writer first, or give the graphs "
    "separate pools)",
    Kind.LIVE_OUTPUT: "graphs sharing a memory pool replayed out of capture order: a graph "
    "captured later carved its output from this graph's scratch memory and ran after this graph "
    "last did; the caller still holds that output and would read this graph's data there "
    "(replay in capture order, read the output first, or give the graphs separate pools; pin "
    "cannot help: this is an order, not a lifetime)",
    Kind.REPLAY_RACE: "two graphs whose memory overlaps were replayed on two streams with "
    "nothing ordering one after the other: they may run at the same time, one writing what the "
    "other reads or writes (order them with `wait_stream` or an event the second stream waits "
    "for, or give the graphs separate pools; pin cannot help). An ordering made outside Python "
    "(NCCL, a C++ extension's cudaStreamWaitEvent) is invisible to graphsan: where one exists, "
    "this finding is wrong and a suppression entry silences it",
    Kind.MODE: "modules whose forward the graph captured were switched between train and eval "
    "since; the graph replays what they did in the mode they had at capture (dropout, batch "
    "statistics, training-only branches): switch them back before the replay, or capture a "
    "graph per mode (pin cannot help)",
    Kind.BAKED_VALUE: "the graph captured an optimizer step while this hyperparameter was a "
    "Python number, which the step's kernels took by value; the graph keeps stepping with the "
    "value at capture: pass it as a tensor (torch.optim takes a tensor lr, and its schedulers "
    "fill it in place), or capture again (pin cannot help)",
    Kind.SUPERSEDED: "the entry now holds another tensor while the one the graph reads lives on "
    "elsewhere; the graph reads and writes a tensor the program no longer uses: copy into the "
    "existing tensor (copy_, load_state_dict), or capture again (pin cannot help)",
}
KINDS = Kind.values()
# the causes of findings about pinned host memory (a graph's memcpy node reads or writes it)
_HOST_CAUSES = {
    Kind.FREED: "eager code dropped the last reference to pinned host memory a graph's memcpy "
    "still reads or writes; PyTorch's pinned-memory cache hands those pages to the next "
    "pin_memory() of a fitting size",
    Kind.REOWNED: "the pinned host memory was freed and the pinned-memory cache handed it to "
    "another tensor; the replay would copy that tensor's data (or overwrite it)",
}
# the cause of a live-output finding whose tensor no graph produced (`OrderEvidence.written_by`
# None)
_EAGER_CAUSE = (
    "eager code allocated a tensor into the graph's memory pool (use_mem_pool, or PyTorch's "
    "begin-allocate-to-pool calls) and was handed memory the graph's capture used as scratch; "
    "every replay writes there (allocate the tensor outside the pool, or free it before the "
    "replay; pin cannot help: the graph owns that memory)"
)


def likely_cause(kind: Kind, host: bool, written_by: int | None, free_op: str | None) -> str:
    """A finding's likely cause: by kind, for pinned host memory, and for a live output that
    eager code allocated into the pool (no graph wrote it)."""
    if host and kind in _HOST_CAUSES:
        return _HOST_CAUSES[kind]
    if kind is Kind.LIVE_OUTPUT and written_by is None:
        return _EAGER_CAUSE
    return kind.cause.format(op=free_op or "resize_/set_/.data=")
