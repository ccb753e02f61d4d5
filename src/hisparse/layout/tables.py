"""The tensors every swap-in implementation reads and writes (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from hisparse.layout.widths import resident_entry_bytes

# What `CacheTables.resident` is indexed by (layout.widths.RESIDENCY_MAPS, for the config).
ResidencyMap = Literal["host_row", "position"]


def residency_dtype(hot_slots: int) -> torch.dtype:
    """dtype of `CacheTables.resident` (`layout.widths.resident_entry_bytes`)."""
    return torch.int16 if resident_entry_bytes(hot_slots) == 2 else torch.int32


def unshared_key_extents(host_extents: int, alias_extents: int,
                         device: torch.device | str) -> torch.Tensor:
    """`CacheTables.key_host_extent` before any sharing: each host extent its own key extent,
    and `alias_extents` aliases after them naming no extent yet (-1)."""
    i32 = {"dtype": torch.int32, "device": device}
    return torch.cat([torch.arange(host_extents, **i32), torch.full((alias_extents,), -1, **i32)])


@dataclass(eq=False)
class CacheTables:
    """Device-resident state of the hot buffers plus the host pool rows.

    Shapes use the symbols of docs/ARCHITECTURE.md. The engine owns one instance; kernels
    receive it and mutate the tensors in place (never rebind them: graph capture holds
    their addresses).
    """

    device_kv: torch.Tensor  # [L, R*S, W] uint8, device
    host_kv: list[torch.Tensor]  # L x [N, W] uint8, host memory of the backend
    # [R, P] int32 per E tokens, -1 = none: the host extent, or (with `key_host_extent`) the
    # key extent whose host extent key_host_extent gives
    page_table: torch.Tensor
    seq_lens: torch.Tensor  # [R] int32
    slot_key: torch.Tensor  # [G, R, H] int32: the `resident` key of each hot slot's token, -1
    # = empty
    # The LRU, as a clock per (group, request) that every long-regime swap-in advances, and
    # the clock's value when each hot slot was last used (hit or filled): oldest first, ties
    # by slot id. Seeding sets the stamps to -1 and the clock to 0.
    last_use: torch.Tensor  # [G, R, H] int32
    lru_clock: torch.Tensor  # [G, R] int32
    # [G, N] (keyed by host row), [G, X * E] (by key row, X = key_host_extent's length) or
    # [G, R * T] (keyed by request slot r and position p as r * T + p, T =
    # positions_per_request), int16 or int32 (residency_dtype): the hot slot holding that
    # token, -1 = none
    resident: torch.Tensor
    counters: torch.Tensor  # [L, 3] int64: hits, misses, invalid entries
    hot_slots: int  # H
    extent_tokens: int  # E
    # [L] int64 device tensor: the address a kernel uses for each host_kv[l] (the engine fills
    # it from backend.device_address: on ROCm it is not the host pointer). None: data_ptr().
    host_kv_addresses: torch.Tensor | None = None
    # Keyed by position, a lookup needs no page-table read for a hit: token-granular page
    # tables read one entry per top-k token otherwise (H200, SW-1 scattered B=128 miss-free
    # step: 18.3 -> 13.6 us; 512-token extents: no change; benchmarks/NOTES.md fifteenth
    # pass), for R * T entries per group instead of N.
    residency_map: ResidencyMap = "host_row"
    # [R, 2] int64: hits and misses of each request slot's swap-ins since it was last seeded
    # (stats() reports them per request). None: not counted.
    request_counters: torch.Tensor | None = None
    # D: device slots per request after the H LRU slots that are never LRU victims. Slot H
    # holds the newest token; a verify step of S <= D tokens writes its drafts to H..H+S-1.
    reserved_slots: int = 1
    # host_row with shared prefixes: [X] int32, the host extent of each key extent. Two
    # requests that hold one shared extent name it in their page tables by two key extents
    # (one an alias, >= N / E), so that their tokens have distinct `resident` entries; a hit
    # needs the key alone, a miss reads its host row through this. None: the page table
    # holds host extents (every key row is its host row).
    key_host_extent: torch.Tensor | None = None

    @property
    def slots_per_request(self) -> int:
        """The per-request row stride every kernel uses: H LRU slots plus D reserved."""
        return self.hot_slots + self.reserved_slots

    @property
    def row_bytes(self) -> int:
        return int(self.device_kv.shape[-1])

    @property
    def positions_per_request(self) -> int:
        """T: the positions a request's page table can map (its width times E)."""
        return int(self.page_table.shape[1]) * self.extent_tokens

    @property
    def num_host_rows(self) -> int:
        """N: host rows a position can map to (a key past them has no host row). Keyed by
        host row without key extents, `resident`'s width (every key is a host row); else the
        host rows of every layer, which must agree (every layer has one row per token): read
        per swap-in call, so from one layer, not all."""
        if self.residency_map == "host_row" and self.key_host_extent is None:
            return int(self.resident.shape[1])
        return int(self.host_kv[0].shape[0]) if self.host_kv else 0

    @property
    def num_keys(self) -> int:
        """Entries of each group's `resident` map: the residency key space (host rows, key
        rows with aliases, or request positions), not necessarily host rows."""
        return int(self.resident.shape[1])

    def residency_keys(self, request_slots: torch.Tensor, positions: torch.Tensor,
                       key_rows: torch.Tensor) -> torch.Tensor:
        """The `resident` index of each token (broadcast): its key row (key extent * E +
        offset: its host row unless the extent is an alias), or its request slot and
        position."""
        if self.residency_map == "host_row":
            return key_rows
        return request_slots * self.positions_per_request + positions


