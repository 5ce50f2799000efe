"""What a graph baked at capture beside addresses, and what changed since (pure: it reads the
program's objects through weak references and plain attributes, never calls torch).

A capture freezes more than addresses:
- the **mode** of the modules whose forward it ran: dropout, batch statistics and training-only
  branches run as they did then, whatever `.train()`/`.eval()` says later;
- the **values** an optimizer step took by value: hyperparameters that were Python numbers in
  a param group are kernel arguments now;
- the **tensors** the program's entries held: a module's parameter or buffer, a param group's
  tensor (a tensor `lr`); re-pointing the entry at a new tensor leaves the graph reading the
  old one.

`Baked` holds one graph's dependencies (`cuda.baked` records them while the graph is
captured). Mode switches and re-registered parameters and buffers are seen by hooks, which mark
the graph to be judged; a param group is a plain dict, so its few entries are looked at on every
replay (`changed`). `Baked.findings` says what differs now, as `mode`, `baked-value` and
`superseded` findings.

A program that keeps a graph per mode of a module (a training step and an inference graph of
the same layer) picks the mode by the graph it replays, not by the module's flag: a mode
finding is raised only for a module that no live graph captured in the mode it is in now.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from graphsan.core.kinds import Kind
from graphsan.core.records import BakedEvidence, Finding, Frame, GraphInfo, Reference, When

SHOWN_MODULES = 4  # modules a mode finding names; `now` counts them all
NO_ARGUMENT = Reference(-1, "", "", 0, 0)  # state no kernel argument names (a mode, a value)


@dataclass(frozen=True)
class Change:
    """Where the program changed something a graph baked: the stack (outermost first), phase and
    step of the `.train()`/`.eval()` call or the re-registration."""

    stack: tuple[Frame, ...] = ()
    phase: str | None = None
    step: int | None = None


class BakedWatch(Protocol):
    """What the hooks after the captures (`cuda.baked`) tell the judgement of baked state."""

    def change_of(self, owner: object, name: str | None) -> Change | None:
        """Where the owner's mode (`name` None) or entry last changed, where a hook saw it."""

    def captured_in(self, module: object, training: bool) -> bool:
        """Whether a live graph captured `module` in that mode."""


class Unwatched:
    """No hook saw anything: no change has a place, no module a graph per mode."""

    @staticmethod
    def change_of(owner: object, name: str | None) -> Change | None:
        return None

    @staticmethod
    def captured_in(module: object, training: bool) -> bool:
        return False


@dataclass(frozen=True)
class ModeDep:
    """A module whose forward the capture ran, in `training` mode then, and whose behaviour
    depends on the mode."""

    module: weakref.ref
    name: str
    training: bool


@dataclass(frozen=True)
class ValueDep:
    """A hyperparameter that was a Python number (or a tuple of them) when the capture ran the
    optimizer's step: `optimizer.param_groups[index][key]` was `value`."""

    optimizer: weakref.ref
    index: int
    key: str
    value: object
    entry: str  # as findings name it: Adam.param_groups[0]['lr']

    def now(self) -> object:
        """The entry's value now (`_GONE` where the optimizer or the group is gone)."""
        opt = self.optimizer()
        try:
            return opt.param_groups[self.index].get(self.key, _GONE) if opt is not None else _GONE
        except (AttributeError, IndexError, TypeError):
            return _GONE


@dataclass(frozen=True)
class EntryDep:
    """A tensor the graph reads that was, at capture, the value of an entry of `owner` (a
    module's parameter or buffer, a param group's tensor): `read(owner)` gives the entry now."""

    owner: weakref.ref
    read: Callable[[object], object]
    tensor: weakref.ref
    entry: str  # as findings name it: HybridLM.layers.3.mlp.weight
    name: str  # the entry's name on its owner (the attribute, or the group's key)
    ref: Reference  # the graph's first reference into the tensor
    nbytes: int
    polled: bool  # a param group's: no hook sees it re-pointed, so every replay looks

    def superseded(self) -> tuple[object, object] | None:
        """(the tensor at capture, the entry now) where the entry holds another object while
        the tensor at capture lives on; None otherwise (the same, or gone: then its memory is
        the tracker's to judge)."""
        owner, old = self.owner(), self.tensor()
        if owner is None or old is None:
            return None
        try:
            now = self.read(owner)
        except Exception:  # the entry was deleted, or the group is gone
            now = _GONE
        return None if now is old else (old, now)


_GONE = object()  # an entry that no longer exists


