"""CPU: nothing graphsan writes can cost the user a file. Every output goes through one helper
(`graphsan.report.output.writing`: a temporary file beside the target, then a rename), so a
failed write leaves the old file whole and no temporary file behind; `run --report` refuses
the script itself and any existing file that is not a report; two outputs naming one file are
refused; the loader refuses NaN and infinities, naming the field; `-` is stdout where an
option takes it, and one line elsewhere."""

from __future__ import annotations

import ast
import json
import os
import stat
from pathlib import Path

import pytest

from graphsan.cli.main import main
from graphsan.report import Report
from graphsan.report.output import same_output, write_output, writing

ROOT = Path(__file__).resolve().parent.parent


def err_lines(capsys) -> list[str]:
    return [
        ln
        for ln in capsys.readouterr().err.strip().splitlines()
        if ln and not ln.startswith("graphsan: CUDA")
    ]


# ----------------------------------------------------------------------------- the helper
def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("the old report")
    with pytest.raises(RuntimeError), writing(str(path)) as fh:
        fh.write("half of the new")
        raise RuntimeError("the disk filled up")
    assert path.read_text() == "the old report"
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


def test_a_new_file_gets_the_umask_mode_and_an_old_one_keeps_its_mode(tmp_path):
    old_mask = os.umask(0o022)
    try:
        write_output(str(tmp_path / "new.html"), "<html>")
        kept = tmp_path / "kept.json"
        kept.write_text("{}")
        kept.chmod(0o640)
        write_output(str(kept), "{}\n")
    finally:
        os.umask(old_mask)
    assert stat.S_IMODE((tmp_path / "new.html").stat().st_mode) == 0o644
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and kept.read_text() == "{}\n"


