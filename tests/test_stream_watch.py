"""The stream orderings graphsan reads from torch's calls (graphsan.cuda.streams), on stand-ins
for `torch.cuda.Event` and `torch.cuda.Stream` (CPU torch cannot make either): each wrapped call
still does what the original does and feeds the model, `wait_stream` through the calls it is
made of, calls on a capturing stream are left out, and `stop` puts every original back."""

from __future__ import annotations

import types

import pytest
import torch

from graphsan.core.races import Races
from graphsan.cuda import streams


class FakeStream:
    def __init__(self, sid: int, device: int = 0) -> None:
        self.stream_id, self.device_index, self.cuda_stream = sid, device, 0x1000 + sid

    def synchronize(self) -> None:
        calls.append(("stream sync", self.stream_id))

    def wait_event(self, event) -> None:  # as torch.cuda.Stream does it
        event.wait(self)

    def wait_stream(self, stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event=None):
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event


class FakeEvent:
    def record(self, stream=None) -> None:
        calls.append(("record", getattr(stream, "stream_id", None)))

    def wait(self, stream=None) -> None:
        calls.append(("wait", getattr(stream, "stream_id", None)))

    def synchronize(self) -> None:
        calls.append(("event sync",))


calls: list = []
S1, S2 = FakeStream(1), FakeStream(2)
K1, K2 = (0, 1), (0, 2)


@pytest.fixture
def watch(monkeypatch):
    calls.clear()
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        torch._C, "_cuda_synchronize", lambda: calls.append(("device sync",)), raising=False
    )
    current = types.SimpleNamespace(stream=S1)
    monkeypatch.setattr(
        torch._C,
        "_cuda_getCurrentStream",
        lambda device: (current.stream.stream_id, 0, 1),
        raising=False,
    )
    errors: list = []
    w = streams.StreamWatch(Races(), errors.append, capturing=lambda h: h == 0x1000 + 9)
    w.start()
    w.current, w.errors = current, errors
    yield w
    w.stop()


def test_wait_stream_is_seen_through_the_calls_it_makes(watch):
    order = watch.ordering
    order.launched(K1, 7)
    assert list(order.unordered(K2)) == [(K1, 1, 7)]
    S2.wait_stream(S1)
    assert calls == [("record", 1), ("wait", 2)], "the originals still run"
    assert list(order.unordered(K2)) == []
    assert watch.errors == []


def test_an_event_on_the_current_stream_and_a_wait_on_the_current_stream(watch):
    order = watch.ordering
    order.launched(K1, 7)
    event = FakeEvent()
    event.record()  # the current stream: S1
    watch.current.stream = S2
    event.wait()
    assert list(order.unordered(K2)) == []


def test_host_waits_complete_what_they_waited_for(watch):
    order = watch.ordering
    # torch.cuda.synchronize() is `torch._C._cuda_synchronize()` on the current device (its
    # lazy CUDA initialisation cannot run here)
    for sync in (lambda: S1.synchronize(), lambda: torch._C._cuda_synchronize()):
        order.launched(K1, 7)
        assert list(order.unordered(K2))
        sync()
        assert list(order.unordered(K2)) == []
    order.launched(K1, 7)
    event = S1.record_event()
    event.synchronize()
    assert list(order.unordered(K2)) == [] and ("event sync",) in calls


def test_calls_on_a_capturing_stream_order_nothing(watch):
    capturing = FakeStream(9)
    watch.ordering.launched(K1, 7)
    event = S1.record_event()
    event.wait(capturing)  # a wait captured into a graph: no order between replays
    assert list(watch.ordering.unordered((0, 9))) == [(K1, 1, 7)]


def test_a_collected_event_is_forgotten(watch):
    import gc

    event = S1.record_event()
    key = id(event)
    assert key in watch.ordering.events
    del event
    gc.collect()
    assert key not in watch.ordering.events


def test_stop_puts_every_original_back(monkeypatch, watch):
    watch.stop()
    assert FakeEvent.record is not None and "record" in vars(FakeEvent)
    assert not hasattr(FakeEvent.record, "__wrapped__")
    assert not hasattr(FakeStream.synchronize, "__wrapped__")
    assert not hasattr(torch._C._cuda_synchronize, "__wrapped__")


def test_a_failure_of_the_model_is_graphsans_never_the_calls(watch, monkeypatch):
    def broken(*args):
        raise RuntimeError("model broke")

    monkeypatch.setattr(watch.ordering, "recorded", broken)
    S1.record_event()  # the program's call returns as it would
    assert [str(e) for e in watch.errors] == ["model broke"]
