"""CPU: a stop signal in `graphsan train` (Ctrl-C, and SIGTERM, SIGHUP and SIGUSR1, which SLURM,
Kubernetes and torchrun stop jobs with) finishes the iteration in flight, saves a checkpoint of it
where --save names a folder, and ends in one line naming the signal with exit status 128 + its
number (no traceback); outside the training loop, or a second time, a signal stops at once,
except that a checkpoint being written is finished first, and the line says what was saved and
where the last good checkpoint is. Under torchrun a signal to one rank stops every rank after the
same iteration."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graphsan.lab.train import cli as train_cli
from graphsan.lab.train import trainer
from graphsan.lab.train.interrupt import StoppedAtOnce, StopSignals
from tests.gpu_programs import ROOT
from tests.once import once

ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PYTHONUNBUFFERED="1")
LABELS = {
    "SIGINT": "Ctrl-C (SIGINT)",
    "SIGTERM": "SIGTERM",
    "SIGHUP": "SIGHUP",
    "SIGUSR1": "SIGUSR1",
}


def train_command(save, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "graphsan.cli",
        "train",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--seq-length",
        "32",
        "--train-iters",
        "100000",
        "--log-interval",
        "1",
        "--save",
        str(save),
        *extra,
    ]


def wait_for_first_iteration(proc: subprocess.Popen) -> None:
    """Read the run's output until its first logged iteration (the loop has begun)."""
    for line in proc.stdout:
        if line.startswith("iter ") and "loss" in line:
            return
    proc.wait(timeout=60)
    pytest.fail(f"the run ended before its first iteration: {proc.stderr.read()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1"])
def test_a_stop_signal_saves_the_iteration_and_stops_in_one_line(tmp_path, name):
    save = tmp_path / "ckpt"
    proc = subprocess.Popen(
        train_command(save), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    wait_for_first_iteration(proc)
    sig = getattr(signal, name)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)  # a safety bound, far above a tiny iteration
    lines = err.strip().splitlines()
    assert proc.returncode == 128 + sig, err
    assert len(lines) == 1, err
    prefix = f"graphsan train: error: stopped by {LABELS[name]} after iteration "
    assert lines[0].startswith(prefix) and lines[0].endswith(f"; checkpoint saved to {save}")
    done = int(lines[0][len(prefix) :].split(";")[0])
    assert f"saved checkpoint {save / 'latest.pt'} at iteration {done}" in out
    assert torch.load(save / "latest.pt", weights_only=False)["iteration"] == done


def test_a_signal_before_the_loop_stops_at_once_in_one_line(monkeypatch, tmp_path, capsys):
    build = trainer.build_model

    def signalled_while_building(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGHUP)  # handled before the next line runs
        return build(*args, **kwargs)

    monkeypatch.setattr(trainer, "build_model", signalled_while_building)
    save = tmp_path / "ckpt"
    argv = ["--preset", "tiny", "--device", "cpu", "--seq-length", "32", "--save", str(save)]
    before = signal.getsignal(signal.SIGHUP)
    assert train_cli.run(argv) == 128 + signal.SIGHUP
    assert capsys.readouterr().err == "graphsan train: error: stopped by SIGHUP\n"
    assert not save.exists()  # nothing trained, nothing saved
    assert signal.getsignal(signal.SIGHUP) is before  # the handler was put back


