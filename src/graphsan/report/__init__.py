"""Reports: findings as text (`text`), the JSON report (`json_report`), several ranks merged
(`ranks`), the process's timeline (`timeline`), and the HTML and trace pages (`pages`).

`StaleMemoryError` is defined here because tracebacks print it as `graphsan.report.StaleMemoryError`.
"""

from __future__ import annotations

from graphsan.core.kinds import KINDS, Kind
from graphsan.core.records import (
    BakedEvidence,
    Finding,
    Frame,
    GraphInfo,
    OrderEvidence,
    OtherUse,
    display_path,
)
from graphsan.report.json_report import (
    READABLE_VERSIONS,
    SCHEMA,
    SCHEMA_VERSION,
    Report,
    finding_from_dict,
    finding_to_dict,
)
from graphsan.report.text import format_finding, one_line, short_kernel

__all__ = [
    "KINDS",
    "READABLE_VERSIONS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "BakedEvidence",
    "Finding",
    "Frame",
    "GraphInfo",
    "Kind",
    "OrderEvidence",
    "OtherUse",
    "Report",
    "StaleMemoryError",
    "display_path",
    "finding_from_dict",
    "finding_to_dict",
    "format_finding",
    "one_line",
    "short_kernel",
]


class StaleMemoryError(RuntimeError):
    """A graph replay would go wrong: it would touch memory that was freed, re-owned, moved or
    unmapped, read or overwrite another graph's data in a shared pool, or run with state it
    baked at capture that the program changed since (a module's mode, a hyperparameter, an
    entry re-pointed at another tensor).

    Raised by `CUDAGraph.replay()` *before* the graph is launched, so the CUDA context stays
    healthy. `findings` holds the findings, of any kind; `str(err)` is a readable report.
    """

    def __init__(self, findings: list[Finding]):
        self.findings = list(findings)
        super().__init__(self._text())

    def _text(self) -> str:
        n = len(self.findings)
        head = f"graphsan: replay stopped before launch: {n} finding(s)"
        return "\n\n".join([head, *(format_finding(f) for f in self.findings)])