@dataclass(eq=False)
class MissPlan:
    """Misses recorded by one planning call, replayable as copy-only work on other layers.

    Plan row b lists `count[b]` (host row, device row) pairs; over all rows they are the call's
    misses, each once, in the order the copy reads them (batch row by batch row, or in
    host-address order: docs/ARCHITECTURE.md, "Miss plan")."""

    src: torch.Tensor  # [Bcap, K] int32 host rows
    dst: torch.Tensor  # [Bcap, K] int32 device rows
    count: torch.Tensor  # [Bcap] int32 entries per plan row

    def first_rows(self, rows: int) -> MissPlan:
        """The plan of a call over the first `rows` batch rows: views of the same storage, so
        a graph captured with them keeps its addresses."""
        return MissPlan(src=self.src[:rows], dst=self.dst[:rows], count=self.count[:rows])

    @classmethod
    def empty(cls, batch_capacity: int, top_k: int, device: torch.device) -> MissPlan:
        return cls(
            src=torch.zeros(batch_capacity, top_k, dtype=torch.int32, device=device),
            dst=torch.zeros(batch_capacity, top_k, dtype=torch.int32, device=device),
            count=torch.zeros(batch_capacity, dtype=torch.int32, device=device),
        )


@dataclass(frozen=True, eq=False)
class NewestRows:
    """What a swap-in that also writes the layer's new token rows reads: `kv [rows, W]`
    uint8 (dense, 4-byte aligned: `word_rows`), the batch's `[Bcap]` int32 newest device
    rows and, to back the rows up to the host pool as it writes them, their `[Bcap]` int32
    host rows (-1 on padding rows)."""

    kv: torch.Tensor
    rows: torch.Tensor
    host_rows: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class DraftUnion:
    """What a swap-in over a verify step's flattened `[B, S * K]` top-k reads to treat it as
    one de-duplicated row per request (a position selected several times is looked up once
    and missed at most once): the step's `[Bcap]` int64 first token positions and draft slot
    0 device rows, and `table()`, which hands over the cache's `[Bcap, positions_per_request]`
    int32 presence table (made at the first call that asks; all SENTINEL between calls,
    `kernels.union_reference.presence_table`). `last_visible` `[Bcap]` int64: in a ragged
    verify step, the last position any query of the row may select (its last appended
    row); -1 (None: every row) where query token s selects up to its own, `first + s`."""

    tokens: int  # S
    top_k: int  # K, entries per query token
    first: torch.Tensor
    draft_base: torch.Tensor
    table: Callable[[], torch.Tensor]
    last_visible: torch.Tensor = None  # type: ignore[assignment]  (None: all -1)

    def __post_init__(self) -> None:
        if self.last_visible is None:
            object.__setattr__(self, "last_visible", torch.full_like(self.first, -1))


def word_rows(rows: torch.Tensor) -> bool:
    """Whether the Triton kernels can read `rows` as they are: dense rows of 4-byte words from
    a 4-byte aligned address (a `[B, W]` slice of a framework's KV output)."""
    return rows.data_ptr() % 4 == 0 and rows.shape[-1] % 4 == 0 and rows.is_contiguous()
