"""CPU: what the project shows people cites code that still holds what it names. A stack frame
`path:line in func` in a shipped sample report, in the README or in docs/ must point into a def
or class named `func` in the file as it is now (a module-level frame, `<module>`, into a file
that exists); a bare `path:line` into a file of that many lines. Paths are matched to the
checkout however they were printed: `src/graphsan/...`, an installed `.../graphsan/...`, an
absolute path of another machine's checkout, `examples/...`.

Prose is held to this outright. Recorded output (the samples, and the blocks the docs quote from
them between `<!-- sample: NAME -->` markers) is re-recorded on a GPU by scripts/make_samples.py;
until then a stale one is an expected failure, strict, so that re-recording it turns the mark
into a failure to remove."""

from __future__ import annotations

import ast
import functools
import gzip
import json
import re
from pathlib import Path

import pytest

from graphsan.report.json_report import SAMPLES, sample_path
from tests import scripts

ROOT = Path(__file__).resolve().parent.parent
TOP_FOLDERS = ("examples", "tests", "bench", "scripts")
CITE = re.compile(r"(?P<path>[\w./-]*\w\.py):(?P<line>\d+)(?: in (?P<func><\w+>|\w+))?")


make_samples = scripts.load("make_samples")


# ----------------------------------------------------------------------------- the check
def project_file(path: str, root: Path = ROOT) -> str | None:
    """The file a printed path names inside the checkout at `root`, relative to it; None for a
    file outside the project (torch, the standard library)."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".", "..")]
    package = [
        i
        for i, p in enumerate(parts[:-1])
        if p == "graphsan"
        and ((i and parts[i - 1] == "src") or (root / "src" / "graphsan" / parts[i + 1]).exists())
    ]
    if package:  # a checkout's src/graphsan, or an installed copy's graphsan
        return "/".join(["src", "graphsan", *parts[package[-1] + 1 :]])
    top = [i for i, p in enumerate(parts[:-1]) if p in TOP_FOLDERS and (root / p).is_dir()]
    if top and (top[-1] == 0 or path.startswith("/")):
        return "/".join(parts[top[-1] :])
    if path.startswith("...") and "/" not in path:  # an elided path: the file of that name
        named = _project_files(root).get(path.lstrip("."), [])
        return named[0] if named else f"src/graphsan/.../{path.lstrip('.')}"
    return None


@functools.cache
def _project_files(root: Path) -> dict[str, list[str]]:
    """The project's Python files by name (relative paths)."""
    out: dict[str, list[str]] = {}
    for folder in ("src", *TOP_FOLDERS):
        for p in sorted((root / folder).rglob("*.py")):
            out.setdefault(p.name, []).append(str(p.relative_to(root)))
    return out


@functools.cache
def _spans(path: Path) -> tuple[int, dict[str, list[tuple[int, int]]]]:
    """A file's line count, and the lines of each def and class by name (decorators included)."""
    text = path.read_text()
    spans: dict[str, list[tuple[int, int]]] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans.setdefault(node.name, []).append((first, node.end_lineno))
    return len(text.splitlines()), spans


def problem(file: str, line: int, func: str | None, root: Path = ROOT) -> str | None:
    """What is wrong with the citation `file:line in func` (None when it holds, or names a
    file outside the project)."""
    rel = project_file(file, root)
    if rel is None:
        return None
    where = f"{file}:{line}" + (f" in {func}" if func else "")
    path = root / rel
    if not path.is_file():
        return f"{where}: {rel} does not exist"
    count, spans = _spans(path)
    if not 1 <= line <= count:
        return f"{where}: {rel} has {count} lines"
    if func is None or func.startswith("<"):
        return None
    if any(a <= line <= b for a, b in spans.get(func, ())):
        return None
    at = ", ".join(f"{a}-{b}" for a, b in spans.get(func, ())) or "nowhere"
    return f"{where}: line {line} of {rel} is not inside {func} (which is at lines {at})"


def text_problems(text: str, first_line: int = 1) -> list[str]:
    out = []
    for n, line in enumerate(text.splitlines(), first_line):
        for m in CITE.finditer(line):
            found = problem(m["path"], int(m["line"]), m["func"])
            if found:
                out.append(f"line {n}: {found}")
    return out


def frames(data) -> list[tuple[str, int, str]]:
    """Every stack frame ([file, line, function]) anywhere in a report's JSON."""
    if isinstance(data, dict):
        return [f for v in data.values() for f in frames(v)]
    if isinstance(data, list):
        shape = [type(x) for x in data] == [str, int, str]
        return [tuple(data)] if shape else [f for v in data for f in frames(v)]
    return []


# ----------------------------------------------------------------------------- the checker
def _tree(tmp_path) -> Path:
    (tmp_path / "src" / "graphsan" / "lab").mkdir(parents=True)
    (tmp_path / "src" / "graphsan" / "lab" / "step.py").write_text(
        "import functools\n\n\n@functools.cache\ndef train(x):\n    return x\n\n\n"
        "class Model:\n    def forward(self):\n        return 1\n"
    )
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "demo.py").write_text("x = 1\ny = 2\n")
    return tmp_path


