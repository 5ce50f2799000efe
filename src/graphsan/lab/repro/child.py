"""The child side: one case trained in this process, and what happened to it.

    python -m graphsan.lab.repro.child N --result PATH [--preset P] [--reference]
        [--mamba-heads H] [--report-file PATH]

`graphsan repro` starts one such process per case (per rank with --nproc). The result goes to
PATH as one `RESULT {json}` line (`graphsan.command_line.write_result`), in a file of its own:
the parent merges the child's stdout and stderr into one log, where lines may interleave.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback

from graphsan.command_line import DefaultsHelpFormatter, OneLineParser, write_result
from graphsan.lab.repro import logparse
from graphsan.lab.repro.cases import BY_NUMBER, Outcome, case_config
from graphsan.lab.repro.result import CaseResult
from graphsan.lab.train.callbacks import Callback
from graphsan.report.output import writing

_T0 = time.perf_counter()  # the child's start, for the start-up phases and the timeline


def since_start() -> float:
    return round(time.perf_counter() - _T0, 1)


class ChildProgress(Callback):
    """Times the start-up phases and prints a progress line after each optimizer step, so the
    parent knows how far a case got even when the process dies on an illegal memory access."""

    def __init__(self, startup: dict[str, float]):
        self.startup = startup
        self.done = 0  # optimizer steps finished

    def on_model_built(self, model) -> None:
        self.startup["model built"] = since_start()

        def forward_done(module, inputs, output):
            self.startup.setdefault("first forward", since_start())

        def backward_done(grad):  # the embedding's weight gradient comes last in backward
            self.startup.setdefault("first backward", since_start())

        model.register_forward_hook(forward_done)
        model.embedding.weight.register_hook(backward_done)

    def on_step_end(self, iteration: int) -> None:
        import graphsan

        self.done = iteration
        graphsan.step()  # the lab's optimizer is not a torch.optim.Optimizer
        print(logparse.progress_line(iteration, since_start()), flush=True)


def first_finding(findings) -> str:
    """The first finding in one line, for the matrix's table."""
    from graphsan.report.text import one_line

    return one_line(findings[0])


def run_child(
    n: int, preset: str, reference: bool, mamba_heads: int = 0, report: str | None = None
) -> CaseResult:
    """Run case `n` (or its eager reference) in this process, one rank of several under
    torchrun's environment; return what happened. `report`: where graphsan's JSON report goes
    (when the case runs graphsan)."""
    import torch

    import graphsan
    from graphsan.lab.train.distributed import world_from_env
    from graphsan.lab.train.trainer import TrainingDiverged, train

    case = BY_NUMBER[n]
    startup = {"imports": since_start()}
    if torch.cuda.is_available():
        # one rank of several: its own GPU, before graphsan watches "the" device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.zeros(1, device="cuda")  # the CUDA context, on its own
        torch.cuda.synchronize()
        startup["cuda context"] = since_start()
    progress = ChildProgress(startup)
    san = None
    if case.graphsan != "off" and not reference:
        san = graphsan.enable(policy=case.graphsan)
    cfg = case_config(case, preset, reference, mamba_heads, world_from_env()[1])
    out = CaseResult()
    try:
        result = train(cfg, callbacks=[progress])
        out = out.replace(losses=result.losses, eval_losses=result.eval_losses)
    except graphsan.StaleMemoryError as err:
        # the iteration whose replay was stopped (the finding's step is the step of the free)
        out = out.replace(
            outcome=Outcome.STALE_MEMORY_ERROR.value,
            iteration=progress.done + 1,
            finding=first_finding(err.findings),
            report=str(err),
        )
    except TrainingDiverged as err:
        out = out.replace(
            outcome=Outcome.SILENT_CORRUPTION.value,
            iteration=err.iteration,
            symptom=str(err),
            losses=err.losses,
        )
    except RuntimeError as err:
        traceback.print_exc()  # where it surfaced (the kernel itself with CUDA_LAUNCH_BLOCKING=1)
        text = str(err).strip()
        crash = logparse.crash_kind(text)
        out = out.replace(
            outcome=crash.value if crash else "error",
            symptom=text.splitlines()[0][:200] if text else type(err).__name__,
        )
    if san is not None and san.findings and not out.finding:
        kinds = sorted({getattr(f.kind, "value", f.kind) for f in san.findings})
        out = out.replace(finding=first_finding(san.findings), kinds=kinds)
    if san is not None and san.pinner is not None:
        out = out.replace(pinned=san.pinner.summary())
    if san is not None and report:
        san.report().save(report)
    if out.iteration is None and out.kind is not Outcome.TRAINED_THROUGH:
        out = out.replace(iteration=progress.done + 1)
    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # a dead context says so again here
            torch.cuda.synchronize()
    # the start-up phases as the progress callback recorded them, the first steps' included
    return out.replace(startup=startup)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m graphsan.lab.repro.child",
        description="One case of `graphsan repro` in this process (the matrix starts one per "
        "case and rank); its result goes to --result as one RESULT line.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("case", type=int, metavar="N", help=f"the case (1-{len(BY_NUMBER)})")
    parser.add_argument(
        "--result", required=True, metavar="PATH", help="the file the parent reads the result from"
    )
    parser.add_argument("--preset", default="small", help="model preset")
    parser.add_argument(
        "--reference", action="store_true", help="the case's eager reference run instead"
    )
    parser.add_argument(
        "--mamba-heads", type=int, default=0, metavar="N", help="Mamba heads (0: the default)"
    )
    parser.add_argument(
        "--report-file", metavar="PATH", help="where graphsan's JSON report of the case goes"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.case not in BY_NUMBER:
        parser.error(f"no case {args.case}; expected 1-{len(BY_NUMBER)}")
    res = run_child(args.case, args.preset, args.reference, args.mamba_heads, args.report_file)
    with writing(args.result) as fh:
        write_result(res.to_json(), fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
