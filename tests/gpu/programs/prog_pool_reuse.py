"""Two graphs share a pool; graph 1's own output is dropped by eager code after its capture and
re-carved by graph 2's. Replayed in capture order (and restarting at graph 1) this is legal: the
pool's replay order owns the range, and nothing is raised."""

from _prelude import *  # noqa: F403

pool = torch.cuda.graph_pool_handle()
x = torch.randn(1 << 18, device="cuda")
state = {}
g1 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g1, pool=pool, stream=s):
    state["buf"] = x * 3  # persistent: graph 1's output lives in the pool
    y1 = state["buf"] + 1
buf_ptr = state["buf"].data_ptr()
del state["buf"]  # eager code drops it; graph 1 still writes/reads it
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, pool=pool, stream=s):
    y2 = x * 5  # re-carves the freed block
out["recarved"] = y2.data_ptr() == buf_ptr
out["replays"] = [replay_guarded(g) for g in (g1, g2, g1, g2)]
out["values_ok"] = bool(torch.equal(y1, x * 3 + 1) and torch.equal(y2, x * 5))
out["healthy"] = healthy()
finish()
