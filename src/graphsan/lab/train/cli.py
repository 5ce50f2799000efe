"""`graphsan train`: options (Megatron names where they exist) and the entry point.

    graphsan train --preset tiny --train-iters 50 --eval-interval 10
    graphsan train --preset small --cuda-graph-modules attn mamba moe_router moe_preprocess \\
        --precision-config super-mixed --num-layers-at-end-in-bf16 2 --state-policy te218
    graphsan train --preset super --dry-run       # meta device: counts and recipe table only
    torchrun --nproc-per-node 2 -m graphsan.cli train --preset small \\
        --expert-model-parallel-size 2            # data + expert parallel, rank 0 prints
    torchrun --nproc-per-node 2 -m graphsan.cli train --use-distributed-optimizer \\
        --save-interval 10 --save ckpt            # sharded optimizer states; resume: --load ckpt

`run(argv) -> int` is what `graphsan train` calls (the parser is built only then);
`python -m graphsan.lab.train ...` runs the same thing on its own.
"""

from __future__ import annotations

import argparse
import signal
import sys

from graphsan.lab.choices import GRAPH_SCOPES, SCHEDULES, STATE_POLICIES
from graphsan.lab.models.args import PRESETS
from graphsan.lab.train.config import ConfigError, TrainConfig
from graphsan.lab.train.interrupt import COMMAND_LINE_SIGNALS, StoppedAtOnce, StopSignals

# out of memory: the options that size a run's memory are named in the line (README, "Exit
# statuses"; 1 is a diverged run, 2 a bad option, 3 and 4 other commands' findings and no GPU)
EXIT_OUT_OF_MEMORY = 5
# a checkpoint the system would not let us write (a full disk, a quota, an I/O error): the line
# names the file, the reason and the last good checkpoint
EXIT_SAVE_FAILED = 6


