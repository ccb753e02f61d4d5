"""The tensors every swap-in implementation reads and writes (docs/ARCHITECTURE.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse.core.widths import resident_entry_bytes


def residency_dtype(hot_slots: int) -> torch.dtype:
    """dtype of `CacheTables.resident` (`core.widths.resident_entry_bytes`)."""
    return torch.int16 if resident_entry_bytes(hot_slots) == 2 else torch.int32


@dataclass(eq=False)
class CacheTables:
    """Device-resident state of the hot buffers plus the host pool rows.

    Shapes use the symbols of docs/ARCHITECTURE.md. The engine owns one instance; kernels
    receive it and mutate the tensors in place (never rebind them: graph capture holds
    their addresses).
    """

    device_kv: torch.Tensor  # [L, R*S, W] uint8, device
    host_kv: list[torch.Tensor]  # L x [N, W] uint8, host memory of the backend
    page_table: torch.Tensor  # [R, P] int32: extent id per E tokens, -1 = none
    seq_lens: torch.Tensor  # [R] int32
    slot_row: torch.Tensor  # [G, R, H] int32: host row per hot slot, -1 = empty
    # The LRU, as a clock per (group, request) that every long-regime swap-in advances, and
    # the clock's value when each hot slot was last used (hit or filled): oldest first, ties
    # by slot id. Seeding sets the stamps to -1 and the clock to 0.
    last_use: torch.Tensor  # [G, R, H] int32
    lru_clock: torch.Tensor  # [G, R] int32
    resident: torch.Tensor  # [G, N] int16 or int32 (residency_dtype): hot slot holding host
    # row n, -1 = none
    counters: torch.Tensor  # [L, 3] int64: hits, misses, invalid entries
    hot_slots: int  # H
    extent_tokens: int  # E
    # [L] int64 device tensor: the address a kernel uses for each host_kv[l] (the engine fills
    # it from backend.device_address: on ROCm it is not the host pointer). None: data_ptr().
    host_kv_addresses: torch.Tensor | None = None

    @property
    def slots_per_request(self) -> int:
        return self.hot_slots + 1

    @property
    def row_bytes(self) -> int:
        return int(self.device_kv.shape[-1])


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
