"""The layout stays true: imports between graphsan's modules go the allowed directions only.

Imports are read with `ast` (module level and inside functions alike, since a lazy import is
still a dependency), so the check needs nothing imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# what a package may import from graphsan (prefixes; a package always imports itself)
ALLOWED = {
    "graphsan.core": ("graphsan.core",),
    "graphsan.report": ("graphsan.core", "graphsan.report"),
    "graphsan.policies": (
        "graphsan.core",
        "graphsan.cuda.context",
        "graphsan.report",  # what a policy does: StaleMemoryError, a finding as text
        "graphsan.cuda.owners",  # the tensors among all objects, as the pinner scans them
    ),
    "graphsan.cuda": (
        "graphsan.core",
        "graphsan.cuda.context",  # the program's phase and step, user frames
        "graphsan.cuda.tracelog",  # the allocator watch's compiled event source
        "graphsan.cuda.tracelib",  # the same library loaded: its records, on and off, drains
        "graphsan.cuda.tracebuild",  # the same library compiled and cached
        "graphsan.cuda.gputrace",  # the same library's GPU-trace interpreter
        "graphsan.cuda.graphwalk",  # the same library's walk of a graph being captured
        "graphsan.cuda.owners",  # the tensors among all objects (the driver watch's keep-alive)
        "graphsan.cuda.device_reads",  # pointer tables read, as both memory watches read them
        # the allocator watch's parts: its event log's views, allocation sites, wrapped ops
        "graphsan.cuda.allocator_log",
        "graphsan.cuda.sites",
        "graphsan.cuda.storage_ops",
    ),
    # the sanitizer at run time builds and drives the rest
    "graphsan.runtime": (
        "graphsan.core",
        "graphsan.cuda",
        "graphsan.policies",
        "graphsan.report",
        "graphsan.command_line",  # the process's rank
        "graphsan.runtime",
    ),
}
# imports no sanitizer module may make; the CLI alone dispatches `graphsan train|repro` to the lab
NEVER = {"graphsan.lab"}
MAY_IMPORT_LAB = {"graphsan.cli.main"}
# what loads without torch: the analysis, the reports, and what the CLI and plugin read up front
TORCH_FREE = {
    "graphsan.core": True,  # True: the package and everything in it
    "graphsan.report": True,
    "graphsan": False,
    "graphsan.policies": False,
    "graphsan.cli": True,
    "graphsan.command_line": False,
    "graphsan.environment": False,
    # the lab's command lines: help, listings and argument checks
    "graphsan.lab.choices": False,
    "graphsan.lab.models.args": False,
    "graphsan.lab.train.cli": False,
    "graphsan.lab.train.config": False,
    "graphsan.lab.repro.cases": False,
}
# the lab's layers, lowest first: a lab module imports its own layer and those below, and from
# the sanitizer only what a user would (the package, its command-line helpers, its reports) and
# the base of its named choices
LAB_LAYERS = (
    "graphsan.lab.choices",
    "graphsan.lab.quant",
    "graphsan.lab.models",
    "graphsan.lab.train",
    "graphsan.lab.repro",
)
LAB_MAY_USE = ("graphsan.command_line", "graphsan.report", "graphsan.core.choice")
# the entry points that dispatch to the lab: the lab itself never imports them (that would be a
# circle through the CLI); what the lab's commands share with graphsan's is graphsan.command_line
ENTRY_POINTS = {"graphsan.cli", "graphsan.cli.main", "graphsan.cli.pytest_plugin"}


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str) -> set[str]:
    """The modules a file imports (relative imports resolved; `from a import b` names `a.b`
    when that is a module of ours, else `a`)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def sanitizer_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the graphsan modules it imports, for every module outside the lab."""
    files = {module_name(p, src): p for p in (src / "graphsan").rglob("*.py")}
    files = {m: p for m, p in files.items() if not m.startswith("graphsan.lab")}
    graph = {}
    for mod, path in files.items():
        deps = {d for d in imports_of(path, mod) if d.startswith("graphsan")}
        known = {d for d in deps if d in files} | {d for d in deps if d.startswith("graphsan.lab")}
        graph[mod] = {d for d in known if d != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, first repeated last), or None. A package's
    `__init__` importing its own submodules is not a cycle unless a submodule imports back."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if mod not in MAY_IMPORT_LAB and any(
                dep == n or dep.startswith(n + ".") for n in NEVER
            ):
                out.append(f"{mod} imports {dep}: the sanitizer never imports the lab")
                continue
            for pkg, allowed in ALLOWED.items():
                inside = mod == pkg or mod.startswith(pkg + ".")
                ok = any(dep == a or dep.startswith(a + ".") for a in allowed) or dep in (
                    "graphsan",
                    pkg,  # the package itself (its __init__)
                )
                if inside and not ok:
                    out.append(f"{mod} imports {dep}: {pkg} may import only {', '.join(allowed)}")
    return out


def test_imports_go_the_allowed_directions():
    assert violations(sanitizer_graph()) == []


def test_no_import_cycles_among_sanitizer_modules():
    assert find_cycle(sanitizer_graph()) is None


@pytest.mark.parametrize("name", TORCH_FREE)
def test_the_pure_parts_do_not_import_torch(name):
    def chosen(mod: str) -> bool:
        return mod == name or (TORCH_FREE[name] and mod.startswith(name + "."))

    files = [p for p in (SRC / "graphsan").rglob("*.py") if chosen(module_name(p))]
    assert files
    for path in files:
        heavy = {d for d in imports_of(path, module_name(path)) if d.split(".")[0] == "torch"}
        assert not heavy, f"{module_name(path)} imports {sorted(heavy)}"


def whole_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the graphsan modules it imports, the lab included."""
    files = {module_name(p, src): p for p in (src / "graphsan").rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        deps = {d for d in imports_of(path, mod) if d in files}
        # `from pkg import sub` inside pkg names pkg only on the way to its submodule
        deps = {
            d
            for d in deps
            if not (mod.startswith(d + ".") and any(x.startswith(d + ".") for x in deps))
        }
        graph[mod] = deps - {mod}
    return graph


def test_the_lab_never_imports_the_entry_points():
    bad = [
        f"{mod} imports {dep}"
        for mod, deps in sorted(whole_graph().items())
        if mod.startswith("graphsan.lab")
        for dep in sorted(deps & ENTRY_POINTS)
    ]
    assert bad == []


def test_benchmarks_stand_on_the_package_not_on_the_tests():
    root = SRC.parent
    bad = [
        f"{path.relative_to(root)} imports {dep}"
        for path in sorted((root / "bench").glob("*.py"))
        for dep in sorted(imports_of(path, path.stem))
        if dep == "tests" or dep.startswith("tests.")
    ]
    assert bad == []


def test_no_import_cycles_through_the_lab_either():
    assert find_cycle(whole_graph()) is None


def test_the_check_catches_a_forbidden_import_and_a_cycle(tmp_path):
    """Copy the package, add one bad import, and see each check fail."""
    import shutil

    shutil.copytree(SRC / "graphsan", tmp_path / "graphsan", ignore=shutil.ignore_patterns("lab"))
    tracker = tmp_path / "graphsan" / "core" / "tracker.py"
    text = tracker.read_text()
    tracker.write_text(text + "\nfrom graphsan.cuda import driver\n")
    assert any(
        "graphsan.core.tracker imports graphsan.cuda" in v
        for v in violations(sanitizer_graph(tmp_path))
    )
    tracker.write_text(text + "\nimport graphsan.lab.repro\n")
    assert any("never imports the lab" in v for v in violations(sanitizer_graph(tmp_path)))
    records = tmp_path / "graphsan" / "core" / "records.py"
    records.write_text(records.read_text() + "\nfrom graphsan.core.tracker import Tracker\n")
    tracker.write_text(text)
    assert find_cycle(sanitizer_graph(tmp_path)) is not None


def _main_guard_is_last(tree: ast.Module) -> bool:
    guards = [
        i
        for i, node in enumerate(tree.body)
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
    ]
    return all(i == len(tree.body) - 1 for i in guards)


def test_a_main_guard_comes_after_everything_it_may_call():
    """`python -m module` runs the guard where it stands: a function defined below it does not
    exist yet (the prebuild CLI once died with a NameError on the GPU machine this way)."""
    root = SRC.parent
    files = sorted(SRC.rglob("*.py")) + sorted((root / "bench").glob("*.py"))
    late = [
        str(f.relative_to(root)) for f in files if not _main_guard_is_last(ast.parse(f.read_text()))
    ]
    assert late == []
    broken = ast.parse('if __name__ == "__main__":\n    main()\n\ndef main():\n    pass\n')
    assert not _main_guard_is_last(broken)


def test_every_file_the_package_reads_is_shipped():
    """A wheel (`pip install .`, not -e) carries only what package-data names: a source file of
    the compiled tracker left out turns the tracker off in every such install."""
    import fnmatch

    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")

    with open(SRC.parent / "pyproject.toml", "rb") as fh:
        package_data = tomllib.load(fh)["tool"]["setuptools"]["package-data"]
    missing = []
    for path in sorted((SRC / "graphsan").rglob("*")):
        if not path.is_file() or path.suffix in (".py", ".pyc"):
            continue
        rel = path.relative_to(SRC)
        packages = [".".join(rel.parts[:i]) for i in range(len(rel.parts) - 1, 0, -1)]
        if not any(
            fnmatch.fnmatch(str(rel.relative_to(*pkg.split("."))), pattern)
            for pkg in packages
            for pattern in package_data.get(pkg, ())
        ):
            missing.append(str(rel))
    assert not missing, f"not in pyproject's package-data, so not in a wheel: {missing}"


def lab_violations(graph: dict[str, set[str]]) -> list[str]:
    def layer(mod: str) -> int | None:
        for i, name in enumerate(LAB_LAYERS):
            if mod == name or mod.startswith(name + "."):
                return i
        return None

    out = []
    for mod, deps in sorted(graph.items()):
        own = layer(mod)
        if own is None:
            continue
        for dep in sorted(deps):
            theirs = layer(dep)
            if theirs is not None:
                if theirs > own:
                    out.append(f"{mod} imports {dep}: {LAB_LAYERS[theirs]} is above it")
            elif dep not in ("graphsan", "graphsan.lab") and not any(
                dep == a or dep.startswith(a + ".") for a in LAB_MAY_USE
            ):
                out.append(
                    f"{mod} imports {dep}: the lab uses only graphsan, " + ", ".join(LAB_MAY_USE)
                )
    return out


def test_the_lab_imports_down_its_layers_and_only_graphsans_public_parts():
    assert lab_violations(whole_graph()) == []


def test_the_lab_check_catches_an_upward_import_and_a_private_one(tmp_path):
    import shutil

    shutil.copytree(SRC / "graphsan", tmp_path / "graphsan")
    args = tmp_path / "graphsan" / "lab" / "models" / "args.py"
    args.write_text(args.read_text() + "\nfrom graphsan.lab.train import config\n")
    cli = tmp_path / "graphsan" / "lab" / "train" / "cli.py"
    cli.write_text(cli.read_text() + "\nfrom graphsan.runtime.sanitizer import Sanitizer\n")
    found = lab_violations(whole_graph(tmp_path))
    assert any("graphsan.lab.models.args imports graphsan.lab.train" in v for v in found), found
    assert any("graphsan.lab.train.cli imports graphsan.runtime.sanitizer" in v for v in found), (
        found
    )


# a graph's state (core.graph_state.GraphState): its fields and its named transitions
GRAPH_STATE_FIELDS = {
    "dirty",
    "handed_over",
    "order",
    "reads",
    "read_order",
    "own",
    "launched",
    "baked",
}
GRAPH_STATE_TRANSITIONS = {
    "mark_changed",
    "judged",
    "block",
    "went_ahead",
    "drop_own",
    "counted_in",
    "checked_against",
    "hand_over",
    "depends_on",
}
MAY_CHANGE_GRAPH_STATE = {
    "graphsan.core.graph_state",  # the transitions themselves
    "graphsan.core.tracker",  # memory events
    "graphsan.core.judgement",  # replays
}


def graph_state_changes(src: Path = SRC) -> list[str]:
    """Where a sanitizer module outside MAY_CHANGE_GRAPH_STATE assigns a graph state's field or
    calls one of its transitions."""
    out = []
    for path in sorted((src / "graphsan").rglob("*.py")):
        name = module_name(path, src)
        if name.startswith("graphsan.lab") or name in MAY_CHANGE_GRAPH_STATE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Assign):
                targets = [n for target in node.targets for n in ast.walk(target)]
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in GRAPH_STATE_FIELDS:
                    out.append(f"{name}:{node.lineno} assigns .{t.attr}")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in GRAPH_STATE_TRANSITIONS
            ):
                out.append(f"{name}:{node.lineno} calls .{node.func.attr}()")
    return out


