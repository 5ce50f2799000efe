"""The lab's own words, importable without torch (the command lines' help and checks read them):
how a quantized module treats its cached weight, and which modules may be CUDA-graphed."""

from __future__ import annotations

from enum import Enum


class StatePolicy(str, Enum):
    """How a quantized module treats its cached (quantized) weight across CUDA graphs.

    FIXED: the cache is rebuilt in place, so a graph's addresses stay valid.
    TE218: Transformer Engine 2.18's behaviour: a grad-free forward (validation) replaces the
    cached weight's buffers, which the training graphs still point at (#3316).
    """

    FIXED = "fixed"
    TE218 = "te218"

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def parse(cls, value: str | StatePolicy, what: str = "--state-policy") -> StatePolicy:
        """The policy named `value`; a ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"{what} {value}: expected one of {', '.join(STATE_POLICIES)}"
            ) from None


STATE_POLICIES = tuple(p.value for p in StatePolicy)

# the modules `--cuda-graph-modules` may graph, as Megatron names them
GRAPH_SCOPES = ("attn", "mamba", "moe_router", "moe_preprocess", "mlp")


def check_scopes(scopes) -> tuple[str, ...]:
    """The scopes without repeats, or a ValueError naming the bad one and the allowed set."""
    scopes = tuple(dict.fromkeys(scopes))
    unknown = [s for s in scopes if s not in GRAPH_SCOPES]
    if unknown:
        raise ValueError(
            f"--cuda-graph-modules: unknown scope {unknown[0]!r}; expected some of "
            f"{', '.join(GRAPH_SCOPES)}"
        )
    if "moe_preprocess" in scopes and "moe_router" not in scopes:
        raise ValueError("--cuda-graph-modules: moe_preprocess needs moe_router as well")
    return scopes
