"""What every page shares: rendering a template (Jinja2, imported only when a page is made),
axis ticks, and finding a finding's replay among the events."""

from __future__ import annotations

import math
from typing import Any


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 times a power of ten apart) inside [lo, hi]."""
    span = hi - lo
    if span <= 0:
        return [lo]
    raw = span / max(count - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    out, k = [], 0
    while first + k * step <= hi + step * 1e-9:
        out.append(first + k * step)
        k += 1
    return out


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
    return _ENV
