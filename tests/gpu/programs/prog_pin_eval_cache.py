"""Pin eval cache."""

from _prelude import *  # noqa: F403


class Cached(torch.nn.Module):
    # a module that caches a derived weight and drops the cache when it changes mode, like TE's
    # weight workspace cleared on a recipe change during validation
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(512, 512, device="cuda"))
        self.cache = None

    def forward(self, x):
        if self.cache is None:
            self.cache = (self.w * 2).contiguous()
        return x @ self.cache


m = Cached()
static_x = torch.randn(256, 512, device="cuda")
with torch.no_grad():
    m(static_x)  # eager step: the cache lives in the default pool
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = m(static_x)
    m.eval()
    m.cache = None  # validation clears the cache ...
    m(torch.randn(256, 512, device="cuda"))  # ... and rebuilds it elsewhere
    m.train()
    m.cache = None
    torch.cuda.empty_cache()
    out["replay"] = replay_guarded(g)
    out["correct"] = bool(torch.allclose(y, static_x @ (m.w * 2), rtol=1e-3, atol=1e-2))
out["healthy"] = healthy()
finish()
