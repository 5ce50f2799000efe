"""--- the pin policy: the same bugs must run to completion with correct results."""

from _prelude import *  # noqa: F403

ws = torch.zeros(4096, device="cuda")
src = torch.randn(4096, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    ws.copy_(src)
    y = ws + 1
g.replay()
before = ws.clone()
ws.resize_(1 << 22)
out["user_view_ok"] = ws.numel() == 1 << 22 and bool(torch.equal(ws[:4096], before))
src.copy_(torch.randn(4096, device="cuda"))
torch.cuda.empty_cache()
out["replay"] = replay_guarded(g)
out["correct"] = bool(torch.equal(y, src + 1))
out["healthy"] = healthy()
finish()
