"""The compiled tracker's library built and cached: the system C++ compiler against the
installed torch's headers (no pybind, no torch extension machinery), a cache under
`$XDG_CACHE_HOME/graphsan` keyed by the torch build and the source, a build that a cold cache
leaves to a detached background process (one per library, however many ranks start at once),
and a failed build remembered beside the library so that later runs say why instead of
compiling again. Which torch it builds for, and the attached tracker, are `cuda.tracelog`'s.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import hashlib
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

from graphsan.cuda import tracelib
from graphsan.cuda.tracelib import BuildError, TraceLog

ENV = "GRAPHSAN_TRACELOG"
# the reason of a run that found the cache cold and left the compile to a background process
BUILDING = (
    "the compiled tracker is being built for the runs after this one "
    f"(python -m graphsan.cuda.tracelog builds it ahead; {ENV}=1 waits for it)"
)
HERE = os.path.dirname(os.path.abspath(__file__))
# built into one library: the tracker, the graph walk (graphwalk.cpp, needing only cuda.h) and
# the GPU trace (its entries and PyTorch's interpreter table made of them), which is left out
# where PyTorch's headers do not fit it (TRACKER_SOURCES)
TRACE_FILES = ("gputrace.cpp", "gputable.cpp")
SOURCES = tuple(os.path.join(HERE, f) for f in ("tracelog.cpp", "graphwalk.cpp", *TRACE_FILES))
TRACKER_SOURCES = SOURCES[:2]
BUILD_TIMEOUT_S = 300


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "graphsan")


def library_name(source: bytes, torch_build: str) -> str:
    """The cached library's file name: the torch build (version, commit, C++ ABI) and the
    source, hashed; the version stays readable."""
    digest = hashlib.sha256(torch_build.encode() + b"\0" + source).hexdigest()[:16]
    version = re.sub(r"[^A-Za-z0-9.+-]", "_", torch_build.split(" ")[0])
    return f"tracelog-{version}-{digest}.so"


def find_compiler() -> str | None:
    """`$CXX`, else `c++` or `g++` on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    return shutil.which("c++") or shutil.which("g++")


