"""How graphsan attaches on the GPU machine: through the hooks where the run asks for them
(`GRAPHSAN_TEST_TORCH_HOOKS=1`: torch 2.14.1's hooks laid over this torch, tests/torch_hooks.py;
or a torch that has its own), by wrapping otherwise; and graphs on the laid-over hooks capture
and replay as before. The rest of the GPU suite runs under whichever attachment this is."""

from __future__ import annotations

import os

import pytest
import torch

from graphsan.cuda.hooks import Seams

pytestmark = pytest.mark.gpu

LAID_OVER = os.environ.get("GRAPHSAN_TEST_TORCH_HOOKS") == "1"


def test_graphsan_attaches_as_the_run_asks():
    own = hasattr(torch.cuda.CUDAGraph, "register_replay_start_hook")
    wrap = os.environ.get("GRAPHSAN_ATTACH", "").strip().lower() == "wrap"
    assert own or not LAID_OVER, "GRAPHSAN_TEST_TORCH_HOOKS=1 without tests/torch_hooks_site first"
    assert Seams.detect().hooks == (own and not wrap)


@pytest.mark.skipif(not LAID_OVER, reason="torch 2.14.1's hooks are not laid over this torch")
@pytest.mark.parametrize("keep_graph", [False, True])
def test_graphs_on_the_laid_over_hooks_capture_and_replay_as_before(keep_graph):
    x = torch.randn(1024, device="cuda")
    out = torch.empty_like(x)
    g = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    seen = []
    g.register_capture_end_hook(lambda graph: seen.append(("end", graph.raw_cuda_graph() != 0)))
    g.register_replay_start_hook(lambda graph: seen.append("start"))
    g.register_replay_end_hook(lambda graph: seen.append("done"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        torch.mul(x, 2, out=out)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2)
    assert seen == [("end", True), "start", "done"]
    if not keep_graph:
        with pytest.raises(RuntimeError):
            g.raw_cuda_graph()  # the template went with the capture, as on torch 2.14

    def refuse(graph):
        raise KeyError("stop")

    g.register_replay_start_hook(refuse)
    out.zero_()
    with pytest.raises(KeyError):
        g.replay()
    torch.cuda.synchronize()
    assert not out.any(), "a raising replay-start hook aborts the launch"
    g.reset()
