"""The lab trainer: Megatron-style knobs, per-scope CUDA graphs, validation transitions.

from graphsan.lab.train import TrainConfig, train
result = train(TrainConfig(preset="tiny", train_iters=10, quiet=True))
result.losses, result.eval_losses, result.main_grads
"""

from graphsan.lab.choices import GRAPH_SCOPES
from graphsan.lab.train.config import ConfigError, TrainConfig

__all__ = ["GRAPH_SCOPES", "ConfigError", "TrainConfig", "TrainResult", "train"]


def __getattr__(name: str):
    # the trainer imports torch: loaded on first use, so the command line's help and checks
    # (graphsan.lab.train.cli, .config, .callbacks) start without it
    if name in ("TrainResult", "train"):
        from graphsan.lab.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
