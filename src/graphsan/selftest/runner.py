"""Runs the corpus: every run in its own process (`graphsan.selftest.child`), several side by
side on the one GPU, and judges each: a correct program must end with no finding, its twin must
be stopped by a finding on the memory it broke."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from graphsan.command_line import cannot_write, read_result
from graphsan.report.json_report import SCHEMA_VERSION, finding_from_dict
from graphsan.report.output import STDOUT, writing
from graphsan.report.text import attachment_line, one_line
from graphsan.runtime import attachment
from graphsan.selftest import BUG, CORRECT, runs

# verdicts
OK, CAUGHT = "ok", "caught"
FALSE_ALARM, MISSED, ERROR, SKIPPED = "false alarm", "missed", "error", "skipped"
FAILURES = (FALSE_ALARM, MISSED, ERROR)
# the runs that take longest go first, so that the pool's last minutes are not one long run
SLOW_FIRST = ("graphed/compile", "kernels/sdpa", "kernels/transformer", "optim/")


@dataclass
class Verdict:
    name: str
    kind: str  # CORRECT or BUG
    verdict: str
    detail: str = ""
    seconds: float = 0.0
    result: dict = field(default_factory=dict)


def judge(
    name: str, kind: str, result: dict | None, log: str, code: int | None, damaged: str = ""
) -> Verdict:
    """The verdict of one run from its child's result (None: it printed none, or `damaged` says
    why its result line could not be read)."""
    if damaged:
        return Verdict(name, kind, ERROR, f"the child's result: {damaged}")
    if result is None:
        last = log.strip().splitlines()[-1] if log.strip() else "no output"
        why = "timed out" if code is None else f"the process died (exit {code}): {last[:200]}"
        # a twin's process dying means a bad replay ran (or graphsan broke): a miss
        return Verdict(name, kind, MISSED if kind == BUG else ERROR, why)
    outcome = result["outcome"]
    findings = result.get("findings", [])
    if outcome == "skipped":
        return Verdict(name, kind, SKIPPED, result.get("why", ""), result=result)
    if result.get("disabled"):
        return Verdict(name, kind, ERROR, f"graphsan disabled itself: {result['disabled']}")
    if outcome == "error":
        return Verdict(name, kind, ERROR, result.get("why", "?"), result=result)
    if not result.get("graphs"):
        return Verdict(name, kind, ERROR, "graphsan watched no graph: the program tests nothing")
    if kind == CORRECT:
        if findings:
            first = findings[0]
            more = f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""
            return Verdict(name, kind, FALSE_ALARM, _one_line(first) + more, result=result)
        if result.get("failed_checks"):
            detail = "the program's own check failed: " + "; ".join(result["failed_checks"])
            return Verdict(name, kind, ERROR, detail, result=result)
        return Verdict(name, kind, OK, result=result)
    hits = [f for f in findings if _names_the_mistake(f, result)]
    if outcome == "stopped" and hits:
        return Verdict(name, kind, CAUGHT, _one_line(hits[0]), result=result)
    if outcome == "stopped":
        detail = "stopped, but by a finding elsewhere: " + _one_line(findings[0])
        return Verdict(name, kind, MISSED, detail, result=result)
    return Verdict(name, kind, MISSED, "the bad replay ran", result=result)


def _names_the_mistake(finding: dict, result: dict) -> bool:
    if finding["kind"] in result.get("kinds", ()):
        return True
    lo, hi = finding["block_address"], finding["block_address"] + max(finding["nbytes"], 1)
    return any(a < hi and lo < a + n for a, n in result.get("victims", ()))


def _one_line(f: dict) -> str:
    """A finding of the child's result (`child._finding`: the report's JSON of it, with the
    graph's label and the text) as the text report writes it in one line."""
    return one_line(finding_from_dict({k: v for k, v in f.items() if k not in CHILD_KEYS}))


CHILD_KEYS = ("label", "text")  # what the child adds to a finding's JSON