def test_a_link_keeps_pointing_at_the_file_it_named(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_output(str(link), "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_dash_is_stdout(capsys):
    write_output("-", "to the terminal\n")
    assert capsys.readouterr().out == "to the terminal\n"


def test_same_output_follows_spellings_and_links(tmp_path):
    (tmp_path / "a").write_text("")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert same_output({"--html": str(tmp_path / "a"), "--trace": str(tmp_path / "b")}) == (
        "--html",
        "--trace",
    )
    assert same_output({"--html": "-", "--trace": "-"}) == ("--html", "--trace")
    assert same_output({"--html": "x", "--trace": None}) is None


def test_a_report_save_that_fails_keeps_the_previous_report(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    Report(rank=1).save(str(path))
    before = path.read_text()

    def dump(data, fh, **kw):
        fh.write('{"schema": "graphsan.report", "vers')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", dump)
    with pytest.raises(OSError):
        Report(rank=2).save(str(path))
    assert path.read_text() == before and os.listdir(tmp_path) == ["r.json"]


# the modules that write what users keep: none opens a file for writing or renames one itself
WRITERS = [
    "src/graphsan/report",
    "src/graphsan/cli",
    "src/graphsan/selftest/runner.py",
    "src/graphsan/lab/repro/cli.py",
    "src/graphsan/lab/repro/child.py",
]


def _writes_itself(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        modes = [a for a in node.args[1:2] if isinstance(a, ast.Constant)]
        modes += [k.value for k in node.keywords if k.arg == "mode"]
        writes = any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax") for m in modes)
        if name in ("os.replace", "os.rename", "shutil.move") or (name == "open" and writes):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return out


def test_every_output_goes_through_the_one_helper():
    files = []
    for entry in WRITERS:
        p = ROOT / entry
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    found = [hit for f in files if f.name != "output.py" for hit in _writes_itself(f)]
    assert found == [], "write through graphsan.report.output.writing instead"


# ----------------------------------------------------------------------------- graphsan run
@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    return path


def test_run_refuses_to_write_the_report_over_its_own_script(script, tmp_path, capsys):
    before = script.read_text()
    for spelling in (str(script), os.path.join(str(tmp_path), ".", "train.py")):
        assert main(["run", "--report", spelling, str(script)]) == 2
        assert err_lines(capsys) == [
            f"graphsan run: error: --report {spelling}: that is the script being run; writing "
            "the report would replace it (expected another path)"
        ]
    assert script.read_text() == before and not (tmp_path / "ran").exists()


@pytest.mark.parametrize("content", [b"print('a module')\n", b"\x1f\x8b\x08garbage", b"[1, 2]"])
def test_run_refuses_an_existing_file_that_is_not_a_report(script, tmp_path, capsys, content):
    other = tmp_path / "notes.json"
    other.write_bytes(content)
    assert main(["run", "--report", str(other), str(script)]) == 2
    assert err_lines(capsys) == [
        f"graphsan run: error: --report {other}: the file exists and is not a graphsan report; "
        "writing the report would replace it (expected a new path, or a report to overwrite)"
    ]
    assert other.read_bytes() == content and not (tmp_path / "ran").exists()


@pytest.mark.parametrize("existing", ["empty", "report", "gzipped report"])
def test_run_replaces_an_empty_file_or_an_old_report(script, tmp_path, capsys, existing):
    import gzip

    path = tmp_path / "out.json"
    if existing == "empty":
        path.write_text("")
    else:
        Report(rank=5).save(str(path))
        if existing == "gzipped report":
            path.write_bytes(gzip.compress(path.read_bytes()))
    assert main(["run", "--policy", "record", "--report", str(path), str(script)]) == 0
    assert Report.load(str(path)).policy == "record" and (tmp_path / "ran").exists()


def test_run_refuses_stdout_for_the_report(script, capsys):
    assert main(["run", "--report", "-", str(script)]) == 2
    assert err_lines(capsys) == [
        "graphsan run: error: --report -: this output cannot go to stdout; expected a file path"
    ]


# ----------------------------------------------------------------------------- graphsan report
@pytest.fixture
def report_file(tmp_path) -> str:
    path = tmp_path / "r.json"
    Report(watched=True).save(str(path))
    return str(path)


def test_html_and_trace_naming_one_file_are_refused(report_file, tmp_path, capsys):
    (tmp_path / "page.html").write_text("kept")
    (tmp_path / "alias.html").symlink_to(tmp_path / "page.html")
    pairs = [
        ("x.html", "x.html"),
        (str(tmp_path / "page.html"), str(tmp_path / "alias.html")),
        (
            str(tmp_path / "page.html"),
            os.path.join(str(tmp_path), "..", tmp_path.name, "page.html"),
        ),
    ]
    for html, trace in pairs:
        assert main(["report", "--html", html, "--trace", trace, report_file]) == 2
        assert err_lines(capsys) == [
            f"graphsan report: error: --html {html} and --trace {trace} name the same file; the "
            "trace would replace the page (expected two paths)"
        ]
    assert (tmp_path / "page.html").read_text() == "kept" and not os.path.exists("x.html")
    assert main(["report", "--html", "-", "--trace", "-", report_file]) == 2
    assert err_lines(capsys) == [
        "graphsan report: error: --html - and --trace - both write to stdout (expected one of "
        "them there)"
    ]


@pytest.mark.parametrize("option", ["--html", "--trace"])
def test_report_pages_go_to_stdout_with_dash(report_file, capsys, option):
    assert main(["report", option, "-", report_file]) == 0
    out = capsys.readouterr()
    if option == "--html":
        assert out.out.startswith("<!DOCTYPE html>")
    else:
        assert json.loads(out.out)["traceEvents"]
    assert "written to stdout" in out.err


def test_selftest_json_goes_to_stdout_with_dash(capsys):
    assert main(["selftest", "--list", "-k", "optim/", "--json", "-"]) == 0
    out = capsys.readouterr()
    listed = json.loads(out.out)
    assert listed and all("optim/" in r["name"] for r in listed)
    assert out.err.strip().endswith("runs listed in stdout")


def test_repro_refuses_stdout_for_its_page(capsys):
    with pytest.raises(SystemExit) as stop:  # the option's check ends the parse
        main(["repro", "--html", "-", "--list"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--html -: this page cannot go to stdout here" in err[0]


# ----------------------------------------------------------------------------- the loader
@pytest.mark.parametrize(
    ("literal", "where", "shown"),
    [
        ("NaN", "events[0].t", "NaN"),
        ("Infinity", "events[0].t", "Infinity"),
        ("-Infinity", "events[0].t", "-Infinity"),
        ("1e400", "events[0].t", "Infinity"),
    ],
)
def test_non_finite_numbers_are_refused_naming_the_field(tmp_path, capsys, literal, where, shown):
    data = Report(watched=True).to_dict()
    data["events"] = [{"t": 12345.5, "kind": "phase", "phase": "train", "step": 1}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data).replace("12345.5", literal))
    for extra in ([], ["--html", str(tmp_path / "p.html")], ["--trace", str(tmp_path / "t.json")]):
        assert main(["report", str(path), *extra]) == 2
        assert err_lines(capsys) == [
            f"graphsan report: error: {path}: not a valid graphsan report: {where} is {shown}; "
            "expected a finite number"
        ]
    assert not (tmp_path / "p.html").exists() and not (tmp_path / "t.json").exists()


def test_a_non_finite_number_in_a_free_form_field_is_refused_too(tmp_path):
    data = Report(watched=True).to_dict()
    data["graphs"] = [{"id": 1, "analysis_ms_by_stage": {"walk": 1.0}}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data).replace("1.0", "NaN"))
    with pytest.raises(ValueError, match=r"graphs\[0\]\.analysis_ms_by_stage\.walk is NaN"):
        Report.load(str(path))
