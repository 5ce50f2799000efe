"""Fault injection: does graphsan stop every replay that would touch memory made stale, and only those?

    python bench/bench_faults.py [--trials 1000] [--workers 16] [--time-limit 450] [--seed 0]
                                 [--kinds free,set,...] [--json out.json]

Each trial trains the lab model (tiny preset, per-module CUDA graphs for attn, mamba, moe_router
and moe_preprocess, validation every 3 steps) under `graphsan.enable(policy="raise")`, beside
what a training job also has: a data-loader copy from a pinned host batch into a static device
input, a gather through a device table of buffer addresses, three graphs that share one memory
pool and must replay in capture order, and a second model graphed with
`torch.cuda.make_graphed_callables` (2 MLP blocks, hidden 512, 1,024 tokens, forward and
backward graphs in one pool, its captured backward allocating on the autograd worker thread),
trained one step with its own AdamW per lab step and run eagerly in eval mode on validation
steps, and a small network (Linear, dropout, Linear) whose whole step with a capturable Adam is
one graph, validated eagerly in eval mode and put back in train mode. After a random step one fault is injected into memory some live graph uses, or, in
control trials, nothing:

    free          a graphed stage's static input is replaced by a new tensor; the old one dies
    free-reuse    the same, then new tensors of the same size take the freed block
    resize        a parameter the graphs read is resized (`resize_`), which moves its storage
    data-rebind   `p.data = p.data.clone()` on such a parameter: same values, new address
    set           `p.set_(clone)` under no_grad
    empty-cache   a freed static input, then `torch.cuda.empty_cache()`
    host-free     the pinned host batch the loader graph copies from is freed and re-pinned
    table-free    a buffer named in the address table is freed and its block reused
    replay-order  the pool-sharing graphs replay out of order (the third re-carved memory the
                  second has still to read)
    live-output   four graphs of one pool captured in a 1F1B order (forward mb0, forward mb1,
                  backward mb1, backward mb0) replay forward mb0, backward mb0, forward mb1:
                  forward mb1 writes over backward mb0's gradient, which the caller holds
    released-output
                  four graphs of one pool captured in sequence with Transformer Engine's buffer
                  reuse (forward mb0's output goes back to the pool once backward mb0 is
                  captured, and forward mb1 carves it) replay forward mb0, forward mb1: forward
                  mb1 writes over the output the caller still holds a view of
    eager-in-pool a tensor allocated eagerly into a graph's MemPool (`use_mem_pool`) is handed
                  the scratch the graph's capture freed: the next replay writes over it
    mgc-data-rebind
                  `p.data = p.data.clone()` on a weight of the make_graphed_callables model: its
                  graphed callables keep the Parameter and replay against its old storage
    mgc-input-rebind
                  a graphed block's sample input re-pointed at a new batch with `.data =`
                  instead of filled with `copy_`: the callable keeps that very tensor and
                  copies each new input into it, but its forward graph reads the old storage
    mode          a small network whose whole training step (forward, backward and a
                  capturable Adam step) is one graph is left in eval mode after an eager
                  validation: its graph still applies dropout
    baked-value   that step's float lr is changed (as a scheduler does): its graph keeps the
                  value it captured
    superseded    that network's weight is re-assigned as a new Parameter while the optimizer
                  keeps the old one alive: the graph reads and updates the old one
    internal-driver / internal-node
                  graphsan's own graph walk fails, or returns a malformed node, during the
                  capture: graphsan must disable itself with one warning and training go on

A fault counts as caught when the next replay that would use the stale memory raises
`graphsan.StaleMemoryError` (which happens before the graph is launched); missed when training
goes on or dies otherwise. A control trial raising anything is a false alarm. After every trial
the CUDA context is checked with a small kernel. Trials run in worker processes (batched, so
the imports and the Triton compile are paid once per worker); a worker whose CUDA context dies
is replaced and its trial counted as unhealthy.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

from fault_injection import (
    EVAL_INTERVAL,
    INTERNAL,
    KINDS,
    SCOPES,
    TRAIN_ITERS,
    WARMUP,
    Injector,
    gather_kernel,
    patch_internal,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------
def _healthy(torch) -> bool:
    try:
        torch.cuda.synchronize()
        x = torch.arange(1024, device="cuda", dtype=torch.float32)
        return float((x * 2).sum().item()) == 1024 * 1023.0
    except Exception:
        return False


def _view_vs_allocator(torch, addr: int) -> dict:
    """What graphsan's allocator view and a fresh snapshot say of the segment holding `addr`
    (a false alarm's block): which of the two is wrong, and how."""
    import graphsan

    memory = graphsan.current().memory
    out: dict = {"drains": memory.ledger.drains}
    view = memory.ledger.views.get(torch.cuda.current_device())
    seg = view.segment_at(addr) if view is not None else None
    if seg is not None:
        out["view"] = {
            "segment": hex(seg.address),
            "size": seg.size,
            "pool": list(seg.pool),
            "allocated_here": bool(seg.allocated_in(addr, addr + 1)),
        }
    for s in torch.cuda.memory._snapshot()["segments"]:
        if s["address"] <= addr < s["address"] + s["total_size"]:
            blocks = [
                (hex(b["address"]), b["size"], b["state"])
                for b in s["blocks"]
                if abs(b["address"] - addr) < 4 << 20
            ]
            out["allocator"] = {
                "segment": hex(s["address"]),
                "size": s["total_size"],
                "pool": list(s["segment_pool_id"]),
                "type": s.get("segment_type"),
                "blocks": blocks[:8],
            }
    return out


def run_trial(spec: dict, torch, gather) -> dict:
    from rich.console import Console

    import graphsan
    from graphsan.lab.train import TrainConfig
    from graphsan.lab.train.trainer import train
    from graphsan.report import format_finding

    san = graphsan.current()
    if san is None or not san.active:
        graphsan.disable()
        san = graphsan.enable(policy="raise")
    kind = spec["kind"]
    cfg = TrainConfig(
        preset="tiny",
        train_iters=TRAIN_ITERS,
        cuda_graph_modules=SCOPES,
        cuda_graph_warmup_steps=WARMUP,
        eval_interval=EVAL_INTERVAL,
        eval_iters=1,
        seed=spec["seed"] % 100000,
        device="cuda",
        quiet=True,
        log_interval=1000,
    )
    inj = Injector(spec, torch, gather)
    patched = patch_internal(kind) if kind in INTERNAL else None
    err_buf, real_err = io.StringIO(), sys.stderr
    sys.stderr = err_buf
    out = {"id": spec["id"], "kind": kind, "step": spec["step"]}
    t0 = time.perf_counter()
    try:
        train(cfg, console=Console(file=io.StringIO()), callbacks=[inj])
        out["outcome"] = "completed"
    except graphsan.StaleMemoryError as e:
        out["outcome"] = "stopped"
        out["finding_kinds"] = sorted({str(f.kind) for f in e.findings})
        out["finding"] = format_finding(e.findings[0])[:3000]  # what a false alarm says
        if inj.injected is None:
            out["view_vs_allocator"] = _view_vs_allocator(torch, e.findings[0].block_address)
    except Exception as e:  # a missed fault that crashed, or a harness problem: keep the text
        out["outcome"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        sys.stderr = real_err
        if patched is not None:
            patched.restore()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["injected"] = inj.injected
    warnings = [ln for ln in err_buf.getvalue().splitlines() if "graphsan:" in ln]
    out["graphsan_lines"] = warnings[:3]
    out["graphsan_active"] = bool(graphsan.current() is not None and graphsan.current().active)
    out["allocator_log"] = graphsan.current().report().allocator_log if graphsan.current() else None
    del inj
    gc.collect()
    out["healthy"] = _healthy(torch)
    return out


def worker() -> None:
    import torch

    specs = json.loads(sys.stdin.read())
    gather = gather_kernel()
    for spec in specs:
        print("START " + json.dumps(spec["id"]), flush=True)
        res = run_trial(spec, torch, gather)
        print("TRIAL " + json.dumps(res), flush=True)
        if not res["healthy"]:
            sys.exit(3)  # a dead CUDA context: the parent starts a fresh worker


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def verdict(res: dict) -> str:
    """caught | missed | false-alarm | went-on | no-hazard (a trial that injected nothing)."""
    kind, outcome = res["kind"], res["outcome"]
    if kind == "control":
        return "false-alarm" if outcome != "completed" else "clean"
    if kind in INTERNAL:  # training goes on; graphsan, if it gave up, said so once and stopped
        lines, active = len(res.get("graphsan_lines", [])), res.get("graphsan_active")
        ok = outcome == "completed" and ((lines == 1 and not active) or (lines == 0 and active))
        return "went-on" if ok else "missed"
    if res.get("injected") == "no-hazard":
        return "no-hazard"
    if res.get("injected") is None:  # stopped before the fault: a false alarm
        return "false-alarm" if outcome == "stopped" else "missed"
    return "caught" if outcome == "stopped" else "missed"


def run_workers(specs: list[dict], workers: int, deadline: float, log) -> list[dict]:
    queue = list(specs)
    lock = threading.Lock()
    results: list[dict] = []

    def take(n):
        with lock:
            batch, queue[:] = queue[:n], queue[n:]
            return batch

    def one_worker():
        while time.monotonic() < deadline:
            batch = take(max(1, len(specs) // (workers * 4)))
            if not batch:
                return
            pending = {s["id"]: s for s in batch}
            env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PYTHONUNBUFFERED="1")
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=ROOT,
            )
            proc.stdin.write(json.dumps(batch))
            proc.stdin.close()
            current, tail = None, []
            for line in proc.stdout:
                if line.startswith("START "):
                    current = json.loads(line[6:])
                elif line.startswith("TRIAL "):
                    res = json.loads(line[6:])
                    pending.pop(res["id"], None)
                    with lock:
                        results.append(res)
                    current = None
                else:
                    tail = (tail + [line.rstrip()])[-20:]
                if time.monotonic() > deadline + 60:
                    proc.kill()
                    break
            proc.wait()
            if current is not None and current in pending:  # the worker died inside a trial
                spec = pending.pop(current)
                res = dict(spec, outcome="died", healthy=False, injected="?", error="\n".join(tail))
                with lock:
                    results.append(res)
                log.write(f"worker died in trial {current}:\n" + "\n".join(tail) + "\n")
            with lock:  # trials the worker never started go back to the queue
                queue[:0] = list(pending.values())

    threads = [threading.Thread(target=one_worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def table(results: list[dict], kinds) -> str:
    by = defaultdict(list)
    for r in results:
        by[r["kind"]].append(r)
    head = (
        "| fault | trials | caught before launch | missed | false alarms | no hazard built "
        "| CUDA healthy after | finding kinds |\n|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for kind in kinds:
        rs = by.get(kind, [])
        if not rs:
            continue
        v = Counter(verdict(r) for r in rs)
        fk = Counter(k for r in rs for k in r.get("finding_kinds", []))
        caught = v["caught"] + v["went-on"]
        caught_s = "-" if kind == "control" else f"{caught}"
        if kind in INTERNAL:
            caught_s += " (went on)"
        rows.append(
            f"| {kind} | {len(rs)} | {caught_s} | {v['missed']} | {v['false-alarm']} "
            f"| {v['no-hazard']} | {sum(r['healthy'] for r in rs)}/{len(rs)} "
            f"| {', '.join(f'{k} {n}' for k, n in fk.most_common()) or '-'} |"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=450, help="seconds for all trials")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kinds", default=",".join(KINDS), help="comma-separated, of: " + ", ".join(KINDS)
    )
    ap.add_argument("--json", help="write every trial's result here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker()
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"--kinds: unknown {', '.join(bad)}; expected some of {', '.join(KINDS)}")
    if args.trials < 1 or args.workers < 1:
        ap.error("--trials and --workers: expected >= 1")
    import torch

    if not torch.cuda.is_available():
        print(
            "bench_faults.py needs a CUDA GPU (CUDA graphs); none is visible here", file=sys.stderr
        )
        return 2
    rng = random.Random(args.seed)
    specs = [
        {
            "id": i,
            "kind": kinds[i % len(kinds)],
            "seed": rng.randrange(1 << 30),
            "step": rng.randrange(WARMUP + 1, TRAIN_ITERS),
        }
        for i in range(args.trials)
    ]
    t0 = time.monotonic()
    results = run_workers(specs, args.workers, t0 + args.time_limit, sys.stderr)
    wall = time.monotonic() - t0
    results.sort(key=lambda r: r["id"])
    print(
        f"{len(results)} of {args.trials} trials in {wall:.0f} s with {args.workers} workers "
        f"(lab tiny preset, graphed {'+'.join(SCOPES)}, {TRAIN_ITERS} steps, policy raise)"
    )
    print(table(results, kinds))
    odd = [r for r in results if verdict(r) in ("missed", "false-alarm")]
    for r in odd[:8]:
        print(
            f"  trial {r['id']} {r['kind']} step {r['step']}: {verdict(r)}, outcome "
            f"{r['outcome']}, injected {r.get('injected')}, {r.get('error', '')[:200]}"
            f"{' ' + ' / '.join(r.get('graphsan_lines', [])) if r.get('graphsan_lines') else ''}"
        )
        if verdict(r) == "false-alarm" and r.get("finding"):
            print("    " + r["finding"][:1500].replace("\n", "\n    "))
            print("    view vs allocator: " + json.dumps(r.get("view_vs_allocator")))
    logs = Counter(r.get("allocator_log") for r in results)
    print("allocator events from: " + ", ".join(f"{k} ({n} trials)" for k, n in logs.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if not odd and len(results) == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
