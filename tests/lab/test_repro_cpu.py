"""CPU checks of the scenario matrix: every case builds a valid configuration (checked without
training it; one case trains eagerly, through the child's own code path), each case's expected
outcome matches what the H200 showed and nothing else, the exit status says whether every case
matched, and the command explains that the cases need CUDA."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import pytest
import torch

from graphsan.cli.main import main
from graphsan.lab import repro
from graphsan.lab.choices import StatePolicy
from graphsan.lab.models import build_model
from graphsan.lab.repro import CaseResult, Outcome, child, compare, logparse, runner
from graphsan.lab.train.recipes import bind_precision


@pytest.mark.parametrize("case", repro.CASES, ids=lambda c: f"case{c.n}")
def test_each_case_builds_the_configuration_it_names(case):
    for reference in (False, True):
        cfg = dataclasses.replace(repro.case_config(case, "small", reference), device="cpu")
        cfg.validate()
        assert cfg.cuda_graph_modules == (() if reference else case.scopes)
        assert cfg.state_policy is (StatePolicy.FIXED if reference else case.state)
        assert cfg.precision_config == case.precision
        assert cfg.empty_cache_on_save == case.empty_cache
        assert cfg.eval_interval == cfg.save_interval == cfg.manual_gc_interval == repro.EVAL_AT
        assert cfg.cuda_graph_warmup_steps == repro.WARMUP < repro.EVAL_AT < cfg.train_iters
        assert cfg.model_overrides == repro.WIDE_MAMBA["small"]
        # the recipes bind to the model the matrix builds (on the meta device: no memory)
        model = build_model(cfg.model_args(), device="meta")
        table = dict(bind_precision(model, cfg)[0])
        out_proj = table["layers.0.mixer.out_proj"]
        assert out_proj.startswith("nvfp4" if "nvfp4-outproj" in case.precision else "mxfp8")
        last = f"layers.{len(model.args.pattern) - 1}.mixer"
        assert all(d.startswith("bf16") for p, d in table.items() if p.startswith(last))
    assert case.graphsan in ("off", "raise", "record", "pin")


def test_a_child_trains_case_1_eagerly_and_reports_losses_progress_and_startup(monkeypatch, capsys):
    """Case 1's configuration (super-mixed, te218, validation + save + GC at iteration 5) on
    the tiny preset, run by the child's code as the matrix runs it (graphs run eagerly here)."""
    config = repro.case_config

    def cpu_config(case, preset, reference, mamba_heads=0, world_size=1):
        cfg = config(case, "tiny", reference, mamba_heads, world_size)
        return dataclasses.replace(cfg, device="cpu", seq_length=32, save="/tmp/graphsan-child")

    monkeypatch.setattr(child, "case_config", cpu_config)
    res = child.run_child(1, "tiny", reference=False)
    assert res.outcome == "trained through" and len(res.losses) == repro.ITERS
    assert all(x == x for x in res.losses)
    assert [it for it, _ in res.eval_losses] == [repro.EVAL_AT]
    phases = res.startup
    assert list(phases)[-3:] == ["model built", "first forward", "first backward"]
    assert phases["imports"] <= phases["model built"] <= phases["first forward"]
    assert len(logparse.iteration_times(capsys.readouterr().out)) == repro.ITERS


