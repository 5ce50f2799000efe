"""The commands of `graphsan` (`graphsan.cli` dispatches to them): one module per command, its
parser and its handler, `main(argv) -> exit status`. `train` and `repro` are the lab's and stay
in `graphsan.cli`, the one sanitizer module that may import the lab.

What more than one command needs lives here: the suppression file of `run` and `report`.
"""

from __future__ import annotations

from graphsan.command_line import CliError


def load_suppressions(path: str | None) -> list:
    """The entries of --suppressions FILE (none without one); a bad file is one CliError."""
    if path is None:
        return []
    from graphsan.report import suppressions

    try:
        return suppressions.load(path)
    except ValueError as err:
        raise CliError(f"--suppressions {err}") from None