def test_the_first_signal_waits_for_the_iteration_and_a_second_stops_at_once():
    stop = StopSignals(("SIGUSR1", "SIGTERM"))
    before = signal.getsignal(signal.SIGUSR1)
    with stop.after_iteration():
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signum == signal.SIGUSR1  # recorded; the loop goes on to the iteration's end
        with pytest.raises(StoppedAtOnce) as err:
            os.kill(os.getpid(), signal.SIGTERM)
    assert err.value.status == 128 + signal.SIGTERM and str(err.value) == "stopped by SIGTERM"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_library_caller_keeps_its_own_handlers_for_the_scheduler_signals(monkeypatch):
    """train() called from a program (the repro child) takes over Ctrl-C alone: SIGTERM keeps
    whatever the program set."""
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGTERM, mine)
    try:
        step = trainer.Trainer.train_step

        def step_then_signal(self, it):
            os.kill(os.getpid(), signal.SIGTERM)
            return step(self, it)

        monkeypatch.setattr(trainer.Trainer, "train_step", step_then_signal)
        cfg = trainer.TrainConfig(
            preset="tiny", train_iters=2, seq_length=32, device="cpu", quiet=True
        )
        assert len(trainer.train(cfg).losses) == 2  # trained through
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_iteration(tmp_path):
    save = tmp_path / "ckpt"
    env = dict(ENV, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            train_command(save, "--distributed-timeout-minutes", "2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
        )
        for r in range(2)
    ]
    try:
        wait_for_first_iteration(procs[0])  # rank 0 prints for the job
        procs[1].send_signal(signal.SIGTERM)  # rank 1 alone is signalled
        ended = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [err.strip().splitlines() for _, err in ended]
    assert [p.returncode for p in procs] == [128 + signal.SIGTERM] * 2, lines
    prefix = "graphsan train [rank {}]: error: stopped by SIGTERM after iteration "
    assert all(len(ln) == 1 and ln[0].startswith(prefix.format(r)) for r, ln in enumerate(lines))
    done = {int(ln[0].split("after iteration ")[1].split(";")[0]) for ln in lines}
    assert len(done) == 1, lines  # the same iteration on both ranks
    assert torch.load(save / "latest.pt", weights_only=False)["iteration"] == done.pop()


# A program that runs `graphsan train` once per scenario, each stopping itself with SIGTERM twice
# in iteration 2, at points the scenario chooses (a signal's Python handler runs before the next
# line, so each run is the same), and prints each run's exit status and error lines as JSON.
TWO_SIGNALS = r"""
import contextlib, io, json, os, signal, sys
import torch
from graphsan.lab.train import cli, trainer

def kill():
    os.kill(os.getpid(), signal.SIGTERM)

def scenario(where, argv):
    step, save, train = trainer.Trainer.train_step, torch.save, trainer.train

    def step_with_signals(self, it):
        if it == 2:
            kill()  # the first: finish iteration 2, save it, stop
            if where == "step":
                kill()  # the second, while the iteration runs
        return step(self, it)

    def save_after_a_signal(*args, **kwargs):
        kill()  # the second, as the checkpoint is written
        return save(*args, **kwargs)

    def train_then_a_signal(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        finally:
            kill()  # the second, as the stopped run unwinds

    trainer.Trainer.train_step = step_with_signals
    if where == "save":
        torch.save = save_after_a_signal
    if where == "late":
        trainer.train = train_then_a_signal
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rc = cli.run(argv)
    finally:
        trainer.Trainer.train_step, torch.save, trainer.train = step, save, train
    return {"rc": rc, "lines": err.getvalue().splitlines()}

runs = json.loads(sys.argv[1])
print(json.dumps({name: scenario(where, argv) for name, (where, argv) in runs.items()}))
"""
SCENARIOS = {  # name: (where the second signal comes, extra options)
    "in-save": ("save", []),
    "late": ("late", []),
    "in-step-after-a-save": ("step", ["--save-interval", "1"]),
    "in-step-before-any-save": ("step", []),
}


# the four scenarios share one child process: run on one worker, it runs once (and `once`
# runs it once where a pytest loses the group)
TWO_SIGNALS_ONCE = pytest.mark.xdist_group("test_train_interrupt-two-signals")


