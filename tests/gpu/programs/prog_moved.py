"""A captured workspace resized (re-pointed) by eager code."""

from _prelude import *  # noqa: F403

ws = torch.zeros(4096, device="cuda")
src = torch.randn(4096, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    ws.copy_(src)
    y = ws + 1
ws.resize_(1 << 22)
out["replay"] = replay_guarded(g)
out["healthy"] = healthy()
finish()
