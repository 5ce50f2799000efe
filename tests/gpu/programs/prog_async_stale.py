"""Under the cudaMallocAsync backend: an input freed after capture, then the pool trimmed by
empty_cache(); graphsan must stop the replay before launch."""

import gc

from _prelude import *  # noqa: F403

x = torch.randn(1 << 20, device="cuda")
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = x * 2
del x
torch.cuda.empty_cache()
out["replay"] = replay_guarded(g)
out["healthy"] = healthy()
finish()
# y lives in the graph's own allocation, which the driver makes at the graph's first launch; the
# launch was stopped, and PyTorch aborts when it frees such a tensor ('invalid argument'):
# graphsan keeps its storage alive, so the program drops everything and exits as any other
del y, g
gc.collect()
torch.cuda.synchronize()
