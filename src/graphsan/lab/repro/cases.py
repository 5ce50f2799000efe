"""The matrix's cases: what each one trains, and how it is expected to end."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from graphsan.lab.choices import Schedule, StatePolicy

SCENARIO_SCOPES = ("attn", "mamba", "moe_router", "moe_preprocess")
NO_MAMBA = ("attn", "moe_router", "moe_preprocess")
# graphs that hold no index tensors: an overwrite there corrupts numbers, not routing
DENSE_SCOPES = ("attn", "mamba")
# iterations: 1-3 eager warm-up, 4 capture, validation + save + GC at 5, first backward after it
# at 6, and one more step to see whether training goes on
WARMUP, EVAL_AT, ITERS = 3, 5, 7
AFTER_EVAL = EVAL_AT + 1  # the first iteration after validation
# A relative loss gap to the eager run above this, after validation, counts as corruption: graphed
# and eager runs never agree bit for bit (docs/te-3316.md, "The matrix").
LOSS_RTOL = 1e-2
# A wider Mamba than `small`'s, so out_proj's weight workspace fills whole pages of the large pool
# that empty_cache can unmap, as in the real model (docs/te-3316.md, "The matrix").
WIDE_MAMBA = {"small": {"mamba_num_heads": 64, "mamba_head_dim": 64}}


class Outcome(str, enum.Enum):
    """How a case ended, as the matrix classifies it."""

    TRAINED_THROUGH = "trained through"
    STALE_MEMORY_ERROR = "StaleMemoryError"  # graphsan stopped a replay before launch
    ILLEGAL_MEMORY_ACCESS = "illegal memory access"
    DEVICE_SIDE_ASSERT = "device-side assert"  # a kernel's bounds check, on indices overwritten
    SILENT_CORRUPTION = "silent corruption"  # a NaN or infinite loss, or losses off eager's
    # one rank of several: stopped while another rank had failed (killed while waiting in a
    # collective, or a collective's error because the peer was gone)
    PEER_FAILED = "stopped after a peer rank failed"
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
    state: StatePolicy
    graphsan: str  # "off" | "raise" | "record" | "pin"
    empty_cache: bool = True
    compare: bool = False  # compare losses with an eager reference run
    expected: frozenset[Outcome] = TRAINS_THROUGH  # any of these matches
    about: str = ""  # the expectation in words
    finding_freed_in: str = ""  # a finding must name this free site (graphsan on)
    # the step's microbatch order, and the graphs' capture order where it differs from it
    schedule: Schedule = Schedule.SEQUENTIAL
    captured_in: Schedule | None = None
    fails_from: int = AFTER_EVAL  # an expected failure comes in this iteration or later
    finding_kinds: frozenset[str] = frozenset()  # the first finding is one of these kinds
    reuse_buffers: bool = False  # TE's _reuse_graph_input_output_buffers (train/graphs.py)

    def __post_init__(self):
        # a case written with the policy's name ("te218") gets the policy itself
        object.__setattr__(self, "state", StatePolicy.parse(self.state, f"case {self.n}: state"))
        object.__setattr__(
            self, "schedule", Schedule.parse(self.schedule, f"case {self.n}: schedule")
        )
        if self.captured_in is not None:
            captured_in = Schedule.parse(self.captured_in, f"case {self.n}: captured_in")
            object.__setattr__(self, "captured_in", captured_in)

    def to_json(self) -> dict:
        """The case as `graphsan repro --list --json` writes it (and the matrix page reads)."""
        return {
            "case": self.n,
            "title": self.title,
            "recipe": self.precision,
            "graphed_modules": list(self.scopes),
            "state": self.state,
            "graphsan": self.graphsan,
            "empty_cache": self.empty_cache,
            "compare_with_eager": self.compare,
            "expected": self.expected_values(),
            "finding_freed_in": self.finding_freed_in or None,
            "about": self.about,
            "schedule": self.schedule,
            "captured_in": self.captured_in,
            "finding_kinds": sorted(self.finding_kinds),
            "reuse_graph_buffers": self.reuse_buffers,
        }

    def expected_values(self) -> list[str]:
        """The expected outcomes as words, in the enum's order."""
        return [o.value for o in Outcome if o in self.expected]


def _pipeline_case(n: int, title: str, scopes: tuple[str, ...], graphsan: str, **rest) -> Case:
    """A schedule case (docs/te-3316.md, cases 10-13): a 1F1B step over graphs captured in
    sequence, wrong from the first graphed step; MXFP8 everywhere and the fixed state policy free
    no workspace, so the schedule is the only mistake."""
    # one definition, so that the unwatched cases and their graphsan twins run the same schedule
    return Case(
        n,
        title,
        "mxfp8-all",
        scopes,
        StatePolicy.FIXED,
        graphsan,
        schedule=Schedule.ONE_F_ONE_B,
        captured_in=Schedule.SEQUENTIAL,
        fails_from=WARMUP + 1,
        **rest,
    )


