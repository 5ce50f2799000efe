"""CPU guard for what CUDA graph capture forbids, run over every graphed stage of the model.

A graphed stage's forward and backward must launch device work only: no host syncs (`.item()`,
`.tolist()`, data-dependent shapes) and no tensors built from Python data (a host-to-device copy
on CUDA). The H200 found one such bug (an E2M1 lookup table built with `torch.tensor` inside the
forward); this test finds that class on CPU, where the same ATen ops show up under a dispatch
mode. It checks the torch reference path; the Triton path is covered by the GPU tests.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphsan.lab.models import build_model, get_preset
from graphsan.lab.quant import QuantModule
from graphsan.lab.train import graphs as cuda_graphs
from graphsan.lab.train.config import TrainConfig
from graphsan.lab.train.trainer import bind_precision

FORBIDDEN = {
    "aten._local_scalar_dense": "a host sync (.item(), bool(), int() or .tolist() on a tensor)",
    "aten.lift_fresh": "a tensor built from Python data (a host-to-device copy on CUDA)",
    "aten.lift_fresh_copy": "a tensor built from Python data (a host-to-device copy on CUDA)",
    "aten.nonzero": "a data-dependent shape (host sync)",
    "aten.masked_select": "a data-dependent shape (host sync)",
    "aten._unique2": "a data-dependent shape (host sync)",
    "aten.unique_consecutive": "a data-dependent shape (host sync)",
}


class CaptureLint(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.hits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
        name = name if name.startswith("aten.") else f"aten.{name}"
        if name in FORBIDDEN:
            where = [
                f"{f.filename.split('graphsan/')[-1]}:{f.lineno}"
                for f in traceback.extract_stack()
                if "graphsan/lab" in f.filename
            ]
            self.hits.append(f"{name} at {where[-1] if where else '?'}: {FORBIDDEN[name]}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["super-mixed", "mxfp8-all", None])
@pytest.mark.parametrize("state", ["fixed", "te218"])
def test_graphed_stages_do_nothing_capture_forbids(precision, state):
    cfg = TrainConfig(preset="tiny", precision_config=precision, device="cpu", state_policy=state)
    cfg.validate()
    model = build_model(get_preset("tiny"), device=torch.device("cpu"), seed=0)
    _, ambient = bind_precision(model, cfg)
    skip = torch.zeros(())
    for m in model.modules():
        if isinstance(m, QuantModule):
            m.skip_weight_update = skip
            m.state_policy = state
    scopes = ("attn", "mamba", "moe_router", "moe_preprocess", "mlp")
    stages = cuda_graphs.plan_stages(model, scopes, cuda_graphs.MicrobatchCounter(), state, ambient)
    assert {s.stage for s in stages} >= {"layer", "front"}
    shape = (1, 32, model.args.hidden_size)
    for st in stages:
        x = torch.randn(shape, dtype=torch.bfloat16)
        st.fn(x.requires_grad_(True))  # the eager warm-up (creates workspaces), outside capture
        x = torch.randn(shape, dtype=torch.bfloat16).requires_grad_(True)
        lint = CaptureLint()
        with lint:
            outs = st.fn(x)
            outs = outs if isinstance(outs, tuple) else (outs,)
            douts = [o for o in outs if o.requires_grad]
            torch.autograd.grad(
                douts, [x, *st.params], [torch.randn_like(o) for o in douts], allow_unused=True
            )
        assert lint.hits == [], f"{st.name} ({precision}, {state}): {sorted(set(lint.hits))}"


def _expert_path_hits(precision, monkeypatch):
    """Run the routed experts + combine (forward and backward) of the first MoE layer under the
    lint, with Tensor.tolist / .cpu / .numpy (host reads the dispatch mode cannot see on CPU)
    made to fail; returns what was found."""
    cfg = TrainConfig(preset="tiny", precision_config=precision, device="cpu")
    cfg.validate()
    model = build_model(get_preset("tiny"), device=torch.device("cpu"), seed=0)
    bind_precision(model, cfg)
    layer = next(la for la in model.layers if la.kind == "E")
    x = torch.randn(2, 32, model.args.hidden_size, dtype=torch.bfloat16, requires_grad=True)

    def front():  # router and preprocess: checked with the graphed stages above
        return layer.mixer.preprocess(*layer.router_stage(x))

    layer.mixer.experts_and_combine(*front(), num_tokens=64).float().sum().backward()  # warm-up
    pre = front()
    found = []

    def host_read(name):
        def read(self, *args, **kwargs):
            found.append(f"Tensor.{name}")
            raise AssertionError(f"Tensor.{name} in the expert path")

        return read

    for name in ("tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, host_read(name))
    lint = CaptureLint()
    try:
        with lint:
            out = layer.mixer.experts_and_combine(*pre, num_tokens=64)
            out.float().sum().backward()
    except AssertionError:
        pass
    finally:
        monkeypatch.undo()
    return sorted(set(lint.hits)) + found


@pytest.mark.parametrize("precision", ["super-mixed", "mxfp8-all", None])
def test_expert_path_has_no_host_sync(precision, monkeypatch):
    """The routed experts run eagerly (as in Megatron), but their grouped GEMMs keep the group
    sizes on the device: no host sync, no data-dependent shape, nothing capture forbids."""
    assert _expert_path_hits(precision, monkeypatch) == []


def test_expert_path_lint_sees_a_host_sync(monkeypatch):
    """The check above can fail: the per-group fallback GEMM reads the offsets on the host."""
    from graphsan.lab.quant import grouped

    monkeypatch.setitem(grouped._GROUPED_MM, "cpu", False)
    assert "Tensor.tolist" in _expert_path_hits(None, monkeypatch)
