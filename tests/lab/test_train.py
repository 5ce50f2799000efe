"""CPU tests of the lab trainer (eager): loss falls, gradient accumulation, validation / save / GC
transitions, data determinism, bad options, `--dry-run` for `super` on the meta device."""

import re
import subprocess
import sys

import pytest
import torch

from graphsan.lab.train import ConfigError, TrainConfig, train
from graphsan.lab.train.cli import run
from graphsan.lab.train.data import SyntheticTokens

TINY = {"preset": "tiny", "quiet": True, "device": "cpu"}


@pytest.mark.slow
def test_loss_falls_on_synthetic_data():
    r = train(TrainConfig(**TINY, train_iters=60, lr=1e-2, micro_batch_size=4, seq_length=64))
    assert len(r.losses) == 60
    assert sum(r.losses[-5:]) / 5 < r.losses[0] - 0.4, r.losses


def test_gradient_accumulation_matches_one_big_microbatch():
    names = ("layers.0.mixer.in_proj.weight", "layers.2.mixer.router.weight", "embedding.weight")
    common = dict(TINY, train_iters=1, global_batch_size=4, seq_length=32, capture_grads=names)
    one = train(TrainConfig(**common, micro_batch_size=4))
    acc = train(TrainConfig(**common, micro_batch_size=1))
    assert one.losses[0] == pytest.approx(acc.losses[0], rel=1e-2)
    for n in names:
        a, b = one.main_grads[0][n], acc.main_grads[0][n]
        assert a.abs().sum() > 0
        assert (a - b).norm() / a.norm() < 0.05, n


def test_eval_save_and_gc_on_the_same_iteration(tmp_path, capsys):
    cfg = TrainConfig(
        **TINY,
        train_iters=4,
        eval_interval=2,
        eval_iters=1,
        save_interval=2,
        manual_gc_interval=2,
        save=str(tmp_path),
        precision_config="super-mixed",
        cuda_graph_modules=("attn", "mamba"),
        state_policy="fixed",
    )
    cfg.quiet = False
    r = train(cfg)
    out = capsys.readouterr().out
    assert [i for i, _ in r.eval_losses] == [2, 4]
    assert all(torch.isfinite(torch.tensor(v)) for _, v in r.eval_losses)
    assert all(torch.isfinite(torch.tensor(r.losses)))
    ckpt = torch.load(tmp_path / "latest.pt", weights_only=False)
    assert ckpt["iteration"] == 4
    # Megatron's order: validation before save on a shared iteration; CPU runs graphs eagerly
    assert out.index("validation at iteration 2") < out.index("saved checkpoint")
    assert out.count("CUDA graphs need CUDA") == 1
    # the recipes of the precision file were bound
    table = dict(r.recipe_table)
    assert table["layers.0.mixer.out_proj"].startswith("mxfp8")
    assert table["layers.0.mixer.in_proj"].startswith("nvfp4")
    assert table["layers.1.mixer.linear_qkv"].startswith("bf16")


def test_eval_does_not_change_training():
    base = dict(TINY, train_iters=4, seq_length=32)
    plain = train(TrainConfig(**base))
    with_eval = train(TrainConfig(**base, eval_interval=1, eval_iters=1))
    assert plain.losses == with_eval.losses


def test_synthetic_data_is_deterministic():
    a = SyntheticTokens(256, 64, seed=5)
    b = SyntheticTokens(256, 64, seed=5)
    x1, y1 = a.batch("train", 3, 2)
    x2, y2 = b.batch("train", 3, 2)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    assert not torch.equal(a.batch("valid", 3, 2)[0], x1)


def test_byte_file_data(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello graphs " * 200)
    r = train(TrainConfig(**TINY, train_iters=2, seq_length=32, data_path=str(f)))
    assert len(r.losses) == 2


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["--cuda-graph-modules", "attn", "foo"],
            "unknown scope 'foo'; expected some of attn, mamba",
        ),
        (["--cuda-graph-modules", "moe_preprocess"], "moe_preprocess needs moe_router"),
        (["--global-batch-size", "3", "--micro-batch-size", "2"], "not a multiple of"),
        (["--state-policy", "te217"], "--state-policy te217: expected one of fixed, te218"),
        (["--graph-state", "te217"], "--state-policy te217: expected one of fixed, te218"),
        (["--preset", "huge"], "--preset huge: expected one of tiny, small, super"),
        (["--precision-config", "nope"], "no such precision file"),
        (["--seq-length", "30", "--micro-batch-size", "1"], "expected a multiple of 32"),
        (["--data-path", "/nonexistent/file"], "no such file"),
        (["--data-path", "/"], "--data-path /: a folder; expected a local text file"),
        (["--data-path", ""], "--data-path '': expected a file"),
        (["--precision-config", ""], "--precision-config '': expected a file"),
        (["--device", "cudaXYZ"], "--device cudaXYZ: expected auto, cpu, cuda or cuda:N"),
        (["--device", "cuda:-1"], "--device cuda:-1: expected auto, cpu, cuda or cuda:N"),
        (["--lr", "inf"], "--lr inf: expected a finite number >= 0"),
        (["--lr", "nan"], "--lr nan: expected a finite number >= 0"),
        (["--lr", "-0.1"], "--lr -0.1: expected a finite number >= 0"),
        (["--lr", "fast"], "argument --lr: invalid float value: 'fast'"),
        (
            ["--eval-interval", "2", "--eval-iters", "0"],
            "--eval-iters 0 with --eval-interval 2: validation needs --eval-iters >= 1",
        ),
        (
            ["--num-layers-at-end-in-bf16", "99"],
            "--num-layers-at-end-in-bf16 99: the tiny model has 4 layers; expected at most 4",
        ),
        (
            ["--num-layers-at-start-in-bf16", "5"],
            "--num-layers-at-start-in-bf16 5: the tiny model has 4 layers",
        ),
        (["--save-interval", "1", "--save", ""], "--save '': expected a directory"),
        (
            ["--save-interval", "1", "--save", __file__ + "/ckpt"],
            f"--save {__file__}/ckpt: {__file__} is a file; expected a directory",
        ),
        # the dry run's size against this machine's memory, before anything is allocated
        (["--preset", "super"], "--preset super: training needs at least 2,072.4 GiB"),
        (["--train-iters"], "argument --train-iters: expected one argument"),
    ],
)
def test_bad_options_give_one_error_line(argv, needle, capsys):
    try:
        rc = run(["--device", "cpu", "--quiet", "--train-iters", "1", *argv])
    except SystemExit as exc:  # argparse's own checks
        rc = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and needle in err[0], err