CASES = [
    Case(
        1,
        "reported failure",
        "super-mixed",
        SCENARIO_SCOPES,
        StatePolicy.TE218,
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
        StatePolicy.TE218,
        "off",
        about="the override and the ambient recipe agree: nothing is freed",
    ),
    Case(
        3,
        "control: mamba not graphed",
        "super-mixed",
        NO_MAMBA,
        StatePolicy.TE218,
        "off",
        about="out_proj runs eagerly: no graph holds its workspace",
    ),
    Case(
        4,
        "graphsan raise",
        "super-mixed",
        SCENARIO_SCOPES,
        StatePolicy.TE218,
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
        StatePolicy.TE218,
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
        StatePolicy.FIXED,
        "off",
        compare=True,
        about=f"losses within {LOSS_RTOL:g} (relative) of eager",
    ),
    Case(
        7,
        "graphsan pin",
        "super-mixed",
        SCENARIO_SCOPES,
        StatePolicy.TE218,
        "pin",
        about="pin keeps the workspace alive, te218 unchanged",
    ),
    Case(
        8,
        "prediction: MXFP8 base, NVFP4 out_proj",
        "mxfp8-base-nvfp4-outproj",
        SCENARIO_SCOPES,
        StatePolicy.TE218,
        "off",
        expected=STALE_REPLAY,
        about="fails after validation like case 1",
    ),
    Case(
        9,
        "prediction under graphsan",
        "mxfp8-base-nvfp4-outproj",
        SCENARIO_SCOPES,
        StatePolicy.TE218,
        "raise",
        expected=STOPPED,
        about="stopped before the replay, naming out_proj's NVFP4 weight workspace",
        finding_freed_in=WORKSPACE_FREE,
    ),
    _pipeline_case(
        10,
        "pipeline schedule: 1F1B over graphs captured in sequence",
        SCENARIO_SCOPES,
        "off",
        compare=True,
        expected=STALE_REPLAY,
        about="the second forward writes over the first microbatch's saved activations before "
        "its backward reads them: corrupted training from the first graphed step",
    ),
    _pipeline_case(
        11,
        "pipeline schedule under graphsan",
        SCENARIO_SCOPES,
        "raise",
        expected=STOPPED,
        finding_kinds=frozenset({"replay-order", "live-output"}),
        about="stopped before a replay out of capture order, naming both graphs",
    ),
    _pipeline_case(
        12,
        "pipeline schedule, graph buffers reused: 1F1B over graphs captured in sequence",
        DENSE_SCOPES,
        "off",
        compare=True,
        expected=frozenset({Outcome.SILENT_CORRUPTION}),
        reuse_buffers=True,
        about="the second forward writes over outputs of the first that the pool got back at "
        "capture and eager code still holds: losses drift from the eager run's, no error",
    ),
    _pipeline_case(
        13,
        "pipeline schedule, graph buffers reused, under graphsan",
        DENSE_SCOPES,
        "raise",
        expected=STOPPED,
        reuse_buffers=True,
        finding_kinds=frozenset({"live-output"}),
        about="stopped before the second forward's launch, naming the first forward's output "
        "and the backward graph whose capture came before the pool got it back",
    ),
]
BY_NUMBER = {c.n: c for c in CASES}


def case_config(
    case: Case, preset: str, reference: bool, mamba_heads: int = 0, world_size: int = 1
):
    """The training configuration of a case (`reference`: its eager, fixed-policy twin). On
    `world_size` ranks every rank trains what one GPU does (two microbatches, so the graphs per
    microbatch are the same) and the routed experts are split across the ranks, as in the
    reported job."""
    from graphsan.lab.train.config import TrainConfig

    return TrainConfig(
        preset=preset,
        train_iters=ITERS,
        micro_batch_size=1,
        global_batch_size=2 * world_size,
        world_size=world_size,
        expert_model_parallel_size=world_size,
        distributed_timeout_minutes=5,
        seq_length=256,
        eval_interval=EVAL_AT,
        eval_iters=1,
        save_interval=EVAL_AT,
        save=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"graphsan-repro-{os.getpid()}"),
        empty_cache_on_save=case.empty_cache,
        manual_gc_interval=EVAL_AT,
        cuda_graph_modules=() if reference else case.scopes,
        microbatch_schedule=case.schedule,
        capture_schedule=None if reference else case.captured_in,
        reuse_graph_buffers=case.reuse_buffers and not reference,
        cuda_graph_warmup_steps=WARMUP,
        state_policy=StatePolicy.FIXED if reference else case.state,
        precision_config=case.precision,
        model_overrides=model_overrides(preset, mamba_heads),
        num_layers_at_end_in_bf16=2,
        device="cuda",
        log_interval=1,
        quiet=True,
    )


def model_overrides(preset: str, mamba_heads: int) -> dict:
    """The matrix's model changes to `preset`; `mamba_heads` widens the Mamba further."""
    out = dict(WIDE_MAMBA.get(preset, {}))
    if mamba_heads:
        out["mamba_num_heads"] = mamba_heads
    return out
