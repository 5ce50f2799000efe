"""The report pages as a person sees them: the HTML report (one rank and several), the Chrome
trace, reading older reports, and the CLI's path errors (the matrix page: test_matrix_page.py).

The browser tests open each page in headless Chromium (the Debian package), read the rendered
text, fail on any console error or network request, and keep a full-page screenshot under
pytest's tmp_path, or under $GRAPHSAN_SCREENSHOTS when set. Without a Chromium they skip and say
why.
"""

from __future__ import annotations

import json
import os
from html import unescape

import pytest

from graphsan.cli.main import main
from graphsan.report import SCHEMA_VERSION, Finding, GraphInfo, Report, short_kernel
from graphsan.report.pages import check_output
from graphsan.report.pages.report_finding import kernel_signature
from graphsan.report.pages.report_page import render_report, report_view
from tests.browser import BROWSER, check_page, needs_browser, open_page, screenshot_path

T0 = 1_780_000_000.0  # a fixed wall-clock start, so pages render the same every run

GEMM = (
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>"
    "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8::Params)"
)
MUL = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, "
    "float, at::native::binary_internal::MulFunctor<float> >, at::detail::Array<char*, 3> >"
    "(int, at::native::BinaryFunctor<float, float, float, at::native::binary_internal::"
    "MulFunctor<float> >, at::detail::Array<char*, 3>)"
)
QUANT = "_quantize_mxfp8_colwise_kernel"
COPY = "memcpy"
FREE_SITE = ("graphsan/lab/quant/linear.py", 311, "release_weight_workspace")
FREE_STACK = [
    ("graphsan/lab/train/trainer.py", 287, "train"),
    ("graphsan/lab/train/checkpoint.py", 64, "save_checkpoint"),
    FREE_SITE,
]
ALLOC_STACK = [
    ("graphsan/lab/train/trainer.py", 240, "train"),
    ("graphsan/lab/quant/linear.py", 205, "_weight_workspace"),
]
REOWN_FREE = [("examples/stale_input.py", 31, "main"), ("examples/stale_input.py", 22, "evaluate")]


def _graph(gid, label, captured_at, kernels, rank):
    names = list(dict.fromkeys(kernels))
    return {
        "id": gid,
        "label": label,
        "capture_site": [["graphsan/lab/train/graphs.py", 140 + gid, "capture"]],
        "pool": [1, gid],
        "nodes": len(kernels),
        "kernels": len(kernels),
        "references": 12,
        "watched_blocks": 3,
        "replays_judged": 1,
        "captured_at": captured_at,
        "node_summary": {
            "names": names,
            "nodes": [names.index(k) for k in kernels],
            "total": len(kernels),
        },
    }


def _finding(rank, kind, graph, node, kernel, block, **kw):
    info = GraphInfo(graph["id"], graph["label"], [tuple(graph["capture_site"][0])], (1, 1), 0)
    base = dict(
        kind=kind,
        graph=info,
        node=node,
        kernel=kernel,
        param=0,
        offset=40,
        address=block + 4096,
        nbytes=2 << 20,
        block_address=block,
        pool="default pool",
        alloc_stack=ALLOC_STACK,
        free_stack=FREE_STACK,
        phase="eval (no_grad)",
        step=5,
        rank=rank,
    )
    base.update(kw)
    return Finding.of(**base)  # flat, as the JSON holds it: a baked one's free stack is its change


