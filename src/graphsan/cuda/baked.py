"""What a graph bakes at capture beside addresses, recorded while it is captured and watched
after (the torch side of `core.baked`).

While a capture runs on a thread, two of torch's global hooks, installed for the captures only,
list what it runs: each module whose forward it calls (`register_module_forward_pre_hook`) and
each optimizer whose step it calls, with its param groups as they are then
(`register_optimizer_step_pre_hook`, which every `torch.optim` optimizer and subclass calling the
base class's step machinery runs). At the capture's end `baked` keeps, for the graph:
- the modules among them whose behaviour depends on the mode (dropout with p > 0, batch norm
  with running statistics, or a forward whose code reads `training`: what it misses is in
  docs/coverage.md), with the mode each had;
- every hyperparameter (a key of the optimizer's `defaults`) that was a Python number (or a
  tuple of them; flags are not);
- every module parameter or buffer, and every param-group tensor, whose memory the graph reads.

After the capture, `.train()`/`.eval()` calls (through `cuda.context`) and torch's parameter
and buffer registration hooks tell it when a module a graph depends on changes: it remembers
where (`change_of`) and marks the graph to be judged. A param group is a plain dict nobody sees
change: the judge looks at its few entries on every replay (`core.baked.Baked.changed`).
"""

from __future__ import annotations

import bisect
import operator
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graphsan.core.baked import Baked, Change, EntryDep, ModeDep, ValueDep
from graphsan.core.graph_state import GraphState
from graphsan.core.records import GraphId
from graphsan.core.tracker import Tracker
from graphsan.cuda.context import Context, python_stack

_PARAMS = "params"  # a param group's tensors: their re-pointing is not judged (coverage.md)


@dataclass
class Recording:
    """What one capture ran: its modules in call order, and the optimizers it stepped with
    their param groups as they were then (copies of the dicts)."""

    gid: GraphId
    modules: dict[int, object] = field(default_factory=dict)  # id -> module
    optimizers: dict[int, tuple[object, list[dict]]] = field(default_factory=dict)


def mode_dependent(module: object) -> bool:
    """Whether a module replays differently in train and eval mode: dropout with p > 0, batch
    norm that keeps running statistics, or a forward whose code reads `training`."""
    nn = torch.nn.modules
    if isinstance(module, nn.dropout._DropoutNd):
        return float(module.p) > 0
    if isinstance(module, nn.batchnorm._NormBase):
        return bool(module.track_running_stats)
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    return code is not None and "training" in code.co_names