def _run_one(name: str, kind: str, timeout: float, dump_dir: str | None) -> Verdict:
    cmd = [sys.executable, "-m", "graphsan.selftest.child", name]
    if dump_dir and kind == CORRECT:  # a twin captures what its correct program captures
        cmd += [
            "--dump",
            os.path.join(dump_dir, name.replace("/", "__").replace(":", "_") + ".jsonl.gz"),
        ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # one compiler per run, many runs
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        out = err.stdout or b""
        log, code = out.decode(errors="replace") if isinstance(out, bytes) else out, None
    try:
        result, damaged = read_result(log), ""
    except ValueError as err:  # the child died writing it, or wrote something else
        result, damaged = None, str(err)
    verdict = judge(name, kind, result, log, code, damaged)
    verdict.seconds = time.perf_counter() - t0
    if verdict.verdict == ERROR and result is not None and "traceback" in result:
        verdict.result["log_tail"] = log[-3000:]
    return verdict


def run_corpus(
    names: list[tuple[str, str]], jobs: int, timeout: float, dump_dir: str | None
) -> list[Verdict]:
    """Run (name, kind) pairs, `jobs` at a time; verdicts in the order given."""
    order = sorted(
        range(len(names)),
        key=lambda i: (not names[i][0].startswith(SLOW_FIRST), i),
    )
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {i: pool.submit(_run_one, *names[i], timeout, dump_dir) for i in order}
        return [futures[i].result() for i in range(len(names))]


def selected(pattern: str | None) -> list[tuple[str, str]]:
    """(run name, kind) of every run whose name contains `pattern` (all without one)."""
    return [(r["name"], r["kind"]) for r in runs() if not pattern or pattern in r["name"]]


def summary(verdicts: list[Verdict]) -> str:
    correct = [v for v in verdicts if v.kind == CORRECT and v.verdict != SKIPPED]
    bugs = [v for v in verdicts if v.kind == BUG and v.verdict != SKIPPED]
    quiet = sum(v.verdict == OK for v in correct)
    caught = sum(v.verdict == CAUGHT for v in bugs)
    skipped = sum(v.verdict == SKIPPED for v in verdicts)
    head = f"quiet on {quiet}/{len(correct)} correct programs, caught {caught}/{len(bugs)} bugs"
    if skipped:
        head += f" ({skipped} skipped)"
    lines = [head]
    for v in verdicts:
        if v.verdict in FAILURES or v.verdict == SKIPPED:
            lines.append(f"  {v.verdict.upper()} {v.name}: {v.detail}")
    return "\n".join(lines)


def attached_otherwise(verdicts: list[Verdict], expected: dict) -> str | None:
    """A line naming the runs that attached otherwise than the header said (the compiled
    tracker finished building partway, say), with how the first of them attached; None when
    every run that says attached as expected."""
    other = [
        v
        for v in verdicts
        if v.result.get("attachment") is not None and v.result["attachment"] != expected
    ]
    if not other:
        return None
    first = other[0].result
    how = attachment_line(first["attachment"], first.get("allocator_log"), None, SCHEMA_VERSION)
    return f"  {len(other)} run(s) attached otherwise, {other[0].name} first: {how}"


def to_json(verdicts: list[Verdict], meta: dict) -> dict:
    """The results as JSON: each run's verdict and graph count; a failed run keeps its first
    findings and the end of its log."""
    out = []
    for v in verdicts:
        d = asdict(v)
        r = d.pop("result") or {}
        d["graphs"] = r.get("graphs")
        d["findings"] = len(r.get("findings", []))
        if v.verdict in FAILURES:
            d["first_findings"] = r.get("findings", [])[:5]
            d["log_tail"] = r.get("log_tail") or r.get("traceback")
        out.append(d)
    return {"schema": "graphsan.selftest", "version": 1, **meta, "runs": out}


def failed(verdicts: list[Verdict]) -> bool:
    return any(v.verdict in FAILURES for v in verdicts)


def run_and_report(
    chosen: list[tuple[str, str]],
    jobs: int,
    timeout: float,
    dump: str | None,
    json_path: str | None,
    json_name: str | None = None,
) -> int | None:
    """`graphsan selftest`: run, print the summary, write the JSON to `json_path` (resolved at
    start; the user named it `json_name`); the exit status (None: there is no CUDA GPU here,
    which the caller reports). A JSON that cannot be written is CannotWrite."""
    import torch

    if not torch.cuda.is_available():
        sys.stderr.write(
            "graphsan selftest: needs a CUDA GPU (torch.cuda.is_available() is False); "
            "`graphsan selftest --list` shows the programs\n"
        )
        return None
    t0 = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    attached, allocator_log = attachment.here()
    sys.stderr.write(
        f"graphsan selftest: {len(chosen)} runs on {gpu} (torch {torch.__version__}), "
        f"{jobs} at a time\n"
        f"graphsan selftest: {attachment_line(attached, allocator_log, None, SCHEMA_VERSION)}\n"
    )
    verdicts = run_corpus(chosen, jobs, timeout, dump)
    took = time.perf_counter() - t0
    out = sys.stderr if json_path == STDOUT else sys.stdout  # stdout carries the JSON
    print(f"graphsan selftest: {summary(verdicts)}", file=out)
    otherwise = attached_otherwise(verdicts, attached)
    if otherwise:
        print(otherwise, file=out)
    print(f"({took:.0f} s; torch {torch.__version__}, {gpu})", file=out)
    if json_path:
        meta = {"torch": torch.__version__, "gpu": gpu, "seconds": round(took, 1)}
        meta |= {"attachment": attached, "allocator_log": allocator_log}
        try:
            write_json(json_path, to_json(verdicts, meta))
        except BrokenPipeError:  # `--json - | head`: the reader left (graphsan.cli says nothing)
            raise
        except OSError as err:
            raise cannot_write("--json", json_name or json_path, err) from None
    return 1 if failed(verdicts) else 0


# how selftest's JSON begins, as write_json writes it: the results, or the listing (--list)
_RESULTS = re.compile(rb'"schema"\s*:\s*"graphsan\.selftest"')
_LISTING = re.compile(rb'^\s*\[\s*\{\s*"name"\s*:\s*"[^"]*"\s*,\s*"kind"\s*:\s*"(correct|bug)"')


def is_selftest_json(path: str) -> bool:
    """Whether the file at `path` begins as `graphsan selftest --json` writes (the first bytes
    are read, not the whole file)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return bool(_RESULTS.search(head) or _LISTING.match(head))


def write_json(path: str, data) -> None:
    """Write `data` as JSON whole (graphsan.report.output: a reader never sees half of it;
    `-`: stdout). Raises OSError."""
    with writing(path) as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")


__all__ = [
    "BUG",
    "CORRECT",
    "Verdict",
    "failed",
    "is_selftest_json",
    "judge",
    "run_and_report",
    "run_corpus",
    "selected",
    "summary",
    "write_json",
]
