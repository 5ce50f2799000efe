"""Lab numerics: MXFP8, NVFP4, FP8 and BF16 recipes, the quantized Linear, per-module precision.

Formats (plain torch, bit-exact to docs/numerics.md on CPU and CUDA; Triton kernels on CUDA,
`kernels/`; the constants in `formats`, the quantized tensors in `tensors`):

    from graphsan.lab.quant import mxfp8, nvfp4
    q = mxfp8.quantize(x, axis=-1, fmt="e4m3");  mxfp8.dequantize(q)
    q = nvfp4.quantize(x, axis=0, options=NVFP4Options(rht=True, generator=g))
    fp8.quantize(x, axis=-1)          # per-tensor current scaling, E4M3 (control recipe)

Recipes and the quantized Linear:

    r = get_recipe("nvfp4", order="legacy", rht=True, sr=True, weight_2d=True)  # Recipe
    r.kind, r.nvfp4                 # RecipeKind.NVFP4, NVFP4Settings(order="legacy", ...)
    lin = QuantLinear(1024, 1024, device="cuda"); lin.set_recipe(r); y = lin(x)
    lin.weight.main_grad            # float32 weight gradient, accumulated in place
    lin.workspace                   # WeightWorkspace(kind, rowwise, columnwise) or None
    lin.state_policy = "te218"      # TE 2.18's workspace behaviour (the #3316 bug) | "fixed"
    experts = GroupedQuantLinear(64, 256, 512, row_multiple=32)  # weight [64, 512, 256]
    y = experts(x_grouped, offsets)  # offsets: int32 [64] cumulative row counts, on the device

Per-module precision:

    cfg = PrecisionConfig.from_yaml("super-mixed")        # built-in name or a path
    table = apply_precision(model, cfg, layer_pattern="M*M-ME", first_bf16=0, last_bf16=2)
    print(format_precision_table(table))                  # [(module path, "recipe [why]")]

Built-in precision files: `super-mixed` (base NVFP4; MTP, `*.linear_qkv`, `*.linear_proj`,
`*.fc1_latent`, `*.fc2_latent` -> BF16; `*mixer.out_proj` -> MXFP8), `mxfp8-all`,
`mxfp8-base-nvfp4-outproj` (base MXFP8, `*mixer.out_proj` -> NVFP4). Module names the rules expect
from the model: attention `linear_qkv` / `linear_proj`, Mamba `mixer.in_proj` / `mixer.out_proj`,
latent MoE `fc1_latent` / `fc2_latent`, routed experts `experts.fc1` / `experts.fc2` (one
GroupedQuantLinear each, all experts), MTP under `mtp.`, layers at `layers.{i}.`.
"""

from . import fp8, mxfp8, nvfp4, rht
from .grouped import GroupedQuantLinear
from .linear import QuantLinear, QuantModule, SkipFlag, WeightWorkspace
from .options import NVFP4Options
from .precision import (
    PrecisionConfig,
    PrecisionConfigError,
    apply_precision,
    builtin_configs,
    format_precision_table,
)
from .recipe import (
    MXFP8Settings,
    NVFP4Settings,
    Quantizer,
    Recipe,
    RecipeError,
    RecipeKind,
    RowGroups,
    get_recipe,
)

__all__ = [
    "PrecisionConfig",
    "PrecisionConfigError",
    "GroupedQuantLinear",
    "MXFP8Settings",
    "NVFP4Options",
    "NVFP4Settings",
    "QuantLinear",
    "QuantModule",
    "Quantizer",
    "Recipe",
    "RecipeError",
    "RecipeKind",
    "RowGroups",
    "SkipFlag",
    "WeightWorkspace",
    "apply_precision",
    "builtin_configs",
    "format_precision_table",
    "fp8",
    "get_recipe",
    "mxfp8",
    "nvfp4",
    "rht",
]