def _number(value: object) -> bool:
    """A Python number a kernel takes by value (bools are flags, not values)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    return isinstance(value, tuple | list) and bool(value) and all(_number(v) for v in value)


def _tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


class ByIdentity:
    """A map keyed by objects' identity that forgets an object once it is collected. (A
    WeakKeyDictionary hashes its keys, and a module that defines `__eq__` without `__hash__`,
    as an `eq=True` dataclass does, has none.)"""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, object]] = {}  # id -> (the object, value)

    def __bool__(self) -> bool:
        return bool(self._items)

    def get(self, obj: object, default: object = None) -> object:
        item = self._items.get(id(obj))
        return item[1] if item is not None and item[0]() is obj else default

    def setdefault(self, obj: object, default: object) -> object:
        item = self._items.get(id(obj))
        if item is not None and item[0]() is obj:
            return item[1]
        key, items = id(obj), self._items

        def gone(ref: weakref.ref) -> None:  # the object was collected: its id may come back
            if items.get(key, (None,))[0] is ref:
                del items[key]

        items[key] = (weakref.ref(obj, gone), default)
        return default

    def pop(self, obj: object) -> None:
        item = self._items.get(id(obj))
        if item is not None and item[0]() is obj:
            del self._items[id(obj)]

    def items(self) -> list[tuple[object, object]]:
        """The live objects and their values, as a list (the map may change meanwhile)."""
        pairs = [(ref(), value) for ref, value in list(self._items.values())]
        return [(obj, value) for obj, value in pairs if obj is not None]


class BakedRecorder:
    """Records what captures bake and watches it after (see the module)."""

    def __init__(
        self, context: Context, tracker: Tracker, on_error: Callable[[BaseException], None]
    ) -> None:
        self.context, self.tracker, self.on_error = context, tracker, on_error
        self._local = threading.local()  # .recordings: this thread's captures in flight
        self._lock = threading.Lock()
        self._recording = 0  # captures in flight on every thread
        self._capture_hooks: list = []  # the forward and step hooks, while one is in flight
        self._hooks: list = []  # the registration hooks, while started
        # the modules graphs depend on -> their graphs, and where each last changed
        self._graphs_of = ByIdentity()
        self._changes = ByIdentity()
        self._modes_of = ByIdentity()  # mode-dependent modules -> {graph: training at capture}

    # -- start / stop ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._hooks:
            return
        module = torch.nn.modules.module
        self._hooks = [
            module.register_module_parameter_registration_hook(self._registered),
            module.register_module_buffer_registration_hook(self._registered),
        ]
        self.context.on_mode_switch.append(self._switched)

    def stop(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()
        if self._switched in self.context.on_mode_switch:
            self.context.on_mode_switch.remove(self._switched)
        with self._lock:
            self._recording = 0
            self._remove_capture_hooks()

    # -- a capture ----------------------------------------------------------------------------
    def begin(self, gid: GraphId) -> None:
        """A capture began on this thread: list what it runs until `end`."""
        stack = getattr(self._local, "recordings", None)
        if stack is None:
            stack = self._local.recordings = []
        stack.append(Recording(gid))
        with self._lock:
            self._recording += 1
            if not self._capture_hooks:
                from torch.optim import optimizer

                self._capture_hooks = [
                    torch.nn.modules.module.register_module_forward_pre_hook(self._forward),
                    optimizer.register_optimizer_step_pre_hook(self._step),
                ]

    def end(self, gid: GraphId) -> Recording | None:
        """The capture ended (or failed): what it ran; the hooks go with the last capture."""
        stack = getattr(self._local, "recordings", None) or []
        found = next((r for r in reversed(stack) if r.gid == gid), None)
        if found is None:
            return None
        stack.remove(found)
        with self._lock:
            self._recording = max(0, self._recording - 1)
            if not self._recording:
                self._remove_capture_hooks()
        return found

    def _remove_capture_hooks(self) -> None:
        while self._capture_hooks:
            self._capture_hooks.pop().remove()

    # the hooks below run inside the program's own calls: what fails in them disables graphsan
    # (on_error), never the call
    def _forward(self, module, args) -> None:
        stack = getattr(self._local, "recordings", None)
        if stack:
            stack[-1].modules.setdefault(id(module), module)

    def _step(self, optimizer, args, kwargs) -> None:
        try:
            stack = getattr(self._local, "recordings", None)
            if stack and id(optimizer) not in stack[-1].optimizers:
                groups = [dict(g) for g in getattr(optimizer, "param_groups", ())]
                stack[-1].optimizers[id(optimizer)] = (optimizer, groups)
        except Exception as err:
            self.on_error(err)

    # -- what the graph baked -------------------------------------------------------------------
    def baked(self, recording: Recording | None, state: GraphState) -> Baked | None:
        """The graph's dependencies, from what its capture ran and what it references."""
        if recording is None or not (recording.modules or recording.optimizers):
            return None
        names = _qualified_names(list(recording.modules.values()))
        blocks = sorted((wb.address, wb.size) for wb in state.blocks.values())
        modes, entries, values = [], [], []
        for module in recording.modules.values():
            name = names[id(module)]
            if mode_dependent(module):
                modes.append(ModeDep(weakref.ref(module), name, bool(module.training)))
            for table in ("_parameters", "_buffers"):
                for key, tensor in (getattr(module, table, None) or {}).items():
                    e = _entry(state, blocks, module, key, tensor, f"{name}.{key}", polled=False)
                    if e is not None:
                        entries.append(e)
        for optimizer, groups in recording.optimizers.values():
            opt_name = type(optimizer).__name__
            # the optimizer's own hyperparameters: keys a program or a scheduler adds to a
            # group (initial_lr, Megatron's lr_mult) are not what the step reads
            own = getattr(optimizer, "defaults", None) or {}
            for i, group in enumerate(groups):
                for key, value in group.items():
                    entry = f"{opt_name}.param_groups[{i}][{key!r}]"
                    if key == _PARAMS or key not in own:
                        continue
                    if _number(value):
                        values.append(ValueDep(weakref.ref(optimizer), i, key, value, entry))
                    elif _tensor(value):
                        e = _group_entry(state, blocks, optimizer, i, key, value, entry)
                        if e is not None:
                            entries.append(e)
        baked = Baked(modes, values, entries)
        if not baked:
            return None
        with self._lock:
            for owner in [d.module() for d in modes] + [e.owner() for e in entries if not e.polled]:
                if owner is not None:
                    self._graphs_of.setdefault(owner, set()).add(state.info.id)
            for d in modes:
                module = d.module()
                if module is not None:
                    self._modes_of.setdefault(module, {})[state.info.id] = d.training
        return baked

    def forget(self, gid: GraphId) -> None:
        """The graph is gone: nothing it depended on is watched for it any more."""
        with self._lock:
            for owner, gids in self._graphs_of.items():
                gids.discard(gid)
                if not gids:
                    self._graphs_of.pop(owner)
            for module, modes in self._modes_of.items():
                modes.pop(gid, None)
                if not modes:
                    self._modes_of.pop(module)

    # -- changes after the capture ------------------------------------------------------------
    def change_of(self, owner: object, name: str | None) -> Change | None:
        """Where the owner's mode (`name` None) or entry last changed, as a hook saw it."""
        return None if owner is None else self._changes.get(owner, {}).get(name)

    def captured_in(self, module: object, training: bool) -> bool:
        """Whether a live graph captured `module` in that mode (the program keeps a graph per
        mode and picks one by replaying it)."""
        modes = self._modes_of.get(module)
        return bool(modes) and training in modes.values()

    def _switched(self, module, mode: bool) -> None:
        try:
            gids = self._graphs_of.get(module) if self._graphs_of else None
            if gids and bool(getattr(module, "training", mode)) != mode:
                self._note(module, None, gids, self.context.switch_site())
        except Exception as err:
            self.on_error(err)

    def _registered(self, module, name, value):
        try:
            gids = self._graphs_of.get(module) if self._graphs_of else None
            if gids:
                self._note(module, name, gids, tuple(python_stack()))
        except Exception as err:
            self.on_error(err)
        return None  # the value stays as given

    def _note(self, owner, name, gids, stack) -> None:
        phase, step = self.context.current()
        self._changes.setdefault(owner, {})[name] = Change(tuple(stack), phase, step)
        for gid in list(gids):
            self.tracker.recheck(gid)


