"""Where a frame's file is, in a form that holds on any machine and from any working directory.

Reports print frames, and suppression files match them, by this location:

- a file of an installed package (under site-packages or dist-packages): its path within, as
  `torch/nn/modules/module.py`;
- a file under the source root given on the command line (`--source-root`): its path relative
  to that root;
- a file of the standard library: its path within it (`threading.py`);
- a file of a package (folders holding `__init__.py`): its path from the package's top folder
  on, as `graphsan/lab/quant/linear.py`, wherever the package sits;
- any other file: its path relative to the project root, the nearest folder above it holding
  `.git`, `pyproject.toml` or `setup.py` (else relative to the `sys.path` folder holding it).

A path recorded on another machine (a report written there, with absolute paths) gets the same
location from its text: the part after site-packages, or the part from the top folder of a
package this machine has (the longest part that exists here, so a checkout at another path, or a
file since removed from the package, still lands on the same location). Nothing else of the
path can be known, so such a path outside every package is kept as it is.

Paths that are not absolute (already a location, or `<frozen runpy>`, `<string>`) are kept.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig

INSTALL_FOLDERS = ("site-packages", "dist-packages")
PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py")

# graphsan's own package folder, found from the package itself so that it holds wherever this
# module sits within it
GRAPHSAN_DIR = os.path.dirname(os.path.abspath(sys.modules[__name__.partition(".")[0]].__file__))

_source_root: str | None = None
_cache: dict[str, str] = {}  # absolute path -> location (files are few; frames are many)


def set_source_root(path: str | None) -> None:
    """The project root given on the command line (None: found per file); forgets what was
    located before, since the root changes the answers."""
    global _source_root
    _source_root = None if path is None else os.path.normpath(os.path.abspath(path))
    _cache.clear()


def source_root() -> str | None:
    return _source_root


def location(filename: str) -> str:
    """The location reports print and suppressions match for a frame's file."""
    if not os.path.isabs(filename):
        return filename
    found = _cache.get(filename)
    if found is None:
        found = _cache[filename] = _locate(os.path.normpath(filename))
    return found


def _locate(path: str) -> str:
    parts = path.split(os.sep)
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] in INSTALL_FOLDERS:
            return "/".join(parts[i + 1 :])
    for root in filter(None, (_source_root, *_stdlib_folders())):
        inside = _relative_to(path, root)
        if inside is not None:
            return inside
    if os.path.isfile(path):
        return _local(path) or _under_sys_path(path) or path
    return _recorded_elsewhere(parts) or path


def _relative_to(path: str, folder: str) -> str | None:
    """`path` from `folder` on, with `/` between the parts; None when it is not inside."""
    if folder == os.sep or not path.startswith(folder.rstrip(os.sep) + os.sep):
        return None
    return os.path.relpath(path, folder).replace(os.sep, "/")


@functools.cache
def _stdlib_folders() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    folders = {os.path.normpath(paths[k]) for k in ("stdlib", "platstdlib") if k in paths}
    return tuple(sorted(folders, key=len, reverse=True))


def _is_project_root(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, m)) for m in PROJECT_MARKERS)


def _local(path: str) -> str | None:
    """A file on this machine: its path from its top package folder on, or from the project
    root; None when neither holds it."""
    folder, in_package = os.path.dirname(path), False
    while True:
        if _is_project_root(folder):
            return _relative_to(path, folder)
        if os.path.isfile(os.path.join(folder, "__init__.py")):
            in_package = True
        elif in_package:  # the folder holding the top package
            return _relative_to(path, folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def _under_sys_path(path: str) -> str | None:
    """The path from the deepest `sys.path` folder holding it (the script's own folder, for a
    script outside any project)."""
    inside = [
        _relative_to(path, os.path.normpath(entry))
        for entry in sys.path
        if isinstance(entry, str) and os.path.isabs(entry)
    ]
    return min(filter(None, inside), key=len, default=None)


def _package_folders(name: str) -> list[str]:
    """The folders of the top-level package `name` on this machine (none: no such package)."""
    module = sys.modules.get(name)
    found = list(getattr(module, "__path__", None) or [])
    for entry in sys.path:
        if isinstance(entry, str) and os.path.isabs(entry):
            folder = os.path.join(entry, name)
            if os.path.isfile(os.path.join(folder, "__init__.py")):
                found.append(folder)
    return found


def _recorded_elsewhere(parts: list[str]) -> str | None:
    """A path that is not on this machine: its part from the top folder of a package this
    machine has, the one under which most of the rest exists here (the deepest on a tie), and
    at least the part after the package's name."""
    best, best_depth = None, -1
    for i, name in enumerate(parts[:-1]):
        if not name:
            continue
        for folder in _package_folders(name):
            depth = _existing_depth(folder, parts[i + 1 :])
            if depth >= max(best_depth, 1):  # a bare name match says nothing: `test`, `lib`
                best, best_depth = i, depth
    return None if best is None else "/".join(parts[best:])


def _existing_depth(folder: str, rest: list[str]) -> int:
    """How many leading parts of `rest` exist under `folder`."""
    depth = 0
    for part in rest:
        folder = os.path.join(folder, part)
        if not os.path.exists(folder):
            break
        depth += 1
    return depth
