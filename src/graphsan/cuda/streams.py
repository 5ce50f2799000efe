"""The orderings a program gives its CUDA streams, as graphsan sees them, fed to the pure model
(`core.streams.StreamOrder`).

Wrapped while graphsan runs (each wrapper does what the original does, then tells the model):
- `torch.cuda.Event.record` and `Event.wait` (`Stream.record_event`, `Stream.wait_event` and
  `Stream.wait_stream` go through them);
- `Event.synchronize`, `Stream.synchronize` and `torch.cuda.synchronize()` (through
  `torch._C._cuda_synchronize`, which it calls), where the host waits.

Not seen: orderings made below Python (NCCL's internal streams, a C++ extension's or
cuda-python's `cudaStreamWaitEvent`, a host wait inside a library), the device-generic
`torch.Stream` and `torch.Event`, and the implicit waits of a copy to the host (`.item()`,
`.cpu()`). Where one of them orders two replays, graphsan asks the earlier replay's stream
whether it is idle before it speaks (`busy`); a race it still finds says that an ordering it
cannot see may exist. Calls made on a stream while it captures are part of the graph being
captured, not an order between replays, and are left out.

A stream is named (device, stream id), an event by its identity until it is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from graphsan.core.patches import Patches
from graphsan.core.races import Races
from graphsan.core.streams import StreamKey


def stream_key(stream) -> StreamKey:
    """(device, stream id) of a `torch.cuda.Stream`."""
    return (int(stream.device_index), int(stream.stream_id))


def current_stream_key() -> StreamKey:
    """The current stream's key, without making a `Stream` object."""
    device = torch.cuda.current_device()
    sid, dev, _ = torch._C._cuda_getCurrentStream(device)
    return (int(dev), int(sid))


def busy(key: StreamKey) -> bool:
    """Whether the stream still has work queued or running (the device's answer; a stream
    that cannot be asked counts as busy)."""
    device, sid = key
    try:
        stream = torch.cuda.Stream(stream_id=sid, device_index=device, device_type=1)
        return not stream.query()
    except Exception:
        return True


class StreamWatch:
    """Feeds `races.ordering` from the wrapped calls (see the module), holding `races.lock`, which
    the replay path holds too. What fails in a wrapper goes to `on_error`, never to the
    program's call."""

    def __init__(
        self,
        races: Races,
        on_error: Callable[[BaseException], None],
        capturing: Callable[[int], bool] = lambda handle: False,
    ) -> None:
        self.ordering, self.lock = races.ordering, races.lock
        self.on_error = on_error
        self.capturing = capturing  # whether a watched capture runs on a stream (its handle)
        self._patches = Patches()
        self._forgetting: dict[int, weakref.finalize] = {}  # events the model keeps a clock of

    def start(self) -> None:
        if self._patches:
            return
        watch = self
        event_cls, stream_cls = torch.cuda.Event, torch.cuda.Stream
        orig_record, orig_wait = event_cls.record, event_cls.wait
        orig_event_sync, orig_stream_sync = event_cls.synchronize, stream_cls.synchronize
        orig_device_sync = getattr(torch._C, "_cuda_synchronize", None)  # None: a CPU build

        def record(event, stream=None):
            result = orig_record(event, stream)
            watch._tell(watch._recorded, event, stream)
            return result

        def wait(event, stream=None):
            result = orig_wait(event, stream)
            watch._tell(watch._waited, event, stream)
            return result

        def event_synchronize(event):
            result = orig_event_sync(event)
            watch._tell(lambda: watch.ordering.host_waited_for_event(id(event)))
            return result

        def stream_synchronize(stream):
            result = orig_stream_sync(stream)
            watch._tell(lambda: watch.ordering.host_waited_for_stream(stream_key(stream)))
            return result

        def device_synchronize(*args, **kwargs):
            result = orig_device_sync(*args, **kwargs)
            device = torch.cuda.current_device()
            watch._tell(lambda: watch.ordering.host_waited_for_all(lambda key: key[0] == device))
            return result

        for fn, orig in (
            (record, orig_record),
            (wait, orig_wait),
            (event_synchronize, orig_event_sync),
            (stream_synchronize, orig_stream_sync),
        ):
            fn.__wrapped__ = orig
            fn.__doc__ = orig.__doc__
        self._patches.set(event_cls, "record", record)
        self._patches.set(event_cls, "wait", wait)
        self._patches.set(event_cls, "synchronize", event_synchronize)
        self._patches.set(stream_cls, "synchronize", stream_synchronize)
        if orig_device_sync is not None:
            self._patches.set(torch._C, "_cuda_synchronize", device_synchronize)

    def stop(self) -> None:
        self._patches.restore()
        for fin in self._forgetting.values():
            fin.detach()
        self._forgetting.clear()

    # -- the wrappers' reports ---------------------------------------------------------------
    def _tell(self, what: Callable, *args) -> None:
        try:
            with self.lock:
                what(*args)
        except Exception as err:  # graphsan's own failure: it disables itself, the call went on
            self.on_error(err)

    def _target(self, stream) -> StreamKey | None:
        """The stream a call names (the current one where none), None while it captures."""
        if stream is None:
            if torch.cuda.is_current_stream_capturing():
                return None
            return current_stream_key()
        if self.capturing(int(stream.cuda_stream)):
            return None
        return stream_key(stream)

    def _recorded(self, event, stream) -> None:
        key = self._target(stream)
        if key is None:
            return
        self.ordering.recorded(id(event), key)
        if id(event) not in self._forgetting:
            self._forgetting[id(event)] = weakref.finalize(event, self._forget, id(event))

    def _waited(self, event, stream) -> None:
        key = self._target(stream)
        if key is not None:
            self.ordering.waited(key, id(event))

    def _forget(self, event_id: int) -> None:
        with self.lock:
            self.ordering.forget_event(event_id)
            self._forgetting.pop(event_id, None)


class DeviceStreams:
    """The device's answers about its streams (`core.streams.Streams`)."""

    @staticmethod
    def current() -> StreamKey:
        return current_stream_key()

    @staticmethod
    def busy(stream: StreamKey) -> bool:
        return busy(stream)