def test_an_unwritable_save_folder_is_refused_before_training(tmp_path, capsys, monkeypatch):
    from graphsan.lab.train import trainer

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:  # root writes anyway: use a folder no one can create files in
        (ro / "probe").mkdir()
        ro = "/proc"
    except OSError:
        pass
    monkeypatch.setattr(trainer, "build_model", None)  # training must not start
    rc = run(["--device", "cpu", "--quiet", "--save-interval", "1", "--save", f"{ro}/ckpt"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"graphsan train: error: --save {ro}/ckpt: cannot write in {ro}")


def test_a_precision_rule_that_matches_no_module_is_refused(tmp_path, capsys):
    path = tmp_path / "typo.yaml"
    path.write_text(
        "base: bf16\nrules:\n  - {match: '*.linear_qkv', recipe: mxfp8}\n"
        "  - {match: '*.linaer_proj', recipe: mxfp8}\n"
    )
    for extra in ([], ["--dry-run"]):
        assert run(["--device", "cpu", "--quiet", "--precision-config", str(path), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"graphsan train: error: {path}: key 'rules[1].match' '*.linaer_proj' (recipe "
            "mxfp8) matches no module of the tiny model; expected a glob over module paths"
        ), err


def test_a_run_that_diverges_ends_in_one_line(capsys):
    argv = ["--device", "cpu", "--quiet", "--lr", "1e9", "--seq-length", "32"]
    rc = run([*argv, "--train-iters", "4", "--log-interval", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert re.fullmatch(
        r"graphsan train: error: training diverged: loss is (nan|inf) at iteration \d "
        r"\(a lower --lr may help\)",
        err[0],
    ), err


def test_module_entry_point_rejects_unknown_option():
    p = subprocess.run(
        [sys.executable, "-m", "graphsan.lab.train", "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "--no-such-flag" in p.stderr


def test_dry_run_super_prints_counts_and_recipes_on_meta(capsys):
    before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    rc = run(
        [
            "--preset",
            "super",
            "--dry-run",
            "--precision-config",
            "super-mixed",
            "--num-layers-at-end-in-bf16",
            "14",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "total 123," in out and "active 13," in out
    assert "layers.{i}.mixer.out_proj" in out and "mxfp8" in out
    assert "[last 14 layers]" in out
    if torch.cuda.is_available():
        assert torch.cuda.memory_allocated() == before


def test_a_resumed_run_continues_identically(tmp_path):
    """2 iterations saved, then --load and 2 more: the losses, norms and weights of 4 in one go
    (the data, the learning rate and the Adam states follow the saved iteration)."""
    from tests.lab.distributed_program import KeepModel

    base = dict(TINY, seq_length=32, lr_warmup_iters=3, save=str(tmp_path))
    whole = train(TrainConfig(**base, train_iters=4), callbacks=[a := KeepModel()])
    train(TrainConfig(**base, train_iters=2, save_interval=2))
    rest = train(
        TrainConfig(**base, train_iters=4, load=str(tmp_path)), callbacks=[b := KeepModel()]
    )
    assert rest.losses == whole.losses[2:] and rest.grad_norms == whole.grad_norms[2:]
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_a_checkpoint_that_does_not_fit_is_one_line(tmp_path, capsys):
    base = dict(TINY, seq_length=32, save=str(tmp_path))
    train(TrainConfig(**base, train_iters=2, save_interval=2))
    with pytest.raises(ConfigError, match="model argument hidden_size is 64 there; expected 96"):
        train(
            TrainConfig(
                **base, train_iters=4, load=str(tmp_path), model_overrides={"hidden_size": 96}
            )
        )
    with pytest.raises(ConfigError, match="at iteration 2; expected --train-iters above it"):
        train(TrainConfig(**base, train_iters=2, load=str(tmp_path)))
    rc = run(["--device", "cpu", "--quiet", "--load", str(tmp_path / "none")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [
        f"graphsan train: error: --load {tmp_path / 'none'}: no latest.pt there; expected a "
        "directory written by --save (with the same --expert-model-parallel-size)"
    ]
