"""One capture across two streams (the pattern of PyTorch's allocator test of graphs): the
snapshot holds exactly the pools and segments the program made, whether graphsan's start-up
probe ran before the capture or not, and memory_reserved() is the program's own."""

from _prelude import *  # noqa: F403

x = torch.ones(1 << 10, device="cuda")
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
s1.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s1):
    g.capture_begin()  # under graphsan the start-up probe runs here, before the capture
    y = x + 1
    s2.wait_stream(s1)
    with torch.cuda.stream(s2):
        z = x * 2
    s1.wait_stream(s2)
    g.capture_end()
torch.cuda.current_stream().wait_stream(s1)
g.replay()
torch.cuda.synchronize()
segments = torch.cuda.memory_snapshot()
pools = [str(tuple(int(v) for v in seg["segment_pool_id"])) for seg in segments]
out["graph_pool"] = str(tuple(int(v) for v in g.pool()))
out["segments_by_pool"] = {p: pools.count(p) for p in sorted(set(pools))}
out["reserved"] = torch.cuda.memory_reserved()
out["largest_segment"] = max(seg["total_size"] for seg in segments)
out["probe_memory"] = san.report().layouts.get("0", {}).get("probe_memory") if san else None
finish()
