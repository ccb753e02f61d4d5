"""The single-token path's executors: append one token to each request (planned and uploaded,
or, for an unchanged batch, moved on by one device launch) and take it back (a cancel); the
end's backup is `DecodeContext.back_up_newest`. The step (core/step.py) runs them where its
plan says `union` is False; core/verify.py holds the union path's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hisparse.core.batch import BatchPlan, QuietRun
from hisparse.core.context import DecodeContext
from hisparse.core.requests import RequestRecord, host_row_of, slot_of
from hisparse.errors import InvalidInputError


def append_one(c: DecodeContext, records: list[RequestRecord],
               appends: np.ndarray | None = None) -> tuple[np.ndarray, list[RequestRecord]]:
    """Append one token to each record and upload the step's batch and table updates; the
    new tokens' positions and the records that took an extent for theirs (a quiet batch,
    where the plan allows it, takes `move_on` instead). `appends` (a ragged step, always
    planned): each record's count, 0 or 1; one of 0 appends nothing.

    The records change only once the updates are on their way to the device: a failed
    upload (a device out of memory) leaves nothing changed and the step retryable.
    """
    c.quiet = None
    batch = BatchPlan(records, c.slots, c.tables, c.max_seq_len, appends)
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
    # every record's num_tokens (they read this array)
    c.slots.lengths[batch.slots] += 1 if appends is None else appends
    _install_table_updates(c, len(records), updates)
    c.quiet = QuietRun.after(batch, records, c.buffers.block)
    return batch.positions, grew


def move_on(c: DecodeContext, run: QuietRun, records: list[RequestRecord]) -> np.ndarray:
    """One token for each record of a quiet step (`run.holds_for` them): the last step's
    batch buffers moved on on the device; the new tokens' positions."""
    expected = BatchPlan(records, c.slots, c.tables, c.max_seq_len) if c.validate else None
    c.order.backup.wait()  # the last backup reads the host rows this moves on
    c.order.tables_changed.wait()
    c.kernels.launch_advance(len(records))
    positions = run.step()
    c.slots.lengths[run.slots] += 1
    if expected is not None:
        _check_moved_on(c, expected, len(records))
    return positions


def undo_one(c: DecodeContext, records: list[RequestRecord], grew: list[RequestRecord]
             ) -> None:
    """A cancel: every record and table back at the length before the step (`records`: those
    that appended a token; `grew`: those that took an extent for it)."""
    if not records:
        return
    t = c.tables
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
