"""What every GPU test program starts with: the sanitizer under the policy in $GRAPHSAN ("off":
none), the `out` dict printed as one `RESULT {json}` line by `finish()` (`write_result`), a
guarded replay, a health check of the CUDA context, and a side stream `s` to capture on."""

import os

import torch

import graphsan
from graphsan.command_line import write_result

POLICY = os.environ.get("GRAPHSAN", "raise")
san = graphsan.enable(policy=POLICY) if POLICY != "off" else None
out = {}


def finish():
    out["findings"] = [
        {
            "kind": f.kind,
            "kernel": f.kernel,
            "param": f.param,
            "offset": f.offset,
            "node": f.node,
            "phase": f.phase,
            "step": f.step,
            "nbytes": f.nbytes,
            "free_stack": f.free_stack,
            "alloc_stack": f.alloc_stack,
            "label": f.graph.label,
            "pool": f.pool,
            "now": f.now,
            "through": f.through,
            "through_slot": f.through_slot,
            "written_by": f.order.written_by if f.order else None,
            "carved_by": f.order.carved_by if f.order else None,
            "host": f.host,
            "text": graphsan.report.format_finding(f),
        }
        for f in (san.findings if san else [])
    ]
    out["graphs"] = san.report().graphs if san else []
    out["disabled_reason"] = san.disabled_reason if san else None
    write_result(out)


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