def rank_report(rank: int | None, skew: float = 0.0) -> Report:
    """What one rank of the #3316 scenario reports: the mamba backward graph reads out_proj's
    freed weight workspace (unmapped by empty_cache); an attention graph's input was re-owned;
    rank 1 also sees a pool re-carved by a later capture."""
    t = T0 + skew
    mamba_nodes = [QUANT, COPY] + [MUL, GEMM] * 10
    mamba_bwd = _graph(4, "mamba bwd", t + 1.2, mamba_nodes, rank)
    mamba_fwd = _graph(3, "mamba fwd", t + 1.0, [QUANT, GEMM, MUL, GEMM], rank)
    attn = _graph(2, "attn fwd", t + 0.8, [MUL, GEMM, MUL], rank)
    unmapped = _finding(
        rank,
        "unmapped",
        mamba_bwd,
        17,
        GEMM,
        0x7F3A40000000,
        now="the address is no longer mapped: the replay would fault; cached memory was "
        "released by empty_cache() at graphsan/lab/train/checkpoint.py:88 (phase eval, step 5)",
        also_used_by=[
            {"graph": 3, "label": "mamba fwd", "node": 1, "kernel": GEMM, "param": 0}
            | {"offset": 40}
        ],
        freed_at=t + 5.1,
        found_at=t + 6.0,
    )
    reowned = _finding(
        rank,
        "reowned",
        attn,
        2,
        MUL,
        0x7F3A00200000,
        param=2,
        offset=8,
        nbytes=8192,
        alloc_stack=[("examples/stale_input.py", 14, "main")],
        free_stack=REOWN_FREE,
        phase="eval",
        now="part of a live 8192 B allocation allocated at examples/stale_input.py:24",
        freed_at=t + 5.3,
        found_at=t + 6.1,
    )
    findings = [unmapped, reowned]
    if rank == 1:
        findings.append(
            _finding(
                rank,
                "pool-reuse",
                mamba_fwd,
                3,
                GEMM,
                0x7F3B00000000,
                pool="private pool (1, 4) of another graph",
                phase="train",
                step=6,
                freed_at=t + 6.3,
                found_at=t + 6.4,
            )
        )
    stream = 0x55D0C0DE0000 + (rank or 0)
    events = [
        {"t": t, "kind": "phase", "rank": rank, "phase": "train", "step": 0},
        *[
            {"t": g["captured_at"], "kind": "capture", "rank": rank, "graph": g["id"]}
            | {"label": g["label"], "device": 0, "stream": stream, "begin": g["captured_at"] - 0.1}
            for g in (attn, mamba_fwd, mamba_bwd)
        ],
        {"t": t + 5.0, "kind": "phase", "rank": rank, "phase": "eval (no_grad)", "step": 5},
        {"t": t + 5.1, "kind": "free", "rank": rank, "block": 0x7F3A40000000, "phase": "eval"}
        | {"step": 5, "op": None, "site": "linear.py:311 in release_weight_workspace"},
        {"t": t + 5.3, "kind": "free", "rank": rank, "block": 0x7F3A00200000, "phase": "eval"}
        | {"step": 5, "op": None, "site": "stale_input.py:22 in evaluate"},
        {"t": t + 5.5, "kind": "release", "rank": rank, "phase": "eval (no_grad)", "step": 5}
        | {"site": "checkpoint.py:88 in save_checkpoint"},
        {"t": t + 5.9, "kind": "phase", "rank": rank, "phase": "train", "step": 5},
        {"t": t + 5.95, "kind": "replay", "rank": rank, "graph": 3, "label": "mamba fwd"}
        | {"device": 0, "stream": stream, "outcome": "clean", "findings": 0, "count": 3}
        | {"t_last": t + 5.97},
        {"t": t + 6.0, "kind": "replay", "rank": rank, "graph": 4, "label": "mamba bwd"}
        | {"device": 0, "stream": stream, "outcome": "stopped", "findings": 1},
        {"t": t + 6.1, "kind": "replay", "rank": rank, "graph": 2, "label": "attn fwd"}
        | {"device": 0, "stream": stream, "outcome": "stopped", "findings": 1},
    ]
    if rank == 1:
        events.append(
            {"t": t + 6.4, "kind": "replay", "rank": rank, "graph": 3, "label": "mamba fwd"}
            | {"device": 0, "stream": stream, "outcome": "stopped", "findings": 1}
        )
    return Report(findings, [attn, mamba_fwd, mamba_bwd], rank, "raise", {}, events, 0)


def save(tmp_path, report: Report, name: str) -> str:
    path = str(tmp_path / name)
    report.save(path)
    return path


# ----------------------------------------------------------------------------- schema v3
def test_report_v3_round_trips_and_v2_still_loads(tmp_path):
    rep = rank_report(0)
    rep.allocator_log = "snapshot (GRAPHSAN_TRACELOG=0)"
    back = Report.load(save(tmp_path, rep, "r.json"))
    assert back.findings == rep.findings and back.events == rep.events
    assert back.allocator_log == rep.allocator_log
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["version"] == SCHEMA_VERSION
    for f in data["findings"]:
        del f["freed_at"], f["found_at"]
    del data["events"], data["events_dropped"], data["allocator_log"]
    (tmp_path / "v2.json").write_text(json.dumps(dict(data, version=2)))
    old = Report.load(str(tmp_path / "v2.json"))
    assert old.events == [] and old.findings[0].found_at is None
    assert "graph #4 'mamba bwd'" in render_report([old], ["v2.json"])


