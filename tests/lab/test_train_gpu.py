"""GPU tests of the trainer's per-scope CUDA graphs. Each run happens in a subprocess (a graph bug
can kill the CUDA context); the subprocess prints one `RESULT {json}` line that the test reads
(`graphsan.command_line.read_result`)."""

import json
import os
import subprocess
import sys

import pytest

from graphsan.command_line import read_result

pytestmark = pytest.mark.gpu

WORKER = r"""
import json, math, sys
import torch
from graphsan.command_line import write_result
from graphsan.lab.train import TrainConfig, train

spec = json.loads(sys.argv[1])
GRADS = ("embedding.weight", "layers.0.norm.weight", "layers.0.mixer.A_log",
         "layers.0.mixer.in_proj.weight", "layers.0.mixer.out_proj.weight",
         "layers.1.mixer.linear_qkv.weight", "layers.2.mixer.router.weight",
         "layers.2.mixer.fc1_latent.weight", "layers.2.mixer.shared_expert.fc1.weight",
         "layers.2.mixer.experts.fc1.weight")

def run(**kw):
    base = dict(preset="tiny", quiet=True, device="cuda", train_iters=5, seq_length=64,
                micro_batch_size=2, global_batch_size=4, cuda_graph_warmup_steps=2,
                capture_grads=GRADS)
    base.update(kw)
    return train(TrainConfig(**base))

def rel(a, b):
    return float((a - b).norm() / max(a.norm(), 1e-12))

def compare(ref, got, first_step):
    worst_loss = max(abs(x - y) / abs(x) for x, y in zip(ref.losses, got.losses))
    worst_grad = {n: max(rel(r[n], g[n]) for r, g in zip(ref.main_grads[first_step:],
                                                          got.main_grads[first_step:]))
                  for n in GRADS}
    return {"loss": worst_loss, "grads": worst_grad, "stages": got.graphed_stages}

out = {}
if spec["kind"] == "scopes":
    for precision in spec["precisions"]:
        eager = run(precision_config=precision)
        for scopes in spec["scope_sets"]:
            graphed = run(precision_config=precision, cuda_graph_modules=tuple(scopes))
            out[f"{precision}:{','.join(scopes)}"] = compare(eager, graphed, 0)
elif spec["kind"] == "accumulation":
    # graphs with 4 microbatches per step vs eager with the same split (the eager CPU test
    # checks eager accumulation against one big microbatch)
    eager = run(micro_batch_size=1, global_batch_size=4)
    graphed = run(micro_batch_size=1, global_batch_size=4, seq_length=64,
                  cuda_graph_modules=("attn", "mamba", "moe_router", "moe_preprocess", "mlp"))
    out["accumulation"] = compare(eager, graphed, 0)
elif spec["kind"] == "transitions":
    import graphsan
    cfg = dict(precision_config=spec["precision"], train_iters=7, eval_interval=2, eval_iters=2,
               save_interval=2, save=spec["save"], empty_cache_on_save=True,
               manual_gc_interval=2, cuda_graph_modules=("attn", "mamba", "moe_router",
               "moe_preprocess"), state_policy="fixed", capture_grads=())
    with graphsan.watch(policy="record") as san:
        r = run(**cfg)
    out["findings"] = [str(f) for f in san.findings]
    out["graphs_watched"] = len(san.graph_stats)
    out["disabled_reason"] = san.disabled_reason
    out["losses"] = r.losses
    out["evals"] = r.eval_losses
    out["stages"] = r.graphed_stages
elif spec["kind"] == "schedule":
    # 1F1B with 2 of 4 microbatches in flight, graphs captured in that order, under graphsan:
    # the same losses and grads as the eager run of the same schedule, and no finding
    import graphsan
    kw = dict(micro_batch_size=1, global_batch_size=4, microbatch_schedule="1f1b",
              precision_config="mxfp8-all")
    eager = run(**kw)
    with graphsan.watch(policy="raise") as san:
        graphed = run(cuda_graph_modules=("attn", "mamba", "moe_router", "moe_preprocess",
                                          "mlp"), **kw)
    out["schedule"] = compare(eager, graphed, 0)
    out["findings"] = [str(f) for f in san.findings]
    out["graphs_watched"] = len(san.graph_stats)
elif spec["kind"] == "reuse":
    # TE's buffer reuse, each schedule over graphs captured in its own order, under graphsan
    import graphsan
    for schedule in ("sequential", "1f1b"):
        kw = dict(micro_batch_size=1, global_batch_size=4, microbatch_schedule=schedule,
                  precision_config="mxfp8-all")
        eager = run(**kw)
        with graphsan.watch(policy="raise") as san:
            graphed = run(cuda_graph_modules=("attn", "mamba", "moe_router", "moe_preprocess",
                                              "mlp"), reuse_graph_buffers=True, **kw)
        out[schedule] = compare(eager, graphed, 0)
        out[schedule]["findings"] = [str(f) for f in san.findings]
elif spec["kind"] == "mismatch":
    # the step runs 1F1B over graphs captured in sequence: out of capture order
    import graphsan
    kw = dict(micro_batch_size=1, global_batch_size=2, microbatch_schedule="1f1b",
              capture_schedule="sequential", precision_config="mxfp8-all", capture_grads=(),
              cuda_graph_modules=tuple(spec.get("scopes", ("attn", "mamba", "moe_router",
                                                           "moe_preprocess"))),
              reuse_graph_buffers=spec.get("reuse", False))
    if spec["graphsan"] == "off":
        eager = run(**{k: v for k, v in kw.items() if k not in ("cuda_graph_modules",
                                                               "capture_schedule",
                                                               "reuse_graph_buffers")})
        graphed = run(**kw)
        out["eager"], out["graphed"] = eager.losses, graphed.losses
    else:
        try:
            with graphsan.watch(policy="raise"):
                run(**kw)
            out["raised"] = None
        except graphsan.StaleMemoryError as err:
            out["raised"] = sorted({f.kind for f in err.findings})
            out["first"] = err.findings[0].kind
            out["text"] = str(err)[:3000]
elif spec["kind"] == "resume":
    # graphed: the resumed run captures its graphs after its own warm-up steps
    import graphsan
    cfg = dict(precision_config="mxfp8-all", cuda_graph_modules=("attn", "mamba", "moe_router",
               "moe_preprocess"), capture_grads=(), save=spec["save"])
    whole = run(train_iters=6, **cfg)
    run(train_iters=3, save_interval=3, **cfg)
    with graphsan.watch(policy="record") as san:
        rest = run(train_iters=6, load=spec["save"], **cfg)
    out = {"whole": whole.losses, "rest": rest.losses, "stages": rest.graphed_stages,
           "findings": [str(f) for f in san.findings]}
write_result(out)
"""


