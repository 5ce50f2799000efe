"""CPU: what the package index shows and the wheel holds. README.md is the index page, where a
link relative to the source tree (docs/*.md, examples/*) or to a heading leads nowhere: every
link in it is absolute. The license, the typing marker and the page templates ship."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+).*?\1", re.DOTALL)
LINK_TARGETS = (
    re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)"),  # [text](target), ![alt](target)
    re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE),  # [id]: target
    re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']*)["']""", re.IGNORECASE),  # HTML
)
ABSOLUTE = re.compile(r"^(https?://|mailto:)", re.IGNORECASE)


def link_targets(markdown: str) -> list[str]:
    """Every link target outside code blocks and code spans."""
    prose = CODE_SPAN.sub("", FENCE.sub("", markdown))
    return [m.group(1) for pattern in LINK_TARGETS for m in pattern.finditer(prose)]


def relative_links(markdown: str) -> list[str]:
    return [t for t in link_targets(markdown) if not ABSOLUTE.match(t)]


def test_the_finder_sees_each_kind_of_relative_link_and_skips_code():
    text = (
        "See [the bug](docs/te-3316.md), ![plot](docs/a.png), [below](#usage) and [x][r].\n\n"
        "[r]: examples/stale_input.py\n"
        '<a href="docs/PERF.md">perf</a> and <img src="docs/coverage.png">\n'
        "`[not](a/link)` and [fine](https://example.org/x) and <https://example.org>\n"
        "```python\nx = d[k](arg)\n```\n"
    )
    assert sorted(relative_links(text)) == sorted(
        ["docs/te-3316.md", "docs/a.png", "#usage", "examples/stale_input.py", "docs/PERF.md",
         "docs/coverage.png"]
    )  # fmt: skip


def test_the_readme_holds_no_relative_link():
    assert relative_links((ROOT / "README.md").read_text()) == []


def test_the_readme_names_the_docs_it_cites_and_they_exist():
    """The docs are named as source-tree paths in code form; each such path is a file."""
    readme = (ROOT / "README.md").read_text()
    paths = set(re.findall(r"`((?:docs|examples)/[\w./-]+)`", readme))
    assert "docs/te-3316.md" in paths and "examples/stale_input.py" in paths
    assert [p for p in sorted(paths) if not (ROOT / p).is_file()] == []


def test_the_project_metadata_names_its_license_and_ships_the_typing_marker():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    meta, setuptools = project["project"], project["tool"]["setuptools"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    # a license expression and a license classifier together are refused by the build
    assert not any(c.startswith("License ::") for c in meta["classifiers"])
    assert "Typing :: Typed" in meta["classifiers"]
    assert "py.typed" in setuptools["package-data"]["graphsan"]
    assert (ROOT / "src" / "graphsan" / "py.typed").is_file()
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "Copyright 2026 The graphsan authors" in license_text
