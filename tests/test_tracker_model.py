"""Model-based test of the Tracker: random interleavings of allocations, frees (plain, by a storage
change, or handed over inside a capture), captures, graph deaths and cache releases, checked
after every step against a simple reference model.

Two properties:
- classification: judging a graph gives exactly the findings the reference model predicts;
- the fast path is sound: a graph that is not dirty would get the same findings as the last time
  it was judged (a replay that skips judging can never miss a change).
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import DEFAULT_POOL, FreeEvent, GraphInfo, Reference
from graphsan.core.tracker import Tracker

SLOT = 4096
SLOTS = 4
POOLS = {DEFAULT_POOL: 0x7F00_0000_0000, (1, 0): 0x7E00_0000_0000}


def addr(pool, slot):
    return POOLS[pool] + slot * SLOT


class TrackerModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.t = Tracker()
        # simulated allocator: per pool, a segment of SLOTS fixed blocks (or None when released)
        self.active = {p: [False] * SLOTS for p in POOLS}
        self.mapped = dict.fromkeys(POOLS, True)
        self.gen = {(p, s): 0 for p in POOLS for s in range(SLOTS)}  # allocation generation
        # reference: graph id -> {(pool, slot): record}
        self.graphs: dict[int, dict] = {}
        self.last: dict[int, set] = {}
        self.next_id = 1

    # -- the simulated allocator's view ----------------------------------------------------
    def memmap(self):
        segs = []
        for p, base in POOLS.items():
            if not self.mapped[p]:
                continue
            blocks = [
                {
                    "address": base + i * SLOT,
                    "size": SLOT,
                    "state": "active_allocated" if a else "inactive",
                }
                for i, a in enumerate(self.active[p])
            ]
            segs.append(
                {
                    "address": base,
                    "total_size": SLOT * SLOTS,
                    "segment_pool_id": p,
                    "blocks": blocks,
                }
            )
        return MemoryMap.from_snapshot({"segments": segs})

    # -- rules -----------------------------------------------------------------------------
    @rule(pool=st.sampled_from(list(POOLS)), slot=st.integers(0, SLOTS - 1))
    def alloc(self, pool, slot):
        if self.active[pool][slot]:
            return
        self.mapped[pool] = True
        self.active[pool][slot] = True
        self.gen[(pool, slot)] += 1
        self.t.on_alloc(addr(pool, slot))

    @rule(
        pool=st.sampled_from(list(POOLS)),
        slot=st.integers(0, SLOTS - 1),
        how=st.sampled_from([None, "resize_", "handover"]),
    )
    def free(self, pool, slot, how):
        if not self.active[pool][slot]:
            return
        self.active[pool][slot] = False
        handover = how == "handover" and pool != DEFAULT_POOL
        op = None if how == "handover" else how
        cap = pool if handover else None
        self.t.on_free(addr(pool, slot), lambda: FreeEvent([], "eval", 1, op, cap))
        for refs in self.graphs.values():
            rec = refs.get((pool, slot))
            if rec is None or rec["gen"] != self.gen[(pool, slot)] or rec["freed"]:
                continue
            if handover:
                del refs[(pool, slot)]
            else:
                rec.update(freed=True, op=op)

    @rule(
        slots=st.lists(
            st.tuples(st.sampled_from(list(POOLS)), st.integers(0, SLOTS - 1)),
            min_size=1,
            max_size=5,
        )
    )
    def capture(self, slots):
        gid = self.next_id
        self.next_id += 1
        m = self.memmap()
        refs = [Reference(i, "k", 0, 0, addr(p, s)) for i, (p, s) in enumerate(slots)]
        self.t.add_graph(GraphInfo(gid, f"g{gid}", [], (1, 0), 0), refs, m)
        model = {}
        for p, s in slots:
            if not self.mapped[p]:
                continue  # foreign to the allocator's map
            if self.active[p][s]:
                model[(p, s)] = {"gen": self.gen[(p, s)], "freed": False, "op": None}
            elif p == DEFAULT_POOL:
                model[(p, s)] = {"gen": self.gen[(p, s)], "freed": True, "op": "before capture"}
        # blocks shared with an older graph share its watch record when still live
        self.graphs[gid] = model
        self.last[gid] = set()

    @rule(data=st.data())
    def forget(self, data):
        if not self.graphs:
            return
        gid = data.draw(st.sampled_from(sorted(self.graphs)))
        self.t.forget(gid)
        del self.graphs[gid]
        del self.last[gid]

    @rule()
    def empty_cache(self):
        for p in POOLS:
            if not any(self.active[p]):
                self.mapped[p] = False
        self.t.on_release()

    @rule(data=st.data())
    def judge(self, data):
        if not self.graphs:
            return
        gid = data.draw(st.sampled_from(sorted(self.graphs)))
        self.last[gid] = self._judge(gid)

    # -- the reference model ---------------------------------------------------------------
    def expected(self, gid):
        out = set()
        for (p, s), rec in self.graphs[gid].items():
            if not rec["freed"]:
                continue
            if not self.mapped[p]:
                kind = "unmapped"
            elif rec["op"] == "resize_":
                kind = "moved"
            elif self.active[p][s]:
                kind = "pool-reuse" if p != DEFAULT_POOL else "reowned"
            elif p == DEFAULT_POOL:
                kind = "freed"
            else:
                continue
            out.add((addr(p, s), kind))
        return out

    def _judge(self, gid):
        got = {(f.block_address, f.kind) for f in self.t.judge(gid, self.memmap())}
        assert got == self.expected(gid), (gid, got, self.expected(gid))
        return got

    @invariant()
    def clean_graphs_would_not_change_their_answer(self):
        for gid, state in list(self.t.graphs.items()):
            if state.dirty:
                continue
            got = self._judge(gid)
            assert got == self.last[gid], f"graph {gid} changed without being marked dirty"


TrackerModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tracker_against_reference_model = TrackerModel.TestCase
