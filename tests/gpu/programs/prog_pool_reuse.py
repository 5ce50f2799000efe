"""Two graphs share a pool; a block the first graph keeps using is re-carved by the second."""

from _prelude import *  # noqa: F403

pool = torch.cuda.graph_pool_handle()
x = torch.randn(1 << 18, device="cuda")
state = {}
g1 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g1, pool=pool, stream=s):
    state["buf"] = x * 3  # persistent: graph 1's output lives in the pool
    y1 = state["buf"] + 1
del state["buf"]  # eager code drops it; graph 1 still writes/reads it
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, pool=pool, stream=s):
    y2 = x * 5  # re-carves the freed block
out["replay"] = replay_guarded(g1)
out["healthy"] = healthy()
finish()
