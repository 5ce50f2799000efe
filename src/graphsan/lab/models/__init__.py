"""Models of the lab: a Nemotron-H-style hybrid (Mamba-2 / attention / latent MoE) with MTP."""

from graphsan.lab.models.args import PRESETS, ModelArgs, get_preset
from graphsan.lab.models.hybrid import HybridLayer, HybridLM, build_model, count_parameters

__all__ = [
    "PRESETS",
    "HybridLM",
    "HybridLayer",
    "ModelArgs",
    "build_model",
    "count_parameters",
    "get_preset",
]
