"""The fault harness (bench/bench_faults.py) on CPU: how a trial is judged, the table, and the
make_graphed_callables side model's training step and faults, with torch's
`make_graphed_callables` (CUDA only) replaced by a stand-in that holds the samples as it does."""

from __future__ import annotations

import gc
import importlib.util
import random
import re
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    """A bench script as a module; registered by name, so that the next one can import it as
    it does when run from bench/."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


fi = _load("fault_injection")
bf = _load("bench_faults")
MGC_KINDS = ("mgc-data-rebind", "mgc-input-rebind")


class Holder:
    """Stands in for make_graphed_callables: keeps the samples (its static inputs) alive and
    returns the modules, as torch does for nn.Module callables."""

    def __init__(self):
        self.held = []

    def __call__(self, modules, samples):
        self.held.append(samples)
        return modules


def _blocks(holder=None):
    torch.manual_seed(0)
    return fi.GraphedBlocks(
        torch, device="cpu", make_graphed=holder or Holder(), blocks=2, hidden=8, tokens=4
    )


# ---- judging a trial ----
@pytest.mark.parametrize("kind", MGC_KINDS)
def test_a_make_graphed_callables_fault_is_caught_only_when_the_replay_raised_after_it(kind):
    injected = {"kind": kind, "injected": f"{kind}: block 0 at 0x7f00"}
    assert bf.verdict(dict(injected, outcome="stopped")) == "caught"
    assert bf.verdict(dict(injected, outcome="completed")) == "missed"
    assert bf.verdict(dict(injected, outcome="error")) == "missed"
    assert bf.verdict({"kind": kind, "outcome": "completed", "injected": "no-hazard"}) == (
        "no-hazard"
    )
    # stopped before the fault was injected: the side model raised on clean training
    assert bf.verdict({"kind": kind, "outcome": "stopped", "injected": None}) == "false-alarm"


def test_a_control_that_stops_is_a_false_alarm():
    assert bf.verdict({"kind": "control", "outcome": "completed"}) == "clean"
    assert bf.verdict({"kind": "control", "outcome": "stopped"}) == "false-alarm"


def test_the_table_has_a_row_per_kind_with_its_counts():
    res = [
        {"kind": "control", "outcome": "completed", "healthy": True},
        {"kind": "control", "outcome": "stopped", "healthy": True, "finding_kinds": ["freed"]},
        {
            "kind": "mgc-data-rebind",
            "outcome": "stopped",
            "injected": "x",
            "healthy": True,
            "finding_kinds": ["moved"],
        },
        {"kind": "mgc-data-rebind", "outcome": "completed", "injected": "x", "healthy": False},
        {
            "kind": "mgc-input-rebind",
            "outcome": "completed",
            "injected": "no-hazard",
            "healthy": True,
        },
    ]
    rows = {ln.split(" | ")[0][2:]: ln for ln in bf.table(res, bf.KINDS).splitlines()[2:]}
    assert set(rows) == {"control", *MGC_KINDS}, "kinds without trials get no row"
    assert rows["control"] == "| control | 2 | - | 0 | 1 | 0 | 2/2 | freed 1 |"
    assert rows["mgc-data-rebind"] == "| mgc-data-rebind | 2 | 1 | 1 | 0 | 0 | 1/2 | moved 1 |"
    assert rows["mgc-input-rebind"] == "| mgc-input-rebind | 1 | 0 | 0 | 0 | 1 | 1/1 | - |"


def test_every_kind_is_described_in_the_docstring_and_in_coverage_md():
    doc_table = (ROOT / "docs" / "coverage.md").read_text().split("## Results")[0]
    described = set(re.findall(r"^\| ([a-z-]+) \|", doc_table, re.M))
    for kind in bf.KINDS[1:]:
        assert re.search(rf"^ +{kind}\b|^ +internal-driver / {kind}", bf.__doc__, re.M), kind
        assert kind in described, f"docs/coverage.md describes no {kind}"
    assert set(fi.MGC_FAULTS) == set(MGC_KINDS) and set(MGC_KINDS) <= set(bf.KINDS)


def test_every_kind_has_a_row_in_coverage_md_results_measured_or_not():
    results = (ROOT / "docs" / "coverage.md").read_text().split("### Results")[1]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| ([a-z-]+) \| ([^|]+) \|", results, re.M)}
    assert sorted(set(bf.KINDS) - set(rows)) == []
    for kind in bf.KINDS:
        assert rows[kind].strip().isdigit() or "not measured" in rows[kind], (kind, rows[kind])


# ---- the make_graphed_callables side model ----
def test_the_side_model_trains_and_goes_back_to_training_mode_after_eval():
    mgc = _blocks()
    before = [p.detach().clone() for b in mgc.blocks for p in b.parameters()]
    mgc.step()
    after = [p.detach() for b in mgc.blocks for p in b.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "all trained"
    assert all(p.grad is None for b in mgc.blocks for p in b.parameters())
    modes = []
    for b in mgc.blocks:
        b.register_forward_pre_hook(lambda m, args: modes.append(m.training))
    mgc.evaluate()
    assert modes == [False, False], "eval mode: the graphed modules run their eager forward"
    assert all(b.training for b in mgc.blocks)


def test_the_harness_drops_its_samples_so_only_the_graphed_callables_hold_them():
    holder = Holder()
    mgc = _blocks(holder)
    gc.collect()
    assert all(ref() is not None for ref in mgc.samples)
    held = [args[0] for samples in holder.held for args in samples]
    assert [ref() for ref in mgc.samples] == held
    assert [t.requires_grad for t in held] == [False, True], "block 0's input is data"
    holder.held.clear()
    del held
    gc.collect()
    assert all(ref() is None for ref in mgc.samples), "the harness kept a sample alive"


def test_data_rebind_moves_a_weight_and_its_old_storage_dies():
    mgc = _blocks()
    ptrs = {id(p): p.data_ptr() for b in mgc.blocks for p in b.parameters()}
    what = mgc.rebind_weight(random.Random(3))
    moved = [p for b in mgc.blocks for p in b.parameters() if p.data_ptr() != ptrs[id(p)]]
    assert len(moved) == 1 and what.startswith("mgc-data-rebind block"), what
    assert f"({moved[0].numel()} elements)" in what
    assert any(q is moved[0] for q in mgc.opt.param_groups[0]["params"]), "still trained"


def test_data_rebind_whose_old_storage_lives_on_is_no_hazard():
    mgc = _blocks()
    kept = [p.detach() for b in mgc.blocks for p in b.parameters()]  # views keep the storage
    assert mgc.rebind_weight(random.Random(3)) == "no-hazard"
    del kept


def test_input_rebind_repoints_the_held_sample_and_its_old_storage_dies():
    holder = Holder()
    mgc = _blocks(holder)
    held = [args[0] for args in holder.held[0]]
    ptrs = [t.data_ptr() for t in held]
    storages = [weakref.ref(t.untyped_storage()) for t in held]
    what = mgc.rebind_input(random.Random(1))
    (i,) = [j for j, t in enumerate(held) if t.data_ptr() != ptrs[j]]
    assert what == f"mgc-input-rebind: block {i}'s sample input at {ptrs[i]:#x}"
    assert storages[i]() is None and held[i].shape == (4, 8)


def test_input_rebind_without_a_held_sample_is_a_harness_error():
    holder = Holder()
    mgc = _blocks(holder)
    holder.held.clear()
    gc.collect()
    with pytest.raises(RuntimeError, match="sample input is no longer alive"):
        mgc.rebind_input(random.Random(1))


@pytest.mark.parametrize("kind", MGC_KINDS)
def test_the_injector_sends_each_make_graphed_callables_fault_to_the_side_model(kind):
    holder = Holder()
    inj = fi.Injector({"seed": 5, "kind": kind, "step": 2}, torch, gather=None)
    inj.side = SimpleNamespace(mgc=_blocks(holder))
    inj.inject(kind)
    assert inj.injected.startswith(kind + " ") or inj.injected.startswith(kind + ":")


def test_the_injector_refuses_a_kind_it_does_not_know():
    inj = fi.Injector({"seed": 5, "kind": "control", "step": 2}, torch, gather=None)
    with pytest.raises(ValueError, match="unknown fault kind 'mgc-nope'"):
        inj.inject("mgc-nope")
    inj.inject("internal-node")  # patched for the whole trial; nothing to do at the step
    assert inj.injected is None


@pytest.mark.parametrize("kind", ["internal-driver", "internal-node"])
def test_an_internal_fault_breaks_graphsans_walk_until_restored(kind):
    from graphsan.cuda import driver, graphwalk

    before = (driver.walk, graphwalk.GraphWalk.walk, driver._read_kernel, graphwalk.parse)
    patched = fi.patch_internal(kind)
    after = (driver.walk, graphwalk.GraphWalk.walk, driver._read_kernel, graphwalk.parse)
    changed = [a is not b for a, b in zip(before, after, strict=True)]
    assert changed == (
        [True, True, False, False] if kind == "internal-driver" else [False, False, True, True]
    )
    if kind == "internal-driver":
        with pytest.raises(RuntimeError, match="injected: cuGraphGetNodes failed"):
            driver.walk(0)
    else:
        assert graphwalk.parse(b"", None) == []  # an empty graph parses to no node, as before
        assert driver._read_kernel(None, 3).name is None
    patched.restore()
    assert (driver.walk, graphwalk.GraphWalk.walk, driver._read_kernel, graphwalk.parse) == before
