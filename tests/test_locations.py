"""CPU: frames are printed and matched by a location that holds on any machine and from any
working directory (graphsan.core.locations): suppressions generated in one folder apply from
another, a report recorded under another absolute prefix prints and matches the same, and a
frame in torch's installed files is named by its path within torch."""

from __future__ import annotations

import dataclasses
import os
import traceback

import pytest
import torch

import graphsan
from graphsan.cli.main import main
from graphsan.core.locations import location, set_source_root
from graphsan.cuda.context import is_user_frame, python_stack
from graphsan.report import Report, format_finding, suppressions
from graphsan.report.json_report import sample_path
from tests.test_plugin_and_ranks import finding

SAMPLE = "te3316-case4"


@pytest.fixture(autouse=True)
def found_roots():
    """Each test starts, and leaves, with roots found per file (none given)."""
    set_source_root(None)
    yield
    set_source_root(None)


def write(folder, name: str, text: str = "") -> str:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_suppressions_generated_in_one_folder_apply_from_another(tmp_path, monkeypatch, capsys):
    here = tmp_path / "a" / "b" / "c"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    assert main(["report", "--sample", SAMPLE, "--gen-suppressions"]) == 0
    text = capsys.readouterr().out
    assert "alloc: " in text and "../" not in text
    known = write(tmp_path, "known.yaml", text)
    total = len(Report.load(sample_path(SAMPLE)).findings)
    for folder in (os.sep, str(tmp_path)):
        monkeypatch.chdir(folder)
        args = ["--suppressions", known, "--error-exitcode", "9"]
        assert main(["report", "--sample", SAMPLE, *args]) == 0
        out = capsys.readouterr().out
        assert "0 finding(s)" in out and f"suppressed: {total} finding(s)" in out


# files of graphsan's lab, as a report written with absolute paths names them; the last one is
# not in this checkout (a file since removed)
LAB_FILES = ("lab/quant/linear.py", "lab/train/graphs.py", "lab/quant/retired_kernels.py")


