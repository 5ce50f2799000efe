"""CPU: what of `graphsan selftest` runs without a GPU: the listing of the corpus, and the twin's
usual mistake as `Case` makes it (the programs themselves run on the GPU: test_gpu_selftest)."""

from __future__ import annotations

import json

import torch

from graphsan.cli.main import main
from graphsan.selftest import BUG_SUFFIX, programs, runs
from graphsan.selftest.case import Case


class _Graph:
    """Stands in for a captured graph: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_the_twin_drops_its_victim_before_the_replay_and_the_correct_program_only_replays(
    monkeypatch,
):
    churned = []
    monkeypatch.setattr(Case, "churn", staticmethod(lambda: churned.append(True)))
    for broken in (False, True):
        case, g = Case(broken), _Graph()
        x = torch.zeros(4)
        inputs = {"x": x, "y": torch.ones(2)}
        case.drop_and_replay(g, inputs, "x")
        assert (g.replays, case.replays) == (1, 1)
        assert ("x" in inputs) is not broken and "y" in inputs
        assert case.victims == ([(x.untyped_storage().data_ptr(), 16)] if broken else [])
    assert churned == [True]


def test_warmup_and_capture_warms_up_the_function_it_then_captures(monkeypatch):
    calls = []
    monkeypatch.setattr(Case, "warmup", staticmethod(lambda fn: calls.append(("warmup", fn))))
    monkeypatch.setattr(Case, "capture", lambda self, fn: calls.append(("capture", fn)) or "g")
    step = object()
    assert Case(False).warmup_and_capture(step) == "g"
    assert calls == [("warmup", step), ("capture", step)]


def test_every_program_is_listed_with_its_twin_and_the_json_says_the_same(tmp_path, capsys):
    listing = runs()
    names = [r["name"] for r in listing]
    assert len(names) == len(set(names)) == 2 * len(programs())
    for correct, twin in zip(listing[::2], listing[1::2], strict=True):
        assert twin["name"] == correct["name"] + BUG_SUFFIX and twin["bug"]
        assert correct["pattern"] and correct["source"] and "bug" not in correct
    path = tmp_path / "list.json"
    assert main(["selftest", "--list", "--json", str(path)]) == 0
    assert json.loads(path.read_text()) == listing
    assert main(["selftest", "--list"]) == 0
    assert [ln.split()[0] for ln in capsys.readouterr().out.splitlines()] == names
