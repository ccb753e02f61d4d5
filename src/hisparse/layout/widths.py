"""Element widths of the engine's tables, without torch: `hisparse plan` sizes a deployment
before any cache exists, and `layout.tables` allocates by the same rule."""

from __future__ import annotations

# What the residency map is indexed by (config `residency_map`; layout.tables.ResidencyMap).
RESIDENCY_MAPS = ("host_row", "position")

# Hot-slot ids and -1 fit in int16 while the hot buffer holds at most this many slots.
INT16_MAX_HOT_SLOTS = 32767


def resident_entry_bytes(hot_slots: int) -> int:
    """Bytes per host row of the residency map: 2 while every slot id fits in int16, else 4.

    On a cold L2 a swap-in's lookups are bound by the bytes of these random reads, not by
    their number (benchmarks/NOTES.md, sixth pass): int16 halves them, and the table."""
    return 2 if hot_slots <= INT16_MAX_HOT_SLOTS else 4
