"""Ctrl-C during `graphsan train`: the iteration in flight is finished (and saved, where --save
asks for checkpoints) before training stops; a second Ctrl-C stops at once."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class TrainingInterrupted(Exception):
    """Ctrl-C stopped training after `iteration` (the one in flight was finished first);
    `checkpoint` is where it was saved (None without --save)."""

    def __init__(self, iteration: int, checkpoint: str | None):
        saved = f"; checkpoint saved to {checkpoint}" if checkpoint else ""
        super().__init__(f"interrupted after iteration {iteration}{saved}")
        self.iteration, self.checkpoint = iteration, checkpoint


@contextmanager
def stop_after_iteration():
    """Ctrl-C during training asks to stop once the iteration in flight is done (a second one
    stops at once); yields a one-item list that holds True once asked."""
    asked = [False]
    if threading.current_thread() is not threading.main_thread():
        yield asked
        return

    def handler(signum, frame):
        if asked[0]:
            raise KeyboardInterrupt
        asked[0] = True

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield asked
    finally:
        signal.signal(signal.SIGINT, old)
