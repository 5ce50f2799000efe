"""What every graphsan command line shares, the lab's `train` and `repro` included: one-line
usage errors, defaults in `--help`, output paths checked before the work starts, and the line a
child process reports its result on (`write_result`/`read_result`: selftest and repro children,
the GPU tests' programs, the benches' runs).

Kept apart from `graphsan.cli` so that the lab's commands can use it without importing the
entry point that dispatches to them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import IO

EXIT_USAGE = 2
EXIT_NO_GPU = 4  # the command needs a CUDA GPU and this machine has none
RESULT = "RESULT "  # how a child's result line starts; the JSON object follows on the same line
# what a RESULT line holds instead of an object, in JSON's words
_JSON_VALUES = {list: "an array", str: "a string", int: "a number", float: "a number"}
_JSON_VALUES |= {bool: "true or false", type(None): "null"}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (what was wrong, where to look)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` shows each option's default, unless there is none or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # `0 in (False,)` is True: an option whose default is 0 must still show it
        hidden = default is None or default is False or default is argparse.SUPPRESS
        if (
            action.option_strings
            and not hidden
            and default not in ([], ())
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


def rank_from_env() -> int | None:
    """The distributed rank under torchrun (None for a single process)."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return int(os.environ.get("RANK", "0"))
    except ValueError:
        pass
    return None


def check_output_file(path: str, option: str) -> None:
    """Raise CliError unless a file can be written at `path`. Checked before the work starts, so
    that a typo costs nothing and the results of a long run are not lost at the end."""
    if not path.strip():
        raise CliError(f"{option} {path!r}: expected a file path")
    if path == "-":  # the options that take stdout check `-` before calling this
        raise CliError(f"{option} -: this output cannot go to stdout; expected a file path")
    if os.path.isdir(path):
        raise CliError(f"{option} {path}: is a directory; expected a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CliError(f"{option} {path}: {folder} is not a folder")
    if not os.path.isdir(folder):
        raise CliError(f"{option} {path}: the folder {folder} does not exist")
    try:  # a real write: permissions, read-only mounts and quotas all show here
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".graphsan-probe-")
    except OSError as err:
        raise CliError(f"{option} {path}: cannot write in {folder} ({err.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise CliError(f"{option} {path}: the file is not writable")


def check_report_file(path: str, option: str) -> None:
    """`check_output_file`, for a JSON report: and a file whose loss costs nothing (an empty
    file or an older report is replaced, anything else is refused)."""
    check_output_file(path, option)
    from graphsan.report.json_report import is_report_file

    if os.path.isfile(path) and os.path.getsize(path) > 0 and not is_report_file(path):
        raise CliError(
            f"{option} {path}: the file exists and is not a graphsan report; writing the report "
            "would replace it (expected a new path, or a report to overwrite)"
        )


def write_result(obj: dict, stream: IO[str] | None = None) -> None:
    """Write `obj` as one line `RESULT {json}` to `stream` (None: the current sys.stdout) and
    flush it, so that the parent reads it even when the child dies right after."""
    out = sys.stdout if stream is None else stream
    out.write(RESULT + json.dumps(obj) + "\n")
    out.flush()


def read_result(text: str) -> dict | None:
    """The object on the last `RESULT {json}` line of a child's output (None: no such line). A
    damaged last line (cut short, not JSON, or no object) is a ValueError saying what is wrong."""
    line = next((ln for ln in reversed(text.splitlines()) if ln.startswith(RESULT)), None)
    if line is None:
        return None
    body = line[len(RESULT) :]
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:
        raise ValueError(f"the RESULT line is not JSON ({err}): {body[:80]!r}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"the RESULT line holds {_JSON_VALUES[type(data)]}; expected a JSON object"
        )
    return data
