"""Building the compiled allocator tracker (graphsan.cuda.tracebuild) with a stand-in compiler:
a cache keyed by the torch build and the source, a temporary file renamed into place, a
background build on a cold cache, and every failure (off by GRAPHSAN_TRACELOG, no compiler, no
headers, a failed build, a library that does not load) turned into one line for the fallback.
"""

from __future__ import annotations

import importlib
import os
import stat
import sys
import types

import pytest
import torch

from graphsan.cuda import allocator, tracebuild, tracelib, tracelog
from graphsan.cuda.gputrace import GpuTrace
from tests.test_tracelog import FakeLog, new_watch

FAKE_CXX = """#!{python}
import os, sys
args = sys.argv[1:]
out = args[args.index("-o") + 1]
with open(os.environ["FAKE_CXX_CALLS"], "a") as fh:
    fh.write(out + "\\n")
with open(os.environ["FAKE_CXX_CALLS"] + ".argv", "w") as fh:
    fh.write("\\n".join(args))
mode = os.environ.get("FAKE_CXX_MODE", "ok")
bad = os.environ.get("FAKE_CXX_BAD", "gputable.cpp")  # the GPU trace's file the headers do not fit
if mode == "no-trace" and any(a.endswith(bad) for a in args):
    sys.stderr.write(f"{{bad}}:130:3: error: no member named trace_gpu_event_record\\n")
    sys.exit(1)
if mode == "fail":
    sys.stderr.write("In file included from tracelog.cpp:9:\\n")
    sys.stderr.write("tracelog.cpp:9:10: fatal error: c10/cuda/CUDACachingAllocator.h: no such file\\n")
    sys.stderr.write("compilation terminated.\\n")
    sys.exit(1)
if mode == "race":  # another process finished the same library meanwhile
    with open(os.environ["FAKE_CXX_TARGET"], "w") as fh:
        fh.write("the other process's library")
with open(out, "w") as fh:
    fh.write("fake library")
"""


FLAGS = tracebuild.TorchFlags("c++20", ("_GLIBCXX_USE_CXX11_ABI=1",), ("/i", "/cuda/include"))


def _script(path, text: str):
    """`text` (a `#!` script) written to `path` and made executable."""
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    path = _script(tmp_path / "fake-c++", FAKE_CXX.format(python=sys.executable))
    calls = tmp_path / "calls"
    calls.write_text("")
    monkeypatch.setenv("CXX", str(path))
    monkeypatch.setenv("FAKE_CXX_CALLS", str(calls))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tracebuild, "cuda_include_dirs", lambda: ["/cuda/include"])
    # the build's include dirs, without importing torch's extension builder
    stub = types.ModuleType("torch.utils.cpp_extension")
    stub.include_paths = lambda: ["/torch/include"]
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", stub)
    return lambda: calls.read_text().split()


def test_build_writes_a_temporary_file_next_to_the_target_then_renames_it(tmp_path, fake_cxx):
    target = tmp_path / "out" / "tracelog-x.so"
    tracebuild.build(str(target), os.environ["CXX"], FLAGS, "/torch/lib", ["c10"])
    (written,) = fake_cxx()
    assert written != str(target) and os.path.dirname(written) == str(target.parent)
    assert target.read_text() == "fake library"
    assert sorted(os.listdir(target.parent)) == ["tracelog-x.so"], "no temporary file is left"


def test_two_builds_at_once_leave_one_whole_library(tmp_path, fake_cxx, monkeypatch):
    target = tmp_path / "tracelog-x.so"
    monkeypatch.setenv("FAKE_CXX_MODE", "race")
    monkeypatch.setenv("FAKE_CXX_TARGET", str(target))
    tracebuild.build(str(target), os.environ["CXX"], FLAGS, "/torch/lib", [])
    assert target.read_text() == "fake library"
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def test_a_failed_build_is_one_line_and_leaves_nothing(tmp_path, fake_cxx, monkeypatch):
    monkeypatch.setenv("FAKE_CXX_MODE", "fail")
    target = tmp_path / "lib" / "tracelog-x.so"
    with pytest.raises(tracelog.BuildError) as err:
        tracebuild.build(str(target), os.environ["CXX"], FLAGS, "/torch/lib", [])
    msg = str(err.value)
    assert msg.startswith(
        "`fake-c++ (4 folders) -O2 -shared -fPIC -std=c++20 -D_GLIBCXX_USE_CXX11_ABI=1 "
        "tracelog.cpp graphwalk.cpp gputrace.cpp gputable.cpp -o tracelog-x.so."
    )
    assert msg.endswith(
        ".tmp -ldl` failed: "
        "tracelog.cpp:9:10: fatal error: c10/cuda/CUDACachingAllocator.h: no such file"
    )
    assert os.listdir(target.parent) == []


