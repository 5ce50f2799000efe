"""The torch calls graphsan wraps so that the allocator's events can be read right: storage
changes (`resize_`, `resize_as_`, `set_`, `.data =`, `untyped_storage().resize_`), named on the
thread while they run so that a free they cause is known to be a *move*; `empty_cache()`, a
release of cached memory to the driver; and the calls that route eager allocations to a private
pool outside captures (torch.compile's CUDA graph trees, `torch.cuda.use_mem_pool`). Each
wrapper does what the original does and tells an `OpsListener`; `Patches` restores them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

import torch

from graphsan.core.patches import Patches
from graphsan.core.records import PoolId

_op = threading.local()


def current_op() -> str | None:
    """The storage change running on this thread (None outside one)."""
    return getattr(_op, "name", None)


class OpsListener(Protocol):
    def redirected_resize(self, tensor: torch.Tensor, sizes: tuple) -> torch.Tensor | None: ...
    def released(self) -> None: ...
    def route_begins(self, pool: PoolId, per_thread: bool) -> None: ...
    def route_ends(self, pool: PoolId) -> None: ...


def _named(name: str, orig: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        prev = getattr(_op, "name", None)
        _op.name = name
        try:
            return orig(self, *args, **kwargs)
        finally:
            _op.name = prev

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", name)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    return wrapper


def patch_storage_ops(patches: Patches, listener: OpsListener) -> None:
    for name in ("resize_as_", "set_"):
        patches.set(torch.Tensor, name, _named(name, getattr(torch.Tensor, name)))
    tagged_resize = _named("resize_", torch.Tensor.resize_)

    def resize_(tensor, *sizes, **kwargs):
        out = listener.redirected_resize(tensor, sizes)
        return out if out is not None else tagged_resize(tensor, *sizes, **kwargs)

    resize_.__wrapped__ = torch.Tensor.resize_
    resize_.__doc__ = torch.Tensor.resize_.__doc__
    patches.set(torch.Tensor, "resize_", resize_)
    patches.set(
        torch.UntypedStorage, "resize_", _named("storage.resize_", torch.UntypedStorage.resize_)
    )
    base = torch._C.TensorBase.data

    def set_data(self, value):
        prev = getattr(_op, "name", None)
        _op.name = ".data ="
        try:
            base.__set__(self, value)
        finally:
            _op.name = prev

    patches.set(torch.Tensor, "data", property(base.__get__, set_data, doc=base.__doc__))


def patch_empty_cache(patches: Patches, listener: OpsListener) -> None:
    orig = torch.cuda.memory.empty_cache

    def empty_cache() -> None:
        orig()
        listener.released()

    empty_cache.__wrapped__ = orig
    empty_cache.__doc__ = orig.__doc__
    patches.set(torch.cuda.memory, "empty_cache", empty_cache)
    patches.set(torch.cuda, "empty_cache", empty_cache)


def patch_pool_routing(patches: Patches, listener: OpsListener) -> None:
    """Outside captures, eager allocations are routed to a private pool by these calls: a
    segment they make belongs to that pool."""

    def wrap_begin(orig: Callable, per_thread: bool) -> Callable:
        def begin(device, pool, *args, **kwargs):
            listener.route_begins((int(pool[0]), int(pool[1])), per_thread)
            return orig(device, pool, *args, **kwargs)

        begin.__wrapped__ = orig
        return begin

    def wrap_end(orig: Callable) -> Callable:
        def end(device, pool, *args, **kwargs):
            out = orig(device, pool, *args, **kwargs)
            listener.route_ends((int(pool[0]), int(pool[1])))
            return out

        end.__wrapped__ = orig
        return end

    for owner in (torch._C, torch.cuda.memory):
        for name, per_thread in (
            ("_cuda_beginAllocateCurrentThreadToPool", True),
            ("_cuda_beginAllocateToPool", True),
            ("_cuda_beginAllocateCurrentStreamToPool", False),
        ):
            if name in vars(owner):
                patches.set(owner, name, wrap_begin(vars(owner)[name], per_thread))
        if "_cuda_endAllocateToPool" in vars(owner):
            patches.set(
                owner, "_cuda_endAllocateToPool", wrap_end(vars(owner)["_cuda_endAllocateToPool"])
            )
