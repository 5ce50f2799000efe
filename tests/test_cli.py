"""CPU: the command line as a newcomer meets it. `graphsan run` runs a program as `python` would
(argv, sys.path, tracebacks, exit status), checks its --report path before the program starts and
writes the report however the program ends; `graphsan report` names what is wrong in a broken
file; `--help` and `--version` load neither torch nor the lab, and `graphsan run` never loads the
lab. Every mistake is one line and a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import graphsan
from graphsan.cli.main import main
from graphsan.report import Report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
# `python -P`: nothing put before sys.path, like the `graphsan` console script (whose folder is
# sys.path[0], not the current directory)
CONSOLE = [
    sys.executable,
    "-P",
    "-c",
    "import sys; from graphsan.cli.main import main; sys.exit(main())",
]


def status(argv: list[str]) -> int:
    """main's exit status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def lines(text: str) -> list[str]:
    return [ln for ln in text.strip().splitlines() if ln and not ln.startswith("graphsan: CUDA")]


def test_help_and_version_load_neither_torch_nor_the_lab():
    code = (
        "import contextlib, io, sys\n"
        "from graphsan.cli.main import main\n"
        "for argv in (['--help'], ['--version'], ['report', '--help']):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "        main(argv)\n"
        "    print(repr(out.getvalue()))\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('graphsan.lab')))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120
    )
    assert p.returncode == 0, p.stderr
    help_text, version, report_help, loaded = p.stdout.strip().splitlines()
    for command in ("run", "report", "train", "repro"):
        assert command in help_text
    assert eval(version) == f"graphsan {graphsan.__version__}\n"
    assert "REPORT.json" in report_help
    assert loaded == "[]"


def test_the_version_is_the_package_version():
    with open(os.path.join(ROOT, "pyproject.toml")) as fh:
        text = fh.read()
    assert re.search(r'^version = "([^"]+)"', text, re.M).group(1) == graphsan.__version__


