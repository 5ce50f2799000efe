"""What a child's log and exit status say when it could not write its own result."""

from __future__ import annotations

import re

from graphsan.command_line import read_result
from graphsan.lab.repro.cases import Outcome
from graphsan.lab.repro.result import CaseResult, ResultError

# the progress line a child prints after each optimizer step
PROGRESS = "ITERATION"
_KERNEL_ASSERT = re.compile(r"([^/\s]+\.cuh?:\d+): .*(Assertion `.*` failed)")


def progress_line(iteration: int, seconds: float) -> str:
    return f"{PROGRESS} {iteration} t={seconds}"


def crash_kind(text: str) -> Outcome | None:
    """The CUDA error a stale replay ends in: a fault on unmapped memory, or a kernel's own
    bounds check tripping over indices that the replay's stale writes overwrote."""
    if "illegal memory access" in text:
        return Outcome.ILLEGAL_MEMORY_ACCESS
    # the kernel's own message counts too: PyTorch's text can be lost when a GPU-trace hook
    # fails while the error is being raised
    # "triggered": PyTorch's advice under every CUDA error names "device-side assertions"
    if "device-side assert triggered" in text or _KERNEL_ASSERT.search(text):
        return Outcome.DEVICE_SIDE_ASSERT
    return None


def crash_line(text: str) -> str:
    """The line of `text` showing the crash `crash_kind` names: the illegal access's, else a
    kernel's assertion as its file, line and condition (the block and thread left out), else
    PyTorch's "device-side assert triggered"."""
    lines = text.splitlines()
    for line in lines:
        if "illegal memory access" in line:
            return line.strip()[:200]
    for line in lines:
        kernel = _KERNEL_ASSERT.search(line)
        if kernel:
            return f"{kernel.group(1)}: {kernel.group(2)}"[:200]
    for line in lines:
        if "device-side assert triggered" in line:
            return line.strip()[:200]
    return ""


# the outcome of a child whose result file does not fit CaseResult (its symptom names the field)
UNREADABLE = "unreadable result"


def result_of(result: str, log: str, rc: int) -> CaseResult:
    """The child's own result (the `RESULT {json}` line of its result file, `result`), or what
    its log and exit status say. A result of an error the child could not name is named from
    the log where the log shows the crash: a kernel's assertion makes the CUDA context fail for
    every later call, so the exception the child caught can be the next library's (cuBLAS:
    "CUBLAS_STATUS_EXECUTION_FAILED") while the kernel's own message went to its stderr. A
    result line cut short (the child died writing it) or one whose fields do not fit counts as
    no result; unless the log or the exit status says more, it is `UNREADABLE` with what was
    wrong (the field, for the latter) in its symptom."""
    crash = crash_kind(log)
    problem = ""
    try:
        data = read_result(result)
    except ValueError as err:
        data, problem = None, f"the child's result file: {err}"
    if data is not None:
        try:
            res = CaseResult.from_json(data)
        except ResultError as err:
            problem = f"the child's result file: {err}"
        else:
            if res.outcome == "error" and crash is not None:
                caught = f"; caught as: {res.symptom}" if res.symptom else ""
                res = res.replace(outcome=crash.value, symptom=crash_line(log) + caught)
            return res
    if crash is not None:
        outcome = crash.value
    elif rc < 0:
        outcome = f"killed by signal {-rc}"
    elif problem:
        outcome = UNREADABLE
    else:
        outcome = f"died (exit {rc})"
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    symptom = crash_line(log) if crash else first_error_line(log)
    symptom = symptom or (lines[-1][:200] if lines else "")
    return CaseResult(
        outcome=outcome,
        iteration=last_logged_iteration(log),
        symptom=problem if outcome == UNREADABLE else symptom,
    )


def first_error_line(log: str) -> str:
    for line in log.splitlines():
        if "CUDA error" in line or "Error:" in line:
            return line.strip()[:200]
    return ""


def iteration_times(log: str) -> list[float]:
    """Seconds from the child's start to the end of each iteration (its progress lines)."""
    return [
        float(line.rsplit("t=", 1)[1])
        for line in log.splitlines()
        if line.startswith(PROGRESS + " ") and " t=" in line
    ]


def last_logged_iteration(log: str) -> int | None:
    """The iteration a child was in when it stopped: the one after its last progress line."""
    last = None
    for line in log.splitlines():
        if line.startswith(PROGRESS + " "):
            last = int(line.split()[1])
    return None if last is None else last + 1
