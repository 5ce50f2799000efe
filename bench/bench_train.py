"""Benchmark of the lab trainer: eager vs per-scope CUDA graphs, per recipe mix, and the cost of
the fixed state policy vs TE 2.18's (te218, no validation so it cannot fault).

    PYTHONPATH=src python3 bench/bench_train.py [--preset small] [--iters 10] [--out FILE]
    PYTHONPATH=src python3 bench/bench_train.py --nproc 2 [--ep 2] [--variants ...]

Prints a table of step times and ratios (graphed speed-up over eager of the same recipe mix);
with --out, also writes it, with date, GPU, torch and the command, to FILE (the numbers go into
docs/PERF.md's "Trainer" section by hand). Never asserts timings.

`--nproc N` is weak scaling: every variant runs under torchrun on 1 GPU and on N GPUs with the
same per-GPU batch (the global batch grows N times), and the table gives the throughput of N
GPUs over one GPU's and, on N GPUs, graphed against eager. `--ep` splits the routed experts
across that many of the N ranks (default 1: data parallel only). `--use-distributed-optimizer`
also runs every variant on N GPUs with the sharded optimizer (reduce-scatter, sharded fp32
masters and Adam states, all-gather) and gives its throughput and peak memory beside the
all-reduce one's.

`--profile` profiles the last `--profile-steps` steps of each variant (torch.profiler) and prints
where a step goes: wall time, kernel time (graph replays included), launches, and the kernels
and host-side operators that cost the most.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from graphsan.lab.train import TrainConfig, train
from graphsan.lab.train.callbacks import Callback

SCOPES = ("attn", "mamba", "moe_router", "moe_preprocess")
VARIANTS = {  # name: (precision config, graphed scopes, graph state)
    "bf16 eager": (None, (), "fixed"),
    "bf16 graphed": (None, SCOPES, "fixed"),
    "mxfp8-all eager": ("mxfp8-all", (), "fixed"),
    "mxfp8-all graphed": ("mxfp8-all", SCOPES, "fixed"),
    "super-mixed eager": ("super-mixed", (), "fixed"),
    "super-mixed graphed": ("super-mixed", SCOPES, "fixed"),
    "super-mixed graphed te218": ("super-mixed", SCOPES, "te218"),
}


def write_table(a, rows) -> None:
    """Print the ratio table and (re)write --out; called after every variant, so a run cut
    short still leaves its numbers."""
    lines = ["| variant | ms/step | tokens/s | vs eager (same recipes) |", "|---|---:|---:|---:|"]
    for name, r in rows.items():
        eager = rows.get(name.split(" ")[0] + " eager")
        ratio = f"{eager.step_ms / r.step_ms:.2f}x" if eager and r.step_ms else "-"
        lines.append(f"| {name} | {r.step_ms:.1f} | {r.tokens_per_s:,.0f} | {ratio} |")
    fixed, te = rows.get("super-mixed graphed"), rows.get("super-mixed graphed te218")
    if fixed and te:
        lines.append(
            f"\nfixed state vs te218 (super-mixed graphed): {fixed.step_ms / te.step_ms:.3f}x step time"
        )
    table = "\n".join(lines)
    print(table)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    header = (
        f"# Trainer performance\n\nDate: {datetime.date.today()}  \nGPU: {gpu}  \n"
        f"torch: {torch.__version__}  \nCommand: `PYTHONPATH=src python3 {' '.join(sys.argv)}`  \n"
        f"Setup: preset {a.preset}, {a.iters} iterations ({a.warmup} eager warm-up, then capture), "
        f"micro batch {a.micro_batch_size} x seq {a.seq_length}, global batch "
        f"{a.global_batch_size}; steady-state step time excludes the first iteration and capture.\n\n"
    )
    if a.out:
        with open(a.out, "w") as f:
            f.write(header + table + "\n")


class ProfileSteps(Callback):
    """torch.profiler over the last `steps` train steps of a run of `iters` iterations."""

    def __init__(self, iters: int, steps: int):
        self.first, self.last, self.steps = iters - steps, iters, steps
        self.prof = None
        self.t0 = 0.0

    def on_step_end(self, iteration: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        if iteration == self.first:
            torch.cuda.synchronize()
            acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif iteration == self.last and self.prof is not None:
            torch.cuda.synchronize()
            self.wall_ms = (time.perf_counter() - self.t0) * 1e3 / self.steps
            self.prof.__exit__(None, None, None)

    def table(self, name: str, top: int = 18) -> str:
        """Where one step goes (per step: the totals divided by the steps profiled)."""
        if self.prof is None:
            return f"profile {name}: no steps profiled (expected --iters above --profile-steps)"
        n, ev = self.steps, self.prof.key_averages()
        kernels = [e for e in ev if e.self_device_time_total > 0]
        busy = sum(e.self_device_time_total for e in kernels) / n / 1e3
        count = {e.key: e.count / n for e in ev}
        launches = sum(
            v
            for k, v in count.items()
            if k
            in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
        )
        lines = [
            f"\nprofile, {name}: {self.wall_ms:.1f} ms wall a step, {busy:.1f} ms of kernels "
            f"({busy / self.wall_ms:.0%}), {launches:.0f} eager kernel launches and "
            f"{count.get('cudaGraphLaunch', 0):.0f} graph launches a step",
            "| kernel | ms/step | calls/step |",
            "|---|---:|---:|",
        ]
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
            lines.append(
                f"| {e.key[:80]} | {e.self_device_time_total / n / 1e3:.2f} | {e.count / n:g} |"
            )
        ops = [e for e in ev if e.key.startswith("aten::")]
        lines += ["| host operator | self CPU ms/step | calls/step |", "|---|---:|---:|"]
        for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]:
            lines.append(f"| {e.key} | {e.self_cpu_time_total / n / 1e3:.2f} | {e.count / n:g} |")
        return "\n".join(lines)


def out_problem(path: str | None) -> str | None:
    """Why --out cannot be written, or None."""
    if path is None:
        return None
    if not path:
        return "empty; expected a file path"
    folder = os.path.dirname(path) or "."
    if os.path.isdir(path):
        return "is a directory; expected a file path"
    if not os.path.isdir(folder):
        return f"folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"folder {folder} is not writable"
    return None


def worker(cfg_json: str, result_path: str) -> int:
    """One rank of a torchrun job (--worker): train, rank 0 writes the result."""
    r = train(TrainConfig(**json.loads(cfg_json)))
    if os.environ.get("RANK", "0") == "0":
        with open(result_path, "w") as fh:
            json.dump(
                {
                    "step_ms": r.step_ms,
                    "tokens_per_s": r.tokens_per_s,
                    "loss": r.losses[-1],
                    "peak_mem_gib": r.peak_mem_gib,
                },
                fh,
            )
    return 0


def run_ranks(cfg: TrainConfig, nproc: int) -> dict:
    """`cfg` under torchrun on `nproc` processes; rank 0's result (step time, tokens/s)."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    fields["world_size"] = None  # each rank reads torchrun's WORLD_SIZE
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", __file__, "--worker", json.dumps(fields), path]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"{nproc} rank(s) failed (exit {proc.returncode}):\n{tail}")
        with open(path) as fh:
            return json.load(fh)