def recorded(prefix: str | None = None) -> list:
    """Findings whose frames hold absolute paths into graphsan's lab: under this checkout's
    folder, or under `prefix` (another machine's checkout or environment)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(graphsan.__file__)))
    base = os.path.join(prefix or here, "graphsan")
    linear, graphs, retired = (os.path.join(base, *f.split("/")) for f in LAB_FILES)
    return [
        dataclasses.replace(
            finding(node=node),
            alloc_stack=[(graphs, 40, "capture"), (retired, 156, "_mxfp8")],
            free_stack=[(graphs, 88, "validate"), (linear, 353 + node, "clear_workspace")],
        )
        for node in (1, 2)
    ]


@pytest.mark.parametrize(
    "prefix", ["/home/ci/builds/4711/src", "/opt/venv/lib/python3.12/site-packages"]
)
def test_a_report_recorded_under_another_prefix_prints_and_matches_the_same(tmp_path, prefix):
    path = str(tmp_path / "r.json")
    Report(recorded(prefix)).save(path)
    elsewhere, original = Report.load(path).findings, recorded()
    assert elsewhere[0].free_stack[-1][0].startswith(prefix + "/graphsan/")
    assert [format_finding(f) for f in elsewhere] == [format_finding(f) for f in original]
    text = format_finding(elsewhere[0])
    assert "graphsan/lab/quant/retired_kernels.py:156 in _mxfp8" in text and prefix not in text
    known = suppressions.load(write(tmp_path, "k.yaml", suppressions.generate(original)))
    kept, suppressed = suppressions.split(known, elsewhere)
    assert kept == [] and len(suppressed) == 2
    assert suppressions.generate(elsewhere) == suppressions.generate(original)


def torch_frame() -> tuple[str, int, str]:
    """A real frame in torch's installed files: nn.Module's call into a forward."""

    class Probe(torch.nn.Module):
        def forward(self):
            return traceback.extract_stack()

    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    inside = [fs for fs in Probe()() if fs.filename.startswith(torch_dir)]
    assert inside, "no frame of torch's between the call and forward"
    return inside[-1].filename, inside[-1].lineno, inside[-1].name


def test_a_frame_in_torch_installed_files_is_named_within_torch(tmp_path):
    filename, line, name = torch_frame()
    assert os.path.isabs(filename) and location(filename) == "torch/nn/modules/module.py"
    f = dataclasses.replace(finding(), alloc_stack=[(filename, line, name)])
    assert f"torch/nn/modules/module.py:{line} in {name}" in format_finding(f)
    text = suppressions.generate([f])
    assert f'alloc: "*torch/nn/modules/module.py:{line} in {name}"' in text
    known = suppressions.load(write(tmp_path, "k.yaml", text))
    other_env = "/srv/env/lib/python3.9/site-packages/torch/nn/modules/module.py"
    there = dataclasses.replace(f, alloc_stack=[(other_env, line, name)])
    assert all(s.matches(there) for s in known) and all(s.matches(f) for s in known)


def test_files_of_a_project_are_named_from_its_root_or_their_top_package(tmp_path, monkeypatch):
    write(tmp_path, "proj/pyproject.toml")
    script = write(tmp_path, "proj/scripts/train.py")
    write(tmp_path, "proj/src/mypkg/__init__.py")
    write(tmp_path, "proj/src/mypkg/sub/__init__.py")
    module = write(tmp_path, "proj/src/mypkg/sub/model.py")
    assert location(script) == "scripts/train.py"
    assert location(module) == "mypkg/sub/model.py"  # as it would be once installed
    monkeypatch.chdir(tmp_path / "proj" / "scripts")
    assert location(script) == "scripts/train.py"  # the working folder plays no part
    set_source_root(str(tmp_path / "proj"))
    assert location(module) == "src/mypkg/sub/model.py"  # a given root comes first
    assert location("<frozen runpy>") == "<frozen runpy>"
    assert location("scripts/train.py") == "scripts/train.py"  # already a location


def test_a_file_outside_every_project_is_named_from_its_sys_path_folder(tmp_path, monkeypatch):
    script = write(tmp_path, "loose/prog.py")
    monkeypatch.syspath_prepend(str(tmp_path / "loose"))
    assert location(script) == "prog.py"
    assert location("/nowhere/here/prog.py") == "/nowhere/here/prog.py"  # nothing to go by


def test_recorded_stacks_hold_locations():
    assert python_stack()[-1][0] == "tests/test_locations.py"


def test_every_file_of_the_sanitizer_is_graphsans_own_frame_and_the_labs_the_users():
    """Wherever the filter's own file sits in the package, a frame in any of the sanitizer's
    files is graphsan's (left out of stacks, never a capture site) and one of the lab's is the
    user's."""
    package = os.path.dirname(os.path.abspath(graphsan.__file__))
    files = [
        os.path.join(folder, name)
        for folder, _, names in os.walk(package)
        for name in names
        if name.endswith(".py")
    ]
    lab = os.path.join(package, "lab") + os.sep
    sanitizer = [f for f in files if not f.startswith(lab)]
    assert len(sanitizer) > 50 and any(os.sep + "runtime" + os.sep in f for f in sanitizer)
    assert [f for f in sanitizer if is_user_frame(f)] == []
    assert all(is_user_frame(f) for f in files if f.startswith(lab))


def test_run_and_report_take_a_source_root(tmp_path, capsys):
    prog = write(
        tmp_path,
        "proj/tools/prog.py",
        "from graphsan.cuda.context import python_stack\nprint('frame at', python_stack()[-1][0])\n",
    )
    assert main(["run", prog]) == 0
    assert "frame at prog.py" in capsys.readouterr().out  # no project root: the script's folder
    assert main(["run", "--source-root", str(tmp_path / "proj"), prog]) == 0
    assert "frame at tools/prog.py" in capsys.readouterr().out
    assert main(["run", "--source-root", str(tmp_path / "none"), prog]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("does not exist; expected the project's root folder") and "\n" not in err
    # a report whose frames hold another machine's absolute paths: give the root it had there
    f = dataclasses.replace(finding(), free_stack=[("/builds/ci/proj/train.py", 200, "evaluate")])
    path = str(tmp_path / "r.json")
    Report([f]).save(path)
    known = write(tmp_path, "k.yaml", '- name: ours\n  free: "train.py:200 in evaluate"\n')
    args = ["report", path, "--suppressions", known, "--error-exitcode", "9"]
    assert main(args) == 9
    assert "/builds/ci/proj/train.py:200 in evaluate" in capsys.readouterr().out
    assert main([*args, "--source-root", "/builds/ci/proj"]) == 0
    assert "suppressed: 1 finding(s) (ours: 1)" in capsys.readouterr().out
