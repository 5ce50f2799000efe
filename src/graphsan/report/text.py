"""Findings as people read them: a multi-line bug report, one line, short kernel names."""

from __future__ import annotations

import re

from graphsan.core.kinds import Kind
from graphsan.core.records import (
    FREED_BEFORE_CAPTURE,
    FREED_UNSEEN,
    BakedEvidence,
    Finding,
    Frame,
    OrderEvidence,
    Stack,
    frame_text,
)


def one_line(f: Finding) -> str:
    """The finding in one line: kind, graph, kernel, buffer, free site (for the replay order:
    who wrote and who overwrote; for state the graph baked: what it baked, what it is now,
    where it changed)."""
    if f.baked is not None:
        return _baked_line(f, f.baked)
    if f.order is not None:
        what = _order_what(f.kind, f.order)
    else:
        free = frame_text(f.free_stack[-1]) if f.free_stack else no_free_stack(f)
        what = f"freed at {free}"
    return (
        f"{f.kind}: {f.graph.label} node {f.node} {short_kernel(f.kernel)} "
        f"param {f.param}+{f.offset}{_via(f)} -> {f.nbytes} B block at {f.block_address:#x}"
        f" ({f.pool}), {what}{when(f.phase, f.step)}"
        + (f" [{f.caveat.split(' (', 1)[0]}]" if f.caveat else "")
    )


def _order_what(kind: Kind, o: OrderEvidence) -> str:
    if kind is Kind.REPLAY_RACE:
        other = f" on stream {o.streams[1]:#x}" if o.streams else ""
        return f"may run at the same time as graph #{o.written_by}'s replay{other}"
    if kind is Kind.REPLAY_ORDER:
        return f"written by graph #{o.written_by}, overwritten by graph #{o.carved_by}"
    if o.written_by is None:
        return "holds a tensor eager code allocated into the pool, still held by the caller"
    return f"holds graph #{o.written_by}'s output, still held by the caller"


def _baked_names(f: Finding, b: BakedEvidence) -> str:
    """What a finding about baked state names: the switched modules, or the entry."""
    return ", ".join(b.modules) if f.kind is Kind.MODE else b.entry


def _rank(f: Finding) -> str:
    return f"[rank {f.rank}] " if f.rank is not None else ""


def _baked_line(f: Finding, b: BakedEvidence) -> str:
    what = _baked_names(f, b)
    where = f", changed at {frame_text(b.changed_at[-1])}" if b.changed_at else ""
    address = f" (reads {f.block_address:#x})" if f.kind is Kind.SUPERSEDED else ""
    return (
        f"{f.kind}: {f.graph.label} {what}{address}: {b.captured} at capture, {b.current} "
        f"now{where}{when(f.phase, f.step)}"
    )


def _via(f: Finding) -> str:
    return f" via table {f.through:#x}+{f.through_slot}" if f.through is not None else ""


def short_kernel(name: str, limit: int = 60) -> str:
    """A kernel name short enough for one line: drop template arguments and parameters, keep
    the names inside them that say what the kernel computes (functors, `*_kernel_impl`)."""
    base = _strip_templates(name)
    hints = [h for h in dict.fromkeys(_HINT.findall(name)) if h not in base][:2]
    text = f"{base} [{', '.join(hints)}]" if hints else base
    return text if len(text) <= limit else text[: limit - 3] + "..."


# identifiers in template arguments worth keeping: at::native's functors and *_kernel_impl
_HINT = re.compile(r"\b(\w+Functor|\w+_kernel_impl|\w+_kernel_cuda)\b")


def _strip_templates(name: str) -> str:
    out, depth = [], 0
    for ch in name:
        if ch in "<(":
            if depth == 0:
                out.append("<>" if ch == "<" else "")
            depth += 1
        elif ch in ">)":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    text = "".join(out).strip() or name
    return text.removeprefix("void ")


def when(phase: str | None, step: int | None) -> str:
    parts = []
    if phase:
        parts.append(f"phase {phase}")
    if step is not None:
        parts.append(f"step {step}")
    return f" ({', '.join(parts)})" if parts else ""


# A free with no user frames ran inside torch: on autograd's backward threads, which free saved
# tensors with no Python on their stack, or in torch code called from outside any user frame.
NO_FREE_FRAMES = "torch internals (no Python frames of yours: e.g. autograd's backward thread)"


def where_stack(f: Finding) -> Stack:
    """The last stack a finding names: where its memory was freed, or, for state the graph
    baked, where the program changed it (`BakedEvidence.changed_at`)."""
    return f.baked.changed_at if f.baked is not None else f.free_stack


