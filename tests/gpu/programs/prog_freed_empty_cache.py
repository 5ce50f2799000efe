"""An input freed after capture, then the cache emptied: the replay would fault."""

from _prelude import *  # noqa: F403

x = torch.randn(1 << 20, device="cuda")
expected = (x * 2).cpu()  # on the host: a device copy would keep x's segment from being released
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = x * 2
del x
torch.cuda.empty_cache()
out["replay"] = replay_guarded(g)
out["correct"] = out["replay"] == "replayed" and bool(torch.equal(y.cpu(), expected))
out["pinned"] = san.report().pinned if san else {}
out["healthy"] = healthy()
finish()