@pytest.fixture(scope="module")
def two_signals(request):
    """Each scenario's (exit status, error lines, --save folder), from one child process."""

    def child(root: Path) -> dict:
        runs = {
            name: (where, train_command(root / name, "--train-iters", "5", *extra)[4:])
            for name, (where, extra) in SCENARIOS.items()
        }
        proc = subprocess.run(
            [sys.executable, "-c", TWO_SIGNALS, json.dumps(runs)],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        ended = json.loads(proc.stdout.strip().splitlines()[-1])
        return {name: (r["rc"], r["lines"], str(root / name)) for name, r in ended.items()}

    ran = once(request, "two-signals", child)
    return {name: (rc, lines, Path(save)) for name, (rc, lines, save) in ran.items()}


@TWO_SIGNALS_ONCE
def test_a_second_signal_during_the_save_waits_for_it(two_signals):
    rc, lines, save = two_signals["in-save"]
    assert rc == 128 + signal.SIGTERM, lines
    assert lines == [
        f"graphsan train: error: stopped by SIGTERM after iteration 2; checkpoint saved to {save}"
    ]
    assert sorted(os.listdir(save)) == ["latest.pt"]
    assert torch.load(save / "latest.pt", weights_only=False)["iteration"] == 2


@TWO_SIGNALS_ONCE
def test_a_second_signal_as_the_stopped_run_ends_keeps_its_line(two_signals):
    rc, lines, save = two_signals["late"]
    assert rc == 128 + signal.SIGTERM, lines
    assert lines == [
        f"graphsan train: error: stopped by SIGTERM after iteration 2; checkpoint saved to {save}"
    ]
    assert torch.load(save / "latest.pt", weights_only=False)["iteration"] == 2


@TWO_SIGNALS_ONCE
def test_a_second_signal_during_the_iteration_says_nothing_was_saved_and_where_the_last_is(
    two_signals,
):
    rc, lines, save = two_signals["in-step-after-a-save"]
    assert rc == 128 + signal.SIGTERM, lines
    assert lines == [
        "graphsan train: error: stopped by SIGTERM during iteration 2, which was not saved; "
        f"the last checkpoint is {save / 'latest.pt'} (iteration 1)"
    ]
    assert sorted(os.listdir(save)) == ["latest.pt"]
    assert torch.load(save / "latest.pt", weights_only=False)["iteration"] == 1


@TWO_SIGNALS_ONCE
def test_a_second_signal_before_any_save_says_this_run_saved_none(two_signals):
    rc, lines, save = two_signals["in-step-before-any-save"]
    assert rc == 128 + signal.SIGTERM, lines
    assert lines == [
        "graphsan train: error: stopped by SIGTERM during iteration 2, which was not saved; "
        "this run saved no checkpoint"
    ]
    assert not save.exists()


@pytest.mark.slow
def test_two_sigterms_close_together_never_lose_the_checkpoint_silently(tmp_path):
    """As a scheduler sends them: the second may come while the iteration runs or while its
    checkpoint is written; either way the line says what is on disk, and it is."""
    save = tmp_path / "ckpt"
    proc = subprocess.Popen(
        train_command(save, "--save-interval", "2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    wait_for_first_iteration(proc)
    proc.send_signal(signal.SIGTERM)
    # two signals sent at once reach the process as one (the kernel does not queue them): a
    # moment between them, and wherever the second lands the line must be true
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)  # a safety bound, far above a tiny iteration
    # the second signal may also come after the line, once the command has put the default
    # handler back: SIGTERM's own end then, which a shell reports as 143 too
    assert proc.returncode in (128 + signal.SIGTERM, -signal.SIGTERM), err
    (line,) = err.strip().splitlines()
    on_disk = sorted(os.listdir(save)) if save.exists() else []
    assert "latest.pt.tmp" not in on_disk
    saved = re.fullmatch(
        r"graphsan train: error: stopped by SIGTERM after iteration (\d+); "
        f"checkpoint saved to {re.escape(str(save))}",
        line,
    )
    not_saved = re.fullmatch(
        r"graphsan train: error: stopped by SIGTERM during iteration (\d+), which was not "
        rf"saved; (?:the last checkpoint is {re.escape(str(save / 'latest.pt'))} \(iteration "
        r"(\d+)\)|this run saved no checkpoint)",
        line,
    )
    assert saved or not_saved, line
    if saved:
        done = int(saved[1])
        assert torch.load(save / "latest.pt", weights_only=False)["iteration"] == done
    elif not_saved[2] is not None:
        last = int(not_saved[2])
        assert last < int(not_saved[1])
        assert torch.load(save / "latest.pt", weights_only=False)["iteration"] == last
    else:
        assert on_disk == []
