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

A finding is suppressed by the first entry, in the file's order, that matches it. Entries are
matched through an index (`Matcher`), so a long file costs little per finding: each entry is
filed under one literal part of one of its patterns (the whole pattern where it has no wildcard,
else the text before its first wildcard or after its last), and a finding is checked only
against the entries filed under a part its own fields hold. The index only narrows which
entries are checked; which entry matches is decided as the plain loop over the entries decides.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from graphsan.core.kinds import KINDS
from graphsan.core.records import Finding, frame_text
from graphsan.report.text import where_stack

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
        for pattern, stack in ((self.alloc, f.alloc_stack), (self.free, where_stack(f))):
            if pattern is not None and not any(
                fnmatch.fnmatchcase(frame_text(fr), pattern) for fr in stack
            ):
                return False
        if self.entry is not None:
            return any(fnmatch.fnmatchcase(n, self.entry) for n in entry_names(f))
        return True


def entry_names(f: Finding) -> tuple[str, ...]:
    """What an entry's `entry` pattern is matched against: the modules a mode finding names,
    else the finding's entry (none for a finding about memory)."""
    b = f.baked
    if b is None:
        return ()
    return b.modules if b.modules else (b.entry,) if b.entry else ()


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
    """The first entry that matches `f`, tried one after the other (`Matcher.first` answers
    the same through its index)."""
    return next((s for s in entries if s.matches(f)), None)


def split(
    entries: list[Suppression], findings: list[Finding]
) -> tuple[list[Finding], list[tuple[str, Finding]]]:
    """(kept, suppressed as (entry name, finding)): each finding suppressed by the first entry
    that matches it. The entries' index is kept for the next call with the same entries (a
    sanitizer splits the findings of every judged replay)."""
    kept: list[Finding] = []
    suppressed: list[tuple[str, Finding]] = []
    if not entries:
        return list(findings), suppressed
    matcher = _matcher(entries)
    texts = matcher.frame_texts()  # this call's: frames read as the source root says now
    for f in findings:
        s = matcher.first(f, texts)
        if s is None:
            kept.append(f)
        else:
            suppressed.append((s.name, f))
    return kept, suppressed


_LAST: list[Matcher] = []  # the index of the last entries split by (one)


def _matcher(entries: list[Suppression]) -> Matcher:
    key = tuple(entries)
    if not _LAST or _LAST[0].entries != key:  # a tuple compares its items by identity first
        _LAST[:] = [Matcher(key)]
    return _LAST[0]


# ----------------------------------------------------------------------------- the index
# the fields an entry may give, and what of a finding each is matched against (any of them)
_FIELDS: dict[str, Callable[[Finding, Callable], Iterable[str]]] = {
    "kind": lambda f, text: (str(f.kind),),
    "kernel": lambda f, text: (f.kernel,),
    "graph": lambda f, text: (f.graph.label,),
    "alloc": lambda f, text: map(text, f.alloc_stack),
    "free": lambda f, text: map(text, where_stack(f)),
    "entry": lambda f, text: entry_names(f),
}
_WILD = re.compile(r"[*?\[]")  # where a wildcard or a character class may begin


def literal_parts(pattern: str) -> tuple[str | None, str, str]:
    """(the pattern itself where it has no wildcard, else None; the text before its first
    wildcard; the text after its last wildcard or character class), as fnmatch reads it:
    every string the pattern matches equals the first, or starts with the second and ends with
    the third. A `[` or `]` counts as a wildcard here even where fnmatch takes it literally,
    which only makes the parts shorter."""
    first = _WILD.search(pattern)
    if first is None:
        return pattern, pattern, pattern
    last = max(map(pattern.rfind, "*?[]"))
    return None, pattern[: first.start()], pattern[last + 1 :]