def test_the_build_takes_the_standard_abi_and_headers_torch_builds_extensions_with(
    tmp_path, fake_cxx, monkeypatch
):
    monkeypatch.delitem(sys.modules, "torch.utils.cpp_extension")  # the fixture's stand-in
    cpp_extension = importlib.import_module("torch.utils.cpp_extension")
    flags = tracebuild.TorchFlags.of_torch()
    known = {(2, 10): "c++17", (2, 13): "c++20", (2, 14): "c++20"}  # read in their sources
    version = tuple(int(v) for v in torch.__version__.split(".")[:2])
    assert flags.std == known.get(version, flags.std) and flags.std in ("c++17", "c++20")
    assert flags.defines == (f"_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",)
    assert flags.include_dirs == tuple(cpp_extension.include_paths())
    tracebuild.build(str(tmp_path / "t.so"), os.environ["CXX"], flags, "/torch/lib", ["c10"])
    argv = (tmp_path / "calls.argv").read_text().splitlines()
    assert f"-std={flags.std}" in argv and flags.defines[0] in map(lambda a: a[2:], argv)
    assert [a[2:] for a in argv if a.startswith("-I")] == list(flags.include_dirs)


@pytest.mark.parametrize(
    ("source", "std"),
    [
        ("cflags = common + ['-fPIC', '-std=c++17'] + extra", "c++17"),
        ("x = ['-std=c++17']\ny = ['/std:c++20']", "c++20"),
        ("no standard named here", "c++17"),
        # torch 2.8's: a docstring's example is no flag it passes
        ('def f():\n    """e.g. [\'-std=c++20\']"""\n    return ["-std=c++17"]', "c++17"),
    ],
)
def test_the_standard_is_the_newest_cpp_extension_passes(tmp_path, monkeypatch, source, std):
    module = types.ModuleType("cpp_extension_of_some_torch")
    path = tmp_path / "cpp_extension_of_some_torch.py"
    path.write_text(source + "\n")
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert tracebuild.extension_standard(module) == std
    assert tracebuild.extension_standard(types.ModuleType("no_source")) == "c++17"


def test_the_cache_is_keyed_by_the_torch_build_and_the_source(tmp_path, fake_cxx):
    name = tracebuild.library_name(b"source", "2.11.0+cu130 abc abi1")
    assert name.startswith("tracelog-2.11.0+cu130-") and name.endswith(".so")
    assert tracebuild.library_name(b"source", "2.11.0+cu130 abc abi1") == name
    assert tracebuild.library_name(b"source2", "2.11.0+cu130 abc abi1") != name
    assert tracebuild.library_name(b"source", "2.11.0+cu130 abd abi1") != name
    assert tracebuild.library_name(b"source", "2.11.0+cu130 abc abi0") != name

    # obtain builds into $XDG_CACHE_HOME/graphsan once per key; the fake library does not load
    for _ in range(2):
        with pytest.raises(tracelog.BuildError, match=r"^cannot load tracelog-2\.11\.0.*\.so: "):
            tracebuild.obtain("2.11.0+cu130 abc abi1", "/torch/lib")
    (built,) = fake_cxx()
    assert os.path.dirname(built) == str(tmp_path / "cache" / "graphsan")
    with pytest.raises(tracelog.BuildError, match="cannot load"):
        tracebuild.obtain("2.13.0+cu130 def abi1", "/torch/lib")
    assert len(fake_cxx()) == 2
    cached = sorted(os.listdir(tmp_path / "cache" / "graphsan"))
    assert len([f for f in cached if f.endswith(".so")]) == 2
    assert len(cached) == 4, "each failure is remembered beside its library (.failed)"