def no_free_stack(f: Finding) -> str:
    if f.free_op == FREED_BEFORE_CAPTURE:
        return "no free seen: the memory was already free when the capture ended"
    if f.free_op == FREED_UNSEEN:
        return (
            "no free seen: the allocator reports none; the driver found it gone before the replay"
        )
    return NO_FREE_FRAMES


def _stack_text(
    frames: list[Frame], indent: str = "      ", empty: str = "not recorded"
) -> list[str]:
    if not frames:
        return [f"{indent}<{empty}>"]
    return [f"{indent}{frame_text(f)}" for f in frames]


def _node_kernel(name: str) -> str:
    """Long demangled names (at::native's lambdas run to a thousand characters) print short;
    the JSON report keeps them whole."""
    if len(name) <= LONG_KERNEL:
        return name
    return (
        f"{short_kernel(name, limit=LONG_KERNEL)} ({len(name)}-character name in the JSON report)"
    )


LONG_KERNEL = 160


def _argument(f: Finding) -> str:
    if f.through is None:
        return f"  argument: param {f.param}, byte offset {f.offset} holds address {f.address:#x}"
    return (
        f"  argument (indirect): param {f.param}, byte offset {f.offset} points at the table "
        f"{f.through:#x}, whose byte {f.through_slot} holds address {f.address:#x}"
    )


def format_finding(f: Finding) -> str:
    """A multi-line bug report for one finding."""
    if f.baked is not None:
        return _format_baked(f, f.baked)
    lines = [
        f"{_rank(f)}{f.kind.upper()}: {f.graph.describe()}",
        f"  node {f.node}: {_node_kernel(f.kernel)}",
        _argument(f),
        f"  memory: block {f.block_address:#x} of {f.nbytes} bytes in the {f.pool}"
        + (f" (+{f.other_nodes} more node(s) of this graph use it)" if f.other_nodes else ""),
    ]
    if f.now:
        lines.append(f"  now: {f.now}")
    lines.append("  allocated at (most recent call last):")
    lines += _stack_text(f.alloc_stack)
    if f.order is not None:
        lines.append(_order_text(f, f.order))
    elif f.free_op == FREED_BEFORE_CAPTURE and not f.free_stack:
        lines.append("  freed: before the capture ended (the graph captured memory already free)")
    elif f.free_op == FREED_UNSEEN and not f.free_stack:
        lines.append(
            f"  freed: before this replay{when(f.phase, f.step)} (the allocator backend reports no "
            "frees; the driver found the allocation gone or replaced, so where it was freed is "
            "unknown)"
        )
    else:
        op = f" by {f.free_op}" if f.free_op else ""
        lines.append(f"  freed{op}{when(f.phase, f.step)} at (most recent call last):")
        lines += _stack_text(f.free_stack, empty=NO_FREE_FRAMES)
    if f.also_used_by:
        lines.append("  also used by:")
        for u in f.also_used_by[:MAX_ALSO]:
            lines.append(
                f"      graph #{u.graph} '{u.label}' node {u.node}: "
                f"{short_kernel(u.kernel)} param {u.param}+{u.offset}"
            )
        if len(f.also_used_by) > MAX_ALSO:
            lines.append(f"      ... and {len(f.also_used_by) - MAX_ALSO} more graph(s)")
    lines.append(f"  likely cause: {f.likely_cause}")
    if f.caveat:
        lines.append(
            f"  caveat: {f.caveat}; the word may sit in a slot of the struct this launch does "
            "not fill (`graphsan selftest` checks this torch)"
        )
    return "\n".join(lines)


MAX_ALSO = 6  # graphs listed under "also used by"; the JSON report keeps them all


def _order_text(f: Finding, o: OrderEvidence) -> str:
    """The line a finding about the replay order has where others say where memory was freed."""
    if f.kind is Kind.REPLAY_RACE:
        mine, theirs = (f"{s:#x}" for s in o.streams) if o.streams else ("?", "?")
        return (
            f"  order: on stream {mine}, with nothing ordering it after graph #{o.written_by}'s "
            f"replay on stream {theirs}, which may still run{when(f.phase, f.step)}"
        )
    if f.kind is Kind.REPLAY_ORDER:
        return (
            f"  order: replayed after graph #{o.carved_by} overwrote the range and before "
            f"graph #{o.written_by} wrote it again{when(f.phase, f.step)}"
        )
    if o.written_by is None:
        return (
            "  order: eager code was handed the memory after the graph's capture; this replay "
            f"would write over it{when(f.phase, f.step)}"
        )
    mine, theirs = (o.replays[1], o.replays[0]) if o.replays else ("?", "?")
    return (
        f"  order: this would be the pool's replay #{mine}; graph #{o.written_by} wrote the "
        f"output at replay #{theirs}, after this graph last ran{when(f.phase, f.step)}"
    )


