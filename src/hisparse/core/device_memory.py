"""The device memory pre-check: the bytes of a cache's device tables from its config alone,
refused before any allocation when the device has fewer free (as the host pool's check does
for host memory)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hisparse.backends._host_memory import available_host_bytes, format_bytes
from hisparse.errors import ConfigError
from hisparse.layout.widths import resident_entry_bytes

if TYPE_CHECKING:
    from hisparse.config import HiSparseConfig

I32, I64 = 4, 8
# The config values each table grows with, for the advice of a refusal.
GROWS_WITH = {
    "device_kv": "max_requests, hot_slots (2 x top_k when unset), max_draft_tokens, num_layers",
    "resident": "host_pool_tokens (alias_extents under host_row), or max_requests x "
                "max_seq_len under residency_map: position",
    "page_table": "max_requests x max_seq_len",
    "slot_key": "max_requests x hot_slots",
    "last_use": "max_requests x hot_slots",
}


def device_table_bytes(config: HiSparseConfig, num_extents: int, num_groups: int | None = None,
                       hot_slots: int | None = None) -> dict[str, int]:
    """Bytes of each device table `slot_tables.build_tables` allocates for `config` with a
    host pool of `num_extents` extents (the shapes are those of `CacheTables`)."""
    L, R, E, W = config.num_layers, config.max_requests, config.extent_tokens, config.row_bytes
    G = config.index_schedule.num_groups if num_groups is None else num_groups
    H = config.hot_slots if hot_slots is None else hot_slots
    S = H + config.max_draft_tokens
    pages = -(-config.max_seq_len // E)
    aliased = config.residency_map == "host_row" and config.alias_extents > 0
    if config.residency_map == "position":
        keys = R * pages * E
    else:
        keys = (num_extents + config.alias_extents if aliased else num_extents) * E
    return {
        "device_kv": L * (R * S + 1) * W,
        "page_table": R * pages * I32,
        "seq_lens": R * I32,
        "slot_key": G * R * H * I32,
        "last_use": G * R * H * I32,
        "lru_clock": G * R * I32,
        "resident": G * keys * resident_entry_bytes(H),
        "counters": L * 3 * I64,
        "request_counters": R * 2 * I64,
        "key_host_extent": (num_extents + config.alias_extents) * I32 if aliased else 0,
        "host_kv_addresses": L * I64,
    }


def free_device_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device`: available RAM on a CPU (its "device" tensors
    are host memory), the runtime's free memory plus what torch's allocator holds unused on an
    accelerator; None where the runtime cannot say."""
    if device.type == "cpu":
        return available_host_bytes()
    module = getattr(torch, device.type, None)
    mem_get_info = getattr(module, "mem_get_info", None)
    if mem_get_info is None:
        return None
    try:
        free, _total = mem_get_info(device)
        cached = module.memory_reserved(device) - module.memory_allocated(device)
    except (RuntimeError, AttributeError):
        return None
    return int(free) + max(0, int(cached))


def check_device_memory(config: HiSparseConfig, device: torch.device, num_extents: int,
                        num_groups: int, hot_slots: int) -> None:
    """Raise ConfigError, before any allocation, if the device tables of `config` need more
    memory than `device` has free: how many bytes, how many are free, what to lower."""
    tables = device_table_bytes(config, num_extents, num_groups, hot_slots)
    needs = sum(tables.values())
    free = free_device_bytes(device)
    if free is None or needs <= free:
        return
    largest = sorted(tables, key=tables.__getitem__, reverse=True)[:2]
    parts = ", ".join(f"{name} {format_bytes(tables[name])}" for name in largest)
    advice = "; ".join(f"{name} grows with {GROWS_WITH[name]}" for name in largest
                       if name in GROWS_WITH)
    raise ConfigError(
        f"the device tables need {format_bytes(needs)} on {device} (largest: {parts}), but "
        f"only {format_bytes(free)} is free there; lower the config values they grow with "
        f"({advice}) or free device memory")