def _spawn(spec: dict, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )


def _run(spec: dict, env_extra: dict | None = None) -> dict:
    p = _spawn(spec, env_extra)
    res = read_result(p.stdout)
    assert p.returncode == 0 and res is not None, (
        f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    )
    return res


SCOPE_SETS = [
    ["attn"],
    ["mamba"],
    ["moe_router"],
    ["moe_router", "moe_preprocess"],
    ["mlp"],
    ["attn", "mamba", "moe_router", "moe_preprocess", "mlp"],
]


def test_graphed_matches_eager_for_each_scope():
    res = _run({"kind": "scopes", "precisions": ["mxfp8-all"], "scope_sets": SCOPE_SETS})
    assert len(res) == len(SCOPE_SETS)
    for key, r in res.items():
        assert r["stages"], f"{key}: nothing was graphed"
        assert r["loss"] < 1e-3, (key, r)
        for name, err in r["grads"].items():
            assert err < 1e-2, (key, name, err)


def test_gradient_accumulation_with_graphs():
    r = _run({"kind": "accumulation"})["accumulation"]
    assert r["loss"] < 1e-3, r
    for name, err in r["grads"].items():
        assert err < 1e-2, (name, err)


@pytest.mark.parametrize("precision", ["mxfp8-all", "super-mixed"])
def test_two_eval_transitions_with_empty_cache_and_expandable_segments(tmp_path, precision):
    res = _run(
        {"kind": "transitions", "save": str(tmp_path), "precision": precision},
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )
    assert [i for i, _ in res["evals"]] == [2, 4, 6]  # capture at 3: transitions at 4 and 6
    assert len(res["losses"]) == 7 and all(x == x and abs(x) < 100 for x in res["losses"])
    # the sanitizer watched every captured graph, stayed on, and found nothing stale
    assert res["disabled_reason"] is None
    assert res["graphs_watched"] >= len(res["stages"]) > 0
    assert res["findings"] == []