# what each kind about baked state calls what it names, and where the program changed it
BAKED_LABELS = {
    Kind.MODE: ("modules", "switched"),
    Kind.BAKED_VALUE: ("entry", "changed"),
    Kind.SUPERSEDED: ("entry", "re-pointed"),
}


def _format_baked(f: Finding, b: BakedEvidence) -> str:
    """A finding about state the graph baked at capture: what it names, the value at capture
    and now, and where the program changed it (no block or allocation: no memory was freed)."""
    noun, verb = BAKED_LABELS[f.kind]
    lines = [f"{_rank(f)}{f.kind.upper()}: {f.graph.describe()}"]
    lines.append(f"  {noun}: {_baked_names(f, b)}")
    if f.kind is Kind.SUPERSEDED:
        lines.append(f"  node {f.node}: {_node_kernel(f.kernel)}")
        lines.append(_argument(f))
    lines.append(f"  at capture: {b.captured}")
    lines.append(f"  now: {b.current}")
    if f.now:
        lines.append(f"  which means: {f.now}")
    if b.changed_at:
        lines.append(f"  {verb}{when(f.phase, f.step)} at (most recent call last):")
        lines += _stack_text(b.changed_at)
    else:
        lines.append(
            f"  {verb} before this replay{when(f.phase, f.step)}: by a plain assignment no hook "
            "sees, found by comparing the value at the replay"
        )
    lines.append(f"  likely cause: {f.likely_cause}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- a report's header
def watch_line(watched: bool | None, reason: str | None) -> str | None:
    """Whether graphsan watched (None when it did, or when the report does not say)."""
    if watched is False:
        return (
            f"NOT WATCHED: graphsan stayed idle ({reason or 'no reason recorded'}); no graph "
            "was checked, so the absence of findings means nothing"
        )
    if watched and reason:
        return f"watched until graphsan disabled itself ({reason}); later replays were not checked"
    return None


def provenance_line(prov: dict, loaded: int | None, current: int) -> str:
    """What recorded the report: graphsan (its commit), torch, CUDA, driver, GPU, Python."""
    if not prov:
        older = loaded is not None and loaded < current
        return "recorded with: not recorded" + (
            f" (report schema v{loaded} predates it)" if older else ""
        )
    commit = prov.get("commit")
    parts = [
        f"graphsan {prov.get('graphsan') or '?'}" + (f" (git {commit[:12]})" if commit else ""),
        f"torch {prov.get('torch') or '?'}",
        f"CUDA runtime {prov.get('cuda') or 'none'}",
        f"driver {prov.get('driver') or 'unknown'}",
        f"GPU {prov.get('gpu') or 'none seen'}",
        f"Python {prov.get('python') or '?'}",
    ]
    return "recorded with " + ", ".join(parts)


ATTACHED_SINCE = 9  # the report schema version that records how graphsan attached


def attachment_line(
    prov: dict, allocator_log: str | None, loaded: int | None, current: int
) -> str | None:
    """How graphsan attached (`runtime.attachment`): torch's hooks or the wrapper and which
    seams, the allocator backend, the tracker (with why, from `allocator_log`, where it fell
    back); None for a report that records no provenance at all (`provenance_line` says so)."""
    if not prov:
        return None
    if "attach" not in prov:
        older = loaded is not None and loaded < ATTACHED_SINCE
        return "attached: not recorded" + (
            f" (report schema v{loaded} predates it)" if older else ""
        )
    allocator = f"allocator backend {prov.get('allocator') or 'unknown'}"
    attach, seams = prov.get("attach"), list(prov.get("hooks") or ())
    if attach is None:
        return f"attached: no (graphsan stayed idle); {allocator}"
    if attach == "hooks":
        how = f"attached through torch's hooks ({', '.join(seams)})"
    else:
        with_ = f" (with {', '.join(seams)})" if seams else ""
        how = f"attached by wrapping CUDAGraph's capture and replay{with_}"
    return f"{how}; {allocator}; {_tracker_text(prov.get('tracker'), allocator_log)}"


def _tracker_text(tracker: str | None, log: str | None) -> str:
    """The tracker, with what the allocator log adds after its first word (why it fell back;
    where frees come through)."""
    detail = re.sub(r"^\w+", "", log or "")
    if tracker == "compiled":
        return "tracker compiled" + detail
    if tracker == "snapshots":
        return "tracker snapshots" + detail
    if tracker == "driver":
        return "no tracker: the driver is asked before each replay" + detail
    return "tracker unknown"
