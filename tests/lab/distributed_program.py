"""Run by tests under `python -m torch.distributed.run`.

distributed_program.py CONFIG_JSON OUT   train the configuration on every rank; each rank
                                         writes its losses, norms, captured main_grads and
                                         parameters to OUT.rank{N}.json
distributed_program.py --each JSON OUT   JSON maps names to configurations: each trained in
                                         turn, into OUT.{name}.rank{N}.json (one job for
                                         several tests: a job's start costs more than a tiny
                                         run)
distributed_program.py optimizer OUT     the distributed optimizer against the all-reduce
                                         one on a toy model of odd sizes, for every expert-
                                         parallel size dividing the ranks; OUT.rank{N}.json
"""

from __future__ import annotations

import atexit
import json
import os
import sys

import torch
from torch import nn

from graphsan.lab.train.callbacks import Callback
from graphsan.lab.train.config import TrainConfig
from graphsan.lab.train.distributed import setup
from graphsan.lab.train.optim import MainGradAdamW
from graphsan.lab.train.trainer import train


class KeepModel(Callback):
    model = None

    def on_model_built(self, model) -> None:
        self.model = model


def train_program(cfg_json: str, out: str) -> None:
    cfg = TrainConfig(**json.loads(cfg_json))
    keep = KeepModel()
    result = train(cfg, callbacks=[keep])
    result_json = {
        "losses": result.losses,
        "mtp_losses": result.mtp_losses,
        "grad_norms": result.grad_norms,
        "eval_losses": result.eval_losses,
        "main_grads": {k: v.tolist() for k, v in (result.main_grads or [{}])[-1].items()},
    }
    if sum(p.numel() for p in keep.model.parameters()) <= 10**6:  # the CPU tests' tiny models
        result_json["params"] = {
            n: p.detach().float().reshape(-1).tolist() for n, p in keep.model.named_parameters()
        }
    with open(f"{out}.rank{os.environ['RANK']}.json", "w") as fh:
        json.dump(result_json, fh)


class _Experts(nn.Module):
    """Stands for a MoE whose experts are split across ranks (`ep` set), as the lab's."""

    def __init__(self, ep):
        super().__init__()
        self.experts = nn.Linear(3, 7)  # 28 elements
        self.ep = ep


def _toy(ep_index: int | None) -> nn.Module:
    """Dense: 12 + 5 elements (odd); experts: 28, drawn per expert shard."""
    torch.manual_seed(0)
    model = nn.Module()
    model.dense = nn.Linear(3, 3).to(torch.bfloat16)
    model.scale = nn.Parameter(torch.randn(5))
    model.moe = _Experts(None if ep_index is None else object())
    torch.manual_seed(100 + (ep_index or 0))
    model.moe.experts.reset_parameters()
    return model


def _grads(model: nn.Module, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    for p in model.parameters():
        p.main_grad.copy_(torch.randn(p.shape, generator=g))


def optimizer_program(out: str) -> None:
    """For each EP size: the sharded optimizer and the all-reduce one on the same toy take the
    same steps from the same per-rank gradients; their parameters must agree bit for bit (no
    clipping: the norm's summation order differs) or to rounding (clipping), and a state saved
    from the sharded one and loaded into fresh optimizers, sharded or not, must continue alike."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    report = {}
    for ep in [e for e in (1, 2, 4) if world % e == 0 and e <= world]:
        d = setup(torch.device("cpu"), ep, 1.0)
        ep_index = rank % ep if ep > 1 else None
        for clip in (1e9, 0.05):
            models = [_toy(ep_index) for _ in range(4)]
            kw = dict(lr=0.1, clip_grad=clip, dist=d)
            sharded = MainGradAdamW(models[0], distributed_optimizer=True, **kw)
            plain = MainGradAdamW(models[1], **kw)
            row = {"param_diff": [], "norm_rel": [], "resumed_diff": [], "unsharded_load_diff": []}
            for step in range(1, 4):
                for m, opt in ((models[0], sharded), (models[1], plain)):
                    opt.zero_grad()
                    _grads(m, step, rank)
                    opt.reduce_grads()
                ns, np_ = sharded.step(0.1), plain.step(0.1)
                row["norm_rel"].append(abs(float(ns) - float(np_)) / float(np_))
                row["param_diff"].append(_max_diff(models[0], models[1]))
            state = sharded.state_dict()
            again = MainGradAdamW(models[2], distributed_optimizer=True, **kw)
            again.load_state_dict(state)
            unsharded = MainGradAdamW(models[3], **kw)
            unsharded.load_state_dict(state)
            for m, opt in zip(models, (sharded, plain, again, unsharded), strict=True):
                opt.zero_grad()
                _grads(m, 4, rank)
                opt.reduce_grads()
                opt.step(0.1)
            row["resumed_diff"].append(_max_diff(models[0], models[2]))
            row["unsharded_load_diff"].append(_max_diff(models[1], models[3]))
            report[f"ep{ep}-clip{clip:g}"] = row
    with open(f"{out}.rank{rank}.json", "w") as fh:
        json.dump(report, fh)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (pa.float() - pb.float()).abs().max().item()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )


def _refuse_a_live_group_at_exit() -> None:
    """A process that exits with its gloo group alive can abort in the interpreter's teardown
    (gloo's threads still hold tensors), now and then and mostly under load; failing every time
    it is left alive makes a path that forgets to destroy it show on the first run."""
    if torch.distributed.is_initialized():
        print("distributed_program: the process group is still alive at exit", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)


if __name__ == "__main__":
    atexit.register(_refuse_a_live_group_at_exit)
    if sys.argv[1] in ("optimizer", "--each"):
        # one group for every run (each run's own would be made and destroyed in turn, and gloo
        # does not always connect a second time); each run makes its EP groups in it
        torch.distributed.init_process_group("gloo")
        try:
            if sys.argv[1] == "optimizer":
                optimizer_program(sys.argv[2])
            else:
                for name, cfg in json.loads(sys.argv[2]).items():
                    print(f"distributed_program: training {name}", file=sys.stderr, flush=True)
                    train_program(json.dumps(cfg), f"{sys.argv[3]}.{name}")
        finally:
            torch.distributed.destroy_process_group()
    else:
        train_program(sys.argv[1], sys.argv[2])
