"""Record the reports that ship with graphsan (`graphsan report --sample NAME`) from the code as it
stands, and the output quoted from them in the docs. Needs an NVIDIA GPU (and, for the lab's
case, Triton); run it from anywhere in the checkout:

    python scripts/make_samples.py

- `stale-input`: `graphsan run --policy raise --report R examples/stale_input.py`, whose second
  replay is stopped (exit status 1);
- `te3316-case4`: `graphsan repro --case 4 --report DIR`, Transformer Engine #3316's stale MXFP8
  weight workspace (DIR/case4.json, stored gzipped).

Each new report must load, say that graphsan watched, and hold findings; otherwise nothing is
written and the script exits 1 with one line. Then the samples replace the old ones, and every
block of the docs between `<!-- sample: NAME -->` and `<!-- /sample -->` is rewritten as graphsan
prints that sample's findings (README.md's example, docs/te-3316.md's case 4). Read the prose
around those blocks afterwards: it may name nodes or sizes of the old run. The report's header
(`graphsan report --sample NAME`) says which GPU, driver and torch recorded it.
"""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the docs that quote a sample, and which
DOCS = {"README.md": ("stale-input",), "docs/te-3316.md": ("te3316-case4",)}
# what the quoted output starts with, before graphsan's own text
PROLOGUE = {
    "stale-input": "$ graphsan run examples/stale_input.py\n...\ngraphsan.report.StaleMemoryError: ",
    "te3316-case4": "",
}
BLOCK = re.compile(
    r"(?P<open><!-- sample: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(?P<close>\n<!-- /sample -->)",
    re.S,
)
EXIT_NO_GPU = 4


def blocks(text: str) -> list[tuple[str, str, int]]:
    """The quoted blocks of a doc: (sample name, the block's text, its first line number)."""
    return [
        (m["name"], m["body"], text.count("\n", 0, m.start("body")) + 1)
        for m in BLOCK.finditer(text)
    ]


def outside_blocks(text: str) -> str:
    """The doc with its quoted blocks blanked (line numbers kept): the prose."""
    return BLOCK.sub(lambda m: m["open"] + "\n" * m["body"].count("\n") + m["close"], text)


def refresh(text: str, name: str, body: str) -> str:
    """`text` with the block quoting sample `name` replaced by `body`."""
    found = []

    def swap(m: re.Match) -> str:
        if m["name"] != name:
            return m[0]
        found.append(m)
        return m["open"] + body + m["close"]

    out = BLOCK.sub(swap, text)
    if not found:
        raise ValueError(f"no <!-- sample: {name} --> block")
    return out


def quoted(name: str, findings: list) -> str:
    """The block a doc quotes for sample `name`: graphsan's text for its findings."""
    from graphsan.report import StaleMemoryError

    return f"```text\n{PROLOGUE[name]}{StaleMemoryError(findings)}\n```"


def _graphsan(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "graphsan.cli", *args], cwd=cwd, env=env, text=True
    )


def record(workdir: Path) -> dict[str, Path]:
    """Run both programs; the reports they wrote, by sample name."""
    stale = workdir / "stale-input.json"
    _graphsan("run", "--policy", "raise", "--report", str(stale), "examples/stale_input.py")
    _graphsan("repro", "--case", "4", "--report", str(workdir / "repro"))
    return {"stale-input": stale, "te3316-case4": workdir / "repro" / "case4.json"}


def check(name: str, path: Path):
    """The report at `path`, loaded; SystemExit(one line) when it cannot be a sample."""
    from graphsan.report import Report

    try:
        rep = Report.load(str(path))
    except ValueError as err:
        raise SystemExit(f"make_samples: {name}: {err}") from None
    if not rep.watched or not rep.findings:
        why = rep.disabled_reason or "no finding"
        raise SystemExit(f"make_samples: {name}: not a sample: watched {rep.watched}, {why}")
    return rep


def main() -> int:
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    if not torch.cuda.is_available():
        print("make_samples: needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        return EXIT_NO_GPU
    from graphsan.report.json_report import sample_path
    from graphsan.report.output import write_output

    with tempfile.TemporaryDirectory(prefix="graphsan-samples-") as tmp:
        made = record(Path(tmp))
        reports = {name: check(name, path) for name, path in made.items()}
        for name, path in made.items():
            data = path.read_bytes()
            target = sample_path(name)
            write_output(target, gzip.compress(data, mtime=0) if target.endswith(".gz") else data)
            print(f"make_samples: {name}: {len(reports[name].findings)} finding(s) -> {target}")
    os.chdir(ROOT)  # frames print as paths inside the checkout
    for doc, names in DOCS.items():
        text = (ROOT / doc).read_text()
        for name in names:
            text = refresh(text, name, quoted(name, reports[name].findings))
        write_output(str(ROOT / doc), text)
        print(f"make_samples: {doc}: quoted {', '.join(names)} again")
    print("make_samples: now run tests/test_citations.py and drop its xfail marks that pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
