"""What one case ended in, typed: the child's own account, what the parent adds, the comparison
with the eager run and the verdict.

The results are frozen: each stage makes a new one (`CaseResult.replace`). `to_json` gives the
dict that `graphsan repro --json` writes and the HTML matrix page reads (its keys and their
order are the format); `from_json` reads one back, field by field, so a child's damaged result
file is one `ResultError` that names the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from graphsan.lab.repro.cases import AFTER_EVAL, Outcome


class ResultError(ValueError):
    """A result that does not fit its type; the message names the field and what was expected."""


def _bad(name: str, expected: str, value: Any) -> ResultError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ResultError(f"field '{name}': expected {expected}, got {shown}")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _text(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _bad(name, "a string", v)
    return v


def _count_or_none(name: str, v: Any) -> int | None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise _bad(name, "an integer or null", v)
    return v


def _count(name: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(name, "an integer", v)
    return v


def _number(name: str, v: Any) -> float:
    if not _is_number(v):
        raise _bad(name, "a number", v)
    return v


def _number_or_none(name: str, v: Any) -> float | None:
    return None if v is None else _number(name, v)


def _flag_or_none(name: str, v: Any) -> bool | None:
    if v is not None and not isinstance(v, bool):
        raise _bad(name, "true, false or null", v)
    return v


def _list(name: str, v: Any, item: Callable[[str, Any], Any]) -> tuple:
    if not isinstance(v, (list, tuple)):
        raise _bad(name, "a list", v)
    return tuple(item(f"{name}[{i}]", x) for i, x in enumerate(v))


def _numbers(name: str, v: Any) -> tuple[float, ...]:
    return _list(name, v, _number)


def _numbers_or_none(name: str, v: Any) -> tuple[float, ...] | None:
    return None if v is None else _numbers(name, v)


def _texts(name: str, v: Any) -> tuple[str, ...]:
    return _list(name, v, _text)


def _eval_point(name: str, v: Any) -> tuple[int, float]:
    if not (isinstance(v, (list, tuple)) and len(v) == 2):
        raise _bad(name, "an [iteration, loss] pair", v)
    return (_count(f"{name}[0]", v[0]), _number(f"{name}[1]", v[1]))


def _eval_points(name: str, v: Any) -> tuple[tuple[int, float], ...]:
    return _list(name, v, _eval_point)


def _eval_points_or_none(name: str, v: Any) -> tuple[tuple[int, float], ...] | None:
    return None if v is None else _eval_points(name, v)


def _object_or_none(name: str, v: Any) -> dict | None:
    if v is not None and not isinstance(v, Mapping):
        raise _bad(name, "an object or null", v)
    return None if v is None else dict(v)


def _seconds_by_phase(name: str, v: Any) -> dict[str, float]:
    if not isinstance(v, Mapping):
        raise _bad(name, "an object of phase: seconds", v)
    return {_text(f"{name} key", k): _number(f"{name}[{json.dumps(k)}]", x) for k, x in v.items()}


def _plain(v: Any) -> Any:
    """A field's value as JSON writes it: tuples as lists, results as their dicts."""
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, RankResult):
        return v.to_json()
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    return v


Readers = Mapping[str, Callable[[str, Any], Any]]


def _check_fields(obj: Any, readers: Readers, prefix: str) -> None:
    """Check and normalize every field of a frozen result in place (lists become tuples)."""
    for f in dataclasses.fields(obj):
        value = readers[f.name](prefix + f.name, getattr(obj, f.name))
        object.__setattr__(obj, f.name, value)


def _read(cls, readers: Readers, data: Any, where: str, required: tuple[str, ...] = ()) -> dict:
    """The fields of `cls` in the JSON object `data`, each checked (a name in an error starts
    with `where`); other keys are ignored, as a newer writer's would be."""
    if not isinstance(data, Mapping):
        what = f"field '{where[:-1]}'" if where else "the result"
        raise ResultError(f"{what}: expected an object, got {type(data).__name__}")
    for name in required:
        if name not in data:
            raise ResultError(f"field '{where}{name}': missing")
    names = [f.name for f in dataclasses.fields(cls)]
    return {k: readers[k](where + k, data[k]) for k in names if k in data}


class _Checked:
    """What both results share: every field checked by its reader (`_READERS`, a field without
    one fails with a KeyError) on construction, and the kind of its outcome."""

    _READERS: ClassVar[Readers]

    def __post_init__(self):
        _check_fields(self, self._READERS, "")

    @property
    def kind(self) -> Outcome:
        return Outcome.of(self.outcome)


def _rank(name: str, v: Any) -> int:
    if _count(name, v) < 0:
        raise _bad(name, "a rank (an integer >= 0)", v)
    return v


_RANK_READERS = {
    "rank": _rank,
    "outcome": _text,
    "iteration": _count_or_none,
    "finding": _text,
    "symptom": _text,
}


