"""The tensors among the process's objects and the storages they hold: what the pin policy
pins and what the driver watch keeps alive are found this way (a scan of the garbage
collector's objects, for memory whose Python owner graphsan did not see being made)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def storages_of(objects: Iterable[object], device_type: str) -> Iterator[tuple[object, object]]:
    """(tensor, its untyped storage) for each tensor on `device_type` among `objects`; tensors
    without a storage (fake, sparse, meta) are passed over."""
    tensor_types: dict[type, bool] = {}
    for obj in objects:
        t = type(obj)
        is_tensor = tensor_types.get(t)
        if is_tensor is None:
            is_tensor = tensor_types[t] = issubclass(t, torch.Tensor)
        if not is_tensor:
            continue
        try:
            if obj.device.type != device_type:
                continue
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError, AttributeError):
            continue
        yield obj, storage
