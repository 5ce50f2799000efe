"""CPU: a checkpoint that cannot be written (a full disk, a file-size limit, an I/O error) ends
`graphsan train` in one line with an exit status of its own (the README's table lists it): the
line names the file, the system's reason, and the last checkpoint that is good. Nothing half
written is left beside it (no `latest.pt.tmp`), and an older `latest.pt` stays as it was."""

from __future__ import annotations

import errno
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphsan.lab.train.cli import EXIT_SAVE_FAILED, run
from tests.gpu_programs import ROOT

ARGV = ["--preset", "tiny", "--device", "cpu", "--quiet", "--seq-length", "32"]
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PYTHONUNBUFFERED="1")


def a_full_disk(monkeypatch, after_saves: int = 0) -> None:
    """torch.save as it fails on a full disk: part of the file written, then the zip writer's
    RuntimeError with the OSError as its context (what torch 2.13 raises on a full tmpfs)."""
    real = torch.save
    calls = []

    def save(obj, f, *args, **kwargs):
        calls.append(f)
        if len(calls) <= after_saves:
            return real(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):
            Path(f).write_bytes(b"PK\x03\x04" + bytes(4096))
        else:
            f.write(b"PK\x03\x04" + bytes(4096))
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:  # raised here, the OSError is the RuntimeError's __context__
            raise RuntimeError(  # noqa: B904
                "[enforce fail at inline_container.cc:672] . unexpected pos 4160 vs 4096"
            )

    monkeypatch.setattr(torch, "save", save)


def test_a_full_disk_at_the_first_save_is_one_line_and_leaves_nothing(
    tmp_path, monkeypatch, capsys
):
    a_full_disk(monkeypatch)
    save = tmp_path / "ckpt"
    rc = run([*ARGV, "--train-iters", "2", "--save-interval", "1", "--save", str(save)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_SAVE_FAILED, lines
    assert lines == [
        f"graphsan train: error: --save {save}: cannot write latest.pt of iteration 1 "
        f"({os.strerror(errno.ENOSPC)}); this run saved no checkpoint"
    ]
    assert os.listdir(save) == []


def test_a_full_disk_keeps_the_checkpoint_saved_before_and_names_it(tmp_path, monkeypatch, capsys):
    a_full_disk(monkeypatch, after_saves=1)
    save = tmp_path / "ckpt"
    rc = run([*ARGV, "--train-iters", "3", "--save-interval", "1", "--save", str(save)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert rc == EXIT_SAVE_FAILED
    assert line.endswith(
        f"cannot write latest.pt of iteration 2 ({os.strerror(errno.ENOSPC)}); the last "
        f"checkpoint is {save / 'latest.pt'} (iteration 1)"
    )
    assert os.listdir(save) == ["latest.pt"]
    assert torch.load(save / "latest.pt", weights_only=False)["iteration"] == 1


def test_the_readme_lists_the_status_of_a_save_that_failed():
    readme = (Path(ROOT) / "README.md").read_text()
    (row,) = [ln for ln in readme.splitlines() if ln.startswith("| `graphsan train` |")]
    assert re.search(rf"`{EXIT_SAVE_FAILED}`: a checkpoint could not be written", row), row


def _small_files() -> None:
    """In the child: files larger than 64 KiB cannot be written (EFBIG; Python ignores the
    SIGXFSZ that comes with it), so the first checkpoint fails in the kernel, as on a full disk."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


@pytest.mark.slow
def test_a_write_the_system_refuses_ends_the_command_in_one_line(tmp_path):
    save = tmp_path / "ckpt"
    argv = [sys.executable, "-m", "graphsan.cli", "train", *ARGV, "--train-iters", "2"]
    argv += ["--save-interval", "1", "--save", str(save)]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=ENV, preexec_fn=_small_files, timeout=300
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == EXIT_SAVE_FAILED, proc.stderr[-3000:]
    assert lines == [
        f"graphsan train: error: --save {save}: cannot write latest.pt of iteration 1 "
        f"({os.strerror(errno.EFBIG)}); this run saved no checkpoint"
    ]
    assert os.listdir(save) == []
