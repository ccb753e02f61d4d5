"""The decode path's ordering rules, one named barrier each.

Work runs on up to three streams of the cache's device: the compute stream the caller drives
(and a scheduler thread's stream, for seeding and slot release), a backup stream for the
newest-token backup, and a prefetch stream where followers of an index group replay their
anchor's misses. The host also writes host rows itself. Each class below is one ordering rule
between those, stated once in its docstring; the engine calls these barriers and never
records or waits on an event itself. On the CPU backend events are None and every call is a
no-op; `tests/fakes/deferred_streams.py` runs side-stream work as late as these rules allow,
so a missing wait shows there as stale rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hisparse.backends.base import Backend


class Barrier:
    """One backend event: `mark()` records where the current stream's work is now, `wait()`
    makes the current stream wait for that work, `wait_on_host()` blocks the host for it."""

    __slots__ = ("_backend", "_device", "_event")

    def __init__(self, backend: Backend, device: torch.device) -> None:
        self._backend = backend
        self._device = device
        self._event = backend.new_event()

    def mark(self) -> None:
        self._backend.record_event(self._event, self._device)

    def wait(self) -> None:
        self._backend.wait_event(self._event, self._device)

    def wait_on_host(self) -> None:
        self._backend.synchronize_event(self._event)


class TableChanges(Barrier):
    """A decode step reads the slot tables only after every seeding and slot release before it.

    Seeding and release may run on a scheduler thread, on that thread's stream: they `mark()`
    after writing the tables, and `begin_decode_step` `wait()`s before it uploads the batch, as
    does the next seeding or release (it rewrites the device fields the last one read:
    `core.slot_tables.SlotWriter`).
    """

    def write(self, change: Callable[[], None]) -> None:
        """Run `change` (a seeding or release) after the last one, then mark it."""
        self.wait()
        change()
        self.mark()


class StepEnd(Barrier):
    """A request slot is released or reseeded, and a host row it freed is rewritten, only
    after the last decode step's device work: its kernels read the slot's tables and host rows,
    and a replay of its may still copy into the slot's rows.

    `mark()` when a step ends or is cancelled (after the step's replays, so it covers them);
    `wait()` on the device before a slot's tables change; `wait_on_host()` through
    `HostRowGuard` before the CPU rewrites recycled rows.
    """


class NewestBackup:
    """The newest-token backup of step n reads every layer's newest row (slot `H`, or the
    short-regime slot) and the batch buffers, and writes the new token's host rows.

    On its side stream it starts after step n's last `write_newest`: after the step's end
    mark (`StepEnd`, which the step records once its writes and replays are queued). The next
    step's upload of the batch buffers, and the seeding of a slot whose newest row it may
    still be copying, `wait()` for it (`done`); the host, before it rewrites host rows,
    through `HostRowGuard` (a host wait on the last backup's event, with a stream or without).
    Without a stream the backup runs in order on the compute stream and needs no device
    barrier. A step whose every layer's swap-in lookup wrote the new rows to their host rows
    as well (`swap_in(..., newest_kv=)` on a GPU, where this rank writes host rows) launches
    no backup (`covered`): those writes ran on the compute stream, before the step's end
    mark, which the next step's kernels follow in order and slot reseeding waits for; the
    host's rewrites still wait for them.
    """

    def __init__(self, backend: Backend, device: torch.device, stream: Any | None,
                 host_rows: HostRowGuard) -> None:
        self._backend = backend
        self.stream = stream
        self._host_rows = host_rows
        self._done = host_rows.backups  # (the host's waits and the device's share it)

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    def issue(self, launch: Callable[[], None], step_end: StepEnd) -> None:
        """Run `launch` (the backup kernel) on the side stream after `step_end`, marked just
        now behind the step's writes (one event serves both rules)."""
        if self.stream is None:
            launch()
            self._done.mark()
        else:
            with self._backend.stream_scope(self.stream):
                step_end.wait()
                launch()
                self._done.mark()
        # On the compute stream too the kernel writes host rows after the host has moved on:
        # the host's own writes of host rows wait for it (`HostRowGuard.drain`).
        self._host_rows.note_copies_in_flight()

    def covered(self) -> None:
        """The step's lookups wrote every layer's host row, on the compute stream: nothing to
        launch, but the host must not rewrite host rows before those writes land."""
        self._host_rows.note_copies_in_flight()

    def wait(self) -> None:
        """The current stream waits for the last backup (nothing to wait for without one)."""
        if self.stream is not None:
            self._done.wait()


class HostRowGuard:
    """The CPU, or a transfer engine, rewrites host rows only after the device work that may
    still read or write them.

    Two kinds of work: device writes of host rows still in flight (a backup, on its stream
    or the compute stream: `backups`, the last one's event; a prefill written from device
    memory: `device_prefill`, each after the one before on the device, so that the last
    one's event covers them all; and the lookups that backed rows up, before the step's
    end); and the last step's kernels reading host rows that a finish, abort or cancel has
    just freed, which the step's end covers. `drain()` runs before every host-row write the
    host or a transfer engine makes and waits on the host for those events alone, not for
    the device work queued after them (an overlap scheduler's next forward pass runs on); a
    drain that fails leaves both flags set, so the next one waits again. A prefill from
    device memory waits for neither on the host: its copies follow them on the device
    (`device_prefill`).
    """

    def __init__(self, backend: Backend, device: torch.device, step_end: StepEnd) -> None:
        self._step_end = step_end
        self.backups = Barrier(backend, device)  # marked after each backup (NewestBackup)
        self._prefills = Barrier(backend, device)  # after each prefill from device memory
        self.copies_in_flight = False
        self.rows_recycled = False
        # A shared host pool (core/shared_pool.py): the writer rank rewrites freed rows only
        # once every rank's last step that may read them has ended.
        self.shared: Any | None = None

    def note_copies_in_flight(self) -> None:
        """Device work writes host rows: a backup (`backups` marks it) or a step's lookups
        (before its end)."""
        self.copies_in_flight = True

    def device_prefill(self, issue: Callable[[], None]) -> None:
        """Issue a prefill's copies from device memory into host rows just given to its
        request, on the current stream, and mark them: after the last step's kernels (which may
        still read rows freed before), the last backup and the last such prefill (which may
        still write them) on the device, and after the other ranks' reads of freed rows on the
        host. A backup does not wait for prefills: they write other requests' rows."""
        if self.shared is not None:
            self.shared.before_write()
        for barrier in (self._step_end, self.backups, self._prefills):
            barrier.wait()
        issue()
        self._prefills.mark()
        self.copies_in_flight = True

    def note_rows_recycled(self) -> None:
        self.rows_recycled = True
        if self.shared is not None:
            self.shared.rows_recycled(self._step_end.wait_on_host)

    def drain(self) -> None:
        if self.shared is not None:
            self.shared.before_write()  # the other ranks' reads of rows freed before
        if self.copies_in_flight:
            self.backups.wait_on_host()
            self._prefills.wait_on_host()
        if self.copies_in_flight or self.rows_recycled:
            self._step_end.wait_on_host()
        self.copies_in_flight = self.rows_recycled = False


class SideStreamReplay:
    """The replays of one index group's miss plan on the prefetch stream.

    The anchor's `swap_in` writes the plan; the side stream replays it on every follower
    layer only after that (`planned`). A follower's `swap_in` returns rows of its layer only
    after its own replay copied them (`ready[layer]`). The anchor plans again, and the step
    ends, only after every replay that reads the plan has run (`done`): the first because the
    plan is rewritten, the second because a replay nobody waited for could otherwise copy into
    a slot freed and reseeded after the step.
    """

    def __init__(self, backend: Backend, device: torch.device, stream: Any,
                 followers: range) -> None:
        self._backend = backend
        self._stream = stream
        self._followers = followers
        self._planned = Barrier(backend, device)
        self._ready = {layer: Barrier(backend, device) for layer in followers}
        self._done = Barrier(backend, device)

    def issue(self, replay: Callable[[int], None]) -> None:
        """Queue `replay(layer)` for every follower behind the anchor's plan."""
        self._planned.mark()
        with self._backend.stream_scope(self._stream):
            self._planned.wait()
            for layer in self._followers:
                replay(layer)
                self._ready[layer].mark()
            self._done.mark()

    def wait_for(self, layer: int) -> None:
        self._ready[layer].wait()

    def wait_for_all(self) -> None:
        self._done.wait()


class DecodeOrdering:
    """The cache-wide barriers: what the cache's bookkeeping and every step share."""

    def __init__(self, backend: Backend, device: torch.device,
                 backup_stream: Any | None) -> None:
        self.tables_changed = TableChanges(backend, device)
        self.step_end = StepEnd(backend, device)
        self.host_rows = HostRowGuard(backend, device, self.step_end)
        self.backup = NewestBackup(backend, device, backup_stream, self.host_rows)
