"""Small real CUDA programs for the GPU tests, each run in its own subprocess (a stale replay can
kill the CUDA context). A program prints one line `RESULT {json}` that the test reads.

Each program takes `GRAPHSAN` from the environment: "off" runs it without the sanitizer (to show
what happens without it), any policy name runs it under `graphsan.enable(policy)`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import json, os, sys
import torch
import graphsan
POLICY = os.environ.get("GRAPHSAN", "raise")
san = graphsan.enable(policy=POLICY) if POLICY != "off" else None
out = {}
def finish():
    out["findings"] = [
        {"kind": f.kind, "kernel": f.kernel, "param": f.param, "offset": f.offset,
         "node": f.node, "phase": f.phase, "step": f.step, "nbytes": f.nbytes,
         "free_stack": f.free_stack, "alloc_stack": f.alloc_stack, "label": f.graph.label,
         "pool": f.pool, "now": f.now, "text": graphsan.report.format_finding(f)}
        for f in (san.findings if san else [])
    ]
    out["graphs"] = san.report().graphs if san else []
    out["disabled_reason"] = san.disabled_reason if san else None
    print("RESULT " + json.dumps(out), flush=True)
def replay_guarded(g):
    try:
        g.replay()
        torch.cuda.synchronize()
        return "replayed"
    except graphsan.StaleMemoryError as err:
        out["error_text"] = str(err)
        out["error_kinds"] = [f.kind for f in err.findings]
        return "raised"
def healthy():
    return float((torch.ones(1000, device="cuda") * 2).sum().item()) == 2000.0
s = torch.cuda.Stream()
"""

PROGRAMS = {
    # an input freed after capture, then the cache emptied: the replay would fault
    "freed_empty_cache": """
x = torch.randn(1 << 20, device="cuda")
expected = (x * 2).cpu()  # on the host: a device copy would keep x's segment from being released
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = x * 2
del x
torch.cuda.empty_cache()
out["replay"] = replay_guarded(g)
out["correct"] = out["replay"] == "replayed" and bool(torch.equal(y.cpu(), expected))
out["pinned"] = san.report().pinned if san else {}
out["healthy"] = healthy()
finish()
""",
    # freed, then the block handed to a new tensor: silent corruption without graphsan
    "reowned": """
x = torch.randn(1 << 20, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = x * 2
x_ptr = x.data_ptr()
del x
z = torch.full((1 << 20,), 7.0, device="cuda")
out["same_block"] = z.data_ptr() == x_ptr
out["replay"] = replay_guarded(g)
out["y_is_14"] = bool((y == 14).all().item()) if out["replay"] == "replayed" else None
out["healthy"] = healthy()
finish()
""",
    # a captured workspace resized (re-pointed) by eager code
    "moved": """
ws = torch.zeros(4096, device="cuda")
src = torch.randn(4096, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    ws.copy_(src)
    y = ws + 1
ws.resize_(1 << 22)
out["replay"] = replay_guarded(g)
out["healthy"] = healthy()
finish()
""",
    # a matmul: the weight's address sits inside cuBLAS(Lt) arguments
    "matmul": """
a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
w = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    a @ w
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = a @ w
del w
out["replay"] = replay_guarded(g)
out["healthy"] = healthy()
finish()
""",
    # a Triton kernel
    "triton": """
import triton
import triton.language as tl
@triton.jit
def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) + 1, mask=m)
x = torch.randn(1 << 16, device="cuda")
y = torch.empty_like(x)
add_one[(64,)](x, y, x.numel(), BLOCK=1024)
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    add_one[(64,)](x, y, x.numel(), BLOCK=1024)
del x
out["replay"] = replay_guarded(g)
out["healthy"] = healthy()
finish()
""",
    # make_graphed_callables on a small model, then train/eval/train done right: no finding
    "graphed_callables_ok": """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 64, device="cuda", requires_grad=True)
gm = torch.cuda.make_graphed_callables(model, (x,))
losses = []
for it in range(6):
    if it == 3:
        model.eval()
        with torch.no_grad():
            model(torch.randn(32, 64, device="cuda"))
        model.train()
        torch.cuda.empty_cache()
    xb = torch.randn(32, 64, device="cuda", requires_grad=True)
    loss = gm(xb).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(loss.item())
out["losses_finite"] = all(l == l for l in losses)
out["healthy"] = healthy()
finish()
""",
    # two graphs share a pool; a block the first graph keeps using is re-carved by the second
    "pool_reuse": """
pool = torch.cuda.graph_pool_handle()
x = torch.randn(1 << 18, device="cuda")
state = {}
g1 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g1, pool=pool, stream=s):
    state["buf"] = x * 3            # persistent: graph 1's output lives in the pool
    y1 = state["buf"] + 1
del state["buf"]                    # eager code drops it; graph 1 still writes/reads it
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, pool=pool, stream=s):
    y2 = x * 5                      # re-carves the freed block
out["replay"] = replay_guarded(g1)
out["healthy"] = healthy()
finish()
""",
    # correct programs: kept-alive inputs, repeated captures, reset, deleted graphs
    "no_false_alarms": """
x = torch.randn(1 << 16, device="cuda")
graphs = []
for i in range(3):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = x * (i + 1)
    graphs.append((g, y))
for g, y in graphs:
    g.replay()
g0, y0 = graphs[0]
g0.reset()                                # forget its references
with torch.cuda.graph(g0, stream=s):      # and capture again on the same object
    y0 = x - 1
g0.replay()
tmp = torch.randn(1 << 16, device="cuda")
g3 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g3, stream=s):
    t = tmp * 2
del g3, t                                 # the graph dies first ...
del tmp                                   # ... then its memory is freed: nothing to say
torch.cuda.empty_cache()
for g, y in graphs[1:]:
    g.replay()
g0.replay()
torch.cuda.synchronize()
out["values_ok"] = bool(torch.allclose(graphs[1][1], x * 2)) and bool(torch.allclose(y0, x - 1))
out["healthy"] = healthy()
finish()
""",
    # the sanitizer breaks internally: it must disable itself and let the program run
    "internal_error": """
import graphsan.cuda.driver as d
def broken(*a, **k):
    raise RuntimeError("simulated driver failure")
d.walk = broken
x = torch.randn(1024, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    y = x + 1
g.replay()
torch.cuda.synchronize()
out["value_ok"] = bool(torch.allclose(y, x + 1))
out["healthy"] = healthy()
finish()
""",
    # --- the pin policy: the same bugs must run to completion with correct results
    "pin_resize": """
ws = torch.zeros(4096, device="cuda")
src = torch.randn(4096, device="cuda")
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=s):
    ws.copy_(src)
    y = ws + 1
g.replay()
before = ws.clone()
ws.resize_(1 << 22)
out["user_view_ok"] = ws.numel() == 1 << 22 and bool(torch.equal(ws[:4096], before))
src.copy_(torch.randn(4096, device="cuda"))
torch.cuda.empty_cache()
out["replay"] = replay_guarded(g)
out["correct"] = bool(torch.equal(y, src + 1))
out["healthy"] = healthy()
finish()
""",
    "pin_eval_cache": """
class Cached(torch.nn.Module):
    # a module that caches a derived weight and drops the cache when it changes mode, like TE's
    # weight workspace cleared on a recipe change during validation
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(512, 512, device="cuda"))
        self.cache = None
    def forward(self, x):
        if self.cache is None:
            self.cache = (self.w * 2).contiguous()
        return x @ self.cache
m = Cached()
static_x = torch.randn(256, 512, device="cuda")
with torch.no_grad():
    m(static_x)  # eager step: the cache lives in the default pool
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = m(static_x)
    m.eval()
    m.cache = None           # validation clears the cache ...
    m(torch.randn(256, 512, device="cuda"))   # ... and rebuilds it elsewhere
    m.train()
    m.cache = None
    torch.cuda.empty_cache()
    out["replay"] = replay_guarded(g)
    out["correct"] = bool(torch.allclose(y, static_x @ (m.w * 2), rtol=1e-3, atol=1e-2))
out["healthy"] = healthy()
finish()
""",
    # torch.compile's CUDA graph trees: correct use must give no finding
    "compile_ok": """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step_fn = torch.compile(model, mode="reduce-overhead")
ok = True
for it in range(8):
    x = torch.randn(64, 256, device="cuda")
    loss = step_fn(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ok = ok and bool(torch.isfinite(loss).item())
    if it == 4:
        model.eval()
        with torch.no_grad():
            ref = model(x)
            ok = ok and bool(torch.allclose(step_fn(x), ref, atol=1e-4))
        model.train()
out["ok"] = ok
out["healthy"] = healthy()
finish()
""",
}


