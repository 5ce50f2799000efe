"""Make_graphed_callables on a stack of blocks (forward and backward graphs in one pool, as
Transformer Engine does), then train/eval/train done right: no finding, and graphsan's view of
the allocator equal to a real snapshot. The blocks are large enough that the captured backward,
run by the autograd engine's worker thread, makes new segments in the graphs' pool."""

from _prelude import *  # noqa: F403

import graphsan
from graphsan.core.memory_map import layout
from graphsan.cuda.allocator_log import snapshot_map

torch.manual_seed(0)
h, tokens = 512, 1024


def block():
    return torch.nn.Sequential(
        torch.nn.LayerNorm(h),
        torch.nn.Linear(h, 4 * h),
        torch.nn.GELU(),
        torch.nn.Linear(4 * h, h),
    ).cuda()


layers = [block() for _ in range(3)]
params = [p for layer in layers for p in layer.parameters()]
opt = torch.optim.AdamW(params, lr=1e-4)
samples = tuple((torch.randn(tokens, h, device="cuda", requires_grad=True),) for _ in layers)
graphed = torch.cuda.make_graphed_callables(tuple(layers), samples)
losses = []
raised = None
try:
    for it in range(6):
        if it == 3:
            for layer in layers:
                layer.eval()
            with torch.no_grad():
                y = torch.randn(tokens, h, device="cuda")
                for layer in layers:
                    y = layer(y)
            for layer in layers:
                layer.train()
            torch.cuda.empty_cache()
        x = torch.randn(tokens, h, device="cuda")
        for g in graphed:
            x = x + g(x)
        loss = x.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
except graphsan.StaleMemoryError as err:
    raised = str(err)[:2000]
torch.cuda.synchronize()
out["raised"] = raised
out["losses_finite"] = len(losses) == 6 and all(loss == loss for loss in losses)
if san is not None:
    out["view_matches"] = layout(san.memory.view(0)) == layout(snapshot_map(0))
out["healthy"] = healthy()
finish()
