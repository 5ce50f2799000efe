"""One-off probe (torch on the GPU machine): can the allocator's trace ring buffer feed an
incremental view? Prints facts; changes nothing."""
import inspect, os, sys, time, json
import torch

print("torch", torch.__version__)
m = torch.cuda.memory
print("record sig:", inspect.signature(m._record_memory_history))
print("memory_snapshot sig:", inspect.signature(m.memory_snapshot))
src = inspect.getsource(m._snapshot)
print("_snapshot calls:", [l.strip() for l in src.splitlines() if "_cuda_memorySnapshot" in l])

def snap(arg):
    t = time.perf_counter()
    s = torch._C._cuda_memorySnapshot(arg)
    return s, (time.perf_counter() - t) * 1e3

x = torch.empty(1024, device="cuda")
m._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1 << 20)
keep = [torch.empty(1000 + i, device="cuda") for i in range(10)]
del keep[3]
for arg in [None, (0, 0), (0, 0, False), (0, 0, True), (7, 123456, True), (7, 123456, False)]:
    try:
        s, ms = snap(arg)
        print("arg", arg, "segments", len(s["segments"]), "traces", [len(t) for t in s["device_traces"]], f"{ms:.2f} ms")
    except Exception as e:
        print("arg", arg, "ERR", type(e).__name__, str(e)[:200])
s, _ = snap(None)
tr = s["device_traces"][0]
print("trace keys:", sorted(tr[-1].keys()))
for e in tr[-6:]:
    print({k: (v if k != "frames" else [(f["filename"].split("/")[-1], f["line"]) for f in v][-2:]) for k, v in e.items()})
print("segment keys:", sorted(s["segments"][0].keys()))
print("block keys:", sorted(s["segments"][0]["blocks"][0].keys()))

# clear_history: does it drop traces but keep per-block frames?
m._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1 << 20, clear_history=True)
s2, _ = snap(None)
nb = sum(1 for sg in s2["segments"] for b in sg["blocks"] if b["state"].startswith("active") and b.get("frames"))
print("after clear: traces", [len(t) for t in s2["device_traces"]], "active blocks with frames", nb)

# capture: what do trace entries say about the private pool / stream?
m._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1 << 20, clear_history=True)
g = torch.cuda.CUDAGraph()
inp = torch.randn(1 << 20, device="cuda")
s_ = torch.cuda.Stream()
with torch.cuda.stream(s_):
    with torch.cuda.graph(g, stream=s_):
        y = inp * 2 + 1
print("graph pool", g.pool())
s3, _ = snap(None)
for e in s3["device_traces"][0]:
    print("cap", e["action"], hex(e["addr"]), e["size"], e["stream"], {k: e[k] for k in e if k not in ("action","addr","size","stream","frames","time_us")})
segs = [(hex(sg["address"]), sg["total_size"], sg["segment_pool_id"], sg["stream"], sg.get("is_expandable")) for sg in s3["segments"]]
print("segments", segs)
# pool filter by the graph's pool
try:
    s4, ms = snap((*g.pool(), False))
    print("pool-filtered:", len(s4["segments"]), "segments", [len(t) for t in s4["device_traces"]], f"{ms:.2f} ms")
except Exception as e:
    print("pool filter ERR", e)

# scale: 100k live blocks, full snapshot vs a drain of a few entries
m._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1 << 20, clear_history=True)
many = [torch.empty(256 + (i % 7) * 64, device="cuda") for i in range(100_000)]
_, ms_first = snap(None)
m._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1 << 20, clear_history=True)
few = [torch.empty(512, device="cuda") for _ in range(20)]
_, ms_full = snap(None)
for arg in [(7, 123456, True), (7, 123456)]:
    try:
        t0 = time.perf_counter()
        sx = torch._C._cuda_memorySnapshot(arg)
        print("drain", arg, len(sx["segments"]), [len(t) for t in sx["device_traces"]], f"{(time.perf_counter()-t0)*1e3:.2f} ms")
    except Exception as e:
        print("drain", arg, "ERR", e)
t0 = time.perf_counter()
m._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1 << 20, clear_history=True)
print(f"clear: {(time.perf_counter()-t0)*1e3:.3f} ms; full snapshot with 100k blocks first {ms_first:.1f} ms, later {ms_full:.1f} ms")
# cost of alloc/free with history all vs state
for mode in ("all", "state"):
    m._record_memory_history(enabled=mode, context="alloc" if mode == "all" else "state", stacks="python", max_entries=1 << 20, clear_history=True)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(20000):
        z = torch.empty(4096, device="cuda"); del z
    print(f"alloc+free with history {mode}: {(time.perf_counter()-t0)/20000*1e6:.2f} us")
m._record_memory_history(enabled=None)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(20000):
    z = torch.empty(4096, device="cuda"); del z
print(f"alloc+free with history off: {(time.perf_counter()-t0)/20000*1e6:.2f} us")

# expandable segments in a child
code = r'''
import torch
m = torch.cuda.memory
m._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1<<20)
a = torch.empty(8<<20, device="cuda"); b = torch.empty(1<<20, device="cuda")
del a; torch.cuda.empty_cache()
s = torch._C._cuda_memorySnapshot(None)
for e in s["device_traces"][0]:
    print("exp", e["action"], hex(e["addr"]), e["size"])
print("exp segs", [(hex(x["address"]), x["total_size"], x["is_expandable"], [(hex(b["address"]), b["size"], b["state"]) for b in x["blocks"]]) for x in s["segments"]])
'''
import subprocess
env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
print(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout[-4000:])
