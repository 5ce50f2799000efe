"""The HTML report of thousands of distinct findings: every finding is counted, the table opens
with one row per kind and graph, the findings table lists up to LISTED rows, and only DETAILED
rows get a block of their own (the first row of each kind and graph first), so the page stays a
few megabytes; a graph's node list is on the page once, however many blocks name the graph.
In headless Chromium (tests/browser.py), a link to a row without a block lands on its row."""

from __future__ import annotations

import dataclasses
import re

from graphsan.report.pages import report_page
from graphsan.report.pages.report_page import DETAILED, render_report, report_view
from tests import scripts
from tests.browser import BROWSER, check_page, needs_browser, open_page, screenshot_path
from tests.test_report_pages import rank_report


def distinct(n: int):
    """bench/bench_report_page.py's report of `n` findings, each at a site of its own."""
    return scripts.bench("bench_report_page").synthetic_report(n, sites=n)


def test_five_thousand_distinct_findings_make_a_page_under_five_megabytes():
    html = render_report([distinct(5_000)], ["run.json"])
    assert len(html.encode()) < 5_000_000
    assert html.count('<article class="card finding"') == DETAILED
    assert len(re.findall(r'<tr class="finding-row" data-kind="[^"]+" id="finding-', html)) == (
        5_000 - DETAILED
    )
    assert "5,000 rows: 50 are detailed below" in html and "By kind and graph" in html


def test_the_first_row_of_each_kind_and_graph_gets_a_block_then_the_first_rows():
    report = distinct(400)
    view = report_view([report], ["run.json"])
    rows, details = view["findings"], view["details"]
    assert len(rows) == 400 and len(details) == DETAILED
    firsts = {}
    for row in rows:
        firsts.setdefault((row["kind"], row["graph_id"]), row["n"])
    detailed = {row["n"] for row in details}
    assert set(firsts.values()) <= detailed
    rest = sorted(detailed - set(firsts.values()))
    others = [row["n"] for row in rows if row["n"] not in firsts.values()]
    assert rest == others[: DETAILED - len(firsts)]  # then the first rows, in order
    # the groups count every row and finding, and name their nodes and free places
    groups = view["groups"]
    assert len(groups) == len(firsts) and sum(g["rows"] for g in groups) == 400
    assert sum(g["count"] for g in groups) == 400
    first = groups[0]
    assert first["nodes_text"] == "0, 8, 16" and first["more_sites"] == 50 - 3


def test_rows_past_the_listed_ones_are_counted_in_their_groups(monkeypatch):
    monkeypatch.setattr(report_page, "LISTED", 60)
    view = report_view([distinct(200)], ["run.json"])
    assert len(view["listed"]) == 60 and sum(g["rows"] for g in view["groups"]) == 200
    assert all(row["anchor"] is None for row in view["findings"][60:])
    # the timeline's marks link only to what is on the page
    hrefs = {m["href"] for m in view["overview"]["marks"] if m["href"]}
    assert hrefs and hrefs <= {f"#finding-{n}" for n in range(1, 61)}
    html = render_report([distinct(200)], ["run.json"])
    assert "the table lists the first 60 and counts the other 140 in the groups" in html


def test_a_page_of_few_findings_has_no_groups_and_details_every_row():
    view = report_view([rank_report(0)], ["out.json"])
    assert view["groups"] == [] and len(view["details"]) == len(view["findings"])
    assert "By kind and graph" not in render_report([rank_report(0)], ["out.json"])


def test_a_graphs_node_list_is_on_the_page_once_however_many_blocks_name_it():
    report = rank_report(0)
    first = report.findings[0]  # node 17 of mamba bwd's 22 listed nodes
    report.findings.append(dataclasses.replace(first, node=3, offset=first.offset + 8))
    html = render_report([report], ["out.json"])
    assert html.count("all 22 listed node(s) of graph #4</a>") == 2  # a link in each block
    assert html.count('<details class="node-list" id="nodes-0-4">') == 1
    assert html.count("'mamba bwd': all 22 listed node(s)") == 1


@needs_browser
def test_a_page_of_hundreds_of_distinct_findings_in_a_browser(tmp_path):
    html = tmp_path / "many.html"
    html.write_text(render_report([distinct(300)], ["run.json"]))
    shot = screenshot_path(tmp_path, "report-many-distinct.png")
    probes = {
        "target": "document.querySelector('tr:target') && document.querySelector('tr:target').id",
        "cards": "document.querySelectorAll('article.card').length",
        "overflow": "document.documentElement.scrollWidth - document.documentElement.clientWidth",
        # then following a link to a graph's node list (a hash change, as a click makes)
        "nodes_open": "location.hash = '#nodes-0-1', "
        "window.dispatchEvent(new HashChangeEvent('hashchange')), "
        "document.getElementById('nodes-0-1').open",
    }
    page = open_page(BROWSER, f"{html}#finding-250", shot, probes=probes, whole=False)
    check_page(page, ["By kind and graph", "300 rows: 50 are detailed below", "Each row"])
    assert page.values["target"] == "finding-250"  # the row itself: it has no block
    assert page.values["cards"] == DETAILED and page.values["overflow"] <= 0
    assert page.values["nodes_open"] is True  # a link to a graph's node list opens it
