"""The parent side: one process per case, read as it runs, and the matrix run side by side."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from graphsan.lab.repro import logparse
from graphsan.lab.repro.cases import Case
from graphsan.lab.repro.compare import add_comparison, judge
from graphsan.lab.repro.result import CaseResult


def child_command(
    case: Case, preset: str, reference: bool, mamba_heads: int, result_path: str
) -> list[str]:
    """The command line of one case's process."""
    cmd = [sys.executable, "-m", "graphsan.cli", "repro", "--child", str(case.n)]
    cmd += ["--preset", preset, "--result", result_path]
    cmd += ["--reference"] if reference else []
    cmd += ["--mamba-heads", str(mamba_heads)] if mamba_heads else []
    return cmd


def spawn(
    case: Case,
    preset: str,
    reference: bool = False,
    timeout: float = 300,
    threads: int = 0,
    mamba_heads: int = 0,
) -> CaseResult:
    """Run one case in a child process; its output is read as it comes, so a case that hangs
    or overruns still reports how far it got. `threads`: the child's CPU threads (0: torch's
    default, one per core)."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    # the result goes to a file of its own: merged stdout and stderr may interleave in a line
    fd, result_path = tempfile.mkstemp(prefix=f"graphsan-repro-{case.n}-", suffix=".json")
    os.close(fd)
    cmd = child_command(case, preset, reference, mamba_heads, result_path)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",  # a stray byte must not stop the reader (and then the child)
        env=env,
    )
    log, rc, timed_out = _pump(proc, timeout)
    wall = time.perf_counter() - t0
    try:
        with open(result_path) as fh:
            text = fh.read()
    finally:
        os.unlink(result_path)
    if timed_out:
        res = CaseResult(
            outcome=f"timed out after {timeout:.0f} s",
            iteration=logparse.last_logged_iteration(log),
        )
    else:
        res = logparse.result_of(text, log, rc)
    res.wall_s = wall
    res.timeline = logparse.iteration_times(log)
    res.log_tail = log[-3000:]
    return res


def _pump(proc: subprocess.Popen, timeout: float) -> tuple[str, int, bool]:
    """(the process's whole output, its exit status, whether it was killed for overrunning);
    a reader thread drains the pipe so a chatty child never blocks on it."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        rc, timed_out = proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        proc.kill()
        rc, timed_out = proc.wait(), True
    reader.join(timeout=10)
    return "".join(lines), rc, timed_out


def run_matrix(
    cases: list[Case],
    preset: str,
    jobs: int,
    timeout: float = 300,
    mamba_heads: int = 0,
    out=None,
) -> list[tuple[Case, CaseResult]]:
    """Run the cases side by side; each finished case prints one line at once (a slow or hung
    case never hides the others' results). Every result is judged against its case's
    expectation (`matched`, and `mismatch` says why not)."""
    out = out or sys.stdout
    ref_case = next((c for c in cases if c.compare), None)
    cores = os.cpu_count() or 1
    if jobs <= 0:
        jobs = min(len(cases) + (ref_case is not None), cores)
    # share the cores out: every process's torch would otherwise start one thread per core
    threads = max(1, cores // jobs)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        ref_future = (
            pool.submit(spawn, ref_case, preset, True, timeout, threads, mamba_heads)
            if ref_case
            else None
        )
        futures = {
            pool.submit(spawn, c, preset, False, timeout, threads, mamba_heads): c for c in cases
        }
        done: dict[int, CaseResult] = {}
        for fut in as_completed(futures):
            c = futures[fut]
            done[c.n] = fut.result()
            print(_progress(c, done[c.n]), file=out, flush=True)
        results = [(c, done[c.n]) for c in cases]
        ref = ref_future.result() if ref_future else None
    for c, res in results:
        if c.compare and ref is not None:
            add_comparison(res, ref)
        res.mismatch = judge(c, res)
        res.matched = not res.mismatch
    return results


def _progress(case: Case, r: CaseResult) -> str:
    first = r.timeline[0] if r.timeline else "-"
    phases = ", ".join(f"{k} {v}" for k, v in r.startup.items())
    return (
        f"case {case.n} ({case.title}): {r.outcome}, iteration {r.iteration or '-'}, "
        f"{r.wall_s:.0f} s (seconds after start: {phases + ', ' if phases else ''}"
        f"first iteration {first})"
    )
