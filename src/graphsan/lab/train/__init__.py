"""The lab trainer: Megatron-style knobs, per-scope CUDA graphs, validation transitions.

from graphsan.lab.train import TrainConfig, train
result = train(TrainConfig(preset="tiny", train_iters=10, quiet=True))
result.losses, result.eval_losses, result.main_grads
"""

from graphsan.lab.train.config import ConfigError, TrainConfig
from graphsan.lab.train.graphs import GRAPH_SCOPES
from graphsan.lab.train.trainer import TrainResult, train

__all__ = ["GRAPH_SCOPES", "ConfigError", "TrainConfig", "TrainResult", "train"]
