"""Many layers graphed by make_graphed_callables into one pool (as Transformer Engine does, and
as bench/bench_sanitizer.py measures), trained with a forward-only pass in between: capture
order, restarts and forward-only replays are legal, so the replay order raises nothing. The
graphs that share the pool must be followed (`orders`) for this to mean anything."""

from _prelude import *  # noqa: F403

torch.manual_seed(0)
H, LAYERS = 256, 8
layers = [
    torch.nn.Sequential(
        torch.nn.LayerNorm(H), torch.nn.Linear(H, 4 * H), torch.nn.GELU(), torch.nn.Linear(4 * H, H)
    ).cuda()
    for _ in range(LAYERS)
]
samples = tuple((torch.randn(64, H, device="cuda", requires_grad=True),) for _ in layers)
graphed = torch.cuda.make_graphed_callables(tuple(layers), samples)
params = [p for layer in layers for p in layer.parameters()]
opt = torch.optim.AdamW(params, lr=1e-3)
data = torch.randn(64, H, device="cuda")
losses = []
for it in range(12):
    x = data
    if it == 6:  # a forward-only pass: the backward graphs do not run
        with torch.no_grad():
            for g in graphed:
                x = x + g(x)
        x = data
    for g in graphed:
        x = x + g(x)
    loss = x.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
out["losses_finite"] = all(v == v for v in losses)
out["loss_went_down"] = losses[-1] < losses[0]
out["shared_pools"] = len(san.orders) if san else 0
out["reading_graphs"] = sum(1 for s in san.tracker.graphs.values() if s.reads) if san else 0
out["healthy"] = healthy()
finish()
