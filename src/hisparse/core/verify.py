"""The union path's executors (speculative decoding's verify steps, and dedupe steps): S tokens
per request, their top-k swapped in as one union per request, accept and roll back.

A step whose plan has `union` (core/step.py runs these): `begin_decode_step(ids,
num_tokens=S)` appends S tokens to each request (`append_union`): the step's first
token (the last accepted one) and S-1 drafts. They sit in the request's draft slots H..H+S-1,
which are never LRU victims; `write_newest(layer, kv [B, S, W])` writes them and
`swap_in(layer, top_k [B, S, K])` returns `[B, S, K]` rows through the union of the S rows
(`core.union`). `end(accepted=[a_b, ...])` keeps the first a_b tokens of each request
(`settle_union`, then `launch_union_commit`): all of
them are backed up to host, the last one moves into the newest-token slot H (or, while the
request is short, each into its own slot), and the rejected drafts are rolled back: length,
host extents taken for them and page-table entries. They never entered the LRU or the
residency map, so nothing else holds a trace of them. `cancel()` rolls back all S.

During the step the device `seq_lens` count all S tokens, so that the kernels accept every
older position as valid; the union hands them only positions before the step's first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hisparse.backends.base import Backend
from hisparse.core.batch import DeviceBlock
from hisparse.core.context import DecodeContext
from hisparse.core.requests import RequestRecord, host_row_of, slot_of
from hisparse.core.union import UnionWidth, build_width
from hisparse.errors import InvalidInputError
from hisparse.kernels.union_reference import presence_table
from hisparse.layout.index_schedule import IndexSchedule


@dataclass(eq=False)
class VerifyContext:
    """What every verify step of one cache shares: the per-S union launchers (built at the
    first step of each S) and the end's upload block (the begin's fields are the batch
    buffers' union fields, `core.batch.BatchBuffers`)."""

    backend: Backend
    max_draft_tokens: int  # D
    top_k: int
    schedule: IndexSchedule
    skip_io: bool
    device: torch.device
    end_block: DeviceBlock
    # (Bcap, positions): the presence table's, a column for every position a request's page
    # table can map (the larger of max_seq_len + D and P x E)
    table_shape: tuple[int, int]
    widths: dict[int, UnionWidth] = field(default_factory=dict)
    _table: torch.Tensor | None = None

    @classmethod
    def build(cls, config: Any, backend: Backend, c: DecodeContext) -> VerifyContext:
        D, cap = config.max_draft_tokens, c.batch_capacity
        sink = int(c.tables.device_kv.shape[1]) - 1
        i64, i32 = torch.int64, torch.int32
        end = DeviceBlock([
            ("commit_src", i64, cap * D, 0), ("commit_dst", i64, cap * D, 0),
            ("seq_slot", i64, cap, 0), ("page_reset", i64, cap * (D + 1), 0),
            ("short_slot", i64, cap * D, 0), ("short_hot", i64, cap * D, 0),
            ("short_key", i64, cap * D, 0), ("backup_rows", i32, cap * D, sink),
            ("backup_host", i32, cap * D, -1), ("backup_count", i32, 1, 0),
            ("seq_len", i32, cap, 0), ("short_key_i32", i32, cap * D, 0),
            ("short_hot_resident", c.tables.resident.dtype, cap * D, 0),
        ], c.device, backend)
        return cls(backend=backend, max_draft_tokens=D, top_k=config.top_k,
                   schedule=config.index_schedule, skip_io=config.skip_io,
                   device=c.device, end_block=end,
                   table_shape=(cap, max(c.max_seq_len + D, c.tables.positions_per_request)))

    def table(self) -> torch.Tensor:
        """The Triton swap-in's presence table (`union_reference.presence_table`), made at
        the first call that asks: one for every S (their swap-ins run in stream order)."""
        if self._table is None:
            self._table = presence_table(*self.table_shape, self.device)
        return self._table

    def width(self, c: DecodeContext, tokens: int) -> UnionWidth:
        width = self.widths.get(tokens)
        if width is None:
            buffers, rows = c.buffers, c.batch_capacity * tokens
            width = self.widths[tokens] = build_width(
                tokens, self.backend, c.kernels, c.tables, buffers.req_slots,
                buffers.num_real, buffers.field("first"), buffers.field("draft_base"),
                buffers.field("last_visible"),
                (buffers.field("draft_rows", rows), buffers.field("draft_rows_long", rows)),
                self.top_k, self.schedule, self.skip_io, c.prefetch_stream, self.table)
        return width


