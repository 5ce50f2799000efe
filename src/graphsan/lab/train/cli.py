"""`graphsan train`: options (Megatron names where they exist) and the entry point.

    graphsan train --preset tiny --train-iters 50 --eval-interval 10
    graphsan train --preset small --cuda-graph-modules attn mamba moe_router moe_preprocess \\
        --precision-config super-mixed --num-layers-at-end-in-bf16 2 --graph-state te218
    graphsan train --preset super --dry-run       # meta device: counts and recipe table only

`add_arguments(parser)` and `main(args) -> int` are what `graphsan/cli.py` wires in;
`python -m graphsan.lab.train ...` runs the same thing on its own.
"""

from __future__ import annotations

import argparse
import sys

from graphsan.lab.models import PRESETS
from graphsan.lab.train.config import GRAPH_STATES, ConfigError, TrainConfig
from graphsan.lab.train.graphs import GRAPH_SCOPES


def _scopes(values: list[str]) -> tuple[str, ...]:
    """Accept `attn mamba` and `attn,mamba`."""
    return tuple(s for v in values for s in v.split(",") if s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    a = parser.add_argument
    a("--preset", default=d.preset, help=f"model preset: {', '.join(PRESETS)} (default {d.preset})")
    a("--dry-run", action="store_true", help="build on the meta device; print counts and recipes")
    a("--train-iters", type=int, default=d.train_iters)
    a("--micro-batch-size", type=int, default=d.micro_batch_size)
    a("--global-batch-size", type=int, default=None, help="default: --micro-batch-size")
    a("--seq-length", type=int, default=d.seq_length)
    a("--lr", type=float, default=d.lr)
    a("--lr-warmup-iters", type=int, default=d.lr_warmup_iters)
    a("--eval-interval", type=int, default=d.eval_interval, help="0: no validation")
    a("--eval-iters", type=int, default=d.eval_iters)
    a(
        "--manual-gc-interval",
        type=int,
        default=d.manual_gc_interval,
        help="> 0: disable automatic GC and gc.collect() every N iterations",
    )
    a("--save-interval", type=int, default=d.save_interval, help="0: no checkpoints")
    a("--save", default=d.save, help=f"checkpoint directory (default {d.save})")
    a(
        "--empty-cache-on-save",
        action="store_true",
        help="torch.cuda.empty_cache() after each save (as Megatron Core 0.19)",
    )
    a(
        "--cuda-graph-modules",
        "--cuda-graph-scope",
        nargs="+",
        default=[],
        metavar="SCOPE",
        help=f"graphed scopes: {', '.join(GRAPH_SCOPES)}",
    )
    a("--cuda-graph-warmup-steps", type=int, default=d.cuda_graph_warmup_steps)
    a(
        "--graph-state",
        default=d.graph_state,
        help=f"{' | '.join(GRAPH_STATES)}: te218 models TE 2.18's graph wrapper (the #3316 bug)",
    )
    a(
        "--precision-config",
        default=None,
        metavar="FILE",
        help="precision YAML or built-in name (super-mixed, mxfp8-all, ...); default BF16",
    )
    a("--num-layers-at-start-in-bf16", type=int, default=d.num_layers_at_start_in_bf16)
    a("--num-layers-at-end-in-bf16", type=int, default=d.num_layers_at_end_in_bf16)
    a("--seed", type=int, default=d.seed)
    a("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    a("--data-path", default=None, help="a local text file (bytes); default synthetic tokens")
    a("--log-interval", type=int, default=d.log_interval)
    a("--quiet", action="store_true", help="no progress bar or log lines")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        preset=args.preset,
        train_iters=args.train_iters,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        seq_length=args.seq_length,
        lr=args.lr,
        lr_warmup_iters=args.lr_warmup_iters,
        eval_interval=args.eval_interval,
        eval_iters=args.eval_iters,
        manual_gc_interval=args.manual_gc_interval,
        save_interval=args.save_interval,
        save=args.save,
        empty_cache_on_save=args.empty_cache_on_save,
        cuda_graph_modules=_scopes(args.cuda_graph_modules),
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        graph_state=args.graph_state,
        precision_config=args.precision_config,
        num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16,
        seed=args.seed,
        device=args.device,
        data_path=args.data_path,
        log_interval=args.log_interval,
        dry_run=args.dry_run,
        quiet=args.quiet,
    ).validate()


def _error(msg: str) -> int:
    print(f"graphsan train: error: {msg}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """Run `graphsan train`; bad options give one error line and exit status 2."""
    from graphsan.lab.quant import PrecisionConfigError, RecipeError
    from graphsan.lab.train.trainer import train

    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        return _error(str(e))
    try:
        train(cfg)
    except (ConfigError, PrecisionConfigError, RecipeError) as e:
        return _error(str(e))
    except ValueError as e:
        # bad input found while building (model shape, data file, device): one line, no traceback
        return _error(str(e))
    return 0


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def run(argv: list[str] | None = None) -> int:
    parser = _OneLineParser(prog="graphsan train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return main(parser.parse_args(argv))
