"""What a repro child's process leaves behind, read back by the parent (graphsan.lab.repro's
`logparse` and `child`): the result file first, a dead child by its signal, a kernel's assertion or
an illegal access named from the log (with what Python caught), a stopped replay in one line,
and the child's refusal to run without a result file (`python -m graphsan.lab.repro.child`)."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest

from graphsan.command_line import write_result
from graphsan.lab import repro
from graphsan.lab.repro import CaseResult, child, logparse, runner

SRC = str(Path(__file__).resolve().parents[2] / "src")

# `python -m graphsan.lab.repro.child ARGS...` itself, its case trained on the CPU
CPU_CHILD_MODULE = textwrap.dedent(
    """
    import dataclasses, os, runpy
    from graphsan.lab.repro import cases
    config = cases.case_config

    def cpu_config(case, preset, reference, mamba_heads=0, world_size=1):
        cfg = config(case, preset, reference, mamba_heads, world_size)
        return dataclasses.replace(cfg, device="cpu", seq_length=32, save=os.environ["CKPT"])

    cases.case_config = cpu_config  # the module below imports it from here
    runpy.run_module("graphsan.lab.repro.child", run_name="__main__")
    """
)


def result_file(data) -> str:
    """What a child writes to its result file: `data` on one RESULT line."""
    out = io.StringIO()
    write_result(data, out)
    return out.getvalue()


def test_the_result_file_wins_and_a_dead_child_is_named_by_its_signal():
    assert logparse.result_of(result_file({"outcome": "trained through"}), "noise", 0).outcome == (
        "trained through"
    )
    assert logparse.result_of("", "Traceback\n", -9).outcome == "killed by signal 9"
    cut = 'RESULT {"trunc'  # the child died writing its result
    assert logparse.result_of(cut, "CUDA error: an illegal memory access", -6).outcome == (
        "illegal memory access"
    )
    assert logparse.result_of("", "ValueError: bad\n", 1).outcome == "died (exit 1)"
    assert logparse.result_of("", "CUDA error: device-side assert triggered", -6).outcome == (
        "device-side assert"
    )


def test_a_kernel_assertion_is_a_device_side_assert_even_when_python_lost_the_message():
    # seen on the H200: a GPU-trace hook ran while the CUDA error was being raised, so the log
    # holds a SystemError from the hook and the kernel's own assertion lines, not PyTorch's text
    log = (
        "[E1201 00:57:14.8 PyInterpreter.cpp:132] cuda trace hook execution failed: SystemError: "
        "<built-in function __import__> returned a result with an exception set\n"
        "/pytorch/aten/src/ATen/native/cuda/ScatterGatherKernel.cu:163: operator(): block: [1,0,0],"
        ' thread: [18,0,0] Assertion `idx_dim >= 0 && idx_dim < index_size && "scatter gather '
        'kernel index out of bounds"` failed.\n'
    )
    named = logparse.result_of("", log, 1)
    # the evidence is the kernel's assertion, not the hook's error on the line before it
    assert (named.outcome, named.symptom) == (
        "device-side assert",
        "ScatterGatherKernel.cu:163: Assertion `idx_dim >= 0 && idx_dim < index_size && "
        '"scatter gather kernel index out of bounds"` failed',
    )
    assert logparse.result_of("", log.splitlines()[0], 1).outcome == "died (exit 1)"


def test_an_error_the_child_could_not_name_is_named_from_its_log():
    # seen on the H200: the kernel's assertion reached Python as the next cuBLAS call's failure
    res = CaseResult("error", iteration=6, symptom="CUDA error: CUBLAS_STATUS_EXECUTION_FAILED")
    log = (
        "/pytorch/aten/src/ATen/native/cuda/IndexKernel.cu:111: operator(): block: [5,0,0], "
        'thread: [80,0,0] Assertion `-sizes[i] <= index && index < sizes[i] && "index out of '
        'bounds"` failed.\n'
    )
    named = logparse.result_of(result_file(res.to_json()), log, 0)
    # the evidence: the kernel's assertion first, then what Python caught
    assert (named.outcome, named.iteration, named.symptom) == (
        "device-side assert",
        6,
        'IndexKernel.cu:111: Assertion `-sizes[i] <= index && index < sizes[i] && "index out of '
        'bounds"` failed; caught as: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED',
    )
    # an illegal access is named by its own line, wherever the log has it
    fault = "noise\nCUDA error: an illegal memory access was encountered\nmore noise\n"
    assert logparse.result_of(result_file(res.to_json()), fault, 0).symptom == (
        "CUDA error: an illegal memory access was encountered; caught as: "
        "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED"
    )
    assert logparse.result_of(result_file(res.to_json()), "no kernel message", 0).outcome == "error"
    # PyTorch's advice under any CUDA error is not a kernel's assertion
    advice = "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
    assert logparse.result_of(result_file(res.to_json()), advice, 0).outcome == "error"
    other = CaseResult("StaleMemoryError", iteration=6)
    assert logparse.result_of(result_file(other.to_json()), log, 0).outcome == "StaleMemoryError"


def test_a_child_without_a_result_file_or_with_no_case_is_refused_in_one_line(capsys):
    for argv, message in [
        (["1"], "the following arguments are required: --result"),
        (["99", "--result", "r.json"], "no case 99; expected 1-"),
    ]:
        with pytest.raises(SystemExit) as end:
            child.main(argv)
        assert end.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("python -m graphsan.lab.repro.child: error: ")
        assert message in err[0], err


def test_a_result_survives_the_result_file_and_the_last_result_line_counts():
    res = CaseResult("StaleMemoryError", iteration=6, finding="x", eval_losses=[[5, 4.5]])
    assert logparse.result_of(result_file(res.to_json()), "", 0) == res
    earlier = result_file(CaseResult("trained through").to_json())
    assert logparse.result_of(earlier + result_file(res.to_json()), "", 0) == res


def test_the_child_names_a_stopped_replay_in_one_line():
    # the branch that handles StaleMemoryError runs on a GPU only; its formatting runs here
    from graphsan.core.records import Finding, GraphInfo
    from graphsan.lab.repro.child import first_finding

    f = Finding(
        kind="reowned",
        graph=GraphInfo(3, "layers.0:layer fwd mb0", (("train.py", 9, "capture"),), (1, 0), 0),
        node=209,
        kernel="void at::native::elementwise_kernel<where_kernel_impl>(int)",
        param=1,
        offset=720,
        address=0x7F00_0000_0000,
        nbytes=2 << 20,
        block_address=0x7F00_0000_0000,
        pool="default pool",
        free_stack=(("src/graphsan/lab/quant/linear.py", 251, "clear_workspace"),),
        phase="eval",
        step=5,
    )
    line = first_finding([f])
    assert line.startswith("reowned: layers.0:layer fwd mb0 node 209")
    assert "linear.py:251 in clear_workspace (phase eval, step 5)" in line


@pytest.mark.slow
def test_the_parent_runs_the_child_module_and_reads_its_result_file(monkeypatch, tmp_path):
    """Case 1 on the tiny preset through the child's command line, its RESULT line written to
    the result file and read back by the parent, with the progress lines of its log."""
    real = runner.child_command

    def command(*args, **kwargs):
        cmd = real(*args, **kwargs)
        assert cmd[1:4] == ["-m", "graphsan.lab.repro.child", "1"]
        return [cmd[0], "-c", CPU_CHILD_MODULE, *cmd[3:]]

    monkeypatch.setattr(runner, "child_command", command)
    monkeypatch.setenv("PYTHONPATH", SRC)
    monkeypatch.setenv("CKPT", str(tmp_path / "ckpt"))
    res = runner.spawn(repro.BY_NUMBER[1], "tiny", timeout=240, threads=1)
    assert res.outcome == "trained through", (res.symptom, res.log_tail)
    assert len(res.losses) == repro.ITERS and len(res.timeline) == repro.ITERS
    assert [it for it, _ in res.eval_losses] == [repro.EVAL_AT]
