"""A verify step (speculative decoding): S tokens per request, union swap-in, accept/rollback.

`begin_decode_step(ids, num_tokens=S)` appends S tokens to each request: the step's first
token (the last accepted one) and S-1 drafts. They sit in the request's draft slots H..H+S-1,
which are never LRU victims; `write_newest(layer, kv [B, S, W])` writes them and
`swap_in(layer, top_k [B, S, K])` returns `[B, S, K]` rows through the union of the S rows
(`core.union`). `end(accepted=[a_b, ...])` keeps the first a_b tokens of each request: all of
them are backed up to host, the last one moves into the newest-token slot H (or, while the
request is short, each into its own slot), and the rejected drafts are rolled back: length,
host extents taken for them and page-table entries. They never entered the LRU or the
residency map, so nothing else holds a trace of them. `cancel()` rolls back all S.

During the step the device `seq_lens` count all S tokens, so that the kernels accept every
older position as valid; the union hands them only positions before the step's first token.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hisparse.backends.base import Backend
from hisparse.core.batch import DeviceBlock
from hisparse.core.plan import StepPlan
from hisparse.core.requests import RequestRecord
from hisparse.core.step import DecodeContext, DecodeStep, StepState, host_row_of, slot_of
from hisparse.core.union import UnionWidth, build_width
from hisparse.core.validation import (
    as_rows,
    check_batch_rows,
    check_layer,
    check_tensor,
    is_plain_tensor,
)
from hisparse.errors import InvalidInputError
from hisparse.kernels.union_reference import presence_table
from hisparse.layout.index_schedule import IndexSchedule


@dataclass(eq=False)
class VerifyContext:
    """What every verify step of one cache shares: the per-S union launchers (built at the
    first step of each S) and the two upload blocks (the step's begin, and its end)."""

    backend: Backend
    max_draft_tokens: int  # D
    top_k: int
    schedule: IndexSchedule
    skip_io: bool
    zero_copy: bool
    begin_block: DeviceBlock
    end_block: DeviceBlock
    # (Bcap, positions): the presence table's, a column for every position a request's page
    # table can map (max_seq_len + D, rounded up to whole extents)
    table_shape: tuple[int, int]
    widths: dict[int, UnionWidth] = field(default_factory=dict)
    _table: torch.Tensor | None = None

    @classmethod
    def build(cls, config: Any, backend: Backend, c: DecodeContext) -> VerifyContext:
        D, cap = config.max_draft_tokens, c.batch_capacity
        sink = int(c.tables.device_kv.shape[1]) - 1
        i64, i32 = torch.int64, torch.int32
        begin = DeviceBlock([
            ("draft_rows_long", i64, cap * D, sink), ("first", i64, cap, 0),
            ("draft_base", i64, cap, 0), ("page_index", i64, cap * D, 0),
            ("draft_rows", i32, cap * D, sink), ("page_extent", i32, cap * D, 0),
        ], c.device, backend)
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
                   zero_copy=bool(config.zero_copy_swap_in), begin_block=begin, end_block=end,
                   table_shape=(cap, max(c.max_seq_len + D, c.tables.positions_per_request)))

    def table(self) -> torch.Tensor:
        """The Triton swap-in's presence table (`union_reference.presence_table`), made at
        the first call that asks: one for every S (their swap-ins run in stream order)."""
        if self._table is None:
            self._table = presence_table(*self.table_shape, self.begin_block.field("first").device)
        return self._table

    def width(self, c: DecodeContext, tokens: int) -> UnionWidth:
        width = self.widths.get(tokens)
        if width is None:
            block = self.begin_block
            width = self.widths[tokens] = build_width(
                tokens, self.backend, c.kernels, c.tables, c.buffers.req_slots,
                c.buffers.num_real, block.field("first"), block.field("draft_base"),
                (block.field("draft_rows", c.batch_capacity * tokens),
                 block.field("draft_rows_long", c.batch_capacity * tokens)),
                self.top_k, self.schedule, self.skip_io, self.zero_copy,
                c.prefetch_stream, self.table)
        return width


