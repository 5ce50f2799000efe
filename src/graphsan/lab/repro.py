"""`graphsan repro`: the Transformer Engine #3316 scenario matrix on one GPU.

Each case trains the `small` hybrid in its own process with
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, per-module CUDA graphs, and validation,
checkpoint (with `empty_cache`) and manual GC on the same iteration, as in the report. Case 1 is
the reported failure; 2 and 3 are the reported controls; 4 shows graphsan naming the culprit
before the crash; 5 is the same bug without `empty_cache` (silent corruption, found by comparing
with an eager run); 6 and 7 train through it (the fixed state policy; graphsan's pin policy with
the buggy policy unchanged); 8 is a prediction the report did not test, and 9 is 8 under graphsan.

    graphsan repro              # every case, a table at the end
    graphsan repro --case 4     # one case (repeatable)
    graphsan repro --list       # the cases, no GPU needed (--json: as JSON)

Each case has a typed expected outcome (a set where the H200 runs legitimately showed more than
one, see docs/te-3316.md); the table says whether each case matched, and the command exits 1
when one did not.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

from graphsan.report.pages import OutputPathAction, write_matrix_page

SCENARIO_SCOPES = ("attn", "mamba", "moe_router", "moe_preprocess")
NO_MAMBA = ("attn", "moe_router", "moe_preprocess")
# iterations: 1-3 eager warm-up, 4 capture, validation + save + GC at 5, first backward after it
# at 6, and one more step to see whether training goes on
WARMUP, EVAL_AT, ITERS = 3, 5, 7
# Case 5 and 6 compare per-iteration losses with an eager run. The two never agree bit for bit:
# stochastic rounding draws from the device generator, whose offsets advance differently under
# graph capture, and atomics (SDPA backward, index_add_) sum in any order. Before validation the
# gap is a few 1e-4 and grows as the runs drift apart (2e-3 two steps later, measured); stale
# weights make it jump by orders of magnitude or give NaN. A relative gap above LOSS_RTOL after
# validation counts as corruption.
LOSS_RTOL = 1e-2
# A wider Mamba than `small`'s for the matrix: out_proj's weight workspace then holds 2 MiB per
# half (512 x 4096 MXFP8 bytes), whole 2 MiB pages of the large pool as in the real model, so
# empty_cache can unmap it. At `small`'s width (512 KiB per half) it sits in the small pool,
# whose pages other tensors keep mapped, and the bug stays silent.
WIDE_MAMBA = {"small": {"mamba_num_heads": 64, "mamba_head_dim": 64}}
# `--mamba-heads N` widens it further (N heads of 64 channels: N / 32 MiB per workspace half)


class Outcome(str, enum.Enum):
    """How a case ended, as the matrix classifies it."""

    TRAINED_THROUGH = "trained through"
    STALE_MEMORY_ERROR = "StaleMemoryError"  # graphsan stopped a replay before launch
    ILLEGAL_MEMORY_ACCESS = "illegal memory access"
    DEVICE_SIDE_ASSERT = "device-side assert"  # a kernel's bounds check, on indices overwritten
    SILENT_CORRUPTION = "silent corruption"  # a NaN or infinite loss, or losses off eager's
    OTHER = "other"  # any other error, a process that died or overran its time

    @classmethod
    def of(cls, outcome: str) -> Outcome:
        """The class of a result's outcome text ("timed out after 300 s" is OTHER)."""
        try:
            return cls(outcome)
        except ValueError:
            return cls.OTHER


# What a stale replay ends in: which one a run shows depends on whether the freed memory was
# unmapped or belongs to live tensors again by the replay (docs/te-3316.md, "Case 1's symptom").
STALE_REPLAY = frozenset(
    {Outcome.ILLEGAL_MEMORY_ACCESS, Outcome.DEVICE_SIDE_ASSERT, Outcome.SILENT_CORRUPTION}
)
TRAINS_THROUGH = frozenset({Outcome.TRAINED_THROUGH})
STOPPED = frozenset({Outcome.STALE_MEMORY_ERROR})
# where the lab frees the weight workspace (te218's recipe-class check in validation): the free
# site a StaleMemoryError case must name
WORKSPACE_FREE = "clear_workspace"


