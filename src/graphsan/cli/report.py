"""`graphsan report`: saved reports printed, merged by rank, or written as an HTML page and a
Chrome trace; suppressions applied or generated. A report in which graphsan watched nothing
(no CUDA, say) says so first, and fails `--error-exitcode` unless `--allow-idle` is given.

    graphsan report [--html OUT.html] [--trace OUT.json] out.json [more.json ...]
    graphsan report --sample NAME [--html OUT.html]
"""

from __future__ import annotations

import os
import sys

from graphsan.cli.options import SOURCE_ROOT_HELP, load_suppressions, set_source_root
from graphsan.command_line import CannotWrite, CliError, OneLineParser, check_output_file


def main(argv: list[str]) -> int:
    p = OneLineParser(
        prog="graphsan report",
        description="Print saved reports; several (one per rank) are merged into one summary.",
    )
    from graphsan.report.json_report import SAMPLES, sample_path

    p.add_argument("paths", nargs="*", metavar="REPORT.json")
    p.add_argument(
        "--html", metavar="OUT.html", help="write one self-contained HTML page (- for stdout)"
    )
    p.add_argument(
        "--trace", metavar="OUT.json", help="write a Chrome trace for Perfetto (- for stdout)"
    )
    p.add_argument(
        "--sample",
        choices=list(SAMPLES),
        help="a report recorded on a GPU, shipped with graphsan (no GPU needed): "
        + "; ".join(f"{k}: {v[1]}" for k, v in SAMPLES.items()),
    )
    p.add_argument(
        "--suppressions",
        metavar="FILE",
        help="leave out the findings a YAML suppression file matches (they are counted)",
    )
    p.add_argument(
        "--source-root",
        metavar="DIR",
        help=f"{SOURCE_ROOT_HELP}; for reports whose frames hold absolute paths, give the root "
        "as it was where the report was written (a folder missing here must hold some frame "
        "of the reports)",
    )
    p.add_argument(
        "--gen-suppressions",
        action="store_true",
        help="print a suppression entry for each finding, ready to edit, and exit (no page or "
        "trace)",
    )
    p.add_argument(
        "--error-exitcode",
        type=int,
        metavar="N",
        help="exit N when findings remain after suppressions (compute-sanitizer's flag), or when "
        "a report says graphsan watched nothing (idle: no CUDA, say)",
    )
    p.add_argument(
        "--allow-idle",
        action="store_true",
        help="with --error-exitcode: accept reports in which graphsan watched nothing",
    )
    args = p.parse_args(argv)
    if args.error_exitcode is not None and not 1 <= args.error_exitcode <= 255:
        raise CliError(f"--error-exitcode {args.error_exitcode}: expected 1 to 255")
    if args.gen_suppressions and (args.html or args.trace):
        given = "--html" if args.html else "--trace"
        raise CliError(
            f"--gen-suppressions prints suppression entries and exits; it writes no page or "
            f"trace (expected {given} in a run of its own)"
        )
    entries = load_suppressions(args.suppressions)
    set_source_root(args.source_root, exists=False)
    if args.sample is not None:
        if args.paths:
            raise CliError("--sample reads the shipped report; give it no REPORT.json as well")
        args.paths = [sample_path(args.sample)]
    elif not args.paths:
        raise CliError("expected REPORT.json (or --sample NAME; see graphsan report --help)")
    inputs = {os.path.realpath(x) for x in args.paths}
    if len(inputs) < len(args.paths):
        twice = next(
            x
            for i, x in enumerate(args.paths)
            if os.path.realpath(x) in {os.path.realpath(y) for y in args.paths[:i]}
        )
        raise CliError(f"{twice} is given twice; each report counts once")
    _check_outputs(args.html, args.trace, inputs)
    from graphsan.report import Report
    from graphsan.report.ranks import merge_reports

    reports = []
    for path in args.paths:
        try:
            reports.append(Report.load(path))
        except ValueError as err:
            raise CliError(str(err)) from None
    if args.source_root is not None and not os.path.isdir(args.source_root):
        _check_recorded_root(args.source_root, reports)
    if entries:
        from graphsan.report import suppressions

        for rep in reports:
            rep.findings, suppressed = suppressions.split(entries, rep.findings)
            rep.suppressed = rep.suppressed + suppressed
    if args.gen_suppressions:
        from graphsan.report.suppressions import generate

        print(generate([f for rep in reports for f in rep.findings]), end="")
        return 0
    if args.html or args.trace:
        from graphsan.report.pages import OutputError, write_report_outputs

        names = _page_names(args.paths)
        try:  # nothing runs here that changes folder: the paths are as checked
            said = write_report_outputs(reports, names, args.html, args.trace)
        except OutputError as err:  # the paths were checked: the disk refused the file
            raise CannotWrite(str(err)) from None
        sys.stderr.write("".join(f"{line}\n" for line in said))
    elif len(reports) == 1:
        print(reports[0].render())
    else:
        head, _, rest = merge_reports(reports, args.paths).partition("\n")
        print("\n".join([head, *_merged_header(reports, args.paths)]) + "\n" + rest)
    return _exit_status(reports, args)


