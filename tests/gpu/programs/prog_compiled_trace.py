"""graphsan's own GPU-trace interpreter (run with GRAPHSAN_TRACELOG=1): eager temporaries reach no
Python, a watched free is judged with its allocation and free sites, and once
torch._C._activate_gpu_trace() has replaced the interpreter graphsan goes on through PyTorch's
trace, with one warning."""

import warnings

from _prelude import *  # noqa: F403


def make_weight():
    return torch.randn(1 << 16, device="cuda")


def drop(holder):
    holder.pop()  # the weight's last reference: its block is freed here


def capture(weight):
    x = torch.randn(1 << 16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = weight * x
    return g, x, y


trace = san.memory.trace if san else None
out["allocator_log"] = san.report().allocator_log if san else None
out["installed"] = bool(trace is not None and trace.current())

held = [make_weight()]
g1, x1, y1 = capture(held[0])
calls = trace.python_calls() if trace else 0
for _ in range(1000):  # eager temporaries: no Python call through graphsan's interpreter
    t = torch.empty(1 << 12, device="cuda")
    del t
torch.cuda.synchronize()
out["python_calls_for_temporaries"] = (trace.python_calls() - calls) if trace else None
drop(held)
out["replay"] = replay_guarded(g1)
out["first_text"] = out.pop("error_text", "")

torch._C._activate_gpu_trace()  # as another tool would: PyTorch's interpreter replaces graphsan's
held2 = [make_weight()]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    g2, x2, y2 = capture(held2[0])  # the capture's drain notices the replacement
out["takeover_warnings"] = [str(w.message) for w in caught if "graphsan" in str(w.message)]
out["allocator_log_after"] = san.report().allocator_log if san else None
drop(held2)
out["replay2"] = replay_guarded(g2)
out["second_text"] = out.pop("error_text", "")
out["healthy"] = healthy()
finish()
