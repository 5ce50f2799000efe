"""docs/report-format.md, rendered from the report schema (`graphsan.report.schema`): every
field of a report, its type and meaning. `python -m graphsan.report.format_doc >
docs/report-format.md`; a test holds the document to this output."""

from __future__ import annotations

import os
import sys

from graphsan.report.schema import PATH, _expected, _resolve, schema


def markdown() -> str:
    """docs/report-format.md: every field of the report, its type and meaning."""
    root = schema()
    out = [
        f"# The report format (graphsan.report, version {max(root['properties']['version']['enum'])})",
        "",
        "<!-- rendered from src/graphsan/report/report.schema.json by "
        "`python -m graphsan.report.format_doc`; edit the schema, not this file -->",
        "",
        root["description"],
        "",
        f"The JSON Schema ships with the package (`graphsan/report/{os.path.basename(PATH)}`); "
        "`graphsan report` validates every report against it and names the first field that "
        "does not fit. Reports may be gzipped. Every number is finite: a `NaN` or `Infinity` "
        "is refused, naming its field.",
        "",
    ]
    out += _table("The report", root, root)
    for name, sub in root["$defs"].items():
        if sub.get("type") == "object":
            out += _table(f"`{name}`", sub, root)
    return "\n".join(out).rstrip() + "\n"


def _type_text(s: dict, root: dict) -> str:
    if "$ref" in s:
        target = s["$ref"].rsplit("/", 1)[-1]
        sub = root["$defs"][target]
        return f"`{target}`" if sub.get("type") == "object" else _type_text(sub, root)
    if "x-expected" in s:
        return s["x-expected"]
    if "const" in s or "enum" in s:
        return _expected(s)
    names = [s["type"]] if isinstance(s.get("type"), str) else s.get("type", [])
    words = []
    for n in names:
        if n == "array" and "items" in s:
            words.append(f"list of {_type_text(s['items'], root)}")
        else:
            words.append(
                {
                    "integer": "integer",
                    "number": "number",
                    "string": "string",
                    "array": "list",
                    "object": "mapping",
                    "boolean": "boolean",
                    "null": "null",
                }[n]
            )
    return " or ".join(words)


def _table(title: str, s: dict, root: dict) -> list[str]:
    required = set(s.get("required", ()))
    lines = [
        f"## {title}",
        "",
        s.get("description", ""),
        "",
        "| field | type | required | meaning |",
        "|---|---|---|---|",
    ]
    for key, sub in s.get("properties", {}).items():
        meaning = sub.get("description") or _resolve(sub, root).get("description", "")
        yes = "yes" if key in required else ""
        lines.append(f"| `{key}` | {_type_text(sub, root)} | {yes} | {meaning} |")
    return [*lines, ""]


if __name__ == "__main__":
    sys.stdout.write(markdown())
