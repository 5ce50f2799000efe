"""On a GPU: the incremental allocator view against real allocator snapshots.

Random allocations, frees and empty_cache calls, graph captures into fresh and shared pools, a
`torch.cuda.MemPool`, and tensors freed on a side stream; after each round the view must equal
a snapshot of the real allocator. Prints `RESULT {json}`, with where the view's events came
from (`allocator_log`: the compiled tracker, or snapshots with the reason) and whether memory
history was on at the end. A second argument: the view keeps a segment's blocks in chunks of
that many (small ones split and join chunks all the time).
"""

import random
import sys

import torch

import graphsan
from graphsan.command_line import write_result
from graphsan.core import viewsegment
from graphsan.core.memory_map import layout
from graphsan.cuda.allocator_log import snapshot_map

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
if len(sys.argv) > 2:
    viewsegment.CHUNK = int(sys.argv[2])
pre = [torch.empty(rng.choice([256, 4096, 1 << 20]), device="cuda") for _ in range(300)]
san = graphsan.enable(policy="record")
dev = torch.cuda.current_device()
live: list[torch.Tensor] = []
graphs = []
shared = torch.cuda.graph_pool_handle()
side = torch.cuda.Stream()
checks = mismatches = 0
first_bad = None


def check(where):
    global checks, mismatches, first_bad
    torch.cuda.synchronize()
    checks += 1
    view = layout(san.memory.view(dev))
    snap = layout(snapshot_map(dev))
    if view != snap:
        mismatches += 1
        if first_bad is None:
            only_v = sorted(set(view) - set(snap))[:3]
            only_s = sorted(set(snap) - set(view))[:3]
            first_bad = {
                "where": where,
                "view_only": repr(only_v)[:1500],
                "snapshot_only": repr(only_s)[:1500],
            }


for round_ in range(40):
    for _ in range(rng.randrange(5, 60)):
        r = rng.random()
        if r < 0.55 or not live:
            n = rng.choice([64, 1000, 65_536, 1 << 20, 5 << 20, 12 << 20])
            live.append(torch.empty(n, device="cuda"))
        elif r < 0.95:
            live.pop(rng.randrange(len(live)))
        else:
            torch.cuda.empty_cache()
    kind = rng.random()
    if kind < 0.25:
        g = torch.cuda.CUDAGraph()
        x = torch.randn(rng.choice([1000, 1 << 20]), device="cuda")
        pool = shared if rng.random() < 0.5 else None
        with torch.cuda.graph(g, pool=pool):
            y = x * 2 + 1
            z = torch.empty(rng.choice([512, 3 << 20]), device="cuda").fill_(1)
            del z
        graphs.append((g, x, y))
    elif kind < 0.35:
        mp = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(mp):
            kept = [torch.empty(rng.choice([4096, 3 << 20]), device="cuda") for _ in range(3)]
        live.extend(kept)
    elif kind < 0.45:
        with torch.cuda.stream(side):
            t = torch.empty(1 << 20, device="cuda")
            t.fill_(3)
        t.record_stream(torch.cuda.current_stream())
        del t
    elif kind < 0.5 and graphs:
        graphs.pop(rng.randrange(len(graphs)))
    check(f"round {round_}")

views = san.memory.ledger.views[dev]
write_result(
    {
        "checks": checks,
        "mismatches": mismatches,
        "first_bad": first_bad,
        "events": views.events,
        "seeds": views.seeds,
        "drains": san.memory.ledger.drains,
        "disabled": san.disabled_reason,
        "blocks": len(views),
        "log": san.memory.event_source,
        "history": getattr(torch._C, "_cuda_isHistoryEnabled", lambda: None)(),
    }
)