# ----------------------------------------------------------------------------- page content
def test_kernel_signature_marks_parameters_at_the_top_level_only():
    head, params, tail = kernel_signature(MUL)
    assert head.endswith("Array<char*, 3> >(") and tail == ")"
    assert params[0] == "int" and params[2] == "at::detail::Array<char*, 3>" and len(params) == 3
    assert kernel_signature(QUANT) == (QUANT, [], "")


def test_the_report_view_groups_findings_across_ranks():
    view = report_view([rank_report(0), rank_report(1, 0.02)], ["a.json", "b.json"])
    assert [f["kind"] for f in view["findings"]] == ["unmapped", "reowned", "pool-reuse"]
    assert view["findings"][0]["ranks"] == ["rank 0", "rank 1"]
    assert view["matrix"]["rows"][2]["cells"] == ["", "pool-reuse"]
    life = [s["kind"] for s in view["findings"][0]["life"]["steps"]]
    assert life == ["alloc", "capture", "capture", "free", "release", "now", "stop"]
    nodes = view["findings"][0]["nodes"]
    assert [n["index"] for n in nodes["window"] if n["hit"]] == [17]
    assert (nodes["before"], nodes["window"][-1]["index"], nodes["after"]) == (11, 21, 0)


def test_the_html_is_self_contained(tmp_path):
    html = render_report([rank_report(0)], ["out.json"])
    for needle in ("http://", "https://", "<link", "src="):
        assert needle not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert short_kernel(GEMM) in unescape(html) and "release_weight_workspace" in html


# ----------------------------------------------------------------------------- the trace
def test_the_chrome_trace_has_one_track_per_rank_and_stream(tmp_path):
    paths = [save(tmp_path, rank_report(r, 0.02 * r), f"out.rank{r}.json") for r in (0, 1)]
    out = tmp_path / "trace.json"
    assert main(["report", "--trace", str(out), *paths]) == 0
    data = json.loads(out.read_text())
    events = data["traceEvents"]
    assert isinstance(events, list) and data["displayTimeUnit"] == "ms"
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] > 0
    real = [e for e in events if e["ph"] != "M"]
    assert {e["pid"] for e in real} == {0, 1}
    by = {(e["pid"], e["cat"]) for e in real}
    for cat in ("capture", "replay", "free", "release", "phase", "finding"):
        assert (0, cat) in by and (1, cat) in by, cat
    # microseconds: rank 1's stopped replay is 6.02 s after rank 0's first event
    stop1 = next(e for e in real if e["pid"] == 1 and e["cat"] == "finding")
    assert stop1["ts"] == pytest.approx(6.02e6)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(1, stop1["tid"])] == f"stream {0x55D0C0DE0001:#x}"
    assert short_kernel(GEMM) in stop1["name"] and stop1["args"]["kernel"] == GEMM


# ----------------------------------------------------------------------------- CLI errors
def _unwritable_folder(tmp_path) -> str:
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        return str(ro)
    return "/sys"  # root may write anywhere on disk; sysfs refuses new files even to root


@pytest.mark.parametrize("option", ["--html", "--trace"])
def test_bad_output_paths_are_one_line_errors(tmp_path, capsys, option):
    rep = save(tmp_path, rank_report(0), "r.json")
    (tmp_path / "afile").write_text("")
    cases = {
        str(tmp_path / "missing" / "out"): "does not exist",
        str(tmp_path): "is a directory",
        str(tmp_path / "afile" / "out"): "is not a folder",
        os.path.join(_unwritable_folder(tmp_path), "out"): "cannot write",
    }
    for path, why in cases.items():
        assert main(["report", option, path, rep]) == 2, path
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("graphsan report: error:"), err
        assert option in err[0] and why in err[0], err


