"""A recipe's kind is a `RecipeKind` (a name from Python, a precision file or a command line is
parsed into it, and a bad one is one error naming the kinds), and the kinds that have settings
carry them as one typed value each: `MXFP8Settings`, `NVFP4Settings`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphsan.lab.quant import (
    MXFP8Settings,
    NVFP4Options,
    NVFP4Settings,
    PrecisionConfig,
    PrecisionConfigError,
    Recipe,
    RecipeError,
    RecipeKind,
    get_recipe,
)

UNKNOWN = "unknown recipe 'fp4'; expected one of ['bf16', 'fp8', 'mxfp8', 'nvfp4']"


@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp8", "nvfp4"])
def test_a_name_parses_into_its_kind_which_still_reads_as_the_name(name):
    r = get_recipe(name)
    assert r.kind is RecipeKind(name) and Recipe(name) == r == Recipe(RecipeKind(name))
    assert r.kind == name and str(r.kind) == name and f"{r.kind}" == name
    assert r.quantized == (name != "bf16")


def test_only_mxfp8_and_nvfp4_carry_settings_and_each_only_its_own():
    assert get_recipe("mxfp8").settings == MXFP8Settings() and get_recipe("mxfp8").nvfp4 is None
    assert get_recipe("nvfp4").settings == NVFP4Settings() and get_recipe("nvfp4").mxfp8 is None
    assert get_recipe("bf16").settings is None and get_recipe("fp8").settings is None
    legacy = get_recipe("nvfp4", order="legacy", sr=False)
    assert legacy == Recipe("nvfp4", nvfp4=NVFP4Settings(order="legacy", sr=False))
    assert legacy.describe() == "nvfp4(legacy, rht, 2d-weights)"
    assert get_recipe("mxfp8", fp8_format="hybrid").describe() == "mxfp8(hybrid)"
    with pytest.raises(RecipeError, match=r"recipe bf16: nvfp4=NVFP4Settings\(.*\); expected None"):
        Recipe("bf16", nvfp4=NVFP4Settings())
    with pytest.raises(RecipeError, match="recipe nvfp4: nvfp4=MXFP8Settings.*; expected NVFP4"):
        Recipe("nvfp4", nvfp4=MXFP8Settings())
    with pytest.raises(RecipeError, match="recipe mxfp8: nvfp4="):
        dataclasses.replace(legacy, kind="mxfp8")


def test_a_bad_kind_is_one_error_naming_the_kinds():
    for make in (lambda: get_recipe("fp4"), lambda: Recipe("fp4")):
        with pytest.raises(RecipeError) as err:
            make()
        assert str(err.value) == UNKNOWN
    with pytest.raises(ValueError, match="recipe nvfp4: order='newest'; expected one of"):
        NVFP4Settings(order="newest")
    with pytest.raises(ValueError, match="recipe nvfp4: sr='yes'; expected true or false"):
        get_recipe("nvfp4", sr="yes")
    with pytest.raises(ValueError, match="recipe mxfp8: fp8_format='e5m2'; expected one of"):
        get_recipe("mxfp8", fp8_format="e5m2")


def test_a_precision_file_parses_kinds_and_settings(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(
        "base: {kind: nvfp4, order: legacy, rht: false}\n"
        "recipes:\n  hybrid: {kind: mxfp8, fp8_format: hybrid}\n"
        "rules:\n  - {match: '*.a', recipe: mxfp8}\n  - {match: '*.b', recipe: hybrid}\n"
    )
    cfg = PrecisionConfig.from_yaml(f)
    assert cfg.base.kind is RecipeKind.NVFP4
    assert cfg.base.nvfp4 == NVFP4Settings(order="legacy", rht=False)
    kinds = [(r.recipe.kind, r.recipe.settings) for r in cfg.rules]
    assert kinds == [
        (RecipeKind.MXFP8, MXFP8Settings()),
        (RecipeKind.MXFP8, MXFP8Settings("hybrid")),
    ]
    assert all(type(k) is RecipeKind for k, _ in kinds)


@pytest.mark.parametrize(
    "text,message",
    [
        ("base: {kind: fp4}\n", "key 'base.kind' is 'fp4'; expected one of ['bf16', 'fp8',"),
        ("base: fp4\n", "key 'base': unknown recipe 'fp4'; expected one of bf16, fp8, mxfp8,"),
        ("base: {kind: mxfp8, sr: true}\n", "unknown option 'sr'; expected one of ['fp8_format']"),
    ],
)
def test_a_bad_kind_in_a_precision_file_is_one_line(tmp_path, text, message):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    with pytest.raises(PrecisionConfigError) as err:
        PrecisionConfig.from_yaml(f)
    assert str(err.value).startswith(f"{f}: ") and "\n" not in str(err.value)
    assert message in str(err.value), err.value


def test_the_settings_give_each_slot_its_treatment():
    g = torch.Generator().manual_seed(0)
    nv = NVFP4Settings(order="legacy")
    assert nv.options("weight", g) == NVFP4Options(block_2d=True, order="legacy")
    assert nv.options("input", g) == NVFP4Options(order="legacy", rht=True)
    assert nv.options("grad_output", g) == NVFP4Options(order="legacy", rht=True, generator=g)
    plain = NVFP4Settings(rht=False, sr=False, weight_2d=False)
    assert {plain.options(role, g) for role in ("weight", "input", "grad_output")} == {
        NVFP4Options()
    }
    hybrid = MXFP8Settings("hybrid")
    assert [hybrid.element_format(r) for r in ("weight", "input", "grad_output")] == [
        "e4m3",
        "e4m3",
        "e5m2",
    ]
    assert MXFP8Settings().element_format("grad_output") == "e4m3"
