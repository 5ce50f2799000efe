"""CPU: small seams of the command line, each one line and a non-zero exit: an unknown option
before the command is named, a report whose version is not a number, a `-k` that matches
nothing in `selftest --list`, and `-` for stdout, which `--help` documents where an option
takes it (`report --html/--trace`, `selftest --json`, `repro --json`)."""

from __future__ import annotations

import json

import pytest

from graphsan.cli.main import main
from graphsan.report import Report


def status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("argv", [["--bogus"], ["--bogus", "run", "x.py"], ["-q"], ["--vers"]])
def test_an_unknown_option_before_the_command_is_named(argv, capsys):
    assert status(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"graphsan: error: unrecognized option {argv[0]}; expected a command (run, report, "
        "selftest, train, repro), --help or --version (see graphsan --help)"
    ]


@pytest.mark.parametrize(
    ("version", "shown"),
    [("4", "'4' (str)"), (4.0, "4.0 (float)"), (True, "True (bool)"), (None, "None (NoneType)")],
)
def test_a_version_that_is_not_an_integer_is_a_type_error(tmp_path, capsys, version, shown):
    data = Report().to_dict()
    data["version"] = version
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"graphsan report: error: {path}: report schema version is {shown}; expected an "
        "integer, one of 1, 2, 3, 4, 5, 6, 7, 8, 9, 10"
    ]


def test_an_unknown_version_still_says_which_are_read(tmp_path, capsys):
    data = dict(Report().to_dict(), version=99)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert main(["report", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"graphsan report: error: {path}: report schema version 99 is not supported (expected "
        "one of 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)"
    )


@pytest.mark.parametrize("extra", [[], ["--json", "-"]])
def test_selftest_list_with_a_pattern_that_matches_nothing_says_so(capsys, extra):
    assert main(["selftest", "--list", "-k", "nomatch", *extra]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.strip().splitlines() == [
        "graphsan selftest: error: -k nomatch: no run's name contains it (see --list alone)"
    ]


@pytest.mark.parametrize(
    ("command", "option"),
    [("report", "--html"), ("report", "--trace"), ("selftest", "--json"), ("repro", "--json")],
)
def test_help_says_where_dash_means_stdout(capsys, command, option):
    assert status([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    options = text[text.index("options:") :]
    described = options[options.index(option + " ") :][:260]
    assert "- for stdout" in described or "(or with -) to stdout" in described, described


def test_run_help_says_which_existing_report_files_it_replaces(capsys):
    assert status(["run", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "an existing file is replaced only when it is empty or a report" in text


def test_report_help_documents_allow_idle(capsys):
    assert status(["report", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "--allow-idle with --error-exitcode: accept reports in which graphsan watched nothing"
        in text
    )
