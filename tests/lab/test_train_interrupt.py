"""CPU: a stop signal in `graphsan train` (Ctrl-C, and SIGTERM, SIGHUP and SIGUSR1, which SLURM,
Kubernetes and torchrun stop jobs with) finishes the iteration in flight, saves a checkpoint of it
where --save names a folder, and ends in one line naming the signal with exit status 128 + its
number (no traceback); outside the training loop, or a second time, a signal stops at once.
Under torchrun a signal to one rank stops every rank after the same iteration."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from graphsan.lab.train import cli as train_cli
from graphsan.lab.train import trainer
from graphsan.lab.train.interrupt import StoppedAtOnce, StopSignals
from tests.gpu_programs import ROOT

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
