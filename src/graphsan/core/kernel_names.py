"""Demangled kernel names cut into their parts: the top-level parameter types of a kernel and
the template arguments of a type, split at the commas outside `<>`, `()` and `{}`."""

from __future__ import annotations

import functools


def parameter_types(name: str) -> list[str]:
    """The top-level parameter types of a demangled kernel name ("void f<...>(A, B<C, D>)" ->
    ["A", "B<C, D>"]); empty when the name has no parameter list."""
    return list(parameter_tuple(name))


@functools.lru_cache(maxsize=8192)
def parameter_tuple(name: str) -> tuple[str, ...]:
    """`parameter_types`, cached per name (a graph launches the same kernels many times)."""
    end = name.rstrip().rfind(")")
    if end < 0:
        return ()
    depth, start = 0, -1
    for i in range(end, -1, -1):
        c = name[i]
        if c in ")>}":
            depth += 1
        elif c in "(<{":
            depth -= 1
            if depth == 0:
                start = i
                break
    if start < 0 or name[start] != "(":
        return ()
    return tuple(_split(name[start + 1 : end]))


def template_args(type_name: str) -> list[str]:
    """The template arguments of `T<a, b<c>, d>` -> ["a", "b<c>", "d"]."""
    start = type_name.find("<")
    if start < 0 or not type_name.endswith(">"):
        return []
    return _split(type_name[start + 1 : -1])


def _split(text: str) -> list[str]:
    """`text` cut at its top-level commas (outside <>, () and {}), each part stripped; no
    empty last part."""
    out, depth, cur = [], 0, []
    for c in text:
        if c in "(<{":
            depth += 1
        elif c in ")>}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
    last = "".join(cur).strip()
    if last:
        out.append(last)
    return out
