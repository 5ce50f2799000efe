"""The matrix page of `graphsan repro --html`: the table of cases and, per case, its losses
against the eager reference's, with validation and the failing iteration marked.

Input is plain data, as `graphsan repro --json` writes it: a list of {"case": {...}, "result":
{...}}. A result's `losses` are per iteration (iteration k at index k-1), `eval_losses` are
(iteration, loss) pairs, `iteration` is where a failing case stopped. The eager reference's
losses come from `result["reference_losses"]` / `["reference_eval_losses"]` (cases that compare),
else from the `reference` argument; a case with neither is drawn against the reference of a case
with the same recipe (the eager run trains that recipe, not another).
"""

from __future__ import annotations

import math
from typing import Any

from graphsan.report.pages.templating import nice_ticks, render

PLOT_W, PLOT_H = 440, 220
PAD_L, PAD_R, PAD_T, PAD_B = 52, 14, 14, 34
GOOD = ("trained through",)


def render_matrix(entries: list[dict[str, Any]], reference: dict[str, Any] | None = None) -> str:
    return render("matrix.html.j2", **matrix_view(entries, reference))


def matrix_view(entries: list[dict[str, Any]], reference: dict[str, Any] | None = None):
    rows, plots = [], []
    by_recipe = {}
    for e in entries:
        ref = _reference(e.get("result", {}), None)
        if ref is not None:
            by_recipe.setdefault(e.get("case", {}).get("recipe"), ref)
    for e in entries:
        case, res = e.get("case", {}), e.get("result", {})
        ref = _reference(res, reference) or by_recipe.get(case.get("recipe"))
        matched = res.get("matched", case.get("matched"))
        outcome = str(res.get("outcome", "?"))
        rows.append(
            {
                "n": case.get("case", "?"),
                "title": case.get("title", ""),
                "config": _config(case),
                "expected": _expected(case),
                "outcome": outcome,
                "outcome_cls": "ok" if outcome in GOOD else "bad",
                "matched": matched,
                "iteration": res.get("iteration"),
                "evidence": "; ".join(x for x in (res.get("symptom"), res.get("comparison")) if x),
                "finding": res.get("finding", ""),
                "wall_s": res.get("wall_s"),
                "anchor": f"case-{case.get('case', len(rows) + 1)}",
            }
        )
        plots.append(_plot(rows[-1], res, ref))
    summary = {
        "cases": len(rows),
        "matched": sum(1 for r in rows if r["matched"] is True),
        "unmatched": sum(1 for r in rows if r["matched"] is False),
        "known": any(r["matched"] is not None for r in rows),
    }
    return {"title": "graphsan repro: the matrix", "rows": rows, "plots": plots, "summary": summary}


def _reference(res: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any] | None:
    if res.get("reference_losses"):
        return {
            "losses": res["reference_losses"],
            "eval_losses": res.get("reference_eval_losses") or [],
        }
    return reference


def _config(case: dict[str, Any]) -> list[tuple[str, str]]:
    """The configuration columns of a case as `graphsan repro --json` writes it (`Case.to_json`)."""
    scopes = case.get("graphed_modules") or ()
    out = [
        ("recipe", case.get("recipe", "")),
        ("graphed", ", ".join(scopes) if not isinstance(scopes, str) else scopes),
        ("state", case.get("state", "")),
        ("graphsan", case.get("graphsan", "")),
    ]
    if "empty_cache" in case:
        out.append(("empty_cache", "yes" if case["empty_cache"] else "no"))
    return [(k, str(v)) for k, v in out if v != ""]


def _expected(case: dict[str, Any]) -> str:
    """The outcomes a case may legitimately end in, as words ("a or b")."""
    expected = case.get("expected", "")
    if isinstance(expected, (list, tuple)):
        return " or ".join(map(str, expected))
    return str(expected)