def _scopes(values: list[str]) -> tuple[str, ...]:
    """Accept `attn mamba` and `attn,mamba`."""
    return tuple(s for v in values for s in v.split(",") if s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    a = parser.add_argument
    a("--preset", default=d.preset, help=f"model preset: {', '.join(PRESETS)}")
    a("--dry-run", action="store_true", help="build on the meta device; print counts and recipes")
    a("--train-iters", type=int, default=d.train_iters, help="training iterations")
    a("--micro-batch-size", type=int, default=d.micro_batch_size, help="sequences per microbatch")
    a(
        "--global-batch-size",
        type=int,
        default=None,
        help="sequences per iteration over all ranks, a multiple of --micro-batch-size x "
        "ranks (default: --micro-batch-size x ranks, one microbatch per rank)",
    )
    a("--seq-length", type=int, default=d.seq_length, help="tokens per sequence")
    a("--lr", type=float, default=d.lr, help="AdamW learning rate (finite, >= 0)")
    a("--lr-warmup-iters", type=int, default=d.lr_warmup_iters, help="linear warm-up; 0: none")
    a("--eval-interval", type=int, default=d.eval_interval, help="0: no validation")
    a("--eval-iters", type=int, default=d.eval_iters, help="iterations per validation")
    a(
        "--manual-gc-interval",
        type=int,
        default=d.manual_gc_interval,
        help="> 0: disable automatic GC and gc.collect() every N iterations",
    )
    a("--save-interval", type=int, default=d.save_interval, help="0: no checkpoints")
    a("--save", default=d.save, help="checkpoint directory")
    a(
        "--load",
        default=None,
        metavar="DIR",
        help="resume from the checkpoint a run saved in DIR (its --save): weights, optimizer "
        "state and iteration",
    )
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
        help=f"graphed scopes: {', '.join(GRAPH_SCOPES)} (default: none, all eager)",
    )
    a(
        "--cuda-graph-warmup-steps",
        type=int,
        default=d.cuda_graph_warmup_steps,
        help="eager iterations before the graphs are captured",
    )
    a(
        "--state-policy",
        "--graph-state",  # the option's old name, kept as a deprecated alias
        dest="state_policy",
        default=d.state_policy,
        help=f"{' | '.join(STATE_POLICIES)}: how quantized modules treat their cached weight "
        "workspace across recipe changes; te218 models TE 2.18 (the #3316 bug). "
        "--graph-state is a deprecated alias",
    )
    a(
        "--microbatch-schedule",
        default=d.microbatch_schedule,
        choices=SCHEDULES,
        help="the order of a step's microbatch forwards and backwards: sequential (each "
        "forward, then its backward) or 1f1b (Megatron's one-forward-one-backward)",
    )
    a(
        "--microbatches-in-flight",
        type=int,
        default=d.microbatches_in_flight,
        help="1f1b: forwards before the first backward (microbatches holding activations)",
    )
    a(
        "--capture-schedule",
        default=None,
        choices=SCHEDULES,
        help="the order the per-microbatch graphs are captured in (default: the step's "
        "schedule); a different one replays them out of capture order, as a schedule that "
        "does not match the graphs' order does",
    )
    a(
        "--reuse-graph-buffers",
        action="store_true",
        help="a forward graph's static outputs go back to the pool once its backward graph is "
        "captured, as Transformer Engine's make_graphed_callables does with "
        "_reuse_graph_input_output_buffers (Megatron sets it on TE 2.7 and later); safe only "
        "when the step replays the graphs in their capture order",
    )
    a(
        "--precision-config",
        default=None,
        metavar="FILE",
        help="precision YAML or built-in name (super-mixed, mxfp8-all, ...) (default: BF16)",
    )
    a(
        "--num-layers-at-start-in-bf16",
        type=int,
        default=d.num_layers_at_start_in_bf16,
        help="the first N layers run in BF16, whatever the precision file says",
    )
    a(
        "--num-layers-at-end-in-bf16",
        type=int,
        default=d.num_layers_at_end_in_bf16,
        help="the last N layers run in BF16, whatever the precision file says",
    )
    a(
        "--expert-model-parallel-size",
        type=int,
        default=d.expert_model_parallel_size,
        help="under torchrun: ranks that split the routed experts among them (a divisor of "
        "the number of processes and of the expert count)",
    )
    a(
        "--distributed-timeout-minutes",
        type=float,
        default=d.distributed_timeout_minutes,
        help="under torchrun: how long a collective may wait for the other ranks",
    )
    a(
        "--use-distributed-optimizer",
        action="store_true",
        help="under torchrun: reduce-scatter the gradients and shard the fp32 masters and Adam "
        "states over the data-parallel ranks (Megatron's distributed optimizer)",
    )
    a("--seed", type=int, default=d.seed, help="weights and data")
    a("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    a(
        "--data-path",
        default=None,
        help="a local text file, read as bytes (default: synthetic tokens)",
    )
    a("--log-interval", type=int, default=d.log_interval, help="a log line every N iterations")
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
        load=args.load,
        empty_cache_on_save=args.empty_cache_on_save,
        cuda_graph_modules=_scopes(args.cuda_graph_modules),
        cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
        state_policy=args.state_policy,
        microbatch_schedule=args.microbatch_schedule,
        microbatches_in_flight=args.microbatches_in_flight,
        capture_schedule=args.capture_schedule,
        reuse_graph_buffers=args.reuse_graph_buffers,
        precision_config=args.precision_config,
        num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16,
        expert_model_parallel_size=args.expert_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        use_distributed_optimizer=args.use_distributed_optimizer,
        seed=args.seed,
        device=args.device,
        data_path=args.data_path,
        log_interval=args.log_interval,
        dry_run=args.dry_run,
        quiet=args.quiet,
    ).validate()


