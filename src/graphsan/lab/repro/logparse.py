"""What a child's log and exit status say when it could not write its own result."""

from __future__ import annotations

import contextlib
import json
import re

from graphsan.lab.repro.cases import Outcome
from graphsan.lab.repro.result import CaseResult

# the progress line a child prints after each optimizer step
PROGRESS = "ITERATION"
_KERNEL_ASSERT = re.compile(r"\.cuh?:\d+: .*Assertion `.*` failed")


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


def result_of(result: str, log: str, rc: int) -> CaseResult:
    """The child's own result (JSON it wrote), or what its log and exit status say. A result
    of an error the child could not name is named from the log where the log shows the crash:
    a kernel's assertion makes the CUDA context fail for every later call, so the exception the
    child caught can be the next library's (cuBLAS: "CUBLAS_STATUS_EXECUTION_FAILED") while the
    kernel's own message went to its stderr."""
    crash = crash_kind(log)
    if result:
        with contextlib.suppress(json.JSONDecodeError):
            res = CaseResult.from_dict(json.loads(result))
            if res.outcome == "error" and crash is not None:
                res.outcome = crash.value
            return res
    if crash is not None:
        outcome = crash.value
    elif rc < 0:
        outcome = f"killed by signal {-rc}"
    else:
        outcome = f"died (exit {rc})"
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    return CaseResult(
        outcome=outcome,
        iteration=last_logged_iteration(log),
        symptom=first_error_line(log) or (lines[-1][:200] if lines else ""),
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
