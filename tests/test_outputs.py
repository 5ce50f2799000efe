"""CPU: nothing graphsan writes can cost the user a file. Every output goes through one helper
(`graphsan.report.output.writing`: a temporary file beside the target, then a rename), so a
failed write leaves the old file whole and no temporary file behind; a FIFO or a character
device is written in place, never replaced; a relative path is resolved where the command
started; a full disk is one line and exit 6 (a failing pytest run for the plugin); `run
--report`, `selftest --json` and `repro --json` refuse the script itself and any existing file
that is not their own output; two outputs naming one file are refused; the loader refuses NaN
and infinities, naming the field; `-` is stdout where an option takes it, and one line
elsewhere."""

from __future__ import annotations

import ast
import contextlib
import errno
import json
import os
import select
import stat
import threading
from pathlib import Path

import pytest

from graphsan.cli.main import main
from graphsan.report import Report
from graphsan.report.output import same_output, write_output, writing

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["pytester"]


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
    assert main(["repro", "--html", "-", "--list"]) == 2
    assert err_lines(capsys) == [
        "graphsan repro: error: --html -: the page cannot go to stdout; expected a file path"
    ]


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


# ----------------------------------------------------------------------------- special files
def _writers(tmp_path) -> dict:
    """Each writer of graphsan, as a function of the output path: its exit status."""
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    report = tmp_path / "in.json"
    Report(watched=True).save(str(report))
    return {
        "run --report": lambda out: main(["run", "--report", out, str(script)]),
        "report --html": lambda out: main(["report", "--html", out, str(report)]),
        "report --trace": lambda out: main(["report", "--trace", out, str(report)]),
        "selftest --json": lambda out: main(["selftest", "--list", "-k", "optim/", "--json", out]),
        "repro --json": lambda out: main(["repro", "--list", "--json", out]),
    }


WRITERS_BY_NAME = ["run --report", "report --html", "report --trace"]
WRITERS_BY_NAME += ["selftest --json", "repro --json"]


def _char_device(path: Path) -> None:
    """A character device like /dev/null at `path` (root only: mknod), or skip."""
    if os.geteuid() != 0:
        pytest.skip("mknod needs root: the FIFO variant stands for this writer")
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    try:
        os.close(os.open(path, os.O_WRONLY))
    except OSError as err:  # a filesystem mounted nodev
        pytest.skip(f"this filesystem refuses device nodes ({err.strerror})")


@contextlib.contextmanager
def _fifo_reader(path: Path):
    """A FIFO at `path`, drained by a thread while the block runs; yields a list that holds what
    was read once the block ends. The read end is open (non-blocking) before the writer comes,
    so a writer that opens the FIFO never waits, and one that never does blocks nothing."""
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    got: list[bytes] = []
    done = threading.Event()

    def drain():
        while True:
            select.select([fd], [], [], 0.05)
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if chunk:
                got.append(chunk)
            elif done.is_set():  # no writer any more, and the writer has finished
                return

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    out: list[bytes] = []
    try:
        yield out
    finally:
        done.set()
        reader.join()
        os.close(fd)
        out.append(b"".join(got))


@pytest.mark.parametrize("writer", WRITERS_BY_NAME)
def test_a_character_device_is_written_in_place_never_replaced(tmp_path, capsys, writer):
    """`graphsan run --report /dev/null x.py`, run as root, once deleted /dev/null."""
    dev = tmp_path / "mynull"
    _char_device(dev)
    assert _writers(tmp_path)[writer](str(dev)) == 0
    assert stat.S_ISCHR(os.stat(dev).st_mode) and os.stat(dev).st_rdev == os.makedev(1, 3)
    assert sorted(os.listdir(tmp_path)) == ["hello.py", "in.json", "mynull"]


@pytest.mark.parametrize("writer", WRITERS_BY_NAME)
def test_a_fifo_is_written_in_place_never_replaced(tmp_path, capsys, writer):
    fifo = tmp_path / "pipe"
    with _fifo_reader(fifo) as got:
        assert _writers(tmp_path)[writer](str(fifo)) == 0
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert got[0].lstrip()[:1] in (b"{", b"[", b"<")  # the output came through the FIFO
    assert sorted(os.listdir(tmp_path)) == ["hello.py", "in.json", "pipe"]


def test_the_plugin_writes_a_fifo_in_place(pytester):
    pytester.makepyfile("def test_ok():\n    pass\n")
    fifo = pytester.path / "pipe"
    with _fifo_reader(fifo) as got:
        result = pytester.runpytest("--graphsan=record", "--graphsan-report", str(fifo))
    assert result.ret == 0 and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert json.loads(got[0])["schema"] == "graphsan.report"


def test_a_block_device_or_a_socket_is_refused_in_one_line(tmp_path, capsys):
    import socket

    sock_path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        assert main(["report", "--sample", "stale-input", "--html", str(sock_path)]) == 2
    finally:
        sock.close()
    assert err_lines(capsys) == [
        f"graphsan report: error: --html {sock_path}: is a socket; expected a regular file, a "
        "FIFO or a character device"
    ]
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)


def test_the_writer_itself_refuses_what_it_cannot_write_in_place(tmp_path):
    import socket

    sock_path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    try:
        with pytest.raises(OSError, match="is a socket; expected a regular file"):
            write_output(str(sock_path), "x")
    finally:
        sock.close()
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)


