"""GPU: `graphsan selftest` on this machine (every correct program quiet, every twin caught),
the startup probe's layouts, and graphsan under the cudaMallocAsync allocator backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu_programs import ROOT, run_program

pytestmark = pytest.mark.gpu

ASYNC = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}


def selftest(tmp_path, *args: str, env: dict | None = None) -> tuple[int, dict, str]:
    out = tmp_path / "selftest.json"
    full_env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "graphsan.cli", "selftest", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=540,
        env=full_env,
    )
    log = proc.stdout + proc.stderr
    return proc.returncode, json.loads(out.read_text()) if out.exists() else {}, log


@pytest.mark.slow
def test_selftest_is_quiet_on_every_correct_program_and_catches_every_twin(tmp_path):
    rc, data, log = selftest(tmp_path)
    assert rc == 0, log[-6000:]
    runs = data["runs"]
    correct = [r for r in runs if r["kind"] == "correct" and r["verdict"] != "skipped"]
    bugs = [r for r in runs if r["kind"] == "bug" and r["verdict"] != "skipped"]
    assert len(correct) >= 40 and all(r["verdict"] == "ok" for r in correct)
    assert all(r["verdict"] == "caught" for r in bugs) and len(bugs) == len(correct)
    assert f"quiet on {len(correct)}/{len(correct)} correct programs" in log
    assert all(r["graphs"] for r in runs if r["verdict"] != "skipped")


@pytest.mark.slow
def test_selftest_under_the_cuda_malloc_async_backend(tmp_path):
    """The driver watch: correct programs quiet, their twins stopped, under the allocator that
    gives graphsan no block map and no free events."""
    picks = ["elementwise/strided-views", "optim/adamw-foreach", "patterns/static-kv-cache-decode"]
    for name in picks:
        rc, data, log = selftest(tmp_path, "-k", name, env=ASYNC)
        assert rc == 0, log[-4000:]
        assert {r["verdict"] for r in data["runs"]} == {"ok", "caught"}, data["runs"]


def test_the_startup_probe_confirms_every_family():
    rc, result, log = run_program("calibrate", policy="record")
    assert rc == 0, log[-3000:]
    fams = result["layouts"]["0"]["families"]
    assert set(fams.values()) == {"confirmed"}, fams
    assert result["caveats"] == 0


def test_enable_under_cuda_malloc_async_says_one_line_and_stops_a_stale_replay():
    rc, result, log = run_program("async_stale", policy="raise", env=ASYNC)
    assert rc == 0, log[-3000:]
    assert log.count("the cudaMallocAsync allocator backend keeps no block map") == 1
    assert result["replay"] == "raised", log[-3000:]
    assert result["error_kinds"] in (["freed"], ["reowned"])
    assert result["healthy"]
    # its output was never allocated: kept alive, said once, and the process exits cleanly
    assert log.count("was stopped before its first launch under cudaMallocAsync") == 1, log
    assert "invalid argument" not in log
