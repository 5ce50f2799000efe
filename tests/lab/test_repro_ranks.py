"""`graphsan repro --nproc N` on CPU: each case is a group of N processes that get torchrun's
environment; what each rank saw is kept, a rank left waiting for a failed peer is stopped and
named as such, the ranks' graphsan reports are merged, and a machine with fewer GPUs than ranks
is one clear error. The processes here are stand-ins (the cases need CUDA): a small program
that plays a rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from graphsan.cli.main import main
from graphsan.lab import repro
from graphsan.lab.repro import CaseResult, Outcome, RankResult, runner
from graphsan.lab.repro.table import print_results

SRC = str(Path(__file__).resolve().parents[2] / "src")

# rank 0 is stopped by graphsan (and writes its report); rank 1 waits forever in a collective
RANK_PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time
    result, report = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    print("ITERATION 5 t=1.0", flush=True)
    if rank == 1 and os.environ.get("FAKE_HANG"):
        time.sleep(120)
    from graphsan.command_line import write_result
    from graphsan.core.records import Finding, GraphInfo
    from graphsan.report import Report
    g = GraphInfo(1, "layers.0:layer fwd mb0", [("graphs.py", 246, "capture")], (1, 0), 0)
    f = Finding(kind="reowned", graph=g, node=209, kernel="where_kernel", param=1, offset=720,
                address=4096, nbytes=2097152, block_address=4096, pool="default pool",
                alloc_stack=[("linear.py", 415, "_alloc_rowwise")],
                free_stack=[("linear.py", 248, "clear_workspace")], phase="eval", step=5,
                rank=rank)
    Report([f], [], rank=rank).save(report)
    out = {"outcome": "StaleMemoryError", "iteration": 6, "symptom": json.dumps(env),
           "finding": "reowned: graph 'layers.0:layer fwd mb0', freed in clear_workspace"}
    with open(result, "w") as fh:
        write_result(out, fh)
    """
)


# a real rank: the child's own code, with the case trained on the CPU (tiny preset, gloo)
CPU_CHILD = textwrap.dedent(
    """
    import dataclasses, sys
    from graphsan.command_line import write_result
    from graphsan.lab.repro import child
    n, reference, result = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
    config = child.case_config

    seen = {}

    def cpu_config(case, preset, reference, mamba_heads=0, world_size=1):
        seen["world size"] = world_size
        cfg = config(case, "tiny", reference, mamba_heads, world_size)
        return dataclasses.replace(cfg, device="cpu", seq_length=32, save=result + ".ckpt")

    child.case_config = cpu_config
    res = child.run_child(n, "tiny", reference)
    res = res.replace(startup={**res.startup, **seen})
    with open(result, "w") as fh:
        write_result(res.to_json(), fh)
    """
)


def fake_ranks(monkeypatch, tmp_path, hang: bool):
    program = tmp_path / "rank.py"
    program.write_text(RANK_PROGRAM)

    def command(case, preset, reference, mamba_heads, result_path, report_path=None):
        return [sys.executable, str(program), result_path, report_path or "/dev/null"]

    monkeypatch.setattr(runner, "child_command", command)
    monkeypatch.setenv("PYTHONPATH", SRC)
    if hang:
        monkeypatch.setenv("FAKE_HANG", "1")
    else:
        monkeypatch.delenv("FAKE_HANG", raising=False)


@pytest.mark.slow
def test_a_case_trains_on_two_ranks_through_the_child_code_and_compares_with_eager(
    monkeypatch, tmp_path
):
    """Case 6 (fixed policy, compared with eager) as two gloo ranks, the experts split across
    them: both ranks train through with the same (all-reduced) losses, and the eager reference,
    also on two ranks, agrees."""
    program = tmp_path / "child.py"
    program.write_text(CPU_CHILD)

    def command(case, preset, reference, mamba_heads, result_path, report_path=None):
        return [sys.executable, str(program), str(case.n), "1" if reference else "0", result_path]

    monkeypatch.setattr(runner, "child_command", command)
    monkeypatch.setenv("PYTHONPATH", SRC)
    case = repro.BY_NUMBER[6]
    results = runner.run_matrix([case], "tiny", jobs=2, timeout=240, nproc=2)
    ((_, res),) = results
    assert [x.outcome for x in res.ranks] == ["trained through"] * 2
    assert res.startup["world size"] == 2  # the case's configuration knew of both ranks
    assert len(res.losses) == repro.ITERS
    assert res.rel_diff_after is not None and res.rel_diff_after < repro.LOSS_RTOL
    assert res.matched, res.mismatch


