"""What every eager allocation and free pays under graphsan: the GPU-trace callbacks
(`AllocatorWatch._on_alloc`, `_on_free`) fired with fake pointers through torch's own callback
registry, from a synthetic Python stack, as the caching allocator fires them. CPU only.

    PYTHONPATH=src python bench/bench_alloc_callbacks.py [--against REV] [--depth 32] [--ideas]

The stack: `--depth` frames of nested calls (a training loop inside module calls), then one of
three call paths per allocation: a module's forward (three fresh frames), the optimizer's foreach
update (several allocations from one frame) and the autograd engine's worker thread (a bare
thread: nearly no Python frames). Each round allocates `--batch` blocks through a path, then
frees them. Times are this thread's CPU time less that of the same calls into a callback that
does nothing, the median over `--rounds` rounds; the columns are us per call. Every variant runs
once a round, so their ratio holds on a busy machine even where the times themselves move. A
ratio is `-` where either cost is not above the harness's (a cost within its noise, such as a
free's with few rounds): a ratio of such costs would say nothing.

`--against REV` loads that revision's allocator module from git (a file path is read instead,
for trees without git history) and measures it beside the current one; it must load beside the
current package (a revision with today's module layout) and record the same sites. `--ideas` also times the
other site walks considered (bench/alloc_site_walks.py), on the forward path.
"""

from __future__ import annotations

import _thread
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable

import torch
from alloc_site_walks import (
    OuterCache,
    Sampled,
    WalkOnly,
    keyed_loop_aliases,
    outer_cache_mistakes,
    probe_then_unrolled,
    walk_loop,
)
from torch._utils import CallbackRegistry

from graphsan.core.graph_state import WatchedBlock
from graphsan.core.tracker import Tracker
from graphsan.cuda import allocator, sites
from graphsan.cuda.context import Context

BASE = 0x7F00_0000_0000
FAR = BASE + (1 << 40)  # a freed watched segment no benchmark pointer falls in
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raise(err: BaseException) -> None:
    raise err


# -- the call paths ----------------------------------------------------------------------------
def _forward(fire: Callable[[int], None], ptr: int) -> None:
    _module_call(fire, ptr)


def _module_call(fire, ptr):
    return _linear(fire, ptr)


def _linear(fire, ptr):
    fire(ptr)


def _optimizer(fire: Callable[[int], None], ptrs: list[int]) -> None:
    for i in range(0, len(ptrs), 8):
        _foreach(fire, ptrs[i : i + 8])


def _foreach(fire, ptrs):
    for ptr in ptrs:  # one op, a temporary per parameter
        fire(ptr)


def _nest(depth: int, fn: Callable[[], object]) -> object:
    """`fn()` called `depth` frames down, through three alternating functions."""
    if depth <= 0:
        return fn()
    return (_nest_a, _nest_b, _nest_c)[depth % 3](depth - 1, fn)


def _nest_a(depth, fn):
    return _nest(depth, fn)


def _nest_b(depth, fn):
    out = _nest(depth, fn)
    return out


def _nest_c(depth, fn):
    if depth >= 0:
        return _nest(depth, fn)
    return None


def on_bare_thread(fn: Callable[[], object]) -> object:
    """`fn()` on a thread with no Python frame of its own above `fn` (as close as Python gets to
    the autograd engine's worker thread)."""
    out: list = []
    done = threading.Event()

    def run():
        try:
            out.append(fn())
        finally:
            done.set()

    _thread.start_new_thread(run, ())
    done.wait()
    return out[0]


# -- the callbacks measured --------------------------------------------------------------------
class Idle:
    """The harness alone: a callback that does nothing."""

    def __init__(self) -> None:
        self.tracker = Tracker()
        self.sites: dict[int, tuple] = {}

    def _on_alloc(self, ptr: int) -> None:
        pass

    def _on_free(self, ptr: int) -> None:
        pass


def load_revision(rev: str) -> types.ModuleType:
    """The allocator module as of `rev` (a git revision, or a file holding that module where the
    tree has no git history), beside the current one; SystemExit naming `rev` where neither
    gives it."""
    if os.path.isfile(rev):
        with open(rev) as f:
            src = f.read()
        rev = os.path.basename(rev)
    else:
        src = _git_show(rev)
    mod = types.ModuleType(f"graphsan.cuda.allocator_{rev}")
    try:
        exec(compile(src, f"<allocator.py at {rev}>", "exec"), mod.__dict__)
    except ImportError as err:
        raise SystemExit(
            f"--against {rev}: its allocator.py does not load beside the current package ({err}); "
            "expected a revision with the current module layout"
        ) from None
    return mod


