"""tests/once.py: a costly fixture's work runs once per run, however xdist spreads its tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parent.parent

# Eight tests share a module fixture, with no xdist group: `--dist load` hands them to both
# workers, and each worker's fixture asks `once` for the work (which appends a line to a log).
SUITE = """
import json, os, sys, time
sys.path.insert(0, {root!r})
import pytest
from tests.once import once

def worker(request):
    return getattr(request.config, "workerinput", {{"workerid": "master"}})["workerid"]

@pytest.fixture(scope="module")
def shared(request):
    worker_id = worker(request)
    def work(folder):
        with open({log!r}, "a") as fh:
            fh.write(worker_id + "\\n")
        time.sleep(0.5)  # the other worker asks meanwhile, and waits
        (folder / "made").write_text("by " + worker_id)
        return {{"folder": str(folder), "by": worker_id, "pair": (1, 2)}}
    return once(request, "shared", work)

@pytest.mark.parametrize("i", range(8))
def test_uses_it(i, shared, request):
    worker_id = worker(request)
    time.sleep(0.1)
    assert shared["pair"] == [1, 2]  # the same shape in every worker: read back as JSON
    assert open(os.path.join(shared["folder"], "made")).read() == "by " + shared["by"]
    with open({log!r} + ".tests", "a") as fh:  # a worker's output does not reach the run's
        fh.write(f"{{worker_id}} {{shared['by']}}\\n")
"""


def test_two_workers_share_one_run_of_the_work(pytester, tmp_path):
    log = tmp_path / "work.log"
    pytester.makepyfile(test_suite=SUITE.format(root=str(ROOT), log=str(log)))
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "load", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=8)
    ran = [line.split() for line in Path(f"{log}.tests").read_text().splitlines()]
    assert {worker for worker, _ in ran} == {"gw0", "gw1"}, "both workers took tests"
    assert len({by for _, by in ran}) == 1, ran
    assert log.read_text().split() == [ran[0][1]], "the work ran once"


def test_without_xdist_the_work_runs_in_this_process(pytester, tmp_path):
    log = tmp_path / "work.log"
    pytester.makepyfile(test_suite=SUITE.format(root=str(ROOT), log=str(log)))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", "-q")
    result.assert_outcomes(passed=8)
    assert log.read_text().split() == ["master"]


class Worker:
    """A fixture's `request` as an xdist worker sees it: its temporary folder inside the run's
    (`run`)."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.config = type("Config", (), {"workerinput": {"workerid": "gw0"}})()

    def getfixturevalue(self, name: str):
        assert name == "tmp_path_factory"
        return self

    def getbasetemp(self) -> Path:
        return self.run / "popen-gw0"


def test_a_failed_work_is_done_again_by_the_next_to_ask(tmp_path):
    """The first caller's work raises: no result is left, and the next caller does it."""
    from tests.once import once

    factory, calls = Worker(tmp_path), []

    def failing(folder):
        calls.append(folder)
        raise RuntimeError("the job failed")

    with pytest.raises(RuntimeError, match="the job failed"):
        once(factory, "fails-first", failing)
    value = once(factory, "fails-first", lambda folder: {"made": str(folder)})
    assert len(calls) == 1 and value["made"] != str(calls[0])
    assert once(factory, "fails-first", failing) == value  # done: read back
    shared = tmp_path / "once-fails-first"
    assert json.loads((shared / "result.json").read_text()) == value
