"""State a graph baked at capture, on real graphs (tests/gpu/programs/prog_baked.py): each way
of changing it that the graph never sees is stopped before the replay by its kind, and each
documented way of changing it stays quiet, under both attachments."""

from __future__ import annotations

import pytest

from tests.gpu_programs import run_program

pytestmark = pytest.mark.gpu

BROKEN = {
    "mode_after_validation_left_in_eval": ["mode"],
    "mode_of_one_submodule": ["mode"],
    "float_lr_under_a_scheduler": ["baked-value"],
    "parameter_re_pointed": ["superseded"],
    "buffer_re_registered": ["superseded"],
    "tensor_lr_replaced": ["superseded"],
}
CORRECT = (
    "tensor_lr_under_a_scheduler",
    "eval_validation_then_train",
    "no_mode_dependent_module_in_eval",
    "a_graph_per_mode",
    "load_state_dict_in_place",
    "value_set_back",
    "make_graphed_callables_in_eval",
    "compile_reduce_overhead_train_eval_train",
)
NAMED = {  # what each stopped replay's text names
    "mode_after_validation_left_in_eval": ["Net.drop", "Net.bn", "at capture: train"],
    "mode_of_one_submodule": ["Net.drop", "switched", "prog_baked.py"],
    "float_lr_under_a_scheduler": ["Adam.param_groups[0]['lr']", "0.001", "0.0005"],
    "parameter_re_pointed": ["Net.up.weight", "re-pointed", "prog_baked.py"],
    "buffer_re_registered": ["Net.bn.running_mean"],
    "tensor_lr_replaced": ["Adam.param_groups[0]['lr']"],
}


@pytest.fixture(scope="module")
def result():
    rc, res, log = run_program("baked", policy="raise", timeout=400)
    assert rc == 0 and res is not None, log[-4000:]
    return res


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_change_the_graph_never_sees_is_stopped_by_its_kind(result, name):
    assert result["scenarios"][name] == BROKEN[name], result["texts"].get(name)
    text = result["texts"][name]
    for needle in NAMED[name]:
        assert needle in text, text


@pytest.mark.parametrize("name", CORRECT)
def test_the_documented_way_is_quiet(result, name):
    assert result["scenarios"][name] == [], result["texts"].get(name)


def test_the_program_checked_what_it_set_up(result):
    assert result["opt_holds_old"] and result["buffer_kept"]
    assert result["lr_filled_in_place"] and result["reloaded_values"]
    assert result["healthy"]
    stopped = {f["kind"] for f in result["findings"]}
    assert stopped == {"mode", "baked-value", "superseded"}