def _qualified_names(modules: list) -> dict[int, str]:
    """A name for each module the capture ran: its path from the outermost module that ran
    (named by its class), as `HybridLM.layers.3.mlp`."""
    ran = {id(m) for m in modules}
    parent: dict[int, tuple[object, str]] = {}
    for m in modules:
        for child_name, child in m.named_children():
            if id(child) in ran:
                parent[id(child)] = (m, child_name)
    out: dict[int, str] = {}
    for m in modules:
        path, node = [], m
        while id(node) in parent and len(path) < 64:
            node, step = parent[id(node)]
            path.append(step)
        out[id(m)] = ".".join([type(node).__name__, *reversed(path)])
    return out


def _read_in(blocks: list[tuple[int, int]], address: int) -> tuple[int, int] | None:
    """The watched block (address, size) holding `address`."""
    i = bisect.bisect_right(blocks, (address, float("inf"))) - 1
    if i >= 0 and address < blocks[i][0] + blocks[i][1]:
        return blocks[i]
    return None


def _entry(state, blocks, owner, key, tensor, entry, polled, read=None) -> EntryDep | None:
    """The entry's tensor, where the graph reads its memory (its first reference into it)."""
    if not _tensor(tensor) or tensor.is_meta:
        return None
    try:
        address, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return None
    block = _read_in(blocks, address)
    if block is None:
        return None
    refs = state.refs.get(block[0])
    if not refs:
        return None
    return EntryDep(
        weakref.ref(owner),
        read or operator.attrgetter(key),
        weakref.ref(tensor),
        entry,
        key,
        refs[0],
        nbytes,
        polled,
    )


def _group_entry(state, blocks, optimizer, index, key, tensor, entry) -> EntryDep | None:
    def read(opt, index=index, key=key):
        return opt.param_groups[index][key]

    return _entry(state, blocks, optimizer, key, tensor, entry, polled=True, read=read)
