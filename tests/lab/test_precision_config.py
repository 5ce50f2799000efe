"""Per-module precision: YAML rules (first match wins), first/last N layers in BF16, built-ins, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsan.lab.quant import (
    GroupedQuantLinear,
    PrecisionConfig,
    PrecisionConfigError,
    QuantLinear,
    QuantModule,
    apply_precision,
    builtin_configs,
    format_precision_table,
    get_recipe,
)
from graphsan.lab.quant.precision import layer_index


class Mixer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        if kind == "M":
            self.in_proj = QuantLinear(32, 32)
            self.out_proj = QuantLinear(32, 32)
        elif kind == "*":
            self.linear_qkv = QuantLinear(32, 96)
            self.linear_proj = QuantLinear(32, 32)
        else:  # latent MoE
            self.fc1_latent = QuantLinear(32, 16)
            self.fc2_latent = QuantLinear(16, 32)
            self.experts = Experts()


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = GroupedQuantLinear(2, 32, 64)
        self.fc2 = GroupedQuantLinear(2, 64, 32)


class Layer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.mixer = Mixer(kind)


class Toy(nn.Module):
    layer_pattern = "M*ME|M*"

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer(k) for k in self.layer_pattern.replace("|", ""))
        self.mtp = nn.ModuleList([Layer("M")])
        self.head = nn.Linear(32, 8)


def recipes_of(model):
    return {p: m.recipe.kind for p, m in model.named_modules() if isinstance(m, QuantModule)}


def test_super_mixed():
    model = Toy()
    table = apply_precision(model, PrecisionConfig.from_yaml("super-mixed"))
    kinds = recipes_of(model)
    assert kinds["layers.0.mixer.out_proj"] == "mxfp8"
    assert kinds["layers.0.mixer.in_proj"] == "nvfp4"
    assert kinds["layers.1.mixer.linear_qkv"] == "bf16"
    assert kinds["layers.1.mixer.linear_proj"] == "bf16"
    assert (
        kinds["layers.3.mixer.fc1_latent"] == "bf16"
        and kinds["layers.3.mixer.fc2_latent"] == "bf16"
    )
    assert kinds["layers.3.mixer.experts.fc1"] == "nvfp4"
    assert kinds["layers.3.mixer.experts.fc2"] == "nvfp4"
    assert kinds["mtp.0.mixer.out_proj"] == "bf16"  # the MTP rule comes first
    assert kinds["mtp.0.mixer.in_proj"] == "bf16"
    assert dict(table)["layers.0.mixer.out_proj"] == "mxfp8(e4m3) [rule *mixer.out_proj]"
    assert dict(table)["layers.0.mixer.in_proj"].endswith("[base]")
    assert len(table) == len(kinds)  # every quantized module, nothing else (nn.Linear skipped)
    text = format_precision_table(table)
    assert "layers.0.mixer.out_proj" in text and "mxfp8" in text


def test_first_and_last_layers_bf16_counted_over_the_pattern():
    model = Toy()
    apply_precision(model, "super-mixed", first_bf16=1, last_bf16=2)  # 6 layers from the pattern
    kinds = recipes_of(model)
    assert kinds["layers.0.mixer.out_proj"] == "bf16"  # first layer wins over the rule
    assert kinds["layers.2.mixer.out_proj"] == "mxfp8"
    assert kinds["layers.3.mixer.experts.fc2"] == "nvfp4"
    assert (
        kinds["layers.4.mixer.in_proj"] == "bf16" and kinds["layers.5.mixer.linear_qkv"] == "bf16"
    )
    # an explicit layer count that is larger than the model: only layer indices >= 10-2 are last
    apply_precision(model, "super-mixed", layer_pattern=10, last_bf16=2)
    assert recipes_of(model)["layers.5.mixer.linear_qkv"] == "bf16"  # by the rule
    assert recipes_of(model)["layers.4.mixer.in_proj"] == "nvfp4"


def test_other_builtins_and_base_override(tmp_path):
    assert {"super-mixed", "mxfp8-all", "mxfp8-base-nvfp4-outproj"} <= set(builtin_configs())
    model = Toy()
    apply_precision(model, "mxfp8-all")
    assert set(recipes_of(model).values()) == {"mxfp8"}
    apply_precision(model, "mxfp8-base-nvfp4-outproj")
    kinds = recipes_of(model)
    assert (
        kinds["layers.0.mixer.out_proj"] == "nvfp4"
        and kinds["layers.1.mixer.linear_qkv"] == "mxfp8"
    )
    cfg = PrecisionConfig.from_yaml("super-mixed", base=get_recipe("fp8"))
    apply_precision(model, cfg)
    assert recipes_of(model)["layers.0.mixer.in_proj"] == "fp8"
    apply_precision(model, get_recipe("bf16"))
    assert set(recipes_of(model).values()) == {"bf16"}


def test_named_recipes_inline_options_and_first_match_wins(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(
        """
base: {kind: nvfp4, rht: false}
recipes:
  legacy4: {kind: nvfp4, order: legacy, sr: false}
rules:
  - {match: "layers.[01].*out_proj", recipe: legacy4}
  - {match: "*out_proj", recipe: mxfp8}
  - {match: "*in_proj", recipe: {kind: mxfp8, fp8_format: hybrid}}
