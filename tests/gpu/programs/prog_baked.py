"""State a graph baked at capture, on real graphs: each scenario captures its own graph, changes
what the graph baked (or changes it the documented way) and replays. `out["scenarios"]` maps
each to the kinds of the StaleMemoryError its last replay raised ([] when it replayed), and
`out["texts"]` to the first finding's text."""

from _prelude import *  # noqa: F403

import graphsan

torch.manual_seed(0)
W = 128
x, y = torch.randn(32, W, device="cuda"), torch.randn(32, W, device="cuda")


class Net(torch.nn.Module):
    def __init__(self, p=0.2):
        super().__init__()
        self.up = torch.nn.Linear(W, 2 * W)
        self.drop = torch.nn.Dropout(p)
        self.down = torch.nn.Linear(2 * W, W)
        self.norm = torch.nn.LayerNorm(W)
        self.bn = torch.nn.BatchNorm1d(W)

    def forward(self, inp):
        return self.bn(
            self.norm(inp + self.down(self.drop(torch.nn.functional.gelu(self.up(inp)))))
        )


def plain(p=0.2):
    """Net without batch norm (nothing but dropout depends on the mode)."""
    net = Net(p)
    net.bn = torch.nn.Identity()
    return net.cuda()


def graphed_step(model, opt):
    def step():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    g.replay()
    return g


def graphed_forward(model):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g), torch.no_grad():
        out_ = model(x)
    g.replay()
    return g, out_


texts = {}


def replayed(name, g):
    try:
        g.replay()
        torch.cuda.synchronize()
        return []
    except graphsan.StaleMemoryError as err:
        texts[name] = str(err)[:1500]
        return sorted({f.kind for f in err.findings})


def mode_after_validation_left_in_eval():
    model = Net().cuda()
    g = graphed_step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    model.eval()
    with torch.no_grad():
        model(x)
    return replayed("mode_after_validation_left_in_eval", g)


def mode_of_one_submodule():
    model = plain()
    g = graphed_step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    model.drop.eval()
    return replayed("mode_of_one_submodule", g)


def float_lr_under_a_scheduler():
    model = plain(0.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True, foreach=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    g = graphed_step(model, opt)
    sched.step()
    return replayed("float_lr_under_a_scheduler", g)


def parameter_re_pointed():
    model = plain(0.0).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # keeps the old weight alive
    g, _ = graphed_forward(model)
    model.up.weight = torch.nn.Parameter(torch.randn_like(model.up.weight))
    out["opt_holds_old"] = opt.param_groups[0]["params"][0] is not model.up.weight
    return replayed("parameter_re_pointed", g)


def buffer_re_registered():
    model = Net(0.0).cuda().eval()
    keep = model.bn.running_mean
    g, _ = graphed_forward(model)
    model.bn.running_mean = torch.zeros(W, device="cuda")
    out["buffer_kept"] = keep is not None
    return replayed("buffer_re_registered", g)


def tensor_lr_replaced():
    model = plain(0.0)
    lr = torch.tensor(1e-3, device="cuda")
    opt = torch.optim.Adam(model.parameters(), lr=lr, capturable=True, foreach=True)
    g = graphed_step(model, opt)
    opt.param_groups[0]["lr"] = torch.tensor(5e-4, device="cuda")  # defaults keep the old one
    return replayed("tensor_lr_replaced", g)


# -- the correct twins ---------------------------------------------------------------------------
def tensor_lr_under_a_scheduler():
    model = plain(0.0)
    lr = torch.tensor(1e-3, device="cuda")
    opt = torch.optim.Adam(model.parameters(), lr=lr, capturable=True, foreach=True)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    g = graphed_step(model, opt)
    kinds = []
    for _ in range(3):
        sched.step()
        kinds += replayed("tensor_lr_under_a_scheduler", g)
    out["lr_filled_in_place"] = opt.param_groups[0]["lr"] is lr and abs(lr.item() - 7.29e-4) < 1e-9
    return kinds


def eval_validation_then_train():
    model = Net().cuda()
    g = graphed_step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    return replayed("eval_validation_then_train", g)


def no_mode_dependent_module_in_eval():
    model = plain(0.0)
    g = graphed_step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    model.eval()
    return replayed("no_mode_dependent_module_in_eval", g)


def a_graph_per_mode():
    model = Net().cuda()
    train_g = graphed_step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    model.eval()
    eval_g, _ = graphed_forward(model)
    kinds = []
    for _ in range(2):
        kinds += replayed("a_graph_per_mode", eval_g)
        model.train()
        kinds += replayed("a_graph_per_mode", train_g)
        model.eval()
    return kinds


def load_state_dict_in_place():
    model = plain(0.0).eval()
    g, got = graphed_forward(model)
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    kinds = replayed("load_state_dict_in_place", g)
    with torch.no_grad():
        out["reloaded_values"] = bool(torch.allclose(got, model(x), rtol=1e-4, atol=1e-5))
    return kinds


def value_set_back():
    model = plain(0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = graphed_step(model, opt)
    opt.param_groups[0]["lr"] = 0.02
    opt.param_groups[0]["lr"] = 0.01
    return replayed("value_set_back", g)


def make_graphed_callables_in_eval():
    model = plain()
    graphed = torch.cuda.make_graphed_callables(model, (x.clone().requires_grad_(),))
    graphed(x).sum().backward()
    graphed.eval()  # PyTorch runs the module eagerly in the other mode
    with torch.no_grad():
        graphed(x)
    graphed.train()
    graphed(x).sum().backward()
    torch.cuda.synchronize()
    return []


def compile_reduce_overhead_train_eval_train():
    model = Net().cuda()
    compiled = torch.compile(model, mode="reduce-overhead")
    for mode in ("train", "train", "train", "eval", "eval", "train", "train"):
        torch.compiler.cudagraph_mark_step_begin()  # each call is a step of its own (the docs')
        getattr(model, mode)()
        ctx = torch.no_grad() if mode == "eval" else torch.enable_grad()
        with ctx:
            r = compiled(x)
            if mode == "train":
                r.sum().backward()
    torch.cuda.synchronize()
    return []


BROKEN = [
    mode_after_validation_left_in_eval,
    mode_of_one_submodule,
    float_lr_under_a_scheduler,
    parameter_re_pointed,
    buffer_re_registered,
    tensor_lr_replaced,
]
CORRECT = [
    tensor_lr_under_a_scheduler,
    eval_validation_then_train,
    no_mode_dependent_module_in_eval,
    a_graph_per_mode,
    load_state_dict_in_place,
    value_set_back,
    make_graphed_callables_in_eval,
    compile_reduce_overhead_train_eval_train,
]
out["scenarios"] = {}
for fn in BROKEN + CORRECT:
    try:
        out["scenarios"][fn.__name__] = fn()
    except graphsan.StaleMemoryError as err:  # raised outside `replayed` (compile, callables)
        out["scenarios"][fn.__name__] = sorted({f.kind for f in err.findings})
        texts[fn.__name__] = str(err)[:1500]
out["texts"] = texts
out["healthy"] = healthy()
finish()
