"""A costly fixture's work done once per test run, however pytest-xdist spreads the tests that
use it over its workers.

The tests that share such a fixture carry an `xdist_group` mark, so that `--dist loadgroup`
(pyproject.toml) sends them to one worker. Newer pytest releases lose that mark on the way to
the scheduler (pytest-xdist issue 1386: the group is written into a field of the test's id that
pytest 9.2 no longer reads), and each worker that gets one of the tests would redo the
work. `once` makes that cost nothing: the first worker to ask does the work, under a lock in
the folder all workers of the run share, and the others wait for it and read its result.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def once(request, name: str, work: Callable[[Path], object]) -> object:
    """`work(folder)`'s result (JSON: what it returns must survive `json.dumps`), computed by
    the first of this run's workers to ask for `name`, in a fresh folder all of them can read
    (`request`: the asking fixture's). A worker whose `work` raised leaves no result: the next to
    ask does the work again."""
    factory = request.getfixturevalue("tmp_path_factory")
    if not hasattr(request.config, "workerinput"):  # no xdist worker: this process is the run
        return json.loads(json.dumps(work(factory.mktemp(name))))
    # the workers' temporary folders share a parent that is this run's alone
    shared = factory.getbasetemp().parent / f"once-{name}"
    shared.mkdir(exist_ok=True)
    result = shared / "result.json"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, raised or not
        if not result.exists():
            value = work(Path(tempfile.mkdtemp(prefix="work-", dir=shared)))
            partial = shared / "result.json.tmp"
            partial.write_text(json.dumps(value))
            os.replace(partial, result)
        return json.loads(result.read_text())  # the same shape in every worker