def test_a_resumed_graphed_run_continues_as_the_whole_one(tmp_path):
    """3 iterations saved, --load and 3 more (graphs captured after the resumed run's own warm-up
    steps, under the sanitizer): the losses of 6 in one go."""
    res = _run({"kind": "resume", "save": str(tmp_path)})
    assert res["stages"] and res["findings"] == []
    assert len(res["rest"]) == 3
    for x, y in zip(res["rest"], res["whole"][3:], strict=True):
        assert abs(x - y) <= 1e-3 * abs(y), (res["rest"], res["whole"])


def test_a_1f1b_schedule_with_its_graphs_captured_in_that_order_matches_eager():
    res = _run({"kind": "schedule"})
    r = res["schedule"]
    assert r["stages"] and res["graphs_watched"] > 0
    assert res["findings"] == []
    assert r["loss"] < 1e-3, r
    for name, err in r["grads"].items():
        assert err < 1e-2, (name, err)


def _assert_losses_left_eagers(p: subprocess.CompletedProcess) -> None:
    """A mismatch run that finished: its graphed losses differ from eager's, or are NaN."""
    res = read_result(p.stdout)
    assert res is not None, p.stdout[-3000:]
    worst = max(abs(a - b) / abs(a) for a, b in zip(res["eager"], res["graphed"], strict=True))
    assert worst > 1e-3 or any(x != x for x in res["graphed"]), res


def test_1f1b_over_graphs_captured_in_sequence_diverges_without_graphsan():
    # the stale replays corrupt the step: its losses leave eager's, or a kernel reading the
    # overwritten routing indices trips its bounds check (which of the two depends on the run)
    p = _spawn({"kind": "mismatch", "graphsan": "off"})
    if p.returncode != 0:
        tail = p.stderr[-5000:]
        assert "device-side assert" in tail or "illegal memory access" in tail, tail
        return
    _assert_losses_left_eagers(p)


def test_1f1b_over_graphs_captured_in_sequence_is_stopped_by_graphsan():
    res = _run({"kind": "mismatch", "graphsan": "raise"})
    assert res["raised"], res
    assert set(res["raised"]) <= {"replay-order", "live-output"}, res["text"]


def test_reused_graph_buffers_are_quiet_and_correct_in_capture_order():
    """TE's buffer reuse hands forward outputs back to the pool at capture; both schedules,
    each replaying its graphs in capture order, train as eager does with no finding."""
    res = _run({"kind": "reuse"})
    for schedule in ("sequential", "1f1b"):
        r = res[schedule]
        assert r["stages"] and r["findings"] == [], (schedule, r["findings"])
        assert r["loss"] < 1e-3, (schedule, r)
        for name, err in r["grads"].items():
            assert err < 1e-2, (schedule, name, err)


REUSED_MISMATCH = {"kind": "mismatch", "reuse": True, "scopes": ["attn", "mamba"]}


def test_1f1b_over_reused_buffers_captured_in_sequence_corrupts_silently():
    """Outputs the pool got back are carved by the next forward: the losses leave eager's with
    no error, since these graphs hold no index a kernel could trip on."""
    p = _spawn(dict(REUSED_MISMATCH, graphsan="off"))
    if p.returncode != 0:  # the trainer stops on a NaN loss: silent for CUDA all the same
        tail = p.stderr[-5000:]
        assert "TrainingDiverged" in tail and "device-side assert" not in tail, tail
        return
    _assert_losses_left_eagers(p)


def test_1f1b_over_reused_buffers_is_stopped_as_a_live_output():
    res = _run(dict(REUSED_MISMATCH, graphsan="raise"))
    assert res["raised"] and res["first"] == "live-output", res