def weak_scaling(a, names: list[str]) -> int:
    """Every variant on 1 GPU and on N GPUs, same per-GPU batch; the table of ratios."""
    n = a.nproc
    rows = []
    for name in names:
        precision, scopes, state = VARIANTS[name]
        per = {}
        runs = [(1, False), (n, False)] + ([(n, True)] if a.use_distributed_optimizer else [])
        for nproc, sharded in runs:
            cfg = TrainConfig(
                preset=a.preset,
                train_iters=a.iters,
                cuda_graph_warmup_steps=a.warmup,
                seq_length=a.seq_length,
                micro_batch_size=a.micro_batch_size,
                global_batch_size=a.global_batch_size * nproc,
                precision_config=precision,
                cuda_graph_modules=scopes,
                state_policy=state,
                expert_model_parallel_size=a.ep if nproc > 1 else 1,
                use_distributed_optimizer=sharded,
                world_size=nproc,
                device=a.device,
                quiet=True,
                log_interval=10**6,
            )
            key = "dist-opt" if sharded else nproc
            per[key] = run_ranks(cfg, nproc)
            print(
                f"{name:<28} {nproc} rank(s){' dist-opt' if sharded else ''}: "
                f"{per[key]['step_ms']:8.1f} ms/step {per[key]['tokens_per_s']:12,.0f} tok/s "
                f"peak {per[key]['peak_mem_gib']:.2f} GiB",
                flush=True,
            )
        rows.append((name, per[1], per[n], per.get("dist-opt")))
    lines = [
        f"| variant | 1 GPU tok/s | {n} GPUs tok/s | {n} GPUs / 1 GPU | {n} GPUs ms/step | "
        f"vs eager on {n} GPUs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    if a.use_distributed_optimizer:
        lines[0] += " dist-opt tok/s | dist-opt / all-reduce | peak GiB all-reduce / dist-opt |"
        lines[1] += "---:|---:|---:|"
    by_name = {name: many for name, _, many, _ in rows}
    for name, one, many, sharded in rows:
        eager = by_name.get(name.split(" ")[0] + " eager")
        vs = f"{eager['step_ms'] / many['step_ms']:.2f}x" if eager and many["step_ms"] else "-"
        scale = many["tokens_per_s"] / one["tokens_per_s"] if one["tokens_per_s"] else 0.0
        lines.append(
            f"| {name} | {one['tokens_per_s']:,.0f} | {many['tokens_per_s']:,.0f} | "
            f"{scale:.2f}x | {many['step_ms']:.1f} | {vs} |"
        )
        if sharded:
            ratio = sharded["tokens_per_s"] / many["tokens_per_s"] if many["tokens_per_s"] else 0
            lines[-1] += (
                f" {sharded['tokens_per_s']:,.0f} | {ratio:.2f}x | "
                f"{many['peak_mem_gib']:.2f} / {sharded['peak_mem_gib']:.2f} |"
            )
    table = "\n".join(lines)
    print(table)
    if a.out:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        dopt = " (and with the distributed optimizer)" if a.use_distributed_optimizer else ""
        with open(a.out, "w") as f:
            f.write(
                f"# Trainer weak scaling\n\nDate: {datetime.date.today()}  \nGPU: {n} x {gpu}  \n"
                f"torch: {torch.__version__}  \nCommand: `PYTHONPATH=src python3 "
                f"{' '.join(sys.argv)}`  \nSetup: preset {a.preset}, {a.iters} iterations, per "
                f"GPU micro batch {a.micro_batch_size} x seq {a.seq_length}, per-GPU batch "
                f"{a.global_batch_size} (global {a.global_batch_size} x GPUs), expert parallel "
                f"{a.ep} on {n} GPUs{dopt}.\n\n{table}\n"
            )
    return 0


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3, help="eager steps before capture")
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=4)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="weak scaling: 1 vs N GPUs (torchrun), same per-GPU batch",
    )
    ap.add_argument("--ep", type=int, default=1, help="with --nproc: expert-parallel ranks")
    ap.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="with --nproc: also run every variant on N GPUs with the sharded optimizer",
    )
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu (cpu: gloo, a smoke test)")
    ap.add_argument("--profile", action="store_true", help="also where each variant's step goes")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps --profile covers")
    a = ap.parse_args()
    problem = out_problem(a.out)
    if problem:  # before the runs, which take minutes
        print(f"bench_train: --out {a.out!r}: {problem}", file=sys.stderr)
        return 2
    names = [v for v in a.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        print(
            f"bench_train: unknown variant {bad[0]!r}; expected some of {list(VARIANTS)}",
            file=sys.stderr,
        )
        return 2
    if a.profile and not torch.cuda.is_available():
        print("bench_train: --profile: expected a CUDA GPU (it times kernels)", file=sys.stderr)
        return 2
    if a.profile and not 1 <= a.profile_steps < a.iters - a.warmup:
        print(
            f"bench_train: --profile-steps {a.profile_steps}: expected 1 to "
            f"{a.iters - a.warmup - 1} (steps after capture and the first steady step)",
            file=sys.stderr,
        )
        return 2
    if a.profile and a.nproc:
        print("bench_train: --profile: expected no --nproc (one process)", file=sys.stderr)
        return 2
    if a.use_distributed_optimizer and not a.nproc:
        print(
            "bench_train: --use-distributed-optimizer: expected --nproc N (it shards over ranks)",
            file=sys.stderr,
        )
        return 2
    if a.nproc:
        gpus = torch.cuda.device_count() if a.device != "cpu" else a.nproc
        if a.nproc < 2 or a.nproc > gpus:
            print(
                f"bench_train: --nproc {a.nproc}: expected 2 to {max(gpus, 2)} ranks, one GPU "
                f"each (this machine has {torch.cuda.device_count()} GPU(s))",
                file=sys.stderr,
            )
            return 2
        if a.nproc % a.ep:
            print(
                f"bench_train: --ep {a.ep}: expected a divisor of --nproc {a.nproc}",
                file=sys.stderr,
            )
            return 2
        return weak_scaling(a, names)
    rows = {}
    for name in names:
        precision, scopes, state = VARIANTS[name]
        cfg = TrainConfig(
            preset=a.preset,
            train_iters=a.iters,
            cuda_graph_warmup_steps=a.warmup,
            seq_length=a.seq_length,
            micro_batch_size=a.micro_batch_size,
            global_batch_size=a.global_batch_size,
            precision_config=precision,
            cuda_graph_modules=scopes,
            state_policy=state,
            quiet=True,
            log_interval=10**6,
        )
        t0 = time.perf_counter()
        prof = ProfileSteps(a.iters, a.profile_steps) if a.profile else None
        r = train(cfg, callbacks=[prof] if prof else ())
        rows[name] = r
        print(
            f"{name:<28} {r.step_ms:8.1f} ms/step {r.tokens_per_s:12,.0f} tok/s "
            f"(run {time.perf_counter() - t0:.0f} s, loss {r.losses[-1]:.3f})",
            flush=True,
        )
        write_table(a, rows)
        if prof:
            print(prof.table(name), flush=True)

    return 0


if __name__ == "__main__":
    sys.exit(main())
