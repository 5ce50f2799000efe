"""CPU: running out of memory in `graphsan train` is one line that says how much the failed
allocation asked for and names the options that size the run's memory with their values, and an
exit status of its own (the README's table lists it); other errors are not mistaken for it. The
model is made to raise the error (nothing is exhausted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from graphsan.lab.train import trainer
from graphsan.lab.train.cli import EXIT_OUT_OF_MEMORY, run

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["--device", "cpu", "--quiet", "--seq-length", "32", "--train-iters", "2"]
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of "
    "which 1.06 GiB is free. Of the allocated memory 74.39 GiB is allocated by PyTorch."
)
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)"
)


def raising_in_the_step(monkeypatch, err: BaseException) -> None:
    def step(self, it):
        raise err

    monkeypatch.setattr(trainer.Trainer, "train_step", step)


@pytest.mark.parametrize(
    ("err", "asked"),
    [
        (torch.OutOfMemoryError(CUDA_OOM), " (tried to allocate 2.00 GiB)"),
        (torch.cuda.OutOfMemoryError("CUDA out of memory."), ""),
        (RuntimeError(CPU_OOM), " (tried to allocate 1.00 GiB)"),
    ],
    ids=["cuda", "cuda-no-size", "cpu"],
)
def test_out_of_memory_is_one_line_naming_the_knobs(monkeypatch, capsys, err, asked):
    raising_in_the_step(monkeypatch, err)
    assert run([*ARGV, "--preset", "tiny"]) == EXIT_OUT_OF_MEMORY
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"graphsan train: error: out of memory{asked}; lower --micro-batch-size (now 2) or "
        "--seq-length (now 32)"
    ]


def test_the_line_names_the_knobs_this_run_uses(monkeypatch, capsys):
    raising_in_the_step(monkeypatch, torch.OutOfMemoryError(CUDA_OOM))
    argv = [*ARGV, "--preset", "small", "--micro-batch-size", "1", "--global-batch-size", "4"]
    argv += ["--microbatch-schedule", "1f1b", "--cuda-graph-modules", "attn", "mamba"]
    monkeypatch.setattr(trainer, "check_memory", lambda cfg, device: None)
    assert run(argv) == EXIT_OUT_OF_MEMORY
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "graphsan train: error: out of memory (tried to allocate 2.00 GiB); lower "
        "--micro-batch-size (now 1), --seq-length (now 32) or --microbatches-in-flight (now 2); "
        "graph fewer --cuda-graph-modules (now attn mamba); pick a smaller --preset than small "
        "(tiny)"
    )


def test_another_runtime_error_is_not_taken_for_out_of_memory(monkeypatch):
    raising_in_the_step(monkeypatch, RuntimeError("CUDA error: an illegal memory access"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run([*ARGV, "--preset", "tiny"])


def test_the_readme_lists_the_out_of_memory_status():
    readme = (ROOT / "README.md").read_text()
    (row,) = [ln for ln in readme.splitlines() if ln.startswith("| `graphsan train` |")]
    assert re.search(rf"`{EXIT_OUT_OF_MEMORY}`: out of memory", row), row
    others = [ln for ln in readme.splitlines() if ln.startswith("| `graphsan ")]
    assert not any(f"`{EXIT_OUT_OF_MEMORY}`" in ln for ln in others if ln != row), others
