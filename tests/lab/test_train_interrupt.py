"""CPU: Ctrl-C in `graphsan train` finishes the iteration in flight, saves a checkpoint where
--save names a folder, and ends in one line with exit status 130 (no traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.gpu_programs import ROOT


@pytest.mark.slow
def test_ctrl_c_saves_and_stops_in_one_line(tmp_path):
    save = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "graphsan.cli",
            "train",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--train-iters",
            "100000",
            "--log-interval",
            "1",
            "--save",
            str(save),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    for line in proc.stdout:  # wait for the first logged iteration
        if "iter" in line and "loss" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert proc.returncode == 130, err
    assert len(lines) == 1 and lines[0].startswith(
        "graphsan train: error: interrupted after iteration "
    )
    assert lines[0].endswith(f"; checkpoint saved to {save}") and any(save.iterdir())
