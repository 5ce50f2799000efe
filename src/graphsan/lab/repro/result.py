"""What one case ended in: the child's own account, what the parent adds, and the verdict."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from graphsan.lab.repro.cases import Outcome


@dataclass
class CaseResult:
    """One case's run. `outcome` is an `Outcome` value or a description of how the process died
    ("timed out after 300 s", "killed by signal 9"), which classifies as `Outcome.OTHER`."""

    outcome: str = Outcome.TRAINED_THROUGH.value
    iteration: int | None = None  # the iteration it ended in (None: it trained through)
    finding: str = ""  # graphsan's first finding, one line
    symptom: str = ""  # the error's first line
    losses: list[float] = field(default_factory=list)
    eval_losses: list = field(default_factory=list)  # (iteration, loss) pairs
    kinds: list[str] = field(default_factory=list)  # finding kinds, when graphsan found several
    report: str = ""  # graphsan's whole report of a stopped replay
    pinned: dict | None = None  # the pin policy's summary
    startup: dict[str, float] = field(default_factory=dict)  # phase -> seconds after start
    # filled in by the parent
    ranks: list[dict] = field(default_factory=list)  # on several ranks: what each one saw
    wall_s: float = 0.0
    timeline: list[float] = field(default_factory=list)  # seconds after start, per iteration
    log_tail: str = ""
    # filled in by the comparison with the eager reference run
    comparison: str = ""
    rel_diff: list[float] = field(default_factory=list)
    rel_diff_before_eval: float | None = None
    rel_diff_after_eval: float | None = None
    reference_outcome: str = ""
    reference_timeline: list[float] | None = None
    reference_losses: list[float] | None = None
    reference_eval_losses: list | None = None
    # the verdict against the case's expectation
    matched: bool | None = None
    mismatch: str = ""

    @property
    def kind(self) -> Outcome:
        return Outcome.of(self.outcome)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CaseResult:
        """A result as `to_dict` wrote it; unknown keys are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
