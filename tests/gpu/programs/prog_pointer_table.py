"""A Triton kernel that reads each expert's weights through an int64 table of data pointers,
as grouped GEMMs over per-expert pointer arrays do. $TABLE_CASE: "free" frees an expert and
empties the cache (the replay would fault), "rewrite" points the table at a new buffer before
the free (legal), "ok" changes nothing; an int64 index tensor in the same graph must never
count as a pointer."""

import triton
import triton.language as tl
from _prelude import *  # noqa: F403

CASE = os.environ.get("TABLE_CASE", "free")
N = 1 << 10


@triton.jit
def scale_rows(table_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    src = tl.load(table_ptr + row).to(tl.pointer_type(tl.float32))
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + row * n + offs, tl.load(src + offs, mask=m) * 2, mask=m)


# expert 1 alone in its segment (12 MiB), so empty_cache() gives its memory back to the driver
experts = [torch.randn(N, device="cuda"), torch.randn(3 << 20, device="cuda")]
experts += [torch.randn(N, device="cuda") for _ in range(2)]
table = torch.tensor([e.data_ptr() for e in experts], dtype=torch.int64, device="cuda")
index = torch.arange(0, 4 * N, 16, device="cuda")  # int64 data that is not a pointer
flat = torch.randn(4 * N, device="cuda")
out_rows = torch.empty(4, N, device="cuda")
scale_rows[(4,)](table, out_rows, N, BLOCK=N)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    scale_rows[(4,)](table, out_rows, N, BLOCK=N)
    picked = flat.index_select(0, index)
out["graphs"] = san.report().graphs if san else []
if CASE == "rewrite":
    fresh = torch.randn(N, device="cuda")
    table[1] = fresh.data_ptr()
if CASE in ("free", "rewrite"):
    del experts[1]
    torch.cuda.empty_cache()
out["replay"] = replay_guarded(g)
if out["replay"] == "replayed":
    want = torch.stack(
        [e[:N] for e in ([experts[0], fresh, *experts[1:]] if CASE == "rewrite" else experts)]
    )
    out["correct"] = bool(torch.equal(out_rows, want * 2))
out["healthy"] = healthy()
finish()
