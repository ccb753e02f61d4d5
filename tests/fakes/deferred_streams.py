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

A default-stream kernel is in order with everything after it on that stream, but the host
learns that it finished only from `synchronize` or an event recorded after it. So the host rows
a default-stream swap-in or replay read stay "pending" until then; the CPU may not rewrite
them before (a prefill or a transfer engine into rows a finish just freed: the engine drains
first). Each pending read keeps a copy of the bytes it read; when the host learns the kernel
is done, rows whose bytes changed in the meantime are a race the GPU could have hit, listed
in `host_races`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hisparse.backends.base import CopyPlannedFn, KernelSet, SwapInFn
from hisparse.backends.cpu import CPU_FEATURES, CpuBackend
from hisparse.backends.features import Feature, FeatureTable, supported
from hisparse.backends.kernel_set import reference_kernels
from hisparse.kernels.backup_reference import backup_newest_reference
from hisparse.kernels.swap_in.reference import copy_planned_reference, swap_in_reference
from hisparse.layout.tables import CacheTables, MissPlan


class DeferredStream:
    def __init__(self) -> None:
        self.queued: list[Callable[[], None]] = []
        self.done = 0  # how many of `queued` have run

    def run_through(self, count: int) -> None:
        while self.done < count:
            self.queued[self.done]()
            self.done += 1


@dataclass
class PendingRead:
    """Host rows a default-stream kernel read, until the host learns that it finished."""

    sequence: int  # the kernel's place among the default stream's kernels
    what: str
    host: torch.Tensor  # the layer's host rows
    rows: torch.Tensor  # int64 rows it read
    read: torch.Tensor  # their bytes then


class DeferredEvent:
    def __init__(self, backend: DeferredStreamCpu) -> None:
        self.backend = backend
        self.stream: DeferredStream | None = None  # None: recorded on the default stream
        self.mark = 0  # the stream's work issued before the event was recorded

    def synchronize(self) -> None:
        """The host waits for the event: the work before it on its stream is done."""
        if self.stream is not None:
            self.stream.run_through(self.mark)
        else:
            self.backend.retire_reads(self.mark)


class DeferredStreamCpu(CpuBackend):
    name = "cpu-deferred-streams"
    features = FeatureTable(dict(CPU_FEATURES) | {Feature.ASYNC_BACKUP: supported()})

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[DeferredStream] = []
        self._current: DeferredStream | None = None
        self.default_kernels = 0  # kernels issued on the default stream so far
        self.pending_reads: list[PendingRead] = []
        self.host_races: list[str] = []

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
        return DeferredEvent(self)

    def record_event(self, event: Any | None, device: torch.device | None = None) -> None:
        event.stream = self._current
        event.mark = (len(self._current.queued) if self._current is not None
                      else self.default_kernels)

    def wait_event(self, event: Any | None, device: torch.device | None = None) -> None:
        # Waiting from the default stream runs the event's stream up to the event; a side
        # stream waiting on default-stream work has nothing to wait for (it ran already).
        if event.stream is not None and self._current is None:
            event.stream.run_through(event.mark)
        elif event.stream is not None and event.stream is not self._current:
            # One side stream waiting on another: queue the wait in order.
            self._issue(lambda stream=event.stream, mark=event.mark: stream.run_through(mark))

    def synchronize_event(self, event: Any | None) -> None:
        event.synchronize()

    def synchronize(self, device: torch.device | None = None) -> None:
        for stream in self.streams:
            stream.run_through(len(stream.queued))
        self.retire_reads(self.default_kernels)

    def retire_reads(self, through: int) -> None:
        """The default stream's kernels up to `through` are known to be done: check that the
        host rows they read still hold what they read."""
        for read in [r for r in self.pending_reads if r.sequence <= through]:
            self.pending_reads.remove(read)
            changed = (read.host[read.rows] != read.read).any(dim=1)
            if changed.any():
                self.host_races.append(
                    f"{read.what}: host rows {read.rows[changed].tolist()} were rewritten "
                    "before the host knew the kernel reading them was done")

    def _note_read(self, what: str, tables: CacheTables, layer: int, plan: MissPlan) -> None:
        self.default_kernels += 1
        counts = plan.count.tolist()
        rows = torch.cat([plan.src[b, :c] for b, c in enumerate(counts)]).long()
        host = tables.host_kv[layer]
        self.pending_reads.append(PendingRead(self.default_kernels, what, host, rows,
                                              host[rows].clone()))

    def pending(self) -> int:
        return sum(len(s.queued) - s.done for s in self.streams)

    def _issue(self, work: Callable[[], None]) -> None:
        if self._current is None:
            work()
        else:
            self._current.queued.append(work)

    @property
    def kernels(self) -> KernelSet:
        return reference_kernels(self._swap_in(), self._copy_planned(), self._backup())

    def _swap_in(self) -> SwapInFn:
        def swap_in(tables: CacheTables, layer: int, group: int, req_slots: torch.Tensor,
                    top_k: torch.Tensor, num_real: torch.Tensor, out: torch.Tensor,
                    plan: MissPlan | None = None, skip_io: bool = False) -> None:
            # The engine launches swap-ins on the default stream only.
            recorded = plan if plan is not None else MissPlan.empty(*top_k.shape, top_k.device)
            swap_in_reference(tables, layer, group, req_slots, top_k, num_real, out, recorded,
                              skip_io)
            if not skip_io:
                self._note_read(f"swap_in of layer {layer}", tables, layer, recorded)
        return swap_in

    def _copy_planned(self) -> CopyPlannedFn:
        def copy_planned(tables: Any, layer: int, plan: Any) -> None:
            if self._current is not None:  # deferred: it reads the rows when it runs
                self._issue(lambda: copy_planned_reference(tables, layer, plan))
            else:
                copy_planned_reference(tables, layer, plan)
                self._note_read(f"replay of layer {layer}", tables, layer, plan)
        return copy_planned

    def _backup(self) -> Callable[..., None]:
        def backup(tables: Any, newest_rows: Any, host_rows: Any, num_real: Any) -> None:
            self._issue(lambda: backup_newest_reference(tables, newest_rows, host_rows,
                                                        num_real))
        return backup
