"""Statistics of a cache: traffic per layer and in total, and host and device occupancy.

Hits, misses and invalid entries are counted on the device by the swap-in kernels and read
only here, when `stats()` is called; the byte counts the engine knows on the host (seeding,
prefill offload, newest-row backups) are kept in plain integer arrays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hisparse.core.host_pool import HostPool
    from hisparse.core.prefixes import PrefixRegistry
    from hisparse.core.requests import RequestTable, SlotAllocator

from dataclasses import asdict, dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class LayerStats:
    layer: int
    hits: int
    misses: int
    invalid: int  # top-k entries outside [-1, seq_len): ignored, returned as -1
    bytes_host_to_device: int  # misses + seeding preloads
    bytes_device_to_host: int  # newest-row backups + prefill offload

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0


@dataclass(frozen=True)
class Occupancy:
    host_extents_used: int
    host_extents_total: int
    host_rows_used: int  # rows holding a token (per layer)
    host_rows_total: int
    internal_fragmentation_rows: int  # rows in owned extents that hold no token yet
    request_slots_used: int
    request_slots_total: int
    requests_by_state: dict[str, int] = field(default_factory=dict)
    # Shared prefixes (docs/integration.md): extents and rows (per layer) that two or more
    # holders, requests or retained prefixes, hold; and the host bytes (all layers) the
    # holders would allocate on top if each held its own extents.
    shared_extents: int = 0
    shared_rows: int = 0
    host_bytes_saved: int = 0
    retained_prefixes: int = 0
    # residency_map: host_row: the alias key extents requests admitted on a shared prefix
    # hold (one per shared extent each), of `alias_extents` (both 0 under position).
    alias_extents_used: int = 0
    alias_extents_total: int = 0


@dataclass(frozen=True)
class RequestStats:
    """One request's swap-in traffic since it last got its device slot (admit, resume or a
    completed transfer), summed over the anchor layers of its index groups (a follower layer
    reads its anchor's rows and adds nothing of its own)."""

    request_id: object
    state: str
    seq_len: int
    hits: int
    misses: int

    @property
    def hit_rate(self) -> float | None:
        """Hits over hits and misses; None before its first swap-in."""
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else None


@dataclass(frozen=True)
class CacheStats:
    layers: list[LayerStats]
    occupancy: Occupancy
    disabled_features: list[str]
    # Every request holding a device slot (running), in admission order.
    requests: list[RequestStats] = field(default_factory=list)

    @property
    def hits(self) -> int:
        return sum(s.hits for s in self.layers)

    @property
    def misses(self) -> int:
        return sum(s.misses for s in self.layers)

    @property
    def invalid(self) -> int:
        return sum(s.invalid for s in self.layers)

    @property
    def bytes_host_to_device(self) -> int:
        return sum(s.bytes_host_to_device for s in self.layers)

    @property
    def bytes_device_to_host(self) -> int:
        return sum(s.bytes_device_to_host for s in self.layers)

    def to_dict(self) -> dict[str, object]:
        totals = {
            "hits": self.hits,
            "misses": self.misses,
            "invalid": self.invalid,
            "bytes_host_to_device": self.bytes_host_to_device,
            "bytes_device_to_host": self.bytes_device_to_host,
        }
        return {
            "total": totals,
            "layers": [asdict(s) for s in self.layers],
            "occupancy": asdict(self.occupancy),
            "disabled_features": list(self.disabled_features),
            "requests": [{**asdict(r), "request_id": str(r.request_id), "hit_rate": r.hit_rate}
                         for r in self.requests],
        }


class TrafficCounters:
    """Per-layer token counts the host already knows; rows are converted to bytes on read."""

    def __init__(self, num_layers: int) -> None:
        self.seeded_tokens = np.zeros(num_layers, dtype=np.int64)
        self.offloaded_tokens = np.zeros(num_layers, dtype=np.int64)
        # Every layer backs the same tokens up: one count (an int add per step, where an
        # array's costs a numpy call).
        self.backed_up_tokens = 0

    def layer_stats(self, device_counters: torch.Tensor, row_bytes: int,
                    misses_copied: bool = True) -> list[LayerStats]:
        """`misses_copied=False` (the skip-IO probe): misses are planned and counted, but no
        byte of theirs crosses the link, so none is reported."""
        counts = device_counters.cpu().tolist()  # the one host sync of statistics
        return [
            LayerStats(
                layer=layer,
                hits=hits,
                misses=misses,
                invalid=invalid,
                bytes_host_to_device=(
                    (misses if misses_copied else 0) + int(self.seeded_tokens[layer])
                ) * row_bytes,
                bytes_device_to_host=(
                    self.backed_up_tokens + int(self.offloaded_tokens[layer])
                )
                * row_bytes,
            )
            for layer, (hits, misses, invalid) in enumerate(counts)
        ]


def occupancy_of(requests: RequestTable, pool: HostPool, slots: SlotAllocator,
               prefixes: PrefixRegistry) -> Occupancy:
    usage = prefixes.usage(requests)  # shared rows counted once
    aliases = prefixes.aliases
    used_rows = usage.rows_used
    extents = pool.allocator
    by_state: dict[str, int] = {}
    for record in requests:
        by_state[str(record.state)] = by_state.get(str(record.state), 0) + 1
    return Occupancy(
        host_extents_used=extents.used_extents,
        host_extents_total=extents.num_extents,
        host_rows_used=used_rows,
        host_rows_total=pool.num_rows,
        internal_fragmentation_rows=extents.used_extents * pool.extent_tokens - used_rows,
        request_slots_used=slots.num_slots - slots.free_slots,
        request_slots_total=slots.num_slots,
        requests_by_state=by_state,
        shared_extents=usage.shared_extents,
        shared_rows=usage.shared_rows,
        host_bytes_saved=(usage.extents_saved * pool.extent_tokens * pool.row_bytes
                          * len(pool.layers)),
        retained_prefixes=len(prefixes),
        alias_extents_used=aliases.capacity - aliases.free if aliases else 0,
        alias_extents_total=aliases.capacity if aliases else 0,
    )

def request_stats(requests: RequestTable, counters: torch.Tensor | None) -> list[RequestStats]:
    """Per request holding a device slot, its slot's counters (read back in one copy)."""
    holding = [r for r in requests if r.slot is not None]
    if counters is None or not holding:
        return []
    values = counters.cpu().tolist()
    return [RequestStats(r.request_id, str(r.state), r.num_tokens, *values[r.slot])
            for r in holding]
