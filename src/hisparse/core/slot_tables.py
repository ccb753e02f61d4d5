"""The device tables of a cache, and the writes that give a request slot to a request or take
it back outside a decode step (seeding and release, `SlotWriter`; docs/ARCHITECTURE.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hisparse.backends.base import Backend
from hisparse.core.batch import DeviceBlock
from hisparse.core.device_memory import check_device_memory
from hisparse.core.host_pool import HostPool, token_rows, token_runs
from hisparse.core.requests import RequestRecord
from hisparse.layout.tables import CacheTables, residency_dtype, unshared_key_extents

if TYPE_CHECKING:
    from hisparse.config import HiSparseConfig


def build_tables(config: HiSparseConfig, backend: Backend, pool: HostPool, device: torch.device,
                 num_groups: int, hot_slots: int) -> CacheTables:
    """Empty tables: every slot free, every counter 0. Row `R*S` of every layer of
    `device_kv` is a sink for padded batch rows' newest-token writes, so `write_newest`
    stays one `index_copy_` a captured graph can replay with any real count."""
    check_device_memory(config, device, pool.num_extents, num_groups, hot_slots)
    L, R, E = config.num_layers, config.max_requests, config.extent_tokens
    S, H, G = hot_slots + config.max_draft_tokens, hot_slots, num_groups
    pages = -(-config.max_seq_len // E)
    i32 = {"dtype": torch.int32, "device": device}
    by_position = config.residency_map == "position"
    # host_row with shared prefixes: every host extent is its own key extent, and the
    # alias_extents after them name shared ones for the requests that joined them (their
    # entries are written when such a request is seeded).
    aliased = not by_position and config.alias_extents > 0
    key_extents = pool.num_extents + config.alias_extents if aliased else 0
    # resident's entries: one per position of every request slot (keyed by position), per
    # key row (host rows, then the aliases' rows), or per host row.
    keys = R * pages * E if by_position else key_extents * E if aliased else pool.num_rows
    return CacheTables(
        device_kv=torch.zeros(L, R * S + 1, config.row_bytes, dtype=torch.uint8, device=device),
        host_kv=pool.layers,
        page_table=torch.full((R, pages), -1, **i32),
        seq_lens=torch.zeros(R, **i32),
        slot_key=torch.full((G, R, H), -1, **i32),
        last_use=torch.full((G, R, H), -1, **i32),
        lru_clock=torch.zeros(G, R, **i32),
        resident=torch.full((G, keys), -1, dtype=residency_dtype(H), device=device),
        counters=torch.zeros(L, 3, dtype=torch.int64, device=device),
        request_counters=torch.zeros(R, 2, dtype=torch.int64, device=device),
        hot_slots=H,
        extent_tokens=E,
        residency_map=config.residency_map,
        reserved_slots=config.max_draft_tokens,
        # An alias names a host extent only while a running request's page table holds it.
        key_host_extent=(unshared_key_extents(pool.num_extents, config.alias_extents, device)
                         if aliased else None),
        # What the fused backup kernel writes through (device-side on ROCm).
        host_kv_addresses=torch.tensor(
            [backend.device_address(layer) for layer in pool.layers],
            dtype=torch.int64, device=device),
    )


class SlotWriter:
    """Gives a request slot to a request (`seed`) and takes it back (`clear`), outside a
    decode step; the caller orders each against the device work around it.

    The values the host computes (the slot's page-table row, its hot buffer's keys, its
    aliases' host extents) go to the device in one upload from a staging ring, and every other
    write is a fill on the device: writing a Python value or a pageable tensor into device
    memory makes torch copy it from pageable memory, which on CUDA waits for the stream, so
    admitting or releasing a request would block the host on the last step's work.
    """

    def __init__(self, tables: CacheTables, pool: HostPool, backend: Backend,
                 device: torch.device) -> None:
        self.tables = tables
        self.pool = pool
        pages = int(tables.page_table.shape[1])
        i64, i32 = torch.int64, torch.int32
        self._block = DeviceBlock([
            ("page_row", i32, pages, -1), ("keys", i64, tables.hot_slots, -1),
            ("alias_index", i64, pages, 0),
            ("alias_extent", i32, pages, 0),
        ], device, backend)

    def seed(self, record: RequestRecord) -> None:
        """Load the newest `H+1` tokens of `record` into its slot's hot buffer: slots `0..H-1`
        the `H` before the newest, oldest first, and the newest in slot `H` (or, short, every
        token in its own slot)."""
        t, pool, E = self.tables, self.pool, self.tables.extent_tokens
        H, S = t.hot_slots, t.slots_per_request
        n, r = record.num_tokens, record.slot
        assert r is not None
        # (first token, count, first device slot) of each piece of the hot buffer
        if n <= H:
            pieces, lru_tokens = [(0, n, 0)], (0, n)
        else:
            pieces, lru_tokens = [(n - 1 - H, H, 0), (n - 1, 1, H)], (n - 1 - H, n - 1)
        # host_row: key extents (its aliases name the shared extents it joined), whose host
        # extents the aliases' entries of key_host_extent give; position: host extents.
        keys = record.key_extents() if t.residency_map == "host_row" else record.extents
        lru_keys = t.residency_keys(r, np.arange(*lru_tokens, dtype=np.int64),
                                    token_rows(keys, E, *lru_tokens))
        count, aliases = len(lru_keys), len(record.aliases)
        block = self._block
        block.upload({"page_row": keys, "keys": lru_keys,
                      "alias_index": record.aliases,
                      "alias_extent": record.extents[:aliases]})
        t.page_table[r].copy_(block.field("page_row"))
        if aliases:
            assert t.key_host_extent is not None
            t.key_host_extent.index_copy_(0, block.field("alias_index", aliases),
                                          block.field("alias_extent", aliases))
        t.seq_lens[r].fill_(n)
        # (-1 past the keys: empty slots; copy_ narrows them to the table's int32)
        t.slot_key[:, r].copy_(block.field("keys").expand(t.slot_key.shape[0], H))
        t.resident[:, block.field("keys", count)] = torch.arange(
            count, dtype=t.resident.dtype, device=t.resident.device)
        # One stamp for all, below the clock: ties go by slot id, so the oldest token goes first.
        t.last_use[:, r].fill_(-1)
        t.lru_clock[:, r].zero_()
        for first, count, slot in pieces:
            for token, row, length in token_runs(record.extents, E, first, first + count):
                device_row = r * S + slot + token - first
                for layer, host in enumerate(pool.layers):
                    t.device_kv[layer, device_row : device_row + length].copy_(
                        host[row : row + length], non_blocking=True
                    )

    def clear(self, record: RequestRecord) -> None:
        """Empty `record`'s slot in every table."""
        t, r = self.tables, record.slot
        assert r is not None
        own_key = int(t.residency_keys(r, 0, record.key_extents()[0] * t.extent_tokens))
        # Empty hot slots hold -1; point them at the key of the request's first token, cleared
        # anyway, so the scatter needs no host sync to filter them out.
        held = t.slot_key[:, r].long()
        t.resident.scatter_(1, torch.where(held >= 0, held, own_key), -1)
        t.slot_key[:, r].fill_(-1)
        t.last_use[:, r].fill_(-1)
        t.lru_clock[:, r].zero_()
        t.seq_lens[r].zero_()
        t.page_table[r].fill_(-1)
        if record.aliases:  # named by no page table now (a resume's seed names them again)
            assert t.key_host_extent is not None
            aliases = len(record.aliases)
            self._block.upload({"alias_index": record.aliases})
            t.key_host_extent.index_fill_(0, self._block.field("alias_index", aliases), -1)
        if t.request_counters is not None:  # a free slot counts nothing: the next seed starts at 0
            t.request_counters[r].zero_()


def move_keys(tables: CacheTables, slot: int, old_extent: int, new_extent: int) -> None:
    """host_row: a running request's own extent `old_extent` became `new_extent` (its
    private copy of an extent a retained prefix holds), so its tokens' key rows move from one
    key extent to the other: the `slot_key`s and `resident` entries of that extent, in every
    group, keep their hot slots and LRU stamps. Both key extents are this request's alone
    (its own, and a just allocated one, which nobody keys): the old range holds its entries
    or -1, the new one only -1. The caller orders it after the last step."""
    t, E = tables, tables.extent_tokens
    if t.residency_map != "host_row":
        return  # keyed by position: the keys do not name extents
    old, new = old_extent * E, new_extent * E
    held = t.slot_key[:, slot]
    inside = (held >= old) & (held < old + E)
    t.slot_key[:, slot] = torch.where(inside, held - old + new, held)
    t.resident[:, new : new + E] = t.resident[:, old : old + E]
    t.resident[:, old : old + E].fill_(-1)
