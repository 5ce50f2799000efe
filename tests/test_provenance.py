"""CPU: what a report records about where it was made (`graphsan.runtime.provenance`). The commit is read
from the checkout's files (a branch, packed refs, a worktree, a detached HEAD) without running
git; an installed copy or a damaged checkout gives None, never an error; the GPU and the
driver's CUDA version are asked only of a process that initialised CUDA."""

from __future__ import annotations

import os
import platform

import pytest

from graphsan.runtime import provenance

SHA = "5629b660d87258138caa43380fa35cd9b097669d"
OTHER = "e1147c3aa9f0e0b6c1d2e3f405162738495a6b7c"


def checkout(tmp_path, head: str = "ref: refs/heads/main\n"):
    """A checkout's layout: <root>/src/graphsan and <root>/.git/HEAD; returns (package, git)."""
    package = tmp_path / "repo" / "src" / "graphsan"
    package.mkdir(parents=True)
    git = tmp_path / "repo" / ".git"
    git.mkdir()
    (git / "HEAD").write_text(head)
    return str(package), git


def commit(package: str) -> str | None:
    return provenance.git_commit.__wrapped__(package)  # uncached: each test has its own tree


def test_a_branch_is_read_from_its_loose_ref(tmp_path):
    package, git = checkout(tmp_path)
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "refs" / "heads" / "main").write_text(SHA + "\n")
    assert commit(package) == SHA


def test_a_branch_is_read_from_packed_refs(tmp_path):
    package, git = checkout(tmp_path)
    (git / "packed-refs").write_text(
        f"# pack-refs with: peeled fully-peeled sorted\n{OTHER} refs/heads/other\n"
        f"{SHA} refs/heads/main\n^{OTHER}\n"
    )
    assert commit(package) == SHA


def test_a_detached_head_is_the_commit(tmp_path):
    package, _ = checkout(tmp_path, head=SHA + "\n")
    assert commit(package) == SHA


def test_a_worktree_reads_its_head_and_the_shared_refs(tmp_path):
    main_git = tmp_path / "main.git"
    wt_git = main_git / "worktrees" / "wt"
    wt_git.mkdir(parents=True)
    (wt_git / "HEAD").write_text("ref: refs/heads/feature\n")
    (wt_git / "commondir").write_text("../..\n")
    (main_git / "packed-refs").write_text(f"{SHA} refs/heads/feature\n")
    package = tmp_path / "wt" / "src" / "graphsan"
    package.mkdir(parents=True)
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {wt_git}\n")
    assert commit(str(package)) == SHA


@pytest.mark.parametrize(
    "damage",
    ["no .git", "HEAD unreadable", "ref missing", "garbage HEAD", "binary ref", ".git file bad"],
)
def test_a_checkout_that_cannot_be_read_gives_none(tmp_path, damage):
    package, git = checkout(tmp_path)
    if damage == "no .git":
        (git / "HEAD").unlink()
        git.rmdir()
    elif damage == "HEAD unreadable":
        (git / "HEAD").unlink()
        (git / "HEAD").mkdir()
    elif damage == "garbage HEAD":
        (git / "HEAD").write_text("not a ref\n")
    elif damage == "binary ref":
        (git / "refs" / "heads").mkdir(parents=True)
        (git / "refs" / "heads" / "main").write_bytes(b"\xff\xfe\x00")
    elif damage == ".git file bad":
        (git / "HEAD").unlink()
        git.rmdir()
        git.write_text("this is not a gitdir line\n")
    assert commit(package) is None


def test_an_installed_copy_has_no_commit(tmp_path):
    package = tmp_path / "lib" / "python3.12" / "site-packages" / "graphsan"
    package.mkdir(parents=True)
    (tmp_path / "lib" / "python3.12" / "site-packages" / ".git").mkdir()  # even beside a repo
    assert commit(str(package)) is None


@pytest.mark.parametrize(
    ("text", "version"),
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
            "550.54.15",
        ),
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build",
            "580.65.06",
        ),
        ("something else entirely", None),
    ],
)
def test_the_driver_version_is_read_from_its_proc_entry(tmp_path, monkeypatch, text, version):
    proc = tmp_path / "version"
    proc.write_text(text + "\nGCC version: gcc 12\n")
    monkeypatch.setattr(provenance, "_DRIVER_PROC", str(proc))
    assert provenance.driver_version() == version


def test_collect_without_cuda_fills_what_it_can_and_asks_cuda_nothing(monkeypatch):
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("CUDA was asked")

    monkeypatch.setattr(provenance, "_DRIVER_PROC", os.devnull + "-missing")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", refuse)
    monkeypatch.setattr(torch.cuda, "current_device", refuse)
    got = provenance.collect()
    assert set(got) == {"graphsan", "commit", "torch", "cuda", "driver", "gpu", "python"}
    import graphsan

    assert got["graphsan"] == graphsan.__version__ and got["torch"] == torch.__version__
    assert got["cuda"] == torch.version.cuda and got["python"] == platform.python_version()
    assert got["gpu"] is None and got["driver"] is None


def test_collect_names_the_gpu_of_a_process_that_initialised_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"NVIDIA H200 #{i}")
    assert provenance.collect()["gpu"] == "NVIDIA H200 #1"


def test_a_failing_cuda_query_leaves_the_field_empty(monkeypatch):
    import torch

    def broken(*args):
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", broken)
    assert provenance.gpu_name() is None
