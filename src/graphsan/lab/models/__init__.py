"""Models of the lab: a Nemotron-H-style hybrid (Mamba-2 / attention / latent MoE) with MTP."""

from graphsan.lab.models.args import PRESETS, ModelArgs, get_preset

__all__ = [
    "PRESETS",
    "HybridLM",
    "HybridLayer",
    "ModelArgs",
    "build_model",
    "count_parameters",
    "get_preset",
]


def __getattr__(name: str):
    # the modules import torch: loaded on first use, so the presets load without it
    if name in ("HybridLayer", "HybridLM", "build_model", "count_parameters"):
        from graphsan.lab.models import hybrid

        return getattr(hybrid, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
