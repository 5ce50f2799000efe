"""The sanitizer on real CUDA graphs (H200). Each program runs in a subprocess; most run twice,
with graphsan off (to show the fault or the corruption it prevents) and on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.gpu_programs import ROOT, prefetch, run_program

pytestmark = pytest.mark.gpu

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.fixture(scope="module", autouse=True)
def _all_programs_side_by_side():
    prefetch(
        [("freed_empty_cache", p, e) for p in ("off", "raise") for e in ({}, EXPANDABLE)]
        + [("reowned", "off", None), ("reowned", "raise", None), ("moved", "record", None)]
        + [(n, "raise", None) for n in ("matmul", "triton", "pool_reuse", "no_false_alarms")]
        + [("internal_error", "raise", None), ("graphed_callables_ok", "raise", {})]
        + [("graphed_callables_ok", "raise", EXPANDABLE)]
        + [("compile_ok", "raise", None), ("hf_forward_ok", "raise", None)]
    )


def _kinds(result):
    return [f["kind"] for f in result["findings"]]


@pytest.mark.parametrize("env", [{}, EXPANDABLE], ids=["default", "expandable"])
def test_freed_then_empty_cache_faults_without_graphsan(env):
    rc, result, log = run_program("freed_empty_cache", policy="off", env=env)
    assert rc != 0 and "illegal memory access" in log, log[-2000:]


@pytest.mark.parametrize("env", [{}, EXPANDABLE], ids=["default", "expandable"])
def test_freed_then_empty_cache_raises_before_launch(env):
    rc, result, log = run_program("freed_empty_cache", policy="raise", env=env)
    assert rc == 0, log[-3000:]
    assert result["replay"] == "raised"
    assert result["error_kinds"] == ["unmapped"]
    assert result["healthy"], "the CUDA context must survive: the graph was never launched"
    text = result["error_text"]
    assert "node 0" in text and "elementwise" in text, text
    assert "empty_cache" in text
    assert text.count("prog_freed_empty_cache.py") >= 3  # capture, allocation and free sites


def test_reowned_is_silent_corruption_without_graphsan():
    rc, result, log = run_program("reowned", policy="off")
    assert rc == 0, log[-2000:]
    if not result["same_block"]:
        pytest.skip("the allocator did not hand the freed block to the new tensor this time")
    assert result["y_is_14"], "without graphsan the graph reads the new tensor's data (7 * 2)"


def test_reowned_caught():
    rc, result, log = run_program("reowned", policy="raise")
    assert rc == 0, log[-3000:]
    if not result["same_block"]:
        pytest.skip("the allocator did not hand the freed block to the new tensor this time")
    assert result["replay"] == "raised"
    assert result["error_kinds"] == ["reowned"]
    assert result["healthy"]


def test_resize_is_moved():
    rc, result, log = run_program("moved", policy="record")
    assert rc == 0, log[-3000:]
    assert result["replay"] == "replayed"  # record: collect only
    kinds = _kinds(result)
    assert kinds and set(kinds) == {"moved"}, result["findings"]
    f = result["findings"][0]
    assert "resize_" in f["text"]
    assert f["nbytes"] >= 4096 * 4


def test_matmul_weight_found_in_cublas_arguments():
    rc, result, log = run_program("matmul", policy="raise")
    assert rc == 0, log[-3000:]
    assert result["replay"] == "raised", log[-3000:]
    f = result["findings"][0]
    assert f["kind"] == "freed"
    assert any(s in f["kernel"].lower() for s in ("gemm", "nvjet", "xmma", "cutlass", "sm90")), f
    assert result["healthy"]


def test_triton_kernel_graph():
    pytest.importorskip("triton")
    rc, result, log = run_program("triton", policy="raise")
    assert rc == 0, log[-3000:]
    assert result["freed"], "something outside any cycle keeps the input's storage after `del x`"
    assert result["replay"] == "raised", log[-3000:]
    f = result["findings"][0]
    assert "add_one" in f["kernel"], f
    assert f["param"] == 0 and f["offset"] == 0  # x_ptr is the first argument


@pytest.mark.parametrize("env", [{}, EXPANDABLE], ids=["default", "expandable"])
def test_make_graphed_callables_train_eval_train_is_clean(env):
    rc, result, log = run_program("graphed_callables_ok", policy="raise", env=env)
    assert rc == 0, log[-3000:]
    assert result["raised"] is None and result["findings"] == [], result["raised"]
    assert result["view_matches"], "graphsan's allocator view differs from a snapshot"
    assert result["losses_finite"] and result["healthy"]
    assert len(result["graphs"]) == 6  # a forward and a backward graph per block
    assert all(g["references"] > 0 for g in result["graphs"])


def test_a_dropped_output_recarved_by_the_next_capture_is_legal_in_capture_order():
    rc, result, log = run_program("pool_reuse", policy="raise")
    assert rc == 0, log[-3000:]
    assert result["recarved"], "the program must build the re-carving it is about"
    assert result["replays"] == ["replayed"] * 4, log[-3000:]
    assert result["findings"] == [] and result["values_ok"] and result["healthy"]


def test_no_false_alarms_on_correct_programs():
    rc, result, log = run_program("no_false_alarms", policy="raise")
    assert rc == 0, log[-3000:]
    assert result["findings"] == []
    assert result["values_ok"] and result["healthy"]


def test_internal_error_disables_and_program_runs_on():
    rc, result, log = run_program("internal_error", policy="raise")
    assert rc == 0, log[-3000:]
    assert result["value_ok"] and result["healthy"]
    assert "simulated driver failure" in (result["disabled_reason"] or "")
    assert "disables itself" in log


def test_cli_run_writes_report_and_fails(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(
        "import torch\n"
        "s = torch.cuda.Stream()\n"
        "x = torch.randn(1 << 20, device='cuda')\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g, stream=s):\n"
        "    y = x * 2\n"
        "del x\n"
        "torch.cuda.empty_cache()\n"
        "g.replay()\n"
    )
    report = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    cmd = [sys.executable, "-m", "graphsan.cli", "run", "--report", str(report), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode != 0
    assert "StaleMemoryError" in proc.stderr and "UNMAPPED" in proc.stderr, proc.stderr[-3000:]
    assert report.exists()
    shown = subprocess.run(
        [sys.executable, "-m", "graphsan.cli", "report", str(report)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert shown.returncode == 0 and "UNMAPPED" in shown.stdout and "prog.py" in shown.stdout


def test_torch_compile_cuda_graph_trees_are_watched_without_false_alarms():
    rc, result, log = run_program("compile_ok", policy="raise", timeout=400)
    assert rc == 0, log[-3000:]
    assert result["findings"] == [] and result["ok"] and result["healthy"]
    assert len(result["graphs"]) >= 2, "the compiled forward and backward graphs were seen"


def test_a_hugging_face_forward_graph_replays_without_findings():
    rc, result, log = run_program("hf_forward_ok", policy="raise", timeout=400)
    assert rc == 0, log[-3000:]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["findings"] == [] and result["ok"] and result["healthy"], log[-3000:]
    (graph,) = result["graphs"]
    assert graph["tables_read"] >= 1, "the int64 ids were read as a possible pointer table"