@dataclass(frozen=True)
class RankResult(_Checked):
    """What one rank of a case run on several (`--nproc`) saw: its outcome, the iteration it
    ended in, graphsan's first finding and the error's first line."""

    rank: int
    outcome: str
    iteration: int | None = None
    finding: str = ""
    symptom: str = ""

    _READERS: ClassVar[Readers] = _RANK_READERS

    def describe(self, short: bool = False) -> str:
        """`rank 1: StaleMemoryError (iteration 6)`; short: `rank 1: StaleMemoryError @6`."""
        if not self.iteration:
            return f"rank {self.rank}: {self.outcome}"
        at = f" @{self.iteration}" if short else f" (iteration {self.iteration})"
        return f"rank {self.rank}: {self.outcome}{at}"

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Any, where: str = "") -> RankResult:
        """One rank's result as `to_json` wrote it; `where` prefixes the field names in an
        error ("ranks[1].")."""
        return cls(**_read(cls, cls._READERS, data, where, required=("rank", "outcome")))


def _ranks(name: str, v: Any) -> tuple[RankResult, ...]:
    def one(where: str, x: Any) -> RankResult:
        return x if isinstance(x, RankResult) else RankResult.from_json(x, f"{where}.")

    return _list(name, v, one)


def describe_ranks(ranks: tuple[RankResult, ...], short: bool = False) -> str:
    """What each rank saw, in one line: `rank 0: StaleMemoryError (iteration 6); rank 1: ...`."""
    return "; ".join(r.describe(short) for r in ranks)


_CASE_READERS = {
    "outcome": _text,
    "iteration": _count_or_none,
    "finding": _text,
    "symptom": _text,
    "losses": _numbers,
    "eval_losses": _eval_points,
    "kinds": _texts,
    "report": _text,
    "pinned": _object_or_none,
    "startup": _seconds_by_phase,
    "ranks": _ranks,
    "wall_s": _number,
    "timeline": _numbers,
    "log_tail": _text,
    "comparison": _text,
    "rel_diff": _numbers,
    "rel_diff_before": _number_or_none,
    "rel_diff_after": _number_or_none,
    "compared_from": _count_or_none,
    "reference_outcome": _text,
    "reference_timeline": _numbers_or_none,
    "reference_losses": _numbers_or_none,
    "reference_eval_losses": _eval_points_or_none,
    "matched": _flag_or_none,
    "mismatch": _text,
}


@dataclass(frozen=True)
class CaseResult(_Checked):
    """One case's run. `outcome` is an `Outcome` value or a description of how the process died
    ("timed out after 300 s", "killed by signal 9"), which classifies as `Outcome.OTHER`.
    Sequences are tuples (a list given is turned into one); every field is checked on
    construction, so a wrong type fails here, naming the field, not later in a table."""

    outcome: str = Outcome.TRAINED_THROUGH.value
    iteration: int | None = None  # the iteration it ended in (None: it trained through)
    finding: str = ""  # graphsan's first finding, one line
    symptom: str = ""  # the error's first line
    losses: tuple[float, ...] = ()
    eval_losses: tuple[tuple[int, float], ...] = ()  # (iteration, loss) pairs
    kinds: tuple[str, ...] = ()  # finding kinds, when graphsan found several
    report: str = ""  # graphsan's whole report of a stopped replay
    pinned: dict | None = None  # the pin policy's summary (graphsan's, passed on as it is)
    startup: dict[str, float] = field(default_factory=dict)  # phase -> seconds after start
    # filled in by the parent
    ranks: tuple[RankResult, ...] = ()  # on several ranks: what each one saw
    wall_s: float = 0.0
    timeline: tuple[float, ...] = ()  # seconds after start, per iteration
    log_tail: str = ""
    # filled in by the comparison with the eager reference run
    comparison: str = ""
    rel_diff: tuple[float, ...] = ()
    # the largest relative differences before iteration `compared_from` (the first in which the
    # case can go wrong) and from it on
    rel_diff_before: float | None = None
    rel_diff_after: float | None = None
    compared_from: int | None = None
    reference_outcome: str = ""
    reference_timeline: tuple[float, ...] | None = None
    reference_losses: tuple[float, ...] | None = None
    reference_eval_losses: tuple[tuple[int, float], ...] | None = None
    # the verdict against the case's expectation
    matched: bool | None = None
    mismatch: str = ""

    _READERS: ClassVar[Readers] = _CASE_READERS

    def replace(self, **changes) -> CaseResult:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        """The result as `graphsan repro --json` writes it: every field, in this order."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: Any) -> CaseResult:
        """A result as `to_json` wrote it; fields left out take their defaults and unknown
        keys are ignored. A field of the wrong type raises ResultError naming it. Files written
        before the comparison's split was the case's own read as split after validation."""
        if isinstance(data, Mapping) and _EARLIER_NAMES.keys() & data.keys():
            data = {_EARLIER_NAMES.get(k, k): v for k, v in data.items()}
            if data.get("rel_diff_after") is not None:
                data.setdefault("compared_from", AFTER_EVAL)
        return cls(**_read(cls, cls._READERS, data, ""))


# the comparison's fields as results named them when every case was split at validation
_EARLIER_NAMES = {
    "rel_diff_before_eval": "rel_diff_before",
    "rel_diff_after_eval": "rel_diff_after",
}
