"""A matmul: the weight's address sits inside cuBLAS(Lt) arguments."""

from _prelude import *  # noqa: F403

a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
w = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    a @ w
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = a @ w
del w
out["replay"] = replay_guarded(g)
out["healthy"] = healthy()
finish()
