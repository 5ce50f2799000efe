"""CPU: what the package index shows, and what the wheel and the source distribution hold.
README.md is the index page, where a link relative to the source tree (docs/*.md, examples/*) or
to a heading leads nowhere: every link in it is absolute, and the paths it names in code form
are files of the source distribution, which holds the source tree (MANIFEST.in): the whole test
suite, which collects there without an error, and the docs, examples, benches and scripts. The
license, the typing marker and the page templates ship."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
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


# what the source distribution is built from: the tree less what a checkout gathers by running
SOURCES = ["pyproject.toml", "MANIFEST.in", "README.md", "LICENSE"]
SOURCES += ["src", "tests", "docs", "examples", "bench", "scripts"]
NOT_SOURCE = ("__pycache__", "*.py[cod]", "*.egg-info", "*.so", "*.o")


def tree_files(folder: Path) -> set[str]:
    """The files under `folder`, as paths from the checkout's root, less built ones."""
    out = set()
    for path in folder.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not any(
            rel.match(p) or p.strip("*") in rel.parts for p in NOT_SOURCE
        ):
            out.add(rel.as_posix())
    return out


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """The source distribution, built (as `python -m build --sdist` does, without its
    isolated environment) from a copy of the tree, and unpacked: its top folder."""
    pytest.importorskip("setuptools", minversion="77")  # pyproject.toml's build requirement
    work = tmp_path_factory.mktemp("sdist")
    tree = work / "tree"
    tree.mkdir()
    ignore = shutil.ignore_patterns(*NOT_SOURCE)
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tree / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, tree / name)
    build = (
        "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", build, str(work / "dist")],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    name = done.stdout.strip().splitlines()[-1]
    with tarfile.open(work / "dist" / name) as tar:
        tar.extractall(work / "unpacked", filter="data")
    (top,) = (work / "unpacked").iterdir()
    return top


def sdist_files(top: Path) -> set[str]:
    return {p.relative_to(top).as_posix() for p in top.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_the_sdist_ships_the_whole_test_suite(sdist):
    shipped = sdist_files(sdist)
    suite = tree_files(ROOT / "tests")
    assert {"tests/conftest.py", "tests/fake_cuda.py", "tests/lab/conftest.py"} <= suite
    assert sorted(suite - shipped) == []
    assert sorted(p for p in shipped - suite if p.startswith("tests/")) == []


@pytest.mark.slow
def test_the_paths_the_readme_names_are_in_the_sdist(sdist):
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`((?:docs|examples|bench|scripts|tests)/[\w./-]+\.\w+)`", readme))
    files = {p for p in named if (ROOT / p).is_file()}  # not an example such as scripts/train.py
    assert {"docs/te-3316.md", "examples/stale_input.py", "bench/bench_faults.py"} <= files
    assert sorted(files - sdist_files(sdist)) == []


@pytest.mark.slow
def test_the_suite_collects_in_the_unpacked_sdist(sdist):
    env = dict(os.environ, PYTHONPATH=str(sdist / "src"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=sdist,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, tail
    assert " error" not in done.stdout.splitlines()[-1], tail
    assert re.search(r"^\d+ tests collected", done.stdout.splitlines()[-1]), tail
