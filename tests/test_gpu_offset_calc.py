"""PyTorch's OffsetCalculator as captured on a GPU (tests/gpu/offset_calc_layout.py, in a
subprocess): graphsan.core.offset_calc finds it in strided elementwise kernels with the
dimensions and sizes TensorIterator kept, and the operands' data pointers are still references."""

from __future__ import annotations

import json

import pytest

from tests.gpu_programs import run_script

pytestmark = pytest.mark.gpu


def test_strided_kernels_carry_a_calculator_and_keep_their_pointers():
    res = run_script("offset_calc_layout.py")
    print(json.dumps(res, indent=1))  # where the calculator sits in the closure, for the docs
    calcs = [(n, c) for n in res["strided"] for c in n["calculators"]]
    two = [n for n, c in calcs if c["dims"] == 2 and c["divisors"] == [48, 51]]
    three = [n for n, c in calcs if c["dims"] == 3 and c["divisors"] == [6, 7, 10]]
    assert two and three, res
    assert all(c["bytes"] == 404 for _, c in calcs), res
    assert two[0]["operands_found"]["2"] == 3, res
    assert three[0]["operands_found"]["3"] == 3, res
