"""The lab on two processes (torchrun, gloo on CPU): the same global batch gives the same losses
as one process, with data parallelism alone and with the routed experts split across the ranks,
with the optimizer replicated or sharded (the distributed optimizer, also against the replicated
one on a toy of odd sizes, and resumed from a checkpoint); only rank 0 prints; bad distributed settings are one clear line. The GPU twin (two GPUs, NCCL,
CUDA graphs) is at the end, skipped with fewer than two GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphsan.lab.train.config import ConfigError, TrainConfig
from graphsan.lab.train.distributed import (
    DistributedError,
    check_device_for_rank,
    world_from_env,
)
from graphsan.lab.train.trainer import train
from tests.lab.distributed_program import KeepModel
from tests.once import once

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).with_name("distributed_program.py")
# bf16 runs add the same numbers in another order (the all-reduce, the experts' rows of two
# microbatches in one GEMM), so the losses agree to rounding, not bit for bit
RTOL = 2e-3


def tiny(**changes) -> dict:
    cfg = dict(
        preset="tiny",
        train_iters=3,
        micro_batch_size=2,
        global_batch_size=8,
        seq_length=32,
        eval_interval=3,
        eval_iters=1,
        device="cpu",
        quiet=True,
        capture_grads=("layers.2.mixer.router.weight",),
        # wider weights than the preset's: the experts' share of the clipping norm is then large
        # enough to show whether both ranks' experts are counted
        model_overrides={"init_std": 0.3},
    )
    cfg.update(changes)
    return cfg


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def run_ranks(cfg: dict, tmp_path: Path) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "result"
    proc = torchrun([str(PROGRAM), json.dumps(cfg), str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b, strict=True))


# (expert_model_parallel_size, use_distributed_optimizer) of the runs matched with one process
MATCHED = {
    "data-parallel": (1, False),
    "expert-parallel": (2, False),
    "dist-opt": (1, True),
    "dist-opt-expert-parallel": (2, True),
}
# the resumed run's settings: the experts split, the distributed optimizer
RESUMED = dict(expert_model_parallel_size=2, use_distributed_optimizer=True, eval_interval=0)
# The two-rank runs of the tests marked with this group are trained in one torchrun job
# (`two_rank_runs`): starting a job costs more than a tiny run. The group keeps those tests on
# one xdist worker (`--dist loadgroup`, pyproject.toml), and `once` runs the job once where a
# pytest loses the group.
ONE_JOB = pytest.mark.xdist_group("test_distributed-two-rank-runs")


@pytest.fixture(scope="module")
def two_rank_runs(request):
    """Each MATCHED configuration, then the resumed test's uninterrupted 4 iterations ("whole")
    and its first 2 saved ("first"), trained in turn by every rank of one job. Returns the
    job's folder and `ranks(name)`: the two ranks' results for one run (failing the test that
    asks where the job failed)."""

    def job(folder: Path) -> dict:
        runs = {
            name: tiny(expert_model_parallel_size=ep, use_distributed_optimizer=sharded)
            for name, (ep, sharded) in MATCHED.items()
        }
        common = dict(RESUMED, capture_grads=(), save=str(folder / "ckpt"))
        runs["whole"] = tiny(train_iters=4, **common)
        runs["first"] = tiny(train_iters=2, save_interval=2, **common)  # saved after "whole"'s
        proc = torchrun([str(PROGRAM), "--each", json.dumps(runs), str(folder / "result")])
        return {"folder": str(folder), "rc": proc.returncode, "stderr": proc.stderr[-3000:]}

    ran = once(request, "two-rank-runs", job)
    folder = Path(ran["folder"])

    def ranks(name: str) -> list[dict]:
        assert ran["rc"] == 0, ran["stderr"]
        return [json.loads((folder / f"result.{name}.rank{r}.json").read_text()) for r in range(2)]

    return folder, ranks


@pytest.fixture(scope="module")
def one_process():
    """The MATCHED runs' reference: the same global batch in one process, and its model."""
    one = train(TrainConfig(**tiny(), world_size=1), callbacks=[keep := KeepModel()])
    return one, keep.model


