"""The runner of the GPU tests' programs (tests/gpu/programs/prog_<name>.py), each run in its own
subprocess (a stale replay can kill the CUDA context). A program prints one line
`RESULT {json}` that the test reads (`graphsan.command_line.write_result`/`read_result`).

Each program takes `GRAPHSAN` from the environment: "off" runs it without the sanitizer (to show
what happens without it), any policy name runs it under `graphsan.enable(policy)`.
"""

from __future__ import annotations

import os
import subprocess
import sys

from graphsan.command_line import read_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM_DIR = os.path.join(ROOT, "tests", "gpu", "programs")
# name -> tests/gpu/programs/prog_<name>.py; each starts with `from _prelude import *`
PROGRAMS = {
    f[len("prog_") : -len(".py")]: os.path.join(PROGRAM_DIR, f)
    for f in sorted(os.listdir(PROGRAM_DIR))
    if f.startswith("prog_") and f.endswith(".py")
}


_CACHE: dict[tuple, tuple] = {}


def _key(name: str, policy: str, env: dict | None) -> tuple:
    return (name, policy, tuple(sorted((env or {}).items())))


def prefetch(runs: list[tuple[str, str, dict | None]], workers: int = 6) -> None:
    """Run many programs side by side (each in its own process, as always) and keep the results
    for `run_program`: the GPU suite then costs the slowest program, not the sum of them."""
    from concurrent.futures import ThreadPoolExecutor

    todo = [r for r in runs if _key(*r) not in _CACHE]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda r: _run(*r), todo))
    for r, res in zip(todo, results, strict=True):
        _CACHE[_key(*r)] = res


def run_program(name: str, policy: str = "raise", env: dict | None = None, timeout: int = 180):
    """PROGRAMS[name]'s (returncode, result dict or None, log), from `prefetch` or a fresh run."""
    hit = _CACHE.get(_key(name, policy, env))
    return hit if hit is not None else _run(name, policy, env, timeout)


def _run(name: str, policy: str = "raise", env: dict | None = None, timeout: int = 400):
    """Run PROGRAMS[name] in a fresh interpreter; returns (returncode, result dict or None, log)."""
    path = PROGRAMS[name]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env["GRAPHSAN"] = policy
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, path], capture_output=True, text=True, timeout=timeout, env=full_env
    )
    return proc.returncode, read_result(proc.stdout), proc.stdout + proc.stderr


def run_script(name: str, *argv: str, env: dict | None = None, timeout: int = 300) -> dict:
    """Run tests/gpu/<name> (a script that is no program: it takes its own arguments) in a fresh
    interpreter with the package on the path; asserts that it exited 0 and printed
    `RESULT {json}`, and returns the last such result."""
    full_env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "gpu", name), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
    result = read_result(proc.stdout)
    assert proc.returncode == 0 and result is not None, (proc.stdout + proc.stderr)[-3000:]
    return result
