"""CPU: suppression files (load, match, generate), applied by the sanitizer (a suppressed
finding never stops a replay and is counted), by `graphsan run`, `graphsan report` (with
--error-exitcode) and the pytest plugin."""

from __future__ import annotations

import dataclasses
import json

import pytest

from graphsan.cli.main import main
from graphsan.cuda import hooks
from graphsan.report import Report, suppressions
from tests.test_plugin_and_ranks import finding

pytest_plugins = ["pytester"]

FILE = """
- name: the known one
  kind: unmapped
  kernel: "*dequant*"
  alloc: "*quant/linear.py:120 in _alloc_*"
- name: never
  graph: "nothing*"
"""


def write(tmp_path, text=FILE):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return str(path)


def test_an_entry_matches_when_every_field_given_matches(tmp_path):
    entries = suppressions.load(write(tmp_path))
    f = finding()
    assert [s.name for s in entries if s.matches(f)] == ["the known one"]
    other = finding(kind="freed")
    assert not any(s.matches(other) for s in entries)
    kept, supp = suppressions.split(entries, [f, other])
    assert kept == [other] and supp == [("the known one", f)]
    assert suppressions.summary(supp) == "suppressed: 1 finding(s) (the known one: 1)"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "- name: x\n  kernal: k\n",
            "entry 1: unknown key 'kernal'; expected some of name, kind, kernel, graph, alloc, free",
        ),
        (
            "- name: only a name\n",
            "entry 1: matches every finding; expected at least one of kind, kernel",
        ),
        ("- kind: frede\n", "entry 1: kind 'frede' matches no kind; expected one of freed"),
        ("name: x\n", "expected a list of suppressions (- name: ...), not a mapping"),
        ("- [1, 2]\n", "entry 1 is [1, 2]; expected a mapping"),
        ("- kind: [unclosed\n", "not YAML (line 2); expected a list of suppressions"),
        ("- kind: 3\n", "entry 1: kind is 3; expected a non-empty string"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_entry(tmp_path, text, message):
    with pytest.raises(ValueError) as err:
        suppressions.load(write(tmp_path, text))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_generated_entries_suppress_the_findings_they_came_from(tmp_path):
    fs = [finding(), finding(kind="freed", node=3), finding()]
    text = suppressions.generate(fs)
    assert text.count("- name:") == 2  # the same entry once
    entries = suppressions.load(write(tmp_path, text))
    kept, supp = suppressions.split(entries, fs)
    assert kept == [] and len(supp) == 3


def test_findings_about_baked_state_match_by_entry_and_generate_their_own(tmp_path):
    def baked(kind, **fields):
        f = finding(kind=kind, node=-1)
        evidence = dataclasses.replace(f.baked, **fields)
        return dataclasses.replace(f, kernel="", alloc_stack=(), baked=evidence)

    mode = baked("mode", modules=("Net.block.0.drop", "Net.block.1.drop"))
    lr = baked("baked-value", entry="Adam.param_groups[0]['lr']")
    entries = suppressions.load(
        write(tmp_path, '- name: drops\n  entry: "Net.block.1.*"\n- name: lr\n  entry: "*lr*"\n')
    )
    assert [suppressions.first_match(entries, f).name for f in (mode, lr)] == ["drops", "lr"]
    assert suppressions.first_match(entries, finding()) is None  # names no entry: no match
    text = suppressions.generate([mode, lr])
    assert "kernel:" not in text and "entry: \"Adam.param_groups[[]0][[]'lr']\"" in text
    kept, supp = suppressions.split(suppressions.load(write(tmp_path, text)), [mode, lr])
    assert kept == [] and len(supp) == 2


def test_report_applies_suppressions_and_error_exitcode(tmp_path, capsys):
    path = tmp_path / "r.json"
    Report([finding(), finding(kind="freed")], rank=0).save(str(path))
    sfile = write(tmp_path)
    assert main(["report", str(path), "--error-exitcode", "7"]) == 7
    capsys.readouterr()
    assert main(["report", str(path), "--suppressions", sfile, "--error-exitcode", "7"]) == 7
    out = capsys.readouterr().out
    assert "1 finding(s)" in out and "suppressed: 1 finding(s) (the known one: 1)" in out
    everything = write(tmp_path, "- name: all\n  kind: '*'\n")
    assert main(["report", str(path), "--suppressions", everything, "--error-exitcode", "7"]) == 0
    capsys.readouterr()
    assert main(["report", str(path), "--gen-suppressions"]) == 0
    assert capsys.readouterr().out.startswith("# graphsan suppressions")
    assert main(["report", str(path), "--error-exitcode", "0"]) == 2
    assert main(["report", str(path), "--suppressions", str(tmp_path / "none.yaml")]) == 2
    assert "--suppressions" in capsys.readouterr().err


def test_suppressed_findings_round_trip_through_the_report(tmp_path):
    rep = Report([finding(kind="freed")], suppressed=[("known", finding())])
    path = tmp_path / "r.json"
    rep.save(str(path))
    back = Report.load(str(path))
    assert back.suppressed == rep.suppressed
    data = json.loads(path.read_text())
    data["suppressed"][0]["by"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"suppressed\[0\].by is 3; expected a string"):
        Report.load(str(path))


@pytest.mark.slow
def test_the_plugin_takes_suppressions_and_writes_a_report(pytester, tmp_path):
    pytester.makepyfile("def test_ok():\n    assert True\n")
    sfile = write(tmp_path)
    out = tmp_path / "run.json"
    result = pytester.runpytest_subprocess(
        "--graphsan=record", "--graphsan-suppressions", sfile, "--graphsan-report", str(out)
    )
    result.assert_outcomes(passed=1)
    assert json.loads(out.read_text())["schema"] == "graphsan.report"
    bad = pytester.runpytest_subprocess(
        "--graphsan=record", "--graphsan-suppressions", str(tmp_path / "no.yaml")
    )
    assert bad.ret != 0
    bad.stderr.fnmatch_lines(["*--graphsan-suppressions*cannot read the suppressions*"])


def test_a_suppressed_finding_never_stops_the_replay_and_is_counted(monkeypatch):
    from graphsan.report.suppressions import Suppression
    from tests import fake_cuda
    from tests.test_sanitizer_cpu import captured, free_block, snapshot

    env = fake_cuda.install(monkeypatch, "void scale(float*)", stream=1)
    san, g = captured(env, "raise")
    san.suppressions = [Suppression("scale's input", kernel="*scale*", free="* in evaluate")]
    state = hooks.graph_state(g)
    assert free_block(san)
    env["map"] = snapshot([(8192, "inactive")])
    san.before_replay(g, state)  # no StaleMemoryError: the one finding is suppressed
    san.before_replay(g, state)
    assert san.findings == [] and [name for name, _ in san.suppressed] == ["scale's input"]
    rep = san.report()
    assert rep.suppressed == san.suppressed and "suppressed: 1 finding(s)" in rep.render()


def test_run_reads_its_suppressions_before_the_program_starts(tmp_path, capsys):
    script = tmp_path / "prog.py"
    script.write_text("print('ran')\n")
    bad = write(tmp_path, "- name: x\n  kernal: k\n")
    assert main(["run", "--suppressions", bad, str(script)]) == 2
    err = capsys.readouterr()
    assert "ran" not in err.out and err.err.startswith("graphsan run: error: --suppressions ")
    assert main(["run", "--suppressions", write(tmp_path), str(script)]) == 0
    assert "ran" in capsys.readouterr().out
