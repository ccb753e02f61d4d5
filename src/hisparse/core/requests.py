"""Python-side bookkeeping of requests: state, device request slot, host extents, length."""

from __future__ import annotations

import enum
import heapq
import itertools
import operator
from collections import OrderedDict
from collections.abc import Hashable, Iterable

import numpy as np
import torch

from hisparse.core.host_pool import token_rows
from hisparse.core.operations import bookkeeping
from hisparse.errors import (
    InvalidInputError,
    PoolExhaustedError,
    RequestStateError,
    UnknownRequestError,
)

_CHANGES = itertools.count(1)  # (next() on it is atomic under the GIL; `+= 1` is not)
_SLOT = operator.attrgetter("_slot")  # a record's slot, read without the property's frame


class RequestState(str, enum.Enum):
    RESERVED = "reserved"  # PD: host rows reserved, KV arriving from another node
    PREFILLING = "prefilling"  # admitted; prompt rows being written
    RUNNING = "running"  # hot buffer seeded; decodes
    PREEMPTED = "preempted"  # host KV kept, device slot released
    FINISHED = "finished"
    ABORTED = "aborted"

    def __str__(self) -> str:
        return self.value


class PromptCoverage:
    """The prompt rows `write_prefill` has written, per layer, as merged `[start, end)` runs.

    A commit with a gap would seed, and later serve, whatever the row's previous owner (another
    request) left in it: silent corruption, and another request's data. The first
    `prefix_tokens` rows came with a shared prefix: written before the request was admitted.
    """

    def __init__(self, num_layers: int, num_tokens: int, prefix_tokens: int = 0) -> None:
        self.num_tokens = num_tokens
        self._runs: list[list[tuple[int, int]]] = [
            [(0, prefix_tokens)] if prefix_tokens else [] for _ in range(num_layers)
        ]

    def add(self, layer: int, start: int, end: int) -> None:
        merged = []
        for run_start, run_end in self._runs[layer]:
            if run_end < start or end < run_start:
                merged.append((run_start, run_end))
            else:  # overlapping or touching: one run
                start, end = min(start, run_start), max(end, run_end)
        merged.append((start, end))
        self._runs[layer] = sorted(merged)

    def first_gap(self) -> tuple[int, int, int] | None:
        """(layer, start, end) of the first rows never written, or None when all were."""
        for layer, runs in enumerate(self._runs):
            written_to = 0
            for start, end in [*runs, (self.num_tokens, self.num_tokens)]:
                if start > written_to:
                    return layer, written_to, start
                written_to = max(written_to, end)
        return None


