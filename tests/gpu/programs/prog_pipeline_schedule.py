"""Four graphs of one pool captured in a 1F1B order (forward mb0, forward mb1, backward mb1,
backward mb0; each backward drops the activation it consumed), then replayed in capture order
and in another schedule (forward mb0, backward mb0, forward mb1): backward mb0's gradient was
carved from forward mb1's activation, so forward mb1 writes over the gradient the caller holds."""

from _prelude import *  # noqa: F403

n = 1 << 18
pool = torch.cuda.graph_pool_handle()
w = torch.randn(n, device="cuda")
x0, x1 = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")


def forward(x):
    scratch = x * 3  # freed inside the capture: the pool's scratch
    return scratch.sin() + w


def backward(act):
    return act * 2 + 1


graphs = {name: torch.cuda.CUDAGraph() for name in ("f0", "f1", "b1", "b0")}
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for x in (x0, x1):  # kernels load outside the captures
        backward(forward(x))
    graphs["f0"].capture_begin(pool)
    act0 = forward(x0)
    graphs["f0"].capture_end()
    graphs["f1"].capture_begin(pool)
    act1 = forward(x1)
    graphs["f1"].capture_end()
    graphs["b1"].capture_begin(pool)
    grad1 = backward(act1)
    graphs["b1"].capture_end()
    act1_at = act1.data_ptr()
    del act1
    graphs["b0"].capture_begin(pool)
    grad0 = backward(act0)
    graphs["b0"].capture_end()
torch.cuda.current_stream().wait_stream(s)
torch.cuda.synchronize()
expected0 = backward(forward(x0)).cpu()
expected1 = backward(forward(x1)).cpu()
# whether backward mb0's gradient took forward mb1's activation memory (the hazard); under pin
# the activation stays pinned for forward mb1's graph, so the gradient gets memory of its own
out["recarved"] = grad0.data_ptr() == act1_at

in_order = []
for _ in range(3):
    for name in ("f0", "f1", "b1", "b0"):
        in_order.append(replay_guarded(graphs[name]))
    torch.cuda.synchronize()
    in_order.append(torch.equal(grad0.cpu(), expected0) and torch.equal(grad1.cpu(), expected1))
out["in_order"] = in_order

out["schedule"] = [replay_guarded(graphs[name]) for name in ("f0", "b0", "f1")]
torch.cuda.synchronize()
out["grad0_correct"] = bool(torch.equal(grad0.cpu(), expected0))
out["healthy"] = healthy()
finish()