def test_list_needs_no_gpu_and_shows_each_expectation(capsys):
    assert main(["repro", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {c.n} |" in out for c in repro.CASES)
    assert "| illegal memory access or device-side assert or silent corruption: " in out


def test_list_json_writes_the_case_table(capsys, tmp_path):
    assert main(["repro", "--list", "--json"]) == 0
    captured = capsys.readouterr()
    cases = json.loads(captured.out)  # the JSON alone on stdout; the table went to stderr
    assert "| case |" in captured.err
    assert [c["case"] for c in cases] == [c.n for c in repro.CASES]
    assert cases[0]["expected"] == [
        "illegal memory access",
        "device-side assert",
        "silent corruption",
    ]
    assert cases[1]["expected"] == ["trained through"] and cases[3]["expected"] == [
        "StaleMemoryError"
    ]
    assert cases[3]["finding_freed_in"] == "clear_workspace"
    assert cases[2]["graphed_modules"] == list(repro.NO_MAMBA)
    path = tmp_path / "cases.json"
    assert main(["repro", "--list", "--case", "4", "--json", str(path)]) == 0
    assert [c["case"] for c in json.loads(path.read_text())] == [4]
    assert main(["repro", "--list", "--json", str(tmp_path / "no" / "x.json")]) == 2
    assert "the folder" in capsys.readouterr().err


def test_without_cuda_it_explains_and_fails(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["repro", "--case", "1"]) == 4  # not 1: no case ended unexpectedly
    assert "need an NVIDIA GPU" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--case", "42"], f"no case 42; expected 1-{len(repro.CASES)}"),
        (["--timeout", "0"], "--timeout 0.0: expected a number of seconds > 0"),
        (["--timeout", "nan"], "--timeout nan: expected"),
        (["--jobs", "-1"], "--jobs -1: expected >= 0"),
        (["--preset", "huge"], "--preset huge: expected one of tiny, small, super"),
        (["--mamba-heads", "3"], "--mamba-heads 3: mamba_num_heads=3 must be a multiple"),
        (["--json", "/nonexistent/r.json"], "--json /nonexistent/r.json: the folder"),
    ],
)
def test_bad_options_are_one_clear_error(argv, needle, capsys):
    assert main(["repro", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_case_that_overruns_its_time_is_reported_not_waited_for(monkeypatch):
    """The child reports one iteration, then hangs far longer than the test allows."""
    hang = "print('ITERATION 1 t=0.1', flush=True); import time; time.sleep(120)"
    monkeypatch.setattr(runner, "child_command", lambda *a: [sys.executable, "-c", hang])
    res = runner.spawn(repro.CASES[0], "tiny", timeout=3)
    assert res.outcome == "timed out after 3 s"  # killed, not left to finish its sleep
    assert res.iteration == 2  # how far it got: the iteration after the last one logged
    assert res.timeline == (0.1,)
    assert res.kind is Outcome.OTHER


def test_compare_covers_iterations_both_runs_have_and_counts_nan_as_infinite():
    ref = CaseResult(losses=[5.0, 4.9, 4.8, 4.7, 4.6, 4.5, 4.4])
    res = CaseResult(losses=[5.0, 4.9, 4.8, 4.7, 4.6 * (1 + 2e-4), float("nan")])
    c = compare.compare(res, ref)
    assert c.before == pytest.approx(2e-4)
    assert c.after == float("inf")
    assert (
        "2.0e-04 up to validation, inf after; first off by more than 0.01 at iteration 6: "
        "nan vs eager 4.5" in c.text
    )
    compared = compare.add_comparison(res, ref)
    assert (compared.rel_diff_before, compared.rel_diff_after) == (c.before, c.after)
    assert compared.compared_from == repro.EVAL_AT + 1
    assert compared.reference_losses == ref.losses and compared.comparison == c.text
    short = CaseResult(losses=[5.0, 4.9])
    assert compare.compare(short, ref).text == "no losses after validation to compare"


def test_a_schedule_case_is_compared_from_its_first_graphed_step():
    """Cases 10 and 12 can go wrong from the first graphed step: their losses are split there,
    so a run that stopped on a NaN before validation still shows how it parted from eager."""
    ref = CaseResult(losses=[5.0, 4.9, 4.8, 4.7, 4.6, 4.5, 4.4])
    res = CaseResult("silent corruption", 5, losses=[5.0, 4.9, 4.8, 4.9, float("nan")])
    case = repro.BY_NUMBER[12]
    assert case.fails_from == repro.WARMUP + 1
    c = compare.compare(res, ref, case.fails_from)
    assert (c.before, c.after) == (0.0, math.inf)
    assert c.rel_diff[3] == pytest.approx(0.2 / 4.7)
    assert c.text == (
        "loss vs eager: max rel diff 0.0e+00 up to iteration 3, inf from iteration 4; "
        "first off by more than 0.01 at iteration 4: 4.9 vs eager 4.7"
    )
    compared = compare.add_comparison(res, ref, case.fails_from)
    assert compared.compared_from == 4 and compared.outcome == "silent corruption"
    assert compare.judge(case, compared) == ""
    # a run that trained through with its losses off from the split on is silent corruption
    drifted = CaseResult(losses=[5.0, 4.9, 4.8, 4.75, 4.6, 4.5, 4.4])
    assert compare.add_comparison(drifted, ref, 4).outcome == "silent corruption"
    assert compare.add_comparison(drifted, ref).outcome == "trained through"  # before iteration 6
    early = CaseResult(losses=[5.0, 4.9])
    assert compare.compare(early, ref, 4).text == "no losses from iteration 4 to compare"


def test_timeline_and_iteration_come_from_the_child_progress_lines():
    log = "noise\nITERATION 1 t=3.5\nITERATION 2 t=4.0\nTraceback\nCUDA error: an illegal x\n"
    assert logparse.iteration_times(log) == [3.5, 4.0]
    assert logparse.last_logged_iteration(log) == 3  # it died in the iteration after the last one
    assert logparse.first_error_line(log) == "CUDA error: an illegal x"


def _fake_spawn(outcomes: dict[int, dict], spawned: list | None = None):
    def fake_spawn(case, preset, reference=False, timeout=300, threads=0, mamba_heads=0, **_):
        if spawned is not None:
            spawned.append((case.n, reference, threads, mamba_heads))
        losses = [5.0 - 0.1 * i for i in range(repro.ITERS)]
        res = {"outcome": "trained through", "losses": losses, "wall_s": 1.0, "finding": ""}
        if not reference:
            res.update(outcomes.get(case.n, {}))
        return CaseResult(**res)

    return fake_spawn


def test_matrix_runs_each_case_once_and_compares_with_one_eager_reference(monkeypatch):
    spawned = []
    drifted = [5.0 - 0.1 * i for i in range(repro.ITERS)]
    drifted[repro.EVAL_AT] *= 1.5  # the corrupted case drifts after validation
    early = [5.0 - 0.1 * i for i in range(repro.ITERS)]
    early[repro.WARMUP] *= 1.5  # a schedule case drifts at its first graphed step
    outcomes = {5: {"losses": drifted}, 10: {"losses": early}}
    monkeypatch.setattr(runner, "spawn", _fake_spawn(outcomes, spawned))
    results = dict((c.n, r) for c, r in repro.run_matrix(repro.CASES, "tiny", jobs=0))
    assert sorted((n, ref) for n, ref, *_ in spawned) == sorted(
        [(c.n, False) for c in repro.CASES] + [(5, True)]
    )
    # the cores are shared out, so the processes' CPU threads do not oversubscribe the machine
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 16)
    spawned.clear()
    repro.run_matrix(repro.CASES, "tiny", jobs=0)
    assert {threads for *_, threads, _ in spawned} == {1}
    spawned.clear()
    repro.run_matrix(repro.CASES[:1], "tiny", jobs=0)
    assert {threads for *_, threads, _ in spawned} == {16}  # one process alone gets every core
    spawned.clear()
    repro.run_matrix(repro.CASES[4:6], "tiny", jobs=0, mamba_heads=128)
    assert [heads for *_, heads in spawned] == [128, 128, 128]  # every case and the reference
    assert results[6].outcome == "trained through"
    assert results[6].comparison.endswith("0.0e+00 after")
    assert results[5].outcome == "silent corruption"  # 0.5 relative > LOSS_RTOL
    assert results[10].compared_from == repro.WARMUP + 1 and results[5].compared_from == 6
    assert results[10].outcome == "silent corruption"  # off at iteration 4, before validation
    assert f"at iteration {repro.WARMUP + 1}" in results[10].comparison


# What each case has shown on GPUs (the report docs/te-3316.md quotes among them), and the other
# symptoms docs/te-3316.md reports for the same mechanism (one module per expert, wider workspaces).
FINDING = (
    "reowned: layers.0:layer fwd mb0 node 209 at::native::elementwise_kernel<> "
    "[where_kernel_impl] param 1+720 -> 2097152 B block at 0x2a92370000 (default pool), freed "
    "at src/graphsan/lab/quant/linear.py:248 in clear_workspace (phase eval, step 5)"
)
SEEN = {
    1: [
        {"outcome": "device-side assert", "iteration": 6},
        {"outcome": "illegal memory access", "iteration": 6},
        {"outcome": "silent corruption", "iteration": 6},
    ],
    2: [{"outcome": "trained through"}],
    3: [{"outcome": "trained through"}],
    4: [{"outcome": "StaleMemoryError", "iteration": 6, "finding": FINDING}],
    5: [
        {"outcome": "device-side assert", "iteration": 6, "finding": FINDING},
        {"outcome": "silent corruption", "iteration": 6, "finding": FINDING},
    ],
    6: [{"outcome": "trained through", "rel_diff_after": 3.1e-3}],
    7: [{"outcome": "trained through"}],
    8: [{"outcome": "silent corruption", "iteration": 7}],
    9: [{"outcome": "StaleMemoryError", "iteration": 6, "finding": FINDING}],
    10: [{"outcome": "device-side assert", "iteration": 4}],
    11: [
        {
            "outcome": "StaleMemoryError",
            "iteration": 4,
            "finding": "replay-order: layers.11:front bwd mb0 node 18 "
            "at::native::vectorized_elementwise_kernel<> param 2+8 -> 28160 B block, "
            "written by graph #12, overwritten by graph #31 (phase train (no_grad), step 6)",
        }
    ],
    12: [{"outcome": "silent corruption", "iteration": 5}],
    13: [
        {
            "outcome": "StaleMemoryError",
            "iteration": 4,
            "finding": "live-output: layers.0:layer fwd mb1 node 7 at::native::elementwise_kernel<> "
            "[BinaryFunctor, MulFunctor] param 1+608 -> 256 B block at 0x1ebf0121700 (graph's own "
            "private pool (0, 1)), holds graph #1's output, still held by the caller (phase train "
            "(no_grad), step 6)",
        }
    ],
}


@pytest.mark.parametrize("case", repro.CASES, ids=lambda c: f"case{c.n}")
def test_what_the_h200_showed_matches_and_other_outcomes_do_not(case):
    if case.n not in SEEN:
        pytest.skip(f"case {case.n} has not run on the H200 yet: nothing seen to hold it to")
    for res in SEEN[case.n]:
        assert repro.judge(case, CaseResult(**res)) == "", res
    seen = {Outcome(r["outcome"]) for r in SEEN[case.n]}
    assert seen <= case.expected
    for other in set(Outcome) - case.expected:
        res = dict(SEEN[case.n][0], outcome=other.value)
        assert repro.judge(case, CaseResult(**res)).startswith("expected "), other


def test_a_match_needs_the_right_iteration_finding_and_comparison():
    by = repro.BY_NUMBER
    early = CaseResult("device-side assert", iteration=repro.EVAL_AT)
    assert "expected after validation" in repro.judge(by[1], early)
    elsewhere = CaseResult("StaleMemoryError", iteration=6, finding="freed: x, freed at a")
    assert "freed in clear_workspace" in repro.judge(by[4], elsewhere)
    unrecorded = CaseResult("device-side assert", iteration=6, finding="")
    assert "freed in clear_workspace" in repro.judge(by[5], unrecorded)
    inconclusive = CaseResult("trained through", comparison="inconclusive: the eager x")
    assert "inconclusive" in repro.judge(by[6], inconclusive)
    assert repro.judge(by[1], CaseResult("timed out after 300 s", iteration=6)) != ""


def test_the_exit_status_says_whether_every_case_matched(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a fake GPU")
    as_seen = {n: dict(seen[0], wall_s=1.0) for n, seen in SEEN.items()}
    as_seen[5]["losses"] = []  # it crashed: nothing to compare after validation
    monkeypatch.setattr(runner, "spawn", _fake_spawn(as_seen))
    path = tmp_path / "results.json"
    seen_cases = [arg for n in SEEN for arg in ("--case", str(n))]  # a new case has no SEEN yet
    assert main(["repro", "--json", str(path), *seen_cases]) == 0
    out = capsys.readouterr().out
    assert out.count("| yes |") == len(SEEN)
    results = json.loads(path.read_text())
    assert all(r["result"]["matched"] for r in results)
    assert results[0]["case"]["expected"][0] == "illegal memory access"

    as_seen[2] = {"outcome": "device-side assert", "iteration": 6}  # a control that crashed
    monkeypatch.setattr(runner, "spawn", _fake_spawn(as_seen))
    assert main(["repro", "--case", "2", "--case", "4"]) == 1
    captured = capsys.readouterr()
    assert "| device-side assert | NO: expected trained through |" in captured.out
    assert captured.out.count("| yes |") == 1
    assert captured.err.strip().splitlines() == [
        "graphsan repro: case 2 (control: MXFP8 everywhere) did not end as expected: "
        "device-side assert; expected trained through"
    ]


def test_a_case_named_twice_runs_once_in_the_order_given(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a fake GPU")
    spawned = []
    as_seen = {n: dict(seen[0], wall_s=1.0) for n, seen in SEEN.items()}
    monkeypatch.setattr(runner, "spawn", _fake_spawn(as_seen, spawned))
    assert main(["repro", "--case", "4", "--case", "2", "--case", "4", "--jobs", "1"]) == 0
    assert [n for n, reference, *_ in spawned if not reference] == [4, 2]
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 4 |")]
    assert len(rows) == 1, rows


def test_a_broken_reference_makes_the_comparison_inconclusive_not_clean():
    res = CaseResult(losses=[5.0] * repro.ITERS)
    for ref in (
        CaseResult("timed out after 240 s", losses=[]),
        CaseResult("trained through", losses=[5.0] * (repro.ITERS - 1) + [float("nan")]),
    ):
        c = compare.compare(res, ref)
        assert c.text.startswith("inconclusive: the eager reference")
        assert c.after is None and compare.add_comparison(res, ref).rel_diff_after is None


def test_mamba_heads_widen_only_the_mamba():
    case = repro.CASES[0]
    default = repro.case_config(case, "small", reference=False).model_overrides
    wide = repro.case_config(case, "small", reference=False, mamba_heads=256).model_overrides
    assert default == {"mamba_num_heads": 64, "mamba_head_dim": 64}
    assert wide == {"mamba_num_heads": 256, "mamba_head_dim": 64}
    parser = argparse.ArgumentParser()
    repro.add_arguments(parser)
    args = parser.parse_args(["--mamba-heads", "128", "--case", "1"])
    assert args.mamba_heads == 128


def test_a_schedule_case_fails_from_its_first_graphed_step_and_names_the_order():
    """Cases 10 and 11 replay graphs out of capture order from the first graphed step (before
    validation), and graphsan's first finding must be one of the order's kinds."""
    by = repro.BY_NUMBER
    first_graphed = repro.WARMUP + 1
    assert repro.judge(by[10], CaseResult("device-side assert", iteration=first_graphed)) == ""
    early = CaseResult("device-side assert", iteration=first_graphed - 1)
    assert f"expected from iteration {first_graphed}" in repro.judge(by[10], early)
    order = CaseResult("StaleMemoryError", iteration=first_graphed, finding="replay-order: g")
    assert repro.judge(by[11], order) == ""
    freed = CaseResult("StaleMemoryError", iteration=first_graphed, finding="freed: g")
    assert "live-output or replay-order" in repro.judge(by[11], freed)
    assert (
        by[11].to_json()["schedule"] == "1f1b" and by[11].to_json()["captured_in"] == "sequential"
    )
