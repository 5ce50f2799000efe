"""Every table that lists the kinds of finding lists `Kind`'s values, no more and no fewer: the
report schema's enum, the page's colour for each kind, and the labels of the kinds about baked
state. A kind added or dropped in `core.kinds` fails here until each table follows."""

from __future__ import annotations

import json
import re
from pathlib import Path

from graphsan.core.kinds import Kind
from graphsan.report.text import BAKED_LABELS

REPORT = Path(__file__).resolve().parent.parent / "src" / "graphsan" / "report"
KINDS = set(Kind.values())


def test_the_schema_names_every_kind():
    schema = json.loads((REPORT / "report.schema.json").read_text())
    enum = schema["$defs"]["finding"]["properties"]["kind"]["enum"]
    assert sorted(enum) == sorted(KINDS) and len(enum) == len(KINDS)


def test_the_page_colours_every_kind_and_nothing_else():
    css = (REPORT / "templates" / "pages.css").read_text()
    coloured = set(re.findall(r"\.kind-([a-z-]+)\s*\{[^}]*background", css))
    assert coloured == KINDS


def test_the_baked_labels_are_the_baked_kinds():
    assert set(BAKED_LABELS) == {k for k in Kind if k.baked}
