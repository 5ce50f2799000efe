"""The revisions a bench compares side by side: the working tree, and with `--against REV` that
git revision's `src/` unpacked into a temporary folder (each run imports graphsan from one)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from graphsan.command_line import read_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git(*argv: str) -> str:
    return subprocess.run(
        ["git", "-C", ROOT, *argv], capture_output=True, text=True, check=True
    ).stdout.strip()


@contextlib.contextmanager
def revisions(against: str | None, error) -> Iterator[list[tuple[str, str, str]]]:
    """(name, src folder, revision: "" for the working tree), the older revision first;
    `error(message)` reports a revision git does not know (argparse's `parser.error`)."""
    head = git("rev-parse", "--short", "HEAD")
    dirty = " (with uncommitted changes)" if git("status", "--porcelain", "src") else ""
    revs = [(f"{head}{dirty}", os.path.join(ROOT, "src"), "")]
    if not against:
        yield revs
        return
    try:
        rev = git("rev-parse", "--short", against)
    except subprocess.CalledProcessError:
        error(f"--against: {against!r} is not a git revision of {ROOT}")
    with tempfile.TemporaryDirectory(prefix="graphsan-bench-") as tmp:
        archive = subprocess.run(
            ["git", "-C", ROOT, "archive", rev, "src"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield [(rev, os.path.join(tmp, "src"), rev), *revs]


def run_at(src: str, argv: list[str], rev: str, what: str, timeout: int) -> dict:
    """`python argv` in a fresh process importing graphsan from `src`: its RESULT line;
    SystemExit naming `what` (and the revision, where one lacks a module the bench imports)
    when it printed none."""
    env = dict(os.environ)
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout
    )
    res = read_result(proc.stdout)
    if res is not None:
        return res
    out = (proc.stdout + proc.stderr).strip()
    missing = re.search(r"^(ModuleNotFoundError|ImportError): .*$", out, re.MULTILINE)
    if rev and missing:
        raise SystemExit(
            f"--against {rev}: graphsan at that revision lacks what the bench drives "
            f"({missing.group(0)}); expected a revision with the current module layout"
        )
    where = f" (revision {rev})" if rev else ""
    raise SystemExit(f"the run {what}{where} failed:\n{out[-3000:]}")
