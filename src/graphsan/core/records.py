"""The records the analysis reads and writes: graph nodes, references, frees and findings.

Everything here is plain data (no CUDA, no torch). The evidence a finding carries is frozen: a
`Finding` is built complete once (by the judgement, through `Finding.at`) and never changed
after, with its kind's own evidence typed (`OrderEvidence`, `BakedEvidence`); rendering it as
text lives in `graphsan.report.text`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

from graphsan.core.kinds import Kind, likely_cause
from graphsan.core.locations import location

DataPtr = int
GraphId = int
PoolId = tuple[int, int]
DEFAULT_POOL: PoolId = (0, 0)
HOST_POOL: PoolId = (-1, -1)  # pinned host memory (no allocator pool has a negative id)

Frame = tuple[str, int, str]  # (filename, line, function)
Stack = tuple[Frame, ...]  # outermost first, like a traceback

# the free_op of memory that was already free when the capture ended (no free was seen)
FREED_BEFORE_CAPTURE = "freed before capture ended"
# the free_op of memory found freed when the driver was asked before a replay (an allocator
# backend that reports no frees: graphsan.cuda.driverwatch)
FREED_UNSEEN = "found freed before the replay"
# storage changes that free a tensor's old memory while the tensor lives on
MOVE_OPS = ("resize_", "set_", ".data =", "storage.resize_")


def display_path(filename: str) -> str:
    """A frame's file as reports print it and suppressions match it: the same on every machine
    and from every working directory (`graphsan.core.locations`)."""
    return location(filename)


def frame_text(frame: Frame) -> str:
    filename, line, name = frame
    return f"{display_path(filename)}:{line} in {name}"


def _stack(frames) -> Stack:
    return tuple(tuple(f) for f in frames)


# ----------------------------------------------------------------------------- graph nodes
@dataclass
class KernelArgs:
    """A kernel node: its name, its device-side parameter block as bytes, and its grid."""

    index: int
    name: str
    buffer: bytes
    offsets: list[int]  # start of each parameter inside `buffer` (empty when unknown)
    grid: tuple[int, int, int] = (0, 0, 0)  # blocks launched in x, y, z ((0, 0, 0): not read)


@dataclass
class CopyArgs:
    """A memcpy or memset node: the device addresses it touches."""

    index: int
    kind: str  # "memcpy" | "memset"
    addresses: list[tuple[str, int]]  # ("src" | "dst", address)


@dataclass
class AllocArgs:
    """A memory-allocation node (stream-ordered allocation captured into the graph, as under
    the cudaMallocAsync backend): memory the graph itself owns."""

    index: int
    address: int
    nbytes: int
    kind: str = "mem_alloc"


@dataclass
class WalkStats:
    nodes: int = 0
    kernels: int = 0
    copies: int = 0
    unreadable: int = 0
    child_graphs: int = 0
    # what read the graph: "compiled" (graphsan's library) or "cuda-bindings" (with the reason
    # where the compiled walk was there but failed on this graph)
    source: str = "cuda-bindings"


class Reference(NamedTuple):
    """One device address found in one node's arguments (a tuple: graphs hold many). An
    indirect reference was read from a small device buffer (a pointer table) that the node's
    argument points at: `through` is that buffer's block, `slot` the byte offset inside it.
    `caveat` says why the word may not be read by the kernel at all (it sits in a struct whose
    layout could not be confirmed: `graphsan.core.argstructs`)."""

    node: int
    kernel: str  # demangled kernel name, or "memcpy" / "memset"
    param: int | str
    offset: int
    address: DataPtr
    through: DataPtr | None = None
    slot: int = 0
    caveat: str | None = None


# ----------------------------------------------------------------------------- graphs and frees
@dataclass(frozen=True)
class GraphInfo:
    """Identity of one captured graph as a person would look for it."""

    id: int
    label: str
    capture_site: Stack
    pool: PoolId | None = None
    device: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "capture_site", _stack(self.capture_site))

    def describe(self) -> str:
        site = frame_text(self.capture_site[-1]) if self.capture_site else "<unknown site>"
        return f"graph #{self.id} '{self.label}' captured at {site}"


@dataclass
class FreeEvent:
    """Where, when and how a watched block was freed."""

    stack: Stack
    phase: str | None
    step: int | None
    op: str | None = None  # "resize_", "set_", ".data =", ... when a storage change freed it
    capture_pool: PoolId | None = None  # the pool a capture in progress was allocating from
    seq: int = 0  # the Tracker's count of watched frees when this one was recorded
    time: float | None = None  # time.time() of the free, for the report's timeline


@dataclass(frozen=True)
class Release:
    """The last release of cached memory to the driver (`torch.cuda.empty_cache()`)."""

    stack: Stack
    phase: str | None
    step: int | None


@dataclass(frozen=True)
class ReferenceCounts:
    """How a graph's references were classified at capture."""

    default: int = 0  # blocks of the default pool
    own: int = 0  # persistent blocks of the graph's own pool
    other: int = 0  # blocks of another graph's pool
    foreign: int = 0  # memory the caching allocator does not own
    temporary: int = 0  # free pool memory: the graph's own temporaries
    host: int = 0  # pinned host memory of memcpy nodes

    @property
    def references(self) -> int:
        return self.default + self.own + self.other + self.foreign + self.temporary + self.host