def test_run_m_finds_modules_in_the_current_folder_and_loads_no_lab(tmp_path):
    pkg = tmp_path / "mymod"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tool.py").write_text(
        "import json, sys\n"
        "loaded = [m for m in sys.modules if m.startswith('graphsan.lab')]\n"
        "heavy = [m for m in ('rich', 'yaml') if m in sys.modules]\n"
        "print(json.dumps({'argv': sys.argv[1:], 'lab': loaded, 'heavy': heavy,\n"
        "                  'name': __name__}))\n"
    )
    p = subprocess.run(
        [*CONSOLE, "run", "-m", "mymod.tool", "-x", "--policy", "y"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen == {"argv": ["-x", "--policy", "y"], "lab": [], "heavy": [], "name": "__main__"}


@pytest.fixture
def prog(tmp_path):
    """Write a script; returns its path (the script leaves `ran` beside it when it starts)."""

    def write(body: str, name: str = "prog.py") -> str:
        path = tmp_path / name
        path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n{body}")
        return str(path)

    return write


def test_an_import_error_in_the_program_shows_the_programs_traceback(prog, capsys):
    script = prog("import no_such_module_of_yours\n")
    assert main(["run", script]) == 1
    err = capsys.readouterr().err
    assert lines(err) == [
        "Traceback (most recent call last):",
        f'  File "{script}", line 2, in <module>',
        "    import no_such_module_of_yours",
        "ModuleNotFoundError: No module named 'no_such_module_of_yours'",
    ]


def test_the_programs_own_error_is_its_traceback_and_exit_1(prog, capsys):
    script = prog("def f():\n    raise KeyError('k')\nf()\n")
    assert main(["run", script]) == 1
    err = lines(capsys.readouterr().err)
    assert err[0] == "Traceback (most recent call last):" and err[-1] == "KeyError: 'k'"
    # graphsan's and runpy's frames, which lead into the program, are left out
    assert [ln for ln in err if ln.startswith("  File ")] == [
        f'  File "{script}", line 4, in <module>',
        f'  File "{script}", line 3, in f',
    ], err
    script = prog("x = (\n", name="syntax.py")
    assert main(["run", script]) == 1
    assert lines(capsys.readouterr().err)[-1] == "SyntaxError: '(' was never closed"


@pytest.mark.parametrize(
    ("body", "status", "stderr"),
    [
        ("import sys; sys.exit('the input is empty')\n", 1, ["the input is empty"]),
        ("import sys; sys.exit(4)\n", 4, []),
        ("import sys; sys.exit()\n", 0, []),
        ("import sys; sys.exit(None)\n", 0, []),
        ("print('done')\n", 0, []),
    ],
)
def test_sys_exit_works_as_with_python(prog, capsys, body, status, stderr):
    assert main(["run", prog(body)]) == status
    assert lines(capsys.readouterr().err) == stderr


def test_the_program_gets_its_own_arguments_and_options(prog, capsys):
    script = prog("import sys; print(sys.argv)\n")
    assert main(["run", "--policy", "warn", script, "--policy", "x", "-m", "y"]) == 0
    assert capsys.readouterr().out.strip() == repr([script, "--policy", "x", "-m", "y"])


@pytest.mark.parametrize(
    "body",
    ["raise RuntimeError('boom')\n", "import sys; sys.exit('stop')\n", "raise KeyboardInterrupt\n"],
)
def test_the_report_is_written_however_the_program_ends(prog, tmp_path, capsys, body):
    report = tmp_path / "out.json"
    assert main(["run", "--policy", "record", "--report", str(report), prog(body)]) != 0
    assert Report.load(str(report)).policy == "record"
    assert f"report written to {report}" in capsys.readouterr().err


def test_a_report_that_cannot_be_written_at_the_end_is_printed_instead(prog, tmp_path, capsys):
    folder = tmp_path / "reports"
    folder.mkdir()
    script = prog(f"import shutil; shutil.rmtree({str(folder)!r})\n")
    assert main(["run", "--report", str(folder / "out.json"), script]) == 6
    err = lines(capsys.readouterr().err)
    assert err[0].startswith(f"graphsan run: error: could not write the report to {folder}")
    assert err[1].startswith("graphsan report: 0 graph(s), 0 node(s) analysed, 0 finding(s)")


def _read_only_folder(tmp_path) -> str:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:  # root writes anyway: use a folder no one can create files in
        (ro / "probe").touch()
    except OSError:
        return str(ro)
    return "/proc"


@pytest.mark.parametrize("where", ["missing folder", "read-only folder", "a directory", "empty"])
def test_a_bad_report_path_is_refused_before_the_program_starts(prog, tmp_path, capsys, where):
    script = prog("print('ran')\n")
    path = {
        "missing folder": str(tmp_path / "no" / "out.json"),
        "read-only folder": os.path.join(_read_only_folder(tmp_path), "out.json"),
        "a directory": str(tmp_path),
        "empty": "",
    }[where]
    assert main(["run", "--report", path, script]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"graphsan run: error: --report {path or repr('')}")
    assert not (tmp_path / "ran").exists()
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "expected a script path or -m MODULE"),
        (["missing.py"], "no such script: missing.py"),
        (["-m", "no_such_pkg.tool"], "-m no_such_pkg.tool: no module named 'no_such_pkg'"),
        (["-m", "json"], "-m json: 'json' is a package without a __main__ module"),
        (["-m"], "argument -m: expected one argument"),
        (["--policy", "loud", "x.py"], "argument --policy: invalid choice: 'loud'"),
        (["--pol", "warn", "x.py"], "unrecognized arguments: --pol"),
    ],
)
def test_run_mistakes_are_one_line(argv, needle, capsys):
    assert status(["run", *argv]) == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("graphsan run: error: ") and needle in err[0], err


