"""`graphsan repro`: the Transformer Engine #3316 scenario matrix on one GPU (or N).

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
    graphsan repro --nproc 2    # each case as a two-rank torch.distributed job (2 GPUs)

Each case has a typed expected outcome (a set where runs legitimately showed more than one, see
docs/te-3316.md); the table says whether each case matched, and the command exits 1 when one did
not.

Modules: `cases` (the table and each case's training configuration), `result` (`CaseResult`
and `RankResult`, frozen, with `to_json`/`from_json`: the `--json` format, checked field by field),
`child` (one case in this process: `python -m graphsan.lab.repro.child`), `runner` (one process
per case, the matrix side by side), `logparse` (the child's result file, a dead child's log),
`compare` (losses against eager, the verdict), `table` (markdown), `cli` (the command).
"""

from graphsan.lab.repro.cases import (
    BY_NUMBER,
    CASES,
    EVAL_AT,
    ITERS,
    LOSS_RTOL,
    NO_MAMBA,
    SCENARIO_SCOPES,
    WARMUP,
    WIDE_MAMBA,
    Case,
    Outcome,
    case_config,
)
from graphsan.lab.repro.cli import add_arguments, build_parser, main, run
from graphsan.lab.repro.compare import judge
from graphsan.lab.repro.result import CaseResult, RankResult, ResultError
from graphsan.lab.repro.runner import run_matrix

__all__ = [
    "BY_NUMBER",
    "CASES",
    "EVAL_AT",
    "ITERS",
    "LOSS_RTOL",
    "NO_MAMBA",
    "SCENARIO_SCOPES",
    "WARMUP",
    "WIDE_MAMBA",
    "Case",
    "CaseResult",
    "Outcome",
    "RankResult",
    "ResultError",
    "add_arguments",
    "build_parser",
    "case_config",
    "judge",
    "main",
    "run",
    "run_matrix",
]
