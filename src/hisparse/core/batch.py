"""The device buffers a decode step's kernels read, and the one upload that refreshes them.

`BatchPlan` works out on the host, in one pass over the batch, where each new token goes;
`BatchBuffers` sends it. Every `[Bcap]` batch buffer is a typed view of one device byte block,
so the whole plan (batch buffers and table updates) reaches the device in one host-to-device
copy, straight into the buffers. Graph capture holds the views' addresses; they never move.
`DeviceBlock` is that mechanism (typed fields of one device block, one upload from a staging
ring); verify steps keep their begin and end fields in two more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hisparse.core.requests import RequestRecord, SlotAllocator
from hisparse.layout.tables import CacheTables

if TYPE_CHECKING:
    from hisparse.backends.base import Backend

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16}
_ALIGN = 16  # bytes: every field starts where a kernel's vector loads may assume it does


@dataclass(frozen=True)
class _Field:
    dtype: torch.dtype
    offset: int  # in bytes, from the block's start
    length: int
    padding: int  # what rows past the step's batch hold


@dataclass(frozen=True)
class BatchViews:
    """The first `rows` entries of every batch buffer (views, made once per row count)."""

    req_slots: torch.Tensor
    newest_rows_long: torch.Tensor
    out: tuple[torch.Tensor, ...]  # per group
    batch_slots: torch.Tensor  # int64 request slots: the index of the seq_lens update
    seq_lens: torch.Tensor  # int32 new length of each request


class BatchBuffers:
    """`[Bcap]` buffers of the open step, refreshed by `begin_decode_step`.

    Uploaded every step (rows past the batch hold their padding): `req_slots` (request slot,
    0), `num_real` `[1]`, `newest_rows` and its int64 twin `newest_rows_long` for
    `write_newest`'s `index_copy_` (device row of the new token, the sink row), `newest_host_rows`
    (its host row, -1), and the `seq_lens` update (`batch_slots` int64 index, `new_seq_lens`).
    Uploaded only by a step that has them: the page-table entries of requests given extents
    (`page_index` into the flattened page table, `page_extent`; up to D a request) and the
    short-regime slot of each new token (`short_slot`, `short_hot`, `short_key` int64;
    `short_key_i32`, `short_hot_resident` as the tables store them). Uploaded by a union step
    (`core/verify.py`) with the rest, in the same copy: each request's S draft rows
    (`draft_rows`, `draft_rows_long`, the sink row past the batch or a ragged count), its
    first new position (`first`), its first draft row (`draft_base`) and the last row its
    queries may select (`last_visible`, -1: each up to its own). `out` `[G, Bcap, K]` is its
    own (the kernels read the caller's top-k in place).
    """

    def __init__(self, capacity: int, top_k: int, num_groups: int, padding_row: int,
                 resident_dtype: torch.dtype, device: torch.device,
                 backend: Backend | None = None, draft_tokens: int = 1) -> None:
        i64, i32 = torch.int64, torch.int32
        cap, drafts = capacity, capacity * draft_tokens
        every_step = [
            ("newest_rows_long", i64, cap, padding_row), ("batch_slots", i64, cap, 0),
            ("req_slots", i32, cap, 0), ("newest_rows", i32, cap, padding_row),
            ("newest_host_rows", i32, cap, -1), ("new_seq_lens", i32, cap, 0),
            ("num_real", i32, 1, 0),
        ]
        some_steps = [
            ("page_index", i64, drafts, 0), ("short_slot", i64, cap, 0),
            ("short_hot", i64, cap, 0), ("short_key", i64, cap, 0),
            ("page_extent", i32, drafts, 0), ("short_key_i32", i32, cap, 0),
            ("short_hot_resident", resident_dtype, cap, 0),
        ]
        union_steps = [
            ("draft_rows_long", i64, drafts, padding_row), ("first", i64, cap, 0),
            ("draft_base", i64, cap, 0), ("last_visible", i64, cap, -1),
            ("draft_rows", i32, drafts, padding_row),
        ]
        self.capacity = capacity
        self.block = DeviceBlock(every_step + some_steps + union_steps, device, backend)
        # The lengths an upload sends: the every-step fields, those and a single-token step's
        # updates, or the whole block.
        self._every_step_bytes = self.block.end_of("num_real")
        self._update_bytes = self.block.end_of("short_hot_resident")
        self.req_slots = self.field("req_slots")
        self.num_real = self.field("num_real")
        self.newest_rows = self.field("newest_rows")
        self.newest_rows_long = self.field("newest_rows_long")
        self.newest_host_rows = self.field("newest_host_rows")
        self.out = torch.full((num_groups, capacity, top_k), -1, dtype=i32, device=device)
        self._views: dict[int, BatchViews] = {}

    def field(self, name: str, count: int | None = None) -> torch.Tensor:
        """The device view of a field (its first `count` entries)."""
        return self.block.field(name, count)

    def upload(self, columns: Mapping[str, Sequence[int] | np.ndarray],
               updates: Mapping[str, Sequence[int] | np.ndarray] | None = None,
               union: bool = False) -> None:
        """Send `columns` (every-step field -> the values of its first rows) and `updates` (the
        same for the other fields) in one host-to-device copy; every other row of the fields
        sent gets its padding. The copy stops after the every-step fields without updates,
        after a single-token step's updates with them, and covers the union fields with
        `union`."""
        size = None if union else self._update_bytes if updates else self._every_step_bytes
        self.block.upload({**columns, **(updates or {})}, size)

    def upload_columns(self, columns: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Int32 columns on the device in one copy, each its own tensor (for rare updates)."""
        lengths = [len(c) for c in columns]
        flat = torch.tensor([v for c in columns for v in c], dtype=torch.int32)
        return list(torch.split(flat.to(self.block.device, non_blocking=True), lengths))

    def views(self, rows: int) -> BatchViews:
        """Views of the first `rows` batch rows, cached: a call per layer makes none."""
        views = self._views.get(rows)
        if views is None:
            views = self._views[rows] = BatchViews(
                req_slots=self.req_slots[:rows],
                newest_rows_long=self.newest_rows_long[:rows],
                out=tuple(self.out[:, :rows].unbind(0)),
                batch_slots=self.field("batch_slots", rows),
                seq_lens=self.field("new_seq_lens", rows),
            )
        return views

    def state(self) -> list[torch.Tensor]:
        """Every device buffer, for tests that compare a cache's state before and after."""
        return [self.block.tensor, self.out]


class DeviceBlock:
    """Named typed fields of one device byte block, refreshed in one host-to-device copy.

    Fields start at 16-byte offsets; every field not given a value gets its padding. The views
    never move (graph capture holds them), and a whole field is the same tensor every call (a
    launch bound to it is replayed, not bound again). Uploads go from a staging ring
    (`_StagingRing`); an upload of the first `size` bytes sends only those.
    """

    def __init__(self, fields: Sequence[tuple[str, torch.dtype, int, int]],
                 device: torch.device, backend: Backend | None = None) -> None:
        self._fields: dict[str, _Field] = {}
        offset = 0
        for name, dtype, length, padding in fields:
            self._fields[name] = _Field(dtype, offset, length, padding)
            offset += -(-length * dtype.itemsize // _ALIGN) * _ALIGN
        self.device = device
        self.uploads = 0  # how many uploads the block has had (core.batch.QuietRun)
        self.tensor = torch.zeros(offset, dtype=torch.uint8, device=device)
        self._prefix = {offset: self.tensor}
        # What the host sends before the values go in: every field's padding.
        self._template = np.zeros(offset, dtype=np.uint8)
        for name, field in self._fields.items():
            self._host_view(self._template, name)[:] = field.padding
        self._whole: dict[str, torch.Tensor] = {}
        self._staging = _StagingRing(self, backend, device)

    def end_of(self, name: str) -> int:
        """The byte offset after field `name` (an upload of that many bytes stops there)."""
        field = self._fields[name]
        end = field.offset + -(-field.length * field.dtype.itemsize // _ALIGN) * _ALIGN
        self._prefix.setdefault(end, self.tensor[:end])
        return end

    def field(self, name: str, count: int | None = None) -> torch.Tensor:
        """The device view of a field (its first `count` entries)."""
        if count is None:
            whole = self._whole.get(name)
            if whole is None:
                whole = self._whole[name] = self.field(name, self._fields[name].length)
            return whole
        field = self._fields[name]
        return self.tensor[field.offset : field.offset + count * field.dtype.itemsize].view(
            field.dtype)

    def upload(self, values: Mapping[str, Sequence[int] | np.ndarray],
               size: int | None = None) -> None:
        """Send `values` (field -> the values of its first entries, flat) and every other
        entry's padding, in one copy of the block's first `size` bytes (None: all of it;
        else an `end_of` offset)."""
        size = self.tensor.numel() if size is None else size
        staged = self._staging.take()
        np.copyto(staged.host[:size], self._template[:size])
        views = staged.views
        for name, value in values.items():
            views[name][: len(value)] = value
        source = staged.prefix.get(size)
        if source is None:  # (an `end_of` size asked for after this copy was made)
            source = staged.prefix[size] = staged.tensor[:size]
        self._prefix[size].copy_(source, non_blocking=True)
        self.uploads += 1
        self._staging.sent(staged)

    def _host_view(self, host: np.ndarray, name: str) -> np.ndarray:
        field = self._fields[name]
        nbytes = field.length * field.dtype.itemsize
        return host[field.offset : field.offset + nbytes].view(_NUMPY[field.dtype])


@dataclass(eq=False)
class _Staged:
    """One host copy of the block: numpy views of its fields, the tensor prefixes an upload
    sends, and the event after its last copy (None: never sent, or no events here)."""

    tensor: torch.Tensor  # the host copy (pinned on accelerators)
    host: np.ndarray  # the same bytes, for numpy
    views: dict[str, np.ndarray]
    prefix: dict[int, torch.Tensor]
    event: Any = None


class _StagingRing:
    """The host copies uploads go from. On an accelerator they are pinned, so a copy is one DMA
    the driver queues without staging it, and a copy is written again only once its last
    upload has landed (its event); while every copy is in flight the ring grows by one, so an
    upload never waits for the device. On the CPU the copy is done when `copy_` returns: one
    pageable copy serves every upload."""

    def __init__(self, block: DeviceBlock, backend: Backend | None,
                 device: torch.device, pin: bool | None = None) -> None:
        self._block = block
        self._backend = backend if device.type != "cpu" else None
        self._device = device
        self._pin = self._backend is not None if pin is None else pin
        self._ring: list[_Staged] = []
        self._next = 0

    def take(self) -> _Staged:
        ring, backend = self._ring, self._backend
        if ring and (backend is None or backend.event_done(ring[self._next].event)):
            return ring[self._next]
        ring.insert(self._next, self._new())
        return ring[self._next]

    def sent(self, staged: _Staged) -> None:
        if self._backend is not None:
            if staged.event is None:
                staged.event = self._backend.new_event()
            self._backend.record_event(staged.event, self._device)
            self._next = (self._next + 1) % len(self._ring)

    def _new(self) -> _Staged:
        b = self._block
        size = b._template.size
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        host = tensor.numpy()
        return _Staged(tensor, host, {name: b._host_view(host, name) for name in b._fields},
                       {n: tensor[:n] for n in b._prefix})


class BatchPlan:
    """Where each new token of a step goes, before anything changes: its position, device row
    (slot `H`, or its own slot while the request is short) and host row, and the table
    updates: every request's length, the page-table entry of a request whose new token starts
    an extent (`grow`), and a short-regime token's slot.

    Nothing is read from the records: their slots are the allocator's (`slots_of`, kept while
    the batch repeats), their lengths and pages its per-slot arrays, so the plan is a few
    numpy operations over the batch whatever its size. A token that starts an extent has no
    host row until the extent is allocated: `place_new_extents` fills it in. `full` lists
    the requests at `max_seq_len` already. `appends` (a ragged step): a request whose count
    is 0 keeps its length, page and slots; its new row goes to the sink row, host row -1.
    """

    def __init__(self, records: Sequence[RequestRecord], slots: SlotAllocator,
                 tables: CacheTables, max_seq_len: int, appends: np.ndarray | None = None
                 ) -> None:
        self._tables = tables
        E = tables.extent_tokens
        self.slots = slots.slots_of(records)
        self._positions = positions = slots.lengths[self.slots]
        self.positions = tuple(positions.tolist())
        # None: every request appends a token; else each one's count (0 or 1, a ragged step).
        self._appends = appends
        appending = self.positions if appends is None else positions[appends > 0].tolist()
        self._shortest = min(appending, default=tables.hot_slots)
        self.grow: list[tuple[RequestRecord, int]] = []  # (record, its batch row)
        self.full: list[Any] = []  # ids of requests at max_seq_len that would append
        if max(appending, default=0) >= max_seq_len:
            at_limit = positions >= max_seq_len
            if appends is not None:
                at_limit &= appends > 0
            self.full = [records[b].request_id for b in np.flatnonzero(at_limit)]
            return  # (past max_seq_len there is no page to look up)
        # Few numpy calls (each costs more than its work at these sizes; benchmarks/NOTES.md).
        page, offset = np.divmod(positions, E)
        if appends is not None:  # (a full request appending nothing has no page there)
            np.minimum(page, slots.pages.shape[1] - 1, out=page)
        extent = slots.pages[self.slots, page]
        self.host_rows = host_rows = extent * E
        host_rows += offset
        if appends is not None:  # nothing to back up, and no extent to take, where idle
            host_rows[appends == 0] = -1
            extent = np.where(appends > 0, extent, 0)
        if extent.min() < 0:  # a token that starts an extent: no page yet
            starts = np.flatnonzero(extent < 0)
            host_rows[starts] = -1
            self.grow = [(records[b], b) for b in starts.tolist()]
        self._offsets = offset
        self._max_seq_len = max_seq_len

    def quiet_steps(self) -> int:
        """How many steps after this one are this one moved on by a token (`QuietRun`): none
        while a request is short (its new token takes a slot of its own), else until a row's
        token starts the next extent or reaches max_seq_len."""
        if self._shortest < self._tables.hot_slots or self._appends is not None:
            return 0
        E = self._tables.extent_tokens
        return min(E - 1 - int(self._offsets.max()),
                   self._max_seq_len - 1 - max(self.positions))

    def place_new_extents(self, extents: Sequence[int]) -> None:
        """The extent each `grow` entry's token starts, in order: its host row follows."""
        E = self._tables.extent_tokens
        for (_, row), extent in zip(self.grow, extents, strict=True):
            self.host_rows[row] = extent * E + int(self._positions[row]) % E

    def columns(self) -> dict[str, Sequence[int] | np.ndarray]:
        """The every-step fields of `BatchBuffers`."""
        H, S = self._tables.hot_slots, self._tables.slots_per_request
        newest = self.slots * S
        newest += H if self._shortest >= H else np.minimum(self._positions, H)  # short: own slot
        lengths = self._positions + 1
        if self._appends is not None:  # an idle request's new row goes to the sink row
            newest[self._appends == 0] = self._tables.device_kv.shape[1] - 1
            lengths = self._positions + self._appends
        return {"req_slots": self.slots, "batch_slots": self.slots,
                "num_real": [len(self.positions)], "newest_rows": newest,
                "newest_rows_long": newest, "newest_host_rows": self.host_rows,
                "new_seq_lens": lengths}

    def updates(self) -> dict[str, np.ndarray]:
        """The other fields of `BatchBuffers`, those this step has (see `place_new_extents`)."""
        t, updates = self._tables, {}
        if self.grow:
            grown = np.array([row for _, row in self.grow], dtype=np.int64)
            updates["page_index"] = (self.slots[grown] * t.page_table.shape[1]
                                     + self._positions[grown] // t.extent_tokens)
            updates["page_extent"] = self.host_rows[grown] // t.extent_tokens
        # The token's own slot, tracked for the switch (a list's min: no numpy for the usual
        # step, whose requests are all long).
        if self._shortest < t.hot_slots:
            short = self._positions < t.hot_slots
            if self._appends is not None:
                short &= self._appends > 0
            slot, hot = self.slots[short], self._positions[short]
            # host_row: a new token lands in an extent of its request's own, whose key rows
            # are its host rows (aliases name only shared extents, which nobody writes).
            key = (slot * t.positions_per_request + hot if t.residency_map == "position"
                   else self.host_rows[short])
            updates |= {"short_slot": slot, "short_hot": hot, "short_key": key,
                        "short_key_i32": key, "short_hot_resident": hot}
        return updates


@dataclass(eq=False)
class QuietRun:
    """The last decode step's batch, while its next steps are that step moved on by a token.

    A batch of long requests whose new tokens all stay inside their extents and under
    `max_seq_len` (`BatchPlan.quiet_steps`) needs no plan and no upload: the device moves
    each row's host row and length on by one (`kernels.advance_reference`) and the host its
    lengths. It holds while nothing else touched the batch: the same record list, no record
    changed state or slot (`RequestRecord.changes`), no length or page entry was written but
    by these steps (`RequestRecord.length_writes`), and the batch buffers had no other upload.
    """

    records: list[RequestRecord]
    slots: np.ndarray
    positions: np.ndarray  # the last step's
    steps: int  # how many more steps may move on
    changes: int
    length_writes: int
    uploads: int

    @classmethod
    def after(cls, plan: BatchPlan, records: list[RequestRecord], block: DeviceBlock
              ) -> QuietRun | None:
        """The run a step's plan starts (called once the step's append is done)."""
        steps = plan.quiet_steps()
        if steps <= 0:
            return None
        return cls(records, plan.slots, plan._positions, steps, RequestRecord.changes,
                   RequestRecord.length_writes, block.uploads)

    def holds_for(self, records: list[RequestRecord], block: DeviceBlock) -> bool:
        return (self.steps > 0 and records is self.records
                and self.changes == RequestRecord.changes
                and self.length_writes == RequestRecord.length_writes
                and self.uploads == block.uploads)

    def step(self) -> np.ndarray:
        """The next step's positions (and one step fewer left)."""
        self.steps -= 1
        self.positions = self.positions + 1
        return self.positions
