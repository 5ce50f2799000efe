"""Graphs made by PyTorch's own tools: `make_graphed_callables` on part of a network, and
`torch.compile` (its CUDA-graph trees under mode="reduce-overhead", and its kernels captured by
hand) through a train -> eval -> train sequence."""

from __future__ import annotations

import torch

from graphsan.selftest import program
from graphsan.selftest.case import Case, Skip

NOTES = "https://pytorch.org/docs/stable/notes/cuda.html"


@program(
    "graphed/make-graphed-callables-partial",
    pattern="partial-network capture: make_graphed_callables on two of three modules, "
    "data-dependent control flow between them, an eager optimizer",
    source=f"{NOTES}#partial-network-capture; pytorch test/test_cuda.py "
    "test_graph_make_graphed_callables",
    bug="`weight.data = weight.data.clone()` on a graphed module: the callable keeps the "
    "Parameter, its graphs the old storage",
)
def make_graphed_callables_partial(case: Case) -> None:
    torch.manual_seed(0)
    n, d_in, hidden, d_out = 64, 256, 192, 32
    module1 = torch.nn.Linear(d_in, hidden).cuda()
    module2 = torch.nn.Linear(hidden, d_out).cuda()
    module3 = torch.nn.Linear(hidden, d_out).cuda()
    loss_fn = torch.nn.MSELoss()
    params = [*module1.parameters(), *module2.parameters(), *module3.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    x = torch.randn(n, d_in, device="cuda")
    h = torch.randn(n, hidden, device="cuda", requires_grad=True)
    module1 = torch.cuda.make_graphed_callables(module1, (x,))
    module2 = torch.cuda.make_graphed_callables(module2, (h,))
    module3 = torch.cuda.make_graphed_callables(module3, (h,))
    reference = module1.weight.detach().clone()

    def train_step(data, target):
        opt.zero_grad(set_to_none=True)
        tmp = module1(data)
        out = module2(tmp) if tmp.sum().item() > 0 else module3(tmp)
        loss = loss_fn(out, target)
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        train_step(torch.randn(n, d_in, device="cuda"), torch.randn(n, d_out, device="cuda"))
    case.check(not torch.equal(reference, module1.weight), "the graphed module trains")
    if case.broken:
        case.victim(module1.weight)
        module1.weight.data = module1.weight.data.clone()
        case.churn()
    train_step(torch.randn(n, d_in, device="cuda"), torch.randn(n, d_out, device="cuda"))


class _Block(torch.nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def _compile_or_skip(model, **kw):
    try:
        import triton  # noqa: F401  (inductor's GPU kernels)
    except ImportError:
        raise Skip("torch.compile needs Triton for CUDA kernels") from None
    return torch.compile(model, **kw)


@program(
    "graphed/compile-train-eval-train",
    pattern="torch.compile(mode='reduce-overhead'): CUDA-graph trees over training steps, an "
    "eval pass under no_grad, then training again; correct: the trees' own graphs; twin: the "
    "compiled step captured by hand",
    source="https://pytorch.org/docs/stable/torch.compiler_cudagraph_trees.html; pytorch "
    "test/inductor/test_cudagraph_trees.py",
    bug="a hand-captured compiled step whose static input is replaced during eval (the graph "
    "keeps reading the old, freed batch)",
)
def compile_train_eval_train(case: Case) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if not case.broken:
        compiled = _compile_or_skip(model, mode="reduce-overhead")
        for phase in ("train", "eval", "train"):
            model.train(phase == "train")
            for _ in range(4):
                x = torch.randn(32, 256, device="cuda")
                if phase == "train":
                    torch.compiler.cudagraph_mark_step_begin()
                    loss = compiled(x).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    case.check(bool(torch.isfinite(loss)), "the compiled step's loss is finite")
                else:
                    with torch.no_grad():
                        torch.compiler.cudagraph_mark_step_begin()
                        out = compiled(x).clone()
                    case.close(out, model(x), "eval output equals the eager module's", 1e-3)
        return
    compiled = _compile_or_skip(model)  # default mode: inductor's kernels, no graphs of its own
    model.eval()
    static_x = torch.randn(32, 256, device="cuda")

    def fwd():
        return compiled(static_x).square().mean()

    with torch.no_grad():
        g, _ = case.warmup_and_capture(fwd)
        case.replay(g, 2)
        # the next pass builds its batch as a new tensor instead of copying into the static one
        case.victim(static_x)
        static_x = torch.randn(32, 256, device="cuda")
        case.churn()
        case.replay(g)
