"""Shared prefixes: requests that begin with the same tokens hold the same host extents.

Whole extents of a common prefix are shared by reference (`HostPool` counts each extent's
holders and frees it when the last one lets go). The extent at the boundary, partly prefix
and partly the new request's own tokens, is copied into an extent of the new request: two
requests never hold one extent that either of them still writes into.

A prefix comes from a live request, `(request_id, num_tokens)`, or from a `PrefixHandle`
that `retain_prefix` returned: a retained prefix holds its extents until `release_prefix`,
whatever happens to the request it came from meanwhile (finish, abort, preempt).

Why a shared row is never written. A request writes its prompt rows (`write_prefill`, a PD
transfer) only while it is prefilling or reserved, and nobody may share from it before it
runs; the rows of a prefix it was admitted on are refused to those writes. Once running it
writes only its newest token's row, at a position past every prefix taken from it. A
retained prefix that ends inside an extent also holds that extent, for its tail rows (copied
into each request admitted on it): when the request it came from keeps decoding into that
extent, its next decode step first moves it to a private copy (`writers_in`, `private_copy`,
`moved`), so the newest token always lands in an extent its request holds alone.

Why a request admitted on a prefix gets alias key extents under `residency_map: host_row`.
Keyed by host row, `resident[g, row]` is one entry per host row: two running requests holding
one shared row in their hot buffers (each in its own slot) would claim the same entry, and a
lookup of one would return the other's slot id, a slot of its own buffer that holds another
token. So the device page table holds *key extents*: a request's own extents are their own
keys, and for each shared extent it joins on admission (`extents_for_new`) it takes an alias
key extent from `AliasKeys` (ids from N / E on; `alias_extents` of them), which
`key_host_extent` maps back to the shared host extent. A hit needs the key alone; a miss
copies from the host row the key extent maps to (kernels/swap_in). Invariant: one key extent
is held by one request at a time (an own extent's key by the request that allocated it, an
alias by the request that took it, until it ends), so `resident` stays one entry per token of
one request slot, as without sharing. A request only ever writes rows of its own extents,
whose keys are their host rows: every host-row write (prefill, PD transfer, newest-token
backup) goes to the row it names. The moved case keeps this: the private copy is a new own
extent, so its key changes too and the request's `resident` entries and `slot_key`s of that
extent move with it (`slot_tables.move_keys`). Keyed by position, every request slot has its
own keys already: sharing host rows leaves the device tables exactly as without sharing, and
no aliases are taken.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hisparse.core.host_pool import HostPool
from hisparse.core.requests import RequestRecord, RequestState, RequestTable
from hisparse.errors import InvalidInputError, PoolExhaustedError, RequestStateError

_cache_ids = itertools.count(1)


@dataclass(frozen=True)
class PrefixHandle:
    """A retained prefix: the host rows of the first `num_tokens` tokens of request `source`.

    Pass it as `prefix=` to `admit` or `reserve_host_slots`, cut a shorter prefix from it with
    `retain_prefix(handle, n)`, and give it back with `release_prefix(handle)` once. It works
    only with the cache that returned it.
    """

    handle_id: int
    num_tokens: int
    source: Hashable  # the request its rows were first retained from (for logs)
    # The PrefixRegistry (one per cache) that holds it. Left out of the repr, which a shared
    # pool hashes as the call's arguments: the ranks' caches have ids of their own.
    cache_id: int = field(repr=False)


@dataclass(frozen=True)
class PrefixRows:
    """Where the first `num_tokens` tokens of a holder live: token `p` in `extents[p // E]`."""

    num_tokens: int
    extents: tuple[int, ...]  # ceil(num_tokens / E) extents


@dataclass(frozen=True)
class HostUsage:
    """What the holders of host extents (requests and retained prefixes) use, per layer."""

    rows_used: int  # rows holding a token of some holder, each row once
    shared_extents: int  # extents two or more holders hold
    shared_rows: int  # rows two or more holders hold
    extents_saved: int  # extents the holders would allocate on top if none shared


class AliasKeys:
    """Alias key extents `first .. first + capacity - 1` (host_row residency keys of shared
    extents, one per request holding one), lowest free first: the ranks of a shared pool
    take the same ids in the same operations."""

    def __init__(self, first: int, capacity: int) -> None:
        self.first, self.capacity = first, capacity
        self._free = list(range(first, first + capacity))  # sorted: already a heap

    @property
    def free(self) -> int:
        return len(self._free)

    def check_free(self, count: int, action: str) -> None:
        if count > len(self._free):
            raise PoolExhaustedError(
                f"cannot {action}: it shares {count} whole extents of its prefix and needs an "
                f"alias key extent for each (residency_map: host_row keys every request's "
                f"shared extents apart), but only {len(self._free)} of alias_extents="
                f"{self.capacity} are free; finish or abort requests admitted on shared "
                "prefixes first, or raise alias_extents (each costs index groups x "
                "extent_tokens x 2 B of device memory) or use residency_map: position"
            )

    def take(self, count: int) -> tuple[int, ...]:
        return tuple(heapq.heappop(self._free) for _ in range(count))

    def give_back(self, aliases: Iterable[int]) -> None:
        for alias in aliases:
            heapq.heappush(self._free, alias)

    def state(self) -> list[int]:
        """The free ids, sorted (tests compare it before and after a refused call)."""
        return sorted(self._free)


class PrefixRegistry:
    """The retained prefixes of one cache, and the requests that must copy before writing."""

    _FORGET_AFTER = 4096  # released handle ids remembered, for a clear double-release error

    def __init__(self, pool: HostPool, residency_map: str, alias_extents: int = 0) -> None:
        self.pool = pool
        self.extent_tokens = pool.extent_tokens
        self.residency_map = residency_map
        # host_row: the alias key extents, numbered after the pool's own (None: position
        # keys need none; an empty allocator refuses sharing).
        self.aliases = (AliasKeys(pool.num_extents, alias_extents)
                        if residency_map == "host_row" else None)
        self.cache_id = next(_cache_ids)
        self._ids = itertools.count(1)
        self._retained: dict[int, tuple[PrefixHandle, PrefixRows]] = {}
        self._released: OrderedDict[int, None] = OrderedDict()
        # id(record) -> record: requests whose next token lands in an extent that a retained
        # prefix also holds (its tail); their next decode step moves them to a private copy.
        self.writers: dict[int, RequestRecord] = {}

    def __len__(self) -> int:
        return len(self._retained)

    def retained(self) -> list[PrefixRows]:
        return [rows for _, rows in self._retained.values()]

    # --- resolving what a caller names ----------------------------------------------------
    def resolve(self, prefix: object, requests: RequestTable,
                in_step: Callable[[RequestRecord], bool], action: str) -> PrefixRows:
        """The rows `prefix=` names: a PrefixHandle, or `(request_id, num_tokens)`."""
        self._check_residency_map(action)
        if isinstance(prefix, PrefixHandle):
            return self._handle_rows(prefix, prefix.num_tokens, action)[1]
        if not (isinstance(prefix, tuple) and len(prefix) == 2):
            raise InvalidInputError(
                f"cannot {action}: prefix {prefix!r:.80} is a {type(prefix).__name__}; pass a "
                "PrefixHandle from retain_prefix or a (request_id, num_tokens) pair naming the "
                "first tokens of a live request"
            )
        source, num_tokens = prefix
        return self._request_rows(source, num_tokens, requests, in_step, action,
                                  f"{action} on a prefix of")[1]

    def _request_rows(
        self, request_id: Hashable, num_tokens: object, requests: RequestTable,
        in_step: Callable[[RequestRecord], bool], action: str, source_action: str,
    ) -> tuple[RequestRecord, PrefixRows]:
        # Running or preempted: every row below its length is on the host and written for good.
        record = requests.expect(request_id, source_action,
                                 (RequestState.RUNNING, RequestState.PREEMPTED))
        if in_step(record):
            raise RequestStateError(
                f"cannot {source_action} request {request_id!r} during the decode step it is "
                "part of (its newest row is still being written); call end_decode_step() "
                "first"
            )
        count = _prefix_length(num_tokens, record.num_tokens, f"request {request_id!r}", action)
        return record, PrefixRows(count, tuple(record.extents[: self._pages(count)]))

    def _handle_rows(self, handle: PrefixHandle, num_tokens: object,
                     action: str) -> tuple[PrefixHandle, PrefixRows]:
        held = self._lookup(handle, action)
        count = _prefix_length(num_tokens, held.num_tokens,
                               f"retained prefix #{handle.handle_id}", action)
        rows = self._retained[handle.handle_id][1]
        return held, PrefixRows(count, rows.extents[: self._pages(count)])

    def _lookup(self, handle: PrefixHandle, action: str) -> PrefixHandle:
        if handle.cache_id != self.cache_id:
            raise InvalidInputError(
                f"cannot {action}: prefix handle #{handle.handle_id} was retained by another "
                "HiSparseCache, and a handle works only with the cache that returned it; pass "
                "it to that cache, or call retain_prefix on this one"
            )
        held = self._retained.get(handle.handle_id)
        if held is not None and held[0] == handle:
            return held[0]
        if handle.handle_id in self._released:
            raise RequestStateError(
                f"cannot {action}: prefix handle #{handle.handle_id} ({handle.num_tokens} "
                f"tokens of request {handle.source!r}) was already released; release each "
                "handle once, and call retain_prefix again to share those rows"
            )
        raise InvalidInputError(
            f"cannot {action}: {handle!r} is not a prefix this cache retains; pass a handle "
            "that retain_prefix returned, unchanged"
        )

    def _check_residency_map(self, action: str) -> None:
        if self.aliases is not None and not self.aliases.capacity:
            raise InvalidInputError(
                f"cannot {action}: under residency_map: host_row a request admitted on a "
                "shared prefix needs alias key extents, so that two running requests holding "
                "one shared host row keep apart in the residency map, and this cache has "
                "alias_extents: 0; create the cache with alias_extents > 0 (null: the pool's "
                "extent count) or with residency_map: position "
                "(HiSparseConfig.from_preset(..., residency_map='position'))"
            )

    # --- retaining ------------------------------------------------------------------------
    def retain(self, source: object, num_tokens: object, requests: RequestTable,
               in_step: Callable[[RequestRecord], bool]) -> PrefixHandle:
        action = "retain a prefix"
        self._check_residency_map(action)
        record = None
        if isinstance(source, PrefixHandle):
            held, rows = self._handle_rows(source, num_tokens, action)
            origin = held.source
        else:
            record, rows = self._request_rows(source, num_tokens, requests, in_step, action,
                                              "retain a prefix of")
            origin = source
        self.pool.share(rows.extents)
        handle = PrefixHandle(next(self._ids), rows.num_tokens, origin, self.cache_id)
        self._retained[handle.handle_id] = (handle, rows)
        E = self.extent_tokens
        if (record is not None and rows.num_tokens % E and record.num_tokens % E
                and rows.extents[-1] == record.extents[-1]):
            self.writers[id(record)] = record  # it decodes into the extent of our tail next
        return handle

    def release(self, handle: object) -> list[int]:
        """Let go of a retained prefix; returns the extents freed (no other holder left)."""
        if not isinstance(handle, PrefixHandle):
            raise InvalidInputError(
                f"cannot release a prefix: {handle!r:.80} is a {type(handle).__name__}, not a "
                "PrefixHandle; pass the handle that retain_prefix returned"
            )
        self._lookup(handle, "release a prefix")
        _, rows = self._retained.pop(handle.handle_id)
        freed = self.pool.release(rows.extents)
        self._released[handle.handle_id] = None
        while len(self._released) > self._FORGET_AFTER:
            self._released.popitem(last=False)
        # A request that would have copied before writing into our tail no longer has to.
        self.writers = {key: r for key, r in self.writers.items()
                        if self.pool.holders(r.extents[-1]) > 1}
        return freed

    def forget(self, record: RequestRecord) -> None:
        """The request ended: its extents are released by the caller, its alias key extents
        here (its slot, which named them, was cleared first)."""
        self.writers.pop(id(record), None)
        if record.aliases:
            assert self.aliases is not None
            self.aliases.give_back(record.aliases)
            record.aliases = ()

    # --- extents of a new request ---------------------------------------------------------
    def check_room(self, prefix: PrefixRows | None, num_tokens: int, action: str) -> None:
        """Raise what `extents_for_new` would raise for a bad length, a full pool or (host_row)
        too few free alias key extents."""
        pool = self.pool
        if prefix is None:
            pool.check_free(pool.extents_for(num_tokens))
            return
        if prefix.num_tokens > num_tokens:
            raise InvalidInputError(
                f"cannot {action}: its prefix has {prefix.num_tokens} tokens, more than the "
                f"{num_tokens} tokens of the request; pass a prefix of at most {num_tokens} "
                "tokens (retain_prefix(handle, n) cuts a shorter one from a handle)"
            )
        shared = prefix.num_tokens // self.extent_tokens
        pool.check_free(pool.extents_for(num_tokens) - shared)
        if self.aliases is not None:
            self.aliases.check_free(shared, action)

    def extents_for_new(self, prefix: PrefixRows | None, num_tokens: int,
                        drain: Callable[[], None], action: str
                        ) -> tuple[list[int], tuple[int, ...]]:
        """Extents for a new `num_tokens` request: the prefix's whole extents, shared, then
        its own, the first of which gets the prefix's tail rows copied; and (host_row) the
        alias key extents that name the shared ones in its page table. Raises before any
        change (PoolExhaustedError, or a prefix longer than the request)."""
        pool, E = self.pool, self.extent_tokens
        self.check_room(prefix, num_tokens, action)
        if prefix is None:
            return pool.allocate(pool.extents_for(num_tokens)), ()
        shared = list(prefix.extents[: prefix.num_tokens // E])
        own_count = pool.extents_for(num_tokens) - len(shared)
        tail = prefix.num_tokens % E
        if tail:
            # The tail's newest row may still be landing from a backup, and our new extent
            # may still be read by a step in flight (rows freed by a finish).
            drain()
        own = pool.allocate(own_count, after=shared[-1] if shared else None) if own_count else []
        try:
            if tail:
                copy_rows(pool, prefix.extents[-1], own[0], tail)
        except BaseException:
            pool.release(own)
            raise
        pool.share(shared)
        aliases = self.aliases.take(len(shared)) if self.aliases is not None else ()
        return shared + own, aliases

    # --- a writer's private copy (decode steps) -------------------------------------------
    def writers_in(self, records: Sequence[RequestRecord]) -> list[RequestRecord]:
        """The requests of a step whose new token would land in an extent they share."""
        if not self.writers:
            return []
        return [r for r in records if id(r) in self.writers]

    def private_copy(self, record: RequestRecord) -> int:
        """A new extent holding the rows written so far in the record's last extent. The
        caller commits it with `moved`, or releases it."""
        E = self.extent_tokens
        after = record.extents[-2] if len(record.extents) > 1 else None
        [extent] = self.pool.allocate(1, after=after)
        try:
            copy_rows(self.pool, record.extents[-1], extent,
                      record.num_tokens - (len(record.extents) - 1) * E)
        except BaseException:
            self.pool.release([extent])
            raise
        return extent

    def moved(self, record: RequestRecord, extent: int) -> list[int]:
        """The record's last extent is now `extent` (its private copy); returns the extents
        freed (none while the retained prefix still holds the old one, as it does)."""
        old, record.extents[-1] = record.extents[-1], extent
        freed = self.pool.release([old])
        self.writers.pop(id(record), None)
        return freed

    # --- statistics -----------------------------------------------------------------------
    def usage(self, records: Iterable[RequestRecord]) -> HostUsage:
        holders = [(r.extents, r.num_tokens) for r in records]
        holders += [(rows.extents, rows.num_tokens) for rows in self.retained()]
        if not self.pool.shared_extents:  # disjoint holders: plain sums
            return HostUsage(sum(n for _, n in holders), 0, 0, 0)
        E = self.extent_tokens
        extents = np.concatenate([np.asarray(held, dtype=np.int64) for held, _ in holders])
        # Rows each holder uses of each of its extents: E, and what its last one holds.
        counts = np.concatenate([
            np.clip(n - E * np.arange(len(held), dtype=np.int64), 0, E) for held, n in holders])
        # By extent, most rows first: each holder holds the first rows of an extent, so the
        # first count of an extent is its rows used, the second the rows shared.
        order = np.lexsort((-counts, extents))
        extents, counts = extents[order], counts[order]
        first = np.ones(extents.size, dtype=bool)
        first[1:] = extents[1:] != extents[:-1]
        second = np.zeros(extents.size, dtype=bool)
        second[1:] = ~first[1:] & first[:-1]
        return HostUsage(
            rows_used=int(counts[first].sum()),
            shared_extents=int(second.sum()),
            shared_rows=int(counts[second].sum()),
            extents_saved=int((~first).sum()),
        )

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.extent_tokens)


def copy_rows(pool: HostPool, source: int, target: int, count: int) -> None:
    """Copy the first `count` rows of extent `source` into extent `target`, every layer.

    Host to host, so done when this returns. On a shared pool's reader, nothing: the writer
    rank copies the same rows in the same operation (the ranks' extents are the same), and
    the reader waits for its publication before reading them."""
    if not pool.writes_rows:
        return
    E = pool.extent_tokens
    for layer in pool.layers:
        layer[target * E : target * E + count].copy_(layer[source * E : source * E + count])


def _prefix_length(value: object, limit: int, what: str, action: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
        longer = isinstance(value, int) and not isinstance(value, bool) and value > limit
        raise InvalidInputError(
            f"cannot {action}: a prefix of {value!r} tokens of {what}, which has {limit}"
            + (f"; pass at most {limit}: a prefix cannot be longer than what it is taken from"
               if longer else f"; pass a plain int in 1..{limit}")
        )
    return value
