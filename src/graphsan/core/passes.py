"""The capture order of one pool's graphs and the pool's replay clock (pure: no CUDA, no torch).

Each capture gets its place in the pool's sequence; the graphs that carved memory form a chain
in that order. Each replay ticks the clock and stamps the graph (`last`). A *pass* starts when
the chain's first carver replays; while the carvers replay in chain order the pass is in
capture order, and `reached` says how far it got. A reader whose producers all ran in this
pass, and that comes before the next carver, is clean by capture order alone (`in_order`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphsan.core.records import GraphId

NEVER_IN_ORDER = 1 << 62  # a reader's producer place that no pass reaches


@dataclass
class PassOrder:
    """One pool's capture order and replay clock."""

    sequence: list[GraphId] = field(default_factory=list)  # every capture, in order
    place: dict[GraphId, int] = field(default_factory=dict)  # its index in `sequence`
    chain: list[GraphId] = field(default_factory=list)  # the graphs that carved, in order
    link: dict[GraphId, int] = field(default_factory=dict)  # carver -> its index in `chain`
    # per reader, the latest place of a graph it reads from (NEVER_IN_ORDER: one is gone)
    producers_up_to: dict[GraphId, int] = field(default_factory=dict)
    clock: int = 0
    last: dict[GraphId, int] = field(default_factory=dict)  # graph -> clock of its last replay
    in_order_since_restart: bool = False  # the carvers replayed in chain order since the start
    reached: int = -1  # the place the pass reached
    pass_start: int = 0  # the clock of the last restart

    def captured(self, gid: GraphId, carved: bool) -> None:
        """Capture `gid` joins the sequence (and the chain where it carved memory)."""
        self.place[gid] = len(self.sequence)
        self.sequence.append(gid)
        if carved:
            self.link[gid] = len(self.chain)
            self.chain.append(gid)

    def reads_from(self, reader: GraphId, place: int) -> None:
        """`reader` depends on the graph at `place` (or later, see NEVER_IN_ORDER)."""
        if place > self.producers_up_to.get(reader, -1):
            self.producers_up_to[reader] = place

    def forget(self, gid: GraphId) -> None:
        """A pass in capture order goes on without a carver that is gone."""
        if gid in self.link:
            self.chain.remove(gid)
            self.link = {g: i for i, g in enumerate(self.chain)}

    def in_order(self, gid: GraphId) -> bool:
        """Whether a replay of `gid` now is clean by capture order alone: the carvers have
        replayed in capture order since the last restart, every graph `gid` reads from among
        them, and none after `gid`'s place (or `gid` restarts the pass)."""
        if self.chain and gid == self.chain[0] and gid not in self.producers_up_to:
            return True
        return self.in_order_since_restart and self.producers_up_to.get(
            gid, -1
        ) <= self.reached < self.place.get(gid, -1)

    def replayed(self, gid: GraphId) -> None:
        """`gid` ran: the clock ticks, and the pass moves on (or restarts, or leaves capture
        order)."""
        self.clock += 1
        self.last[gid] = self.clock
        i = self.link.get(gid)
        if i is None:
            return  # it carved nothing: the order of the pass does not change
        if i == 0:
            self.in_order_since_restart = True  # a pass restarts
            self.pass_start = self.clock
        elif not (self.in_order_since_restart and self.chain[i - 1] == self._reached_graph()):
            self.in_order_since_restart = False
        self.reached = self.place[gid]

    def _reached_graph(self) -> GraphId | None:
        return self.sequence[self.reached] if self.reached >= 0 else None