class VerifyStep(DecodeStep):
    """A decode step of S tokens per request (S = 1: a single-token step whose top-k is
    de-duplicated, taking the same path).

    Public beyond `DecodeStep`'s: `num_tokens` (S); `positions` is `[B][S]` (a tuple per
    request) when S > 1 and `newest_rows` the `[Bcap, S]` int32 device rows of the S tokens.
    """

    def __init__(self, context: DecodeContext, verify: VerifyContext, plan: StepPlan,
                 request_ids: tuple[Hashable, ...], records: list[RequestRecord],
                 first: list[int], extents_before: list[int]) -> None:
        tokens = plan.num_tokens
        positions: tuple[Any, ...] = (
            tuple(map(tuple, (np.asarray(first)[:, None] + np.arange(tokens)).tolist()))
            if tokens > 1 else tuple(first))
        super().__init__(context, plan, request_ids, positions, records, [])
        self.num_tokens = tokens
        self._verify = verify
        self._width = verify.width(context, tokens)
        self._first = first
        self._extents_before = extents_before
        block = verify.begin_block
        cap = context.batch_capacity
        rows = block.field("draft_rows", cap * tokens)
        self.newest_rows = rows.view(cap, tokens) if tokens > 1 else rows

    # --- opening --------------------------------------------------------------------------
    @classmethod
    def begin_verify(cls, c: DecodeContext, v: VerifyContext, plan: StepPlan,
                     request_ids: tuple[Hashable, ...], records: list[RequestRecord]
                     ) -> VerifyStep:
        """Append `plan.num_tokens` tokens to each record: extents first, then one upload of
        the batch and table updates; a failure before the records change leaves nothing
        taken."""
        E, tokens = c.tables.extent_tokens, plan.num_tokens
        # Numpy over the batch's slots, as a single-token step's plan (core.batch.BatchPlan):
        # per-request Python only for the requests that take extents.
        slots = c.slots.slots_of(records)
        first = c.slots.lengths[slots]
        if int(first.max()) + tokens > c.max_seq_len:
            full = [records[b].request_id
                    for b in np.flatnonzero(first + tokens > c.max_seq_len).tolist()]
            raise InvalidInputError(
                f"requests {full!r} have fewer than num_tokens={tokens} tokens left before "
                f"max_seq_len={c.max_seq_len}; verify fewer tokens, finish them or raise "
                "max_seq_len")
        before = c.slots.held[slots]
        need = np.maximum(0, -(-(first + tokens) // E) - before)
        c.pool.check_free(int(need.sum()))
        taken: dict[int, list[int]] = {}  # batch row -> the extents it takes, in row order
        try:
            for b in np.flatnonzero(need).tolist():
                previous = taken.get(b - 1)
                after = previous[-1] if previous else records[b].extents[-1]
                taken[b] = c.pool.allocate(int(need[b]), after=after)
            values = _begin_values(c, slots, first, before, taken, tokens)
            c.order.backup.wait()
            c.order.tables_changed.wait()
            c.buffers.upload(values.pop("columns"))
            v.begin_block.upload(values)
        except BaseException:
            c.pool.release([e for extents in taken.values() for e in extents])
            raise
        for b, extents in taken.items():
            records[b].extents.extend(extents)
            c.slots.sync_pages(records[b])
        c.slots.add_tokens(slots, tokens)
        views = c.buffers.views(len(records))
        t = c.tables
        t.seq_lens.index_copy_(0, views.batch_slots, views.seq_lens)
        pages = sum(map(len, taken.values()))
        if pages:
            c.page_entries.index_copy_(0, v.begin_block.field("page_index", pages),
                                       v.begin_block.field("page_extent", pages))
        return cls(c, v, plan, request_ids, records, first.tolist(), before.tolist())

    # --- per layer ------------------------------------------------------------------------
    def write_newest(self, layer: int, kv: torch.Tensor) -> None:
        """Write the step's S tokens of `layer`: `kv [B, S, W]` (`[B, W]` when S = 1), B
        between the step's request count and `max_batch` (padding rows go to the sink)."""
        c = self._usable("write_newest")
        check_layer(layer, c.num_layers)
        S = self.num_tokens
        # The usual call (dense uint8 [B, S, W] on our device) passes attribute reads, as a
        # single-token step's does; any other goes through `as_rows`'s checks and messages.
        shape = (S, c.row_bytes) if S > 1 else (c.row_bytes,)
        if not (is_plain_tensor(kv, torch.uint8, len(shape) + 1, c.device, contiguous=False)
                and tuple(kv.shape[1:]) == shape):
            kv = as_rows("kv", kv, c.row_bytes, len(shape) + 1, device=c.device)
            if S > 1 and kv.shape[1] != S:
                raise InvalidInputError(
                    f"kv has {kv.shape[1]} tokens per request, the verify step appends "
                    f"num_tokens={S}; pass kv as [B, {S}, W]")
        count = kv.shape[0]
        if not self.batch_size <= count <= c.batch_capacity:
            check_batch_rows("kv", count, self.batch_size, c.batch_capacity)
        # The backend's newest writer over the draft slots (one bound launch on the GPUs).
        self._width.kernels.write_newest(layer, kv.reshape(count * S, c.row_bytes))
        self._written.add(layer)

    def swap_in(self, layer: int, top_k: torch.Tensor | None = None,
                newest_kv: torch.Tensor | None = None) -> torch.Tensor:
        """`[B, S, K]` int32 device rows for `top_k [B, S, K]` (`[B, K]` when S = 1): query
        token s of request b may select any position up to its own, `positions[b][s]`; a
        position listed several times, in one row or several, is looked up and loaded once.
        The step's own tokens come from their draft slots. -1 for none, invalid (below -1 or
        after the query token) and padding. A follower of an index group gets its anchor's.
        `newest_kv`: the layer's draft rows, as `write_newest` takes them, written first.
        """
        c = self._usable("swap_in")
        check_layer(layer, c.num_layers)
        width = self._width
        group = c.layer_group[layer]
        replay = width.replays[group]
        if replay is not None and layer != replay.anchor:
            out = self._follow(c, layer, replay, top_k, self._check_verify_top_k)
            if newest_kv is not None:
                self.write_newest(layer, newest_kv)
            return out
        if top_k is None:
            raise InvalidInputError(
                f"swap_in({layer}) needs its top_k ([B, S, K] int32 positions): layer {layer} "
                "plans its own swap-in (it is no follower of an index group)")
        rows, checked = self._check_verify_top_k(c, top_k)
        if c.validate:
            self._validate_positions(checked if self.num_tokens > 1 else checked[:, None])
        if newest_kv is not None:  # its own launch here: the union's lookup has other widths
            self.write_newest(layer, newest_kv)
        if replay is not None:
            replay.begin_plan()
        union_top_k, outs, singles = width.views(rows)
        kernels = width.kernels
        if kernels.fuses_union:
            kernels.launch_swap_in(layer, group, rows, checked.view(rows, -1))
        else:
            # Around the swap-in (kernels.union_reference): the union row and inverse
            # codes, then the rows back to [B, S, K] and the extra counts.
            kernels.launch_union_plan(rows, checked)
            kernels.launch_swap_in(layer, group, rows, union_top_k)
            kernels.launch_union_scatter(layer, group, rows)
        result = outs[group] if self.num_tokens > 1 else singles[group]
        self._finish_anchor(replay, top_k, result)
        return result

    def _check_verify_top_k(self, c: DecodeContext, top_k: object) -> tuple[int, torch.Tensor]:
        S, K = self.num_tokens, self._verify.top_k
        ndim = 3 if S > 1 else 2
        if is_plain_tensor(top_k, torch.int32, ndim, c.device):
            rows = top_k.shape[0]
            if (tuple(top_k.shape[1:]) == ((S, K) if S > 1 else (K,))
                    and self.batch_size <= rows <= c.batch_capacity):
                return rows, top_k
        top_k = check_tensor("top_k", top_k, dtype=torch.int32, device=c.device, ndim=ndim)
        rows = top_k.shape[0]
        check_batch_rows("top_k", rows, self.batch_size, c.batch_capacity)
        if tuple(top_k.shape[1:]) != ((S, K) if S > 1 else (K,)):
            want = f"[B, {S}, {K}]" if S > 1 else f"[B, {K}]"
            raise InvalidInputError(
                f"top_k has shape {tuple(top_k.shape)}; this verify step of num_tokens={S} on "
                f"a cache built for top_k={K} takes {want} (pad rows with -1)")
        return rows, top_k

    def _validate_positions(self, top_k: torch.Tensor) -> None:
        """Every real entry is -1 or a position up to its query token's own (host sync)."""
        real = top_k[: self.batch_size].cpu().long()
        first = torch.tensor(self._first, dtype=torch.long)[:, None, None]
        own = first + torch.arange(self.num_tokens)[None, :, None]
        bad = (real < -1) | (real > own)
        if bool(bad.any()):
            b, s, k = (int(i) for i in bad.nonzero()[0])
            raise InvalidInputError(
                f"top_k[{b}, {s}, {k}] = {int(real[b, s, k])} is outside [-1, "
                f"{int(own[b, s, 0])}] for query token {s} of request {self.request_ids[b]!r} "
                f"(at position {int(own[b, s, 0])}); a query token attends to positions up "
                "to its own, -1 for an empty entry")

    # --- closing --------------------------------------------------------------------------
    def end(self, accepted: Sequence[int] | torch.Tensor | None = None) -> None:
        """Keep the first `accepted[b]` tokens of request b (1..S; None: all S), back them up
        and roll the rejected drafts back. A device tensor is read once (a host sync)."""
        with self._lock:
            c = self._usable("end_decode_step")
            counts = self._check_accepted(accepted)
            self._prepare_end(c)
            shared = self._enter_shared(c, "end")
            backups, commits = self._settle(c, counts)
            self._mark_end(c)
            c.order.backup.issue(lambda: self._launch_commit(c, backups, commits),
                                 c.order.step_end)
            c.traffic.backed_up_tokens += backups
            self._close(c, StepState.ENDED)
            self._exit_shared(c, shared, f"end{counts}", wrote=True,  # `accepted` counts
                              stream=c.order.backup.stream)

    def _roll_back(self, c: DecodeContext) -> None:
        """A cancel rolls back all S tokens of every request; the newest slot gets its token
        back."""
        self._restore_newest_slot(c)
        self._settle(c, [0] * self.batch_size)

    def _check_accepted(self, accepted: Sequence[int] | torch.Tensor | None) -> list[int]:
        S, B = self.num_tokens, self.batch_size
        if accepted is None:
            return [S] * B
        if isinstance(accepted, torch.Tensor):
            if accepted.dim() != 1 or accepted.is_floating_point() or accepted.is_complex():
                raise InvalidInputError(
                    f"accepted must be a 1-D integer tensor or a list of ints, got a "
                    f"{accepted.dtype} tensor of shape {tuple(accepted.shape)}")
            accepted = accepted.tolist()
        values = list(accepted) if isinstance(accepted, list | tuple) else [accepted]
        # Python ints (not bools, floats or numpy scalars) in 1..S, checked at C speed.
        if (len(values) != B or set(map(type, values)) != {int}
                or min(values) < 1 or max(values) > S):
            raise InvalidInputError(
                f"accepted must list one int in 1..{S} (num_tokens) per request of the step "
                f"({B} requests), got {values!r:.200}; the first token of a verify step is "
                "always accepted")
        return values

    def _settle(self, c: DecodeContext, accepted: list[int]) -> tuple[int, int]:
        """Table and record updates for `accepted` tokens per request (0: a cancel). Returns
        how many rows to back up and to move, uploaded to the end block."""
        records = self._records
        slots = c.slots.slots_of(records)
        kept = np.asarray(accepted, dtype=np.int64)
        first = np.asarray(self._first, dtype=np.int64)
        if len(records) <= 8 or ((first + kept <= c.tables.hot_slots) & (kept > 0)).any():
            # A few requests (a loop costs less than numpy's ~15 calls), or one still short:
            # each kept token moves into its own slot (rare enough for the loop).
            values, released = _end_values(c, records, self._first, self._extents_before,
                                           accepted)
        else:
            values, released = _long_end_values(c, records, slots, first, kept,
                                                self._extents_before)
        block = self._verify.end_block
        block.upload(values)
        t = c.tables
        count = len(self._records)
        t.seq_lens.index_copy_(0, block.field("seq_slot", count), block.field("seq_len", count))
        resets = len(values["page_reset"])
        if resets:
            c.page_entries[block.field("page_reset", resets)] = -1
        short = len(values["short_slot"])
        if short:
            slot, hot = block.field("short_slot", short), block.field("short_hot", short)
            t.slot_key[:, slot, hot] = block.field("short_key_i32", short)
            t.resident[:, block.field("short_key", short)] = block.field(
                "short_hot_resident", short)
        c.slots.add_tokens(slots, kept - self.num_tokens)  # first + kept each
        for record, extents in zip(records, released, strict=True):
            if extents:
                del record.extents[-len(extents):]
                c.slots.sync_pages(record)
        freed = [e for extents in released for e in extents]
        if freed:
            c.pool.release(freed)
            c.order.host_rows.note_rows_recycled()
        return len(values["backup_rows"]), len(values["commit_src"])

    def _launch_commit(self, c: DecodeContext, backups: int, commits: int) -> None:
        """Back the accepted tokens up from their draft slots, then move the rows that must
        live elsewhere: after the backup, since the newest slot H is draft slot 0."""
        block = self._verify.end_block
        if self.plan.writes_host_rows:  # (a reader leaves the backup to the writer)
            c.kernels.launch_backup(c.tables, block.field("backup_rows"),
                                    block.field("backup_host"), block.field("backup_count"))
        if commits:
            kv = c.tables.device_kv
            kv[:, block.field("commit_dst", commits)] = kv[:, block.field("commit_src", commits)]

    def _restore_newest_slot(self, c: DecodeContext) -> None:
        """Give slot H of each request that was long before the step its newest token back
        from the host in the layers `write_newest` overwrote (draft slot 0 is slot H)."""
        H, SPR, E = c.tables.hot_slots, c.tables.slots_per_request, c.tables.extent_tokens
        pairs = [(slot_of(r) * SPR + H, host_row_of(r, n - 1, E))
                 for r, n in zip(self._records, self._first, strict=True) if n > H]
        if not pairs or not self._written:
            return
        c.order.host_rows.drain()
        device_rows = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=c.device)
        host_rows = torch.tensor([h for _, h in pairs], dtype=torch.long)
        for layer in sorted(self._written):
            c.layer_kv[layer].index_copy_(
                0, device_rows, c.pool.layers[layer][host_rows].to(c.device))


def check_num_tokens(num_tokens: object, dedupe: object, max_draft_tokens: int) -> None:
    """`begin_decode_step`'s `num_tokens` and `dedupe`, before anything changes."""
    D = max_draft_tokens
    if type(num_tokens) is not int or not 1 <= num_tokens <= D:
        raise InvalidInputError(
            f"num_tokens must be an int in 1..{D} (max_draft_tokens), got {num_tokens!r}; "
            "build the cache with max_draft_tokens >= the tokens a verify step appends (and "
            "hot_slots >= max_draft_tokens x top_k)")
    if not isinstance(dedupe, bool):
        raise InvalidInputError(f"dedupe must be True or False, got {dedupe!r}")


def _begin_values(c: DecodeContext, slots: np.ndarray, first: np.ndarray, before: np.ndarray,
                  taken: dict[int, list[int]], tokens: int) -> dict[str, Any]:
    """The begin block's fields and the batch buffers' columns for a verify step: each
    request's draft slots, its first token's host row, and the page entries it takes."""
    t = c.tables
    H, SPR, E = t.hot_slots, t.slots_per_request, t.extent_tokens
    P = int(t.page_table.shape[1])
    base = slots * SPR + H
    draft = (base[:, None] + np.arange(tokens)).reshape(-1)
    page = first // E
    extent = c.slots.pages[slots, page]  # -1 where the first token starts a taken extent
    page_index, page_extent = [], []
    for b, extents in taken.items():
        held = int(before[b])
        page_index += [int(slots[b]) * P + held + i for i in range(len(extents))]
        page_extent += extents
        if page[b] >= held:
            extent[b] = extents[page[b] - held]
    host = extent * E + first % E
    columns = {"req_slots": slots, "batch_slots": slots, "num_real": [len(slots)],
               "newest_rows": base, "newest_rows_long": base, "newest_host_rows": host,
               "new_seq_lens": first + tokens}
    return {"columns": columns, "draft_rows_long": draft, "draft_rows": draft, "first": first,
            "draft_base": base, "page_index": page_index, "page_extent": page_extent}


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


