"""A plain-Python model of the cache: the oracle the engine is compared with step by step.

It knows nothing of tensors, extents or kernels. Per request it keeps each layer's token rows
(bytes) and length; per (request, index group) a dict position -> hot slot, each slot's last
use and the LRU clock, following docs/ARCHITECTURE.md word for word. Device rows are
`request_slot * S + slot`; the request slot comes from the engine, everything else is
predicted here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

NONE = -1


@dataclass
class HotBuffer:
    """One (request, group): which positions the LRU slots hold, and when each was last used."""

    slot_of: dict[int, int] = field(default_factory=dict)  # position -> slot 0..H-1
    last_use: list[int] = field(default_factory=list)  # per slot: the clock at its last use
    clock: int = 0  # advanced by every long-regime swap-in

    @property
    def lru(self) -> list[int]:
        """Slot ids, least recently used first (ties by slot id)."""
        return sorted(range(len(self.last_use)), key=lambda s: (self.last_use[s], s))

    def position_of(self, slot: int) -> int | None:
        return next((p for p, s in self.slot_of.items() if s == slot), None)


@dataclass
class ModelRequest:
    rows: list[list[bytes]]  # rows[layer][position]: the bytes attention must see
    running: bool = False
    buffers: list[HotBuffer] = field(default_factory=list)  # one per group while running

    @property
    def length(self) -> int:
        return len(self.rows[0])


@dataclass
class LayerCounts:
    hits: int = 0
    misses: int = 0
    invalid: int = 0


class CacheModel:
    def __init__(self, num_layers: int, hot_slots: int, index_group_size: int) -> None:
        self.num_layers = num_layers
        self.hot = hot_slots
        self.group_size = index_group_size
        self.num_groups = -(-num_layers // index_group_size)
        self.requests: dict[Hashable, ModelRequest] = {}
        self.counts = [LayerCounts() for _ in range(num_layers)]
        # Per running request, over anchor layers, since its last seeding (stats().requests).
        self.request_counts: dict[Hashable, LayerCounts] = {}
        # What each group's anchor produced this step, for its followers to return.
        self._last_delta = [LayerCounts() for _ in range(self.num_groups)]
        self._last_result: list[list[list[int]]] = [[] for _ in range(self.num_groups)]
        self._last_verify: list[list[list[list[int]]]] = [[] for _ in range(self.num_groups)]

    # --- lifecycle ------------------------------------------------------------------------
    def add(self, request_id: Hashable, rows: list[list[bytes]]) -> None:
        self.requests[request_id] = ModelRequest(rows=[list(r) for r in rows])

    def seed(self, request_id: Hashable) -> None:
        """Slots 0..H-1 get the H tokens before the newest, oldest first; every slot's last use
        is -1 and the clock 0, so the LRU order is 0..H-1."""
        request = self.requests[request_id]
        n, hot = request.length, self.hot
        first = max(0, n - 1 - hot)
        held = {first + s: s for s in range(min(n, hot))}
        request.buffers = [HotBuffer(dict(held), [-1] * hot) for _ in range(self.num_groups)]
        request.running = True
        self.request_counts[request_id] = LayerCounts()

    def release(self, request_id: Hashable) -> None:
        request = self.requests[request_id]
        request.running, request.buffers = False, []

    def remove(self, request_id: Hashable) -> None:
        del self.requests[request_id]

    def append(self, request_id: Hashable, new_rows: Sequence[bytes]) -> None:
        """One decode token; in the short regime it takes its own slot in every group."""
        request = self.requests[request_id]
        for layer, row in enumerate(new_rows):
            request.rows[layer].append(row)
        position = request.length - 1
        if request.length <= self.hot:
            for buffer in request.buffers:
                buffer.slot_of[position] = position

    def unappend(self, request_id: Hashable) -> None:
        """Take the last decode token back (a cancelled step): its rows, and its own slot in
        the short regime. What swap-ins did meanwhile stays."""
        request = self.requests[request_id]
        position = request.length - 1
        if request.length <= self.hot:
            for buffer in request.buffers:
                del buffer.slot_of[position]
        for rows in request.rows:
            rows.pop()

    def newest_slot(self, request_id: Hashable) -> int:
        n = self.requests[request_id].length
        return n - 1 if n <= self.hot else self.hot

    # --- swap-in --------------------------------------------------------------------------
    def swap_in(self, layer: int, batch: Sequence[Hashable], top_k: Sequence[Sequence[int]]
                ) -> list[list[int]]:
        """Slots within each request (or -1) for the real rows; updates LRU on anchors only."""
        group, offset = divmod(layer, self.group_size)
        if offset:  # a follower sees the anchor's result and the anchor's counts
            delta = self._last_delta[group]
            counts = self.counts[layer]
            counts.hits += delta.hits
            counts.misses += delta.misses
            counts.invalid += delta.invalid
            return self._last_result[group]
        delta = LayerCounts()
        result = []
        for request_id, row in zip(batch, top_k, strict=True):
            own = self.request_counts.setdefault(request_id, LayerCounts())
            before = (delta.hits, delta.misses)
            result.append(self._swap_in_row(group, request_id, list(row), delta))
            own.hits += delta.hits - before[0]
            own.misses += delta.misses - before[1]
        counts = self.counts[layer]
        counts.hits += delta.hits
        counts.misses += delta.misses
        counts.invalid += delta.invalid
        self._last_delta[group] = delta
        self._last_result[group] = result
        return result

    def _swap_in_row(self, group: int, request_id: Hashable, positions: list[int],
                     delta: LayerCounts) -> list[int]:
        request = self.requests[request_id]
        n, hot = request.length, self.hot
        buffer = request.buffers[group]
        out = [NONE] * len(positions)
        misses: list[int] = []
        hit_slots: set[int] = set()
        for index, position in enumerate(positions):
            if position == NONE:
                continue
            if position < NONE or position >= n:
                delta.invalid += 1
                continue
            if n <= hot:
                out[index] = position
            elif position == n - 1:
                out[index] = hot
            elif position in buffer.slot_of:
                out[index] = buffer.slot_of[position]
                hit_slots.add(out[index])
            else:
                misses.append(index)
                continue
            delta.hits += 1
        if n <= hot:
            return out
        clock = buffer.clock
        for slot in hit_slots:
            buffer.last_use[slot] = clock
        # The misses take the least recently used slots not hit this step, in slot-id order.
        evictable = [s for s in buffer.lru if buffer.last_use[s] < clock]
        victims = sorted(evictable[: len(misses)])
        for index, victim in zip(misses, victims, strict=True):
            old = buffer.position_of(victim)
            if old is not None:
                del buffer.slot_of[old]
            buffer.slot_of[positions[index]] = victim
            buffer.last_use[victim] = clock
            out[index] = victim
        delta.misses += len(misses)
        buffer.clock = clock + 1
        return out

    # --- verify steps (speculative decoding) ----------------------------------------------
    def append_drafts(self, request_id: Hashable, new_rows: Sequence[Sequence[bytes]]) -> None:
        """A verify step's S tokens, `new_rows[layer][s]`: they sit in the draft slots H+s
        and take no LRU or short-regime slot until they are accepted."""
        request = self.requests[request_id]
        for layer, rows in enumerate(new_rows):
            request.rows[layer].extend(rows)

    def verify_swap_in(self, layer: int, batch: Sequence[Hashable], first: Sequence[int],
                       top_k: Sequence[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
        """Slots (within each request) for `top_k[b][s][k]`: the distinct positions before
        the step's first token, in first-occurrence order (s-major, then k: the union
        kernels' order, which the LRU's slot assignment follows), go through one ordinary
        swap-in (one step's use of the LRU); query token s's selections of the step's own
        tokens (up to its own) are the draft slots H + offset; anything else is -1 and
        counted invalid."""
        group, offset = divmod(layer, self.group_size)
        if offset:
            delta = self._last_delta[group]
            self._add_counts(layer, delta)
            return self._last_verify[group]
        delta = LayerCounts()
        result = []
        for request_id, n0, rows in zip(batch, first, top_k, strict=True):
            union = list(dict.fromkeys(p for row in rows for p in row if 0 <= p < n0))
            slot_of = dict(zip(union, self._swap_in_row(group, request_id, union, delta),
                               strict=True))
            drafts = set()
            request_rows = []
            for s, row in enumerate(rows):
                out = []
                for p in row:
                    if 0 <= p < n0:
                        out.append(slot_of[p])
                    elif n0 <= p <= n0 + s:
                        out.append(self.hot + p - n0)
                        drafts.add(p)
                    else:
                        delta.invalid += p != NONE
                        out.append(NONE)
                request_rows.append(out)
            delta.hits += len(drafts)
            result.append(request_rows)
        self._add_counts(layer, delta)
        self._last_delta[group] = delta
        self._last_verify[group] = result
        return result

    def accept(self, request_id: Hashable, first: int, accepted: int) -> None:
        """Keep `accepted` of the step's tokens (0: a cancelled step): the rest leave no
        trace; kept tokens of a request still short take their own slots."""
        request = self.requests[request_id]
        for rows in request.rows:
            del rows[first + accepted:]
        if request.length <= self.hot:
            for buffer in request.buffers:
                for position in range(first, request.length):
                    buffer.slot_of[position] = position

    def _add_counts(self, layer: int, delta: LayerCounts) -> None:
        counts = self.counts[layer]
        counts.hits += delta.hits
        counts.misses += delta.misses
        counts.invalid += delta.invalid
