"""A decode step: its batch, what it has done so far, and the verbs that drive it.

`HiSparseCache.begin_decode_step` returns a `DecodeStep`; the model thread then calls
`write_newest(layer, kv)` and `swap_in(layer, top_k)` per layer and `end()` (or `cancel()`
after a forward pass that failed). Everything that lives for one step lives here; what all
steps of a cache share (tables, batch buffers, kernels, group replays, barriers) is the
cache's `DecodeContext`.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hisparse.backends.base import Backend
from hisparse.core.batch import BatchBuffers, BatchPlan, QuietRun
from hisparse.core.host_pool import HostPool
from hisparse.core.kernels import DecodeKernels
from hisparse.core.ordering import DecodeOrdering
from hisparse.core.plan import StepPlan
from hisparse.core.replay import GroupReplay, group_replays, miss_plans
from hisparse.core.requests import RequestRecord
from hisparse.core.stats import TrafficCounters
from hisparse.core.validation import (
    as_rows,
    check_batch_rows,
    check_layer,
    check_positions_against_lengths,
    check_tensor,
    is_plain_tensor,
)
from hisparse.errors import InvalidInputError, RequestStateError
from hisparse.layout.tables import CacheTables

if TYPE_CHECKING:
    from hisparse.config import HiSparseConfig


@dataclass(eq=False)
class DecodeContext:
    """What every decode step of one cache shares, built once with the cache."""

    tables: CacheTables
    pool: HostPool
    traffic: TrafficCounters
    buffers: BatchBuffers
    kernels: DecodeKernels
    order: DecodeOrdering
    replays: list[GroupReplay | None]  # per group; None: a group of one layer replays nothing
    layer_group: list[int]  # per layer
    layer_kv: list[torch.Tensor]  # per layer: `device_kv[layer]`, the sink row included
    lock: threading.RLock
    device: torch.device
    batch_capacity: int
    max_seq_len: int
    validate: bool
    prefetch_stream: Any | None  # where followers replay (None: inline)
    shared: Any | None = None  # a shared host pool's SharedPoolSync (core/shared_pool.py)
    slots: Any = None  # the cache's SlotAllocator: lengths and host pages per request slot
    quiet: QuietRun | None = None  # the last step's batch, while its next steps move on

    @classmethod
    def build(cls, config: HiSparseConfig, backend: Backend, device: torch.device,
              tables: CacheTables, pool: HostPool, traffic: TrafficCounters,
              lock: threading.RLock, slots: Any = None) -> DecodeContext:
        """The buffers, kernels, streams, barriers and group replays for `tables`."""
        L, schedule = config.num_layers, config.index_schedule
        capacity = config.max_batch or config.max_requests
        num_groups = schedule.num_groups
        padding_row = int(tables.device_kv.shape[1]) - 1
        buffers = BatchBuffers(capacity, config.top_k, num_groups, padding_row,
                               tables.resident.dtype, device, backend)
        plans = miss_plans(schedule, capacity, config.top_k, device)
        kernels = DecodeKernels(backend, config.skip_io, config.zero_copy_swap_in, tables,
                                buffers.req_slots, buffers.num_real, buffers.out, plans,
                                (buffers.newest_rows, buffers.newest_rows_long),
                                (buffers.field("batch_slots"), buffers.num_real,
                                 buffers.newest_host_rows, buffers.field("new_seq_lens")),
                                # Where this rank writes host rows (a reader does not); a
                                # shared writer's plan waits for readers at the begin.
                                newest_host_rows=(buffers.newest_host_rows
                                                  if pool.writes_rows else None))
        backup_stream = backend.backup_stream() if config.async_backup else None
        prefetch = config.shared_index_prefetch and schedule.shares
        prefetch_stream = backend.prefetch_stream() if prefetch else None
        order = DecodeOrdering(backend, device, backup_stream)
        replays = group_replays(schedule, plans, tables, kernels, backend, device,
                                prefetch_stream)
        return cls(tables=tables, pool=pool, traffic=traffic, buffers=buffers,
                   kernels=kernels, order=order, replays=replays,
                   layer_group=list(schedule.layer_groups),
                   layer_kv=[tables.device_kv[layer] for layer in range(L)], lock=lock,
                   device=device, batch_capacity=capacity, max_seq_len=config.max_seq_len,
                   validate=config.validate, prefetch_stream=prefetch_stream, slots=slots)

    def __post_init__(self) -> None:
        t = self.tables
        self.num_layers = len(self.layer_kv)
        self.row_bytes = t.row_bytes
        self.top_k_columns = self.buffers.out.shape[2]
        self.page_entries = t.page_table.view(-1)  # for one flat index_copy_ per step


class StepState(enum.Enum):
    OPEN = "open"
    ENDED = "ended"
    CANCELLED = "cancelled"
    CLOSED = "closed"  # the cache was closed while the step was open


class DecodeStep:
    """One decode step of a batch of running requests.

    Public: `request_ids`, `positions` (each new token's), `batch_size`, and the persistent
    `[Bcap]` device buffers its kernels read: `req_slots`, `num_real` `[1]`, `newest_rows`.
    It owns its records, the layers `write_newest` wrote (a cancel restores them), and the
    index groups whose anchor swapped in during it (their replays are owed until it ends).
    Once ended or cancelled every verb raises `RequestStateError`.
    """

    def __init__(self, context: DecodeContext, plan: StepPlan,
                 request_ids: tuple[Hashable, ...], positions: tuple[Any, ...] | np.ndarray,
                 records: list[RequestRecord], grew: list[RequestRecord]) -> None:
        self.plan = plan  # every choice of this step's path (core/plan.py)
        self.request_ids = request_ids
        # A quiet step's come as the array it moved on; a tuple is made only if read (an
        # eager step at B = 128 would pay a few us for it, and most callers never read it).
        self._positions = positions
        buffers = context.buffers
        self.req_slots = buffers.req_slots  # [Bcap] int32 request slot per row (0: padding)
        self.num_real = buffers.num_real  # [1] int32
        self.newest_rows = buffers.newest_rows  # [Bcap] int32 device row of the new token
        self._context: DecodeContext | None = context
        self._lock = context.lock
        self._records = records
        self._grew = grew  # the records that took an extent for their new token
        self._written: set[int] = set()  # layers given write_newest
        # Layers whose new rows their swap-in's lookup also wrote to the host rows (the backup
        # need not copy them); a later write_newest of the layer takes it out again.
        self._backed_up: set[int] = set()
        self._anchored: list[GroupReplay] = []  # groups whose anchor swapped in
        self._state = StepState.OPEN

    @property
    def positions(self) -> tuple[Any, ...]:
        """The position of each request's new token (its seq_len - 1)."""
        positions = self._positions
        if not isinstance(positions, tuple):
            positions = self._positions = tuple(positions.tolist())
        return positions

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    @property
    def is_open(self) -> bool:
        return self._state is StepState.OPEN

    def holds(self, record: RequestRecord) -> bool:
        return any(r is record for r in self._records)

    # --- opening --------------------------------------------------------------------------
    @classmethod
    def begin(cls, context: DecodeContext, plan: StepPlan, request_ids: tuple[Hashable, ...],
              records: list[RequestRecord]) -> DecodeStep:
        """Append one token to each record and upload the step's batch and table updates.

        The records change only once the updates are on their way to the device: a failed
        upload (a device out of memory) leaves nothing changed and the step retryable.
        """
        c = context
        if c.validate:
            c.slots.check(records)
        run = c.quiet if plan.quiet_advance else None
        if run is not None and run.holds_for(records, c.buffers.block):
            return cls._move_on(c, plan, run, request_ids, records)
        c.quiet = None
        batch = BatchPlan(records, c.slots, c.tables, c.max_seq_len)
        if batch.full:
            raise InvalidInputError(
                f"requests {batch.full!r} already hold max_seq_len={c.max_seq_len} tokens; "
                "finish them or raise max_seq_len"
            )
        c.pool.check_free(len(batch.grow))
        new_extents: list[int] = []  # the extent each grown record's new token starts
        try:
            for record, _ in batch.grow:
                new_extents += c.pool.allocate(1, after=record.extents[-1])
            batch.place_new_extents(new_extents)
            updates = batch.updates()
            # The previous step's backup (maybe still running on its side stream) reads the
            # batch buffers, and seeding may have run on another thread's stream.
            c.order.backup.wait()
            c.order.tables_changed.wait()
            c.buffers.upload(batch.columns(), updates)
        except BaseException:
            if new_extents:
                c.pool.release(new_extents)
            raise
        grew = [record for record, _ in batch.grow]
        for record, extent in zip(grew, new_extents, strict=True):
            record.extents.append(extent)
            c.slots.sync_pages(record)
        c.slots.lengths[batch.slots] += 1  # every record's num_tokens (they read this array)
        _install_table_updates(c, len(records), updates)
        c.quiet = QuietRun.after(batch, records, c.buffers.block)
        return cls(c, plan, request_ids, batch.positions, records, grew)

    @classmethod
    def _move_on(cls, c: DecodeContext, plan: StepPlan, run: QuietRun,
                 request_ids: tuple[Hashable, ...], records: list[RequestRecord]) -> DecodeStep:
        """`begin` of a quiet step: the last step's batch buffers moved on on the device."""
        expected = BatchPlan(records, c.slots, c.tables, c.max_seq_len) if c.validate else None
        c.order.backup.wait()  # the last backup reads the host rows this moves on
        c.order.tables_changed.wait()
        c.kernels.launch_advance(len(records))
        positions = run.step()
        c.slots.lengths[run.slots] += 1
        if expected is not None:
            _check_moved_on(c, expected, len(records))
        return cls(c, plan, request_ids, positions, records, [])

    # --- per layer ------------------------------------------------------------------------
    def write_newest(self, layer: int, kv: torch.Tensor) -> None:
        """Write the new token's row of `layer` for every request: `kv [B, W]`, B between the
        step's request count and `max_batch` (padding rows go to the sink row)."""
        c = self._usable("write_newest")
        check_layer(layer, c.num_layers)
        c.kernels.write_newest(layer, self._newest_rows(c, kv))
        self._written.add(layer)
        self._backed_up.discard(layer)

    def _newest_rows(self, c: DecodeContext, kv: object) -> torch.Tensor:
        """`kv` checked as the step's new rows `[B, W]` uint8 on the device."""
        # The usual call (dense uint8 rows on our device) passes attribute reads; any other
        # goes through `as_rows`, which views other dtypes as bytes or says what is wrong.
        if (is_plain_tensor(kv, torch.uint8, 2, c.device, contiguous=False)
                and kv.shape[1] == c.row_bytes):
            rows = kv
        else:
            rows = as_rows("kv", kv, c.row_bytes, 2, device=c.device)
        count = rows.shape[0]
        if not self.batch_size <= count <= c.batch_capacity:
            check_batch_rows("kv", count, self.batch_size, c.batch_capacity)
        return rows

    def swap_in(self, layer: int, top_k: torch.Tensor | None = None,
                newest_kv: torch.Tensor | None = None) -> torch.Tensor:
        """Map each top-k position to the device row holding it, loading the misses.

        Args:
            layer: the KV layer attention is about to read.
            top_k: `[B, K]` int32 positions on the cache's device, -1 = none; B between the
                step's request count and `max_batch` (rows past the real count are padding).
                A follower of an index group may leave it out, or pass its anchor's top-k
                (that tensor, free; or equal contents, compared at one host sync).
            newest_kv: the layer's new token rows, as `write_newest(layer, newest_kv)` takes
                them, written in this call instead (on the GPUs inside the swap-in's first
                launch: one launch fewer per layer).

        Returns:
            `[B, K]` int32 rows of `device_kv(layer)` (-1 for none, invalid and padding): a
            view of a buffer reused by the group's next call; a follower gets its anchor's.
        """
        c = self._usable("swap_in")
        check_layer(layer, c.num_layers)
        group = c.layer_group[layer]
        replay = c.replays[group]
        if replay is not None and layer != replay.anchor:
            out = self._follow(c, layer, replay, top_k)
            if newest_kv is not None:
                self.write_newest(layer, newest_kv)
            return out
        if top_k is None:
            raise _anchor_needs_top_k(layer, replay)
        rows = self._check_top_k(c, top_k)
        newest = self._newest_rows(c, newest_kv) if newest_kv is not None else None
        if c.validate:
            check_positions_against_lengths(
                top_k, [r.num_tokens for r in self._records], self.request_ids)
        if replay is not None:
            replay.begin_plan()
        # The kernels run over the B rows the caller passed, not over `max_batch`: a caller
        # that captures one graph per batch size gets small grids for small batches. They
        # read the caller's top-k in place (a copy into a buffer of ours cost 6 us per call).
        out = c.buffers.views(rows).out[group]
        if c.kernels.launch_swap_in(layer, group, rows, top_k, newest):
            self._backed_up.add(layer)
        elif newest is not None:
            self._backed_up.discard(layer)
        if newest is not None:
            self._written.add(layer)
        self._finish_anchor(replay, top_k, out)
        return out

    def _finish_anchor(self, replay: GroupReplay | None, top_k: torch.Tensor,
                       out: torch.Tensor) -> None:
        """After an anchor's swap-in: its group's followers will replay this plan."""
        if replay is not None:
            if replay.step is not self:
                self._anchored.append(replay)
            replay.finish_plan(self, top_k, out)

    def _follow(self, c: DecodeContext, layer: int, replay: GroupReplay,
                top_k: torch.Tensor | None,
                check: Callable[[DecodeContext, object], object] | None = None
                ) -> torch.Tensor:
        """A follower's rows: its anchor's, once its layer holds the anchor's copies. Handed a
        top-k, it must hold the anchor's: its own tensor (an address check, free on the hot
        path; `validate` compares contents too) or equal contents (`GroupReplay`). `check` is
        the step's own top-k check (the single-token one by default), run on a tensor that is
        not the anchor's so that a malformed one gets the precise message."""
        if replay.step is not self:
            raise replay.not_anchored(layer)
        if top_k is not None:
            if not replay.is_anchor_top_k(top_k):
                (check or self._check_top_k)(c, top_k)
                raise replay.other_top_k(layer, top_k)
            if c.validate and not torch.equal(top_k, replay.top_k):
                raise replay.changed_top_k(layer)
        return replay.ready_rows(layer)

    def _check_top_k(self, c: DecodeContext, top_k: object) -> int:
        if is_plain_tensor(top_k, torch.int32, 2, c.device):
            rows, columns = top_k.shape
            if columns == c.top_k_columns and self.batch_size <= rows <= c.batch_capacity:
                return rows
        top_k = check_tensor("top_k", top_k, dtype=torch.int32, device=c.device, ndim=2)
        rows, columns = top_k.shape
        check_batch_rows("top_k", rows, self.batch_size, c.batch_capacity)
        if columns != c.top_k_columns:
            raise InvalidInputError(
                f"top_k has {columns} columns, the cache was built for top_k="
                f"{c.top_k_columns}; pad rows with -1 to {c.top_k_columns} columns"
            )
        return rows

    # --- closing --------------------------------------------------------------------------
    def end(self, accepted: Any = None) -> None:
        """Back every layer's new row up to its host row (on a side stream where supported).
        `accepted`: None, or one 1 per request (a single-token step keeps its token)."""
        with self._lock:
            c = self._usable("end_decode_step")
            if accepted is not None:
                _check_single_accepted(accepted, self.batch_size)
            self._prepare_end(c)
            shared = self._enter_shared(c, "end")
            self._mark_end(c)
            backup_stream = None  # where this step's host-row writes run (None: compute)
            if self.plan.writes_host_rows:  # (a shared pool's reader leaves them to the writer)
                if len(self._backed_up) == c.num_layers:
                    c.order.backup.covered()  # every layer's lookup wrote its host row
                else:
                    c.order.backup.issue(self._launch_backup, c.order.step_end)
                    backup_stream = c.order.backup.stream
            c.traffic.backed_up_tokens += self.batch_size
            self._close(c, StepState.ENDED)
            self._exit_shared(c, shared, "end", wrote=True, stream=backup_stream)

    def cancel(self) -> None:
        """Undo the step's token append, for a forward pass that failed part way.

        Every request is back at its length before the step, with its KV as it was: the new
        token's extent (if it took one) and short-regime slot are released, and the newest
        slot gets its previous token back from the host. Rows the step's swap-ins brought into
        hot buffers stay, as do the counters: those are valid copies of older tokens.
        """
        with self._lock:
            c = self._context
            if c is None:
                raise self._refusal("cancel_decode_step")
            self._settle_replays()
            shared = self._enter_shared(c, "cancel")
            self._roll_back(c)
            self._mark_end(c)
            self._close(c, StepState.CANCELLED)
            self._exit_shared(c, shared, "cancel", wrote=False)

    def _prepare_end(self, c: DecodeContext) -> None:
        """Before an end changes anything: (validate) every layer was written, and every
        group's follower replays owed are made."""
        if c.validate and len(self._written) != c.num_layers:
            missing = sorted(set(range(c.num_layers)) - self._written)
            raise RequestStateError(
                f"end_decode_step: layers {missing} got no write_newest in this step, so "
                "their host backup would store a stale row; call write_newest(layer, kv) "
                "for every layer first"
            )
        for replay in self._anchored:
            replay.replay_owed()

    def _roll_back(self, c: DecodeContext) -> None:
        """A cancel's undo of the step's token: the device first, so that a failure leaves the
        step open and the call retryable."""
        self._restore_newest_slots(c)
        self._undo_append(c)

    def _enter_shared(self, c: DecodeContext, action: str) -> Any | None:
        """On a shared host pool, an end or cancel is an operation of its own: refused on a
        failed pool; an end's backup (the writer's) waits for readers of recycled rows, a
        cancel's restore (every rank's) for the writer's rows."""
        shared = c.shared
        if shared is not None:
            shared.begin_op()
            shared.before_write() if action == "end" else shared.before_read()
        return shared

    def _exit_shared(self, c: DecodeContext, shared: Any | None, action: str,
                     wrote: bool, stream: Any | None = None) -> None:
        if shared is None:
            return
        if wrote and self.plan.writes_host_rows:
            shared.wrote(stream)  # published once the host-row writes on `stream` landed
        # The batch's ids were hashed at its begin: its size is enough here.
        shared.end_op(action, self.batch_size)

    def _settle_replays(self) -> None:
        """Before a cancel: every follower holds the rows its anchor's plan put in the group's
        tables, and the compute stream waits for side-stream replays nobody waited for."""
        for replay in self._anchored:
            replay.replay_owed()
        for replay in self._anchored:
            replay.wait_unwaited()

    def abandon(self) -> None:
        """The cache is closing under an open step: refuse every verb from now on."""
        self._state = StepState.CLOSED
        self._context = None

    def _mark_end(self, c: DecodeContext) -> None:
        """Mark where the step's device work ends (what slot release, reseeding, host-row
        writers and the step's backup wait for), after every replay it owes."""
        for replay in self._anchored:
            replay.wait_unwaited()
        c.order.step_end.mark()

    def _close(self, c: DecodeContext, state: StepState) -> None:
        """After `_mark_end`: let go of the cache."""
        for replay in self._anchored:
            replay.forget(self)
        self._state = state
        # An old step object the caller keeps must not keep the cache's tables alive.
        self._context = None
        self._records, self._anchored = [], []

    def _launch_backup(self) -> None:
        c = self._context
        assert c is not None
        b = c.buffers
        c.kernels.launch_backup(c.tables, b.newest_rows, b.newest_host_rows, b.num_real)

    def _restore_newest_slots(self, c: DecodeContext) -> None:
        """Give each long request's newest slot its previous token back from the host, in the
        layers `write_newest` overwrote."""
        H, S = c.tables.hot_slots, c.tables.slots_per_request
        newest = [(slot_of(r) * S + H, host_row_of(r, r.num_tokens - 2, c.tables.extent_tokens))
                  for r in self._records if r.num_tokens - 1 > H]
        if not newest or not self._written:
            return
        c.order.host_rows.drain()  # that row's backup may still be landing from a side stream
        device_rows = torch.tensor([d for d, _ in newest], dtype=torch.long, device=c.device)
        host_rows = torch.tensor([h for _, h in newest], dtype=torch.long)
        for layer in sorted(self._written):
            c.layer_kv[layer].index_copy_(
                0, device_rows, c.pool.layers[layer][host_rows].to(c.device))

    def _undo_append(self, c: DecodeContext) -> None:
        """Put every record and table back at the length before the step."""
        t, records, grew = c.tables, self._records, self._grew
        H, E = t.hot_slots, t.extent_tokens
        short = [(slot_of(r), r.num_tokens - 1, host_row_of(r, r.num_tokens - 1, E))
                 for r in records if r.num_tokens - 1 < H]
        uploaded = c.buffers.upload_columns(
            [[slot_of(r) for r in records], [r.num_tokens - 1 for r in records],
             [slot_of(r) for r in grew], [len(r.extents) - 1 for r in grew],
             *zip(*short, strict=True)]
        )
        t.seq_lens[uploaded[0].long()] = uploaded[1]
        if grew:
            t.page_table[uploaded[2].long(), uploaded[3].long()] = -1
        if short:
            # (the token's extent is its own: its key rows are its host rows)
            slot_index, hot_slot, row = (x.long() for x in uploaded[4:7])
            t.slot_key[:, slot_index, hot_slot] = -1
            t.resident[:, t.residency_keys(slot_index, hot_slot, row)] = -1
        for record in records:
            record.num_tokens -= 1
        for record in grew:
            c.pool.release(record.extents[-1:])
            record.extents.pop()
            c.slots.sync_pages(record)
        if grew:
            # Kernels of the step may still run; the freed extent held only the new token's
            # row, which they never read, but its next writer waits for them all the same.
            c.order.host_rows.note_rows_recycled()

    # --- refusals -------------------------------------------------------------------------
    def _usable(self, action: str) -> DecodeContext:
        """The context, if the step is open and the cache still decodes; else raise."""
        c = self._context
        if c is None:
            raise self._refusal(action)
        if c.kernels.failure is not None:
            c.kernels.check_usable(action)
        return c

    def _refusal(self, action: str) -> RequestStateError:
        if self._state is StepState.CLOSED:
            return RequestStateError("this HiSparseCache is closed; create a new one")
        return RequestStateError(
            f"cannot {action}: this decode step was {self._state.value} already; begin the "
            "next one with begin_decode_step(request_ids)"
        )


def wait_at_begin(plan: StepPlan, shared: Any | None) -> None:
    """A shared pool's waits before any step's begin: a reader's for the writer's rows of
    every earlier operation (every path reads them), and, where the writer's lookups back
    new rows up (before its end would wait), the writer's for readers of recycled rows."""
    if plan.wait_for_writer:
        shared.before_read()
    if plan.wait_for_readers_at_begin:
        shared.before_write()


def _install_table_updates(c: DecodeContext, batch: int, updates: dict[str, Any]) -> None:
    """Write the uploaded values into the tables: one index_copy_ for the lengths, one more
    where a request took an extent, two where a new token took its own short-regime slot."""
    t, b = c.tables, c.buffers
    views = b.views(batch)
    t.seq_lens.index_copy_(0, views.batch_slots, views.seq_lens)
    if "page_index" in updates:
        count = len(updates["page_index"])
        c.page_entries.index_copy_(0, b.field("page_index", count), b.field("page_extent", count))
    if "short_slot" in updates:
        count = len(updates["short_slot"])
        slot, hot = b.field("short_slot", count), b.field("short_hot", count)
        t.slot_key[:, slot, hot] = b.field("short_key_i32", count)
        t.resident[:, b.field("short_key", count)] = b.field("short_hot_resident", count)


def _check_moved_on(c: DecodeContext, plan: BatchPlan, rows: int) -> None:
    """Validate mode: a quiet step's buffers and lengths are what a plan would have sent."""
    if plan.full or plan.grow:
        raise AssertionError("a quiet step moved on a batch whose plan would refuse it or "
                             f"give it extents (full: {plan.full}, grow: {len(plan.grow)})")
    b, got = c.buffers, {}
    for name in ("req_slots", "newest_rows", "newest_host_rows", "new_seq_lens"):
        got[name] = b.field(name, rows).tolist()
    got["seq_lens"] = c.tables.seq_lens.cpu()[plan.slots.tolist()].tolist()
    columns = plan.columns()
    want = {name: np.asarray(columns[name]).tolist() for name in got if name != "seq_lens"}
    want["seq_lens"] = np.asarray(columns["new_seq_lens"]).tolist()
    if got != want:
        raise AssertionError(f"a quiet step's moved-on batch {got} is not its plan's {want}")


def _check_single_accepted(accepted: Any, batch_size: int) -> None:
    values = accepted.tolist() if isinstance(accepted, torch.Tensor) else accepted
    if not isinstance(values, (list, tuple)) or list(values) != [1] * batch_size:
        raise InvalidInputError(
            f"accepted={accepted!r:.200}: a single-token step keeps its one token per request; "
            f"pass None or {batch_size} ones (a verify step takes begin_decode_step(ids, "
            "num_tokens=S))")


def slot_of(record: RequestRecord) -> int:
    """The request slot of a record in a step (every running request has one)."""
    assert record.slot is not None
    return record.slot


def host_row_of(record: RequestRecord, position: int, extent_tokens: int) -> int:
    page, offset = divmod(position, extent_tokens)
    return record.extents[page] * extent_tokens + offset


def _anchor_needs_top_k(layer: int, replay: GroupReplay | None) -> InvalidInputError:
    if replay is None:
        return InvalidInputError(
            f"swap_in({layer}) needs its top_k ([B, K] int32 positions): with "
            "index_group_size=1 every layer plans its own swap-in; pass the layer's top-k"
        )
    last = replay.followers[-1] if replay.followers else layer
    return InvalidInputError(
        f"swap_in({layer}) needs its top_k ([B, K] int32 positions): layer {layer} is the "
        f"anchor of index group {replay.group} (layers {layer}..{last}) and plans the group's "
        f"swap-in; pass the group's top-k here (its followers may then leave it out)"
    )
