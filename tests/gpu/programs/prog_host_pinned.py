"""A graph copies a pinned host batch into its static input. $HOST_CASE: "free" drops the
batch and pins the next one (the pinned-memory cache hands it the same pages: the replay copies
the new batch), "refill" refills the batch in place each step (legal)."""

from _prelude import *  # noqa: F403

CASE = os.environ.get("HOST_CASE", "free")
N = 1 << 16
batch = torch.full((N,), 1.0).pin_memory()
static = torch.empty(N, device="cuda")
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    static.copy_(batch, non_blocking=True)
    y = static * 2
out["graph_counts"] = san.report().graphs[0] if san else {}
if CASE == "free":
    address = batch.data_ptr()
    del batch
    nxt = torch.full((N,), 7.0).pin_memory()  # the next batch, pinned by the loader
    out["same_pages"] = nxt.data_ptr() == address
else:
    batch.fill_(3.0)
out["replay"] = replay_guarded(g)
if out["replay"] == "replayed":
    out["y"] = float(y[0].item())
out["healthy"] = healthy()
finish()