@pytest.mark.parametrize(
    ("file", "line", "func", "wrong"),
    [
        ("src/graphsan/lab/step.py", 6, "train", None),
        ("src/graphsan/lab/step.py", 4, "train", None),  # the decorator's line
        ("src/graphsan/lab/step.py", 11, "forward", None),
        ("src/graphsan/lab/step.py", 10, "Model", None),
        ("src/graphsan/lab/step.py", 9, "train", "not inside train (which is at lines 4-6)"),
        (
            "src/graphsan/lab/step.py",
            6,
            "backward",
            "not inside backward (which is at lines nowhere)",
        ),
        ("/home/ci/checkout/src/graphsan/lab/step.py", 6, "train", None),
        ("../../venv/lib/python3.12/site-packages/graphsan/lab/step.py", 11, "train", "not inside"),
        ("graphsan/lab/gone.py", 3, "train", "src/graphsan/lab/gone.py does not exist"),
        ("examples/demo.py", 2, "<module>", None),
        ("examples/demo.py", 9, "<module>", "examples/demo.py has 2 lines"),
        ("examples/old_demo.py", 1, "<module>", "does not exist"),
        ("examples/demo.py", 1, None, None),
        ("torch/nn/modules/module.py", 1775, "_call_impl", None),  # not the project's
        ("demo.py", 99, None, None),  # a bare name: not a path into the project
        (".../demo.py", 2, None, None),
        ("...demo.py", 2, None, None),  # elided: the project's file of that name
        ("...gone_kernels.py", 117, None, "src/graphsan/.../gone_kernels.py does not exist"),
    ],
)
def test_the_checker_names_what_moved(tmp_path, file, line, func, wrong):
    found = problem(file, line, func, _tree(tmp_path))
    if wrong is None:
        assert found is None
    else:
        assert found is not None and wrong in found


def test_citations_are_found_in_text():
    text = "at src/graphsan/no_such_module.py:3 in nothing, and torch/x.py:1 in y\n"
    assert text_problems(text, 7) == [
        "line 7: src/graphsan/no_such_module.py:3 in nothing: src/graphsan/no_such_module.py "
        "does not exist"
    ]


# ----------------------------------------------------------------------------- what ships
# recorded before the code moved on; scripts/make_samples.py records them again on a GPU
STALE: dict[str, str] = {}  # sample name -> what moved since it was recorded


def _stale(name: str):
    if name not in STALE:
        return name
    reason = f"recorded before {STALE[name]}; re-recorded on a GPU by scripts/make_samples.py"
    return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason), id=name)


def _read_sample(name: str):
    path = sample_path(name)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)


@pytest.mark.parametrize("name", [_stale(n) for n in SAMPLES])
def test_a_shipped_sample_cites_code_that_holds_what_it_names(name):
    found = [problem(*f) for f in frames(_read_sample(name))]
    assert [p for p in found if p] == []


DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS)
def test_the_prose_cites_code_that_holds_what_it_names(doc):
    assert text_problems(make_samples.outside_blocks((ROOT / doc).read_text())) == []


QUOTED = [
    f"{doc}:{name}" for doc in DOCS for name, _, _ in make_samples.blocks((ROOT / doc).read_text())
]


@pytest.mark.parametrize("block", [_stale(b) for b in QUOTED])
def test_a_quoted_sample_cites_code_that_holds_what_it_names(block):
    doc, name = block.rsplit(":", 1)
    (body, first) = next(
        (b, n) for s, b, n in make_samples.blocks((ROOT / doc).read_text()) if s == name
    )
    assert text_problems(body, first) == []


def test_the_quoted_blocks_are_those_make_samples_rewrites():
    quoted = {
        doc: tuple(n for n, _, _ in make_samples.blocks((ROOT / doc).read_text())) for doc in DOCS
    }
    assert {d: n for d, n in quoted.items() if n} == make_samples.DOCS
    assert set(STALE) <= set(SAMPLES) | set(QUOTED), "an expected failure that no longer exists"


def test_make_samples_rewrites_one_block_and_keeps_the_rest():
    text = (
        "intro\n<!-- sample: a -->\n```text\nold a\n```\n<!-- /sample -->\nmiddle\n"
        "<!-- sample: b -->\nold b\n<!-- /sample -->\nend\n"
    )
    out = make_samples.refresh(text, "b", "new b\nsecond line")
    assert out == text.replace("old b", "new b\nsecond line")
    assert [(n, first) for n, _, first in make_samples.blocks(out)] == [("a", 3), ("b", 9)]
    with pytest.raises(ValueError, match="no <!-- sample: c --> block"):
        make_samples.refresh(text, "c", "x")
    assert make_samples.outside_blocks(text).count("\n") == text.count("\n")
    assert "old" not in make_samples.outside_blocks(text)


def test_make_samples_quotes_a_sample_as_graphsan_prints_it():
    from graphsan.report import Report, StaleMemoryError

    findings = Report.load(sample_path("stale-input")).findings
    block = make_samples.quoted("stale-input", findings)
    assert block.startswith("```text\n$ graphsan run examples/stale_input.py\n...\n")
    assert block.endswith(f"graphsan.report.StaleMemoryError: {StaleMemoryError(findings)}\n```")
