"""The parent side: one process per case, read as it runs, and the matrix run side by side."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from graphsan.lab.repro import logparse
from graphsan.lab.repro.cases import Case, Outcome
from graphsan.lab.repro.compare import add_comparison, judge
from graphsan.lab.repro.result import CaseResult, RankResult, describe_ranks

# how long the other ranks may go on after one rank ended (a trained-through job ends within
# a second on every rank; a rank still running is waiting in a collective for the one that ended)
PEER_GRACE_S = 30.0


def child_command(
    case: Case,
    preset: str,
    reference: bool,
    mamba_heads: int,
    result_path: str,
    report_path: str | None = None,
) -> list[str]:
    """The command line of one case's process (one rank's, on several)."""
    cmd = [sys.executable, "-m", "graphsan.lab.repro.child", str(case.n)]
    cmd += ["--preset", preset, "--result", result_path]
    cmd += ["--reference"] if reference else []
    cmd += ["--mamba-heads", str(mamba_heads)] if mamba_heads else []
    cmd += ["--report-file", report_path] if report_path else []
    return cmd


def report_file(directory: str, case: Case, rank: int | None) -> str:
    """Where a case's graphsan report goes: DIR/case4.json, or DIR/case4.rank1.json."""
    name = f"case{case.n}" + ("" if rank is None else f".rank{rank}")
    return os.path.join(directory, f"{name}.json")


def free_port() -> int:
    """A TCP port free now on this host, for the ranks' rendezvous (MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(
    case: Case,
    preset: str,
    reference: bool = False,
    timeout: float = 300,
    threads: int = 0,
    mamba_heads: int = 0,
    nproc: int = 1,
    report_dir: str | None = None,
    grace: float = PEER_GRACE_S,
) -> CaseResult:
    """Run one case in a child process, or in `nproc` child processes that form one
    torch.distributed job as torchrun would start it (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); their output is read as it comes, so a case that hangs or
    overruns still reports how far it got. `threads`: each child's CPU threads (0: torch's
    default, one per core). When one rank has ended and the others are still running `grace`
    seconds later, they are waiting for it: they are stopped."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    ranks = list(range(nproc)) if nproc > 1 else [None]
    if nproc > 1:
        env.update(WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    want_report = report_dir is not None and case.graphsan != "off" and not reference
    procs, paths = [], []
    t0 = time.perf_counter()
    for rank in ranks:
        # the result goes to a file of its own: merged stdout and stderr may interleave in a line
        fd, result_path = tempfile.mkstemp(prefix=f"graphsan-repro-{case.n}-", suffix=".json")
        os.close(fd)
        paths.append(result_path)
        report = report_file(report_dir, case, rank) if want_report else None
        cmd = child_command(case, preset, reference, mamba_heads, result_path, report)
        rank_env = env if rank is None else dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",  # a stray byte must not stop the reader (and then the child)
                env=rank_env,
            )
        )
    ended = _pump(procs, timeout, grace)
    wall = time.perf_counter() - t0
    results = []
    for (log, rc, how), result_path in zip(ended, paths, strict=True):
        try:
            with open(result_path) as fh:
                text = fh.read()
        finally:
            os.unlink(result_path)
        if how == "timed out":
            res = CaseResult(
                outcome=f"timed out after {timeout:.0f} s",
                iteration=logparse.last_logged_iteration(log),
            )
        elif how == "waited for a peer":
            res = CaseResult(
                outcome=Outcome.PEER_FAILED.value,
                iteration=logparse.last_logged_iteration(log),
                symptom=f"still running {grace:.0f} s after another rank ended: stopped",
            )
        else:
            res = logparse.result_of(text, log, rc)
        timeline = logparse.iteration_times(log)
        results.append(res.replace(wall_s=wall, timeline=timeline, log_tail=log[-3000:]))
    if nproc == 1:
        return results[0]
    merged = combine(results)
    reports = [report_file(report_dir, case, r) for r in ranks] if want_report else []
    return merged.replace(report=merge_rank_reports(reports) or merged.report)


def _pump(
    procs: list[subprocess.Popen], timeout: float, grace: float
) -> list[tuple[str, int, str]]:
    """Per process: (its whole output, its exit status, how it ended: "exited", "timed out"
    or "waited for a peer"); reader threads drain the pipes so a chatty child never blocks."""
    logs: list[list[str]] = [[] for _ in procs]
    readers = []
    for proc, lines in zip(procs, logs, strict=True):
        reader = threading.Thread(target=lambda p=proc, ln=lines: ln.extend(p.stdout), daemon=True)
        reader.start()
        readers.append(reader)
    how = ["exited"] * len(procs)
    start, first_end = time.monotonic(), None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_end is None and any(p.poll() is not None for p in procs):
            first_end = now
        overrun = now - start > timeout
        stuck = first_end is not None and now - first_end > grace
        if overrun or stuck:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    how[i] = "timed out" if overrun else "waited for a peer"
            break
        time.sleep(0.05)
    out = []
    for proc, lines, reader, h in zip(procs, logs, readers, how, strict=True):
        rc = proc.wait()
        reader.join(timeout=10)
        out.append(("".join(lines), rc, h))
    return out


