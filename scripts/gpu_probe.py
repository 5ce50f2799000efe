"""One-off facts for the sanitizer's design, printed on the GPU machine (not a test)."""

import torch

s = torch.cuda.Stream()
x = torch.randn(1 << 20, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = x * 2
xp = x.data_ptr()
del x
torch.cuda.empty_cache()
snap = torch.cuda.memory._snapshot()
for seg in snap["segments"]:
    lo, hi = seg["address"], seg["address"] + seg["total_size"]
    mark = "<-- x" if lo <= xp < hi else ""
    print(
        "segment", hex(lo), seg["total_size"], seg.get("is_expandable"), seg["segment_pool_id"],
        [(hex(b["address"]), b["size"], b["state"]) for b in seg["blocks"]][:6], mark,
    )
print("x was", hex(xp))
from cuda.bindings import driver as drv
print("address range", drv.cuMemGetAddressRange(drv.CUdeviceptr(xp)))
print("retain handle", drv.cuMemRetainAllocationHandle(xp)[0])
