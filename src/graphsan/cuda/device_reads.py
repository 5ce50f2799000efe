"""Small buffers of device memory read from Python (the pointer tables graphs' arguments point
at), as both memory watches read them: on the current stream, after the work queued there."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def read_now(driver: Callable[[], object] | None, spans: Sequence[tuple[int, int]]) -> list[bytes]:
    """The bytes of each (address, size), read through `driver()` (cuda.driver), or empty ones
    where they cannot be read now (no driver, a capture running on this stream, a driver
    error): an unread table hides what it names, nothing more."""
    if not spans or driver is None or torch.cuda.is_current_stream_capturing():
        return [b""] * len(spans)
    driver = driver()
    try:
        return driver.read_device(list(spans), torch.cuda.current_stream().cuda_stream)
    except driver.DriverError:
        return [b""] * len(spans)
