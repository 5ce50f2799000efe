"""PyTorch's three graphs in one pool (test_graph_three_successive): g2 re-carves c, which g1
reads and g0 writes. Capture order replays clean; g0, g2, g1 makes g1 read g2's data."""

from _prelude import *  # noqa: F403

size = 1 << 16
pool = torch.cuda.graph_pool_handle()
a = torch.ones(size, device="cuda")
g0, g1, g2 = (torch.cuda.CUDAGraph() for _ in range(3))
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    g0.capture_begin(pool)
    b = a.clone()
    c = b + 1
    d = b + 2
    g0.capture_end()
    g1.capture_begin(pool)
    e = c + 3
    del c
    g1.capture_end()
    g2.capture_begin(pool)
    f = d + 4
    g2.capture_end()
torch.cuda.current_stream().wait_stream(s)
out["in_order"] = [replay_guarded(g) for g in (g0, g1, g2, g0, g1, g2)]
out["e_in_order"] = e.sum().item() / size  # 5
g0.replay()
g2.replay()
out["out_of_order"] = replay_guarded(g1)
out["e_out_of_order"] = e.sum().item() / size  # 10 when g1 read f's memory
out["f"] = f.sum().item() / size  # 7
out["healthy"] = healthy()
finish()