def test_only_the_judge_and_the_tracker_change_a_graphs_state():
    assert graph_state_changes() == []


def test_the_graph_state_check_sees_an_assignment_and_a_transition(tmp_path):
    pkg = tmp_path / "graphsan" / "cuda"
    pkg.mkdir(parents=True)
    (pkg / "watch.py").write_text(
        "def f(state, g):\n    state.dirty = True\n    g.reads, g.read_order = True, 1\n"
        "    state.block()\n"
    )
    assert graph_state_changes(tmp_path) == [
        "graphsan.cuda.watch:2 assigns .dirty",
        "graphsan.cuda.watch:3 assigns .reads",
        "graphsan.cuda.watch:3 assigns .read_order",
        "graphsan.cuda.watch:4 calls .block()",
    ]


# the module that keeps graphsan's side object on the program's graphs (one attribute of them)
MAY_TOUCH_A_GRAPHS_ATTRIBUTES = {"graphsan.cuda.hooks"}


def graph_attribute_uses(src: Path = SRC) -> list[str]:
    """Where a module outside `MAY_TOUCH_A_GRAPHS_ATTRIBUTES` reads or writes an object's own
    attributes wholesale (`__dict__`): what graphsan keeps on a program's graph goes through
    `cuda.hooks.side`."""
    out = []
    for path in sorted((src / "graphsan").rglob("*.py")):
        name = module_name(path, src)
        if name.startswith("graphsan.lab") or name in MAY_TOUCH_A_GRAPHS_ATTRIBUTES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            named = getattr(node, "attr", None) or getattr(node, "value", None)
            if isinstance(node, ast.Attribute | ast.Constant) and named == "__dict__":
                out.append(f"{name}:{node.lineno}")
    return out


def test_only_the_hooks_touch_what_graphsan_keeps_on_a_graph():
    assert graph_attribute_uses() == []


def test_the_graph_attribute_check_sees_both_spellings(tmp_path):
    pkg = tmp_path / "graphsan" / "runtime"
    pkg.mkdir(parents=True)
    (pkg / "sanitizer.py").write_text(
        "def f(g):\n    g.__dict__['_x'] = 1\n    return getattr(g, '__dict__')\n"
    )
    assert graph_attribute_uses(tmp_path) == [
        "graphsan.runtime.sanitizer:2",
        "graphsan.runtime.sanitizer:3",
    ]
