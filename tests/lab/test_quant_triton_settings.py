"""The environment switch of the Triton kernels, GRAPHSAN_NO_TRITON: 1/true/yes/on turn them off,
0/false/no/off/empty do not, and a value that means nothing is one clear error naming the
variable, raised where the kernels are chosen (not at import, which imports no Triton)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
