"""Pages for people and viewers: the HTML report, the Chrome trace, the matrix page.

Every page is one self-contained file (inline CSS, JS and SVG; nothing fetched), so it opens
from a laptop's disk. The HTML comes from Jinja2 templates (`graphsan/templates/`); this module
imports Jinja2 only when a page is rendered, so the CLI's parser stays light.

    write_report_outputs(reports, names, html="out.html", trace="out.json")
    write_matrix_page("matrix.html", [{"case": {...}, "result": {...}}, ...])
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from graphsan.report.output import STDOUT, write_output


class OutputError(ValueError):
    """An output path that cannot be written; the message is one line for the user."""


def check_output(path: str, what: str, stdout: bool = False) -> str:
    """Fail early, with one line, for a path that cannot take a file: a folder that does not
    exist or is a file, a directory given as the file, or a folder we may not write in. `-` is
    stdout where the caller takes it (`stdout`), and refused elsewhere."""
    if not path:
        raise OutputError(f"{what}: expected a file path, got an empty one")
    if path == STDOUT:
        if stdout:
            return path
        raise OutputError(f"{what} -: this page cannot go to stdout here; expected a file path")
    if os.path.isdir(path):
        raise OutputError(f"{what} {path}: is a directory; expected a file path inside one")
    folder = os.path.dirname(path) or "."
    if not os.path.exists(folder):
        raise OutputError(f"{what} {path}: folder {folder} does not exist")
    if not os.path.isdir(folder):
        raise OutputError(f"{what} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise OutputError(f"{what} {path}: cannot write there (permission denied)")
    return path


def write_text(path: str, text: str, what: str) -> None:
    """Write `text` to `path` whole (graphsan.report.output; `-`: stdout) or raise
    OutputError."""
    try:
        write_output(path, text)
    except BrokenPipeError:  # `--html - | head`: the reader left (graphsan.cli says nothing)
        raise
    except OSError as err:
        raise OutputError(f"{what} {path}: cannot write ({err.strerror or err})") from None


class OutputPathAction(argparse.Action):
    """`--html PATH` for argparse: the path is checked when the command line is read, so a long
    run never ends in a page that cannot be written; a bad one is one line and exit status 2."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            check_output(values, option_string or self.dest)
        except OutputError as err:
            parser.exit(2, f"error: {parser.prog}: {err}\n")
        setattr(namespace, self.dest, values)


def write_report_outputs(
    reports: list, names: list[str], html: str | None = None, trace: str | None = None
) -> list[str]:
    """Write the HTML report and/or the Chrome trace of `reports` (one per rank; `-`: stdout);
    returns the lines to tell the user. Raises OutputError for a path that cannot be written."""
    for path, what in ((html, "--html"), (trace, "--trace")):
        if path:
            check_output(path, what, stdout=True)
    said = []
    if html:
        from graphsan.report.pages.report_page import render_report

        write_text(html, render_report(reports, names), "--html")
        said.append(f"graphsan: HTML report written to {_where(html)}")
    if trace:
        from graphsan.report.pages.trace import chrome_trace

        data = chrome_trace(reports, names)
        write_text(trace, json.dumps(data, separators=(",", ":")), "--trace")
        n = sum(1 for e in data["traceEvents"] if e["ph"] != "M")
        said.append(
            f"graphsan: trace of {n} event(s) written to {_where(trace)} (open it in Perfetto)"
        )
        if n == 0:
            said.append(f"graphsan: {_why_no_events(reports)}: the trace has only its tracks")
    return said


def _where(path: str) -> str:
    return "stdout" if path == STDOUT else path


def _why_no_events(reports: list) -> str:
    """Why reports hold no event: idle, older than the timeline (schema v3), or nothing ran."""
    if all(r.idle for r in reports):
        return "nothing was watched in these reports"
    if all(r.loaded_version is not None and r.loaded_version < 3 for r in reports):
        return "these reports hold no times (written before report schema v3)"
    return "these reports hold no events"


def write_matrix_page(path: str, entries: list[dict[str, Any]], reference=None) -> bool:
    """The matrix page for `graphsan repro --html`; False (and one line on stderr) when the file
    cannot be written."""
    from graphsan.report.pages.matrix import render_matrix

    try:
        write_text(check_output(path, "--html"), render_matrix(entries, reference), "--html")
    except OutputError as err:
        sys.stderr.write(f"error: graphsan repro: {err}\n")
        return False
    sys.stderr.write(f"graphsan: matrix page written to {path}\n")
    return True
