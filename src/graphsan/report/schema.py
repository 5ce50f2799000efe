"""The report format, described once: `report.schema.json` (JSON Schema, shipped with the
package) is what the loader validates every report against, and what `docs/report-format.md`
is rendered from (`python -m graphsan.report.format_doc > docs/report-format.md`).

The validator reads the subset of JSON Schema the file uses (type, const, enum, properties,
required, additionalProperties, items, prefixItems, minItems, maxItems, $ref into $defs) and says
what is wrong in one line naming the field: `events[3]: key 't' is missing`,
`findings[0].address is '0x10'; expected an integer`. A field may name what it expects in words
(`x-expected`).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.schema.json")
_TYPES = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "array": "a list",
    "object": "a mapping",
    "boolean": "true or false",
    "null": "null",
}


class SchemaError(ValueError):
    """A report that does not fit the schema: `where: what; expected what`."""


@functools.lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    with open(PATH) as fh:
        return json.load(fh)


def validate(data: Any) -> None:
    """Raise SchemaError naming the first field of `data` the report schema does not allow."""
    root = schema()
    _check(data, root, "", root)


def validate_finding(data: Any, where: str) -> None:
    """A finding on its own (a suppressed one carries its entry's name beside its fields)."""
    root = schema()
    _check(data, {"$ref": "#/$defs/finding"}, where, root)


def _is(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "boolean":
        return isinstance(value, bool)
    if name == "null":
        return value is None
    kind = {"string": str, "array": list, "object": dict}[name]
    return isinstance(value, kind)


def _resolve(s: dict, root: dict) -> dict:
    while "$ref" in s:
        extra = {k: v for k, v in s.items() if k != "$ref"}
        s = {
            **root["$defs"][s["$ref"].rsplit("/", 1)[-1]],
            **{k: v for k, v in extra.items() if k != "description"},
        }
    return s


def _expected(s: dict) -> str:
    if "x-expected" in s:
        return s["x-expected"]
    if "const" in s:
        return repr(s["const"])
    if "enum" in s:
        return "one of " + ", ".join(str(x) for x in s["enum"])
    names = s.get("type", [])
    names = [names] if isinstance(names, str) else names
    return " or ".join(_TYPES[n] for n in names)


def _name(where: str) -> str:
    return where or "the report"


def _check(value: Any, s: dict, where: str, root: dict) -> None:
    s = _resolve(s, root)
    bad = SchemaError(f"{_name(where)} is {value!r:.60}; expected {_expected(s)}")
    if "const" in s and value != s["const"]:
        raise bad
    if "enum" in s and (isinstance(value, bool) or value not in s["enum"]):
        raise bad
    if "type" in s:
        names = [s["type"]] if isinstance(s["type"], str) else s["type"]
        if not any(_is(value, n) for n in names):
            raise bad
    if isinstance(value, list):
        if len(value) < s.get("minItems", 0) or len(value) > s.get("maxItems", len(value)):
            raise bad
        for i, item in enumerate(value):
            prefix = s.get("prefixItems", [])
            sub = prefix[i] if i < len(prefix) else s.get("items")
            if sub is not None:
                try:
                    _check(item, sub, f"{where}[{i}]", root)
                except SchemaError:
                    if "x-expected" in s:
                        raise bad from None
                    raise
    if isinstance(value, dict):
        props = s.get("properties", {})
        for key in s.get("required", ()):
            if key not in value:
                raise SchemaError(f"{_name(where)}: key '{key}' is missing")
        for key, item in value.items():
            if key in props:
                _check(item, props[key], f"{where}.{key}" if where else key, root)
            elif s.get("additionalProperties", True) is False:
                known = ", ".join(props)
                raise SchemaError(f"{_name(where)}: unknown key '{key}'; expected some of {known}")