def cuda_include_dirs() -> list[str]:
    """Where cuda_runtime_api.h is: CUDA_HOME or CUDA_PATH, nvcc's toolkit, /usr/local/cuda,
    then the NVIDIA pip packages next to torch."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    found = [os.path.join(r, "include") for r in roots if r]
    for base in sys.path:
        nvidia = os.path.join(base or ".", "nvidia")
        if os.path.isdir(nvidia):
            found.append(os.path.join(nvidia, "cuda_runtime", "include"))
            found += sorted(
                os.path.dirname(p) for p in glob.glob(f"{nvidia}/*/include/cuda_runtime_api.h")
            )
    out: list[str] = []
    for d in found:
        if os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) and d not in out:
            out.append(d)
    return out[:1]


class CompileError(BuildError):
    """The compiler refused: `command` (shortened) and the first line of its error."""

    def __init__(self, command: str, error: str) -> None:
        super().__init__(f"`{command}` failed: {error}")
        self.command, self.error = command, error


@dataclass(frozen=True)
class TorchFlags:
    """How the installed torch compiles its own C++ extensions (`torch.utils.cpp_extension`):
    the language standard, the C++ ABI and the header folders; `defines` without `-D`."""

    std: str
    defines: tuple[str, ...]
    include_dirs: tuple[str, ...]

    @classmethod
    def of_torch(cls) -> TorchFlags:
        import torch

        cpp_extension = importlib.import_module("torch.utils.cpp_extension")
        abi = int(torch.compiled_with_cxx11_abi())
        return cls(
            extension_standard(cpp_extension),
            (f"_GLIBCXX_USE_CXX11_ABI={abi}",),
            tuple(cpp_extension.include_paths()),
        )


def extension_standard(cpp_extension: object) -> str:
    """The C++ standard `torch.utils.cpp_extension` compiles extensions with (`c++17` on torch
    2.10, `c++20` on 2.13; torch's headers need it): the newest `-std=c++NN` flag its code passes,
    read from the module's own source (docstrings' examples are not flags), since it offers no
    function that says it. `c++17` where the source cannot be read."""
    try:
        tree = ast.parse(inspect.getsource(cpp_extension))
    except (OSError, TypeError, SyntaxError):
        return "c++17"
    found = [
        int(m.group(1))
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        for m in [re.fullmatch(r"[-/]std[=:]c\+\+(\d\d)", node.value)]
        if m
    ]
    return f"c++{max(found)}" if found else "c++17"


def build(
    target: str,
    cxx: str,
    flags: TorchFlags,
    lib_dir: str,
    libs: Sequence[str],
    sources: Sequence[str] = SOURCES,
    extra: Sequence[str] = (),
) -> None:
    """Compile `sources` into `target` with `flags` (and `extra` flags before them): into a
    temporary file next to it, renamed into place, so a process that loads `target` never sees
    half a file (two processes may build at once; the later rename wins with an equal file).
    Raises BuildError naming the compiler command."""
    folder = os.path.dirname(target) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as err:
        raise BuildError(f"cannot write to {folder}: {err.strerror or err}") from None
    cmd = compile_command(cxx, flags, sources, tmp, lib_dir, libs, extra)
    said = shown(cmd)
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
        if proc.returncode != 0:
            raise CompileError(said, _first_error(proc.stderr))
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise BuildError(f"`{said}` ran past {BUILD_TIMEOUT_S} s") from None
    except OSError as err:
        raise BuildError(f"`{said}`: {err.strerror or err}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def compile_command(
    cxx: str,
    flags: TorchFlags,
    sources: Sequence[str],
    output: str,
    lib_dir: str,
    libs: Sequence[str],
    extra: Sequence[str] = (),
) -> list[str]:
    cmd = [cxx, *extra, "-O2", "-shared", "-fPIC", f"-std={flags.std}"]
    cmd += [f"-D{d}" for d in flags.defines] + [f"-I{d}" for d in flags.include_dirs]
    cmd += [*sources, "-o", output, f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    return cmd + [f"-l{lib}" for lib in libs] + ["-ldl"]


def shown(cmd: Sequence[str]) -> str:
    """A compiler command in one short line: the compiler and source names, the flags, the
    header and library folders counted instead of spelled out."""
    words, folders = [], 0
    for word in cmd:
        if word.startswith(("-I", "-L", "-Wl,-rpath")):
            folders += 1
            continue
        if word.endswith((".cpp", ".so", ".tmp")) or word == cmd[0]:
            word = os.path.basename(word)
        words.append(word)
    return " ".join(words[:1] + [f"({folders} folders)"] + words[1:])


def _first_error(stderr: str) -> str:
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    line = next((x for x in lines if "error" in x), lines[-1] if lines else "no message")
    return line[:300]


def obtain(
    torch_build: str,
    lib_dir: str,
    libs: Sequence[str] = ("c10_cuda", "c10"),
    wait: bool = True,
) -> TraceLog:
    """The tracker for this torch build, from the cache or built into it now, loaded (not
    attached); `wait=False` leaves a build to a background process (`start_background_build`)
    and raises BuildError(BUILDING). A failed build is remembered beside the library, so that
    later runs say why instead of compiling again. Raises BuildError."""
    source = b""
    for path in SOURCES:
        try:
            with open(path, "rb") as fh:
                source += fh.read()
        except OSError as err:
            raise BuildError(f"cannot read {path}: {err.strerror}") from None
    target = os.path.join(cache_dir(), library_name(source, torch_build))
    # the tracker and the walk alone where the GPU trace failed to build; the .why file says why
    partial = target[: -len(".so")] + "-notrace.so"
    if os.path.isfile(target):
        return tracelib.load(target)
    if os.path.isfile(partial):
        return tracelib.load(partial, _read_why(partial))
    cxx = find_compiler()
    if cxx is None:
        raise BuildError("no C++ compiler ($CXX, c++ or g++)")
    cuda = cuda_include_dirs()
    if not cuda:
        raise BuildError("no CUDA headers (cuda_runtime_api.h): set CUDA_HOME")
    if not wait:
        failed = _read_failed(target)
        if failed:
            raise BuildError(
                f"the compiled tracker's build failed: {failed} "
                "(python -m graphsan.cuda.tracelog tries again)"
            )
        start_background_build(target)
        raise BuildError(BUILDING)
    try:
        log = _build_and_load(target, partial, cxx, cuda, lib_dir, libs)
    except BuildError as err:
        with contextlib.suppress(OSError), open(target + ".failed", "w") as fh:
            fh.write(str(err))
        raise
    with contextlib.suppress(OSError):
        os.unlink(target + ".failed")
    return log


def _build_and_load(
    target: str,
    partial: str,
    cxx: str,
    cuda: list[str],
    lib_dir: str,
    libs: Sequence[str],
) -> TraceLog:
    torch_flags = TorchFlags.of_torch()
    flags = TorchFlags(torch_flags.std, torch_flags.defines, (*torch_flags.include_dirs, *cuda))
    why = why_no_trace()
    if why is None:
        try:
            build(target, cxx, flags, lib_dir, libs)
            return tracelib.load(target)
        except BuildError as err:
            if not (isinstance(err, CompileError) and any(n in err.error for n in TRACE_FILES)):
                raise  # a failure of the tracker's own, or of the machine (time, disk): no cache
            why = str(err)
    # the GPU trace leans on PyTorch's interpreter table: without it the tracker still works
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(partial), exist_ok=True)
        with open(partial + ".why", "w") as fh:  # before the library, which readers look for
            fh.write(why)
    build(partial, cxx, flags, lib_dir, libs, TRACKER_SOURCES)
    return tracelib.load(partial, why)


def start_background_build(target: str) -> None:
    """Build `target` in a process of its own (`python -m graphsan.cuda.tracelog`), detached, so
    that it finishes even when this run ends first; one build at a time per library, however
    many ranks start at once (a marker file, taken over once older than a build may run)."""
    marker = target + ".building"
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if time.time() - os.path.getmtime(marker) > BUILD_TIMEOUT_S + 60:
                os.unlink(marker)  # its builder died without cleaning up
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return  # another run is building it, or the cache cannot be written (the build would fail)
    package_root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        _BACKGROUND.append(
            subprocess.Popen(
                [sys.executable, "-m", "graphsan.cuda.tracelog", "--marker", marker],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C for the run is not one for the build
            )
        )
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(marker)


_BACKGROUND: list[subprocess.Popen] = []


def _read_failed(target: str) -> str | None:
    try:
        with open(target + ".failed") as fh:
            return fh.read().strip() or "unknown"
    except OSError:
        return None


def why_no_trace() -> str | None:
    """Why this interpreter cannot have the GPU trace, if it cannot."""
    if sys.version_info < (3, 11):
        return "the GPU trace reads frames with PyFrame_GetLasti (Python 3.11)"
    if sys.version_info[:2] == (3, 11) and sys.version_info < (3, 11, 5):
        # CPython issues 97002 and 106092: a collection while a frame object is made (which
        # the trace does on every allocation) corrupts memory there
        return "Python 3.11 before 3.11.5 corrupts memory when it collects while making frames"
    return None


def _read_why(path: str) -> str:
    try:
        with open(path + ".why") as fh:
            return fh.read().strip() or "unknown"
    except OSError:
        return "unknown"