# ----------------------------------------------------------------------------- findings
@dataclass(frozen=True)
class OtherUse:
    """Another live graph's first reference to a finding's block: it would touch it next."""

    graph: int
    label: str
    node: int
    kernel: str
    param: int | str
    offset: int


@dataclass(frozen=True)
class OrderEvidence:
    """What a finding about the order of replays (`replay-order`, `live-output` in a shared
    pool; `replay-race` across streams) knows beside the memory: which graph wrote the range,
    which carved it, the replays, the streams."""

    written_by: int | None = None
    """replay-order: the graph that last wrote the range for this one; live-output: the graph
    whose output the replay would overwrite (None: a tensor eager code allocated into the pool)."""

    carved_by: int | None = None
    """replay-order: the graph captured later that re-carved the range and has replayed since."""

    replays: tuple[int, int] | None = None
    """live-output: the pool's replay count at the output's producer's last replay, and the
    count this replay would have (`written_by` names the producer)."""

    streams: tuple[int, int] | None = None
    """replay-race: the stream this replay launches on and the one `written_by`'s replay runs
    on (their stream ids, as `torch.cuda.Stream.stream_id` gives them)."""

    def __post_init__(self) -> None:
        for name in ("replays", "streams"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))


@dataclass(frozen=True)
class BakedEvidence:
    """What a finding about state a graph baked at capture (`mode`, `baked-value`,
    `superseded`) knows: the entry the program changed, what it was at capture and is now, the
    modules switched, and where it changed. Nothing was freed: such a finding has no free stack."""

    entry: str | None = None
    """baked-value, superseded: the entry (`model.layers.3.mlp.weight`,
    `optimizer.param_groups[0]['lr']`)."""

    captured: str | None = None
    """What the graph baked at capture: a mode, a value, a tensor."""

    current: str | None = None
    """What it is now."""

    modules: tuple[str, ...] = ()
    """mode: the modules switched (a few of them; the finding's `now` counts them all)."""

    changed_at: Stack = ()
    """Where the program changed it (the `.train()`/`.eval()` call, the re-registration), where
    a hook saw it; empty for a change found by comparing values at the replay. The finding's
    `phase` and `step` are the change's."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "changed_at", _stack(self.changed_at))


Evidence = OrderEvidence | BakedEvidence

# the flat fields (the JSON report's) that each kind's evidence holds; a baked finding's
# `changed_at` is its flat `free_stack`
ORDER_FIELDS = tuple(f.name for f in dataclasses.fields(OrderEvidence))
BAKED_FIELDS = ("entry", "captured", "current", "modules")


@dataclass(frozen=True)
class Finding:
    """One graph reference into memory that is no longer what it was at capture, or state the
    graph baked at capture that the program changed since.

    `node`, `kernel`, `param` and `offset` name the first node of the graph whose arguments hold
    `address` (`param` is the parameter index, `offset` the byte offset inside it; for memcpy and
    memset nodes `param` is "src"/"dst"); `other_nodes` counts further references to the same block.

    Beside these common fields, a kind's own evidence is typed: `order` (an `OrderEvidence`) for
    replay-order and live-output findings, `baked` (a `BakedEvidence`) for mode, baked-value and
    superseded ones; each is None on every other kind, and filled in (empty) where its kind has
    it and none is given. A baked finding's `free_stack` is empty (nothing was freed): where the
    state changed is `baked.changed_at`.

    Findings are built by `Finding.at` (the judgement's) or from their flat fields, as the JSON
    report holds them, by `Finding.of` (`flat()` gives them back).
    """

    kind: Kind
    graph: GraphInfo
    node: int
    kernel: str
    param: int | str
    offset: int
    address: int
    nbytes: int
    block_address: int
    pool: str
    alloc_stack: Stack = ()
    free_stack: Stack = ()
    # where the memory was freed, or the baked state changed (else the judged replay's)
    phase: str | None = None
    step: int | None = None
    free_op: str | None = None
    now: str = ""
    other_nodes: int = 0
    rank: int | None = None
    # the replay that was stopped is only the first to run; these graphs would touch it next
    also_used_by: tuple[OtherUse, ...] = ()
    # time.time() of the watched free, and of the replay that was judged and found this
    freed_at: float | None = None
    found_at: float | None = None
    # an indirect reference: `address` sits at byte `through_slot` of the block at `through`,
    # a pointer table the node's argument (`param`, `offset`) points at
    through: int | None = None
    through_slot: int | None = None
    host: bool = False  # the memory is pinned host memory (a memcpy node's source or target)
    # why the graph may not read this address at all: every reference to the block sits in an
    # argument struct whose layout could not be confirmed ("unconfirmed layout (...)")
    caveat: str | None = None
    order: OrderEvidence | None = None
    baked: BakedEvidence | None = None

    @classmethod
    def at(
        cls,
        kind: Kind | str,
        graph: GraphInfo,
        ref: Reference,
        when: When,
        evidence: Evidence | None = None,
        *,
        block: tuple[DataPtr, int] = (0, 0),
        pool: str = "",
        **fields,
    ) -> Finding:
        """A finding about what `ref` names (its node, kernel, parameter, offset and address):
        `when` gives the phase and step (the free's, the change's or the judged replay's) and the
        judgement's rank and time, `evidence` the kind's own, `block` the block's (start, size);
        the rest comes from `fields`."""
        return cls(
            kind=kind,
            graph=graph,
            node=ref.node,
            kernel=ref.kernel,
            param=ref.param,
            offset=ref.offset,
            address=ref.address,
            nbytes=block[1],
            block_address=block[0],
            pool=pool,
            phase=when.phase,
            step=when.step,
            rank=when.judged.rank,
            found_at=when.judged.found_at,
            order=evidence if isinstance(evidence, OrderEvidence) else None,
            baked=evidence if isinstance(evidence, BakedEvidence) else None,
            **fields,
        )

    @classmethod
    def of(cls, **flat) -> Finding:
        """A finding from its flat fields, as the JSON report holds them: `written_by`,
        `carved_by` and `replays` are a replay-order or live-output finding's `OrderEvidence`;
        `entry`, `captured`, `current` and `modules`, with `free_stack` (where it changed), are a
        baked finding's `BakedEvidence`. ValueError where a kind is given another kind's
        evidence (the message begins with the field's name)."""
        kind = Kind(flat["kind"])
        order = {k: flat.pop(k) for k in ORDER_FIELDS if k in flat}
        baked = {k: flat.pop(k) for k in BAKED_FIELDS if k in flat}
        if kind.baked:
            baked["changed_at"] = flat.pop("free_stack", ())
        for given, own in ((order, kind.order), (baked, kind.baked)):
            if own:
                continue
            for key, value in given.items():
                if value not in (None, (), []):
                    raise ValueError(
                        f"{key} is {value!r}; expected it empty in a finding of kind {kind}"
                    )
        return cls(
            **flat,
            order=OrderEvidence(**order) if kind.order else None,
            baked=BakedEvidence(**baked) if kind.baked else None,
        )

    def flat(self) -> dict[str, object]:
        """The finding's flat fields, as the JSON report holds them (`Finding.of` takes them
        back): the common ones, then every kind's evidence fields (empty where the finding has
        no such evidence); a baked finding's `free_stack` is where it changed."""
        order, baked = self.order or OrderEvidence(), self.baked or BakedEvidence()
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            if f.name == "through":  # the JSON report's key order: the order fields come here
                out |= {k: getattr(order, k) for k in ORDER_FIELDS}
            if f.name not in ("order", "baked"):
                out[f.name] = getattr(self, f.name)
        if self.baked is not None:
            out["free_stack"] = baked.changed_at
        return out | {k: getattr(baked, k) for k in BAKED_FIELDS}

    def __post_init__(self) -> None:
        # callers may hand lists; the evidence is kept as tuples so nobody can change it
        kind = Kind(self.kind)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "alloc_stack", _stack(self.alloc_stack))
        object.__setattr__(self, "free_stack", _stack(self.free_stack))
        others = tuple(u if isinstance(u, OtherUse) else OtherUse(**u) for u in self.also_used_by)
        object.__setattr__(self, "also_used_by", others)
        for name, own, evidence in (
            ("order", kind.order, OrderEvidence),
            ("baked", kind.baked, BakedEvidence),
        ):
            value = getattr(self, name)
            if not own:
                if value is not None:
                    raise ValueError(
                        f"{name} is {value!r}; expected None in a finding of kind {kind}"
                    )
            elif value is None:
                object.__setattr__(self, name, evidence())
            elif not isinstance(value, evidence):
                raise ValueError(f"{name} is {value!r}; expected {evidence.__name__}")
        if kind.baked and self.free_stack:
            raise ValueError(
                f"free_stack is {self.free_stack!r}; expected it empty in a finding of kind {kind} "
                "(nothing was freed: where the state changed is its BakedEvidence's changed_at)"
            )

    @property
    def key(self) -> tuple[int, int, str]:
        """What makes a finding the same one at a later replay: its graph, its block, and for
        what a graph baked at capture, the entry."""
        return (self.graph.id, self.block_address, (self.baked and self.baked.entry) or "")

    @property
    def likely_cause(self) -> str:
        written_by = self.order.written_by if self.order is not None else None
        return likely_cause(self.kind, self.host, written_by, self.free_op)


@dataclass(frozen=True)
class Judged:
    """What a judgement adds to every finding: who judged (rank), when, and the last release."""

    rank: int | None = None
    found_at: float | None = None
    release: Release | None = field(default=None)


@dataclass(frozen=True)
class When:
    """The program's phase and step a finding is about (when the replay is judged, or when the
    memory was freed or the baked state changed), and the judgement's `Judged`."""

    phase: str | None = None
    step: int | None = None
    judged: Judged = field(default_factory=Judged)


@dataclass
class GraphStats:
    """What capturing and watching one graph cost and found (a report's `graphs` entry)."""

    id: int
    label: str
    capture_site: Stack
    pool: PoolId
    walk: WalkStats
    counts: ReferenceCounts
    watched_blocks: int
    captured_at: float | None
    node_summary: dict
    # seconds per stage: reading the graph through the driver, bringing the allocator view up
    # to date, confirming addresses, registering the blocks
    walk_s: float = 0.0
    allocator_view_s: float = 0.0
    references_s: float = 0.0
    tracker_s: float = 0.0
    replays_judged: int = 0
    # small blocks read as possible pointer tables at capture end, and the indirect references
    # they gave
    tables_read: int = 0
    indirect: int = 0

    def to_dict(self) -> dict:
        """The JSON form (schema v3's graph entry)."""
        c, ms = self.counts, (lambda s: round(s * 1e3, 3))
        stages = (self.walk_s, self.allocator_view_s, self.references_s, self.tracker_s)
        return {
            "id": self.id,
            "label": self.label,
            "capture_site": [list(f) for f in self.capture_site],
            "pool": list(self.pool),
            "nodes": self.walk.nodes,
            "kernels": self.walk.kernels,
            "copies": self.walk.copies,
            "unreadable_nodes": self.walk.unreadable,
            "child_graphs": self.walk.child_graphs,
            "walk": self.walk.source,
            "references": c.references,
            "watched_blocks": self.watched_blocks,
            "default": c.default,
            "own": c.own,
            "other": c.other,
            "foreign": c.foreign,
            "temporary": c.temporary,
            "host": c.host,
            "tables_read": self.tables_read,
            "indirect": self.indirect,
            "analysis_ms": ms(sum(stages)),
            "analysis_ms_by_stage": dict(
                zip(
                    ("walk", "allocator_view", "references", "tracker"),
                    map(ms, stages),
                    strict=True,
                )
            ),
            "replays_judged": self.replays_judged,
            "captured_at": self.captured_at,
            "node_summary": self.node_summary,
        }


def pool_name(pool: PoolId, own: PoolId | None) -> str:
    """A pool as a finding names it; `own` is the graph's own pool."""
    if pool == HOST_POOL:
        return "pinned host memory"
    if pool == DEFAULT_POOL:
        return "default pool"
    if own is not None and pool == own:
        return f"graph's own private pool {pool}"
    return f"private pool {pool} of another graph"
