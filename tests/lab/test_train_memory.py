"""CPU: `graphsan train` counts a training step's memory before allocating it, and a step the
machine cannot hold ends in the out-of-memory line and its exit status, not in a process the
kernel kills. The count runs the step on the meta device at the run's shapes; what the machine
has is the kernel's MemAvailable or less, where a cgroup limits the process. The machine's
memory is replaced by a figure here: nothing large is ever allocated."""

from __future__ import annotations

import pytest
import torch

from graphsan.lab.train import device, trainer
from graphsan.lab.train.cli import EXIT_OUT_OF_MEMORY, run
from graphsan.lab.train.config import TrainConfig

GIB = 2**30
ARGV = ["--device", "cpu", "--quiet", "--train-iters", "1"]


def a_machine_with(monkeypatch, nbytes: int) -> None:
    monkeypatch.setattr(device, "free_memory", lambda where: nbytes)


def test_a_step_larger_than_the_machine_is_the_out_of_memory_line(monkeypatch, capsys):
    a_machine_with(monkeypatch, 8 * GIB)

    def build_model(*args, **kwargs):
        raise AssertionError("the model was built: the step was not counted first")

    monkeypatch.setattr(trainer, "build_model", build_model)
    assert run([*ARGV, "--micro-batch-size", "100000"]) == EXIT_OUT_OF_MEMORY
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("graphsan train: error: out of memory (a training step needs about ")
    assert line.endswith(
        "for 1 microbatch of 6,400,000 tokens and 0.0 GiB for the weights and optimizer; cpu "
        "has 8.0 GiB available; counted before allocating); lower --micro-batch-size (now "
        "100000) or --seq-length (now 64)"
    )
    needs = float(line.split("needs about ")[1].split(" GiB")[0].replace(",", ""))
    assert needs > 8


def test_forwards_in_flight_count_each(monkeypatch, capsys):
    a_machine_with(monkeypatch, 8 * GIB)
    monkeypatch.setattr(trainer, "build_model", None)
    argv = [*ARGV, "--micro-batch-size", "100000", "--global-batch-size", "300000"]
    argv += ["--microbatch-schedule", "1f1b", "--microbatches-in-flight", "3"]
    assert run(argv) == EXIT_OUT_OF_MEMORY
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "for 3 microbatches of 6,400,000 tokens each" in line
    assert line.endswith("or --microbatches-in-flight (now 3)")


def test_a_run_that_fits_is_not_refused(monkeypatch):
    a_machine_with(monkeypatch, 1 * GIB)
    assert run([*ARGV, "--seq-length", "32"]) == 0


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_meta_device_runs_each_preset_step(preset):
    """A step the meta device cannot run is not counted (and so never refused): each preset's
    must be, and its count grow with the microbatch."""
    cfg = TrainConfig(preset=preset, device="cpu", seq_length=64)
    one, two = (device.step_memory(cfg.replace(micro_batch_size=n)) for n in (4, 8))
    assert one is not None and two is not None
    (peak1, held1), (peak2, held2) = one, two
    assert 0 < held1 <= peak1 and 0 < held2 <= peak2
    assert held2 > held1 and peak2 > peak1


def test_the_count_on_the_meta_device_is_what_the_cpu_step_holds():
    """The same step run on the CPU, its tensors counted the same way: the meta device's count
    (attention counted as the fused kernels allocate, not as the math path's scores) is close
    to it."""
    cfg = TrainConfig(preset="tiny", device="cpu", micro_batch_size=2, seq_length=256)
    peak, _ = device.step_memory(cfg)
    model = device.build_model(cfg.model_args(), device="cpu", seed=0)
    tokens = torch.randint(0, cfg.model_args().vocab_size, (2, 256))
    with device._LiveBytes() as count:
        model(tokens, tokens)["loss"].backward()
    assert 0.8 < peak / count.peak < 1.25, (peak, count.peak)


MEMINFO = "MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20971520 kB\n"


def cgroup_v2(tmp_path, limits: dict[str, tuple[str, int, int]]) -> tuple[str, str, str]:
    """A /proc/meminfo with 20 GiB available, and a cgroup v2 tree: `limits` maps a cgroup's
    path to (memory.max, memory.current, page cache); the process sits in /job/step."""
    (tmp_path / "meminfo").write_text(MEMINFO)
    (tmp_path / "cgroup").write_text("0::/job/step\n")
    root = tmp_path / "fs"
    for path, (limit, used, cache) in limits.items():
        folder = root / path.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "memory.max").write_text(f"{limit}\n")
        (folder / "memory.current").write_text(f"{used}\n")
        (folder / "memory.stat").write_text(f"anon {used - cache}\nfile {cache}\n")
    return str(tmp_path / "meminfo"), str(tmp_path / "cgroup"), str(root)


def test_the_ram_available_is_memavailable_without_a_cgroup_limit(tmp_path):
    files = cgroup_v2(tmp_path, {"/job/step": ("max", GIB, 0), "/job": ("max", GIB, 0)})
    assert device.available_ram(*files) == 20 * GIB


def test_a_cgroup_limit_below_memavailable_wins_and_page_cache_is_not_used(tmp_path):
    files = cgroup_v2(tmp_path, {"/job/step": (str(8 * GIB), 3 * GIB, 2 * GIB)})
    assert device.available_ram(*files) == 7 * GIB  # 8 - (3 - 2)


def test_a_limit_above_the_process_cgroup_counts(tmp_path):
    files = cgroup_v2(tmp_path, {"/job/step": ("max", GIB, 0), "/job": (str(4 * GIB), 3 * GIB, 0)})
    assert device.available_ram(*files) == GIB


def test_cgroup_v1_memory_controller(tmp_path):
    (tmp_path / "meminfo").write_text(MEMINFO)
    (tmp_path / "cgroup").write_text("5:cpu,cpuacct:/x\n4:memory:/host/ctr\n")
    folder = tmp_path / "fs" / "memory"  # a container: its own cgroup mounted at the top
    folder.mkdir(parents=True)
    (folder / "memory.limit_in_bytes").write_text(str(6 * GIB))
    (folder / "memory.usage_in_bytes").write_text(str(2 * GIB))
    (folder / "memory.stat").write_text(f"cache 0\ntotal_cache {GIB}\n")
    files = (str(tmp_path / "meminfo"), str(tmp_path / "cgroup"), str(tmp_path / "fs"))
    assert device.available_ram(*files) == 5 * GIB