def append_union(c: DecodeContext, tokens: int, records: list[RequestRecord],
                 appends: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Append `tokens` tokens to each record (a ragged step: `appends[b]` to record b, 0..S):
    extents first, then one upload of the batch and table updates; a failure before the
    records change leaves nothing taken. Returns each record's first new position and how
    many extents it held before."""
    E = c.tables.extent_tokens
    # Numpy over the batch's slots, as a single-token step's plan (core.batch.BatchPlan):
    # per-request Python only for the requests that take extents.
    slots = c.slots.slots_of(records)
    first = c.slots.lengths[slots]
    count = tokens if appends is None else np.array(appends, dtype=np.int64)
    last = first + count
    if int(last.max()) > c.max_seq_len:
        full = [records[b].request_id for b in np.flatnonzero(last > c.max_seq_len).tolist()]
        left = (f"fewer than num_tokens={tokens} tokens left" if appends is None else
                "fewer tokens left than the rows they append")
        raise InvalidInputError(
            f"requests {full!r} have {left} before max_seq_len={c.max_seq_len}; verify "
            "fewer tokens, finish them or raise max_seq_len")
    before = c.slots.held[slots]
    need = np.maximum(0, -(-last // E) - before)
    c.pool.check_free(int(need.sum()))
    taken: dict[int, list[int]] = {}  # batch row -> the extents it takes, in row order
    try:
        for b in np.flatnonzero(need).tolist():
            previous = taken.get(b - 1)
            after = previous[-1] if previous else records[b].extents[-1]
            taken[b] = c.pool.allocate(int(need[b]), after=after)
        values = _begin_values(c, slots, first, before, taken, tokens, appends)
        c.order.backup.wait()
        c.order.tables_changed.wait()
        c.buffers.upload(values.pop("columns"), values, union=True)
    except BaseException:
        c.pool.release([e for extents in taken.values() for e in extents])
        raise
    for b, extents in taken.items():
        records[b].extents.extend(extents)
        c.slots.sync_pages(records[b])
    c.slots.add_tokens(slots, count)
    views = c.buffers.views(len(records))
    t = c.tables
    t.seq_lens.index_copy_(0, views.batch_slots, views.seq_lens)
    pages = sum(map(len, taken.values()))
    if pages:
        c.page_entries.index_copy_(0, c.buffers.field("page_index", pages),
                                   c.buffers.field("page_extent", pages))
    return first, before

def validate_union_positions(top_k: torch.Tensor, first: Sequence[int], tokens: int,
                             request_ids: Sequence[Any],
                             appends: Sequence[int] | None = None) -> None:
    """Every real entry of `top_k [B, S, K]` is -1 or a position up to its query token's own
    (a ragged step: any query of request b up to its last appended row, `first + a_b - 1`;
    a host sync; validate mode)."""
    real = top_k[: len(request_ids)].cpu().long()
    first_t = torch.tensor(list(first), dtype=torch.long)[:, None, None]
    if appends is None:
        own = (first_t + torch.arange(tokens)[None, :, None]).expand(-1, -1, 1)
    else:
        last = first_t + torch.tensor(list(appends), dtype=torch.long)[:, None, None] - 1
        own = last.expand(-1, tokens, 1)
    bad = (real < -1) | (real > own)
    if bool(bad.any()):
        b, s, k = (int(i) for i in bad.nonzero()[0])
        limit = int(own[b, s, 0])
        if appends is None:
            raise InvalidInputError(
                f"top_k[{b}, {s}, {k}] = {int(real[b, s, k])} is outside [-1, {limit}] for "
                f"query token {s} of request {request_ids[b]!r} (at position {limit}); a "
                "query token attends to positions up to its own, -1 for an empty entry")
        raise InvalidInputError(
            f"top_k[{b}, {s}, {k}] = {int(real[b, s, k])} is outside [-1, {limit}] for "
            f"request {request_ids[b]!r}, which appends {appends[b]} rows at "
            f"{int(first_t[b, 0, 0])} in this step; its queries select positions up to its "
            "last appended row, -1 for an empty entry")


def _as_counts(name: str, counts: Sequence[int] | torch.Tensor) -> list[Any]:
    """A list or tuple's or a 1-D integer tensor's values (a tensor read once)."""
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1 or counts.is_floating_point() or counts.is_complex():
            raise InvalidInputError(
                f"{name} must be a 1-D integer tensor or a list of ints, got a "
                f"{counts.dtype} tensor of shape {tuple(counts.shape)}")
        counts = counts.tolist()
    return list(counts) if isinstance(counts, list | tuple) else [counts]


def check_accepted(accepted: Sequence[int] | torch.Tensor | None, S: int, B: int
                   ) -> list[int]:
    """`end(accepted=...)`'s counts: one int in 1..S per request (None: all S)."""
    if accepted is None:
        return [S] * B
    values = _as_counts("accepted", accepted)
    # Python ints (not bools, floats or numpy scalars) in 1..S, checked at C speed.
    if (len(values) != B or set(map(type, values)) != {int}
            or min(values) < 1 or max(values) > S):
        if S == 1:
            raise InvalidInputError(
                f"accepted={values!r:.200}: a single-token step keeps its one token per "
                f"request; pass None or {B} ones (a verify step takes "
                "begin_decode_step(ids, num_tokens=S))")
        raise InvalidInputError(
            f"accepted must list one int in 1..{S} (num_tokens) per request of the step "
            f"({B} requests), got {values!r:.200}; the first token of a verify step is "
            "always accepted")
    return values


def check_kept(accepted: Sequence[int] | torch.Tensor | None, appends: Sequence[int]
               ) -> list[int]:
    """A ragged verify step's `end(accepted=...)`: the rows each request keeps, an int in
    0..appends[b] (None: all it appended)."""
    if accepted is None:
        return list(appends)
    values = _as_counts("accepted", accepted)
    if len(values) != len(appends):
        raise InvalidInputError(
            f"accepted must list one int per request of the step ({len(appends)} requests), "
            f"got {values!r:.200}; pass the rows each request keeps, in the batch's order")
    for b, (value, appended) in enumerate(zip(values, appends, strict=True)):
        if type(value) is not int or not 0 <= value <= appended:
            raise InvalidInputError(
                f"accepted[{b}] = {value!r}: request {b} of the step appended {appended} "
                f"rows, so it keeps an int in 0..{appended}; pass the rows it keeps")
    return values


def settle_union(c: DecodeContext, v: VerifyContext, records: list[RequestRecord],
                 first_positions: Sequence[int], extents_before: Sequence[int],
                 appended: int | Sequence[int], accepted: list[int]) -> tuple[int, int]:
    """Table and record updates for `accepted` of the rows each request appended
    (`appended`: S each, or a ragged step's counts; accepted 0: a cancel). Returns how many
    rows to back up and to move, uploaded to the end block."""
    slots = c.slots.slots_of(records)
    kept = np.asarray(accepted, dtype=np.int64)
    first = np.asarray(first_positions, dtype=np.int64)
    if len(records) <= 8 or ((first + kept <= c.tables.hot_slots) & (kept > 0)).any():
        # A few requests (a loop costs less than numpy's ~15 calls), or one still short:
        # each kept token moves into its own slot (rare enough for the loop).
        values, released = _end_values(c, records, list(first_positions),
                                       list(extents_before), accepted)
    else:
        values, released = _long_end_values(c, records, slots, first, kept,
                                            list(extents_before))
    block = v.end_block
    block.upload(values)
    t = c.tables
    count = len(records)
    t.seq_lens.index_copy_(0, block.field("seq_slot", count), block.field("seq_len", count))
    resets = len(values["page_reset"])
    if resets:
        # index_fill_ hands -1 to its kernel; `entries[index] = -1` on CUDA first copies it
        # from pageable host memory, which waits for the stream (a host sync in such an end).
        c.page_entries.index_fill_(0, block.field("page_reset", resets), -1)
    short = len(values["short_slot"])
    if short:
        slot, hot = block.field("short_slot", short), block.field("short_hot", short)
        t.slot_key[:, slot, hot] = block.field("short_key_i32", short)
        t.resident[:, block.field("short_key", short)] = block.field(
            "short_hot_resident", short)
    if type(appended) is not int:
        appended = np.asarray(appended, dtype=np.int64)
    c.slots.add_tokens(slots, kept - appended)  # first + kept each
    for record, extents in zip(records, released, strict=True):
        if extents:
            del record.extents[-len(extents):]
            c.slots.sync_pages(record)
    freed = [e for extents in released for e in extents]
    if freed:
        c.pool.release(freed)
        c.order.host_rows.note_rows_recycled()
    return len(values["backup_rows"]), len(values["commit_src"])

def launch_union_commit(c: DecodeContext, v: VerifyContext, writes_host_rows: bool,
                        commits: int) -> None:
    """Back the accepted tokens up from their draft slots, then move the rows that must
    live elsewhere: after the backup, since the newest slot H is draft slot 0."""
    block = v.end_block
    if writes_host_rows:  # (a reader leaves the backup to the writer)
        c.kernels.launch_backup(c.tables, block.field("backup_rows"),
                                block.field("backup_host"), block.field("backup_count"))
    if commits:
        kv = c.tables.device_kv
        kv[:, block.field("commit_dst", commits)] = kv[:, block.field("commit_src", commits)]


def check_num_tokens(num_tokens: object, dedupe: object, max_draft_tokens: int) -> None:
    """`begin_decode_step`'s `num_tokens` and `dedupe`, before anything changes."""
    D = max_draft_tokens
    if type(num_tokens) is not int or not 1 <= num_tokens <= D:
        raise InvalidInputError(
            f"num_tokens must be an int in 1..{D} (max_draft_tokens), got {num_tokens!r}; "
            "to verify more tokens a step, set max_draft_tokens to at least that in the "
            "config (and hot_slots >= max_draft_tokens x top_k)")
    if not isinstance(dedupe, bool):
        raise InvalidInputError(f"dedupe must be True or False, got {dedupe!r}")


def _begin_values(c: DecodeContext, slots: np.ndarray, first: np.ndarray, before: np.ndarray,
                  taken: dict[int, list[int]], tokens: int,
                  appends: tuple[int, ...] | None) -> dict[str, Any]:
    """The batch buffers' columns and union fields for a verify step: each
    request's draft slots, its first token's host row, and the page entries it takes. In a
    ragged step a request's rows past its count go to the sink row, and every query may
    select up to its last appended row (`last_visible`; -1: each up to its own)."""
    t = c.tables
    H, SPR, E = t.hot_slots, t.slots_per_request, t.extent_tokens
    P = int(t.page_table.shape[1])
    base = slots * SPR + H
    draft = base[:, None] + np.arange(tokens)
    page = first // E
    if appends is not None:  # (a full request appending nothing has no page there)
        np.minimum(page, c.slots.pages.shape[1] - 1, out=page)
    extent = c.slots.pages[slots, page]  # -1 where the first token starts a taken extent
    page_index, page_extent = [], []
    for b, extents in taken.items():
        held = int(before[b])
        page_index += [int(slots[b]) * P + held + i for i in range(len(extents))]
        page_extent += extents
        if page[b] >= held:
            extent[b] = extents[page[b] - held]
    host = extent * E + first % E
    lengths = first + tokens
    if appends is not None:
        count = np.array(appends, dtype=np.int64)
        draft[np.arange(tokens) >= count[:, None]] = int(t.device_kv.shape[1]) - 1
        host[count == 0] = -1
        lengths = first + count
    columns = {"req_slots": slots, "batch_slots": slots, "num_real": [len(slots)],
               "newest_rows": base, "newest_rows_long": base, "newest_host_rows": host,
               "new_seq_lens": lengths}
    draft = draft.reshape(-1)
    values = {"columns": columns, "draft_rows_long": draft, "draft_rows": draft,
              "first": first, "draft_base": base, "page_index": page_index,
              "page_extent": page_extent}
    if appends is not None:  # (else every row keeps its padding, -1)
        values["last_visible"] = lengths - 1
    return values


def _long_end_values(c: DecodeContext, records: list[RequestRecord], slots: np.ndarray,
                     first: np.ndarray, kept: np.ndarray, extents_before: list[int]
                     ) -> tuple[dict[str, Any], list[list[int]]]:
    """`_end_values` for a batch whose requests are all long after the step (or keep no
    token): numpy over the slots, per-request Python only for those giving extents back."""
    t = c.tables
    H, SPR, E = t.hot_slots, t.slots_per_request, t.extent_tokens
    P = int(t.page_table.shape[1])
    last = first + kept
    keep = np.maximum(np.asarray(extents_before, dtype=np.int64), -(-last // E))
    held = c.slots.held[slots]
    released: list[list[int]] = [[] for _ in records]
    page_reset: list[int] = []
    for b in np.flatnonzero(keep < held).tolist():
        released[b] = records[b].extents[keep[b]:]
        page_reset += [int(slots[b]) * P + page for page in range(keep[b], held[b])]
    draft = slots * SPR + H
    token = np.arange(max(1, int(kept.max())))
    mask = token[None, :] < kept[:, None]  # the kept tokens, request by request
    position = (first[:, None] + token)[mask]
    backup_host = (c.slots.pages[np.broadcast_to(slots[:, None], mask.shape)[mask],
                                 position // E] * E + position % E)
    moved = kept > 1  # the last kept token is the next step's newest, in slot H
    none: list[int] = []
    values = {"seq_slot": slots, "seq_len": last, "page_reset": page_reset,
              "backup_rows": (draft[:, None] + token)[mask], "backup_host": backup_host,
              "commit_src": (draft + kept - 1)[moved], "commit_dst": draft[moved],
              "short_slot": none, "short_hot": none, "short_key": none,
              "backup_count": [int(mask.sum())], "short_key_i32": none,
              "short_hot_resident": none}
    return values, released


def _end_values(c: DecodeContext, records: list[RequestRecord], first: list[int],
                extents_before: list[int], accepted: list[int]
                ) -> tuple[dict[str, list[int]], list[list[int]]]:
    """The end block's fields for `accepted` tokens per request, and the extents each record
    gives back (those taken by the step that hold no accepted token)."""
    t = c.tables
    H, SPR, E = t.hot_slots, t.slots_per_request, t.extent_tokens
    P = int(t.page_table.shape[1])
    v: dict[str, list[int]] = {name: [] for name in (
        "seq_slot", "seq_len", "page_reset", "backup_rows", "backup_host", "commit_src",
        "commit_dst", "short_slot", "short_hot", "short_key")}
    released = []
    for record, n0, before, a in zip(records, first, extents_before, accepted, strict=True):
        slot, n1 = slot_of(record), n0 + a
        draft = slot * SPR + H
        keep = max(before, -(-n1 // E))
        released.append(record.extents[keep:])
        v["page_reset"] += [slot * P + page for page in range(keep, len(record.extents))]
        v["seq_slot"].append(slot)
        v["seq_len"].append(n1)
        for s in range(a):
            v["backup_rows"].append(draft + s)
            v["backup_host"].append(host_row_of(record, n0 + s, E))
        if n1 <= H:  # short: every token in its own slot, tracked for the switch to long
            for s in range(a):
                position = n0 + s
                v["commit_src"].append(draft + s)
                v["commit_dst"].append(slot * SPR + position)
                v["short_slot"].append(slot)
                v["short_hot"].append(position)
                # (a kept token is in an extent of its own: its key row is its host row)
                v["short_key"].append(int(t.residency_keys(
                    slot, position, host_row_of(record, position, E))))
        elif a > 1:  # the last accepted token is the next step's newest, in slot H
            v["commit_src"].append(draft + a - 1)
            v["commit_dst"].append(draft)
    v["backup_count"] = [len(v["backup_rows"])]
    v["short_key_i32"] = v["short_key"]
    v["short_hot_resident"] = v["short_hot"]
    return v, released


