"""State a graph bakes at capture beside addresses: the modules' train/eval mode, an optimizer's
hyperparameters taken by value, and which tensor a module's or a param group's entry holds.
Each correct program follows the documented way to change that state under a graph; its twin
changes it the way the graph never sees (no memory is freed: the twins are caught by kind)."""

from __future__ import annotations

import copy

import torch

from graphsan.selftest import program
from graphsan.selftest.case import Case

NOTES = "https://pytorch.org/docs/stable/notes/cuda.html"
OPTIM = "https://pytorch.org/docs/stable/optim.html"


class _Net(torch.nn.Module):
    def __init__(self, width: int = 128, p: float = 0.2) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.drop = torch.nn.Dropout(p)
        self.down = torch.nn.Linear(2 * width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.down(self.drop(torch.nn.functional.gelu(self.up(x)))))


def _graphed_step(case: Case, model, opt, x, y):
    """Forward, backward and step in one graph, after a warm-up on a side stream (the notes'
    whole-network recipe); the graph and its static loss."""

    def step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    def eager():
        opt.zero_grad(set_to_none=True)
        return step()

    case.warmup(eager)
    opt.zero_grad(set_to_none=True)
    return case.capture(step)


@program(
    "baked/mode-validation",
    pattern="a training step graphed in train mode (dropout), an eager validation under "
    "model.eval() and no_grad, then model.train() before the next replay",
    source=f"{NOTES}#whole-network-capture; Megatron-LM and Transformer Engine's validation",
    bug="the step graph replayed while the model is still in eval mode: it keeps applying dropout",
)
def mode_validation(case: Case) -> None:
    torch.manual_seed(0)
    model = _Net().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, 128, device="cuda"), torch.randn(32, 128, device="cuda")
    g, loss = _graphed_step(case, model, opt, x, y)
    case.replay(g, 2)
    model.eval()
    with torch.no_grad():
        val = torch.nn.functional.mse_loss(model(x), y)
    case.check(bool(torch.isfinite(val)), "the eager validation loss is finite")
    if case.broken:
        case.expect("mode")
    else:
        model.train()
    case.replay(g)
    torch.cuda.synchronize()
    case.check(bool(torch.isfinite(loss)), "the graphed loss is finite")


@program(
    "baked/scheduler-lr",
    pattern="Adam(capturable=True) with a tensor lr in a graphed training step, stepped by "
    "ExponentialLR between replays (the scheduler fills the tensor in place)",
    source=f"{OPTIM} (lr as a Tensor); pytorch test/optim/test_lrscheduler.py",
    bug="lr given as a Python float: the scheduler changes param_groups[0]['lr'], and the "
    "graph keeps stepping with the value it captured",
)
def scheduler_lr(case: Case) -> None:
    torch.manual_seed(0)
    model = _Net(p=0.0).cuda()
    reference = copy.deepcopy(model)
    lr = 1e-2 if case.broken else torch.tensor(1e-2, device="cuda")
    make = lambda params, lr: torch.optim.Adam(params, lr=lr, capturable=True, foreach=True)  # noqa: E731
    opt = make(model.parameters(), lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    x, y = torch.randn(32, 128, device="cuda"), torch.randn(32, 128, device="cuda")
    g, _ = _graphed_step(case, model, opt, x, y)
    if case.broken:
        case.expect("baked-value")
    for _ in range(3):
        case.replay(g)
        sched.step()
    torch.cuda.synchronize()
    # the same schedule eagerly (warm-up steps included) gives the same parameters
    ref_opt = make(reference.parameters(), torch.tensor(1e-2, device="cuda"))
    ref_sched = torch.optim.lr_scheduler.ExponentialLR(ref_opt, gamma=0.5)
    for i in range(3 + 3):
        ref_opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        if i >= 3:
            ref_sched.step()
    case.close(model.up.weight, reference.up.weight, "the graphed steps follow the schedule", 1e-4)


@program(
    "baked/reload-weights",
    pattern="a graphed forward whose weights are reloaded from a checkpoint with "
    "load_state_dict (copied into the same tensors) between replays",
    source=f"{NOTES}#graph-memory-management (static inputs are updated in place); "
    "torch.nn.Module.load_state_dict",
    bug="the weight re-assigned as a new nn.Parameter: the optimizer keeps the old one alive, "
    "the graph reads it, and the model holds the new one",
)
def reload_weights(case: Case) -> None:
    torch.manual_seed(0)
    model = _Net(p=0.0).cuda().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the parameters, as in training
    x = torch.randn(32, 128, device="cuda")
    with torch.no_grad():
        g, out = case.warmup_and_capture(lambda: model(x))
    case.replay(g)
    saved = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    if case.broken:
        case.expect("superseded")
        model.up.weight = torch.nn.Parameter(saved["up.weight"].clone())
    else:
        model.load_state_dict(saved)
    case.replay(g)
    torch.cuda.synchronize()
    with torch.no_grad():
        want = model(x)
    case.close(out, want, "the graph computes with the reloaded weights", 1e-4)
    case.check(len(opt.param_groups[0]["params"]) == 6, "the optimizer still holds six tensors")
