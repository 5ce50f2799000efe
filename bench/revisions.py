"""The revisions a bench compares side by side: the working tree, and with `--against REV` that
git revision's `src/` unpacked into a temporary folder (each run imports graphsan from one)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

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
