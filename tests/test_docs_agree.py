"""CPU: the docs agree with the commands and the project file. docs/coverage.md counts the
selftest corpus `graphsan selftest --list` shows, and every program is either in its measured
figures or in a row that says it is not measured; docs/architecture.md names every dependency
pyproject.toml declares; the README's scenario matrix gives each case the end `graphsan repro
--list` expects and the iteration it can go wrong from; the README's exit table says what
`graphsan train`'s statuses cover."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from graphsan import selftest
from graphsan.cli.main import main
from graphsan.lab.repro.cases import BY_NUMBER, TRAINS_THROUGH

ROOT = Path(__file__).resolve().parent.parent


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of each Markdown table row whose first cell matches `first_cell` (a regex)."""
    out = []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if re.fullmatch(first_cell, cells[0]):
                out.append(cells)
    return out


def test_coverage_counts_the_selftest_corpus_and_every_program_is_measured_or_says_not():
    text = (ROOT / "docs" / "coverage.md").read_text()
    corpus = selftest.programs()
    ((_, count, *_),) = table_rows(text, "programs in the corpus")
    assert re.match(rf"{len(corpus)} correct programs, each with its broken twin", count), count
    measured = {}
    for figure in ("correct programs without a finding", "broken twins stopped on the memory.*"):
        ((_, value, *_),) = table_rows(text, figure)
        m = re.match(r"(\d+) of (\d+)", value)
        assert m and m[1] == m[2], value
        measured[figure] = int(m[1])
    assert len(set(measured.values())) == 1, measured
    unmeasured = set()
    for cells in table_rows(text, r".*programs.*"):
        if "not measured" in cells[1]:
            (pattern,) = re.findall(r"`graphsan selftest -k (\S+)`", cells[-1])
            unmeasured |= {name for name in corpus if pattern in name}
    assert measured.popitem()[1] + len(unmeasured) == len(corpus)


def test_the_architecture_names_every_dependency_of_the_project():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    names = {re.match(r"[A-Za-z0-9_.-]+", d)[0].lower() for d in declared}
    text = (ROOT / "docs" / "architecture.md").read_text()
    (bullet,) = re.findall(r"^- Python >= .*?(?=^- )", text, re.MULTILINE | re.DOTALL)
    named = set(re.findall(r"[a-z0-9][a-z0-9_.-]*", bullet.lower()))
    assert sorted(names - named) == []


def test_the_readme_matrix_gives_each_case_the_end_repro_expects():
    text = (ROOT / "README.md").read_text()
    rows = table_rows(text.split("## The scenario matrix")[1], r"\d+")
    assert sorted(int(r[0]) for r in rows) == sorted(BY_NUMBER)
    for n, _, end, iteration in rows:
        case = BY_NUMBER[int(n)]
        expected = " or ".join(case.expected_values())
        assert re.match(rf"{re.escape(expected)}($|[:, ])", end), (n, end, expected)
        if case.expected == TRAINS_THROUGH:
            assert iteration == "-", (n, iteration)
        else:
            assert iteration == str(case.fails_from), (n, iteration, case.fails_from)


def train_row() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    header = next(r for r in table_rows(text, "command"))
    (row,) = table_rows(text, "`graphsan train`")
    return dict(zip(header, row, strict=True))


def test_the_readme_exit_table_says_a_dry_run_exits_0():
    """(tests/lab/test_train.py runs one: its status is 0)"""
    assert "`--dry-run`" in train_row()["0"]


def test_the_readme_exit_table_says_a_bad_variable_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("GRAPHSAN_ATTACH", "sideways")
    assert main(["train", "--device", "cpu"]) == 2
    assert "GRAPHSAN_ATTACH" in capsys.readouterr().err
    assert "`GRAPHSAN_*` variable" in train_row()["2"]


def test_the_readme_exit_table_says_1_is_also_an_unexpected_error():
    """Python ends an uncaught error (a traceback) with 1, which is not a diverged run."""
    assert "an unexpected error (a traceback)" in train_row()["1"]
