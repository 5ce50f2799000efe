"""CPU: the docs say what holds, not how it came to be. README.md and docs/*.md carry no commit
hash, no run date and no "so far" / "still to come" / "not yet run": history lives in git.

The record of measured figures is exempt: the rows of docs/PERF.md's tables and of
docs/coverage.md's tables, each with its date, GPU, torch and command. So is output quoted from
a sample (the blocks between `<!-- sample: NAME -->` markers, which scripts/make_samples.py
rewrites); its addresses are 0x-prefixed and never read as hashes anyway."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import scripts

ROOT = Path(__file__).resolve().parent.parent
# docs whose table rows are the project's record of figures, with their dates
RECORDS = {"docs/PERF.md", "docs/coverage.md"}
# a hex word with a digit and a letter a-f, not after 0x, not inside a longer name or number
COMMIT = re.compile(r"(?<![\w-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
DATE = re.compile(r"(?<!\d)20\d\d-\d\d-\d\d(?!\d)")
PHRASES = re.compile(r"\b(so far|still to come|not yet run)\b", re.IGNORECASE)


make_samples = scripts.load("make_samples")


def history(doc: str, text: str) -> list[str]:
    """Each hash, run date or changelog phrase in the prose of `doc` (a path relative to the
    checkout), as 'line N: what'."""
    out = []
    prose = make_samples.outside_blocks(text)
    for n, line in enumerate(prose.splitlines(), 1):
        if doc in RECORDS and line.lstrip().startswith("|"):
            continue
        for pattern, what in ((COMMIT, "commit hash"), (DATE, "date"), (PHRASES, "phrase")):
            out += [f"line {n}: {what} {m[0]!r}" for m in pattern.finditer(line)]
    return out


@pytest.mark.parametrize(
    ("doc", "text", "found"),
    [
        ("README.md", "In the b4cc33f build it faulted.", ["line 1: commit hash 'b4cc33f'"]),
        (
            "README.md",
            "x\n(commit 126beb4, 42301f8)",
            ["line 2: commit hash '126beb4'", "line 2: commit hash '42301f8'"],
        ),
        ("README.md", "`--against 5629b66`", ["line 1: commit hash '5629b66'"]),
        ("README.md", "Recorded on the H200 on 2026-11-30.", ["line 1: date '2026-11-30'"]),
        ("docs/te-3316.md", "no pair of GPUs so far", ["line 1: phrase 'so far'"]),
        ("README.md", "the two-GPU run is Still to come", ["line 1: phrase 'Still to come'"]),
        ("README.md", "expected there, not yet run", ["line 1: phrase 'not yet run'"]),
        # addresses, numbers, words and names that only look like hashes
        ("README.md", "block 0x7fb464800000 of 4194304 bytes", []),
        ("README.md", "alpha = amax / 7225344; the cafe; e4m3, 2.11.0+cu130, 1.5e-03", []),
        ("README.md", "the kernel dequant_abc1234 and the key abc1234_x, sha-1a2b3c4d", []),
        ("README.md", "a 64-digit digest " + "ab12" * 16, []),
        # the record of figures keeps its dates and the revisions it compared against
        ("docs/PERF.md", "| 24 s | 2026-12-05 | H100 | `--against 5629b66` |", []),
        ("docs/coverage.md", "| 43 of 43 | 2026-12-05 | H100 |", []),
        ("docs/PERF.md", "2026-12-05, one H100, torch 2.11.0", ["line 1: date '2026-12-05'"]),
        ("docs/te-3316.md", "| 1 | 2026-12-05 |", ["line 1: date '2026-12-05'"]),
        # quoted output is rewritten by scripts/make_samples.py, not by hand
        ("README.md", "<!-- sample: x -->\n```text\nat 126beb4\n```\n<!-- /sample -->\n", []),
    ],
)
def test_the_check_finds_history_in_prose_and_only_there(doc, text, found):
    assert history(doc, text) == found


DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_state_what_holds(doc):
    assert history(doc, (ROOT / doc).read_text()) == []