@pytest.mark.parametrize("bad", tracebuild.TRACE_FILES)
def test_a_build_without_the_gpu_trace_keeps_the_tracker_and_says_why(
    tmp_path, fake_cxx, monkeypatch, bad
):
    monkeypatch.setenv("FAKE_CXX_MODE", "no-trace")
    monkeypatch.setenv("FAKE_CXX_BAD", bad)
    loaded = []
    monkeypatch.setattr(
        tracelib, "load", lambda path, without_trace=None: loaded.append((path, without_trace))
    )
    for _ in range(2):  # the second process finds the partial library and its reason cached
        tracebuild.obtain("2.11.0+cu130 abc abi1", "/torch/lib")
    full, partial = fake_cxx()
    assert partial.endswith(".tmp") and "-notrace.so" in partial and "-notrace" not in full
    why = f"failed: {bad}:130:3: error: no member named trace_gpu_event_record"
    assert [w.split("` ")[1] for _, w in loaded] == [why, why]
    assert loaded[0][1].startswith("`fake-c++ (4 folders) ") and bad in loaded[0][1]
    assert loaded[0][0] == loaded[1][0] and loaded[0][0].endswith("-notrace.so")


def test_before_python_3_11_the_library_is_the_tracker_alone(tmp_path, fake_cxx, monkeypatch):
    monkeypatch.setattr(tracebuild.sys, "version_info", (3, 10, 14))
    loaded = []
    monkeypatch.setattr(
        tracelib, "load", lambda path, without_trace=None: loaded.append((path, without_trace))
    )
    tracebuild.obtain("2.11.0+cu130 abc abi1", "/torch/lib")
    (built,) = fake_cxx()  # one compile: the tracker and the walk, without the GPU trace
    assert "-notrace.so" in built
    assert loaded[0][1] == "the GPU trace reads frames with PyFrame_GetLasti (Python 3.11)"


@pytest.mark.parametrize(
    ("version", "why"),
    [
        ((3, 11, 4), "Python 3.11 before 3.11.5 corrupts memory"),
        ((3, 11, 5), None),
        ((3, 12, 0), None),
    ],
)
def test_pythons_that_corrupt_memory_when_making_frames_get_no_gpu_trace(monkeypatch, version, why):
    monkeypatch.setattr(tracebuild.sys, "version_info", version)
    found = tracebuild.why_no_trace()
    assert found == why if why is None else found.startswith(why)


def test_the_prebuild_names_the_library_or_says_why(tmp_path, fake_cxx, monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert tracelog.main([]) == 1
    assert capsys.readouterr().err == "graphsan tracelog: error: torch is not built with CUDA\n"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    lib = tmp_path / "torch-lib"
    lib.mkdir()
    monkeypatch.setattr(tracelog, "torch_lib_dir", lambda: str(lib))
    assert tracelog.main([]) == 1
    assert capsys.readouterr().err == f"graphsan tracelog: error: no libc10_cuda.so in {lib}\n"
    (lib / "libc10_cuda.so").write_text("")
    monkeypatch.setattr(
        tracelib,
        "load",
        lambda path, without_trace=None: tracelib.TraceLog(
            None, without_trace or object.__new__(GpuTrace), path
        ),
    )
    assert tracelog.main([]) == 0
    (built,) = fake_cxx()  # built into the cache, as enable() would find it
    line = capsys.readouterr().out
    assert line.startswith("graphsan tracelog: ") and line.endswith(", with the GPU trace\n")
    assert os.path.dirname(line.split()[2].rstrip(",")) == str(tmp_path / "cache" / "graphsan")


def test_no_compiler_or_no_cuda_headers_is_a_reason(tmp_path, fake_cxx, monkeypatch):
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(tracelog.BuildError, match=r"^no C\+\+ compiler \(\$CXX, c\+\+ or g\+\+\)$"):
        tracebuild.obtain("2.11.0 abc abi1", "/torch/lib")
    monkeypatch.setenv("CXX", str(tmp_path / "fake-c++"))
    monkeypatch.setattr(tracebuild, "cuda_include_dirs", lambda: [])
    with pytest.raises(tracelog.BuildError, match=r"^no CUDA headers"):
        tracebuild.obtain("2.11.0 abc abi1", "/torch/lib")
    assert fake_cxx() == []


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ("0", "GRAPHSAN_TRACELOG=0"),
        ("yes", "GRAPHSAN_TRACELOG='yes': expected 0 (off) or 1 (on, waiting for the build)"),
        ("1", "torch is not built with CUDA"),
        ("", "torch is not built with CUDA"),  # unset: on
    ],
)
def test_open_log_falls_back_with_one_line(monkeypatch, setting, reason):
    monkeypatch.setattr(tracelog, "_opened", [])
    monkeypatch.setenv("GRAPHSAN_TRACELOG", setting)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert tracelog.open_log() == (None, reason)
    monkeypatch.setenv("GRAPHSAN_TRACELOG", "1" if setting == "0" else "0")
    assert tracelog.open_log() == (None, reason), "decided once per process"