_CACHE: dict[tuple, tuple] = {}


def _key(name: str, policy: str, env: dict | None) -> tuple:
    return (name, policy, tuple(sorted((env or {}).items())))


def prefetch(runs: list[tuple[str, str, dict | None]], workers: int = 6) -> None:
    """Run many programs side by side (each in its own process, as always) and keep the results
    for `run_program`: the GPU suite then costs the slowest program, not the sum of them."""
    from concurrent.futures import ThreadPoolExecutor

    todo = [r for r in runs if _key(*r) not in _CACHE]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda r: _run(*r), todo))
    for r, res in zip(todo, results, strict=True):
        _CACHE[_key(*r)] = res


def run_program(name: str, policy: str = "raise", env: dict | None = None, timeout: int = 180):
    """PROGRAMS[name]'s (returncode, result dict or None, log), from `prefetch` or a fresh run."""
    hit = _CACHE.get(_key(name, policy, env))
    return hit if hit is not None else _run(name, policy, env, timeout)


def _run(name: str, policy: str = "raise", env: dict | None = None, timeout: int = 400):
    """Run PROGRAMS[name] in a fresh interpreter; returns (returncode, result dict or None, log)."""
    code = textwrap.dedent(PRELUDE) + textwrap.dedent(PROGRAMS[name])
    # a real file: Triton needs the source, and reports name `prog_<name>.py` frames
    path = os.path.join(tempfile.mkdtemp(prefix="graphsan-"), f"prog_{name}.py")
    with open(path, "w") as fh:
        fh.write(code)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env["GRAPHSAN"] = policy
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, path], capture_output=True, text=True, timeout=timeout, env=full_env
    )
    log = proc.stdout + proc.stderr
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    return proc.returncode, result, log
