"""The smallest stale-memory bug: a graph reads a tensor that eager code frees, and the cache is
emptied before the next replay. Without graphsan the replay dies with "an illegal memory access";
with `graphsan run examples/stale_input.py` it stops before launch and says why."""

import sys

import torch

if not torch.cuda.is_available():
    sys.exit(
        "examples/stale_input.py needs an NVIDIA GPU; `graphsan report --sample stale-input` "
        "shows the report graphsan gives for it (recorded on an H200)"
    )


def make_input():
    return torch.randn(1 << 20, device="cuda")


def capture(x):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        y = x * 2
    return g, y


def validate(state):
    state.pop("x")  # "we do not need the input any more"
    torch.cuda.empty_cache()


state = {"x": make_input()}
graph, out = capture(state["x"])
graph.replay()
validate(state)
graph.replay()
torch.cuda.synchronize()
print("replayed")
