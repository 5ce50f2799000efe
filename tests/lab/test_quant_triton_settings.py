"""The two environment switches of the Triton kernels: GRAPHSAN_NO_TRITON (1/true/yes/on turn
them off; 0/false/no/off/empty do not) and GRAPHSAN_TRITON_VARIANT (checked where the kernels are
chosen, not at import); a value that means nothing is one clear error naming the variable."""

from __future__ import annotations

import importlib

import pytest
import torch

from graphsan.lab.quant import triton_kernels as tk

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


def test_unknown_variant_is_not_an_import_error(monkeypatch):
    monkeypatch.setenv("GRAPHSAN_TRITON_VARIANT", "v9")
    importlib.reload(tk)  # reads nothing from the environment at import
    monkeypatch.delenv("GRAPHSAN_TRITON_VARIANT")
    importlib.reload(tk)
    assert tk.default_variant() == tk.DEFAULT_VARIANT


def test_unknown_variant_fails_where_the_kernels_are_chosen(monkeypatch):
    monkeypatch.setenv("GRAPHSAN_TRITON_VARIANT", "v9")
    with pytest.raises(tk.TritonSettingError) as err:
        tk.default_variant()
    msg = str(err.value)
    assert msg.startswith("GRAPHSAN_TRITON_VARIANT='v9': expected one of ")
    assert all(v in msg for v in tk.VARIANTS) and "\n" not in msg
    x = torch.zeros(32, 32, dtype=torch.bfloat16)
    with pytest.raises(tk.TritonSettingError):
        tk.mxfp8_quantize(x)  # the default is read before anything is launched
    with pytest.raises(tk.TritonSettingError):
        tk.nvfp4_quantize(x)


@pytest.mark.parametrize("value", tk.VARIANTS)
def test_variant_from_the_environment(monkeypatch, value):
    monkeypatch.setenv("GRAPHSAN_TRITON_VARIANT", value)
    assert tk.default_variant() == value
    monkeypatch.setenv("GRAPHSAN_TRITON_VARIANT", "")
    assert tk.default_variant() == tk.DEFAULT_VARIANT