@dataclass(frozen=True)
class Case:
    n: int
    title: str
    precision: str
    scopes: tuple[str, ...]
    state: str  # "te218" | "fixed"
    graphsan: str  # "off" | "raise" | "record" | "pin"
    empty_cache: bool = True
    compare: bool = False  # compare losses with an eager reference run
    expected: frozenset[Outcome] = TRAINS_THROUGH  # any of these matches
    about: str = ""  # the expectation in words
    finding_freed_in: str = ""  # a finding must name this free site (graphsan on)

    def to_dict(self) -> dict:
        return {
            "case": self.n,
            "title": self.title,
            "recipe": self.precision,
            "graphed_modules": list(self.scopes),
            "state": self.state,
            "graphsan": self.graphsan,
            "empty_cache": self.empty_cache,
            "compare_with_eager": self.compare,
            "expected": _expected_values(self),
            "finding_freed_in": self.finding_freed_in or None,
            "about": self.about,
        }


def _expected_values(case: Case) -> list[str]:
    return [o.value for o in Outcome if o in case.expected]  # in the enum's order


CASES = [
    Case(
        1,
        "reported failure",
        "super-mixed",
        SCENARIO_SCOPES,
        "te218",
        "off",
        expected=STALE_REPLAY,
        about="a crash in the first step after validation (the report: an illegal memory "
        "access; here the stale writes may trip an index check or give a NaN loss instead, see "
        "docs/te-3316.md)",
    ),
    Case(
        2,
        "control: MXFP8 everywhere",
        "mxfp8-all",
        SCENARIO_SCOPES,
        "te218",
        "off",
        about="the override and the ambient recipe agree: nothing is freed",
    ),
    Case(
        3,
        "control: mamba not graphed",
        "super-mixed",
        NO_MAMBA,
        "te218",
        "off",
        about="out_proj runs eagerly: no graph holds its workspace",
    ),
    Case(
        4,
        "graphsan raise",
        "super-mixed",
        SCENARIO_SCOPES,
        "te218",
        "raise",
        expected=STOPPED,
        about="stopped before the replay, naming out_proj's weight workspace",
        finding_freed_in=WORKSPACE_FREE,
    ),
    Case(
        5,
        "no empty_cache",
        "super-mixed",
        SCENARIO_SCOPES,
        "te218",
        "record",
        empty_cache=False,
        compare=True,
        expected=STALE_REPLAY,
        about="corrupted training (wrong or NaN loss, or a crash on overwritten indices); "
        "graphsan records it",
        finding_freed_in=WORKSPACE_FREE,
    ),
    Case(
        6,
        "fixed state policy",
        "super-mixed",
        SCENARIO_SCOPES,
        "fixed",
        "off",
        compare=True,
        about=f"losses within {LOSS_RTOL:g} (relative) of eager",
    ),
    Case(
        7,
        "graphsan pin",
        "super-mixed",
        SCENARIO_SCOPES,
        "te218",
        "pin",
        about="pin keeps the workspace alive, te218 unchanged",
    ),
    Case(
        8,
        "prediction: MXFP8 base, NVFP4 out_proj",
        "mxfp8-base-nvfp4-outproj",
        SCENARIO_SCOPES,
        "te218",
        "off",
        expected=STALE_REPLAY,
        about="fails after validation like case 1",
    ),
    Case(
        9,
        "prediction under graphsan",
        "mxfp8-base-nvfp4-outproj",
        SCENARIO_SCOPES,
        "te218",
        "raise",
        expected=STOPPED,
        about="stopped before the replay, naming out_proj's NVFP4 weight workspace",
        finding_freed_in=WORKSPACE_FREE,
    ),
]
BY_NUMBER = {c.n: c for c in CASES}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--case",
        type=int,
        action="append",
        metavar="N",
        help=f"run only case N (1-{len(CASES)}; repeatable)",
    )
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--preset", default="small", help="model preset")
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="processes run side by side (0: every case and the eager reference at "
        "once, up to the number of CPU cores)",
    )
    parser.add_argument(
        "--mamba-heads",
        type=int,
        default=0,
        metavar="N",
        help="Mamba heads (of 64 channels) on the small preset (0: 64, so out_proj's MXFP8 "
        "weight workspace holds 2 MiB per half; the real model's spans many 2 MiB pages)",
    )
    parser.add_argument(
        "--html",
        metavar="PATH",
        action=OutputPathAction,
        help="also write the matrix and per-case loss curves as one self-contained HTML page",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="also write the cases (--list) or the results as JSON to PATH; without PATH "
        "(or with -) to stdout, the tables then go to stderr",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds a case may take")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    from graphsan.cli import DefaultsHelpFormatter, OneLineParser

    parser = OneLineParser(
        prog="graphsan repro",
        description="The Transformer Engine #3316 scenario matrix: each case in its own process "
        "on one NVIDIA GPU; exits 1 when a case does not end as expected.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_arguments(parser)
    return parser


def run(argv: list[str] | None = None) -> int:
    return main(build_parser().parse_args(argv))


# ----------------------------------------------------------------------------- one case (child)
def _config(case: Case, preset: str, reference: bool, mamba_heads: int = 0):
    from graphsan.lab.train.config import TrainConfig

    return TrainConfig(
        preset=preset,
        train_iters=ITERS,
        micro_batch_size=1,
        global_batch_size=2,
        seq_length=256,
        eval_interval=EVAL_AT,
        eval_iters=1,
        save_interval=EVAL_AT,
        save=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"graphsan-repro-{os.getpid()}"),
        empty_cache_on_save=case.empty_cache,
        manual_gc_interval=EVAL_AT,
        cuda_graph_modules=() if reference else case.scopes,
        cuda_graph_warmup_steps=WARMUP,
        graph_state="fixed" if reference else case.state,
        precision_config=case.precision,
        model_overrides=_model_overrides(preset, mamba_heads),
        num_layers_at_end_in_bf16=2,
        device="cuda",
        log_interval=1,
        quiet=True,
    )


def _model_overrides(preset: str, mamba_heads: int) -> dict:
    out = dict(WIDE_MAMBA.get(preset, {}))
    if mamba_heads:
        out["mamba_num_heads"] = mamba_heads
    return out


def run_child(n: int, preset: str, reference: bool, mamba_heads: int = 0) -> dict:
    """Run one case in this process; return what happened (the parent prints it)."""
    import torch

    import graphsan
    from graphsan.lab.train import trainer
    from graphsan.lab.train.trainer import train

    case = BY_NUMBER[n]
    startup = {"imports": _since_start()}
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # the CUDA context, on its own
        torch.cuda.synchronize()
        startup["cuda context"] = _since_start()
    build = trainer.build_model

    def timed_build(*args, **kwargs):
        model = build(*args, **kwargs)
        startup["model built"] = _since_start()

        def forward_done(module, inputs, output):
            startup.setdefault("first forward", _since_start())

        def backward_done(grad):  # the embedding's weight gradient comes last in backward
            startup.setdefault("first backward", _since_start())

        model.register_forward_hook(forward_done)
        model.embedding.weight.register_hook(backward_done)
        return model

    trainer.build_model = timed_build  # start-up time by phase (the matrix's start-up is slow)
    _report_progress()
    san = None
    if case.graphsan != "off" and not reference:
        san = graphsan.enable(policy=case.graphsan)
    cfg = _config(case, preset, reference, mamba_heads)
    out = {"outcome": "trained through", "iteration": None, "finding": "", "losses": []}
    out["symptom"] = ""
    out["startup"] = startup
    try:
        result = train(cfg)
        out["losses"] = [float(x) for x in result.losses]
        out["eval_losses"] = result.eval_losses
    except graphsan.StaleMemoryError as err:
        f = err.findings[0]
        # the iteration whose replay was stopped (f.step is the step of the free)
        it = _progress["done"] + 1
        out.update(outcome="StaleMemoryError", iteration=it, finding=f.one_line())
        out["report"] = str(err)
    except FloatingPointError as err:  # the trainer's check: a non-finite loss
        out.update(outcome="silent corruption", iteration=getattr(err, "iteration", None))
        out.update(symptom=str(err), losses=getattr(err, "losses", []))
    except RuntimeError as err:
        traceback.print_exc()  # where it surfaced (the kernel itself with CUDA_LAUNCH_BLOCKING=1)
        text = str(err)
        kind = _crash_kind(text) or "error"
        out.update(outcome=kind, iteration=getattr(err, "iteration", None))
        out["symptom"] = text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__
    if san is not None and san.findings and not out["finding"]:
        out["finding"] = san.findings[0].one_line()
        out["kinds"] = sorted({f.kind for f in san.findings})
    if san is not None and san.pinner is not None:
        out["pinned"] = san.pinner.summary()
    if out["iteration"] is None and out["outcome"] != "trained through":
        out["iteration"] = _progress["done"] + 1
    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # a dead context says so again here
            torch.cuda.synchronize()
    return out


_progress = {"done": 0}
_T0 = time.perf_counter()  # the child's start, for the per-iteration timeline


def _since_start() -> float:
    return round(time.perf_counter() - _T0, 1)


def _report_progress() -> None:
    """Print `ITERATION k` after each optimizer step, so the parent knows how far a case got
    even when the process dies on an illegal memory access."""
    import graphsan
    from graphsan.lab.train import optim

    orig = optim.MainGradAdamW.step

    def step(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        _progress["done"] += 1
        graphsan.step()  # the lab's optimizer is not a torch.optim.Optimizer
        print(f"ITERATION {_progress['done']} t={_since_start()}", flush=True)
        return out

    optim.MainGradAdamW.step = step


# ----------------------------------------------------------------------------- the matrix (parent)
def _spawn(
    case: Case,
    preset: str,
    reference: bool = False,
    timeout: float = 300,
    threads: int = 0,
    mamba_heads: int = 0,
) -> dict:
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
    lines: list[str] = []

    def pump() -> None:
        lines.extend(proc.stdout)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.kill()
        rc, timed_out = proc.wait(), True
    reader.join(timeout=10)
    log = "".join(lines)
    wall = time.perf_counter() - t0
    try:
        with open(result_path) as fh:
            text = fh.read()
    finally:
        os.unlink(result_path)
    if timed_out:
        res = {"outcome": f"timed out after {timeout:.0f} s", "losses": []}
        res.update(iteration=_last_logged_iteration(log), finding="", symptom="")
    else:
        res = _result_of(text, log, rc)
    res["wall_s"] = wall
    res["timeline"] = _iteration_times(log)
    res["log_tail"] = log[-3000:]
    return res


def child_command(
    case: Case, preset: str, reference: bool, mamba_heads: int, result_path: str
) -> list[str]:
    """The command line of one case's process."""
    cmd = [sys.executable, "-m", "graphsan.cli", "repro", "--child", str(case.n)]
    cmd += ["--preset", preset, "--result", result_path]
    cmd += ["--reference"] if reference else []
    cmd += ["--mamba-heads", str(mamba_heads)] if mamba_heads else []
    return cmd


def _crash_kind(text: str) -> str | None:
    """The CUDA error a stale replay ends in: a fault on unmapped memory, or a kernel's own
    bounds check tripping over indices that the replay's stale writes overwrote."""
    if "illegal memory access" in text:
        return "illegal memory access"
    # the kernel's own message counts too: PyTorch's "device-side assert triggered" can be lost
    # when a GPU-trace hook runs while the error is being raised (SystemError in the hook)
    if "device-side assert" in text or _KERNEL_ASSERT.search(text):
        return "device-side assert"
    return None


_KERNEL_ASSERT = re.compile(r"\.cuh?:\d+: .*Assertion `.*` failed")


def _result_of(result: str, log: str, rc: int) -> dict:
    """The child's own result (JSON it wrote), or what its log and exit status say."""
    if result:
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(result)
    if _crash_kind(log):
        outcome = _crash_kind(log)
    elif rc < 0:
        outcome = f"killed by signal {-rc}"
    else:
        outcome = f"died (exit {rc})"
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    return {
        "outcome": outcome,
        "iteration": _last_logged_iteration(log),
        "finding": "",
        "symptom": _first_error_line(log) or (lines[-1][:200] if lines else ""),
        "losses": [],
    }


def _first_error_line(log: str) -> str:
    for line in log.splitlines():
        if "CUDA error" in line or "Error:" in line:
            return line.strip()[:200]
    return ""


def _iteration_times(log: str) -> list[float]:
    """Seconds from the child's start to the end of each iteration (`ITERATION k t=...`)."""
    times = []
    for line in log.splitlines():
        if line.startswith("ITERATION ") and " t=" in line:
            times.append(float(line.rsplit("t=", 1)[1]))
    return times


def _last_logged_iteration(log: str) -> int | None:
    last = None
    for line in log.splitlines():
        if line.startswith("ITERATION "):
            last = int(line.split()[1])
    return None if last is None else last + 1


def _compare(res: dict, ref: dict) -> str:
    """Per-iteration loss against the eager run, over the iterations both have (a case that
    stopped on a NaN loss has fewer); NaN counts as an infinite difference."""
    a, b = res.get("losses", []), ref.get("losses", [])
    if len(b) < ITERS or not all(math.isfinite(y) for y in b):
        return f"inconclusive: the eager reference {ref.get('outcome', 'gave no losses')}"
    n = min(len(a), len(b))
    if n <= EVAL_AT:
        return "no losses after validation to compare"
    rel = [
        abs(x - y) / max(abs(y), 1e-12) if math.isfinite(x) else math.inf
        for x, y in zip(a[:n], b[:n], strict=True)
    ]
    before, after = max(rel[:EVAL_AT]), max(rel[EVAL_AT:])
    res["rel_diff_before_eval"], res["rel_diff_after_eval"] = before, after
    res["rel_diff"] = rel
    return f"loss vs eager: max rel diff {before:.1e} up to validation, {after:.1e} after"


def run_matrix(
    cases: list[Case],
    preset: str,
    jobs: int,
    timeout: float = 300,
    mamba_heads: int = 0,
    out=None,
) -> list[tuple[Case, dict]]:
    """Run the cases side by side; each finished case prints one line at once (a slow or hung
    case never hides the others' results). Every result is judged against its case's
    expectation (`matched`, and `mismatch` says why not)."""
    out = out or sys.stdout
    needs_ref = any(c.compare for c in cases)
    ref_case = next(c for c in cases if c.compare) if needs_ref else None
    cores = os.cpu_count() or 1
    if jobs <= 0:
        jobs = min(len(cases) + needs_ref, cores)
    # The cores are shared out: torch's CPU ops (the model's weights are drawn on the CPU) start
    # one OpenMP thread per core in every process, and ten processes with 16 threads each on 16
    # cores made building the model take ~125 s instead of ~2 s (H200 machine, 2026-11-30).
    threads = max(1, cores // jobs)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        ref_future = (
            pool.submit(_spawn, ref_case, preset, True, timeout, threads, mamba_heads)
            if ref_case
            else None
        )
        futures = {
            pool.submit(_spawn, c, preset, False, timeout, threads, mamba_heads): c for c in cases
        }
        done: dict[int, dict] = {}
        for fut in as_completed(futures):
            c = futures[fut]
            r = done[c.n] = fut.result()
            first = r.get("timeline") or ["-"]
            phases = ", ".join(f"{k} {v}" for k, v in r.get("startup", {}).items())
            print(
                f"case {c.n} ({c.title}): {r['outcome']}, iteration "
                f"{r.get('iteration') or '-'}, {r['wall_s']:.0f} s (seconds after start: "
                f"{phases + ', ' if phases else ''}first iteration {first[0]})",
                file=out,
                flush=True,
            )
        results = [(c, done[c.n]) for c in cases]
        ref = ref_future.result() if ref_future else None
    for c, res in results:
        if c.compare and ref is not None:
            res["comparison"] = _compare(res, ref)
            res["reference_timeline"] = ref.get("timeline")
            res["reference_losses"] = ref.get("losses")
            res["reference_eval_losses"] = ref.get("eval_losses")
            res["reference_outcome"] = f"{ref.get('outcome')}, {ref.get('wall_s', math.nan):.0f} s"
            after = res.get("rel_diff_after_eval")
            if res["outcome"] == "trained through" and after is not None and after > LOSS_RTOL:
                res["outcome"] = "silent corruption"
    for c, res in results:
        mismatch = judge(c, res)
        res["matched"], res["mismatch"] = not mismatch, mismatch
    return results


def judge(case: Case, res: dict) -> str:
    """Why the result does not match the case's expectation ("" when it does)."""
    kind = Outcome.of(res.get("outcome", ""))
    if kind not in case.expected:
        return f"expected {' or '.join(_expected_values(case))}"
    it = res.get("iteration")
    if kind is not Outcome.TRAINED_THROUGH and it is not None and it <= EVAL_AT:
        return f"ended in iteration {it}; expected after validation (iteration {EVAL_AT})"
    if case.finding_freed_in and f"in {case.finding_freed_in}" not in res.get("finding", ""):
        return f"expected graphsan's finding to name memory freed in {case.finding_freed_in}"
    if case.compare and kind is Outcome.TRAINED_THROUGH and "rel_diff_after_eval" not in res:
        return f"expected a comparison with eager; {res.get('comparison') or 'there was none'}"
    return ""


def print_cases(cases: list[Case], out=None) -> None:
    out = out or sys.stdout
    print(
        "| case | title | recipe | graphed modules | state | graphsan | empty_cache | expected |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|---|", file=out)
    for c in cases:
        expected = " or ".join(_expected_values(c))
        print(
            f"| {c.n} | {c.title} | {c.precision} | {','.join(c.scopes)} | {c.state} | "
            f"{c.graphsan} | {'yes' if c.empty_cache else 'no'} | {expected}: {c.about} |",
            file=out,
        )


def print_results(results: list[tuple[Case, dict]], out=None) -> None:
    out = out or sys.stdout
    print(
        "| case | recipe | graphed modules | state | graphsan | outcome | as expected | "
        "iteration | evidence | graphsan's finding | wall s |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for c, r in results:
        evidence = "; ".join(x for x in (r.get("symptom"), r.get("comparison")) if x)
        finding = r.get("finding", "")
        if len(r.get("kinds", [])) > 1:
            finding += f" (kinds: {', '.join(r['kinds'])})"
        matched = "yes" if r.get("matched") else f"NO: {r.get('mismatch', '')}"
        print(
            f"| {c.n} | {c.precision} | {','.join(c.scopes)} | {c.state} | {c.graphsan} | "
            f"{r['outcome']} | {_cell(matched)} | {r.get('iteration') or '-'} | "
            f"{_cell(evidence)} | {_cell(finding)} | {r['wall_s']:.1f} |",
            file=out,
        )


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ") or "-"


def _error(msg: str) -> int:
    sys.stderr.write(f"graphsan repro: error: {msg}\n")
    return 2


def _check_args(args: argparse.Namespace) -> str:
    """What is wrong with the options of a matrix run ("" when nothing)."""
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout {args.timeout}: expected a number of seconds > 0"
    if args.jobs < 0:
        return f"--jobs {args.jobs}: expected >= 0 (0: as many as the cases need)"
    if args.mamba_heads < 0:
        return f"--mamba-heads {args.mamba_heads}: expected >= 0 (0: the default width)"
    from graphsan.lab.models import PRESETS, get_preset

    if args.preset not in PRESETS:
        return f"--preset {args.preset}: expected one of {', '.join(PRESETS)}"
    try:
        get_preset(args.preset).replace(**_model_overrides(args.preset, args.mamba_heads))
    except ValueError as err:
        return f"--mamba-heads {args.mamba_heads}: {err}"
    return ""


def main(args: argparse.Namespace) -> int:
    if args.child is not None:
        res = run_child(args.child, args.preset, args.reference, args.mamba_heads)
        text = json.dumps(res)
        if args.result:
            with open(args.result, "w") as fh:
                fh.write(text)
        else:
            print("RESULT " + text, flush=True)
        return 0
    unknown = [n for n in args.case or [] if n not in BY_NUMBER]
    if unknown:
        return _error(f"no case {unknown[0]}; expected 1-{len(CASES)}")
    cases = [BY_NUMBER[n] for n in args.case] if args.case else CASES
    to_stdout = args.json == "-"
    if args.json is not None and not to_stdout:
        from graphsan.cli import CliError, check_output_file

        try:
            check_output_file(args.json, "--json")
        except CliError as err:
            return _error(str(err))
    out = sys.stderr if to_stdout else sys.stdout  # the JSON alone goes to stdout
    if args.list:
        print_cases(cases, out)
        if args.json is not None:
            _write_json([c.to_dict() for c in cases], args.json)
        return 0
    problem = _check_args(args)
    if problem:
        return _error(problem)
    import torch

    if not torch.cuda.is_available():
        print_cases(cases, out)
        sys.stderr.write(
            "graphsan repro: error: these cases train with CUDA graphs and need an NVIDIA GPU "
            "(torch.cuda.is_available() is False here); `graphsan repro --list` shows them, "
            "`graphsan train --preset tiny` runs the lab eagerly on CPU\n"
        )
        return 1
    t0 = time.perf_counter()
    results = run_matrix(cases, args.preset, args.jobs, args.timeout, args.mamba_heads, out)
    print_results(results, out)
    ref = next((r["reference_outcome"] for _, r in results if "reference_outcome" in r), None)
    if ref:
        print(f"\neager reference run (for the comparisons): {ref}", file=out)
    print(
        f"\nwhole matrix: {time.perf_counter() - t0:.0f} s wall on {torch.cuda.get_device_name()}",
        file=out,
    )
    for c, r in results:
        if r.get("report"):
            print(f"\ncase {c.n}, graphsan's report:\n{r['report']}", file=out)
    if args.json is not None:
        _write_json([{"case": c.to_dict(), "result": r} for c, r in results], args.json)
    if args.html and not write_matrix_page(
        args.html, [{"case": c.to_dict(), "result": r} for c, r in results]
    ):
        return 2
    missed = [(c, r) for c, r in results if not r["matched"]]
    for c, r in missed:
        sys.stderr.write(
            f"graphsan repro: case {c.n} ({c.title}) did not end as expected: "
            f"{r['outcome']}; {r['mismatch']}\n"
        )
    return 1 if missed else 0


def _write_json(data, path: str) -> None:
    if path == "-":
        json.dump(data, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
        return
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, default=str)