def same_value(a: object, b: object) -> bool:
    """Equal numbers, or tuples of them, of the same types: a tensor now in place of a
    number is a change (and never compared element-wise)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@dataclass
class Baked:
    """One graph's dependencies on state it baked at capture."""

    modes: list[ModeDep] = field(default_factory=list)
    values: list[ValueDep] = field(default_factory=list)
    entries: list[EntryDep] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._polled = [e for e in self.entries if e.polled]
        # whether a replay must look (`changed`): hooks tell every other change
        self.polls = bool(self.values or self._polled)

    def __bool__(self) -> bool:
        return bool(self.modes or self.values or self.entries)

    def changed(self) -> bool:
        """The look of every replay: a baked value or a param group's tensor that differs now.
        (Mode switches and re-registered parameters and buffers are told by hooks.) Never
        raises: what cannot be read is judged (the verdict says what it finds)."""
        try:
            for v in self.values:
                if not same_value(v.now(), v.value):
                    return True
            return any(e.superseded() is not None for e in self._polled)
        except Exception:
            return True

    def findings(self, info: GraphInfo, when: When, watch: BakedWatch) -> list[Finding]:
        """What differs now, as findings; `watch` says where an owner's mode or entry changed
        and which modules live graphs captured in which modes."""
        change_of = watch.change_of
        out = self._mode_findings(info, when, watch)
        for v in self.values:
            now = v.now()
            if now is _GONE or same_value(now, v.value):
                continue
            out.append(
                _finding(
                    Kind.BAKED_VALUE,
                    info,
                    NO_ARGUMENT,
                    when,
                    None,
                    BakedEvidence(entry=v.entry, captured=repr(v.value), current=repr(now)),
                    now=f"{v.entry} is {now!r}; the graph's optimizer step took {v.value!r} "
                    "by value at capture and keeps using it",
                )
            )
        for e in self.entries:
            hit = e.superseded()
            if hit is None:
                continue
            old, now = hit
            out.append(
                _finding(
                    Kind.SUPERSEDED,
                    info,
                    e.ref,
                    when,
                    change_of(e.owner(), e.name),
                    BakedEvidence(entry=e.entry, captured=_describe(old), current=_describe(now)),
                    block=(e.ref.address, e.nbytes),
                    now=f"{e.entry} holds {_describe(now)}; the graph reads {_describe(old)}, "
                    "which lives on elsewhere",
                )
            )
        return out

    def _mode_findings(self, info, when, watch: BakedWatch) -> list[Finding]:
        switched = []
        for d in self.modes:
            m = d.module()
            if m is None:
                continue
            training = bool(getattr(m, "training", d.training))
            if training != d.training and not watch.captured_in(m, training):
                switched.append(d)
        if not switched:
            return []
        first = switched[0]
        was, now = _mode(first.training), _mode(not first.training)
        names = [d.name for d in switched]
        shown = ", ".join(names[:SHOWN_MODULES])
        more = f" and {len(names) - SHOWN_MODULES} more" if len(names) > SHOWN_MODULES else ""
        return [
            _finding(
                Kind.MODE,
                info,
                NO_ARGUMENT,
                when,
                watch.change_of(first.module(), None),
                BakedEvidence(captured=was, current=now, modules=tuple(names[:SHOWN_MODULES])),
                now=f"{len(names)} module(s) captured in {was} mode are in {now} mode now "
                f"({shown}{more}); their behaviour differs by mode",
            )
        ]


def _mode(training: bool) -> str:
    return "train" if training else "eval"


def _describe(obj: object) -> str:
    """A tensor as a finding names it: its type, shape and address (no torch needed)."""
    if obj is _GONE:
        return "nothing (the entry is gone)"
    ptr = getattr(obj, "data_ptr", None)
    shape = getattr(obj, "shape", None)
    if callable(ptr) and shape is not None:
        try:
            return f"a {type(obj).__name__} of shape {tuple(shape)} at {ptr():#x}"
        except Exception:
            pass
    return f"a {type(obj).__name__}"


def _finding(
    kind: Kind,
    info: GraphInfo,
    ref: Reference,
    when: When,
    change: Change | None,
    evidence: BakedEvidence,
    block: tuple[int, int] = (0, 0),
    now: str = "",
) -> Finding:
    """A finding about baked state: where it changed (where a hook saw it) is the evidence's
    `changed_at`, with the change's phase and step; otherwise the judgement's phase and step."""
    if change is not None:
        evidence = dataclasses.replace(evidence, changed_at=change.stack)
        when = When(change.phase, change.step, when.judged)
    return Finding.at(kind, info, ref, when, evidence, block=block, now=now)
