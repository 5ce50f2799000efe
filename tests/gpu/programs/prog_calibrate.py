"""The startup probe on this GPU: which argument-struct layouts it confirms, and that a graph
full of PyTorch's structs (a foreach optimizer step, strided elementwise and reduction kernels,
a batched cat) gives no reference a caveat."""

from _prelude import *  # noqa: F403

params = [torch.randn((i * 13) % 97 + 1, device="cuda", requires_grad=True) for i in range(150)]
for p in params:
    p.grad = torch.randn_like(p)
opt = torch.optim.Adam(params, capturable=True, foreach=True)
x = torch.randn(64, 258, device="cuda")
parts = [torch.randn(3, 8, device="cuda") for _ in range(130)]


def step():
    opt.step()
    return [x[:, :256:2] * 2.0, x.t().sum(dim=1), x.t().max(dim=1)[0], torch.cat(parts)]


with torch.cuda.stream(s):
    step()
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    outs = step()
g.replay()
torch.cuda.synchronize()
out["layouts"] = san.report().layouts
out["caveats"] = sum(
    1 for refs in san.tracker.graphs[1].refs.values() for r in refs if r.caveat is not None
)
finish()
