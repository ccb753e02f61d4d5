"""Swap-in and planned copy in plain torch ops: the semantics of docs/ARCHITECTURE.md.

This is production code on the CPU backend and the reference the Triton kernels are tested
against everywhere. It is vectorised over the batch; boolean indexing makes it synchronise
with the host on accelerators, which is why the GPU backends bind the Triton kernels instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hisparse.kernels.swap_in.plan import LauncherCapabilities
from hisparse.layout.tables import CacheTables, MissPlan, NewestRows


@dataclass
class _Lookup:
    """What the lookup found for every entry of a padded batch (the classify kernel's part)."""

    real: torch.Tensor  # [B] real rows with a request slot in range
    r: torch.Tensor  # [B] request slot (0 for padding)
    short: torch.Tensor  # [B, 1] short regime
    result: torch.Tensor  # [B, K] device row of every served entry, -1 elsewhere
    served: torch.Tensor  # [B, K] hits, short-regime and newest entries
    hit: torch.Tensor  # [B, K] long-regime hits
    resident_slot: torch.Tensor  # [B, K] the hit's slot
    miss: torch.Tensor  # [B, K]
    invalid: torch.Tensor  # [B, K] out of range, or without a host row
    row: torch.Tensor  # [B, K] host row of long-regime candidates
    key: torch.Tensor  # [B, K] their residency key (a key row differs from the host row
    # where the page table names a shared extent by an alias key extent)
    base: torch.Tensor  # [B, 1] the request slot's first device row


def swap_in_reference(
    tables: CacheTables,
    layer: int,
    group: int,
    req_slots: torch.Tensor,  # [Bcap] int32 request slot per batch row
    top_k: torch.Tensor,  # [Bcap, K] int32 token positions, -1 = none
    num_real: torch.Tensor,  # [1] int32: rows >= num_real are padding
    out: torch.Tensor,  # [Bcap, K] int32: device row per entry, -1 = none
    plan: MissPlan | None = None,
    skip_io: bool = False,
    newest: NewestRows | None = None,
) -> None:
    t = tables
    if newest is not None:  # write_newest's index_copy_, first
        t.device_kv[layer].index_copy_(0, newest.rows.long(), newest.kv)
        if newest.host_rows is not None:  # and the backup's copy of the real rows
            _back_up_newest(t.host_kv[layer], newest, num_real)
    found = _lookup(t, group, req_slots, top_k, num_real)
    chosen = _select_victims(t, group, found)
    miss, victim = chosen.miss, chosen.victim
    result = torch.where(miss, found.base + victim, found.result)
    _install(t, layer, group, found, chosen, plan, skip_io)
    served = found.served & ~miss
    t.counters[layer, 0] += served.sum()
    t.counters[layer, 1] += miss.sum()
    t.counters[layer, 2] += found.invalid.sum()
    if t.request_counters is not None:
        per_row = torch.stack([served.sum(1), miss.sum(1)], dim=1)
        t.request_counters.index_add_(0, found.r[found.real], per_row[found.real])
    out.copy_(result.to(out.dtype))


def _back_up_newest(host: torch.Tensor, newest: NewestRows, num_real: torch.Tensor) -> None:
    """The new rows of the real batch rows into their host rows (none for padding rows)."""
    rows = newest.kv.shape[0]
    host_rows = newest.host_rows[:rows].long()
    back_up = (torch.arange(rows, device=host_rows.device) < num_real.long()) & (host_rows >= 0)
    host[host_rows[back_up].to(host.device)] = newest.kv[back_up].to(host.device)


def _lookup(t: CacheTables, group: int, req_slots: torch.Tensor, top_k: torch.Tensor,
            num_real: torch.Tensor) -> _Lookup:
    """Resolve every entry: short regime, newest token, hit, miss or invalid."""
    hot_slots, slots, ext = t.hot_slots, t.slots_per_request, t.extent_tokens
    batch_cap, dev = top_k.shape[0], top_k.device
    real = torch.arange(batch_cap, device=dev) < num_real.to(dev).long()
    # A real row with a request slot outside [0, R) is treated as padding, as the Triton
    # kernels do: a negative slot would otherwise wrap around to another request's state.
    slot_in_range = (req_slots >= 0) & (req_slots < t.page_table.shape[0])
    real = real & slot_in_range.to(dev)
    r = torch.where(real, req_slots.long(), 0)
    n = t.seq_lens[r].long()[:, None]
    pos = top_k.long()
    valid = real[:, None] & (pos >= 0) & (pos < n)
    invalid = real[:, None] & ((pos < -1) | (pos >= n))
    base = (r * slots)[:, None]
    short = n <= hot_slots

    result = torch.where(valid & short, base + pos, -1)
    newest = valid & ~short & (pos == n - 1)
    result = torch.where(newest, base + hot_slots, result)
    candidate = valid & ~short & ~newest

    safe_pos = torch.where(candidate, pos, 0)
    page_index = safe_pos // ext
    in_table = page_index < t.page_table.shape[1]
    page = t.page_table[r[:, None], torch.where(in_table, page_index, 0)].long()
    page = torch.where(in_table, page, -1)
    key_row, row = _key_and_host_rows(t, page, safe_pos % ext)
    # A position without a host row (no extent, or past the pool or the page table) would be
    # an engine bug: it counts as invalid and gets -1, as in the Triton kernels, rather than
    # reading a wrapped or wild residency entry.
    no_row = (row < 0) | (row >= t.num_host_rows)
    by_position = t.residency_map == "position"
    # Only a miss needs its host row: a resident token is a hit on its key alone (keyed by
    # position, the Triton lookup reads the page table for misses alone).
    no_key = ~in_table if by_position else (page < 0) | (key_row >= t.num_keys)
    lost = candidate & no_key
    candidate = candidate & ~lost
    key = torch.where(candidate, t.residency_keys(r[:, None], safe_pos, key_row), 0)
    resident_slot = t.resident[group, key].long()
    hit = candidate & (resident_slot >= 0)
    miss = candidate & (resident_slot < 0)
    lost = lost | (miss & no_row)
    miss = miss & ~no_row
    result = torch.where(hit, base + resident_slot, result)
    return _Lookup(real=real, r=r, short=short, result=result, served=valid & ~lost,
                   hit=hit, resident_slot=resident_slot, miss=miss, invalid=invalid | lost,
                   row=row, key=key, base=base)


def _key_and_host_rows(t: CacheTables, page: torch.Tensor, offset: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(key row, host row) of page-table entries `page` (-1: none, both negative): the same
    row unless the page table holds key extents, whose host extents `key_host_extent` gives
    (a shared extent has one key extent per request holding it)."""
    key_row = page * t.extent_tokens + offset
    keys = t.key_host_extent
    if keys is None:
        return key_row, key_row
    known = (page >= 0) & (page < keys.shape[0])
    host_extent = torch.where(known, keys[torch.where(known, page, 0)].long(), -1)
    return key_row, torch.where(host_extent >= 0, host_extent * t.extent_tokens + offset, -1)


class _Selection(NamedTuple):
    """The victims the LRU gave a batch's misses."""

    miss: torch.Tensor  # [B, K] the misses that got a slot
    victim: torch.Tensor  # [B, K] each one's victim slot
    rank: torch.Tensor  # [B, K] each miss's rank among its row's (top-k order)
    installed: torch.Tensor  # [B] misses installed per row (0 for short and padding rows)


def _select_victims(t: CacheTables, group: int, found: _Lookup) -> _Selection:
    """Exact LRU over the long-regime rows: hits take the clock's value; the evictable slots
    are those below it, oldest first, ties by slot id; miss m (top-k order) takes the m-th
    victim in slot-id order. Leaves the stamps and clocks updated."""
    hot_slots = t.hot_slots
    batch_cap, dev = found.result.shape[0], found.result.device
    r, hit, miss = found.r, found.hit, found.miss
    update = found.real & ~found.short[:, 0]
    clock = t.lru_clock[group, r].long()[:, None]  # [B, 1]
    stamps = t.last_use[group, r].long()  # [B, H]
    slot_ids = torch.arange(hot_slots, device=dev)
    hit_slot = torch.zeros(batch_cap, hot_slots + 1, dtype=torch.bool, device=dev)
    hit_slot.scatter_(1, torch.where(hit, found.resident_slot, hot_slots), True)
    stamps = torch.where(hit_slot[:, :hot_slots], clock, stamps)
    evictable = stamps < clock
    # (stamp, slot id) as one key: stamps are int32, slot ids < H.
    age_key = torch.where(evictable, stamps * hot_slots + slot_ids,
                          torch.iinfo(torch.int64).max)
    by_age = age_key.argsort(dim=1)
    num_miss = miss.sum(1, keepdim=True)
    installed = torch.minimum(num_miss, evictable.sum(1, keepdim=True))
    oldest_rank = torch.empty_like(by_age).scatter_(1, by_age, slot_ids.expand_as(by_age))
    chosen = evictable & (oldest_rank < installed)
    chosen_rank = chosen.long().cumsum(1) - 1
    victims = torch.zeros(batch_cap, hot_slots + 1, dtype=torch.long, device=dev)
    victims.scatter_(1, torch.where(chosen, chosen_rank, hot_slots),
                     slot_ids.expand_as(chosen_rank))
    miss_rank = miss.long().cumsum(1) - 1
    miss = miss & (miss_rank < installed)
    victim = victims.gather(1, miss_rank.clamp(min=0))
    stamps = torch.where(chosen, clock, stamps)
    t.last_use[group, r[update]] = stamps[update].to(t.last_use.dtype)
    t.lru_clock[group, r[update]] += 1
    return _Selection(miss, victim, miss_rank, torch.where(update, installed[:, 0], 0))


def _install(t: CacheTables, layer: int, group: int, found: _Lookup, chosen: _Selection,
             plan: MissPlan | None, skip_io: bool) -> None:
    """Give each installed miss its victim slot in the tables, copy its row (unless
    skip-IO) and record it in the plan, batch row by batch row in top-k order."""
    victim = chosen.victim
    miss_b, miss_k = chosen.miss.nonzero(as_tuple=True)
    miss_req = found.r[miss_b]
    miss_slot = victim[miss_b, miss_k]
    miss_row = found.row[miss_b, miss_k]
    miss_key = found.key[miss_b, miss_k]
    old_key = t.slot_key[group, miss_req, miss_slot].long()
    t.resident[group, old_key[old_key >= 0]] = -1
    t.resident[group, miss_key] = miss_slot.to(t.resident.dtype)
    t.slot_key[group, miss_req, miss_slot] = miss_key.to(t.slot_key.dtype)
    miss_dst = miss_req * t.slots_per_request + miss_slot
    if not skip_io and miss_row.numel():
        host = t.host_kv[layer]
        dev = found.result.device
        t.device_kv[layer][miss_dst] = host[miss_row.to(host.device)].to(dev, non_blocking=True)
    if plan is not None:
        batch_cap = found.result.shape[0]
        rank = chosen.rank[miss_b, miss_k]
        plan.count[:batch_cap].copy_(chosen.installed.to(plan.count.dtype))
        plan.src[miss_b, rank] = miss_row.to(plan.src.dtype)
        plan.dst[miss_b, rank] = miss_dst.to(plan.dst.dtype)


def copy_planned_reference(tables: CacheTables, layer: int, plan: MissPlan) -> None:
    """Copy the rows a plan recorded into `layer`'s device rows (shared-index replay)."""
    num_rows, k = plan.src.shape
    count = plan.count[:num_rows]  # may be longer than the plan's rows, as in the Triton copy
    take = torch.arange(k, device=plan.count.device)[None, :] < count[:, None]
    src = plan.src[take].long()
    dst = plan.dst[:num_rows, :k][take].long()
    host = tables.host_kv[layer]
    # Entries outside the layer's rows (a plan the planner did not make) are skipped, as the
    # Triton copy skips them, instead of wrapping a negative row around to the last one.
    keep = (src >= 0) & (src < host.shape[0]) & (dst >= 0)
    keep &= dst < tables.device_kv.shape[1]
    src, dst = src[keep], dst[keep]
    if src.numel():
        rows = host[src.to(host.device)]
        tables.device_kv[layer][dst.to(tables.device_kv.device)] = rows.to(
            tables.device_kv.device, non_blocking=True
        )


class ReferenceSwapInLauncher:
    """`launch.SwapInLauncher`'s interface over the torch reference (the CPU backend, and any
    backend without triton): the engine drives both alike."""

    def __init__(self, tables: CacheTables, req_slots: torch.Tensor, num_real: torch.Tensor,
                 out: torch.Tensor, *, plans: Sequence[MissPlan | None] | None = None,
                 skip_io: bool = False,
                 swap_in: Callable[..., None] | None = None,
                 copy_planned: Callable[..., None] | None = None) -> None:
        self.tables, self.skip_io = tables, skip_io
        self._req_slots, self._num_real, self._out = req_slots, num_real, out
        self._swap_in = swap_in or swap_in_reference
        self._copy_planned = copy_planned or copy_planned_reference
        self.plans = list(plans) if plans is not None else [None] * out.shape[0]

    # The torch reference writes no new rows and takes no union: the engine does both.
    capabilities = LauncherCapabilities()

    def swap_in(self, layer: int, group: int, rows: int, top_k: torch.Tensor) -> None:
        recorded = self.plans[group]
        plan = recorded.first_rows(rows) if recorded is not None else None
        self._swap_in(self.tables, layer, group, self._req_slots[:rows], top_k, self._num_real,
                      self._out[group][:rows], plan=plan, skip_io=self.skip_io)

    def replay(self, layer: int, group: int, rows: int) -> None:
        self._copy_planned(self.tables, layer, self.plans[group].first_rows(rows))