def _finite(xs) -> list[float]:
    return [float(x) for x in xs if _is_num(x) and math.isfinite(float(x))]


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _plot(row: dict[str, Any], res: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    """Polylines and markers in SVG coordinates: the case's losses, the reference's, the
    validation iterations, the failing iteration and any non-finite loss."""
    losses = list(res.get("losses") or [])
    evals = [tuple(p) for p in res.get("eval_losses") or [] if len(p) == 2]
    ref_losses = list((ref or {}).get("losses") or [])
    ref_evals = [tuple(p) for p in (ref or {}).get("eval_losses") or [] if len(p) == 2]
    failed_at = row["iteration"] if row["outcome"] not in GOOD else None
    values = _finite(losses) + _finite(ref_losses)
    values += _finite(v for _, v in evals) + _finite(v for _, v in ref_evals)
    iters = [len(losses), len(ref_losses)] + [int(i) for i, _ in evals + ref_evals]
    if _is_num(failed_at):
        iters.append(int(failed_at))
    n_max = max(iters + [1])
    base = {"anchor": row["anchor"], "n": row["n"], "title": row["title"], "w": PLOT_W}
    base |= {"h": PLOT_H, "outcome": row["outcome"], "outcome_cls": row["outcome_cls"]}
    if not values:
        return base | {"empty": True, "has_ref": bool(ref_losses)}
    lo, hi = min(values), max(values)
    log = lo > 0 and hi / lo > 20  # a diverging loss would flatten the rest on a linear axis
    f = math.log10 if log else (lambda v: v)
    ylo, yhi = f(lo), f(hi)
    if yhi - ylo < 1e-9:
        ylo, yhi = ylo - 0.5, yhi + 0.5
    pad = (yhi - ylo) * 0.08
    ylo, yhi = ylo - pad, yhi + pad
    x0, x1 = PAD_L, PLOT_W - PAD_R
    y0, y1 = PAD_T, PLOT_H - PAD_B

    def X(it: float) -> float:
        return round(x0 + (it - 1) / max(n_max - 1, 1) * (x1 - x0), 1)

    def Y(v: float) -> float:
        return round(y1 - (f(v) - ylo) / (yhi - ylo) * (y1 - y0), 1)

    def line(xs: list) -> list[str]:
        """Polyline segments; a non-finite loss breaks the line."""
        segs, cur = [], []
        for k, v in enumerate(xs, 1):
            if _is_num(v) and math.isfinite(v):
                cur.append(f"{X(k)},{Y(v)}")
            elif cur:
                segs.append(" ".join(cur))
                cur = []
        if cur:
            segs.append(" ".join(cur))
        return segs

    def points(xs: list, kind: str) -> list[dict[str, Any]]:
        return [
            {"x": X(k), "y": Y(v), "title": f"{kind} iteration {k}: {v:.5g}"}
            for k, v in enumerate(xs, 1)
            if _is_num(v) and math.isfinite(v)
        ]

    bad = [
        {"x": X(k), "y": y0 + 6, "title": f"iteration {k}: loss {v}"}
        for k, v in enumerate(losses, 1)
        if not (_is_num(v) and math.isfinite(v))
    ]
    validation = sorted({int(i) for i, _ in evals + ref_evals})
    if log:
        decades = [10.0**k for k in range(math.floor(ylo), math.ceil(yhi) + 1)]
        vals = [v for d in decades for v in (d, 2 * d, 5 * d) if ylo <= math.log10(v) <= yhi]
        if len(vals) > 6:
            vals = [v for v in vals if math.log10(v) % 1 == 0] or vals
    else:
        vals = nice_ticks(ylo, yhi)
    yticks = [{"y": Y(v), "label": f"{v:.4g}"} for v in vals]
    step = max(1, math.ceil(n_max / 10))
    xticks = [{"x": X(i), "label": str(i)} for i in range(1, n_max + 1, step)]
    return base | {
        "empty": False,
        "log": log,
        "x0": x0,
        "x1": x1,
        "y0": y0,
        "y1": y1,
        "case_line": line(losses),
        "case_points": points(losses, "loss"),
        "ref_line": line(ref_losses),
        "ref_points": points(ref_losses, "eager reference loss"),
        "has_ref": bool(ref_losses),
        "has_case": bool(_finite(losses)),
        "evals": [
            {"x": X(i), "y": Y(v), "title": f"validation loss at iteration {i}: {v:.5g}"}
            for i, v in evals
            if _is_num(v) and math.isfinite(v)
        ],
        "ref_evals": [
            {"x": X(i), "y": Y(v), "title": f"eager validation loss at iteration {i}: {v:.5g}"}
            for i, v in ref_evals
            if _is_num(v) and math.isfinite(v)
        ],
        "validation": [{"x": X(i), "it": i} for i in validation],
        "failed": {"x": X(failed_at), "it": failed_at} if _is_num(failed_at) else None,
        "bad": bad,
        "yticks": yticks,
        "xticks": xticks,
    }
