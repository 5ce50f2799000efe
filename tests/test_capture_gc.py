"""graphsan's own work inside a program's open capture never sets off a garbage collection:
one that runs there can destroy an unreachable CUDA graph of the program, and destroying a
graph while a stream captures invalidates the capture ("operation not permitted when stream
is capturing", then "operation failed due to a previous error during capture" at its end).
PyTorch's test_graph_cudnn_dropout failed so under graphsan on the GPU: walking a captured
LSTM keeps thousands of objects, enough to start a collection inside the capture."""

from __future__ import annotations

import gc

import pytest

from graphsan.core.records import WalkStats
from graphsan.cuda import driver
from tests import fake_cuda


class Capturing:
    """Whether the fake stream is capturing, and the collections that started meanwhile."""

    def __init__(self) -> None:
        self.now = False
        self.collections_during_capture = 0

    def __call__(self, phase: str, info: dict) -> None:  # gc.callbacks
        if phase == "start" and self.now:
            self.collections_during_capture += 1


@pytest.fixture
def env(monkeypatch, attach):
    state = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    cls = fake_cuda.graph_class(monkeypatch, (1, 3), attach)
    capturing = Capturing()
    begin, end = cls.capture_begin, cls.capture_end

    def capture_begin(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        capturing.now = True

    def capture_end(self, *args, **kwargs):
        capturing.now = False
        end(self, *args, **kwargs)

    monkeypatch.setattr(cls, "capture_begin", capture_begin)
    monkeypatch.setattr(cls, "capture_end", capture_end)
    # a graph of many nodes, read afresh by each walk, as the driver's walk does
    monkeypatch.setattr(
        driver,
        "walk",
        lambda graph: (
            [fake_cuda.kernel(i, fake_cuda.SEG) for i in range(1000)],
            WalkStats(1000, 1),
        ),
    )
    state["cls"], state["capturing"] = cls, capturing
    return state


@pytest.mark.parametrize("policy", ["raise", "record", "pin"])
def test_no_collection_starts_inside_a_capture_from_graphsans_work(env, fake_sanitizer, policy):
    fake_sanitizer(env, policy)
    capturing = env["capturing"]
    thresholds = gc.get_threshold()
    gc.callbacks.append(capturing)
    try:
        gc.set_threshold(200, 2, 2)  # the walk's objects alone would start several
        for _ in range(2):
            g = env["cls"]()
            gc.collect()  # the program's own objects start none inside the capture
            g.capture_begin()
            g.capture_end()
            g.replay()
    finally:
        gc.callbacks.remove(capturing)
        gc.set_threshold(*thresholds)
    assert capturing.collections_during_capture == 0
    assert gc.isenabled(), "graphsan gives the collector back as it found it"


def test_threads_inside_at_once_leave_the_collector_as_they_found_it():
    import threading

    from graphsan.cuda.owners import no_collection

    entered, leave = threading.Event(), threading.Event()

    def later_and_longer():
        with no_collection():
            entered.set()
            leave.wait(10)

    other = threading.Thread(target=later_and_longer)
    with no_collection():  # this thread first: it found the collector on
        other.start()
        assert entered.wait(10)
    assert not gc.isenabled(), "the first thread out gave the collector back under the other"
    leave.set()
    other.join(10)
    assert gc.isenabled(), "the last thread out gives it back"
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled(), "a program that turned the collector off keeps it off"
    finally:
        gc.enable()
