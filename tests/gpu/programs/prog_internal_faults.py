"""Internal faults injected into graphsan during graphed training ($GRAPHSAN_FAULT): a malformed
node from the driver walk ("node"), a failing allocator-view read at a judged replay ("view"), a
failing free callback ("free"). graphsan must disable itself with one warning; training goes on."""

from _prelude import *  # noqa: F403

import graphsan.cuda.driver as d
from graphsan.core.records import CopyArgs, FreeEvent
from graphsan.cuda.graphwalk import GraphWalk

FAULT = os.environ.get("GRAPHSAN_FAULT", "node")


def boom(*args, **kwargs):
    raise RuntimeError(f"injected {FAULT} fault")


if FAULT == "node":  # from whichever walk reads the graph: the compiled one or cuda-bindings'
    walk, compiled_walk = d.walk, GraphWalk.walk

    def malformed(graph):
        nodes, stats = walk(graph)
        return [*nodes, CopyArgs(len(nodes), "memcpy", [("src", None)])], stats

    def compiled_malformed(self, graph, describe):
        nodes, stats = compiled_walk(self, graph, describe)
        return [*nodes, CopyArgs(len(nodes), "memcpy", [("src", None)])], stats

    d.walk, GraphWalk.walk = malformed, compiled_malformed

torch.manual_seed(0)
model = torch.nn.Linear(256, 256, device="cuda")
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, 256, device="cuda")
target = torch.randn(64, 256, device="cuda")
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):  # warm up the optimizer state outside the capture
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), target).backward()
        opt.step()
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
opt.zero_grad(set_to_none=True)
with torch.cuda.graph(g, stream=s):
    loss = torch.nn.functional.mse_loss(model(x), target)
    loss.backward()
    opt.step()
scratch = torch.empty(1024, device="cuda")
if FAULT == "view":  # a watched block looks freed, so the next replay reads the view
    state = next(iter(san.tracker.graphs.values()))  # noqa: F405
    next(iter(state.blocks.values())).freed = FreeEvent((), "train", 0)
    state.dirty = True
    san.memory.view = boom  # noqa: F405
elif FAULT == "free":
    san.tracker.on_free = boom  # noqa: F405
    # watched as Tracker.add_graph watches: graphsan's GPU-trace interpreter is told first
    if san.tracker.mirrored is not None:  # noqa: F405
        san.tracker.mirrored([scratch.data_ptr()])  # noqa: F405
    san.tracker.live[scratch.data_ptr()] = next(iter(san.tracker.live.values()))  # noqa: F405
del scratch  # the free callback runs here
losses = []
for _ in range(20):
    g.replay()
    losses.append(loss.item())
out["losses_finite"] = all(v == v and abs(v) < 1e6 for v in losses)
out["loss_went_down"] = losses[-1] < losses[0]
out["healthy"] = healthy()
finish()
