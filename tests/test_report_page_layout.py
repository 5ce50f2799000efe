"""The HTML report's layout and scale: time axes with 4 to 8 round ticks, identical findings
folded into one row with their count, a page of 20,000 findings that stays small, and, in
headless Chromium at 1280 and 1920 px (tests/browser.py), pages whose tables fit the page and
whose timeline labels are not cut off. Without a Chromium the browser tests skip and say why.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from graphsan.cli.main import main
from graphsan.report import Report
from graphsan.report.json_report import sample_path
from graphsan.report.pages.report_page import render_report, report_view
from graphsan.report.pages.templating import breakable, nice_ticks
from tests import scripts
from tests.browser import BROWSER, check_page, needs_browser, open_page, screenshot_path
from tests.test_report_pages import rank_report

ROOT = Path(__file__).resolve().parent.parent

# every table's right edge within its container's content box (tables folded away have none)
TABLES_PAST_EDGE = """[...document.querySelectorAll("table")].filter(t => {
  const r = t.getBoundingClientRect(), p = t.parentElement, cs = getComputedStyle(p);
  const edge = p.getBoundingClientRect().right - parseFloat(cs.paddingRight)
    - parseFloat(cs.borderRightWidth);
  return r.width > 0 && r.right > edge + 0.5;
}).map(t => `${t.className || "table"} ends at ${t.getBoundingClientRect().right}`)"""
# every text of the timelines inside its SVG's drawing area
SVG_TEXT_CUT = """[...document.querySelectorAll("svg.overview text, svg.life-strip text")]
  .filter(t => { const b = t.getBBox(), w = t.ownerSVGElement.viewBox.baseVal.width;
                 return b.x < -0.5 || b.x + b.width > w + 0.5; })
  .map(t => t.textContent)"""
PAGE_OVERFLOW = "document.documentElement.scrollWidth - document.documentElement.clientWidth"
PROBES = {"tables": TABLES_PAST_EDGE, "svg_text": SVG_TEXT_CUT, "overflow": PAGE_OVERFLOW}


def bench_module():
    """bench/bench_report_page.py as a module (its synthetic reports)."""
    return scripts.bench("bench_report_page")


def assert_round_ticks(ticks: list[float], lo: float, hi: float) -> None:
    """4 to 8 values inside [lo, hi], evenly 1, 2, 2.5 or 5 times a power of ten apart, each
    a multiple of that spacing."""
    assert 4 <= len(ticks) <= 8, ticks
    tol = (hi - lo) * 1e-9
    assert lo - tol <= ticks[0] and ticks[-1] <= hi + tol, (lo, hi, ticks)
    gaps = [b - a for a, b in zip(ticks[:-1], ticks[1:], strict=True)]
    step = gaps[0]
    assert all(math.isclose(g, step, rel_tol=1e-6) for g in gaps), ticks
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 2.5, 5, 10)), ticks
    for t in ticks:
        assert math.isclose(t / step, round(t / step), abs_tol=1e-6), (t, step)


# ----------------------------------------------------------------------------- axis ticks
@pytest.mark.parametrize(
    "lo, hi",
    [(0, 26.255), (22.184, 26.255), (0, 1e-3), (0, 7.9), (0.3, 0.9), (0, 123456), (-3.2, 0.4)]
    + [(5.0, 5.0004), (1.0, 1000.0), (0, 1)],
)
def test_axis_ticks_are_four_to_eight_round_values(lo, hi):
    assert_round_ticks(nice_ticks(lo, hi), lo, hi)


def test_axis_ticks_of_an_empty_or_non_finite_range():
    assert nice_ticks(3.0, 3.0) == [3.0]
    assert nice_ticks(0.0, math.inf) == [] and nice_ticks(math.nan, 1.0) == []


def test_the_timelines_of_a_real_sample_have_round_ticks_on_the_page_clock():
    view = report_view([Report.load(sample_path("te3316-case4"))], ["sample"])
    axes = [view["overview"]["ticks"]] + [f["life"]["svg"]["ticks"] for f in view["findings"]]
    for ticks in axes:
        values = [float(t["label"].removeprefix("+").removesuffix(" s")) for t in ticks]
        assert_round_ticks(values, values[0], values[-1])
        assert [t["x"] for t in ticks] == sorted(t["x"] for t in ticks)


def test_paths_and_kernel_names_may_wrap_between_their_parts_only_escaped():
    assert str(breakable("lab/quant.py:3 in <module>")) == "lab/<wbr>quant.py:3 in &lt;module&gt;"
    assert str(breakable("at::native::k<float>")) == "at::<wbr>native::<wbr>k&lt;float&gt;"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_time_that_is_not_a_number_is_left_off_the_timelines(bad):
    rep = rank_report(0)
    rep.events.insert(0, {"t": bad, "kind": "release", "rank": 0, "site": "x.py:1 in f"})
    rep.findings[1] = dataclasses.replace(rep.findings[1], found_at=bad, freed_at=bad)
    view = report_view([rep], ["out.json"])
    xs = [m["x"] for m in view["overview"]["marks"]] + [t["x"] for t in view["overview"]["ticks"]]
    assert xs and all(math.isfinite(x) for x in xs)
    strip = view["findings"][1]["life"]["svg"]  # the capture's time is left to draw
    assert all(math.isfinite(m["x"]) for m in strip["marks"]) and strip["ticks"]
    assert_round_ticks([float(t["label"][1:-2]) for t in view["overview"]["ticks"]], 0, 6.1)


# ----------------------------------------------------------------------------- folding
def test_identical_findings_fold_into_one_row_with_their_count():
    rep = rank_report(0)
    first, other = rep.findings
    again = [dataclasses.replace(first, step=5 + k, found_at=first.found_at + k) for k in (1, 2, 3)]
    elsewhere = dataclasses.replace(again[0], free_stack=[("examples/other.py", 9, "drop")])
    moved = dataclasses.replace(first, offset=first.offset + 8)  # another argument: its own row
    rep.findings = [first, *again, elsewhere, other, moved]
    view = report_view([rep], ["out.json"])
    rows = view["findings"]
    counts = [(r["kind"], r["count"]) for r in rows]
    assert counts == [("unmapped", 5), ("reowned", 1), ("unmapped", 1)]
    assert view["folded"] and rows[2]["offset"] == first.offset + 8
    assert rows[0]["fold_when"] == "eval (no_grad), steps 5 to 8"
    assert (rows[0]["first"], rows[0]["last"]) == ("+6.000 s", "+9.000 s")
    assert rows[0]["free_sites"] == [
        "graphsan/lab/quant/linear.py:311 in release_weight_workspace",
        "examples/other.py:9 in drop",
    ]
    html = render_report([rep], ["out.json"])
    assert "<title>graphsan: 7 finding(s), rank 0</title>" in html
    assert "7 findings in 3 rows" in html and '<th class="num">count</th>' in html
    assert '<td class="num">5</td>' in html and "Found 5 times</strong>" in html


def test_a_page_without_repeats_has_no_count_column():
    html = render_report([rank_report(0)], ["out.json"])
    assert '<th class="num">count</th>' not in html and "Found " not in html


def test_twenty_thousand_findings_make_a_small_page():
    report = bench_module().synthetic_report(20_000, sites=16)
    html = render_report([report], ["run.json"])
    assert len(html.encode()) < 20_000_000
    assert "20,000 findings in 16 rows" in html and html.count('<td class="num">1,250</td>') == 16
    # the timeline draws a finding once per pixel of its lane, and says how many more are there
    assert html.count('class="ev-finding"') < 2_000 and "more at this point" in html


# ----------------------------------------------------------------------------- in a browser
def _sample_page(tmp_path) -> str:
    html = tmp_path / "sample.html"
    assert main(["report", "--sample", "te3316-case4", "--html", str(html)]) == 0
    return str(html)


def _ranks_page(tmp_path) -> str:
    html = tmp_path / "ranks.html"
    html.write_text(render_report([rank_report(0), rank_report(1, 0.02)], ["a.json", "b.json"]))
    return str(html)


def _long_names_page(tmp_path) -> str:
    """Two ranks, a freeing frame with a long path and function name, a long graph label."""
    folder = "/".join(["a_rather_long_folder_name"] * 6)
    frame = (f"/{folder}/checkpoint_and_workspace_release.py", 311, "release_the_weight_workspace")
    reports = []
    for rank in (0, 1):
        rep = rank_report(rank, 0.02 * rank)
        first = rep.findings[0]
        graph = dataclasses.replace(first.graph, label="model.decoder.layers.0.mixer.in_proj")
        rep.findings[0] = dataclasses.replace(first, free_stack=[frame], graph=graph)
        reports.append(rep)
    html = tmp_path / "long.html"
    html.write_text(render_report(reports, ["a.json", "b.json"]))
    return str(html)


@needs_browser
@pytest.mark.parametrize(
    "make, width",
    [(_sample_page, 1280), (_sample_page, 1920), (_ranks_page, 1280), (_long_names_page, 1280)],
)
def test_the_page_fits_its_width_in_a_browser(tmp_path, make, width):
    shot = screenshot_path(tmp_path, f"layout-{make.__name__.strip('_')}-{width}.png")
    page = open_page(BROWSER, make(tmp_path), shot, width=width, probes=PROBES)
    check_page(page, ["Findings", "Timeline", "phase", "allocator"])
    assert page.values["tables"] == []
    assert page.values["svg_text"] == []
    assert page.values["overflow"] <= 0


# the labels under each block's-life axis ("before", then the ticks) that run into each other
LIFE_AXIS_OVERLAP = """[...document.querySelectorAll("svg.life-strip")].flatMap(svg => {
  const texts = [...svg.querySelectorAll("text")];
  const low = Math.max(...texts.map(t => parseFloat(t.getAttribute("y"))));
  const axis = texts.filter(t => parseFloat(t.getAttribute("y")) === low)
    .map(t => ({text: t.textContent, box: t.getBBox()})).sort((a, b) => a.box.x - b.box.x);
  return axis.slice(1).filter((t, i) => t.box.x < axis[i].box.x + axis[i].box.width + 2)
    .map((t, i) => `${axis[i].text} / ${t.text}`);
})"""


@needs_browser
def test_the_life_axis_labels_do_not_overlap_in_a_browser(tmp_path):
    """The stale-input sample's first tick (+0.0412 s) sits 5 px right of the axis's start,
    where its centred label ran into "before"."""
    html = tmp_path / "stale.html"
    assert main(["report", "--sample", "stale-input", "--html", str(html)]) == 0
    page = open_page(BROWSER, str(html), None, probes={"overlap": LIFE_AXIS_OVERLAP})
    check_page(page, ["The block's life", "before"])
    assert page.values["overlap"] == []
