"""What more than one of graphsan's commands needs (`run`, `report`, the pytest plugin): the
suppression file, and the source root by which frames' files are named
(`graphsan.core.locations`)."""

from __future__ import annotations

import os

from graphsan.command_line import CliError

SOURCE_ROOT_HELP = (
    "the project root: frames in files under it are printed and matched by their path from it "
    "(default: per file, the nearest folder above it holding .git, pyproject.toml or setup.py)"
)


def load_suppressions(path: str | None) -> list:
    """The entries of --suppressions FILE (none without one); a bad file is one CliError."""
    if path is None:
        return []
    from graphsan.report import suppressions

    try:
        return suppressions.load(path)
    except ValueError as err:
        raise CliError(f"--suppressions {err}") from None
    except RecursionError:
        raise CliError(f"--suppressions {deep_yaml(path)}") from None


def deep_yaml(path: str) -> str:
    """The line for a suppression file nested deeper than the YAML reader follows."""
    return (
        f"{path}: nested deeper than the YAML reader follows; expected a list of suppressions "
        "(- name: ...)"
    )


def check_source_root(path: str, option: str = "--source-root", exists: bool = True) -> str:
    """`path` as an absolute folder; CliError when it is empty or (with `exists`) not a folder
    here. A report's recorded root may be another machine's, so `report` passes exists=False."""
    if not path.strip():
        raise CliError(f"{option} {path!r}: expected a folder")
    if exists and not os.path.isdir(path):
        what = "is not a folder" if os.path.exists(path) else "does not exist"
        raise CliError(f"{option} {path}: {what}; expected the project's root folder")
    return os.path.abspath(path)


def set_source_root(path: str | None, exists: bool = True) -> None:
    """Name frames' files under `path` from it on (None: each file's own project root)."""
    from graphsan.core.locations import set_source_root as set_root

    set_root(None if path is None else check_source_root(path, exists=exists))
