"""CPU: a report says whether graphsan watched and what recorded it (report schema v7). An idle
run (no CUDA, an allocator it cannot read, an internal error before any graph) never reads as
clean: `graphsan report` says NOT WATCHED in its header, the HTML page shows a neutral "not
watched" banner instead of a green "No findings", and `--error-exitcode` fails it unless
`--allow-idle` is given. No page says a report is old when it is current."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphsan.cli.main import main
from graphsan.report import SCHEMA_VERSION, Report
from graphsan.report.pages import write_report_outputs
from graphsan.report.pages.report_page import render_report
from graphsan.runtime import sanitizer
from tests import fake_cuda
from tests.browser import BROWSER, check_page, needs_browser, open_page, screenshot_path

PROVENANCE = {
    "graphsan": "0.1.0",
    "commit": "0123456789abcdef0123456789abcdef01234567",
    "torch": "2.13.0+cu130",
    "cuda": "13.0",
    "driver": "580.65.06",
    "gpu": "NVIDIA H100 80GB HBM3",
    "python": "3.12.3",
}


def idle_report(reason: str = "CUDA is not available") -> Report:
    return Report(watched=False, disabled_reason=reason, provenance=dict(PROVENANCE))


def saved(tmp_path, report: Report, name: str = "r.json") -> str:
    path = tmp_path / name
    report.save(str(path))
    return str(path)


def stop_quietly(san) -> None:
    """start() never ran: nothing of the CUDA side to undo when an internal error stops it."""
    san.hooks.uninstall = lambda: None
    san.memory.stop = lambda: None
    san.context.stop = lambda: None


# ----------------------------------------------------------------------------- the sanitizer
def test_without_cuda_the_report_says_nothing_was_watched_and_why(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    san = sanitizer.Sanitizer("raise").start()
    rep = san.report()
    assert rep.watched is False and rep.idle and rep.disabled_reason == "CUDA is not available"
    assert rep.provenance["torch"] == torch.__version__ and rep.provenance["python"]
    assert "stays idle" in capsys.readouterr().err


def test_an_internal_error_before_any_graph_leaves_the_report_idle(capsys):
    san = sanitizer.Sanitizer("raise")
    san.active = san.watched = True  # as start() leaves it
    stop_quietly(san)
    san._internal_error(RuntimeError("no driver entry point"))
    rep = san.report()
    assert rep.idle and "no driver entry point" in rep.disabled_reason
    assert "disables itself" in capsys.readouterr().err


def test_an_internal_error_after_a_graph_is_a_partial_watch(monkeypatch, capsys):
    env = fake_cuda.install(monkeypatch, "void scale(float*)", stream=1)

    class Graph:
        def pool(self):
            return (1, 3)

    san = fake_cuda.started(env, "raise", hooks=False)
    san.watched = True
    g = Graph()
    san.capture_begin(g, None)
    san.after_capture_end(g, san.before_capture_end(g))
    stop_quietly(san)
    san._internal_error(RuntimeError("walk failed"))
    rep = san.report()
    assert rep.watched is True and not rep.idle and "walk failed" in rep.disabled_reason
    assert "watched until graphsan disabled itself" in rep.render().splitlines()[1]


def test_a_sanitizer_never_started_reports_that_it_was_not(capsys):
    rep = sanitizer.Sanitizer("record").report()
    assert rep.idle and "not started" in rep.disabled_reason


# ----------------------------------------------------------------------------- the JSON
def test_watched_reason_and_provenance_round_trip(tmp_path):
    path = saved(tmp_path, idle_report())
    data = json.loads(Path(path).read_text())
    assert data["version"] == SCHEMA_VERSION == 10
    assert data["watched"] is False and data["provenance"] == PROVENANCE
    back = Report.load(path)
    assert back.idle and back.disabled_reason == "CUDA is not available"
    assert back.provenance == PROVENANCE and back.loaded_version == 10


def test_a_report_from_before_v7_is_neither_idle_nor_said_to_have_provenance(tmp_path):
    path = tmp_path / "v6.json"
    data = Report().to_dict()
    for key in ("watched", "disabled_reason", "provenance"):
        del data[key]
    path.write_text(json.dumps(dict(data, version=6)))
    rep = Report.load(str(path))
    assert rep.watched is None and not rep.idle and rep.loaded_version == 6
    assert rep.header() == ["recorded with: not recorded (report schema v6 predates it)"]


def test_an_unknown_provenance_field_is_one_line(tmp_path, capsys):
    path = tmp_path / "r.json"
    data = idle_report().to_dict()
    data["provenance"]["hostname"] = "gpu-node-7"
    path.write_text(json.dumps(data))
    assert main(["report", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "provenance: unknown key 'hostname'" in line


# ----------------------------------------------------------------------------- graphsan report
def test_report_says_not_watched_and_what_recorded_it_in_its_header(tmp_path, capsys):
    assert main(["report", saved(tmp_path, idle_report())]) == 0
    head = capsys.readouterr().out.splitlines()
    assert head[0].startswith("graphsan report: 0 graph(s)")
    assert head[1].startswith("NOT WATCHED: graphsan stayed idle (CUDA is not available)")
    assert head[2] == (
        "recorded with graphsan 0.1.0 (git 0123456789ab), torch 2.13.0+cu130, CUDA runtime "
        "13.0, driver 580.65.06, GPU NVIDIA H100 80GB HBM3, Python 3.12.3"
    )


def test_merged_reports_name_the_idle_rank(tmp_path, capsys):
    watched = Report(rank=0, watched=True, provenance=PROVENANCE)
    idle = Report(rank=1, watched=False, disabled_reason="CUDA is not available")
    paths = [saved(tmp_path, watched, "r0.json"), saved(tmp_path, idle, "r1.json")]
    assert main(["report", *paths]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("graphsan: 2 report(s)")
    assert out[1].startswith("rank 1: NOT WATCHED: graphsan stayed idle (CUDA is not available)")
    assert out[2].startswith("rank 0: recorded with graphsan 0.1.0")
    assert out[3] == "rank 1: recorded with: not recorded"


@pytest.mark.parametrize(
    ("report", "extra", "status"),
    [
        (idle_report(), [], 9),
        (idle_report(), ["--allow-idle"], 0),
        (Report(watched=True), [], 0),
        (Report(watched=True, disabled_reason="internal error: x"), [], 0),
        (Report(), [], 0),  # not recorded: as before schema v7
    ],
    ids=["idle", "idle allowed", "watched", "partial", "not recorded"],
)
def test_error_exitcode_fails_an_idle_report_unless_allowed(
    tmp_path, capsys, report, extra, status
):
    path = saved(tmp_path, report)
    assert main(["report", "--error-exitcode", "9", *extra, path]) == status
    err = capsys.readouterr().err.strip().splitlines()
    if status:
        assert err == [
            f"graphsan report: {path}: graphsan watched nothing (CUDA is not available); "
            "exit 9 (--allow-idle accepts it)"
        ]
    else:
        assert err == []


def test_an_idle_report_fails_the_html_run_too(tmp_path):
    page = tmp_path / "p.html"
    path = saved(tmp_path, idle_report())
    assert main(["report", "--error-exitcode", "3", "--html", str(page), path]) == 3
    assert page.exists()


# ----------------------------------------------------------------------------- the pages
def test_the_page_of_an_idle_report_is_neutral_not_green():
    html = render_report([idle_report()], ["r.json"])
    assert "Not watched" in html and "graphsan stayed idle: CUDA is not available." in html
    assert 'class="badge-ok"' not in html and "this is not a clean result" in html
    assert "schema v3" not in html
    assert "<title>graphsan: not watched, r.json</title>" in html


def test_a_watched_clean_report_stays_green_without_a_banner():
    html = render_report([Report(watched=True)], ["r.json"])
    assert 'class="badge-ok"' in html and "Not watched" not in html
    assert "schema v3" not in html and "No events were recorded." in html


def test_an_idle_rank_and_a_partial_one_are_named_and_the_clean_badge_is_neutral():
    reports = [
        Report(rank=0, watched=True),
        Report(rank=1, watched=False, disabled_reason="x y"),
        Report(rank=2, watched=True, disabled_reason="internal error: z"),
    ]
    html = render_report(reports, ["a.json", "b.json", "c.json"])
    assert "Not watched: 1 of 3 reports" in html and "<li>rank 1: x y</li>" in html
    assert "rank 2: graphsan disabled itself (internal error: z)" in html
    assert 'class="badge-ok"' not in html and "1 not watched (above)" in html


def test_only_a_report_older_than_v3_is_said_to_be_older(tmp_path):
    old = Report()
    old.loaded_version = 2
    html = render_report([old], ["old.json"])
    assert "These reports hold no times (written before report schema v3)." in html
    for rep, why in ((old, "written before report schema v3"), (idle_report(), "nothing was")):
        said = write_report_outputs([rep], ["r.json"], trace=str(tmp_path / "t.json"))
        assert why in said[-1] and said[-1].endswith("the trace has only its tracks")
    said = write_report_outputs([Report(watched=True)], ["r.json"], trace=str(tmp_path / "t.json"))
    assert "schema" not in " ".join(said) and "these reports hold no events" in said[-1]


@needs_browser
def test_an_idle_report_in_a_browser(tmp_path):
    page_path = tmp_path / "idle.html"
    assert main(["report", "--html", str(page_path), saved(tmp_path, idle_report())]) == 0
    shot = screenshot_path(tmp_path, "report-idle.png")
    page = open_page(BROWSER, str(page_path), shot)
    check_page(
        page,
        [
            "Not watched",
            "graphsan stayed idle: CUDA is not available.",
            "No findings, and nothing was watched: this is not a clean result.",
            "GPU NVIDIA H100 80GB HBM3",
        ],
    )
    assert "No findings:" not in page.text and "schema v3" not in page.text
