"""CPU checks of the scenario matrix: every case's configuration is valid and trains (eagerly, on
the tiny preset); the command explains that the cases need CUDA."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from graphsan.cli import main
from graphsan.lab import repro
from graphsan.lab.train.trainer import train


@pytest.mark.parametrize("case", repro.CASES, ids=lambda c: f"case{c.n}")
def test_case_configuration_is_valid_and_trains_eagerly_on_cpu(case):
    cfg = dataclasses.replace(
        repro._config(case, "tiny", reference=False),
        device="cpu",
        seq_length=32,
        save=f"/tmp/graphsan-repro-test-{case.n}",
    )
    cfg.validate()
    assert cfg.cuda_graph_modules == case.scopes
    assert cfg.eval_interval == cfg.save_interval == cfg.manual_gc_interval == repro.EVAL_AT
    result = train(cfg)
    assert len(result.losses) == repro.ITERS and all(x == x for x in result.losses)
    assert [it for it, _ in result.eval_losses] == [repro.EVAL_AT]


def test_list_needs_no_gpu(capsys):
    assert main(["repro", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {c.n} |" in out for c in repro.CASES)


def test_without_cuda_it_explains_and_fails(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["repro", "--case", "1"]) == 1
    assert "need an NVIDIA GPU" in capsys.readouterr().err


def test_unknown_case_is_one_clear_error(capsys):
    assert main(["repro", "--case", "42"]) == 2
    assert f"no case 42; expected 1-{len(repro.CASES)}" in capsys.readouterr().err


def test_a_case_that_overruns_its_time_is_reported_not_waited_for():
    res = repro._spawn(repro.CASES[0], "tiny", timeout=0.5)
    assert res["outcome"] == "timed out after 0 s" or res["outcome"].startswith("timed out")
    assert res["wall_s"] < 30


def test_compare_covers_iterations_both_runs_have_and_counts_nan_as_infinite():
    ref = {"losses": [5.0, 4.9, 4.8, 4.7, 4.6, 4.5, 4.4]}
    res = {"losses": [5.0, 4.9, 4.8, 4.7, 4.6 * (1 + 2e-4), float("nan")]}
    text = repro._compare(res, ref)
    assert res["rel_diff_before_eval"] == pytest.approx(2e-4)
    assert res["rel_diff_after_eval"] == float("inf")
    assert "2.0e-04 up to validation, inf after" in text
    short = {"losses": [5.0, 4.9]}
    assert repro._compare(short, ref) == "no losses after validation to compare"


def test_timeline_and_iteration_come_from_the_child_progress_lines():
    log = "noise\nITERATION 1 t=3.5\nITERATION 2 t=4.0\nTraceback\nCUDA error: an illegal x\n"
    assert repro._iteration_times(log) == [3.5, 4.0]
    assert repro._last_logged_iteration(log) == 3  # it died in the iteration after the last one
    assert repro._first_error_line(log) == "CUDA error: an illegal x"


def test_matrix_runs_each_case_once_and_compares_with_one_eager_reference(monkeypatch):
    spawned, threads_given, heads_given = [], [], []

    def fake_spawn(case, preset, reference=False, timeout=300, threads=0, mamba_heads=0):
        spawned.append((case.n, reference))
        threads_given.append(threads)
        heads_given.append(mamba_heads)
        losses = [5.0 - 0.1 * i for i in range(repro.ITERS)]
        if case.n == 5 and not reference:  # the corrupted case drifts after validation
            losses[repro.EVAL_AT] *= 1.5
        return {"outcome": "trained through", "losses": losses, "wall_s": 1.0}

    monkeypatch.setattr(repro, "_spawn", fake_spawn)
    results = dict((c.n, r) for c, r in repro.run_matrix(repro.CASES, "tiny", jobs=0))
    assert sorted(spawned) == sorted([(c.n, False) for c in repro.CASES] + [(5, True)])
    # the cores are shared out, so the processes' CPU threads do not oversubscribe the machine
    monkeypatch.setattr(repro.os, "cpu_count", lambda: 16)
    threads_given.clear()
    repro.run_matrix(repro.CASES, "tiny", jobs=0)
    assert set(threads_given) == {1}
    threads_given.clear()
    repro.run_matrix(repro.CASES[:1], "tiny", jobs=0)
    assert set(threads_given) == {16}  # one process alone gets every core
    heads_given.clear()
    repro.run_matrix(repro.CASES[4:6], "tiny", jobs=0, mamba_heads=128)
    assert heads_given == [128, 128, 128]  # --mamba-heads reaches every case and the reference
    assert results[6]["outcome"] == "trained through"
    assert results[6]["comparison"].endswith("0.0e+00 after")
    assert results[5]["outcome"] == "silent corruption"  # 0.5 relative > LOSS_RTOL


def test_a_broken_reference_makes_the_comparison_inconclusive_not_clean():
    res = {"losses": [5.0] * repro.ITERS}
    for ref in (
        {"outcome": "timed out after 240 s", "losses": []},
        {"outcome": "trained through", "losses": [5.0] * (repro.ITERS - 1) + [float("nan")]},
    ):
        assert repro._compare(res, ref).startswith("inconclusive: the eager reference")
        assert "rel_diff_after_eval" not in res


def test_the_result_file_wins_and_a_dead_child_is_named_by_its_signal():
    assert repro._result_of('{"outcome": "trained through"}', "noise", 0)["outcome"] == (
        "trained through"
    )
    assert repro._result_of("", "Traceback\n", -9)["outcome"] == "killed by signal 9"
    assert repro._result_of("{trunc", "CUDA error: an illegal memory access", -6)["outcome"] == (
        "illegal memory access"
    )
    assert repro._result_of("", "ValueError: bad\n", 1)["outcome"] == "died (exit 1)"
    assert repro._result_of("", "CUDA error: device-side assert triggered", -6)["outcome"] == (
        "device-side assert"
    )


def test_mamba_heads_widen_only_the_mamba():
    case = repro.CASES[0]
    default = repro._config(case, "small", reference=False).model_overrides
    wide = repro._config(case, "small", reference=False, mamba_heads=256).model_overrides
    assert default == {"mamba_num_heads": 64, "mamba_head_dim": 64}
    assert wide == {"mamba_num_heads": 256, "mamba_head_dim": 64}
    parser = argparse.ArgumentParser()
    repro.add_arguments(parser)
    args = parser.parse_args(["--mamba-heads", "128", "--case", "1"])
    assert args.mamba_heads == 128


def test_a_child_reports_its_losses_progress_and_startup_phases(monkeypatch, capsys):
    from graphsan.lab.train import optim, trainer

    config = repro._config

    def cpu_config(case, preset, reference, mamba_heads=0):
        cfg = config(case, "tiny", reference, mamba_heads)
        return dataclasses.replace(cfg, device="cpu", seq_length=32, save="/tmp/graphsan-child")

    monkeypatch.setattr(repro, "_config", cpu_config)
    monkeypatch.setattr(optim.MainGradAdamW, "step", optim.MainGradAdamW.step)  # restored after
    monkeypatch.setattr(trainer, "build_model", trainer.build_model)
    monkeypatch.setitem(repro._progress, "done", 0)
    res = repro.run_child(2, "tiny", reference=True)
    assert res["outcome"] == "trained through" and len(res["losses"]) == repro.ITERS
    phases = res["startup"]
    assert list(phases)[-3:] == ["model built", "first forward", "first backward"]
    assert phases["imports"] <= phases["model built"] <= phases["first forward"]
    assert repro._iteration_times(capsys.readouterr().out) != []
