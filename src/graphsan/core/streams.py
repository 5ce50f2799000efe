"""Which graph replays may run at the same time (pure: no CUDA, no torch).

CUDA runs one stream's work in order and two streams' work in any order, unless the program
orders them. graphsan follows what the host told CUDA about that order, as vector clocks: each
stream's clock says how many of every stream's replays its next launch comes after.

- A replay on stream `s` is `s`'s next launch (`launched`): it comes after everything `s`'s
  clock names, and joins `s`'s replays in flight.
- `Event.record(s)` copies `s`'s clock into the event; `Event.wait(s2)` (and
  `Stream.wait_event` and `Stream.wait_stream`, which go through it) joins the event's clock into
  `s2`'s.
- The host waiting (`torch.cuda.synchronize()`, `Stream.synchronize()`, `Event.synchronize()`)
  completes what it waited for: every later launch, on any stream, comes after it (the floor).

A replay in flight on another stream that the next launch on `s` does not come after may run at
the same time as it (`unordered`). Whether it still runs is the device's to say (a query of its
stream: the caller's). Streams are named by opaque keys (a device and a handle), events by keys
the caller forgets once the event is gone.

Cost: a launch is two dict updates and an append; an ordering call joins two clocks (as many
entries as streams that replayed). What is kept in flight per stream is bounded
(`MAX_IN_FLIGHT`): the oldest replay of a stream that launched that many since without the
host ever waiting is taken as done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

from graphsan.core.records import GraphId

StreamKey = Hashable  # a stream as the caller names it: (device, handle)
EventKey = Hashable
Clock = dict  # StreamKey -> how many of that stream's replays are ordered before

MAX_IN_FLIGHT = 256  # replays kept per stream since the host last waited for it


class Streams(Protocol):
    """What the device says of its streams (`cuda.streams` answers it)."""

    def current(self) -> StreamKey:
        """The stream the calling thread launches on now."""
        ...

    def busy(self, stream: StreamKey) -> bool:
        """Whether `stream` still has work queued or running."""
        ...


def _join(into: Clock, other: Clock) -> None:
    for s, n in other.items():
        if into.get(s, 0) < n:
            into[s] = n


class StreamOrder:
    """The order the program gave its replays (see the module)."""

    def __init__(self) -> None:
        self.clocks: dict[StreamKey, Clock] = {}
        self.floor: Clock = {}  # what every later launch comes after: the host waited for it
        self.events: dict[EventKey, Clock] = {}
        self.in_flight: dict[StreamKey, deque[tuple[int, GraphId]]] = {}

    # -- what the program does -------------------------------------------------------------
    def launched(self, stream: StreamKey, gid: GraphId) -> int:
        """Graph `gid` was replayed on `stream`: its launch number there."""
        clock = self.clocks.get(stream)
        if clock is None:
            clock = self.clocks[stream] = dict(self.floor)
        n = clock.get(stream, 0) + 1
        clock[stream] = n
        flight = self.in_flight.get(stream)
        if flight is None:
            flight = self.in_flight[stream] = deque(maxlen=MAX_IN_FLIGHT)
        flight.append((n, gid))
        return n

    def recorded(self, event: EventKey, stream: StreamKey) -> None:
        """`event` was recorded on `stream`: it completes with `stream`'s work so far."""
        self.events[event] = dict(self.clocks.get(stream) or self.floor)

    def waited(self, stream: StreamKey, event: EventKey) -> None:
        """`stream`'s later work waits for `event` (an event never recorded orders nothing)."""
        clock = self.events.get(event)
        if clock:
            _join(self.clocks.setdefault(stream, dict(self.floor)), clock)

    def forget_event(self, event: EventKey) -> None:
        self.events.pop(event, None)

    def host_waited_for_all(self, which: Callable[[StreamKey], bool] | None = None) -> None:
        """The host waited for every stream (`which` of them: a device's, for
        `torch.cuda.synchronize()`)."""
        for stream, clock in self.clocks.items():
            if which is None or which(stream):
                _join(self.floor, clock)
        self._settle()

    def host_waited_for_stream(self, stream: StreamKey) -> None:
        clock = self.clocks.get(stream)
        if clock:
            _join(self.floor, clock)
            self._settle()

    def host_waited_for_event(self, event: EventKey) -> None:
        clock = self.events.get(event)
        if clock:
            _join(self.floor, clock)
            self._settle()

    # -- what a replay asks ----------------------------------------------------------------
    def unordered(self, stream: StreamKey) -> Iterator[tuple[StreamKey, int, GraphId]]:
        """The replays in flight on other streams that the next launch on `stream` does not
        come after: (their stream, launch number, graph), latest first per stream."""
        clock = self.clocks.get(stream) or self.floor
        for other, flight in self.in_flight.items():
            if other == stream or not flight:
                continue
            after = max(clock.get(other, 0), self.floor.get(other, 0))
            for n, gid in reversed(flight):
                if n <= after:
                    break
                yield other, n, gid

    def done(self, stream: StreamKey) -> None:
        """`stream` is idle (the device said so): its replays so far are complete."""
        clock = self.clocks.get(stream)
        if clock is not None and self.floor.get(stream, 0) < clock.get(stream, 0):
            self.floor[stream] = clock[stream]
        flight = self.in_flight.get(stream)
        if flight:
            flight.clear()

    def _settle(self) -> None:
        """Replays the floor covers are no longer in flight."""
        for stream, flight in self.in_flight.items():
            done = self.floor.get(stream, 0)
            while flight and flight[0][0] <= done:
                flight.popleft()
