"""The CPU backend with side streams that run their work as late as the engine allows.

A GPU runs side-stream work (follower replays, newest-token backups) whenever it likes after
what the work waits for; the engine must wait on the right event before it reads what that
work writes or overwrites what it reads. On the real backends a missing wait is a race that
shows only with the wrong timing. Here work issued on a side stream is queued and runs only
when something waits on an event recorded after it on that stream (or at `synchronize`): the
latest moment the engine's events allow. A missing wait then reads stale rows or lets a
backup read buffers already rewritten, deterministically.

Work on the default stream runs at once, as with the plain CPU backend. Only the kernels the
engine launches on side streams are deferred (the planned copy and the backup); torch ops it
issues there (a counter update) run at once, which no ordering depends on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hisparse.backends.base import CopyPlannedFn
from hisparse.backends.cpu import CPU_FEATURES, CpuBackend
from hisparse.backends.features import Feature, FeatureTable, supported
from hisparse.kernels.swap_in_reference import backup_newest_reference, copy_planned_reference


class DeferredStream:
    def __init__(self) -> None:
        self.queued: list[Callable[[], None]] = []
        self.done = 0  # how many of `queued` have run

    def run_through(self, count: int) -> None:
        while self.done < count:
            self.queued[self.done]()
            self.done += 1


class DeferredEvent:
    def __init__(self) -> None:
        self.stream: DeferredStream | None = None  # None: recorded on the default stream
        self.mark = 0  # the stream's work issued before the event was recorded


class DeferredStreamCpu(CpuBackend):
    name = "cpu-deferred-streams"
    features = FeatureTable(dict(CPU_FEATURES) | {Feature.ASYNC_BACKUP: supported()})

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[DeferredStream] = []
        self._current: DeferredStream | None = None

    def new_stream(self) -> DeferredStream:
        stream = DeferredStream()
        self.streams.append(stream)
        return stream

    @contextlib.contextmanager
    def stream_scope(self, stream: Any | None) -> Iterator[Any]:
        previous, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = previous

    def new_event(self) -> DeferredEvent:
        return DeferredEvent()

    def record_event(self, event: Any | None, device: torch.device | None = None) -> None:
        event.stream = self._current
        event.mark = len(self._current.queued) if self._current is not None else 0

    def wait_event(self, event: Any | None, device: torch.device | None = None) -> None:
        # Waiting from the default stream runs the event's stream up to the event; a side
        # stream waiting on default-stream work has nothing to wait for (it ran already).
        if event.stream is not None and self._current is None:
            event.stream.run_through(event.mark)
        elif event.stream is not None and event.stream is not self._current:
            # One side stream waiting on another: queue the wait in order.
            self._issue(lambda stream=event.stream, mark=event.mark: stream.run_through(mark))

    def synchronize(self, device: torch.device | None = None) -> None:
        for stream in self.streams:
            stream.run_through(len(stream.queued))

    def pending(self) -> int:
        return sum(len(s.queued) - s.done for s in self.streams)

    def _issue(self, work: Callable[[], None]) -> None:
        if self._current is None:
            work()
        else:
            self._current.queued.append(work)

    def copy_planned_kernel(self) -> CopyPlannedFn:
        def copy_planned(tables: Any, layer: int, plan: Any) -> None:
            self._issue(lambda: copy_planned_reference(tables, layer, plan))
        return copy_planned

    def backup_kernel(self) -> Callable[..., None]:
        def backup(tables: Any, newest_rows: Any, host_rows: Any, num_real: Any) -> None:
            self._issue(lambda: backup_newest_reference(tables, newest_rows, host_rows,
                                                        num_real))
        return backup
