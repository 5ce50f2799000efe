"""Where a report was recorded: graphsan's version (and its git commit when it runs from a
checkout), torch, the CUDA runtime and driver, the GPU, and Python.

Everything is read without side effects: no subprocess, files read as they are (`.git`, the
driver's `/proc` entry), and CUDA asked only in a process that already initialised it. Any
failure leaves that field None; nothing here raises.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import re
import sys

from graphsan.core.locations import GRAPHSAN_DIR

_SHA = re.compile(r"[0-9a-f]{40}(?:[0-9a-f]{24})?")
_DRIVER_PROC = "/proc/driver/nvidia/version"


def collect() -> dict[str, str | None]:
    """The report's `provenance`: graphsan, commit, torch, cuda, driver, gpu, python."""
    # the package is loaded before any of its modules (importing it here would be a cycle)
    version = getattr(sys.modules.get("graphsan"), "__version__", None)
    torch_version = cuda = None
    with contextlib.suppress(Exception):
        import torch

        torch_version, cuda = str(torch.__version__), torch.version.cuda
    return {
        "graphsan": version,
        "commit": git_commit(),
        "torch": torch_version,
        "cuda": cuda,
        "driver": driver_version(),
        "gpu": gpu_name(),
        "python": platform.python_version(),
    }


@functools.lru_cache(maxsize=4)
def git_commit(package: str = GRAPHSAN_DIR) -> str | None:
    """The commit checked out where graphsan runs from a git checkout (`<root>/src/graphsan`),
    read from the repository's files; None for an installed copy or anything unreadable."""
    try:
        return _commit(package)
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()


def _commit(package: str) -> str | None:
    src = os.path.dirname(package)
    if os.path.basename(src) != "src":  # installed (site-packages): not a checkout
        return None
    root = os.path.dirname(src)
    git = os.path.join(root, ".git")
    if os.path.isfile(git):  # a worktree or submodule: the file names the git folder
        text = _read(git)
        if not text.startswith("gitdir:"):
            return None
        gitdir = os.path.join(root, text[len("gitdir:") :].strip())
    elif os.path.isdir(git):
        gitdir = git
    else:
        return None
    head = _read(os.path.join(gitdir, "HEAD"))
    if _SHA.fullmatch(head):  # a detached HEAD
        return head
    if not head.startswith("ref:"):
        return None
    ref = head[len("ref:") :].strip()
    common = gitdir
    if os.path.isfile(os.path.join(gitdir, "commondir")):  # a worktree shares the main refs
        common = os.path.join(gitdir, _read(os.path.join(gitdir, "commondir")))
    for folder in dict.fromkeys((gitdir, common)):
        loose = os.path.join(folder, ref)
        if os.path.isfile(loose) and _SHA.fullmatch(sha := _read(loose)):
            return sha
    packed = os.path.join(common, "packed-refs")
    if os.path.isfile(packed):
        for line in _read(packed).splitlines():
            sha, _, name = line.partition(" ")
            if name.strip() == ref and _SHA.fullmatch(sha):
                return sha
    return None


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version, from its /proc entry (no CUDA call); else, in a
    process that initialised CUDA, the CUDA version the driver supports."""
    with contextlib.suppress(OSError, ValueError):
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+(?:\.\d+)+)", _read(_DRIVER_PROC))
        if found:
            return found.group(1)
    if not _cuda_initialised():
        return None
    with contextlib.suppress(Exception):
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if int(err) == 0:
            return f"CUDA {version // 1000}.{version % 1000 // 10} (driver API)"
    return None


def gpu_name() -> str | None:
    """The current device's name, in a process that initialised CUDA (asking would start it)."""
    if not _cuda_initialised():
        return None
    with contextlib.suppress(Exception):
        import torch

        return torch.cuda.get_device_name(torch.cuda.current_device())
    return None


def _cuda_initialised() -> bool:
    with contextlib.suppress(Exception):
        import torch

        return bool(torch.cuda.is_initialized())
    return False
