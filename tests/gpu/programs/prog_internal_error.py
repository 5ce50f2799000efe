"""The sanitizer breaks internally: it must disable itself and let the program run."""

from _prelude import *  # noqa: F403

import graphsan.cuda.driver as d
from graphsan.cuda.graphwalk import GraphWalk


def broken(*a, **k):
    raise RuntimeError("simulated driver failure")


d.walk = GraphWalk.walk = broken  # whichever walk reads the graph
x = torch.randn(1024, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = x + 1
g.replay()
torch.cuda.synchronize()
out["value_ok"] = bool(torch.allclose(y, x + 1))
out["healthy"] = healthy()
finish()