class Matcher:
    """Entries indexed for `first`: the answer is `first_match`'s, found by checking only the
    entries filed under a literal part that the finding's fields hold (`literal_parts`), plus
    those with no literal part at all."""

    def __init__(self, entries: Iterable[Suppression]) -> None:
        self.entries = tuple(entries)
        # field -> how ("exact", "prefix", "suffix") -> literal -> positions of entries
        self._index: dict[str, dict[str, dict[str, list[int]]]] = {}
        self._lengths: dict[tuple[str, str], list[int]] = {}  # the literals' lengths probed
        self._always: list[int] = []  # entries with no literal part: checked for every finding
        parts: dict[str, tuple[str | None, str, str]] = {}  # patterns repeat: kinds, kernels
        keys = [self._keys(s, parts) for s in self.entries]
        shared = Counter(k for ks in keys for k in set(ks))
        for position, ks in enumerate(keys):
            if not ks:
                self._always.append(position)
                continue
            # the key fewest entries share (then the longest, then the first): few candidates
            field, how, text = min(
                ks, key=lambda k: (len(k[2]) < 4, shared[k], -len(k[2]), ks.index(k))
            )
            self._index.setdefault(field, {}).setdefault(how, {}).setdefault(text, [])
            self._index[field][how][text].append(position)
        for field, hows in self._index.items():
            for how, by_text in hows.items():
                if how != "exact":
                    self._lengths[field, how] = sorted({len(t) for t in by_text})
        self._tests: dict[str, Callable[[str], bool]] = {}

    @staticmethod
    def _keys(s: Suppression, parts: dict) -> list[tuple[str, str, str]]:
        """Every (field, how, literal) one of the entry's patterns requires of what it matches;
        `parts`: the literal parts of the patterns seen so far."""
        out = []
        for field in _FIELDS:
            pattern = getattr(s, field)
            if pattern is None:
                continue
            got = parts.get(pattern)
            if got is None:
                got = parts[pattern] = literal_parts(pattern)
            exact, prefix, suffix = got
            if exact is not None:
                out.append((field, "exact", exact))
                continue
            if prefix:
                out.append((field, "prefix", prefix))
            if suffix:
                out.append((field, "suffix", suffix))
        return out

    def frame_texts(self) -> Callable[[tuple], str]:
        """A frame's text as reports print it, each frame's made once (for one call: the
        source root may change between calls)."""
        cache: dict[tuple, str] = {}

        def text(frame) -> str:
            key = tuple(frame)
            got = cache.get(key)
            if got is None:
                got = cache[key] = frame_text(key)
            return got

        return text

    def candidates(self, f: Finding, text: Callable[[tuple], str]) -> list[int]:
        """The positions of the entries that may match `f`, in order; every entry that
        matches it is among them."""
        found: set[int] = set(self._always)
        for field, hows in self._index.items():
            exact, prefix, suffix = hows.get("exact"), hows.get("prefix"), hows.get("suffix")
            plen = self._lengths.get((field, "prefix"), ())
            slen = self._lengths.get((field, "suffix"), ())
            for value in _FIELDS[field](f, text):
                if exact is not None and value in exact:
                    found.update(exact[value])
                for n in plen:
                    if n > len(value):
                        break
                    hit = prefix.get(value[:n])
                    if hit is not None:
                        found.update(hit)
                for n in slen:
                    if n > len(value):
                        break
                    hit = suffix.get(value[-n:])
                    if hit is not None:
                        found.update(hit)
        return sorted(found)

    def first(self, f: Finding, text: Callable[[tuple], str] | None = None) -> Suppression | None:
        """The first entry that matches `f` (`first_match`'s answer)."""
        text = text or self.frame_texts()
        for position in self.candidates(f, text):
            s = self.entries[position]
            if self._matches(s, f, text):
                return s
        return None

    def _matches(self, s: Suppression, f: Finding, text: Callable[[tuple], str]) -> bool:
        """`s.matches(f)`, with frame texts made once and each pattern compiled once."""
        for field, values in _FIELDS.items():
            pattern = getattr(s, field)
            if pattern is not None and not any(map(self._test(pattern), values(f, text))):
                return False
        return True

    def _test(self, pattern: str) -> Callable[[str], bool]:
        """Whether a string matches `pattern` (fnmatch.fnmatchcase), made once per pattern
        however many strings it meets."""
        test = self._tests.get(pattern)
        if test is None:
            test = self._tests[pattern] = pattern_test(pattern)
        return test


def pattern_test(pattern: str) -> Callable[[str], bool]:
    """fnmatch.fnmatchcase(value, pattern) as a function of the value. A pattern whose only
    wildcard is `*` (the file's usual `*frame` and `prefix*`) is matched by string methods:
    compiling tens of thousands of patterns into regular expressions would cost more than
    matching them all."""
    if "?" in pattern or "[" in pattern:
        match = re.compile(fnmatch.translate(pattern)).match
        return lambda value: match(value) is not None
    if "*" not in pattern:
        return lambda value: value == pattern
    head, *middle, tail = pattern.split("*")
    least = len(head) + len(tail)

    def test(value: str) -> bool:
        if len(value) < least or not value.startswith(head) or not value.endswith(tail):
            return False
        at, end = len(head), len(value) - len(tail)
        for part in middle:  # each part at its first place after the one before
            found = value.find(part, at, end)
            if found < 0:
                return False
            at = found + len(part)
        return True

    return test


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
        stack = where_stack(f)
        free = f"*{_literal(frame_text(stack[-1]))}" if stack else None
        b = f.baked
        named = b and (b.entry or (b.modules[0] if b.modules else None))
        kernel, label = f.kernel or None, f.graph.label
        entry = (str(f.kind), *(_literal(v) for v in (kernel, label)), alloc, free, _literal(named))
        if entry in seen:
            continue
        seen.add(entry)
        where = f": {named}" if b is not None else f" node {f.node}"
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
