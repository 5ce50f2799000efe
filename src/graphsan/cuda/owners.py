"""What graphsan asks of Python's garbage collector: its objects, the tensors among them and the
storages they hold (what the pin policy pins, what the driver watch keeps alive and which pinned
host tensors a graph copies from are found this way, for memory whose Python owner graphsan did
not see being made), and a pause of its collections while graphsan works inside a capture.

Two rules keep a scan of every object out of the program's way:
- An object is judged by its type alone. `isinstance` would ask an object that is not an
  instance for its `__class__`, which runs the program's own code on arbitrary objects (lazy
  proxies, deprecated module attributes that warn).
- No list of the collector's objects that holds an exact tuple outlives one C-level call. Another
  thread may be suspended half way through `tuple(generator)`; CPython grows that tuple in place
  and fails with a SystemError if anything else references it when it resumes. `gc_objects`
  lists, filters and drops the collector's lists in one call that runs no Python code, with
  collections paused, so no thread can run while such a reference exists.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import threading
from collections.abc import Iterable, Iterator

import torch


def gc_instances(cls: type, *generations: int) -> list:
    """The objects the garbage collector tracks, in all generations or in `generations`, whose
    type is `cls` or a subclass of it (judged by type alone). `cls` may not be tuple or a base of
    it: holding a tuple can break another thread's tuple build."""
    if not isinstance(cls, type) or issubclass(tuple, cls):
        raise ValueError(
            f"gc_instances: expected a class that is not tuple or a base of it, got {cls!r}"
        )
    # one call of `list`, in C (`type.__subclasscheck__` on two classes runs no Python code):
    # each of the collector's lists is split in two (`tee`, made after the list, so it is not in
    # it), `compress` keeps an object of the first half where the second half's type passes;
    # `halves` is read in turn by both arguments of the outer `map`
    halves = itertools.chain.from_iterable(
        map(itertools.tee, map(gc.get_objects, generations or (None,)))
    )
    keep = functools.partial(type.__subclasscheck__, cls)
    selectors = map(map, itertools.repeat(keep), map(map, itertools.repeat(type), halves))
    with no_collection():
        return list(itertools.chain.from_iterable(map(itertools.compress, halves, selectors)))


def gc_tensors(*generations: int) -> list:
    """The tensors among the collector's objects (all generations, or `generations`)."""
    return gc_instances(torch.Tensor, *generations)


_PAUSE = threading.Lock()
_paused = {"depth": 0, "was": False}  # captures on several threads share one collector


@contextlib.contextmanager
def no_collection():
    """No garbage collection starts while graphsan works inside the program's open capture (or
    lists the collector's objects): what graphsan keeps there counts towards the collector's
    thresholds, and a collection in a capture can destroy an unreachable graph of the program,
    which invalidates the capture. The collector is left as it was found, once the last thread
    inside is done; what was due runs at the next allocation after."""
    with _PAUSE:
        if _paused["depth"] == 0:
            _paused["was"] = gc.isenabled()
            gc.disable()
        _paused["depth"] += 1
    try:
        yield
    finally:
        with _PAUSE:
            _paused["depth"] -= 1
            if _paused["depth"] == 0 and _paused["was"]:
                gc.enable()


def storages_of(
    tensors: Iterable[torch.Tensor], device_type: str
) -> Iterator[tuple[object, object]]:
    """(tensor, its untyped storage) for each of `tensors` on `device_type`; tensors without a
    storage (fake, sparse, meta) are passed over."""
    for obj in tensors:
        try:
            if obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError, AttributeError):
            continue
        yield obj, storage
