"""What every page shares: rendering a template (Jinja2, imported only when a page is made),
axis ticks, and finding a finding's replay among the events."""

from __future__ import annotations

import math
from typing import Any

STEPS = (1.0, 2.0, 2.5, 5.0)  # tick spacings, times a power of ten


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """4 to 8 round values inside [lo, hi], 1, 2, 2.5 or 5 times a power of ten apart, as
    near `count` of them as those spacings allow; [lo] for an empty range, [] for a range
    that is not finite (nothing to draw)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    span = hi - lo
    if span <= 0:
        return [lo]
    top = math.floor(math.log10(span))
    best: tuple | None = None
    for power in range(top - 2, top + 2):
        for m in STEPS:
            step = m * 10.0**power
            first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
            n = last - first + 1
            # a count of 4 to 8 always exists (the spacings are at most 2x apart)
            score = (not 4 <= n <= 8, abs(n - count), m == 2.5, -step)
            if best is None or score < best[0]:
                best = (score, step, power, first, last)
    _, step, power, first, last = best
    digits = max(0, 1 - power)  # enough for 2.5 x 10^power; rounding drops the float noise
    return [round(k * step, digits) for k in range(first, last + 1)]


def tick_label(value: float) -> str:
    """A tick's value as the axis prints it: no float noise, no needless zeros."""
    return f"{value:.6g}"


def replay_index(events: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Judged-replay events by (graph id, time): a finding's `found_at` is its replay's time."""
    return {(e.get("graph"), e.get("t")): e for e in events if e.get("kind") == "replay"}


def render(template: str, **context: Any) -> str:
    """Render one of graphsan's templates (autoescaped HTML)."""
    import jinja2

    env = _environment()
    try:
        return env.get_template(template).render(**context)
    except jinja2.TemplateError as err:  # a packaging fault, not the user's
        raise RuntimeError(f"graphsan: template {template} failed: {err}") from err


_ENV = None


def _environment():
    global _ENV
    if _ENV is None:
        import jinja2

        _ENV = jinja2.Environment(
            loader=jinja2.PackageLoader("graphsan.report", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,  # a misspelt field fails the tests, not silently
            trim_blocks=True,
            lstrip_blocks=True,
        )
        _ENV.filters["breakable"] = breakable
    return _ENV


def breakable(text: str):
    """`text` escaped, with a line-break opportunity after each "/" and "::", so a narrow
    table cell wraps a path or a kernel name between its parts rather than inside a word."""
    import markupsafe

    escaped = str(markupsafe.escape(text))
    return markupsafe.Markup(escaped.replace("/", "/<wbr>").replace("::", "::<wbr>"))
