"""The matrix page of `graphsan repro --html` as a person sees it: its view of crashes, stopped
replays, silent corruption and a fix that trains through, and the page in headless Chromium
(tests/browser.py; skipped, with the reason, where no Chromium is installed)."""

from __future__ import annotations

import math

from graphsan.report import short_kernel
from graphsan.report.pages.matrix import matrix_view, render_matrix
from tests.browser import BROWSER, check_page, needs_browser, open_page, screenshot_path
from tests.test_report_pages import GEMM


def matrix_entries() -> list[dict]:
    """Synthetic `graphsan repro --json` output: a crash, a stopped replay, silent corruption
    against the eager reference, a fix that trains through, and a case with no losses."""
    ref = [10.4, 9.8, 9.1, 8.7, 8.3, 8.0, 7.8]
    ref_eval = [[5, 8.6]]

    from graphsan.lab.repro import CASES

    def case(n):
        return CASES[n - 1].to_json()  # as `graphsan repro --json` writes it

    return [
        {
            "case": case(1),
            "result": {
                "outcome": "illegal memory access",
                "iteration": 6,
                "losses": [],
                "symptom": "CUDA error: an illegal memory access was encountered",
                "matched": True,
                "wall_s": 41.0,
            },
        },
        {
            "case": case(4),
            "result": {
                "outcome": "StaleMemoryError",
                "iteration": 6,
                "losses": [],
                "finding": f"unmapped: mamba bwd node 17 {short_kernel(GEMM)} param 0+40",
                "matched": True,
                "wall_s": 38.0,
            },
        },
        {
            "case": case(5),
            "result": {
                "outcome": "silent corruption",
                "iteration": 6,
                "losses": [10.4, 9.8, 9.1, 8.7, 8.3, 900.0, float("nan")],
                "eval_losses": [[5, 8.6]],
                "reference_losses": ref,
                "reference_eval_losses": ref_eval,
                "comparison": "loss vs eager: max rel diff 3.0e-04 up to validation, inf after",
                "matched": True,
                "wall_s": 44.0,
            },
        },
        {
            "case": case(6),
            "result": {
                "outcome": "trained through",
                "iteration": None,
                "losses": [10.4, 9.8, 9.1, 8.7, 8.3, 8.01, 7.79],
                "eval_losses": [[5, 8.6]],
                "reference_losses": ref,
                "reference_eval_losses": ref_eval,
                "matched": False,
                "wall_s": 45.0,
            },
        },
    ]


def test_the_matrix_view_marks_validation_failure_and_nan():
    view = matrix_view(matrix_entries())
    crash, stopped, corrupt, fixed = view["plots"]
    # no losses of their own (the process died, or the run stopped): the reference of the same
    # recipe is drawn with the failing iteration
    assert crash["case_line"] == [] and crash["has_ref"] and crash["failed"]["it"] == 6
    assert not stopped["has_case"] and stopped["ref_line"]
    assert corrupt["failed"]["it"] == 6 and [v["it"] for v in corrupt["validation"]] == [5]
    assert len(corrupt["bad"]) == 1 and corrupt["log"]  # 900 next to 8: a log axis
    assert fixed["failed"] is None and not fixed["log"] and len(fixed["ref_line"]) == 1
    assert view["summary"] == {"cases": 4, "matched": 3, "unmatched": 1, "known": True}
    assert math.isnan(matrix_entries()[2]["result"]["losses"][-1])


@needs_browser
def test_matrix_page_in_a_browser(tmp_path):
    html = tmp_path / "matrix.html"
    html.write_text(render_matrix(matrix_entries()))
    shot = screenshot_path(tmp_path, "matrix.png")
    page = open_page(BROWSER, str(html), shot)
    check_page(
        page,
        [
            "illegal memory access",
            "silent corruption",
            "StaleMemoryError",
            "3 matched",
            "fixed state policy",
        ],
    )
    assert page.dom.count("failed: it. 6") == 3