def test_repro_html_path_is_checked_before_any_case_runs(tmp_path, capsys):
    assert main(["repro", "--html", str(tmp_path / "nope" / "m.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"graphsan repro: error: --html {tmp_path}/nope/m.html: the folder {tmp_path}/nope does "
        "not exist"
    ]


def test_check_output_accepts_a_new_file(tmp_path):
    assert check_output(str(tmp_path / "new.html"), "--html").endswith("new.html")


# ----------------------------------------------------------------------------- in a browser
@needs_browser
def test_single_rank_report_in_a_browser(tmp_path):
    rep = save(tmp_path, rank_report(0), "out.json")
    html = tmp_path / "report.html"
    assert main(["report", "--html", str(html), rep]) == 0
    shot = screenshot_path(tmp_path, "report-one-rank.png")
    page = open_page(BROWSER, str(html), shot)
    check_page(
        page,
        [
            short_kernel(GEMM),
            short_kernel(MUL),
            "graphsan/lab/quant/linear.py:311 in release_weight_workspace",
            "examples/stale_input.py:22 in evaluate",
            "empty_cache() released cached memory to the driver",
            "replay of graph #4 stopped before launch",
            "mamba fwd",  # also used by
        ],
    )
    assert page.scripts_ran and "open all stacks" in page.text
    # a folded stack is not visible until clicked: its outer frames stay out of the text
    middle = "graphsan/lab/train/checkpoint.py:64 in save_checkpoint"  # a free stack's frame
    assert middle not in page.text and middle in page.dom
    assert os.path.getsize(shot) > 10_000


@needs_browser
def test_multi_rank_report_in_a_browser(tmp_path):
    paths = [save(tmp_path, rank_report(r, 0.02 * r), f"out.rank{r}.json") for r in (0, 1)]
    html = tmp_path / "ranks.html"
    assert main(["report", "--html", str(html), *paths]) == 0
    shot = screenshot_path(tmp_path, "report-two-ranks.png")
    page = open_page(BROWSER, str(html), shot)
    check_page(
        page,
        [
            "Ranks by finding",
            "rank 0, rank 1",
            short_kernel(GEMM),
            "graphsan/lab/quant/linear.py:311 in release_weight_workspace",
            "pool-reuse",
        ],
    )


@needs_browser
def test_the_report_reads_without_scripts(tmp_path):
    html = tmp_path / "report.html"
    html.write_text(
        render_report([rank_report(0)], ["out.json"]).replace("<script>", "<script>throw 0;", 1)
    )
    page = open_page(BROWSER, str(html))
    assert not page.scripts_ran and "open all stacks" not in page.text  # the toolbar stays hidden
    assert short_kernel(GEMM) in page.text and "release_weight_workspace" in page.text


def baked_report() -> Report:
    """A report of the three kinds about state a graph baked at capture: a dropout switched to
    eval in validation, a float lr a scheduler changed, a weight re-pointed."""
    g = _graph(5, "train step", T0 + 1.0, [MUL, GEMM], 0)
    switch = [("examples/train.py", 60, "main"), ("examples/train.py", 31, "validate")]
    common = dict(nbytes=0, block_address=0, pool="", alloc_stack=[], node=-1, kernel="")
    mode = _finding(
        0,
        "mode",
        g,
        **common,
        block=0,
        modules=("Net.drop", "Net.block.drop"),
        captured="train",
        current="eval",
        free_stack=switch,
        phase="validation",
        step=40,
        now="2 module(s) captured in train mode are in eval mode now",
    )
    value = _finding(
        0,
        "baked-value",
        g,
        **common,
        block=0,
        entry="Adam.param_groups[0]['lr']",
        captured="0.001",
        current="0.0005",
        free_stack=[],
        phase="train",
        step=41,
    )
    superseded = _finding(
        0,
        "superseded",
        g,
        1,
        GEMM,
        0x7F3A00400000,
        entry="Net.lin.weight",
        captured="a Parameter of shape (4, 4) at 0x7f3a00400000",
        current="a Parameter of shape (4, 4) at 0x7f3a00900000",
        free_stack=[("examples/train.py", 77, "swap_weights")],
        alloc_stack=[],
    )
    return Report([mode, value, superseded], [g], 0, "raise", {}, [], 0)


def test_baked_findings_read_as_what_changed_not_as_a_block(tmp_path):
    text = render_report([baked_report()], ["out.json"])
    assert "Net.drop, Net.block.drop" in text and "train &rarr; eval" in text
    assert "switched at <code>examples/train.py:31 in validate</code>" in text.replace("<wbr>", "")
    assert "changed before this replay, by a plain assignment no hook sees" in text  # the lr
    assert "freed or changed at" in text
    assert "The block&#39;s life" not in text and "The block's life" not in text
    assert "Net.lin.weight" in text and "0x7f3a00400000" in text


@needs_browser
def test_baked_findings_in_a_browser(tmp_path):
    rep = save(tmp_path, baked_report(), "baked.json")
    html = tmp_path / "baked.html"
    assert main(["report", "--html", str(html), rep]) == 0
    page = open_page(BROWSER, str(html), screenshot_path(tmp_path, "report-baked.png"))
    check_page(
        page,
        [
            "mode",
            "baked-value",
            "superseded",
            "Adam.param_groups[0]['lr']",
            "0.001 → 0.0005",
            "examples/train.py:77 in swap_weights",
        ],
    )