def test_an_opened_tracker_has_no_reason_so_nothing_is_announced(monkeypatch, capsys):
    """(On the H200 every run with the tracker once said "events come from snapshots (tracker)".)"""
    monkeypatch.setattr(tracelog, "_opened", [])
    monkeypatch.setattr(allocator, "_SAID", [])
    log = FakeLog()
    monkeypatch.setattr(tracelog, "_open", lambda: log)
    watch = new_watch()
    watch.tracelog, watch.tracelog_reason = tracelog.open_log()
    assert (watch.tracelog, watch.tracelog_reason) == (log, None)
    allocator._say_fallback(watch.tracelog_reason)
    assert capsys.readouterr().err == "" and watch.event_source == "tracker"


def test_an_unexpected_error_is_a_reason_too(monkeypatch):
    monkeypatch.setattr(tracelog, "_opened", [])

    def broken():
        raise RuntimeError("CUDA driver initialization failed\nmore detail")

    monkeypatch.setattr(tracelog, "_open", broken)
    assert tracelog.open_log() == (None, "RuntimeError: CUDA driver initialization failed")


def test_the_watch_says_where_its_events_come_from_once(monkeypatch, capsys):
    monkeypatch.setattr(allocator, "_SAID", [])
    watch = new_watch()
    assert watch.event_source is None
    watch.tracelog_reason = "no C++ compiler ($CXX, c++ or g++)"
    assert watch.event_source == "snapshot (no C++ compiler ($CXX, c++ or g++))"
    allocator._say_fallback("GRAPHSAN_TRACELOG=0")
    assert capsys.readouterr().err == "", "a fallback the user asked for is not announced"
    allocator._say_fallback(watch.tracelog_reason)
    allocator._say_fallback("another reason")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler" in err
    watch.tracelog = FakeLog()
    assert watch.event_source == "tracker"


