"""How graphsan attached to PyTorch, as a report's provenance records it:

- `attach`: "hooks" where it took torch's graph hooks (`cuda.hooks.Seams`), "wrapper" where it
  wraps `torch.cuda.CUDAGraph`'s capture_end, replay and reset; None where it never attached
  (graphsan stayed idle);
- `hooks`: the seams of torch it used (`Seams.names()`);
- `allocator`: the CUDA allocator backend torch runs ("native", "cudaMallocAsync"; None where
  this torch cannot say);
- `tracker`: where the allocator's events come from: "compiled" (graphsan's compiled tracker),
  "snapshots" (the allocator's memory history, the fallback) or "driver" (a backend without a
  block map: the driver is asked before each replay); None where it never attached.

The report's `allocator_log` says why the fallback was taken; `graphsan report` and
`graphsan selftest` print all of it in one line (`report.text.attachment_line`).
"""

from __future__ import annotations

import contextlib
from typing import Any

FIELDS = ("attach", "hooks", "allocator", "tracker")


def allocator_backend() -> str | None:
    """The allocator backend torch reports (None on a CPU build, or where it cannot say)."""
    with contextlib.suppress(Exception):
        import torch

        return str(torch.cuda.get_allocator_backend())
    return None


def of(seams, memory, attached: bool) -> dict[str, Any]:
    """The provenance fields of a sanitizer: its hooks' `seams`, its allocator watch `memory`
    (`cuda.allocator.AllocatorWatch` or `cuda.driverwatch.DriverWatch`), and whether it
    attached (its start() got as far as installing the hooks)."""
    if not attached:
        return {"attach": None, "hooks": None, "allocator": allocator_backend(), "tracker": None}
    return {
        "attach": "hooks" if seams.hooks else "wrapper",
        "hooks": seams.names(),
        "allocator": allocator_backend(),
        "tracker": tracker_of(memory),
    }


def tracker_of(memory) -> str | None:
    """Where `memory`'s allocator events come from (None: its watch never started)."""
    from graphsan.cuda import driverwatch

    if isinstance(memory, driverwatch.DriverWatch):
        return "driver"
    if memory.tracelog is not None:
        return "compiled"
    return "snapshots" if memory.tracelog_reason is not None else None


def here() -> tuple[dict[str, Any], str]:
    """What a sanitizer started in this process would attach with, and its allocator log
    (`Report.allocator_log`'s words), for `graphsan selftest`'s header. The compiled tracker is
    opened as a sanitizer opens it (attached to this process's allocator; a cold cache starts
    its build in the background, which the runs after would start anyway)."""
    from graphsan.cuda import driverwatch, tracelog
    from graphsan.cuda.hooks import Seams

    seams = Seams.detect()
    backend = allocator_backend()
    fields = {"attach": "hooks" if seams.hooks else "wrapper", "hooks": seams.names()}
    fields["allocator"] = backend
    if driverwatch.backend() != "native":
        return fields | {"tracker": "driver"}, f"driver ({driverwatch.no_block_map()})"
    log, why = tracelog.open_log()
    if log is not None:
        return fields | {"tracker": "compiled"}, "tracker"
    return fields | {"tracker": "snapshots"}, f"snapshot ({why})"
