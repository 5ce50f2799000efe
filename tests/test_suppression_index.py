"""CPU: suppressions matched through an index (`graphsan.report.suppressions.Matcher`). Which
entry suppresses a finding stays the plain loop's answer (the first entry in the file that
matches); the index only leaves out entries that cannot match, so a long file checks few entries
per finding."""

from __future__ import annotations

import dataclasses
import fnmatch

from hypothesis import given, settings
from hypothesis import strategies as st

from graphsan.core import locations
from graphsan.core.kinds import KINDS
from graphsan.core.records import BakedEvidence
from graphsan.report import suppressions
from graphsan.report.suppressions import (
    Matcher,
    Suppression,
    first_match,
    literal_parts,
    pattern_test,
)
from tests.test_plugin_and_ranks import finding

# small alphabets, so that random patterns and random findings often meet
PIECES = ["a", "b", "ab", "ba", ":", ".py", "[", "]", "*", "?", "[ab]", "[!a]", "[]a]", "**"]
texts = st.lists(st.sampled_from(["a", "b", "ab", ":", ".py", "[", "]", "*", "?"]), max_size=5)
patterns = st.lists(st.sampled_from(PIECES), min_size=1, max_size=5).map("".join)
frames = st.tuples(texts.map("".join), st.integers(1, 3), texts.map("".join))


@st.composite
def entries(draw) -> list[Suppression]:
    out = []
    for i in range(draw(st.integers(0, 12))):
        fields = draw(st.sets(st.sampled_from(suppressions.FIELDS[1:]), min_size=1))
        values = {
            k: draw(st.sampled_from(KINDS) | patterns) if k == "kind" else draw(patterns)
            for k in fields
        }
        out.append(Suppression(f"entry {i}", **values))
    return out


@st.composite
def findings(draw):
    f = finding(kind=draw(st.sampled_from(KINDS)))
    # where the memory was freed, or (baked state) where it changed: `free` matches either
    where = tuple(draw(st.lists(frames, max_size=3)))
    baked = None
    if f.baked is not None:
        baked = BakedEvidence(
            entry=draw(st.none() | texts.map("".join)),
            modules=tuple(draw(st.lists(texts.map("".join), max_size=2))),
            changed_at=where,
        )
    return dataclasses.replace(
        f,
        graph=dataclasses.replace(f.graph, label="".join(draw(texts))),
        kernel="".join(draw(texts)),
        alloc_stack=tuple(draw(st.lists(frames, max_size=3))),
        free_stack=() if baked is not None else where,
        baked=baked,
    )


@settings(max_examples=150, deadline=None)
@given(entries(), st.lists(findings(), min_size=1, max_size=6))
def test_the_index_finds_the_entry_the_plain_loop_finds(given_entries, given_findings):
    matcher = Matcher(given_entries)
    for f in given_findings:
        assert matcher.first(f) is first_match(given_entries, f)
    kept, suppressed = suppressions.split(given_entries, given_findings)
    naive = [(first_match(given_entries, f), f) for f in given_findings]
    assert kept == [f for s, f in naive if s is None]
    assert suppressed == [(s.name, f) for s, f in naive if s is not None]


@settings(max_examples=500, deadline=None)
@given(patterns, texts.map("".join))
def test_a_pattern_matches_as_fnmatch_says_and_needs_its_literal_parts(pattern, text):
    assert pattern_test(pattern)(text) == fnmatch.fnmatchcase(text, pattern)
    exact, prefix, suffix = literal_parts(pattern)
    if fnmatch.fnmatchcase(text, pattern):
        assert text.startswith(prefix) and text.endswith(suffix)
        assert exact is None or text == exact


def generated(n: int) -> tuple[list[Suppression], list]:
    """`--gen-suppressions` entries for `n` findings freed at `n` places of one graph, and the
    findings."""
    fs = [
        dataclasses.replace(
            finding(kind=KINDS[i % 4], node=i % 24),
            kernel=f"void op{i % 24}<float>(float const*, float*)",
            free_stack=(("train.py", 200, "evaluate"), ("model.py", 1000 + i, "drop")),
        )
        for i in range(n)
    ]
    import yaml

    listed = yaml.safe_load(suppressions.generate(fs))
    return [Suppression(**e) for e in listed], fs


def test_a_long_file_checks_a_finding_against_the_entries_that_may_match_only():
    entries, fs = generated(1000)
    assert len(entries) == 1000
    matcher = Matcher(entries)
    text = matcher.frame_texts()
    for i in (0, 567, 999):
        assert [entries[p] for p in matcher.candidates(fs[i], text)] == [entries[i]]
        assert matcher.first(fs[i]) is entries[i]
    stranger = dataclasses.replace(fs[0], free_stack=(("other.py", 1, "f"),))
    assert matcher.candidates(stranger, text) == []


def test_a_changed_list_of_entries_is_indexed_again():
    entries, fs = generated(20)
    late = fs[0]
    kept, suppressed = suppressions.split(entries[1:], [late])
    assert kept == [late] and suppressed == []
    later = entries[1:]
    later.append(Suppression("added", free="*model.py:1000 in drop"))
    assert suppressions.split(later, [late]) == ([], [("added", late)])
    later.pop()  # the same list object, changed in place
    assert suppressions.split(later, [late]) == ([late], [])


def test_frames_are_read_as_the_source_root_says_at_each_call(tmp_path):
    root = tmp_path / "project"
    (root / "pkg").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    f = dataclasses.replace(finding(), free_stack=((str(root / "pkg" / "mod.py"), 5, "g"),))
    entries = [Suppression("by its place in the project", free="pkg/mod.py:5 in g")]
    before = locations.source_root()
    try:
        locations.set_source_root(str(root))
        assert suppressions.split(entries, [f]) == ([], [("by its place in the project", f)])
        locations.set_source_root(str(tmp_path))
        assert suppressions.split(entries, [f]) == ([f], [])
    finally:
        locations.set_source_root(before)
