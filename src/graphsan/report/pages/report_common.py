"""What the parts of the HTML report page share: sizes and times as the page writes them (times
relative to the first event, or as a UTC clock) and the geometry of its SVG timelines."""

from __future__ import annotations

import datetime

SVG_WIDTH = 960
RIGHT_MARGIN = 36.0  # room for half of a time axis's last label (e.g. "+1000 s") right of it


def rel(t: float | None, t0: float | None) -> str:
    if t is None or t0 is None:
        return ""
    return f"+{t - t0:.3f} s"


def clock(t: float) -> str:
    d = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
    return d.strftime("%Y-%m-%d %H:%M:%S.") + f"{d.microsecond // 1000:03d} UTC"


def phase_class(phase: str) -> str:
    if phase.startswith("eval") or "valid" in phase:
        return "eval"
    if phase.startswith("train"):
        return "train"
    return "other"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit} ({n} B)"
        size /= 1024
    return f"{n} B"