def _git_show(rev: str) -> str:
    try:
        src = subprocess.run(
            ["git", "show", f"{rev}:src/graphsan/cuda/allocator.py"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        raise SystemExit(
            f"--against {rev}: cannot read its allocator.py from git ({detail.strip()})"
        ) from None
    return src


def new_watch(module: types.ModuleType, stacks: bool = True):
    watch = module.AllocatorWatch(Tracker(), Context(), _raise, stacks)
    watch._active = True  # the callbacks without torch's GPU trace
    return watch


def freed_segment(tracker: Tracker) -> None:
    """A watched block freed far from the benchmark's pointers: every allocation and free then
    asks the tracker whether it landed in freed memory."""
    tracker.freed_segments[(FAR, 1 << 20)] = {1}
    tracker._index_freed_segments()


def registry(fn: Callable[[int], None]) -> Callable[[int], None]:
    reg = CallbackRegistry("bench")
    reg.add_callback(fn)
    return reg.fire_callbacks


def round_times(watch, path: str, ptrs: list[int], watched: bool) -> tuple[float, float]:
    """One round: us per allocation and per free."""
    alloc, free = registry(watch._on_alloc), registry(watch._on_free)
    live = watch.tracker.live
    if watched:
        blocks = [WatchedBlock(p, 256, (0, 0), (p, 256), [], {1}) for p in ptrs]
    t0 = time.thread_time()
    if path == "optimizer":
        _optimizer(alloc, ptrs)
    else:
        for ptr in ptrs:
            _forward(alloc, ptr)
    t1 = time.thread_time()
    if watched:  # watched again just before its free, for the harness too
        for ptr, wb in zip(ptrs, blocks, strict=True):
            live[ptr] = wb
            free(ptr)
        t2 = time.thread_time()
    else:
        for ptr in ptrs:
            free(ptr)
        t2 = time.thread_time()
    n = len(ptrs)
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def measure(variants: dict[str, object], path: str, args, watched: bool = False) -> dict:
    """{name: (us per allocation, us per free)} of each variant but the first (the harness
    alone, "idle"), less the harness: the median over rounds, each round running every variant
    once, so a slow moment of the machine is paid by all of them."""
    ptrs = [BASE + 512 * i for i in range(args.batch)]
    idle, *names = variants
    diffs: dict[str, list[list[float]]] = {name: [[], []] for name in names}
    for _ in range(args.rounds):
        times = {}
        for name, watch in variants.items():
            times[name] = round_times(watch, path, ptrs, watched)
            if watched:  # each watched free left a freed segment: back to none
                watch.tracker.freed_segments.clear()
                watch.tracker._index_freed_segments()
        for name in names:
            diffs[name][0].append(times[name][0] - times[idle][0])
            diffs[name][1].append(times[name][1] - times[idle][1])
    return {name: (statistics.median(a), statistics.median(f)) for name, (a, f) in diffs.items()}


def run_case(case: dict, modules: dict[str, types.ModuleType], args) -> dict:
    variants: dict[str, object] = {"idle": Idle()}
    for name, module in modules.items():
        watch = variants[name] = new_watch(module, case.get("stacks", True))
        if case.get("freed"):
            freed_segment(watch.tracker)

    def go():
        depth = 0 if case.get("thread") else args.depth
        return _nest(depth, lambda: measure(variants, case["path"], args, case.get("watched")))

    return on_bare_thread(go) if case.get("thread") else go()


CASES = [
    {"name": "forward, depth+4 frames", "path": "forward"},
    {"name": "optimizer foreach", "path": "optimizer"},
    {"name": "worker thread (shallow)", "path": "forward", "thread": True},
    {"name": "forward, freed segments", "path": "forward", "freed": True},
    {"name": "forward, alloc_stacks=False", "path": "forward", "stacks": False},
    {"name": "watched frees (their stack taken)", "path": "forward", "watched": True},
]


def check_same_sites(modules: dict[str, types.ModuleType], args) -> bool:
    """Both modules' watches record the same call path for the same allocations."""
    watches = {name: new_watch(m) for name, m in modules.items()}
    ptrs = [BASE + 512 * i for i in range(args.batch)]

    def record():
        for watch in watches.values():
            alloc = registry(watch._on_alloc)
            for ptr in ptrs:
                _forward(alloc, ptr)
            _optimizer(alloc, [p + 1 for p in ptrs])

    _nest(args.depth, record)
    on_bare_thread(record)
    sites = [w.sites.by_address for w in watches.values()]
    return all(
        s.keys() == sites[0].keys()
        and all(
            len(s[p]) == len(sites[0][p])
            and all(a is b for a, b in zip(s[p][0::2], sites[0][p][0::2], strict=True))
            and s[p][1::2] == sites[0][p][1::2]
            for p in s
        )
        for s in sites
    )


# -- other walks (--ideas; the walks are in alloc_site_walks.py) ------------------------------
def ideas(old: types.ModuleType | None, args) -> None:
    watch = new_watch(allocator)
    walks: dict[str, Callable] = {}
    if old is not None:
        old_watch = new_watch(old)
        walks[f"{args.against}'s walk, interned at once"] = lambda f, _: old_watch.sites.of_frame(f)
    walks["keyed loop, method lookups hoisted"] = keyed_loop_aliases
    walks["plain loop, interned later"] = walk_loop
    walks["unrolled, interned at once"] = lambda f, _: watch.sites.of_frame(f)
    walks["unrolled, interned later (now)"] = lambda f, _: sites.walk(f)
    walks["sys._getframe probe + unrolled"] = probe_then_unrolled
    walks["outer part cached by frame id (unsound)"] = OuterCache()
    walks["unrolled, 12 frames (less information)"] = (lambda walk: lambda f, _: walk(f))(
        sites._unrolled_walk(12)
    )
    walks["every 16th allocation (less information)"] = Sampled(16)
    variants: dict[str, object] = {"idle": Idle()}
    variants.update({name: WalkOnly(walk) for name, walk in walks.items()})
    best = _nest(args.depth, lambda: measure(variants, "forward", args))
    print(f"\nSite walks alone on the forward path (us per allocation, --depth {args.depth}):")
    print("| walk | us |")
    print("|---|---|")
    for name, (a, _) in best.items():
        print(f"| {name} | {a:.3f} |")
    wrong = outer_cache_mistakes(200)
    print(f"outer-part cache: {wrong} of 200 allocations from two callers got the wrong site")


def ratio_cell(now: float, before: float) -> str:
    """`now / before` to three significant digits (a small ratio is not rounded to 0), or `-`
    where either cost is not above the harness's."""
    return f"{now / before:.3g}" if now > 0 and before > 0 else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--against",
        help="git revision (or a copy of its allocator.py) to compare with (default: none)",
    )
    p.add_argument("--depth", type=int, default=32, help="frames above the call paths")
    p.add_argument("--batch", type=int, default=64, help="blocks allocated, then freed, a round")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--ideas", action="store_true", help="also time the other site walks")
    args = p.parse_args()
    for name, least in (("depth", 0), ("batch", 1), ("rounds", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name} must be at least {least}, got {getattr(args, name)}")
    modules: dict[str, types.ModuleType] = {}
    old = None
    if args.against is not None:
        old = load_revision(args.against)
    if old is not None:
        modules[f"before ({args.against})"] = old
    modules["now"] = allocator
    print(
        f"# {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}, depth {args.depth}, batch {args.batch}, "
        f"rounds {args.rounds}, INTERN_BATCH {sites.INTERN_BATCH}"
    )
    if old is not None:
        same = check_same_sites(modules, args)
        print(f"sites the same as {args.against}'s: {'yes' if same else 'NO'}")
        if not same:
            sys.exit(1)
    names = list(modules)
    head = " | ".join(f"{n} alloc | {n} free" for n in names)
    ratio = " | alloc now/before | free now/before" if old is not None else ""
    print(f"| case | {head}{ratio} |")
    print("|---|" + "---|" * (2 * len(names) + (2 if old is not None else 0)))
    for case in CASES:
        res = run_case(case, modules, args)
        cells = " | ".join(f"{res[n][0]:.3f} | {res[n][1]:.3f}" for n in names)
        if old is not None:
            (a0, f0), (a1, f1) = res[names[0]], res[names[1]]
            cells += f" | {ratio_cell(a1, a0)} | {ratio_cell(f1, f0)}"
        print(f"| {case['name']} | {cells} |")
    if args.ideas:
        ideas(old, args)


if __name__ == "__main__":
    main()
