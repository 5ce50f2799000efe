"""Whole-network capture with every `torch.optim` optimizer that captures, as PyTorch's CUDA-graph
notes write it: warm-up on a side stream, `zero_grad(set_to_none=True)`, then forward, backward
and the optimizer step in one graph, replayed on new data copied into the static input.

The model has more parameters than one multi-tensor launch holds (280 on CUDA 13 builds, whose
launches take 210 to 770 tensors) and odd shapes, one of them past a 65536-element chunk, so
the optimizers' `multi_tensor_apply` launches split and carry leftovers of earlier launches in
their argument structs.

The twin resumes from a checkpoint after the capture: `load_state_dict` replaces the state
tensors the graph updates in place.
"""

from __future__ import annotations

import copy
import inspect

import torch

from graphsan.selftest import program
from graphsan.selftest.case import Case, Skip

DOCS = "https://pytorch.org/docs/stable/notes/cuda.html#whole-network-capture"
TESTS = "pytorch test/test_cuda.py test_graph_optims, test_graph_optims_with_explicitly_capturable_param_groups"
BUG = "optimizer.load_state_dict() after the capture replaces the state tensors the graph updates"


def make_model(widths: list[int]) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).cuda()


BIG = [48, 300, 260] + [(7 * i) % 61 + 3 for i in range(1, 138)] + [10]  # 280 parameters
SMALL = [48, 37, 5, 10]  # 6 parameters, fewer than any launch holds


def _graphed_training(case: Case, model, make_opt, batches):
    """The notes' recipe: warm-up steps on a side stream, then forward, backward and step
    captured, replayed on the later batches; the optimizer, the graph and its static inputs
    (the caller keeps them alive as long as the graph)."""
    opt = make_opt(model.parameters())
    x, y = (torch.empty_like(t) for t in batches[0])

    def step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    def eager_step(batch):
        x.copy_(batch[0])
        y.copy_(batch[1])
        opt.zero_grad(set_to_none=True)
        return step()

    warm = len(batches) // 2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for batch in batches[:warm]:
            eager_step(batch)
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    g, loss = case.capture(step)
    for batch in batches[warm:]:
        x.copy_(batch[0])
        y.copy_(batch[1])
        case.replay(g)
    torch.cuda.synchronize()
    case.check(bool(torch.isfinite(loss)), "the captured loss is finite")
    return opt, g, (x, y)


def whole_network(case: Case, make_opt) -> None:
    try:
        make_opt([torch.zeros(1, device="cuda", requires_grad=True)])
    except (RuntimeError, ValueError) as err:
        raise Skip(f"this torch cannot build it: {err}") from None
    batches = [
        (torch.randn(16, 48, device="cuda"), torch.randn(16, 10, device="cuda")) for _ in range(6)
    ]
    model = make_model(BIG)
    reference = copy.deepcopy(model)
    opt, g, static = _graphed_training(case, model, make_opt, batches)
    # the same steps eagerly, as PyTorch's own test of capturable optimizers compares them
    ref_opt = make_opt(reference.parameters())
    for xb, yb in batches:
        ref_opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(reference(xb), yb).backward()
        ref_opt.step()
    for i, (p, q) in enumerate(zip(model.parameters(), reference.parameters(), strict=True)):
        if i in (0, len(BIG) // 2, 2 * len(BIG) - 3):
            case.close(p, q, f"parameter {i} equals the eager optimizer's", 1e-4)
    del reference, ref_opt, p, q
    # a second, small configuration in the same process (a sweep, or the next test)
    small_opt, g_small, small_static = _graphed_training(case, make_model(SMALL), make_opt, batches)
    if case.broken:  # resuming from a checkpoint after the capture
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        case.victim(*[t for t in state if t.is_cuda])
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        del state
        case.churn()
    case.replay(g_small)
    case.replay(g)


def capturable() -> list[tuple[str, type, bool]]:
    """(name, class, takes fused=) of every optimizer in torch.optim that takes capturable=."""
    out = []
    for name in sorted(dir(torch.optim)):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            continue
        params = inspect.signature(cls.__init__).parameters
        if cls is not torch.optim.Optimizer and "capturable" in params:
            out.append((name, cls, "fused" in params))
    return out


def _register(name: str, make_opt, pattern: str) -> None:
    program(name, pattern=pattern, source=f"{DOCS}; {TESTS}", bug=BUG)(
        lambda case: whole_network(case, make_opt)
    )


def _foreach(cls, **kw):
    return lambda params: cls(params, capturable=True, foreach=True, **kw)


def _fused(cls, **kw):
    return lambda params: cls(params, capturable=True, fused=True, **kw)


for _name, _cls, _takes_fused in capturable():
    _low = _name.lower()
    _register(
        f"optim/{_low}-foreach",
        _foreach(_cls),
        f"whole-network capture, {_name}(capturable=True, foreach=True)",
    )
    if _takes_fused:
        _register(
            f"optim/{_low}-fused",
            _fused(_cls),
            f"whole-network capture, {_name}(capturable=True, fused=True)",
        )
    if "amsgrad" in inspect.signature(_cls.__init__).parameters:
        _register(
            f"optim/{_low}-amsgrad-{'fused' if _takes_fused else 'foreach'}",
            (_fused if _takes_fused else _foreach)(_cls, amsgrad=True),
            f"whole-network capture, {_name}(amsgrad=True): five tensor lists per launch",
        )

_register(
    "optim/sgd-momentum-foreach",
    lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True),
    "whole-network capture with SGD (momentum), the notes' own example",
)
_register(
    "optim/sgd-momentum-fused",
    lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True),
    "whole-network capture with fused SGD (momentum)",
)
_register(
    "optim/adam-capturable-param-groups",
    lambda params: torch.optim.Adam(
        [{"params": list(params), "capturable": True}], foreach=True, lr=1e-3
    ),
    "whole-network capture, Adam with capturable set per parameter group",
)
