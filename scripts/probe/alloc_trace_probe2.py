"""One-off probe 2: where the first snapshot's seconds go, and what frames cost."""
import os, subprocess, sys, time
import torch

CHILD = r'''
import sys, time, torch
mode = sys.argv[1]
m = torch.cuda.memory
x = torch.empty(10, device="cuda")
t0 = time.perf_counter()
if mode == "all-alloc":
    m._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1<<20)
elif mode == "all-none":
    m._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1<<20)
elif mode == "state":
    m._record_memory_history(enabled="state", context="state", stacks="python")
t1 = time.perf_counter()
def f(n):
    return [torch.empty(1000 + i, device="cuda") for i in range(n)]
keep = f(1000)
t2 = time.perf_counter()
s = torch._C._cuda_memorySnapshot((7, 12345, True))
t3 = time.perf_counter()
tr = s["device_traces"][0] if s["device_traces"] else []
fr = [e for e in tr if e.get("frames")]
print(mode, f"enable {(t1-t0)*1e3:.1f} ms; 1000 allocs {(t2-t1)*1e3:.1f} ms; first drain {(t3-t2)*1e3:.1f} ms",
      "entries", len(tr), "with frames", len(fr), "sample", (fr[0]["frames"][:2] if fr else None))
more = f(1000)
t4 = time.perf_counter()
s = torch._C._cuda_memorySnapshot((7, 12345, True))
t5 = time.perf_counter()
print(mode, f"second drain of {len(s['device_traces'][0]) if s['device_traces'] else 0} entries {(t5-t4)*1e3:.1f} ms")
t6 = time.perf_counter(); s = torch._C._cuda_memorySnapshot((0, 0, False)); t7 = time.perf_counter()
print(mode, f"(0,0,False): {len(s['segments'])} segments, {sum(len(g['blocks']) for g in s['segments'])} blocks {(t7-t6)*1e3:.1f} ms")
from torch.utils._traceback import CapturedTraceback
t8 = time.perf_counter()
tbs = [CapturedTraceback.extract(script=False, cpp=False) for _ in range(10000)]
t9 = time.perf_counter()
print(mode, f"CapturedTraceback.extract: {(t9-t8)/10000*1e6:.2f} us each")
t10 = time.perf_counter(); ss = [tb.summary() for tb in tbs[:100]]; t11 = time.perf_counter()
print(mode, f"first 100 summaries {(t11-t10)*1e3:.1f} ms; depth {len(ss[0])}")
t10 = time.perf_counter(); ss = CapturedTraceback.format_all(tbs[100:200]); t11 = time.perf_counter()
print(mode, f"format_all 100: {(t11-t10)*1e3:.1f} ms")
import traceback
t12 = time.perf_counter()
for _ in range(10000):
    fs = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
t13 = time.perf_counter()
print(mode, f"python walk_stack extract: {(t13-t12)/10000*1e6:.2f} us each")
t12 = time.perf_counter()
for _ in range(10000):
    f = sys._getframe(0); st = []
    while f is not None:
        st.append((f.f_code, f.f_lineno)); f = f.f_back
t13 = time.perf_counter()
print(mode, f"raw (code, lineno) walk: {(t13-t12)/10000*1e6:.2f} us each, depth {len(st)}")
'''
for mode in ("all-alloc", "all-none", "state", "off"):
    r = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=200)
    print(r.stdout.strip(), r.stderr.strip()[-600:])
