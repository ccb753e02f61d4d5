"""A decode step: its batch, what it has done so far, and the verbs that drive it.

`HiSparseCache.begin_decode_step(ids, num_tokens=S)` returns a `DecodeStep`; the model thread
then calls `write_newest(layer, kv)` and `swap_in(layer, top_k)` per layer and `end()` (or
`cancel()` after a forward pass that failed). One class for every step: its `plan`
(core/plan.py) says which path each verb takes, and the two paths' executors live beside it:
one token per request, its top-k a row per request (core/single.py), or S tokens, or one
de-duplicated, swapped in as one union per request (core/verify.py). Everything that lives
for one step lives here; what all steps of a cache share is its `DecodeContext`.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from hisparse.core.context import DecodeContext
from hisparse.core.plan import StepPlan
from hisparse.core.replay import GroupReplay
from hisparse.core.requests import RequestRecord, host_row_of, slot_of
from hisparse.core.single import append_one, move_on, undo_one
from hisparse.core.validation import (
    as_rows,
    check_batch_rows,
    check_layer,
    check_positions_against_lengths,
    check_tensor,
    is_plain_tensor,
)
from hisparse.core.verify import (
    VerifyContext,
    append_union,
    check_accepted,
    check_kept,
    launch_union_commit,
    settle_union,
    validate_union_positions,
)
from hisparse.errors import InvalidInputError, RequestStateError


class StepState(enum.Enum):
    OPEN = "open"
    ENDED = "ended"
    CANCELLED = "cancelled"
    CLOSED = "closed"  # the cache was closed while the step was open


class DecodeStep:
    """One decode step of a batch of running requests, `num_tokens` (S) tokens each.

    Public: `plan`, `request_ids`, `num_tokens`, `positions` (each request's new token's, or
    when S > 1 a tuple of its S tokens'), `appends` (the rows each request appends: S, or
    in a ragged step 0..S), `batch_size`, and the persistent device buffers its
    kernels read: `req_slots` `[Bcap]`, `num_real` `[1]`, `newest_rows` (`[Bcap]` int32
    device rows of the new tokens; `[Bcap, S]` when S > 1). It owns its records, the layers
    `write_newest` wrote (a cancel restores them), and the index groups whose anchor swapped
    in during it (their replays are owed until it ends). Once ended or cancelled every verb
    raises `RequestStateError`.
    """

    # What most steps leave as it is, as class defaults: each instance attribute a begin sets
    # costs it host time (a single-token step sets none of these).
    _appends: tuple[int, ...] | None = None  # (a ragged step) each request's count
    _positions: tuple[Any, ...] | None = None  # made only if read
    _grew: list[RequestRecord] | tuple[()] = ()  # (single-token path) records that took an extent
    _extents_before: list[int] | None = None  # (union path) extents held before the step
    _width: Any = None  # (union path) the per-S launchers and buffers
    _verify: VerifyContext | None = None  # (union path) what every union step shares

    def __init__(self, context: DecodeContext, verify: VerifyContext, plan: StepPlan,
                 request_ids: tuple[Hashable, ...], records: list[RequestRecord],
                 first: np.ndarray, grew: list[RequestRecord],
                 extents_before: list[int] | None = None,
                 appends: tuple[int, ...] | None = None) -> None:
        self.plan = plan  # every choice of this step's path (core/plan.py)
        self.num_tokens = plan.num_tokens
        self.request_ids = request_ids
        if appends is not None:
            self._appends = appends
        self._first = first  # each request's first new position (an array, or a quiet run's)
        buffers = context.buffers
        self.req_slots = buffers.req_slots  # [Bcap] int32 request slot per row (0: padding)
        self.num_real = buffers.num_real  # [1] int32
        self._context: DecodeContext | None = context
        self._lock = context.lock
        self._records = records
        if grew:
            self._grew = grew
        if extents_before is not None:
            self._extents_before = extents_before
        if plan.union:
            self._verify = verify
            self._width = verify.width(context, plan.num_tokens)
            self._kernels, self._replays = self._width.kernels, self._width.replays
            cap, S = context.batch_capacity, plan.num_tokens
            rows = context.buffers.field("draft_rows", cap * S)
            self.newest_rows = rows.view(cap, S) if S > 1 else rows
        else:
            self._kernels, self._replays = context.kernels, context.replays
            self.newest_rows = buffers.newest_rows  # [Bcap] int32 device row of the new token
        self._written: set[int] = set()  # layers given write_newest
        # Layers whose new rows their swap-in's lookup also wrote to the host rows (the backup
        # need not copy them); a later write_newest of the layer takes it out again.
        self._backed_up: set[int] = set()
        self._anchored: list[GroupReplay] = []  # groups whose anchor swapped in
        self._state = StepState.OPEN

    @property
    def positions(self) -> tuple[Any, ...]:
        """The position of each request's new token (when S > 1: a tuple of its S tokens')."""
        if self._positions is None:
            first = np.asarray(self._first)
            self._positions = (tuple(first.tolist()) if self.num_tokens == 1 else tuple(
                map(tuple, (first[:, None] + np.arange(self.num_tokens)).tolist())))
        return self._positions

    @property
    def appends(self) -> tuple[int, ...]:
        """The rows each request appends (S each, or 0..S in a ragged step)."""
        if self._appends is None:
            return (self.num_tokens,) * len(self.request_ids)
        return self._appends

    def _appending(self) -> list[RequestRecord]:
        """The records that append rows in this step."""
        if self._appends is None:
            return self._records
        return [r for r, a in zip(self._records, self._appends, strict=True) if a]

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
    def begin(cls, c: DecodeContext, v: VerifyContext, plan: StepPlan,
              request_ids: tuple[Hashable, ...], records: list[RequestRecord],
              appends: tuple[int, ...] | None = None) -> DecodeStep:
        """Append `plan.num_tokens` tokens to each record (a ragged plan: `appends[b]`, 0..S)
        and upload the step's batch and table updates, by the plan's path; a failure
        leaves nothing changed."""
        if c.validate:
            c.slots.check(records)
        if plan.union:
            first, before = append_union(c, plan.num_tokens, records, appends)
            return cls(c, v, plan, request_ids, records, first, [], before.tolist(),
                       appends)
        run = c.quiet if plan.quiet_advance else None
        if run is not None and run.holds_for(records, c.buffers.block):
            return cls(c, v, plan, request_ids, records, move_on(c, run, records), [])
        counts = None if appends is None else np.array(appends, dtype=np.int64)
        first, grew = append_one(c, records, counts)
        return cls(c, v, plan, request_ids, records, first, grew, appends=appends)

    # --- per layer ------------------------------------------------------------------------
    def write_newest(self, layer: int, kv: torch.Tensor) -> None:
        """Write the step's new rows of `layer`: `kv [B, W]` (S > 1: `[B, S, W]`), B between
        the step's request count and `max_batch` (padding rows go to the sink row)."""
        c = self._usable("write_newest")
        check_layer(layer, c.num_layers)
        self._kernels.write_newest(layer, self._newest_rows(c, kv))
        self._written.add(layer)
        self._backed_up.discard(layer)

    def _newest_rows(self, c: DecodeContext, kv: object) -> torch.Tensor:
        """`kv` checked as the step's new rows, `[B * S, W]` uint8 on the device."""
        # The usual call (a single-token step's dense uint8 rows on our device) passes a few
        # attribute reads; every other goes through `_checked_rows`.
        if (self.num_tokens == 1
                and is_plain_tensor(kv, torch.uint8, 2, c.device, contiguous=False)
                and kv.shape[1] == c.row_bytes
                and self.batch_size <= kv.shape[0] <= c.batch_capacity):
            return kv
        return self._checked_rows(c, kv)

    def _checked_rows(self, c: DecodeContext, kv: object) -> torch.Tensor:
        """`_newest_rows` for any call: S > 1 rows, other dtypes viewed as bytes (`as_rows`),
        or the error that says what is wrong."""
        S, W = self.num_tokens, c.row_bytes
        if S > 1 and is_plain_tensor(kv, torch.uint8, 3, c.device, contiguous=False) and \
                kv.shape[1] == S and kv.shape[2] == W:
            rows = kv
        else:
            rows = self._coerced_rows(c, kv)
        count = rows.shape[0]
        if not self.batch_size <= count <= c.batch_capacity:
            check_batch_rows("kv", count, self.batch_size, c.batch_capacity)
        return rows if S == 1 else rows.reshape(count * S, W)

    def _coerced_rows(self, c: DecodeContext, kv: object) -> torch.Tensor:
        """`kv` of another dtype viewed as rows of bytes, or the error that says why not."""
        S = self.num_tokens
        rows = as_rows("kv", kv, c.row_bytes, 2 if S == 1 else 3, device=c.device)
        if S > 1 and rows.shape[1] != S:
            raise InvalidInputError(
                f"kv has {rows.shape[1]} tokens per request, the step appends "
                f"num_tokens={S}; pass kv as [B, {S}, W]")
        return rows

    def swap_in(self, layer: int, top_k: torch.Tensor | None = None,
                newest_kv: torch.Tensor | None = None) -> torch.Tensor:
        """Map each top-k position to the device row holding it, loading the misses.

        Args:
            layer: the KV layer attention is about to read.
            top_k: `[B, K]` int32 positions on the cache's device (S > 1: `[B, S, K]`, row s
                for query token s, which may select positions up to its own), -1 = none; B
                between the step's request count and `max_batch` (rows past the real count
                are padding). A follower of an index group may leave it out, or pass its
                anchor's tensor or one of equal contents.
            newest_kv: the layer's new rows, as `write_newest(layer, newest_kv)` takes them,
                written in this call instead (where the plan folds them: inside the swap-in's
                first launch).

        Returns:
            `[B, K]` (`[B, S, K]`) int32 rows of `device_kv(layer)` (-1 for none, invalid and
            padding): a view of a buffer reused by the group's next call; a follower gets its
            anchor's. A union step looks a position listed several times up once, and serves
            the step's own tokens from their draft slots.
        """
        c = self._usable("swap_in")
        check_layer(layer, c.num_layers)
        group = c.layer_group[layer]
        replay = self._replays[group]
        if replay is not None and layer != replay.anchor:
            out = self._follow(c, layer, replay, top_k)
            if newest_kv is not None:
                self.write_newest(layer, newest_kv)
            return out
        if top_k is None:
            raise _anchor_needs_top_k(layer, replay, self.num_tokens)
        rows = self._check_top_k(c, top_k)
        if self.plan.union:
            if c.validate:
                self._validate_positions(top_k)
            if replay is not None:
                replay.begin_plan()
            out = self._swap_in_union(layer, group, rows, top_k, newest_kv)
            self._finish_anchor(replay, top_k, out)
            return out
        # The single-token path, inline (a call more is 4% of its host time): the kernels
        # run over the B rows the caller passed (a caller that captures a graph per batch
        # size gets small grids for small batches) and read its top-k in place.
        newest = self._newest_rows(c, newest_kv) if newest_kv is not None else None
        if c.validate:
            self._validate_positions(top_k)
        if replay is not None:
            replay.begin_plan()
        out = c.buffers.views(rows).out[group]
        if c.kernels.launch_swap_in(layer, group, rows, top_k, newest):
            self._backed_up.add(layer)
        elif newest is not None:
            self._backed_up.discard(layer)
        if newest is not None:
            self._written.add(layer)
        self._finish_anchor(replay, top_k, out)
        return out

    def _swap_in_union(self, layer: int, group: int, rows: int, top_k: torch.Tensor,
                       newest_kv: torch.Tensor | None) -> torch.Tensor:
        """The union path: the S rows of each request as one de-duplicated row, inside the
        swap-in's kernels (`plan.fused_union`) or around them (a union plan, then a scatter)."""
        if newest_kv is not None:  # its own launch: the union's lookup has other widths
            self.write_newest(layer, newest_kv)
        union_top_k, outs, singles = self._width.views(rows)
        kernels = self._kernels
        if self.plan.fused_union:
            kernels.launch_swap_in(layer, group, rows, top_k.view(rows, -1))
        else:
            kernels.launch_union_plan(rows, top_k)
            kernels.launch_swap_in(layer, group, rows, union_top_k)
            kernels.launch_union_scatter(layer, group, rows)
        return outs[group] if self.num_tokens > 1 else singles[group]

    def _validate_positions(self, top_k: torch.Tensor) -> None:
        """Validate mode: every entry a position up to its query token's own."""
        if self.plan.union:
            validate_union_positions(top_k if self.num_tokens > 1 else top_k[:, None],
                                     np.asarray(self._first).tolist(), self.num_tokens,
                                     self.request_ids, self._appends)
        else:
            check_positions_against_lengths(
                top_k, [r.num_tokens for r in self._records], self.request_ids)

    def _finish_anchor(self, replay: GroupReplay | None, top_k: torch.Tensor,
                       out: torch.Tensor) -> None:
        """After an anchor's swap-in: its group's followers will replay this plan."""
        if replay is not None:
            if replay.step is not self:
                self._anchored.append(replay)
            replay.finish_plan(self, top_k, out)

    def _follow(self, c: DecodeContext, layer: int, replay: GroupReplay,
                top_k: torch.Tensor | None) -> torch.Tensor:
        """A follower's rows: its anchor's, once its layer holds the anchor's copies. Handed a
        top-k, it must hold the anchor's: its own tensor (an address check, free on the hot
        path; `validate` compares contents too) or equal contents (`GroupReplay`); a tensor
        that is not the anchor's is checked first so that a malformed one gets the precise
        message."""
        if replay.step is not self:
            raise replay.not_anchored(layer)
        if top_k is not None:
            if not replay.is_anchor_top_k(top_k):
                self._check_top_k(c, top_k)
                raise replay.other_top_k(layer, top_k)
            if c.validate and not torch.equal(top_k, replay.top_k):
                raise replay.changed_top_k(layer)
        return replay.ready_rows(layer)

    def _check_top_k(self, c: DecodeContext, top_k: object) -> int:
        """The batch rows of a well-formed `top_k` (`[B, K]`, S > 1: `[B, S, K]` int32)."""
        if self.num_tokens == 1 and is_plain_tensor(top_k, torch.int32, 2, c.device):
            rows, columns = top_k.shape  # (the usual call: attribute reads, as above)
            if columns == c.top_k_columns and self.batch_size <= rows <= c.batch_capacity:
                return rows
        return self._checked_top_k(c, top_k)

    def _checked_top_k(self, c: DecodeContext, top_k: object) -> int:
        """`_check_top_k` for any call, or the error that says what is wrong."""
        S, K = self.num_tokens, c.top_k_columns
        if S > 1 and is_plain_tensor(top_k, torch.int32, 3, c.device):
            rows = top_k.shape[0]
            if top_k.shape[1] == S and top_k.shape[2] == K and \
                    self.batch_size <= rows <= c.batch_capacity:
                return rows
        shape = (S, K) if S > 1 else (K,)
        top_k = check_tensor("top_k", top_k, dtype=torch.int32, device=c.device,
                             ndim=len(shape) + 1)
        rows = top_k.shape[0]
        check_batch_rows("top_k", rows, self.batch_size, c.batch_capacity)
        if tuple(top_k.shape[1:]) != shape:
            if S == 1:
                raise InvalidInputError(
                    f"top_k has {top_k.shape[1]} columns, the cache was built for top_k={K}; "
                    f"pad rows with -1 to {K} columns (hisparse.pad_top_k)")
            raise InvalidInputError(
                f"top_k has shape {tuple(top_k.shape)}; this step of num_tokens={S} on a cache "
                f"built for top_k={K} takes [B, {S}, {K}] (pad rows with -1)")
        return rows

    # --- closing --------------------------------------------------------------------------
    def end(self, accepted: Any = None) -> None:
        """Keep the first `accepted[b]` tokens of request b (1..S; None: all S; a one-token
        step keeps its token; a ragged verify step: rows, 0..appends[b]), back them up to
        their host rows (on a side stream where supported) and roll the rejected ones back
        (a request keeping none of its rows gets its previous newest back in slot H). A
        device tensor is read once (a sync)."""
        with self._lock:
            c = self._usable("end_decode_step")
            plan = self.plan
            if plan.union and self._appends is not None:  # a ragged verify step: 0..a_b rows
                counts = check_kept(accepted, self._appends)
            else:
                counts = (check_accepted(accepted, self.num_tokens, self.batch_size)
                          if accepted is not None or plan.union else None)
            self._prepare_end(c)
            shared = self._enter_shared(c, "end")
            stream = None  # where this step's host-row writes run (None: compute)
            if plan.union:
                if self._appends is not None:  # (only a ragged step keeps 0 rows)
                    self._restore_newest_slots(c, counts)
                backups, commits = self._settle(c, counts)
                self._mark_end(c)
                writes = plan.writes_host_rows
                c.order.backup.issue(
                    lambda: launch_union_commit(c, self._verify, writes, commits),
                    c.order.step_end)
                c.traffic.backed_up_tokens += backups
                stream = c.order.backup.stream
            else:
                self._mark_end(c)
                if not plan.writes_host_rows:
                    pass  # a shared pool's reader leaves its host rows to the writer
                elif len(self._backed_up) == c.num_layers:
                    c.order.backup.covered()  # every layer's lookup wrote its host row
                else:
                    c.order.backup.issue(c.back_up_newest, c.order.step_end)
                    stream = c.order.backup.stream
                c.traffic.backed_up_tokens += (self.batch_size if self._appends is None
                                               else sum(self._appends))
            self._close(c, StepState.ENDED)
            if shared is not None:
                # (a union step's accept counts are part of the operation every rank hashes)
                self._exit_shared(c, shared, f"end{counts}" if plan.union else "end",
                                  wrote=True, stream=stream)

    def cancel(self) -> None:
        """Undo the step's tokens, for a forward pass that failed part way.

        Every request is back at its length before the step, with its KV as it was: the
        extents its new tokens took and their short-regime slots are released, and the
        newest slot gets its previous token back from the host. Rows the step's swap-ins
        brought into hot buffers stay, as do the counters: those are valid copies of older
        tokens. Nothing is backed up.
        """
        with self._lock:
            c = self._context
            if c is None:
                raise self._refusal("cancel_decode_step")
            self._settle_replays()
            shared = self._enter_shared(c, "cancel")
            # The device first, so that a failure leaves the step open and the call retryable.
            self._restore_newest_slots(c)
            if self.plan.union:
                self._settle(c, [0] * self.batch_size)
            else:
                undo_one(c, self._appending(), self._grew)
            self._mark_end(c)
            self._close(c, StepState.CANCELLED)
            self._exit_shared(c, shared, "cancel", wrote=False)

    def _settle(self, c: DecodeContext, accepted: list[int]) -> tuple[int, int]:
        return settle_union(c, self._verify, self._records, np.asarray(self._first).tolist(),
                            self._extents_before, self._appends or self.num_tokens, accepted)

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
        self._context = self._kernels = self._replays = self._width = self._verify = None

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
        self._context = self._kernels = self._replays = self._width = self._verify = None
        self._records, self._anchored = [], []

    def _restore_newest_slots(self, c: DecodeContext, kept: list[int] | None = None) -> None:
        """Give slot H of each request that was long before the step its newest token back
        from the host, in the layers `write_newest` overwrote (slot H is the new token's on
        the single-token path, draft slot 0 on the union path; a request of a ragged step
        that appended nothing kept it). `kept` (an end): only those keeping no row."""
        H, SPR, E = c.tables.hot_slots, c.tables.slots_per_request, c.tables.extent_tokens
        first = np.asarray(self._first).tolist()
        kept = kept or [0] * self.batch_size
        pairs = [(slot_of(r) * SPR + H, host_row_of(r, n - 1, E))
                 for r, n, a, e in zip(self._records, first, self.appends, kept, strict=True)
                 if n > H and a and not e]
        if not pairs or not self._written:
            return
        c.order.host_rows.drain()  # that row's backup may still be landing from a side stream
        device_rows = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=c.device)
        host_rows = torch.tensor([h for _, h in pairs], dtype=torch.long)
        for layer in sorted(self._written):
            c.layer_kv[layer].index_copy_(
                0, device_rows, c.pool.layers[layer][host_rows].to(c.device))

    # --- refusals -------------------------------------------------------------------------
    def _usable(self, action: str) -> DecodeContext:
        """The context, if the step is open and the cache still decodes; else raise."""
        c = self._context
        if c is None:
            raise self._refusal(action)
        if c.kernels.failure is not None:  # (a union width's failure is the cache's too)
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


def _anchor_needs_top_k(layer: int, replay: GroupReplay | None, tokens: int
                        ) -> InvalidInputError:
    shape = f"[B, {tokens}, K]" if tokens > 1 else "[B, K]"
    if replay is None:
        return InvalidInputError(
            f"swap_in({layer}) needs its top_k ({shape} int32 positions): layer {layer} runs "
            "its own indexer (it follows no anchor in the index schedule); pass the layer's "
            "top-k")
    last = replay.followers[-1] if replay.followers else layer
    return InvalidInputError(
        f"swap_in({layer}) needs its top_k ({shape} int32 positions): layer {layer} is the "
        f"anchor of index group {replay.group} (layers {layer}..{last}) and plans the group's "
        f"swap-in; pass the group's top-k here (its followers may then leave it out)"
    )