def test_a_case_on_two_ranks_gets_torchrun_env_and_merges_what_each_saw(monkeypatch, tmp_path):
    fake_ranks(monkeypatch, tmp_path, hang=False)
    case = repro.BY_NUMBER[4]
    res = runner.spawn(case, "small", nproc=2, report_dir=str(tmp_path), timeout=60)
    assert res.kind is Outcome.STALE_MEMORY_ERROR and res.iteration == 6
    assert [x.outcome for x in res.ranks] == ["StaleMemoryError"] * 2
    envs = [json.loads(x.symptom) for x in res.ranks]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]  # one rendezvous for the group
    # the ranks' reports, one file each, merged into the case's report
    assert sorted(p.name for p in tmp_path.glob("case4.rank*.json")) == [
        "case4.rank0.json",
        "case4.rank1.json",
    ]
    assert "seen on rank 0, rank 1:" in res.report
    assert repro.judge(case, res) == ""


def test_a_rank_left_waiting_for_a_failed_peer_is_stopped_and_named(monkeypatch, tmp_path):
    fake_ranks(monkeypatch, tmp_path, hang=True)
    case = repro.BY_NUMBER[4]
    res = runner.spawn(case, "small", nproc=2, report_dir=str(tmp_path), timeout=60, grace=1)
    assert res.kind is Outcome.STALE_MEMORY_ERROR and res.iteration == 6
    assert [x.kind for x in res.ranks] == [
        Outcome.STALE_MEMORY_ERROR,
        Outcome.PEER_FAILED,
    ]
    assert res.ranks[1].iteration == 6  # its last progress line said 5 were done
    # stopped by the grace after its peer ended, not left to its sleep or the case's timeout
    assert res.ranks[1].symptom == "still running 1 s after another rank ended: stopped"
    assert "seen on rank 0:" in res.report  # rank 1 never wrote a report
    assert repro.judge(case, res) == ""
    # the table says what each rank saw
    lines = []
    print_results([(case, res.replace(matched=True))], type("Out", (), {"write": lines.append})())
    table = "".join(lines)
    assert "what each rank saw" in table
    assert "rank 0: StaleMemoryError @6; rank 1: stopped after a peer rank failed @6" in table


def test_a_rank_that_fails_otherwise_breaks_the_match():
    case = repro.BY_NUMBER[4]
    ranks = (
        RankResult(0, "StaleMemoryError", iteration=6),
        RankResult(1, "illegal memory access", iteration=6),
    )
    res = CaseResult(
        "StaleMemoryError", iteration=6, finding="x, freed in clear_workspace", ranks=ranks
    )
    assert repro.judge(case, res).startswith("rank 1 ended in illegal memory access")


def test_an_error_after_a_peer_failed_counts_as_waiting_for_it():
    own = CaseResult("device-side assert", iteration=6)
    peer = CaseResult("died (exit 1)", iteration=7, symptom="Connection closed by peer")
    merged = runner.combine([peer, own])
    assert merged.outcome == "device-side assert" and merged.iteration == 6
    assert merged.ranks[0].kind is Outcome.PEER_FAILED
    assert "Connection closed by peer" in merged.ranks[0].symptom
    clean = runner.combine([CaseResult(losses=[1.0]), CaseResult(losses=[1.0])])
    assert clean.kind is Outcome.TRAINED_THROUGH and clean.losses == (1.0,)


def test_more_ranks_than_gpus_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["repro", "--nproc", "2", "--case", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "graphsan repro: error: --nproc 2: each rank needs a GPU of its own and this machine "
        "has 1; expected --nproc <= 1"
    ]
    assert main(["repro", "--nproc", "0"]) == 2
    assert "--nproc 0: expected >= 1" in capsys.readouterr().err


@pytest.mark.gpu
def test_case_4_on_two_gpus_stops_the_replay_on_every_rank(tmp_path):
    """The real thing: case 4 and control 2 as two-rank NCCL jobs; case 4 is stopped by graphsan
    on both ranks, control 2 trains through on both, the ranks' reports are merged."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one per rank)")
    reports = tmp_path / "reports"
    cmd = [sys.executable, "-m", "graphsan.cli", "repro", "--nproc", "2", "--case", "2"]
    cmd += ["--case", "4", "--report", str(reports), "--json", str(tmp_path / "r.json")]
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = {r["case"]["case"]: r["result"] for r in json.loads((tmp_path / "r.json").read_text())}
    assert [x["outcome"] for x in rows[2]["ranks"]] == ["trained through"] * 2
    assert [x["outcome"] for x in rows[4]["ranks"]] == ["StaleMemoryError"] * 2
    assert sorted(p.name for p in reports.iterdir()) == ["case4.rank0.json", "case4.rank1.json"]
    assert "seen on rank 0, rank 1:" in rows[4]["report"]
