"""The GPU tests' programs are real files the CPU suite can read: every one compiles, starts from
the shared prelude, and every name a GPU test runs has its file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.gpu_programs import PROGRAM_DIR, PROGRAMS

TESTS = Path(__file__).resolve().parent


def test_every_program_compiles_and_starts_from_the_prelude():
    assert len(PROGRAMS) >= 12
    for name, path in PROGRAMS.items():
        tree = ast.parse(Path(path).read_text(), path)
        froms = [n.module for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert "_prelude" in froms, name
    compile(Path(PROGRAM_DIR, "_prelude.py").read_text(), "_prelude.py", "exec")


def test_every_program_a_gpu_test_names_exists():
    named = set()
    for test in [*TESTS.glob("test_gpu_*.py"), *TESTS.glob("lab/test_*gpu*.py")]:
        text = test.read_text()
        named |= set(re.findall(r'run_program\(\s*"([a-z_0-9]+)"', text))
        named |= set(re.findall(r'\(\s*"([a-z_0-9]+)",\s*"(?:off|raise|warn|record|pin)"', text))
        for listed in re.findall(r"PROGRAMS = \[([^\]]*)\]", text):
            named |= set(re.findall(r'"([a-z_0-9]+)"', listed))
    named -= {"off", "raise", "warn", "record", "pin"}  # policies beside the names
    assert {"freed_empty_cache", "pin_resize"} <= named, "the patterns above are out of date"
    assert named <= set(PROGRAMS), sorted(named - set(PROGRAMS))