# ----------------------------------------------------------------------------- the caller's folder
def test_run_writes_the_report_where_it_started_whatever_folder_the_program_moves_to(
    tmp_path, monkeypatch, capsys
):
    """Hydra apps change folder by default: the report once went to other/keep.txt, a text
    file the guard had not looked at."""
    (tmp_path / "other").mkdir()
    kept = tmp_path / "other" / "keep.txt"
    kept.write_text("notes\n")
    (tmp_path / "s.py").write_text("import os\nos.chdir('other')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--policy", "record", "--report", "keep.txt", "s.py"]) == 0
    assert kept.read_text() == "notes\n"
    assert Report.load(str(tmp_path / "keep.txt")).policy == "record"
    assert "graphsan: report written to keep.txt" in capsys.readouterr().err


def test_output_paths_are_resolved_once_in_the_current_folder(tmp_path, monkeypatch):
    from graphsan.report.output import output_path

    monkeypatch.chdir(tmp_path)
    assert output_path("out.json") == str(tmp_path / "out.json") and output_path("-") == "-"


# ----------------------------------------------------------------------------- a full disk
@pytest.fixture
def full_disk(monkeypatch):
    """Every file graphsan writes fails as on a full disk (when its data reaches the disk)."""

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)


def _no_temporary(folder) -> bool:
    return not [name for name in os.listdir(folder) if name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["selftest", "--list", "-k", "optim/", "--json"], "--json"),
        (["repro", "--list", "--json"], "--json"),
        (["report", "--sample", "stale-input", "--html"], "--html"),
        (["report", "--sample", "stale-input", "--trace"], "--trace"),
    ],
)
def test_a_full_disk_is_one_line_and_exit_6(tmp_path, capsys, full_disk, argv, option):
    out = str(tmp_path / "out.json")
    assert main([*argv, out]) == 6
    command = argv[0]
    lines = [ln for ln in err_lines(capsys) if "error" in ln]
    assert lines == [
        f"graphsan {command}: error: {option} {out}: cannot write (No space left on device)"
    ]
    assert os.listdir(tmp_path) == []


def test_run_on_a_full_disk_prints_the_report_instead_and_exits_6(tmp_path, capsys, full_disk):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    out = tmp_path / "out.json"
    assert main(["run", "--report", str(out), str(script)]) == 6
    err = err_lines(capsys)
    assert err[0] == (
        f"graphsan run: error: could not write the report to {out} (No space left on device); "
        "here it is instead:"
    )
    assert err[1].startswith("graphsan report: 0 graph(s)")
    assert sorted(os.listdir(tmp_path)) == ["hello.py"]


def test_the_plugin_on_a_full_disk_fails_the_pytest_run(pytester, full_disk):
    """It once said so and exited 0: CI passed without a report."""
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest("--graphsan=record", "--graphsan-report", "out.json")
    assert result.ret == 6
    said = [ln for ln in result.outlines if "could not write" in ln]
    assert said == [
        "graphsan: error: could not write the report to out.json (No space left on device)"
    ]
    assert _no_temporary(pytester.path) and not (pytester.path / "out.json").exists()


def test_the_plugin_keeps_a_failing_runs_own_status(pytester, full_disk):
    pytester.makepyfile("def test_bad():\n    assert False\n")
    result = pytester.runpytest("--graphsan=record", "--graphsan-report", "out.json")
    assert result.ret == 1 and _no_temporary(pytester.path)


# ----------------------------------------------------------------------------- what is replaced
@pytest.mark.parametrize("command", ["selftest", "repro"])
@pytest.mark.parametrize("content", ["notes\n", "graphsan report"])
def test_selftest_and_repro_json_refuse_a_file_that_is_not_their_own(
    tmp_path, capsys, command, content
):
    path = tmp_path / "out.json"
    if content == "graphsan report":
        Report(watched=True).save(str(path))
    else:
        path.write_text(content)
    before = path.read_bytes()
    argv = ["selftest", "--list", "-k", "optim/"] if command == "selftest" else ["repro", "--list"]
    assert main([*argv, "--json", str(path)]) == 2
    assert err_lines(capsys) == [
        f"graphsan {command}: error: --json {path}: the file exists and is not graphsan "
        f"{command}'s JSON; writing the JSON would replace it (expected a new path, or an earlier "
        f"{command} JSON to overwrite)"
    ]
    assert path.read_bytes() == before


@pytest.mark.parametrize("command", ["selftest", "repro"])
def test_selftest_and_repro_json_replace_an_empty_file_or_their_own(tmp_path, capsys, command):
    path = tmp_path / "out.json"
    path.write_text("")
    argv = ["selftest", "--list", "-k", "optim/"] if command == "selftest" else ["repro", "--list"]
    assert main([*argv, "--json", str(path)]) == 0
    first = json.loads(path.read_text())
    assert main([*argv, "--json", str(path)]) == 0
    assert json.loads(path.read_text()) == first and first


def test_selftest_results_are_their_own_too(tmp_path):
    from graphsan.selftest.runner import is_selftest_json, to_json, write_json

    path = tmp_path / "results.json"
    write_json(str(path), to_json([], {"torch": "x", "gpu": "y", "seconds": 1.0}))
    assert is_selftest_json(str(path))


def test_repro_results_are_their_own_too(tmp_path):
    from graphsan.lab.repro.cases import CASES
    from graphsan.lab.repro.cli import is_repro_json

    path = tmp_path / "results.json"
    rows = [{"case": CASES[0].to_json(), "result": {"outcome": "trained"}}]
    write_output(str(path), json.dumps(rows, indent=1) + "\n")
    assert is_repro_json(str(path))
