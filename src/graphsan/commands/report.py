"""`graphsan report`: saved reports printed, merged by rank, or written as an HTML page and a
Chrome trace; suppressions applied or generated.

    graphsan report [--html OUT.html] [--trace OUT.json] out.json [more.json ...]
    graphsan report --sample NAME [--html OUT.html]
"""

from __future__ import annotations

import os
import sys

from graphsan.command_line import CliError, OneLineParser, check_output_file
from graphsan.commands import SOURCE_ROOT_HELP, load_suppressions, set_source_root


def main(argv: list[str]) -> int:
    p = OneLineParser(
        prog="graphsan report",
        description="Print saved reports; several (one per rank) are merged into one summary.",
    )
    from graphsan.report.json_report import SAMPLES, sample_path

    p.add_argument("paths", nargs="*", metavar="REPORT.json")
    p.add_argument("--html", metavar="OUT.html", help="write one self-contained HTML page")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (Perfetto)")
    p.add_argument(
        "--sample",
        choices=list(SAMPLES),
        help="a report recorded on an NVIDIA H200, shipped with graphsan (no GPU needed): "
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
        "as it was where the report was written",
    )
    p.add_argument(
        "--gen-suppressions",
        action="store_true",
        help="print a suppression entry for each finding, ready to edit, and exit",
    )
    p.add_argument(
        "--error-exitcode",
        type=int,
        metavar="N",
        help="exit N when findings remain after suppressions (compute-sanitizer's flag)",
    )
    args = p.parse_args(argv)
    if args.error_exitcode is not None and not 1 <= args.error_exitcode <= 255:
        raise CliError(f"--error-exitcode {args.error_exitcode}: expected 1 to 255")
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
    for path, option in ((args.html, "--html"), (args.trace, "--trace")):
        if path is not None:
            if os.path.realpath(path) in inputs:
                raise CliError(
                    f"{option} {path}: that is one of the reports being read; writing it would "
                    "replace the report (expected another path)"
                )
            check_output_file(path, option)
    from graphsan.report import Report
    from graphsan.report.ranks import merge_reports

    reports = []
    for path in args.paths:
        try:
            reports.append(Report.load(path))
        except ValueError as err:
            raise CliError(str(err)) from None
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

        try:
            said = write_report_outputs(reports, args.paths, args.html, args.trace)
        except OutputError as err:
            raise CliError(f"graphsan report: {err}") from None
        sys.stderr.write("".join(f"{line}\n" for line in said))
    elif len(reports) == 1:
        print(reports[0].render())
    else:
        print(merge_reports(reports, args.paths))
    if args.error_exitcode is not None and any(rep.findings for rep in reports):
        return args.error_exitcode
    return 0