@ONE_JOB
@pytest.mark.parametrize("name", MATCHED)
def test_two_ranks_match_one_process_on_the_same_global_batch(name, two_rank_runs, one_process):
    """2 ranks x 2 microbatches x 2 sequences = one process's 4 microbatches x 2: the losses,
    the validation loss, a router gradient (reduced over the ranks) and the parameters agree,
    with the optimizer replicated or sharded (--use-distributed-optimizer)."""
    ep, _ = MATCHED[name]
    one, model = one_process
    ranks = two_rank_runs[1](name)
    for rank, r in enumerate(ranks):
        assert close(r["losses"], one.losses), (r["losses"], one.losses)
        assert close(r["mtp_losses"], one.mtp_losses)
        assert close(r["grad_norms"], one.grad_norms)  # the experts of both ranks count
        assert close([v for _, v in r["eval_losses"]], [v for _, v in one.eval_losses])
        grad = torch.tensor(r["main_grads"]["layers.2.mixer.router.weight"])
        ref = one.main_grads[-1]["layers.2.mixer.router.weight"]
        assert (grad - ref).norm() <= 1e-2 * ref.norm()
        for pname, p in model.named_parameters():
            got, want = torch.tensor(r["params"][pname]), p.detach().float().reshape(-1)
            if got.numel() != want.numel():  # experts split: this rank holds its share of them
                want = want.reshape(ep, -1)[rank % ep]
            assert (got - want).norm() <= 1e-2 * want.norm(), pname
    # every rank took the same steps, so they report the same (all-reduced) losses and hold the
    # same dense parameters
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["params"]["embedding.weight"] == ranks[1]["params"]["embedding.weight"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [4])
def test_distributed_optimizer_steps_as_the_all_reduce_one(nproc, tmp_path):
    """A toy model of odd sizes (the buffers are padded to a multiple of the ranks), every
    expert-parallel size dividing the ranks (with 4 ranks and EP 2 the experts are sharded
    over two ranks too): reduce-scatter + sharded AdamW + all-gather leave the parameters the
    all-reduce optimizer gives, bit for bit without clipping (a wrong division or a shard
    stepped against another slice shows here), to rounding with it; a state saved sharded and
    loaded into fresh optimizers, sharded or not, continues as the original."""
    out = tmp_path / "opt"
    proc = torchrun([str(PROGRAM), "optimizer", str(out)], nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in range(nproc):
        report = json.loads(Path(f"{out}.rank{r}.json").read_text())
        assert set(report) >= {"ep1-clip1e+09", "ep2-clip0.05"}
        for case, row in report.items():
            exact = case.endswith("clip1e+09")
            limit = 0.0 if exact else 1e-6
            assert max(row["param_diff"]) <= limit, (r, case, row)
            assert max(row["unsharded_load_diff"]) <= limit, (r, case, row)
            assert max(row["resumed_diff"]) == 0.0, (r, case, row)
            assert max(row["norm_rel"]) <= 1e-6, (r, case, row)


@ONE_JOB
def test_a_resumed_sharded_run_continues_identically(two_rank_runs, tmp_path):
    """Two ranks with the distributed optimizer and the experts split: 2 iterations saved (one
    file per expert shard, the shards' states gathered), then --load and 2 more in a job of its
    own, give the losses and parameters of 4 iterations in one go, exactly."""
    folder, ranks = two_rank_runs
    whole = ranks("whole")
    ranks("first")
    ckpt = folder / "ckpt"
    assert [p.name for p in sorted(ckpt.iterdir())] == ["latest.ep0.pt", "latest.ep1.pt"]
    # the rest resumes in fresh processes, as a real resumed run does
    rest = dict(RESUMED, capture_grads=(), save=str(ckpt), load=str(ckpt))
    resumed = run_ranks(tiny(train_iters=4, **rest), tmp_path / "rest")
    for r in range(2):
        assert resumed[r]["losses"] == whole[r]["losses"][2:]
        assert resumed[r]["grad_norms"] == whole[r]["grad_norms"][2:]
        assert resumed[r]["params"] == whole[r]["params"]


@pytest.mark.slow
def test_only_rank_0_prints_and_the_global_batch_is_split(tmp_path):
    proc = torchrun(
        [
            "-m",
            "graphsan.cli",
            "train",
            "--preset",
            "tiny",
            "--train-iters",
            "2",
            "--device",
            "cpu",
            "--seq-length",
            "32",
            "--global-batch-size",
            "8",
            "--log-interval",
            "1",
            "--expert-model-parallel-size",
            "2",
            "--use-distributed-optimizer",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("graphsan train: preset tiny") == 1  # the header, once for the job
    assert sum(line.startswith("iter ") for line in out.splitlines()) == 2
    assert (
        "2 ranks (gloo), data parallel 2, expert parallel 2 (4 experts per rank), distributed "
        "optimizer | global batch" in out
    )
    assert "global batch 8 = 2 x 2 microbatch(es) x 2 ranks" in out


@pytest.mark.slow
def test_a_bad_split_is_one_line_from_each_rank_that_reports(tmp_path):
    proc = torchrun(
        [
            "-m",
            "graphsan.cli",
            "train",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--global-batch-size",
            "6",
            "--micro-batch-size",
            "2",
            "--seq-length",
            "32",
        ]
    )
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("graphsan train")]
    # torchrun stops the other workers once one fails, so a slower rank may be stopped before it
    # prints: at least one rank reports, and every rank that reports says it in one named line
    expected = {
        f"graphsan train [rank {r}]: error: --global-batch-size 6 is not a multiple of "
        "--micro-batch-size 2 x 2 ranks"
        for r in (0, 1)
    }
    assert lines and len(lines) == len(set(lines)) and set(lines) <= expected, lines
    # torchrun itself reports the failed children with its own traceback; none comes from us
    assert "graphsan/lab" not in proc.stderr and "ConfigError" not in proc.stderr


def test_torchrun_environment_is_read_and_checked():
    assert world_from_env({}) == (0, 1, 0)
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }
    assert world_from_env(env) == (3, 4, 1)
    with pytest.raises(DistributedError, match="RANK=4, WORLD_SIZE=4"):
        world_from_env(dict(env, RANK="4"))
    with pytest.raises(DistributedError, match="WORLD_SIZE='two'"):
        world_from_env(dict(env, WORLD_SIZE="two"))
    with pytest.raises(DistributedError, match="MASTER_PORT not set"):
        world_from_env({k: v for k, v in env.items() if k != "MASTER_PORT"})


def test_each_rank_trains_on_its_own_gpu_or_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device_for_rank("auto", 1) == check_device_for_rank("cuda", 1) == "cuda:1"
    assert check_device_for_rank("cpu", 1) == "cpu"
    with pytest.raises(
        DistributedError, match="LOCAL_RANK 2 needs GPU cuda:2, but this machine has 2"
    ):
        check_device_for_rank("cuda", 2)
    with pytest.raises(DistributedError, match="each rank trains on cuda:LOCAL_RANK"):
        check_device_for_rank("cuda:0", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_device_for_rank("auto", 1) == "auto"  # left to resolve_device: the CPU, gloo


def test_expert_parallel_size_must_divide_ranks_and_experts():
    with pytest.raises(ConfigError, match="expected a divisor of the number of processes"):
        TrainConfig(preset="tiny", world_size=4, expert_model_parallel_size=3).validate()
    with pytest.raises(ConfigError, match="model has 8 routed experts"):
        TrainConfig(preset="tiny", world_size=16, expert_model_parallel_size=16).validate()
    with pytest.raises(ConfigError, match=r"1 process\(es\)"):
        train(TrainConfig(preset="tiny", world_size=1, expert_model_parallel_size=2))
    # one process keeps its defaults: one microbatch of micro-batch-size
    assert TrainConfig(preset="tiny", world_size=1).validate().global_batch_size == 2
    assert TrainConfig(preset="tiny", world_size=2).validate().global_batch_size == 4


def test_the_memory_check_counts_the_sharded_optimizer():
    """Each of 4 ranks holds a quarter of the fp32 masters and moments (12 of 16 bytes)."""
    from graphsan.lab.train.device import memory_needed

    plain = TrainConfig(preset="tiny", world_size=4).validate()
    need, _, trainable = memory_needed(plain)
    sharded, _, _ = memory_needed(plain.replace(use_distributed_optimizer=True))
    assert need - sharded == 12 * trainable * 3 // 4


@pytest.mark.gpu
@pytest.mark.parametrize("sharded", [False, True], ids=["all-reduce", "dist-opt"])
def test_two_gpus_match_one_gpu_with_cuda_graphs(sharded, tmp_path):
    """NCCL, expert parallel 2, the scenario's graphed scopes, MXFP8, the optimizer replicated
    or sharded: the losses of two GPUs agree with one GPU's on the same global batch within
    the matrix's tolerance."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL between two ranks)")
    from graphsan.lab.repro.cases import LOSS_RTOL

    cfg = tiny(
        device="cuda",
        preset="small",
        seq_length=256,
        micro_batch_size=1,
        global_batch_size=4,
        train_iters=6,
        eval_interval=5,
        precision_config="mxfp8-all",
        cuda_graph_modules=["attn", "mamba", "moe_router", "moe_preprocess"],
        cuda_graph_warmup_steps=2,
        capture_grads=(),
        model_overrides={},
    )
    one = run_ranks_n(cfg, tmp_path / "one", 1)[0]
    two = run_ranks_n(
        dict(cfg, expert_model_parallel_size=2, use_distributed_optimizer=sharded),
        tmp_path / "two",
        2,
    )
    for r in two:
        rel = [abs(x - y) / abs(y) for x, y in zip(r["losses"], one["losses"], strict=True)]
        assert max(rel) <= LOSS_RTOL, rel


def run_ranks_n(cfg: dict, out: Path, nproc: int) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    proc = torchrun([str(PROGRAM), json.dumps(cfg), str(out / "r")], nproc=nproc, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"r.rank{r}.json").read_text()) for r in range(nproc)]
