"""CPU: `graphsan run --report` loses nothing when the job is stopped: on SIGTERM (SIGHUP,
SIGUSR1) it writes its report as on Ctrl-C, then ends by the signal; under torchrun, where one
rank's failure makes torchrun terminate the others, every rank's report is written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.gpu_programs import ROOT

pytest_plugins = ["pytester"]

ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PYTHONUNBUFFERED="1")

WAITER = """
import sys, time
print("started", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGUSR1"])
def test_a_stop_signal_writes_the_report_then_ends_by_the_signal(tmp_path, name):
    prog = tmp_path / "prog.py"
    prog.write_text(WAITER)
    report = tmp_path / "out.json"
    sig = getattr(signal, name)
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphsan.cli", "run", "--report", str(report), str(prog)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        # a program that does not handle the signal, whatever the test run inherited (under
        # nohup, SIGHUP is ignored, and graphsan leaves a signal the program ignores ignored)
        preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL),
    )
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -sig, err  # died of the signal, as without graphsan
    assert json.loads(report.read_text())["schema"] == "graphsan.report"
    assert f"graphsan: report written to {report}" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_under_torchrun_a_failed_rank_and_a_terminated_one_both_write_their_reports(tmp_path):
    prog = tmp_path / "prog.py"
    # rank 1 fails only once rank 0's program runs, so once graphsan there catches SIGTERM: a
    # rank 0 slower to start would otherwise be stopped before it could write a report
    prog.write_text(
        "import os, sys, time\n"
        "running = os.path.join(os.path.dirname(__file__), 'rank0.running')\n"
        "if os.environ['RANK'] == '1':\n"
        "    deadline = time.monotonic() + 100\n"
        "    while not os.path.exists(running) and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "    sys.exit('rank 1 fails')\n"
        "open(running, 'w').close()\n"
        "time.sleep(600)\n"
    )
    report = tmp_path / "out.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "-m",
            "graphsan.cli",
            "run",
            "--report",
            str(report),
            str(prog),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    # rank 0's report is written only when torchrun stops it: its program sleeps past the timeout
    assert proc.returncode != 0 and (tmp_path / "rank0.running").exists(), proc.stderr[-3000:]
    for rank in (0, 1):
        data = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert data["rank"] == rank
    assert "[rank 0] graphsan: report written to" in proc.stderr


def test_report_refuses_to_write_over_a_report_it_reads(tmp_path, capsys):
    from graphsan.cli.main import main
    from graphsan.report import Report

    path = tmp_path / "r.json"
    Report([]).save(str(path))
    before = path.read_text()
    for option in ("--trace", "--html"):
        assert main(["report", option, str(path), str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"graphsan report: error: {option} {path}: that is one of the reports being read; "
            "writing it would replace the report (expected another path)"
        )
    assert path.read_text() == before


def test_the_shipped_samples_render_without_a_gpu(tmp_path, capsys):
    from graphsan.cli.main import main

    assert main(["report", "--sample", "stale-input"]) == 0
    out = capsys.readouterr().out
    # the line numbers are the recording's (scripts/make_samples.py records it again)
    assert re.search(r"UNMAPPED: graph #1 'stale_input.py:\d+'", out) and "empty_cache()" in out
    assert main(["report", "--sample", "te3316-case4"]) == 0
    assert "FREED: graph #1 'layers.0:layer fwd mb0'" in capsys.readouterr().out
    html, trace = tmp_path / "s.html", tmp_path / "s.trace.json"
    assert (
        main(["report", "--sample", "te3316-case4", "--html", str(html), "--trace", str(trace)])
        == 0
    )
    assert "<html" in html.read_text() and json.loads(trace.read_text())["traceEvents"]


def test_a_gzipped_report_loads_like_a_plain_one(tmp_path):
    import gzip

    from graphsan.report import Report

    plain = tmp_path / "r.json"
    Report([], rank=3).save(str(plain))
    packed = tmp_path / "r.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert Report.load(str(packed)).rank == 3


def test_the_example_says_in_one_line_that_it_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the example runs")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "stale_input.py")],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "examples/stale_input.py needs an NVIDIA GPU; `graphsan report --sample stale-input` "
        "shows the report graphsan gives for it (recorded on an H200)"
    ]


def test_run_gives_the_program_an_absolute_file_and_ranks_its_traceback(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text("import os\nprint(os.path.isabs(__file__))\nraise ValueError('boom')\n")
    env = dict(ENV, WORLD_SIZE="2", RANK="1")
    proc = subprocess.run(
        [sys.executable, "-m", "graphsan.cli", "run", "prog.py"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stdout.strip() == "True"
    tb = [x for x in proc.stderr.splitlines() if "Traceback" in x or "ValueError" in x]
    assert tb and all(x.startswith("[rank 1] ") for x in tb), proc.stderr


def test_report_refuses_the_same_report_twice(tmp_path, capsys):
    from graphsan.cli.main import main
    from graphsan.report import Report

    path = tmp_path / "r.json"
    Report([]).save(str(path))
    assert main(["report", str(path), str(tmp_path / "." / "r.json")]) == 2
    assert "is given twice; each report counts once" in capsys.readouterr().err


def test_the_plugin_says_when_the_policy_it_got_is_a_missing_test_path(pytester):
    bad = pytester.runpytest_subprocess("--graphsan", "tests_typo_dir")
    assert bad.ret != 0
    bad.stderr.fnmatch_lines(
        ["*unknown policy 'tests_typo_dir' (and no file or folder has that name)*"]
    )
