"""What the swap-in launcher refuses before any launch: tables, buffers and plans it cannot use.

The kernels index every table with sizes taken from the others and as contiguous rows, so a
table that disagrees would be read or written past its end. Everything here runs when a
launcher is bound or a standalone call is made, never per launch of a bound launcher.
"""

from __future__ import annotations

import weakref

import torch

from hisparse.errors import InvalidInputError
from hisparse.layout.tables import CacheTables, MissPlan
from hisparse.layout.widths import RESIDENCY_MAPS

_checked_host: weakref.WeakKeyDictionary[CacheTables, set[int]] = weakref.WeakKeyDictionary()


def fail(what: str, seen: object, fix: str) -> InvalidInputError:
    return InvalidInputError(f"{what} (got {seen}); {fix}.")


def check_tables(tables: CacheTables) -> None:
    """The kernels index every table with sizes taken from the others (R from the page table,
    G from the LRU stamps, H = hot_slots, N from resident or the host rows, the key extents
    from key_host_extent, L from device_kv)
    and as contiguous rows: a table that disagrees would be read or written past its end.
    Shapes only, no sync."""
    t = tables
    device = t.last_use.device
    if t.page_table.dim() != 2 or t.last_use.dim() != 3 or t.resident.dim() != 2:
        raise fail("tables.page_table must be [R, P], tables.last_use [G, R, H] and "
                    "tables.resident [G, N] or [G, R * T]",
                    [list(t.page_table.shape), list(t.last_use.shape), list(t.resident.shape)],
                    "build the tables as docs/ARCHITECTURE.md lays them out")
    if t.residency_map not in RESIDENCY_MAPS:
        raise fail(f"tables.residency_map must be one of {', '.join(RESIDENCY_MAPS)}",
                    t.residency_map,
                    "build the tables as docs/ARCHITECTURE.md lays them out")
    num_requests, num_groups = t.page_table.shape[0], t.last_use.shape[0]
    num_layers = t.device_kv.shape[0]
    position_keyed = t.residency_map == "position"
    num_keys = (num_requests * t.positions_per_request if position_keyed
                else t.resident.shape[1])
    grid = (num_groups, num_requests, t.hot_slots)
    expected = (  # (name, tensor, shape, dtype or None where checked per call)
        ("page_table", t.page_table, tuple(t.page_table.shape), torch.int32),
        ("seq_lens", t.seq_lens, (num_requests,), torch.int32),
        ("slot_key", t.slot_key, grid, torch.int32),
        ("last_use", t.last_use, grid, torch.int32),
        ("lru_clock", t.lru_clock, (num_groups, num_requests), torch.int32),
        ("resident", t.resident, (num_groups, num_keys), None),
        ("counters", t.counters, (num_layers, 3), torch.int64),
    )
    if t.request_counters is not None:
        expected += (("request_counters", t.request_counters, (num_requests, 2), torch.int64),)
    for name, tensor, shape, dtype in expected:
        if (tuple(tensor.shape) != shape or not tensor.is_contiguous()
                or tensor.device != device or dtype not in (None, tensor.dtype)):
            raise fail(f"tables.{name} must be a contiguous {list(shape)} "
                        f"{dtype or 'int16/int32'} tensor on {device}",
                        f"{tensor.dtype} {list(tensor.shape)} stride {tensor.stride()} on "
                        f"{tensor.device}",
                        "build the tables as docs/ARCHITECTURE.md lays them out")
    if num_keys >= 2**31:
        raise fail("tables.resident must have fewer than 2**31 entries per group (int32 keys)",
                    num_keys, "use fewer request slots or a shorter page table")
    device_rows = num_requests * t.slots_per_request
    if t.device_kv.dim() != 3 or t.device_kv.shape[1] < device_rows:
        raise fail(f"tables.device_kv must be [L, >= R*S = {device_rows}, W]",
                    list(t.device_kv.shape), "allocate one row per hot slot of every request")
    _check_key_extents(t)
    for layer, host in enumerate(t.host_kv):
        # N is the host rows themselves (CacheTables.num_host_rows), not resident's width
        if position_keyed or t.key_host_extent is not None:
            if host.dim() != 2 or host.shape[0] != t.num_host_rows:
                raise fail(f"tables.host_kv[{layer}] must hold N = {t.num_host_rows} rows, as "
                            "every layer does", list(host.shape),
                            "allocate every layer's host pool with the same rows")
            continue
        if host.dim() != 2 or host.shape[0] < t.resident.shape[1]:
            raise fail(f"tables.host_kv[{layer}] must hold at least N = {t.resident.shape[1]} "
                        "rows (tables.resident's width)", list(host.shape),
                        "allocate every layer's host pool with the rows resident maps")