last_bf16: 1
"""
    )
    model = Toy()
    table = dict(apply_precision(model, PrecisionConfig.from_yaml(f)))
    m = dict(model.named_modules())
    assert m["layers.0.mixer.out_proj"].recipe == get_recipe("nvfp4", order="legacy", sr=False)
    assert m["layers.2.mixer.out_proj"].recipe.kind == "mxfp8"
    assert m["layers.2.mixer.in_proj"].recipe == get_recipe("mxfp8", fp8_format="hybrid")
    assert m["layers.1.mixer.linear_qkv"].recipe == get_recipe("nvfp4", rht=False)
    assert table["layers.5.mixer.linear_qkv"] == "bf16 [last 1 layers]"


def test_layer_index():
    assert layer_index("layers.12.mixer.out_proj") == 12
    assert layer_index("decoder.layers.3.mlp") == 3
    assert layer_index("mtp.layers.0.mixer.out_proj") is None
    assert layer_index("embedding") is None
    assert layer_index("xlayers.3.a") is None


@pytest.mark.parametrize(
    "text,needles",
    [
        ("base: fp4\n", ["base", "unknown recipe 'fp4'", "bf16"]),
        (
            "base: nvfp4\nrules:\n  - {match: '*.a[b', recipe: bf16}\n",
            ["rules[0].match", "unclosed"],
        ),
        (
            "base: nvfp4\nrules:\n  - {match: 'a b', recipe: bf16}\n",
            ["rules[0].match", "characters"],
        ),
        (
            "base: nvfp4\nrules:\n  - {match: '', recipe: bf16}\n",
            ["rules[0].match", "non-empty glob"],
        ),
        ("base: nvfp4\nrules:\n  - {match: '*.x', recipe: fp5}\n", ["rules[0].recipe", "'fp5'"]),
        ("base: nvfp4\nrules:\n  - {match: '*.x'}\n", ["rules[0]", "'match' and 'recipe'"]),
        ("base: nvfp4\nrules: {a: b}\n", ["'rules'", "list"]),
        ("base: {kind: nvfp4, rth: true}\n", ["base", "'rth'", "rht"]),
        ("base: {kind: nvfp4, order: newest}\n", ["base", "order", "legacy"]),
        ("base: nvfp4\nlast_bf16: -1\n", ["last_bf16", "non-negative integer"]),
        ("base: nvfp4\nfirst_bf16: many\n", ["first_bf16", "non-negative integer"]),
        ("rules: []\n", ["'base' is missing"]),
        ("base: nvfp4\nbse: 1\n", ["unknown key 'bse'", "base"]),
        ("base: nvfp4\n  rules: [\n", ["malformed YAML"]),
        ("- a\n- b\n", ["top level", "mapping"]),
        ("base: nvfp4\nrecipes: {nvfp4: {kind: mxfp8}}\n", ["recipes.nvfp4", "new name"]),
    ],
)
def test_bad_files_name_file_key_and_expectation(tmp_path, text, needles):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(PrecisionConfigError) as err:
        PrecisionConfig.from_yaml(f)
    msg = str(err.value)
    assert str(f) in msg or "malformed" in msg
    assert str(f) in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_missing_file_and_bad_arguments():
    with pytest.raises(PrecisionConfigError, match="no such precision file.*super-mixed"):
        PrecisionConfig.from_yaml("super-mixd")
    model = Toy()
    with pytest.raises(PrecisionConfigError, match="layer_pattern"):
        apply_precision(model, "super-mixed", layer_pattern=3.5)
    with pytest.raises(PrecisionConfigError, match="last_bf16"):
        apply_precision(model, "super-mixed", last_bf16=-2)
    flat = nn.Sequential(QuantLinear(8, 8))
    with pytest.raises(PrecisionConfigError, match="no layers found"):
        apply_precision(flat, "super-mixed", last_bf16=1)


def test_applied_recipes_run():
    model = Toy()
    apply_precision(model, "super-mixed", last_bf16=1)
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    for layer in model.layers[:3]:
        mixer = layer.mixer
        for mod in mixer.children():
            if isinstance(mod, QuantLinear) and mod.in_features == 32:
                mod(x).float().sum().backward()
    assert model.layers[0].mixer.out_proj.workspace.kind == "mxfp8"
    assert model.layers[0].mixer.in_proj.workspace.kind == "nvfp4"
    assert model.layers[1].mixer.linear_qkv.workspace is None


def test_rules_set_the_grouped_experts_recipe(tmp_path):
    """One grouped module per projection holds every expert: a glob on its path sets them all."""
    f = tmp_path / "experts.yaml"
    f.write_text(
        """
base: nvfp4
rules:
  - {match: "*.experts.fc1", recipe: mxfp8}
  - {match: "*.experts.*", recipe: bf16}
"""
    )
    model = Toy()
    table = dict(apply_precision(model, PrecisionConfig.from_yaml(f)))
    kinds = recipes_of(model)
    assert kinds["layers.3.mixer.experts.fc1"] == "mxfp8"
    assert kinds["layers.3.mixer.experts.fc2"] == "bf16"
    assert kinds["layers.3.mixer.fc1_latent"] == "nvfp4"
    assert table["layers.3.mixer.experts.fc1"] == "mxfp8(e4m3) [rule *.experts.fc1]"
    assert "layers.3.mixer.experts" not in table  # the container is not a quantized module


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("base: [\n  a: : b\n", "line 2, column 6: expected the node content, but found ':'"),
        ('base: "abc\n', "line 2, column 1: found unexpected end of stream"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper than the YAML reader follows"),
    ],
    ids=["a bad flow", "an open quote", "deep nesting"],
)
def test_malformed_yaml_is_one_line(tmp_path, text, line):
    """PyYAML's own message is five lines, with a caret under the column."""
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(PrecisionConfigError) as err:
        PrecisionConfig.from_yaml(f)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{f}: malformed YAML") and line in msg, msg