def _error(msg: str, status: int = 2) -> int:
    """One line on stderr; every rank of a torchrun job prints its own, named by its rank."""
    from graphsan.command_line import rank_from_env

    rank = rank_from_env()
    who = f" [rank {rank}]" if rank is not None else ""
    # one write of the whole line: ranks sharing torchrun's stderr never join two lines
    sys.stderr.write(f"graphsan train{who}: error: {msg}\n")
    sys.stderr.flush()
    return status


def main(args: argparse.Namespace) -> int:
    """Run `graphsan train`: a bad option gives one error line and exit status 2, a run that
    diverges one line and exit status 1, running out of memory one line naming the options to
    lower and EXIT_OUT_OF_MEMORY, a checkpoint the system would not write one line naming the
    last good one and EXIT_SAVE_FAILED; Ctrl-C, SIGTERM, SIGHUP and SIGUSR1 finish the
    iteration in flight, save it and give one line and 128 + the signal's number (at once
    outside training's loop, or for a second signal, which lets a checkpoint's write finish)."""
    stop = StopSignals(COMMAND_LINE_SIGNALS)
    try:
        with stop.at_once():
            return _train(args, stop)
    except StoppedAtOnce as e:  # raised between the handlers' removal and the return
        return _error(str(e), status=e.status)


def _train(args: argparse.Namespace, stop: StopSignals) -> int:
    from graphsan.lab.quant import PrecisionConfigError, RecipeError
    from graphsan.lab.train.checkpoint import SaveFailed
    from graphsan.lab.train.oom import is_out_of_memory, out_of_memory_line
    from graphsan.lab.train.trainer import TrainingDiverged, TrainingInterrupted, train

    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        return _error(str(e))
    try:
        train(cfg, stop=stop)
    except (ConfigError, PrecisionConfigError, RecipeError) as e:
        return _error(str(e))
    except TrainingDiverged as e:
        return _error(f"training diverged: {e} (a lower --lr may help)", status=1)
    except TrainingInterrupted as e:
        return _error(str(e), status=e.status)
    except SaveFailed as e:
        return _error(str(e), status=EXIT_SAVE_FAILED)
    except StoppedAtOnce as e:  # outside training's loop, or a second signal
        return _error(str(e), status=e.status)
    except KeyboardInterrupt:  # Ctrl-C where Python's own handler was in place
        return _error(str(StoppedAtOnce(signal.SIGINT)), status=128 + signal.SIGINT)
    except ValueError as e:
        # bad input found while building (model shape, data file, device): one line, no traceback
        return _error(str(e))
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
        if is_out_of_memory(e):
            return _error(out_of_memory_line(e, cfg), status=EXIT_OUT_OF_MEMORY)
        if stop.signum is None:
            raise
        # under torchrun a stopped job's other ranks may be gone: a collective then fails
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return _error(
            f"{StoppedAtOnce(stop.signum)}; the iteration in flight could not finish ({first})",
            status=128 + stop.signum,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from graphsan.command_line import DefaultsHelpFormatter, OneLineParser

    parser = OneLineParser(
        prog="graphsan train",
        description=__doc__.split("\n")[0],
        epilog="Ctrl-C, SIGTERM, SIGHUP or SIGUSR1 finish the iteration in flight, save it to "
        "--save and stop (a second one stops at once, but lets a checkpoint being written "
        "finish; the line says what was saved and where the last good checkpoint is). Exit "
        "statuses: 0 trained, 1 the loss "
        f"diverged, 2 a bad option, {EXIT_OUT_OF_MEMORY} out of memory (the line names the "
        f"options to lower), {EXIT_SAVE_FAILED} a checkpoint could not be written (a full "
        "disk: the line names the last good one), 128 + N stopped by signal N (130 Ctrl-C, "
        "143 SIGTERM).",
        formatter_class=DefaultsHelpFormatter,
    )
    add_arguments(parser)
    return parser


def run(argv: list[str] | None = None) -> int:
    return main(build_parser().parse_args(argv))
