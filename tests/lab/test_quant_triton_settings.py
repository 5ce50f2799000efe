"""The environment switch of the Triton kernels, GRAPHSAN_NO_TRITON: 1/true/yes/on turn them off,
0/false/no/off/empty do not, and a value that means nothing is one clear error naming the
variable, raised where the kernels are chosen (not at import, which imports no Triton). The
typed accessors (`nvfp4_launcher(x)`, ...) give a CUDA tensor its launcher module, which has
what the accessor's Protocol declares, and give a CPU tensor or a machine without Triton None."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from graphsan.lab.quant import kernels as tk

OFF = ["1", "true", "TRUE", "yes", "On", " on "]
ON = ["", "0", "false", "False", "no", "off", "OFF"]
BAD = ["2", "maybe", "disable", "-1"]


@pytest.mark.parametrize("value", OFF)
def test_no_triton_turns_the_kernels_off(monkeypatch, value):
    monkeypatch.setenv("GRAPHSAN_NO_TRITON", value)
    assert tk.triton_disabled()
    assert not tk.available()


@pytest.mark.parametrize("value", [*ON, None])
def test_no_triton_zero_or_empty_leaves_them_on(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("GRAPHSAN_NO_TRITON", raising=False)
    else:
        monkeypatch.setenv("GRAPHSAN_NO_TRITON", value)
    assert not tk.triton_disabled()
    pytest.importorskip("triton")
    assert tk.available()


@pytest.mark.parametrize("value", BAD)
def test_no_triton_rejects_other_values_in_one_line(monkeypatch, value):
    monkeypatch.setenv("GRAPHSAN_NO_TRITON", value)
    with pytest.raises(tk.TritonSettingError) as err:
        tk.available()
    msg = str(err.value)
    assert msg.startswith(f"GRAPHSAN_NO_TRITON={value!r}: expected ")
    assert "1, true, yes or on" in msg and "0, false, no, off or empty" in msg
    assert "\n" not in msg
    assert isinstance(err.value, ValueError)  # the train CLI prints a ValueError as one line


def test_importing_the_quant_package_imports_no_triton():
    code = (
        "import sys, graphsan.lab.quant as q, graphsan.lab.quant.kernels; "
        "assert 'triton' not in sys.modules, 'triton imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


CUDA_LIKE = SimpleNamespace(is_cuda=True)  # what the accessors read of a tensor
ACCESSORS = {
    "mxfp8": (tk.mxfp8_launcher, tk.MXFP8Launcher),
    "nvfp4": (tk.nvfp4_launcher, tk.NVFP4Launcher),
    "gemm": (tk.gemm_launcher, tk.GemmLauncher),
}


@pytest.mark.parametrize("name", ACCESSORS)
def test_a_cpu_tensor_gets_no_launcher_and_never_reads_the_switch(monkeypatch, name):
    monkeypatch.setenv("GRAPHSAN_NO_TRITON", "maybe")  # would be an error where it is read
    assert ACCESSORS[name][0](torch.zeros(1)) is None


@pytest.mark.parametrize("name", ACCESSORS)
def test_each_accessor_gives_its_own_launcher_unless_the_switch_is_off(monkeypatch, name):
    pytest.importorskip("triton")
    monkeypatch.delenv("GRAPHSAN_NO_TRITON", raising=False)
    accessor, protocol = ACCESSORS[name]
    module = importlib.import_module(f"graphsan.lab.quant.kernels.launch_{name}")
    assert accessor(CUDA_LIKE) is module is getattr(tk.launchers(), name)
    # the module has every function of its Protocol, taking the Protocol's parameters in order
    members = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
    assert members, protocol
    for member in members:
        assert hasattr(module, member), (name, member)
        declared = getattr(protocol, member, None)
        if callable(declared):
            want = list(inspect.signature(declared).parameters)[1:]  # without self
            have = list(inspect.signature(getattr(module, member)).parameters)
            assert have[: len(want)] == want, (name, member, have, want)
    monkeypatch.setenv("GRAPHSAN_NO_TRITON", "1")
    assert accessor(CUDA_LIKE) is None


def test_without_triton_a_cuda_tensor_gets_no_launcher_either():
    """Triton that does not import (here: blocked) leaves every accessor None, so the torch
    reference runs; the failed import is not tried again (Triton importable after it changes
    nothing)."""
    code = (
        "import sys, types; sys.modules['triton'] = None; "
        "from graphsan.lab.quant import kernels; "
        "x = types.SimpleNamespace(is_cuda=True); "
        "assert kernels.launchers() is None and not kernels.available(); "
        "assert kernels.nvfp4_launcher(x) is kernels.mxfp8_launcher(x) is kernels.gemm_launcher(x)"
        " is None; "
        "del sys.modules['triton']; assert kernels.launchers() is None"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
