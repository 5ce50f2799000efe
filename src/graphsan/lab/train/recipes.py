"""The precision recipes bound to a model (the precision config, the BF16 layers at the ends,
the BF16 output layer), the table that shows them, and `--dry-run`, which prints it."""

from __future__ import annotations

import re

from graphsan.lab.models import build_model, count_parameters
from graphsan.lab.quant import (
    PrecisionConfig,
    PrecisionConfigError,
    QuantModule,
    SkipFlag,
    apply_precision,
    get_recipe,
)
from graphsan.lab.quant.precision import CONFIG_DIR
from graphsan.lab.train.config import TrainConfig
from graphsan.lab.train.metrics import Metrics


def bind_precision(model, cfg: TrainConfig):
    """Apply the precision config; returns (table, ambient recipe). The output layer stays BF16:
    in Megatron it is not a TE module, so no recipe applies to it."""
    config = (
        PrecisionConfig.uniform(get_recipe("bf16"))
        if cfg.precision_config is None
        else PrecisionConfig.from_yaml(cfg.precision_config)
    )
    table = apply_precision(
        model,
        config,
        layer_pattern=model.args.pattern,
        first_bf16=cfg.num_layers_at_start_in_bf16 or None,
        last_bf16=cfg.num_layers_at_end_in_bf16 or None,
    )
    check_rules_match(config, [p for p, _ in table], cfg.preset)
    model.output_layer.set_recipe(get_recipe("bf16"))
    table = [(p, "bf16 [output layer]" if p == "output_layer" else d) for p, d in table]
    return table, config.base


def share_skip_flag(model, skip: SkipFlag, cfg: TrainConfig) -> None:
    """Every quantized module (QuantLinear and the experts' GroupedQuantLinear) reads the one
    weight-workspace skip flag and follows the run's state policy."""
    for m in model.modules():
        if isinstance(m, QuantModule):
            m.skip_weight_update = skip
            m.state_policy = cfg.state_policy


def check_rules_match(config: PrecisionConfig, paths: list[str], preset: str) -> None:
    """A rule that matches no module is a typo or a file written for another model: refuse it.
    The built-in files are exempt: `super-mixed` keeps Megatron's `*.mtp.*` rule, which no
    module path of the lab's model has."""
    if config.source.startswith(str(CONFIG_DIR)):
        return
    for i, rule in enumerate(config.rules):
        if not any(rule.matches(p) for p in paths):
            examples = ", ".join(paths[:2] + paths[-1:])
            raise PrecisionConfigError(
                f"{config.source}: key 'rules[{i}].match' {rule.pattern!r} (recipe {rule.name}) "
                f"matches no module of the {preset} model; expected a glob over module paths "
                f"such as {examples}"
            )


def summarize_table(table: list[tuple[str, str]]) -> str:
    """The recipe table with layer indices folded: one row per (module kind, recipe)."""
    rows: dict[tuple[str, str], list[int]] = {}
    for path, desc in table:
        m = re.match(r"^(mtp\.)?layers\.(\d+)\.(.*)$", path)
        key_path = path if not m else f"{m.group(1) or ''}layers.{{i}}.{m.group(3)}"
        rows.setdefault((key_path, desc), []).append(int(m.group(2)) if m else -1)
    out = []
    width = max(len(p) for p, _ in rows) if rows else 6
    for (path, desc), idx in rows.items():
        layers = sorted({i for i in idx if i >= 0})
        where = f"  layers {_ranges(layers)}" if layers else ""
        out.append(f"{path:<{width}}  {desc:<28} x{len(idx)}{where}")
    return "\n".join([f"{'module':<{width}}  recipe", *out])


def _ranges(xs: list[int]) -> str:
    parts, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts)


def dry_run(cfg: TrainConfig, metrics: Metrics) -> None:
    """Build on the meta device (no memory), print parameter counts and the recipe table."""
    model = build_model(cfg.model_args(), device="meta")
    total, active = count_parameters(model)
    table, base = bind_precision(model, cfg)
    metrics.print(
        f"preset {cfg.preset}: pattern {model.args.pattern} ({len(model.args.pattern)} layers)"
    )
    metrics.print(
        f"parameters: total {total:,} ({total / 1e9:.2f} B), active {active:,} "
        f"({active / 1e9:.2f} B)"
    )
    metrics.print(
        f"precision: {cfg.precision_config or 'bf16 everywhere'} (base {base.describe()})"
    )
    metrics.print(summarize_table(table))