def test_top_level_mistakes_are_one_line(capsys):
    for argv, needle in (([], "expected a command: run, report"), (["rnu"], "invalid choice")):
        assert status(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("graphsan: error: ") and needle in err[0]


# ----------------------------------------------------------------------------- graphsan report
def _saved_report(tmp_path) -> dict:
    from tests.test_plugin_and_ranks import finding

    path = tmp_path / "good.json"
    Report([finding(rank=0)], [{"id": 3, "nodes": 12}], rank=0, policy="record").save(str(path))
    return json.loads(path.read_text())


def _breakages():
    def finding(d):
        return d["findings"][0]

    return {
        "findings is not a list": (lambda d: d.update(findings={}), "findings is {}"),
        "a finding without its graph": (
            lambda d: finding(d).pop("graph"),
            "findings[0]: key 'graph' is missing",
        ),
        "an unknown kind": (
            lambda d: finding(d).update(kind="escaped"),
            "findings[0].kind is 'escaped'; expected one of freed, reowned",
        ),
        "an address as text": (
            lambda d: finding(d).update(address="0x10"),
            "findings[0].address is '0x10'; expected an integer",
        ),
        "a bad frame": (
            lambda d: finding(d).update(free_stack=[["train.py", "x", "f"]]),
            "findings[0].free_stack[0] is ['train.py', 'x', 'f']; expected [file, line, function]",
        ),
        "a bad capture site": (
            lambda d: finding(d)["graph"].update(capture_site="train.py:1"),
            "findings[0].graph.capture_site is 'train.py:1'; expected a list",
        ),
        "an unknown field": (
            lambda d: finding(d).update(colour="red"),
            "findings[0]: unknown key 'colour'",
        ),
        "a graph that is not a mapping": (lambda d: d.update(graphs=[3]), "graphs[0] is 3"),
        "a rank as text": (lambda d: d.update(rank="0"), "rank is '0'; expected an integer"),
        "pinned bytes as text": (
            lambda d: d.update(pinned={"bytes": "many"}),
            "pinned.bytes is 'many'",
        ),
        "also_used_by without a kernel": (
            lambda d: finding(d).update(
                also_used_by=[{"graph": 1, "label": "g", "node": 2, "param": 0, "offset": 8}]
            ),
            "findings[0].also_used_by[0]: key 'kernel' is missing",
        ),
    }


@pytest.mark.parametrize("broken", list(_breakages()))
def test_report_on_a_broken_file_names_the_file_and_what_is_wrong(tmp_path, capsys, broken):
    data = _saved_report(tmp_path)
    assert main(["report", str(tmp_path / "good.json")]) == 0
    capsys.readouterr()
    change, needle = _breakages()[broken]
    change(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"graphsan report: error: {path}: not a valid graphsan report: ")
    assert needle in err[0], err


def test_report_mistakes_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "list.json").write_text("[]")
    assert main(["report", str(tmp_path / "list.json")]) == 2
    (tmp_path / "trunc.json").write_text('{"schema": "graphsan.report", "vers')
    assert main(["report", str(tmp_path / "trunc.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(ln.startswith("graphsan report: error: ") for ln in err)
    assert status(["report"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_train_help_shows_the_defaults(capsys):
    assert status(["train", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for needle in (
        "--preset PRESET model preset: tiny, small, super (default: tiny)",
        "--lr LR AdamW learning rate (finite, >= 0) (default: 0.003)",
        "--train-iters TRAIN_ITERS training iterations (default: 20)",
        "--save SAVE checkpoint directory (default: out/checkpoints)",
        "--state-policy STATE_POLICY, --graph-state STATE_POLICY fixed | te218",
    ):
        assert needle in out, needle


def test_help_shows_a_default_of_zero():
    """argparse's `0 == False` once hid six defaults of `train` and two of `repro`."""
    import argparse

    from graphsan.command_line import DefaultsHelpFormatter

    p = argparse.ArgumentParser(prog="x", formatter_class=DefaultsHelpFormatter)
    p.add_argument("--jobs", type=int, default=0, help="processes")
    p.add_argument("--flag", action="store_true", help="a switch")
    text = p.format_help()
    assert "processes (default: 0)" in text and "a switch\n" in text


def test_environment_variables_are_checked_on_every_path(monkeypatch, capsys):
    """A typo in a container image's environment shows on the first command, CPU included."""
    monkeypatch.setenv("GRAPHSAN_NO_TRITON", "maybe")
    monkeypatch.setenv("GRAPHSAN_TRITON_VARIANT", "bogus")
    assert main(["report", "--sample", "stale-input"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "graphsan report: warning: GRAPHSAN_TRITON_VARIANT is set but graphsan reads no such "
        "variable (it reads GRAPHSAN_TRACELOG, GRAPHSAN_ATTACH, GRAPHSAN_NO_TRITON)",
        "graphsan report: error: GRAPHSAN_NO_TRITON='maybe': expected one of '1', 'true', "
        "'yes', 'on', empty, '0', 'false', 'no', 'off'",
    ]
    monkeypatch.setenv("GRAPHSAN_NO_TRITON", " ON ")
    monkeypatch.setenv("GRAPHSAN_TRACELOG", "maybe")
    assert main(["report", "--sample", "stale-input"]) == 2
    assert "GRAPHSAN_TRACELOG='maybe': expected one of empty, '0', '1'" in capsys.readouterr().err


def test_the_readme_lists_every_environment_variable():
    from graphsan.environment import VARIABLES

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme[readme.index("| variable | values | default | effect |") :]
    for var in VARIABLES:
        assert f"| `{var.name}` |" in table, var.name


@pytest.mark.parametrize(
    "event, needle",
    [
        ({"kind": "free"}, "events[0]: key 't' is missing"),
        ({"t": "noon", "kind": "free"}, "events[0].t is 'noon'; expected a number"),
        ({"t": 1.0, "kind": "explode"}, "events[0].kind is 'explode'; expected one of capture"),
    ],
)
def test_a_bad_event_is_one_line_not_a_crash_of_the_pages(tmp_path, capsys, event, needle):
    data = _saved_report(tmp_path)
    data["events"] = [event]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    for extra in ([], ["--html", str(tmp_path / "p.html")], ["--trace", str(tmp_path / "t.json")]):
        assert main(["report", str(path), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def test_the_report_format_document_is_rendered_from_the_schema():
    from graphsan.report import format_doc

    doc = Path(__file__).parent.parent / "docs" / "report-format.md"
    assert doc.read_text() == format_doc.markdown(), (
        "run: python -m graphsan.report.format_doc > docs/report-format.md"
    )


@pytest.mark.parametrize("argv", [["train", "--help"], ["repro", "--help"], ["repro", "--list"]])
def test_help_and_listings_start_without_importing_torch(argv):
    """Importing torch costs seconds; a newcomer asking for help should not wait for it."""
    code = (
        "import sys\nfrom graphsan.cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print('TORCH', 'torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "TORCH False", proc.stdout[-2000:]


# ----------------------------------------------------------------------------- big and odd inputs
def test_deeply_nested_json_is_one_line_not_a_recursion_traceback(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    data = _saved_report(tmp_path)
    nest: list = []
    for _ in range(900):  # within what the JSON reader follows, past what a report holds
        nest = [nest]
    data["graphs"][0]["extra"] = nest
    inner = tmp_path / "inner.json"
    inner.write_text(json.dumps(data))
    for path in (deep, inner):
        for extra in ([], ["--html", str(tmp_path / "p.html")]):
            assert main(["report", str(path), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == 2 * [
        f"graphsan report: error: {deep}: not a graphsan report (its JSON nests deeper than "
        "Python's JSON reader follows; a report nests at most 64 levels)"
    ] + 2 * [
        f"graphsan report: error: {inner}: not a valid graphsan report: graphs[0].extra"
        "[0][0][0][0][0][0][0][0][0][0][0][0][0][0]... nests deeper than 64 levels; expected at "
        "most 64"
    ]
    assert not (tmp_path / "p.html").exists()


def test_a_deeply_nested_suppression_file_is_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["report", "--sample", "stale-input", "--suppressions", str(deep)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"graphsan report: error: --suppressions {deep}: nested deeper than the YAML reader "
        "follows; expected a list of suppressions (- name: ...)"
    ]


@pytest.mark.parametrize(
    "argv",
    [["--sample", "te3316-case4"], ["--sample", "te3316-case4", "--html", "-"]],
    ids=["text", "page"],
)
def test_a_reader_that_leaves_early_ends_report_as_it_ends_cat(argv):
    """`graphsan report ... | head -1` exited 1, which the exit table says report never does;
    now 141 (128 + SIGPIPE), what a shell shows for `cat`, and nothing on stderr. The reader
    here leaves before the command writes anything: every write then meets the closed pipe."""
    proc = subprocess.Popen(
        [*CONSOLE, "report", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == ""


def test_an_unknown_variable_is_warned_about_once(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    env = dict(ENV, GRAPHSAN_FOO="1")
    proc = subprocess.run(
        [*CONSOLE, "run", str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    said = [ln for ln in proc.stderr.splitlines() if "GRAPHSAN_FOO" in ln]
    assert said == [
        "graphsan run: warning: GRAPHSAN_FOO is set but graphsan reads no such variable (it "
        "reads GRAPHSAN_TRACELOG, GRAPHSAN_ATTACH, GRAPHSAN_NO_TRITON)"
    ]


@pytest.mark.parametrize(
    "argv", [["run", "--help"], ["run", "-h", "x.py"], ["report", "--help"], ["selftest", "-h"]]
)
def test_help_holds_whatever_the_environment_says(monkeypatch, capsys, argv):
    monkeypatch.setenv("GRAPHSAN_TRACELOG", "7")
    assert status(argv) == 0
    out = capsys.readouterr()
    assert out.out.startswith("usage: graphsan ") and "GRAPHSAN_TRACELOG" not in out.err


def test_the_programs_own_help_still_needs_a_good_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHSAN_TRACELOG", "7")
    assert status(["run", str(tmp_path / "x.py"), "--help"]) == 2
    assert "GRAPHSAN_TRACELOG='7'" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--html", "--trace"])
def test_gen_suppressions_with_a_page_is_refused_not_dropped(tmp_path, capsys, option):
    out = tmp_path / "x.html"
    argv = ["report", "--sample", "stale-input", "--gen-suppressions", option, str(out)]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "graphsan report: error: --gen-suppressions prints suppression entries and exits; it "
        f"writes no page or trace (expected {option} in a run of its own)"
    ]
    assert not out.exists()


@pytest.mark.parametrize("path", ["/proc/x.html", "page.html"])
def test_repro_list_checks_its_page_path_and_says_it_draws_none(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    proc = subprocess.run(
        [*CONSOLE, "repro", "--list", "--html", path],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"graphsan repro: error: --html {path}: "), err
    if path == "page.html":
        assert err[0].endswith(
            "--list runs no case, so there is no matrix to draw (expected --html without --list)"
        )
    else:
        assert "cannot write in /proc" in err[0]
    assert os.listdir(tmp_path) == []


def test_report_refuses_a_source_root_that_is_nowhere(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["report", "--sample", "stale-input", "--source-root", "missingdir"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "graphsan report: error: --source-root missingdir: does not exist here, and no frame of "
        "the reports lies under it; expected the project's root folder (for another machine's "
        "report: the root as it was there)"
    ]
    (tmp_path / "afile").write_text("")
    assert main(["report", "--sample", "stale-input", "--source-root", "afile"]) == 2
    assert "--source-root afile: is not a folder" in capsys.readouterr().err


def test_the_page_and_trace_do_not_carry_the_folders_of_the_machine_that_drew_them(
    tmp_path, monkeypatch
):
    from graphsan.report.json_report import sample_path

    monkeypatch.chdir(tmp_path)
    assert main(["report", "--sample", "stale-input", "--html", "s.html", "--trace", "s.json"]) == 0
    samples = os.path.dirname(sample_path("stale-input"))
    for name in ("s.html", "s.json"):
        text = (tmp_path / name).read_text()
        assert samples not in text and "stale-input.json" in text, name
    (tmp_path / "runs").mkdir()
    Report(watched=True).save(str(tmp_path / "runs" / "r.json"))
    assert main(["report", str(tmp_path / "runs" / "r.json"), "--html", "r.html"]) == 0
    page = (tmp_path / "r.html").read_text()
    assert str(tmp_path) not in page and "runs/r.json" in page