def combine(results: list[CaseResult]) -> CaseResult:
    """One result for a case run on several ranks: the first rank that failed by itself speaks
    for the case (its outcome and finding; the iteration is the earliest any rank failed in),
    the losses are rank 0's (averaged over the ranks), and `ranks` keeps what each rank saw.
    A rank that failed only because another had (an error in a collective, or waiting until it
    was stopped) counts as `Outcome.PEER_FAILED`."""
    own = [r for r in results if r.kind not in (Outcome.TRAINED_THROUGH, Outcome.OTHER)]
    own = [r for r in own if r.kind is not Outcome.PEER_FAILED]
    failed = own or [r for r in results if r.kind is not Outcome.TRAINED_THROUGH]
    base = failed[0] if failed else results[0]
    iterations = [r.iteration for r in failed if r.iteration is not None]
    with_losses = [r for r in results if r.losses] or [base]
    return base.replace(
        iteration=min(iterations) if iterations else base.iteration,
        losses=with_losses[0].losses,
        eval_losses=with_losses[0].eval_losses,
        timeline=results[0].timeline,
        wall_s=max(r.wall_s for r in results),
        ranks=tuple(_rank_result(i, r, peer_failed=bool(own)) for i, r in enumerate(results)),
    )


def _rank_result(rank: int, r: CaseResult, peer_failed: bool) -> RankResult:
    """What rank `rank` saw; once another rank failed by itself, an error this rank could not
    name (a collective's, its peer gone) counts as stopping after that peer."""
    if peer_failed and r.kind is Outcome.OTHER:
        symptom = "; ".join(x for x in (r.outcome, r.symptom) if x)
        return RankResult(rank, Outcome.PEER_FAILED.value, r.iteration, r.finding, symptom)
    return RankResult(rank, r.outcome, r.iteration, r.finding, r.symptom)


def merge_rank_reports(paths: list[str]) -> str:
    """graphsan's per-rank reports merged into one summary ("" when none was written)."""
    from graphsan.report import Report
    from graphsan.report.ranks import merge_reports

    found = [p for p in paths if os.path.exists(p)]
    if not found:
        return ""
    reports = []
    for p in found:
        try:
            reports.append(Report.load(p))
        except ValueError as err:
            return f"(the per-rank reports could not be merged: {err})"
    return merge_reports(reports, found)


def run_matrix(
    cases: list[Case],
    preset: str,
    jobs: int,
    timeout: float = 300,
    mamba_heads: int = 0,
    out=None,
    nproc: int = 1,
    report_dir: str | None = None,
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
    threads = max(1, cores // (jobs * nproc))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        ref_future = (
            pool.submit(spawn, ref_case, preset, True, timeout, threads, mamba_heads, nproc=nproc)
            if ref_case
            else None
        )
        futures = {
            pool.submit(
                spawn,
                c,
                preset,
                False,
                timeout,
                threads,
                mamba_heads,
                nproc=nproc,
                report_dir=report_dir,
            ): c
            for c in cases
        }
        done: dict[int, CaseResult] = {}
        for fut in as_completed(futures):
            c = futures[fut]
            done[c.n] = fut.result()
            print(_progress(c, done[c.n]), file=out, flush=True)
        results = [(c, done[c.n]) for c in cases]
        ref = ref_future.result() if ref_future else None
    judged = []
    for c, res in results:
        if c.compare and ref is not None:
            res = add_comparison(res, ref, c.fails_from)
        mismatch = judge(c, res)
        judged.append((c, res.replace(mismatch=mismatch, matched=not mismatch)))
    return judged


def _progress(case: Case, r: CaseResult) -> str:
    first = r.timeline[0] if r.timeline else "-"
    phases = ", ".join(f"{k} {v}" for k, v in r.startup.items())
    line = (
        f"case {case.n} ({case.title}): {r.outcome}, iteration {r.iteration or '-'}, "
        f"{r.wall_s:.0f} s (seconds after start: {phases + ', ' if phases else ''}"
        f"first iteration {first})"
    )
    return line + (f"; {describe_ranks(r.ranks)}" if r.ranks else "")
