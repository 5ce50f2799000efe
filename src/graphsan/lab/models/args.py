"""Model arguments and presets for the lab's Nemotron-H-style hybrid.

A layer pattern string names the mixer of each layer: `M` Mamba-2, `*` attention (GQA, no
positional embedding), `E` latent MoE, `-` dense MLP. Presets:

- `tiny`:  a CPU test model that runs a training step in well under a second.
- `small`: the single-GPU default (pattern `MEM*EMEM*EME`, hidden 512, 64 experts top-6).
- `super`: the Nemotron 3 Super shape (88 layers: 40 Mamba-2, 40 latent MoE, 8 attention; hidden
  4096; 512 experts top-22, latent 1024). Build it on the `meta` device only (parameter counts and
  the recipe table); the layer order is an approximation with the published layer counts.

Every Linear dimension is a multiple of 32 so that every recipe (MXFP8 needs 32-element blocks
in both directions, NVFP4 16) can be applied to any Linear; `ModelArgs.validate` checks it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LAYER_TYPES = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}


@dataclass
class ModelArgs:
    """Shapes and options of the hybrid model (Megatron / Nemotron-H names where they exist)."""

    pattern: str = "M*EM"
    vocab_size: int = 256
    hidden_size: int = 64
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # Mamba-2
    mamba_num_heads: int = 16
    mamba_head_dim: int = 8
    mamba_state_dim: int = 8
    mamba_num_groups: int = 1
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 16
    # attention (GQA)
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 16
    # dense MLP (`-` layers), squared ReLU
    ffn_hidden_size: int = 128
    # latent MoE
    num_experts: int = 8
    moe_router_topk: int = 2
    moe_latent_size: int = 32
    moe_ffn_hidden_size: int = 64
    moe_shared_expert_intermediate_size: int = 64
    moe_router_topk_scaling_factor: float = 1.0
    moe_router_bias_update_rate: float = 1e-3
    moe_pad_multiple: int = 32  # routing-map padding: each expert's token count % this == 0
    # multi-token prediction: one extra depth sharing the embedding and the output head
    mtp_num_layers: int = 1
    mtp_pattern: str = "*"
    mtp_loss_scaling_factor: float = 0.1

    @property
    def mamba_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_in_proj_size(self) -> int:
        """in_proj output: [z, x, B, C, dt]."""
        gn = self.mamba_num_groups * self.mamba_state_dim
        return 2 * self.mamba_inner + 2 * gn + self.mamba_num_heads

    def validate(self) -> ModelArgs:
        """Raise ValueError naming the first bad field and what was expected."""
        for pat_name in ("pattern", "mtp_pattern"):
            pat = getattr(self, pat_name)
            bad = sorted(set(pat) - set(LAYER_TYPES))
            if bad or (pat_name == "pattern" and not pat):
                raise ValueError(
                    f"model {pat_name} {pat!r}: unknown layer type(s) {bad}; expected a "
                    f"non-empty string of {''.join(LAYER_TYPES)} (M Mamba-2, * attention, "
                    "E latent MoE, - MLP)"
                )
        if self.mamba_num_heads % self.mamba_num_groups:
            raise ValueError(
                f"mamba_num_heads={self.mamba_num_heads} must be a multiple of "
                f"mamba_num_groups={self.mamba_num_groups}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"moe_router_topk={self.moe_router_topk} must be <= num_experts={self.num_experts}"
            )
        dims = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "mamba in_proj output (2*inner + 2*groups*state + heads)": self.mamba_in_proj_size,
            "mamba inner (heads*head_dim)": self.mamba_inner,
            "attention qkv (heads + 2*groups)*kv_channels": (
                self.num_attention_heads + 2 * self.num_query_groups
            )
            * self.kv_channels,
            "attention heads*kv_channels": self.num_attention_heads * self.kv_channels,
            "ffn_hidden_size": self.ffn_hidden_size,
            "moe_latent_size": self.moe_latent_size,
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size,
            "moe_pad_multiple": self.moe_pad_multiple,
        }
        for name, value in dims.items():
            if value <= 0 or value % 32:
                raise ValueError(
                    f"{name} = {value}: expected a positive multiple of 32 (quantized Linear "
                    "blocks are 32 wide for MXFP8)"
                )
        return self

    def replace(self, **changes) -> ModelArgs:
        return dataclasses.replace(self, **changes).validate()


PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(),
    "small": ModelArgs(
        pattern="MEM*EMEM*EME",
        vocab_size=256,
        hidden_size=512,
        mamba_num_heads=32,
        mamba_head_dim=32,
        mamba_state_dim=64,
        mamba_num_groups=8,
        mamba_chunk_size=128,
        num_attention_heads=8,
        num_query_groups=2,
        kv_channels=64,
        ffn_hidden_size=1024,
        num_experts=64,
        moe_router_topk=6,
        moe_latent_size=256,
        moe_ffn_hidden_size=256,
        moe_shared_expert_intermediate_size=1024,
        moe_router_topk_scaling_factor=2.5,
        mtp_pattern="*E",
    ),
    "super": ModelArgs(
        pattern="MEMEM*EMEME" * 8,  # 40 M, 40 E, 8 *: the published counts, approximate order
        vocab_size=131072,
        hidden_size=4096,
        mamba_num_heads=128,
        mamba_head_dim=64,
        mamba_state_dim=128,
        mamba_num_groups=8,
        mamba_chunk_size=128,
        num_attention_heads=32,
        num_query_groups=2,
        kv_channels=128,
        ffn_hidden_size=5376,
        num_experts=512,
        moe_router_topk=22,
        moe_latent_size=1024,
        moe_ffn_hidden_size=2688,
        moe_shared_expert_intermediate_size=5376,
        moe_router_topk_scaling_factor=5.0,
        mtp_pattern="*E",
    ),
}


def get_preset(name: str) -> ModelArgs:
    """Return a copy of a preset; unknown names raise ValueError naming the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name]).validate()
