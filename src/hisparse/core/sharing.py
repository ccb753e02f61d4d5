"""The shared-prefix calls of `HiSparseCache` (docs/integration.md, "Shared prefixes").

A mixin of the cache, so that its lifecycle class keeps one job: these methods use the
cache's request table, prefix registry (`core.prefixes`), host pool, tables and barriers, and
take its bookkeeping lock like every other call that changes request records.

On a host pool the tensor-parallel ranks share (core/shared_pool.py) every call here is a
counted, hashed operation like `admit` or `finish`: the ranks retain, release and copy in
the same order, so their holder counts, allocators and page tables stay identical, and a
rank that retains or releases what the writer did not fails the group. The host rows that
sharing copies (an admit's boundary tail, a decoding request's private copy of the extent a
retained prefix's tail holds) are written by the writer rank only, inside the operation that
takes the copy's extent, after its source rows' own copies have landed (`drain`); a reader
reads them only once the writer published that operation (`before_read`). Rows a release
frees take the same path as a finish's (`note_rows_recycled`): the writer rewrites them only
after every reader's `reads_done`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from hisparse.core.operations import operation
from hisparse.core.prefixes import PrefixHandle, PrefixRows
from hisparse.core.slot_tables import move_keys

if TYPE_CHECKING:
    from hisparse.core.requests import RequestRecord

# What `admit` and `reserve_host_slots` accept as a shared prefix.
Prefix = PrefixHandle | tuple[Hashable, int] | None


class PrefixSharing:
    """Retain and release prefixes; resolve an admit's prefix; keep shared rows unwritten."""

    @operation
    def retain_prefix(self, source: Hashable | PrefixHandle, num_tokens: int) -> PrefixHandle:
        """Keep the host rows of the first `num_tokens` tokens of `source` (a running or
        preempted request's id, or a `PrefixHandle` to cut a shorter one from) for requests
        admitted with `prefix=handle`, until `release_prefix(handle)`. Shared by reference; a
        request that goes on decoding gets a private copy of an extent it shares with the
        handle's tail at its next step (none if the handle is released or the request ends
        first, as when a prefix cache retains a finishing request's tokens). Under
        `residency_map: host_row` a request admitted on it takes an alias key extent per
        shared extent (`alias_extents`; docs/integration.md). On a shared pool every rank
        makes the same call and gets a handle of the same number."""
        self._check_open()
        return self._prefixes.retain(source, num_tokens, self._requests, self._in_step)

    @operation
    def release_prefix(self, handle: PrefixHandle) -> None:
        """Give back a retained prefix; requests admitted on it keep their rows. Raises
        InvalidInputError for anything but a handle this cache retains (RequestStateError
        for a second release), changing nothing."""
        self._check_open()
        if self._prefixes.release(handle):
            # A step in flight may read the rows freed; on a shared pool, any rank's step.
            self._order.host_rows.note_rows_recycled()

    def _shared_prefix(self, prefix: Prefix, action: str) -> PrefixRows | None:
        if prefix is None:
            return None
        return self._prefixes.resolve(prefix, self._requests, self._in_step, action)

    def _in_step(self, record: RequestRecord) -> bool:
        step = self._step
        return step is not None and step.holds(record)

    def _unshare_writers(self, records: list[RequestRecord], num_tokens: int,
                         appends: tuple[int, ...] | None = None) -> None:
        """Before a step appends `num_tokens` tokens to `records` (a ragged step: `appends[b]`
        to record b, those appending none left out): every one whose next token would land
        in an extent a retained prefix holds moves to a private copy of it. Checks first that
        the pool has the copies and the step's new extents (nothing moved else); a step its
        checks then refuse keeps the copies, which hold the same rows."""
        if not self._prefixes.writers:
            return  # (the usual step: no request shares the extent it appends to)
        counts = [num_tokens] * len(records) if appends is None else list(appends)
        appending = [(r, a) for r, a in zip(records, counts, strict=True) if a]
        writers = self._prefixes.writers_in([r for r, _ in appending])
        E = self.extent_tokens
        if not writers or any(r.num_tokens + a > self.max_seq_len for r, a in appending):
            return  # (a full request: the step refuses it, and nothing may have changed)
        need = sum(r.extents_to_grow(a, E) for r, a in appending)
        self._pool.check_free(need + len(writers))
        for record in writers:
            self._give_private_tail(record)
        if self._shared is not None:
            # The writer copied the rows in this very operation (a reader copied none): this
            # step's swap-ins read the copies only once the writer published it.
            self._shared.before_read(current=True)

    def _give_private_tail(self, record: RequestRecord) -> None:
        """Move a request whose next tokens would land in an extent a retained prefix holds
        to a copy of that extent (its rows written so far), on the host and in its page
        table, so that no shared row is ever written."""
        # The copied rows' last backup may still be landing, and the new extent's rows (freed
        # by a finish) may still be read by a step in flight: on a shared pool, any rank's.
        self._order.host_rows.drain()
        extent = self._prefixes.private_copy(record)
        # The extent it writes into is its own (never an alias), so it is its own key too.
        assert len(record.aliases) < len(record.extents)
        if record.slot is not None:
            try:
                self._order.step_end.wait()  # the last step's kernels read the page table
                # host_row: the new extent is the page's key now, so the request's hot slots
                # of the old one move to it (hits stay hits); position keys stay as they are.
                move_keys(self.tables, record.slot, record.extents[-1], extent)
                self.tables.page_table[record.slot, len(record.extents) - 1].fill_(extent)
                self._order.tables_changed.mark()
            except BaseException:
                self._pool.release([extent])
                raise
        if self._prefixes.moved(record, extent):  # (the retained prefix still holds it)
            self._order.host_rows.note_rows_recycled()
        if record.slot is not None:
            self._slots.sync_pages(record)  # the host twin of the page table entry above