FAKE_PYTHON = """#!{python}
import json, os, sys
with open(os.environ["FAKE_PYTHON_CALLS"], "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv[1:], "pythonpath": os.environ.get("PYTHONPATH"),
                         "session": os.getsid(0) == os.getpid()}}) + "\\n")
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """sys.executable as a script that writes down how it was started (the background builder)."""
    import json
    import time

    path = _script(tmp_path / "fake-python", FAKE_PYTHON.format(python=sys.executable))
    calls = tmp_path / "python-calls"
    monkeypatch.setenv("FAKE_PYTHON_CALLS", str(calls))
    monkeypatch.setattr(sys, "executable", str(path))
    monkeypatch.setattr(tracebuild, "_BACKGROUND", [])

    def started(expected: int) -> list[dict]:
        deadline = time.monotonic() + 30  # the starts are detached: wait for their lines
        while time.monotonic() < deadline:
            lines = calls.read_text().splitlines() if calls.exists() else []
            if len(lines) >= expected:
                break
            time.sleep(0.02)
        return [json.loads(x) for x in lines]

    return started


def test_a_cold_cache_starts_one_background_build_and_the_run_reads_snapshots(
    tmp_path, fake_cxx, fake_python, monkeypatch, capsys
):
    key = "2.11.0+cu130 abc abi1 py3.11"
    for _ in range(2):  # the second run (or rank) finds the first one's build under way
        with pytest.raises(tracelog.BuildError) as err:
            tracebuild.obtain(key, "/torch/lib", wait=False)
        assert str(err.value) == tracebuild.BUILDING
    assert fake_cxx() == [], "the run itself compiles nothing"
    (started,) = fake_python(1)
    marker = started["argv"][-1]
    assert started["argv"] == ["-m", "graphsan.cuda.tracelog", "--marker", marker]
    assert os.path.isfile(marker) and marker.endswith(".so.building")
    assert os.path.dirname(marker) == str(tmp_path / "cache" / "graphsan")
    assert started["session"], "a Ctrl-C for the run does not reach the build"
    src = os.path.dirname(os.path.dirname(os.path.dirname(tracelog.__file__)))
    assert started["pythonpath"].split(os.pathsep)[0] == src
    allocator._say_fallback(tracebuild.BUILDING)
    assert capsys.readouterr().err == "", "a build under way fixes itself: it is not announced"

    old = os.path.getmtime(marker) - tracebuild.BUILD_TIMEOUT_S - 120
    os.utime(marker, (old, old))  # its builder died without removing it
    with pytest.raises(tracelog.BuildError, match="being built"):
        tracebuild.obtain(key, "/torch/lib", wait=False)
    assert len(fake_python(2)) == 2

    # the builder's turn (what the background process runs), then a run finds the library
    loaded = []
    monkeypatch.setattr(
        tracelib, "load", lambda path, without_trace=None: loaded.append(path) or "the log"
    )
    monkeypatch.setattr(torch.version, "cuda", None)  # a builder that fails: no CUDA torch
    assert tracelog.main(["--marker", marker]) == 1
    assert not os.path.exists(marker), "the builder removes its marker, failed or not"
    tracebuild.obtain(key, "/torch/lib")
    assert tracebuild.obtain(key, "/torch/lib", wait=False) == "the log"
    assert len(fake_cxx()) == 1 and len(fake_python(2)) == 2 and len(set(loaded)) == 1


def test_a_failed_build_is_remembered_and_said_instead_of_compiling_again(
    tmp_path, fake_cxx, fake_python, monkeypatch
):
    monkeypatch.setenv("FAKE_CXX_MODE", "fail")
    key = "2.11.0+cu130 abc abi1 py3.11"
    with pytest.raises(tracelog.BuildError, match="^`fake-c\\+\\+ .*` failed: "):
        tracebuild.obtain(key, "/torch/lib")
    for _ in range(2):
        with pytest.raises(tracelog.BuildError) as err:
            tracebuild.obtain(key, "/torch/lib", wait=False)
        msg = str(err.value)
        assert msg.startswith("the compiled tracker's build failed: `fake-c++ (4 folders) ")
        assert msg.endswith(
            "` failed: tracelog.cpp:9:10: fatal error: c10/cuda/CUDACachingAllocator.h: no "
            "such file (python -m graphsan.cuda.tracelog tries again)"
        )
    assert tracebuild._BACKGROUND == [] and len(fake_cxx()) == 1
    monkeypatch.setenv("FAKE_CXX_MODE", "ok")
    monkeypatch.setattr(tracelib, "load", lambda path, without_trace=None: "the log")
    assert tracebuild.obtain(key, "/torch/lib") == "the log"  # what the prebuild runs
    cached = os.listdir(tmp_path / "cache" / "graphsan")
    assert [f for f in cached if f.endswith(".failed")] == [], "a good build forgets the failure"


@pytest.mark.skipif(bool(torch.version.cuda), reason="with CUDA torch the process would compile")
def test_the_background_builder_runs_as_a_module_and_removes_its_marker(tmp_path):
    import subprocess

    marker = tmp_path / "tracelog-x.so.building"
    marker.write_text("")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(tracelog.__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "graphsan.cuda.tracelog", "--marker", str(marker)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == "graphsan tracelog: error: torch is not built with CUDA\n"
    assert not marker.exists()
