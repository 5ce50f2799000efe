"""What every graphsan command line shares, the lab's `train` and `repro` included: one-line
usage errors, defaults in `--help`, output paths checked before the work starts (and resolved
then, in the caller's directory: `graphsan.report.output`), the exit statuses, and the line a
child process reports its result on (`write_result`/`read_result`: selftest and repro children,
the GPU tests' programs, the benches' runs).

Kept apart from `graphsan.cli` so that the lab's commands can use it without importing the
entry point that dispatches to them.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
from collections.abc import Callable
from typing import IO

EXIT_USAGE = 2
EXIT_NO_GPU = 4  # the command needs a CUDA GPU and this machine has none
EXIT_CANNOT_WRITE = 6  # an output could not be written at the end (a full disk, an I/O error)
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader left early (`| head`), as for `cat`
RESULT = "RESULT "  # how a child's result line starts; the JSON object follows on the same line
# what a RESULT line holds instead of an object, in JSON's words
_JSON_VALUES = {list: "an array", str: "a string", int: "a number", float: "a number"}
_JSON_VALUES |= {bool: "true or false", type(None): "null"}


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""

    exit_status = EXIT_USAGE


class CannotWrite(CliError):
    """An output that could not be written once the work was done (a full disk, an I/O error):
    one line, exit status 6. Nothing half-written is left behind (`graphsan.report.output`)."""

    exit_status = EXIT_CANNOT_WRITE


def cannot_write(option: str, path: str, err: OSError) -> CannotWrite:
    """The one line for an output `writing` could not write (`option PATH: cannot write (why)`)."""
    return CannotWrite(f"{option} {path}: cannot write ({err.strerror or err})")


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
    that a typo costs nothing and the results of a long run are not lost at the end. A FIFO or a
    character device is written in place (`graphsan.report.output`); any other path must be, or
    become, a regular file."""
    from graphsan.report.output import IN_PLACE, REFUSED, kind_of

    if not path.strip():
        raise CliError(f"{option} {path!r}: expected a file path")
    if path == "-":  # the options that take stdout check `-` before calling this
        raise CliError(f"{option} -: this output cannot go to stdout; expected a file path")
    kind = kind_of(path)
    if kind == stat.S_IFDIR:
        raise CliError(f"{option} {path}: is a directory; expected a file path")
    if kind in IN_PLACE:
        if not os.access(path, os.W_OK):
            raise CliError(f"{option} {path}: {IN_PLACE[kind]} that is not writable")
        return
    if kind is not None and kind != stat.S_IFREG:
        raise CliError(
            f"{option} {path}: is {REFUSED.get(kind, 'not a regular file')}; expected a regular "
            "file, a FIFO or a character device"
        )
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


def check_kept_file(
    path: str, option: str, ours: Callable[[str], bool], what: str, output: str, earlier: str
) -> None:
    """`check_output_file`, for an output that replaces what is there: only a file whose loss
    costs nothing is replaced (none, an empty file, or a file `ours` recognises as an earlier
    output of the same command); anything else is refused, in one line: it is not `what`,
    writing `output` would replace it, expected a new path or `earlier`. A FIFO or a character
    device is written in place, never read."""
    check_output_file(path, option)
    if os.path.isfile(path) and os.path.getsize(path) > 0 and not ours(path):
        raise CliError(
            f"{option} {path}: the file exists and is not {what}; writing {output} would "
            f"replace it (expected a new path, or {earlier} to overwrite)"
        )


def check_report_file(path: str, option: str) -> None:
    """`check_kept_file` for a JSON report: an empty file or an older report is replaced,
    anything else is refused."""
    from graphsan.report.json_report import is_report_file

    check_kept_file(path, option, is_report_file, "a graphsan report", "the report", "a report")


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