def _check_outputs(html: str | None, trace: str | None, inputs: set[str]) -> None:
    """--html and --trace: each writable, neither a report being read, not both one file."""
    from graphsan.report.output import STDOUT, same_output

    both = same_output({"--html": html, "--trace": trace})
    if both is not None and html == STDOUT:
        raise CliError("--html - and --trace - both write to stdout (expected one of them there)")
    if both is not None:
        raise CliError(
            f"--html {html} and --trace {trace} name the same file; the trace would replace "
            "the page (expected two paths)"
        )
    from graphsan.report.pages import OutputError, check_output

    for path, option in ((html, "--html"), (trace, "--trace")):
        if path is None or path == STDOUT:
            continue
        if os.path.realpath(path) in inputs:
            raise CliError(
                f"{option} {path}: that is one of the reports being read; writing it would "
                "replace the report (expected another path)"
            )
        check_output_file(path, option)
        try:  # what the pages' writer checks again: refused here, before anything is written
            check_output(path, option)
        except OutputError as err:
            raise CliError(str(err)) from None


def _page_names(paths: list[str]) -> list[str]:
    """How the page and the trace name each report: a file by its path from the current folder
    when it is under it, else (a shipped sample too) by its file name. A page is passed around:
    it does not carry the folders of the machine that drew it."""
    here = os.getcwd()
    names = []
    for path in paths:
        full = os.path.abspath(path)
        inside = full.startswith(here.rstrip(os.sep) + os.sep)
        names.append(os.path.relpath(full, here) if inside else os.path.basename(full))
    return names


def _check_recorded_root(root: str, reports: list) -> None:
    """--source-root DIR that is no folder here: accepted only as the root the reports were
    written under (some frame's file lies under it), which no longer exists on this machine."""
    if os.path.exists(root):
        raise CliError(f"--source-root {root}: is not a folder; expected the project's root folder")
    from graphsan.report.text import where_stack

    prefix = os.path.abspath(root).rstrip(os.sep) + os.sep
    for rep in reports:
        for f in [*rep.findings, *(f for _, f in rep.suppressed)]:
            for frame in (*f.alloc_stack, *where_stack(f), *f.graph.capture_site):
                if str(frame[0]).startswith(prefix):
                    return
        for g in rep.graphs:
            for frame in g.get("capture_site") or []:
                if frame and str(frame[0]).startswith(prefix):
                    return
    raise CliError(
        f"--source-root {root}: does not exist here, and no frame of the reports lies under it; "
        "expected the project's root folder (for another machine's report: the root as it was "
        "there)"
    )


def _name(rep, path: str) -> str:
    return f"rank {rep.rank}" if rep.rank is not None else path


def _merged_header(reports: list, paths: list[str]) -> list[str]:
    """Under the merged summary: each idle report, what recorded them and how graphsan
    attached (each once if alike)."""
    from graphsan.report.json_report import SCHEMA_VERSION
    from graphsan.report.text import attachment_line, provenance_line, watch_line

    lines = []
    for rep, path in zip(reports, paths, strict=True):
        watch = watch_line(rep.watched, rep.disabled_reason)
        if watch:
            lines.append(f"{_name(rep, path)}: {watch}")
    made = [provenance_line(r.provenance, r.loaded_version, SCHEMA_VERSION) for r in reports]
    attached = [
        attachment_line(r.provenance, r.allocator_log, r.loaded_version, SCHEMA_VERSION)
        for r in reports
    ]
    for texts in (made, attached):
        if len(set(texts)) == 1:
            lines += [texts[0]] if texts[0] else []
            continue
        for rep, path, text in zip(reports, paths, texts, strict=True):
            if text:
                lines.append(f"{_name(rep, path)}: {text}")
    return lines


def _exit_status(reports: list, args) -> int:
    """--error-exitcode N: findings remain, or a report watched nothing (unless --allow-idle)."""
    if args.error_exitcode is None:
        return 0
    if any(rep.findings for rep in reports):
        return args.error_exitcode
    idle = [(rep, path) for rep, path in zip(reports, args.paths, strict=True) if rep.idle]
    if idle and not args.allow_idle:
        rep, path = idle[0]
        more = f" (and {len(idle) - 1} more)" if len(idle) > 1 else ""
        sys.stderr.write(
            f"graphsan report: {_name(rep, path)}{more}: graphsan watched nothing "
            f"({rep.disabled_reason or 'no reason recorded'}); exit {args.error_exitcode} "
            "(--allow-idle accepts it)\n"
        )
        return args.error_exitcode
    return 0
