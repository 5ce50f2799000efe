"""Suppressions, as valgrind, ASan and compute-sanitizer users know them: a YAML file of entries,
each naming what a finding must match to be suppressed (glob patterns, every given field must
match). A suppressed finding never stops a replay and is not listed among the findings, but it
is counted, per entry, in every summary: nothing is hidden silently.

    # graphsan suppressions
    - name: te-3316 workspace, fixed in TE 2.21      # shown in the summaries
      kind: freed                                     # freed, reowned, moved, unmapped, ...
      kernel: "*dequant_mxfp8*"                      # the demangled kernel name
      graph: "layers.*:layer bwd*"                   # the graph's label
      alloc: "*quant/linear.py:* in _alloc*"         # any frame of the allocation stack
      free: "* in clear_workspace"                    # any frame of the free stack
    - name: dropout left in eval on purpose
      kind: mode                                      # mode, baked-value, superseded
      entry: "HybridLM.layers.*.drop"                # the entry, or any module a mode names

`free` matches, for the kinds about state a graph baked, where the program changed it.

Frames are matched as reports print them: `file:line in function`, the file by its location
(`graphsan.core.locations`: its path within its package or from its project's root), so one
file matches from any folder and on any machine. `graphsan report --gen-suppressions` prints an
entry for each finding of a report, ready to edit.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from graphsan.core.kinds import KINDS
from graphsan.core.records import Finding, frame_text

FIELDS = ("name", "kind", "kernel", "graph", "alloc", "free", "entry")


@dataclass(frozen=True)
class Suppression:
    """One entry; None: the field is not part of the match."""

    name: str
    kind: str | None = None
    kernel: str | None = None
    graph: str | None = None
    alloc: str | None = None
    free: str | None = None
    entry: str | None = None

    def matches(self, f: Finding) -> bool:
        if self.kind is not None and not fnmatch.fnmatchcase(str(f.kind), self.kind):
            return False
        if self.kernel is not None and not fnmatch.fnmatchcase(f.kernel, self.kernel):
            return False
        if self.graph is not None and not fnmatch.fnmatchcase(f.graph.label, self.graph):
            return False
        for pattern, stack in ((self.alloc, f.alloc_stack), (self.free, f.free_stack)):
            if pattern is not None and not any(
                fnmatch.fnmatchcase(frame_text(fr), pattern) for fr in stack
            ):
                return False
        if self.entry is not None:
            names = f.modules if f.modules else (f.entry,) if f.entry else ()
            return any(fnmatch.fnmatchcase(n, self.entry) for n in names)
        return True


def load(path: str) -> list[Suppression]:
    """The entries of a suppression file; ValueError with one line naming the file, the entry
    and what was expected."""
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except OSError as err:
        raise ValueError(f"{path}: cannot read the suppressions ({err.strerror})") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ValueError(f"{path}: not YAML{line}; expected a list of suppressions") from None
    if data is None:
        return []
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of suppressions (- name: ...), not a mapping")
    out = []
    for i, entry in enumerate(data, 1):
        where = f"{path}: entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is {entry!r:.40}; expected a mapping of {', '.join(FIELDS)}")
        unknown = [k for k in entry if k not in FIELDS]
        if unknown:
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r}; expected some of {', '.join(FIELDS)}"
            )
        for key, value in entry.items():
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{where}: {key} is {value!r:.40}; expected a non-empty string")
        if set(entry) <= {"name"}:
            raise ValueError(
                f"{where}: matches every finding; expected at least one of {', '.join(FIELDS[1:])}"
            )
        kind = entry.get("kind")
        if kind is not None and not any(fnmatch.fnmatchcase(k, kind) for k in KINDS):
            raise ValueError(
                f"{where}: kind {kind!r} matches no kind; expected one of {', '.join(KINDS)}"
            )
        out.append(
            Suppression(entry.get("name") or f"entry {i}", *(entry.get(k) for k in FIELDS[1:]))
        )
    return out


def first_match(entries: list[Suppression], f: Finding) -> Suppression | None:
    return next((s for s in entries if s.matches(f)), None)


def split(
    entries: list[Suppression], findings: list[Finding]
) -> tuple[list[Finding], list[tuple[str, Finding]]]:
    """(kept, suppressed as (entry name, finding))."""
    kept, suppressed = [], []
    for f in findings:
        s = first_match(entries, f) if entries else None
        if s is None:
            kept.append(f)
        else:
            suppressed.append((s.name, f))
    return kept, suppressed


def counts(suppressed: list[tuple[str, object]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, _ in suppressed:
        out[name] = out.get(name, 0) + 1
    return out


def summary(suppressed: list[tuple[str, object]]) -> str:
    """'suppressed: 3 finding(s) (te-3316: 2, cublas: 1)', or '' when none was."""
    if not suppressed:
        return ""
    by = ", ".join(f"{name}: {n}" for name, n in counts(suppressed).items())
    return f"suppressed: {len(suppressed)} finding(s) ({by})"


def generate(findings: list[Finding]) -> str:
    """A suppression entry for each finding (the same entry once), as YAML text to edit."""
    seen, lines = set(), ["# graphsan suppressions (graphsan report --gen-suppressions)"]
    for f in findings:
        alloc = f"*{_literal(frame_text(f.alloc_stack[-1]))}" if f.alloc_stack else None
        free = f"*{_literal(frame_text(f.free_stack[-1]))}" if f.free_stack else None
        named = f.entry or (f.modules[0] if f.modules else None)
        kernel, label = f.kernel or None, f.graph.label
        entry = (str(f.kind), *(_literal(v) for v in (kernel, label)), alloc, free, _literal(named))
        if entry in seen:
            continue
        seen.add(entry)
        where = f": {named}" if f.kind.baked else f" node {f.node}"
        lines.append(f"- name: {_quote(f'{f.kind} in {f.graph.label}{where}')}")
        for key, value in zip(FIELDS[1:], entry, strict=True):
            if value is not None:
                lines.append(f"  {key}: {_quote(value)}")
    return "\n".join(lines) + "\n"


def _literal(text: str | None) -> str | None:
    """`text` as a pattern that matches itself: a `[` would open a character class
    (`param_groups[0]`, kernels' array types); `*` and `?` may stay, matching themselves too."""
    return text.replace("[", "[[]") if text is not None else None


def _quote(text: str) -> str:
    """A YAML double-quoted scalar (escapes backslashes and quotes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