def _check_key_extents(t: CacheTables) -> None:
    """A key extent indexes `key_host_extent`, and its key rows `resident`: the two must
    cover each other, or a lookup would read past one of them."""
    keys = t.key_host_extent
    if keys is None:
        return
    if t.residency_map != "host_row":
        raise fail("tables.key_host_extent translates host_row keys only",
                   f"residency_map {t.residency_map!r}", "leave key_host_extent None")
    if (keys.dtype != torch.int32 or keys.dim() != 1 or not keys.is_contiguous()
            or keys.device != t.last_use.device
            or keys.numel() * t.extent_tokens != t.resident.shape[1]):
        raise fail("tables.key_host_extent must be a contiguous int32 [X] tensor on "
                   f"{t.last_use.device}, X * E = tables.resident's width "
                   f"({t.resident.shape[1]})",
                   f"{keys.dtype} {list(keys.shape)} on {keys.device}",
                   "allocate one entry per key extent, as core/slot_tables.py does")


def check_int32(name: str, tensor: torch.Tensor, shape: tuple[int, ...], device: torch.device):
    if tensor.dtype != torch.int32:
        raise fail(f"{name} must be int32", tensor.dtype, f"pass {name}.to(torch.int32)")
    if tensor.device != device:
        raise fail(f"{name} must be on the cache device {device}", tensor.device,
                    f"move {name} to {device}")
    if tuple(tensor.shape) != shape:
        raise fail(f"{name} must have shape {list(shape)}", list(tensor.shape),
                    "pass one entry per batch row (padded to the batch capacity)")
    if not tensor.is_contiguous():
        raise fail(f"{name} must be contiguous", tuple(tensor.stride()),
                    f"pass {name}.contiguous()")


def check_plan(plan: MissPlan, batch_cap: int, top_k: int, device: torch.device) -> None:
    for name, tensor in (("plan.src", plan.src), ("plan.dst", plan.dst)):
        if tensor.dtype != torch.int32 or tensor.device != device or tensor.dim() != 2:
            raise fail(f"{name} must be a 2-D int32 tensor on {device}",
                        f"{tensor.dtype} {list(tensor.shape)} on {tensor.device}",
                        "allocate it with MissPlan.empty(batch_capacity, top_k, device)")
        if tensor.shape[0] < batch_cap or tensor.shape[1] < top_k or tensor.stride(1) != 1:
            raise fail(f"{name} must hold at least [{batch_cap}, {top_k}] with unit column "
                        "stride", f"shape {list(tensor.shape)}, stride {tensor.stride()}",
                        "allocate it with MissPlan.empty(batch_capacity, top_k, device)")
        # Rows closer than their width (an expanded tensor) would share entries: one batch
        # row's misses would overwrite another's and the copy would move the wrong rows.
        if tensor.shape[0] > 1 and tensor.stride(0) < tensor.shape[1]:
            raise fail(f"{name}'s rows must not overlap (row stride >= its {tensor.shape[1]} "
                        "columns)", f"stride {tensor.stride()}",
                        "allocate it with MissPlan.empty(batch_capacity, top_k, device)")
    if plan.src.stride(0) != plan.dst.stride(0):
        raise fail("plan.src and plan.dst must have the same row stride",
                    (plan.src.stride(0), plan.dst.stride(0)), "allocate them together")
    count = plan.count
    if count.dtype != torch.int32 or count.device != device or count.dim() != 1 or (
        count.shape[0] < batch_cap or not count.is_contiguous()
    ):
        raise fail(f"plan.count must be a contiguous int32 vector of at least {batch_cap} on "
                    f"{device}", f"{count.dtype} {list(count.shape)} on {count.device}",
                    "allocate it with MissPlan.empty(batch_capacity, top_k, device)")


def layer_rows(tables: CacheTables, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's host and device rows viewed as int32 words."""
    num_layers = tables.device_kv.shape[0]
    if not 0 <= layer < num_layers or len(tables.host_kv) != num_layers:
        raise fail(f"layer must be in [0, {num_layers}) with one host tensor per layer",
                    f"layer {layer}, {len(tables.host_kv)} host tensors", "pass a valid layer")
    row_bytes = tables.row_bytes
    if row_bytes % 4:
        raise fail("the Triton swap-in moves rows as 4-byte words; row_bytes must be a "
                    "multiple of 4", row_bytes, "pad rows to a multiple of 4 bytes or use the "
                    "torch reference swap-in")
    host = tables.host_kv[layer]
    device = tables.device_kv[layer]
    if host.dtype != torch.uint8 or host.dim() != 2 or host.shape[1] != row_bytes:
        raise fail(f"host_kv[{layer}] must be a uint8 [N, {row_bytes}] tensor",
                    f"{host.dtype} {list(host.shape)}", "allocate it through the backend")
    if not host.is_contiguous() or not device.is_contiguous():
        raise fail("host and device rows must be contiguous",
                    (host.stride(), device.stride()), "allocate them through the backend")
    checked = _checked_host.setdefault(tables, set())
    if host.device.type == "cpu" and device.device.type != "cpu" and layer not in checked:
        if not host.is_pinned():
            raise fail(f"host_kv[{layer}] must be registered (pinned) host memory for the "
                        "device to read it", "pageable memory",
                        "allocate the pool with backend.alloc_host() or register it")
        checked.add(layer)
    return host.view(torch.int32), device.view(torch.int32)