class RequestRecord:
    """One request's bookkeeping. While it holds a device request slot its length lives in
    the slot allocator's per-slot array (`SlotAllocator.lengths`), which a decode step reads
    and advances for the whole batch with one numpy operation; `num_tokens` reads and writes
    that entry, so the record and the array can never disagree."""

    __slots__ = ("_lengths", "_slot", "_state", "_tokens", "admitted_tokens", "aliases",
                 "extents", "prefix_tokens", "prompt_written", "request_id")
    # A new value at every change of any record's state or slot: while it stands still, a
    # decode batch of the same ids has the same records, all running, in the same slots (the
    # memo of `RequestTable.remembered_batch` and `SlotAllocator.slots_of`). Each value comes
    # from one counter, so a thread that stores a stale one never restores a remembered one.
    changes = 0
    # The same for every write of a slot holder's length or page entries other than a decode
    # step's own append (a cancel, a verify step, a new extent, a private prefix copy, a slot
    # taken or given back): while it and `changes` stand still, the batch's next step is its
    # last one moved on by a token (core.batch.QuietRun).
    length_writes = 0

    def __init__(self, request_id: Hashable, state: RequestState, admitted_tokens: int,
                 num_tokens: int, extents: list[int] | None = None,
                 prompt_written: PromptCoverage | None = None, prefix_tokens: int = 0,
                 aliases: tuple[int, ...] = ()) -> None:
        self.request_id = request_id
        self.state = state
        self.admitted_tokens = admitted_tokens  # prompt length given to admit / reserve
        self.extents: list[int] = [] if extents is None else extents
        # Tracked from admit to commit_prefill (a PD transfer writes its rows outside hisparse).
        self.prompt_written = prompt_written
        # Tokens admitted on a shared prefix: on the host already, never written by this one.
        self.prefix_tokens = prefix_tokens
        # residency_map: host_row only: the key extents that name the first len(aliases)
        # extents (those shared on admission) in the page table and `resident`, this
        # request's alone (core/prefixes.py). Every later extent is its own key.
        self.aliases = aliases
        self._tokens = num_tokens  # the length while no slot is held
        self._slot: int | None = None
        self._lengths: np.ndarray | None = None  # the allocator's lengths while a slot is held

    @property
    def state(self) -> RequestState:
        return self._state

    @state.setter
    def state(self, value: RequestState) -> None:
        self._state = value
        RequestRecord.changes = next(_CHANGES)

    @property
    def num_tokens(self) -> int:
        """Tokens whose rows exist on the host (the seq_len once running)."""
        lengths = self._lengths
        return self._tokens if lengths is None else int(lengths[self._slot])

    @num_tokens.setter
    def num_tokens(self, value: int) -> None:
        if self._lengths is None:
            self._tokens = value
        else:
            self._lengths[self._slot] = value
            RequestRecord.length_writes = next(_CHANGES)

    @property
    def slot(self) -> int | None:
        """The device request slot, None while none is held (`SlotAllocator.take`)."""
        return self._slot

    def key_extents(self) -> list[int]:
        """The page table's entries in host_row mode: the aliases, then the own extents."""
        aliases = self.aliases
        return [*aliases, *self.extents[len(aliases):]] if aliases else self.extents

    def extents_to_grow(self, tokens: int, extent_tokens: int) -> int:
        """The new extents that appending `tokens` tokens to the request takes."""
        return max(0, -(-(self.num_tokens + tokens) // extent_tokens) - len(self.extents))

    def __repr__(self) -> str:
        return (f"RequestRecord({self.request_id!r}, {self.state}, tokens={self.num_tokens}, "
                f"slot={self._slot}, extents={self.extents!r:.80})")


class SlotAllocator:
    """Device request slots `0..R-1`, lowest free first, and what a decode step reads of the
    request holding each: its length (the one copy of it, see `RequestRecord`) and `pages`,
    the host twin of the device page table (extent of each page, -1 past the request's),
    with `held`, how many extents it holds,
    written wherever the device table is (seed, release, a step's new extent, a cancel, a
    verify step, a private prefix copy) and checked against the records in validate mode."""

    def __init__(self, num_slots: int, pages_per_request: int = 1) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # already a heap
        self.lengths = np.zeros(num_slots, dtype=np.int64)
        self.pages = np.full((num_slots, pages_per_request), -1, dtype=np.int64)
        self.held = np.zeros(num_slots, dtype=np.int64)  # extents of each slot's request
        self._memo: tuple[int, list[RequestRecord], np.ndarray] | None = None

    def slots_of(self, records: list[RequestRecord]) -> np.ndarray:
        """The int64 slots of a decode batch (read-only), kept while `records` is the last
        batch's very list and no record changed state or slot since."""
        memo = self._memo
        if memo is not None and memo[1] is records and memo[0] == RequestRecord.changes:
            return memo[2]
        slots = np.fromiter(map(_SLOT, records), dtype=np.int64, count=len(records))
        slots.flags.writeable = False
        self._memo = (RequestRecord.changes, records, slots)
        return slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def check_free(self, what: str) -> None:
        if not self._free:
            raise PoolExhaustedError(
                f"no device request slot free for {what}: all {self.num_slots} are in use; "
                "finish or preempt a request first, or raise max_requests"
            )

    def take(self, record: RequestRecord) -> int:
        """Give `record` the lowest free slot; its length moves into `lengths`."""
        slot = heapq.heappop(self._free)
        RequestRecord.changes = RequestRecord.length_writes = next(_CHANGES)
        self.lengths[slot] = record._tokens
        record._slot, record._lengths = slot, self.lengths
        self.sync_pages(record)
        return slot

    def release(self, record: RequestRecord) -> None:
        """Take `record`'s slot back; its length moves back into the record."""
        slot = record._slot
        assert slot is not None
        RequestRecord.changes = RequestRecord.length_writes = next(_CHANGES)
        record._tokens = int(self.lengths[slot])
        record._slot, record._lengths = None, None
        self.lengths[slot] = 0
        self.pages[slot] = -1
        self.held[slot] = 0
        heapq.heappush(self._free, slot)

    def add_tokens(self, slots: np.ndarray, tokens: np.ndarray | int) -> None:
        """Every slot's request gets `tokens` more (a verify step's append or accept), as its
        record's `num_tokens` setter would give it: one numpy operation for the batch."""
        self.lengths[slots] += tokens
        RequestRecord.length_writes = next(_CHANGES)

    def sync_pages(self, record: RequestRecord) -> None:
        """`pages` of the record's slot from its extents (after they changed)."""
        RequestRecord.length_writes = next(_CHANGES)
        row, extents = self.pages[record._slot], record.extents
        row.fill(-1)
        row[: len(extents)] = extents
        self.held[record._slot] = len(extents)

    def check(self, records: list[RequestRecord]) -> None:
        """Validate mode: the batch's slots are its records', and every slot holder's
        `pages` row (and `held` count) matches its extents."""
        if self.slots_of(records).tolist() != [r.slot for r in records]:
            raise AssertionError("the decode batch's remembered slots are not its records'")
        for record in records:
            if record._slot is None:
                continue
            row = self.pages[record._slot]
            count = len(record.extents)
            if (row[:count].tolist() != record.extents or (row[count:] != -1).any()
                    or self.held[record._slot] != count):
                raise AssertionError(
                    f"slot {record._slot}'s host page table {row.tolist()} disagrees with "
                    f"request {record.request_id!r}'s extents {record.extents}")


class RequestTable:
    """Live requests by id, plus a bounded memory of freed ids for clear double-free errors."""

    _FORGET_AFTER = 4096

    def __init__(self) -> None:
        self._live: dict[Hashable, RequestRecord] = {}
        self._ended: OrderedDict[Hashable, RequestState] = OrderedDict()
        # (RequestRecord.changes, ids, records) of the last decode batch that passed its checks
        self._batch: tuple[int, list[Hashable], list[RequestRecord]] | None = None

    def remembered_batch(self, ids: list[Hashable]) -> list[RequestRecord] | None:
        """The last checked decode batch's records, if `ids` are its ids and no record changed
        state or slot since (then they are all still running, each once: no lookup needed)."""
        memo = self._batch
        if memo is not None and memo[0] == RequestRecord.changes and memo[1] == ids:
            return memo[2]
        return None

    def remember_batch(self, ids: list[Hashable], records: list[RequestRecord]) -> None:
        self._batch = (RequestRecord.changes, ids, records)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self):
        return iter(self._live.values())

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._live

    def get(self, request_id: Hashable, action: str) -> RequestRecord:
        try:
            return self._live[request_id]
        except (KeyError, TypeError):
            pass
        ended = self._ended.get(request_id) if _hashable(request_id) else None
        if ended is not None:
            raise RequestStateError(
                f"cannot {action} request {request_id!r}: it was already {ended} and its "
                "memory freed; admit it again (under this id or another) to start a new request"
            )
        raise UnknownRequestError(
            f"cannot {action} request {request_id!r}: no such request is admitted "
            f"({len(self._live)} live); admit it (or reserve_host_slots) first"
        )

    def expect(
        self, request_id: Hashable, action: str, allowed: Iterable[RequestState]
    ) -> RequestRecord:
        record = self.get(request_id, action)
        allowed = tuple(allowed)
        if record.state not in allowed:
            raise RequestStateError(
                f"cannot {action} request {request_id!r}: it is {record.state}, not "
                f"{' or '.join(str(s) for s in allowed)}; {_NEXT_STEP[record.state]}"
            )
        return record

    def expect_all(self, request_ids: Iterable[Hashable], action: str,
                   allowed: RequestState) -> list[RequestRecord]:
        """`expect` for a batch: one dict lookup each while every id is live and `allowed`
        (a decode step's batch, every step), `expect`'s message for the first that is not."""
        live = self._live
        try:
            records = [live[i] for i in request_ids]
        except (KeyError, TypeError):
            records = None
        # (a list's count compares by identity first: ~20 ns a record, no generator frames)
        if records is None or [r.state for r in records].count(allowed) != len(records):
            return [self.expect(i, action, (allowed,)) for i in request_ids]
        return records

    def check_new(self, request_id: Hashable, action: str) -> None:
        check_request_id(request_id, action)
        if request_id in self._live:
            raise RequestStateError(
                f"cannot {action} request {request_id!r}: it is already "
                f"{self._live[request_id].state}; finish or abort it before reusing the id"
            )

    def add(self, record: RequestRecord) -> None:
        RequestRecord.changes = next(_CHANGES)
        self._ended.pop(record.request_id, None)
        self._live[record.request_id] = record

    def remove(self, record: RequestRecord, final: RequestState) -> None:
        del self._live[record.request_id]
        record.state = final
        self._ended[record.request_id] = final
        while len(self._ended) > self._FORGET_AFTER:
            self._ended.popitem(last=False)


# What a caller holding a request in each live state can do next, for RequestStateError.
_NEXT_STEP = {
    RequestState.RESERVED: "call complete_transfer(id) once the transfer wrote its rows",
    RequestState.PREFILLING: "call commit_prefill(id) once its prompt rows are written",
    RequestState.RUNNING: "a running request decodes: call preempt(id) to park it or "
                          "finish(id) to free it",
    RequestState.PREEMPTED: "call resume(id) to give it a device slot again",
}


def check_request_id(request_id: object, action: str) -> None:
    """A new request's id must name it by value: hashable, not None, not a tensor (a tensor
    hashes by identity, so two equal tensors would be two requests)."""
    problem = None
    if request_id is None:
        problem = "request id None names no request"
    elif isinstance(request_id, torch.Tensor):
        problem = (f"request id {request_id!r} is a torch.Tensor, which hashes by identity "
                   "(an equal tensor would name another request)")
    elif not _hashable(request_id):
        problem = f"request id {request_id!r} is not hashable"
    if problem is not None:
        raise InvalidInputError(f"cannot {action}: {problem}; use an int or str")


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


class RequestQueries:
    """`HiSparseCache`'s read-only request lookups, as a mixin of it: what a scheduler may ask
    about a request at any time (under the cache's bookkeeping lock)."""

    @bookkeeping
    def request_state(self, request_id: Hashable) -> RequestState:
        return self._requests.get(request_id, "look up").state

    @bookkeeping
    def seq_len(self, request_id: Hashable) -> int:
        return self._requests.get(request_id, "look up").num_tokens

    @bookkeeping
    def request_slot(self, request_id: Hashable) -> int | None:
        """The device request slot `r` (rows `r*S .. r*S+H`), None while it holds none."""
        return self._requests.get(request_id, "look up").slot

    @bookkeeping
    def host_rows(self, request_id: Hashable) -> np.ndarray:
        """Host row (int64) of each of the request's tokens, the same in every layer."""
        record = self._requests.get(request_id, "look up")
        return token_rows(record.extents, self.extent_tokens, 0, record.num_tokens)


def slot_of(record: RequestRecord) -> int:
    """The request slot of a record in a step (every running request has one)."""
    assert record.slot is not None
    return record.slot


def host_row_of(record: RequestRecord, position: int, extent_tokens: int) -> int:
    """The host row of token `position` of a record."""
    page, offset = divmod(position, extent_tokens)
    return record.extents[page] * extent_tokens + offset
