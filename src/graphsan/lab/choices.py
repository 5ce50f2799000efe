"""The lab's named choices, importable without torch (the command lines' help and checks read
them): the precision a quantized module runs in, how it treats its cached weight, which modules
may be CUDA-graphed, and the order of a step's microbatch passes."""

from __future__ import annotations

from graphsan.core.choice import Choice


class RecipeKind(Choice):
    """A recipe's class (Transformer Engine's recipe type): what precision a module's GEMMs run in.

    BF16: no quantization. FP8: per-tensor current scaling, E4M3. MXFP8: 32-element blocks with
    an E8M0 scale each. NVFP4: E2M1 elements in 16-element blocks with an E4M3 scale each, under
    one FP32 per-tensor factor. (`graphsan.lab.quant.recipe` holds each kind's settings.)
    """

    BF16 = "bf16"
    FP8 = "fp8"
    MXFP8 = "mxfp8"
    NVFP4 = "nvfp4"

    @classmethod
    def unknown(cls, value: object, what: str) -> str:
        """E.g. "unknown recipe 'fp4'; expected one of [...]": the name quoted, since it comes
        from a file or a keyword where an empty or odd one must show."""
        return f"unknown {what} {value!r}; expected one of {list(cls.values())}"


class StatePolicy(Choice):
    """How a quantized module treats its cached (quantized) weight across CUDA graphs.

    FIXED: the cache is rebuilt in place, so a graph's addresses stay valid.
    TE218: Transformer Engine 2.18's behaviour: a grad-free forward (validation) replaces the
    cached weight's buffers, which the training graphs still point at (#3316).
    """

    FIXED = "fixed"
    TE218 = "te218"

    @classmethod
    def parse(cls, value: str | StatePolicy, what: str = "--state-policy") -> StatePolicy:
        """The policy named `value`; a ValueError naming the choices otherwise."""
        return super().parse(value, what)


STATE_POLICIES = StatePolicy.values()

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


class Schedule(Choice):
    """The order of a step's microbatch forwards and backwards (one pipeline stage).

    SEQUENTIAL: each microbatch's forward, then its backward.
    ONE_F_ONE_B: Megatron's 1F1B: `in_flight` forwards first, then one backward and one forward
    in turn, then the remaining backwards; up to `in_flight` microbatches keep their activations.
    """

    SEQUENTIAL = "sequential"
    ONE_F_ONE_B = "1f1b"


SCHEDULES = Schedule.values()
Pass = tuple[str, int]  # ("F" or "B", microbatch)


def schedule_order(
    schedule: str | Schedule, num_microbatches: int, in_flight: int = 2
) -> list[Pass]:
    """The step's forwards and backwards in order, e.g. 1F1B of 3 microbatches with 2 in
    flight: F0 F1 B0 F2 B1 B2."""
    schedule = Schedule.parse(schedule, "schedule")
    if num_microbatches < 1 or in_flight < 1:
        raise ValueError(
            f"{num_microbatches} microbatch(es), {in_flight} in flight: expected both >= 1"
        )
    if schedule is Schedule.SEQUENTIAL:
        return [(p, mb) for mb in range(num_microbatches) for p in ("F", "B")]
    warmup = min(in_flight, num_microbatches)
    order: list[Pass] = [("F", mb) for mb in range(warmup)]
    for mb in range(num_microbatches - warmup):
        order += [("B", mb), ("F", mb + warmup)]
    order += [("B", mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return order


def check_order(order: list[Pass], num_microbatches: int) -> list[Pass]:
    """`order` if it has each microbatch's forward once and, after it, its backward once; else
    a ValueError naming the first pass out of place."""
    seen: set[Pass] = set()
    for kind, mb in order:
        bad = (
            kind not in ("F", "B")
            or not 0 <= mb < num_microbatches
            or (kind, mb) in seen
            or (kind == "B" and ("F", mb) not in seen)
        )
        if bad:
            raise ValueError(
                f"pass {kind}{mb} of {order}: expected each of microbatches 0..{num_microbatches - 1} "
                "forward once, then its backward once"
            )
        seen.add((kind, mb))
    if len(seen) != 2 * num_microbatches:
        raise ValueError(f"{order}: expected all {num_microbatches} microbatches' passes")
    return order
