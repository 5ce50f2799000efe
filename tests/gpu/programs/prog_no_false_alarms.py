"""Correct programs: kept-alive inputs, repeated captures, reset, deleted graphs."""

from _prelude import *  # noqa: F403

x = torch.randn(1 << 16, device="cuda")
graphs = []
for i in range(3):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = x * (i + 1)
    graphs.append((g, y))
for g, _y in graphs:
    g.replay()
g0, y0 = graphs[0]
g0.reset()  # forget its references
with torch.cuda.graph(g0, stream=s):  # and capture again on the same object
    y0 = x - 1
g0.replay()
tmp = torch.randn(1 << 16, device="cuda")
g3 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g3, stream=s):
    t = tmp * 2
del g3, t  # the graph dies first ...
del tmp  # ... then its memory is freed: nothing to say
torch.cuda.empty_cache()
for g, _y in graphs[1:]:
    g.replay()
g0.replay()
torch.cuda.synchronize()
out["values_ok"] = bool(torch.allclose(graphs[1][1], x * 2)) and bool(torch.allclose(y0, x - 1))
out["healthy"] = healthy()
finish()
