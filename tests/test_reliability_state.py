"""Helpers the reliability tests share, and tests that the helpers themselves catch changes.

full_snapshot(cache)       everything a rejected call must leave as it was: every CacheTables
                           tensor (device rows including the sink, host rows), the batch and
                           plan buffers, the LRU order, request records and freed-id memory,
                           the pool's free runs, free request slots, traffic counters,
                           statistics, the open step and its bookkeeping flags
assert_same_state(a, b)    names the first part that differs
check_table_invariants(c)  the ARCHITECTURE.md invariants between the engine's records and
                           its device tables, without an oracle (for threaded tests), with
                           check_key_extents(c): host_row's key extents, one request each
check_holders(c)           the host pool's holder count of every extent is the number of
                           requests and retained prefixes listing it; free means none
row_pattern(...)           deterministic row bytes of (request uid, layer, position), so a
                           test or script can verify any returned row without storing the KV
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import pytest
import torch

import hisparse
from hisparse.core.host_pool import token_rows
from hisparse.core.requests import RequestState

_M31 = (1 << 31) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (xorshift-multiply rounds); products stay below 2**62."""
    for multiplier in (0x2C1B3C6D, 0x297A2D39, 0x3C6EF372):
        x = ((x ^ (x >> 15)) * multiplier) & _M31
    return x ^ (x >> 13)


def row_pattern(uid: torch.Tensor | int, layer: torch.Tensor | int, positions: torch.Tensor,
                width: int) -> torch.Tensor:
    """uint8 `[*positions.shape, width]`: token `positions` of request `uid` in `layer`.

    Each row gets two independent 31-bit hashes of its key, so two rows of a long run (a
    collision would hide a wrong-row bug) agree in both about once in 2**62; byte `j` mixes
    them with per-column odd multipliers, a few integer ops per byte (cheap on a CPU too).
    `uid` and `layer` broadcast with `positions`.
    """
    device = positions.device
    uid = torch.as_tensor(uid, dtype=torch.int64, device=device)
    p = positions.long()
    low = _mix((uid * 0x9E3779B1 + layer * 0x7FEB352D + p * 0x846CA68B) & _M31)
    high = _mix((uid * 0x85EBCA77 + layer * 0x27D4EB2F + p * 0x165667B1 + 0x5BD1E995) & _M31)
    column = torch.arange(width, dtype=torch.int64, device=device)
    first = _mix(column * 0x61C88647 + 1) | 1  # odd multipliers below 2**31
    second = _mix(column * 0x2545F491 + 7) | 1
    mixed = ((low[..., None] * first) >> 23) ^ ((high[..., None] * second) >> 23)
    return (mixed & 0xFF).to(torch.uint8)


def prefill_patterned(cache: Any, name: Hashable, uid: int, tokens: int, layers: int,
                      width: int) -> None:
    """Admit `name` with `tokens` tokens and prefill every layer with `row_pattern` rows of
    request `uid`."""
    cache.admit(name, tokens)
    cache.write_prefill(name, torch.stack([
        row_pattern(uid, layer, torch.arange(tokens), width) for layer in range(layers)
    ]).to(cache.device))
    cache.commit_prefill(name)


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().cpu()
    if isinstance(value, list | tuple):
        return [_cpu(v) for v in value]
    return value


def full_snapshot(cache: hisparse.HiSparseCache) -> dict[str, Any]:
    """Everything a rejected call must leave unchanged (reads device state: a host sync)."""
    cache.backend.synchronize()  # backups may still be writing host rows from a side stream
    state: dict[str, Any] = {}
    if not cache._closed:  # close() let go of the device state
        t = cache.tables
        state.update({
            f"tables.{f.name}": _cpu(getattr(t, f.name)) for f in dataclasses.fields(t)
        })
        for index, buffer in enumerate(cache._decode.buffers.state()):
            state[f"buffers.{index}"] = _cpu(buffer)
        for group, replay in enumerate(cache._decode.replays):
            if replay is not None:
                plan = replay.plan
                state[f"plans.{group}"] = [_cpu(plan.src), _cpu(plan.dst), _cpu(plan.count)]
                state[f"replays.{group}"] = (sorted(replay.owed), sorted(replay.unwaited))
        host_rows = cache._order.host_rows
        state["flags"] = (host_rows.copies_in_flight, host_rows.rows_recycled)
    state["requests"] = [
        (r.request_id, r.state, r.admitted_tokens, r.num_tokens, list(r.extents), r.slot,
         r.prefix_tokens, r.aliases)
        for r in cache._requests
    ]
    state["ended"] = list(cache._requests._ended.items())
    state["pool.free_runs"] = cache._pool.allocator.free_runs()
    state["pool.free_extents"] = cache._pool.allocator.free_extents
    state["pool.holders"] = list(cache._pool._holders)
    prefixes = cache._prefixes
    state["prefixes"] = sorted(prefixes._retained.items())
    state["prefixes.released"] = list(prefixes._released)
    state["prefixes.writers"] = sorted(r.request_id for r in prefixes.writers.values())
    state["prefixes.aliases"] = prefixes.aliases.state() if prefixes.aliases else None
    state["pool.layers"] = [h.data_ptr() for h in cache._pool.layers]
    state["slots.free"] = sorted(cache._slots._free)
    state["slots.lengths"] = cache._slots.lengths.tolist()
    state["slots.pages"] = cache._slots.pages.tolist()
    traffic = cache._traffic
    state["traffic"] = [traffic.seeded_tokens.copy(), traffic.offloaded_tokens.copy(),
                        traffic.backed_up_tokens]
    step = cache._step
    state["step"] = None if step is None else (id(step), step.request_ids, step.positions)
    if step is not None:
        state["step.records"] = [id(r) for r in step._records]
        state["step.anchored"] = [replay.group for replay in step._anchored]
        state["step.written_layers"] = sorted(step._written)
    state["closed"] = cache._closed
    state["stats"] = None if cache._closed else cache.stats().to_dict()
    return state


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    changed = [name for name in before if not _equal(before[name], after[name])]
    assert not changed, f"a rejected call changed {changed}"


def check_table_invariants(cache: hisparse.HiSparseCache) -> None:
    """Records and device tables agree (docs/ARCHITECTURE.md), checked without an oracle."""
    t = cache.tables
    H = cache.hot_slots
    seq_lens, page_table = t.seq_lens.cpu(), t.page_table.cpu()
    slot_key, resident = t.slot_key.cpu(), t.resident.cpu()
    last_use, lru_clock = t.last_use.cpu(), t.lru_clock.cpu()
    expected_resident = torch.full_like(resident, -1)
    used_slots = set()
    check_key_extents(cache)
    for record in cache._requests:
        if record.slot is None:
            assert record.state is not RequestState.RUNNING
            continue
        r = record.slot
        used_slots.add(r)
        assert record.state is RequestState.RUNNING
        assert int(seq_lens[r]) == record.num_tokens
        pages = page_table[r].tolist()
        # host_row: key extents (aliases for the shared extents it joined); position: extents
        keys = record.key_extents() if t.residency_map == "host_row" else record.extents
        assert pages[: len(keys)] == keys
        assert all(p == -1 for p in pages[len(keys):])
        # The residency keys of its tokens: key rows (its host rows but for aliases), or
        # r*T + position (position map).
        own_rows = (set(token_rows(keys, t.extent_tokens, 0, record.num_tokens).tolist())
                    if t.residency_map == "host_row" else
                    {r * t.positions_per_request + p for p in range(record.num_tokens)})
        for group in range(cache.num_groups):
            # Every slot was last used before the clock's current step (seeding: -1 and 0).
            assert bool((last_use[group, r] < lru_clock[group, r]).all()), "stamps < clock"
            assert last_use[group, r].shape == (H,)
            for slot, row in enumerate(slot_key[group, r].tolist()):
                if row >= 0:
                    assert row in own_rows, (record.request_id, group, slot, row)
                    # One key, one hot slot: a key two slots hold has one entry for both.
                    assert expected_resident[group, row] < 0, (
                        f"residency key {row} of group {group} is held twice")
                    expected_resident[group, row] = slot
    assert torch.equal(resident, expected_resident)
    free = set(range(cache.max_requests)) - used_slots
    assert set(cache._slots._free) == free
    for r in free:
        assert int(seq_lens[r]) == 0 and (page_table[r] == -1).all()
        assert (slot_key[:, r] == -1).all()
        assert (last_use[:, r] == -1).all() and (lru_clock[:, r] == 0).all()
    held = [e for r in cache._requests for e in r.extents]
    held += [e for rows in cache._prefixes.retained() for e in rows.extents]
    assert cache._pool.allocator.used_extents == len(set(held))


def check_key_extents(cache: hisparse.HiSparseCache) -> None:
    """host_row: one key extent, one request (so one request slot's `resident` entries), and
    `key_host_extent` names its host extent exactly while a slot holder's page table names
    it: identity for the pool's extents, an alias -> the shared extent it stands for, -1 for
    an alias no running request holds. The alias allocator's free ids are the rest."""
    t, prefixes = cache.tables, cache._prefixes
    if t.residency_map != "host_row":
        assert prefixes.aliases is None
        assert all(not r.aliases for r in cache._requests)
        return
    num_extents = cache._pool.num_extents
    holder: dict[int, object] = {}
    for record in cache._requests:
        assert all(a >= num_extents for a in record.aliases), record.aliases
        assert len(record.aliases) <= len(record.extents)
        for key in record.key_extents():
            assert key not in holder, (
                f"key extent {key} is held by {holder[key]!r} and {record.request_id!r}")
            holder[key] = record.request_id
    aliases = prefixes.aliases
    held = [a for r in cache._requests for a in r.aliases]
    assert sorted(held + aliases.state()) == list(
        range(num_extents, num_extents + aliases.capacity))
    if t.key_host_extent is None:
        assert not held and aliases.capacity == 0
        return
    expected = list(range(num_extents)) + [-1] * aliases.capacity
    for record in cache._requests:
        if record.state is RequestState.RUNNING:  # seeded (a prefilling slot is not yet)
            for alias, extent in zip(record.aliases, record.extents, strict=False):
                expected[alias] = extent
    assert t.key_host_extent.cpu().tolist() == expected


def check_holders(cache: hisparse.HiSparseCache) -> None:
    """The pool's holder counts are the holders' extents, and free means no holder."""
    pool = cache._pool
    counts = [0] * pool.num_extents
    for record in cache._requests:
        for extent in record.extents:
            counts[extent] += 1
    for rows in cache._prefixes.retained():
        for extent in rows.extents:
            counts[extent] += 1
    assert pool._holders == counts
    assert [pool.allocator.is_free(e) for e in range(pool.num_extents)] == [c == 0 for c in counts]
    assert pool.shared_extents == sum(c > 1 for c in counts)


# --- the helpers catch what they must ---------------------------------------------------
def _small_cache(residency_map: str = "position") -> hisparse.HiSparseCache:
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=2, row_bytes=16, top_k=2, hot_slots=4, extent_tokens=2,
        max_requests=2, max_batch=2, host_pool_tokens=32, max_seq_len=32, validate=True,
        residency_map=residency_map,
    )
    cache = hisparse.HiSparseCache(config, device="cpu")
    cache.admit("a", 7)
    positions = torch.arange(7)
    cache.write_prefill("a", torch.stack([row_pattern(1, layer, positions, 16)
                                          for layer in range(2)]))
    cache.commit_prefill("a")
    return cache


MUTATIONS: dict[str, Callable[[hisparse.HiSparseCache], None]] = {
    "a host byte": lambda c: c.tables.host_kv[1][3].add_(1),
    "the sink row": lambda c: c.tables.device_kv[0, -1].add_(1),
    "an LRU stamp": lambda c: c.tables.last_use[0, 0, 1].fill_(-2),
    "an LRU clock": lambda c: c.tables.lru_clock[0, 0].add_(1),
    "a counter": lambda c: c.tables.counters[1, 2].add_(1),
    "a batch buffer": lambda c: c._decode.buffers.out[0, 1, 1].fill_(5),
    "a request record": lambda c: setattr(next(iter(c._requests)), "admitted_tokens", 9),
    "the freed-id memory": lambda c: c._requests._ended.update({"x": RequestState.FINISHED}),
    "the pool's free runs": lambda c: c._pool.allocator.allocate(1),
    "a free slot": lambda c: heapq.heappop(c._slots._free),
    "a slot's length": lambda c: c._slots.lengths.__setitem__(-1, 7),
    "a slot's page entry": lambda c: c._slots.pages.__setitem__((-1, 0), 3),
    "a holder count": lambda c: c._pool.share([c._requests.get("a", "test").extents[0]]),
    "a retained prefix": lambda c: c.retain_prefix("a", 3),
    "a traffic counter": lambda c: c._traffic.offloaded_tokens.__setitem__(0, 99),
    "a recycled-rows flag": lambda c: setattr(c._order.host_rows, "rows_recycled", True),
    "the written layers": lambda c: c._step._written.add(1),
    "the anchored groups": lambda c: c._step._anchored.append(c._decode.replays[0]),
}
IN_A_STEP = {"the written layers", "the anchored groups"}  # mutations of an open step


@pytest.mark.parametrize("what", MUTATIONS)
def test_the_snapshot_sees_every_kind_of_change(what: str) -> None:
    cache = _small_cache()
    if what in IN_A_STEP:
        cache.begin_decode_step(["a"])
    before = full_snapshot(cache)
    assert_same_state(before, full_snapshot(cache))
    MUTATIONS[what](cache)
    with pytest.raises(AssertionError, match="changed"):
        assert_same_state(before, full_snapshot(cache))


# host_row's key extents: the alias allocator, a request's aliases, an alias's host extent.
KEY_MUTATIONS: dict[str, Callable[[hisparse.HiSparseCache], None]] = {
    "an alias taken": lambda c: c._prefixes.aliases.take(1),
    "a request's aliases": lambda c: setattr(next(iter(c._requests)), "aliases", (16,)),
    "an alias's host extent": lambda c: c.tables.key_host_extent[16].fill_(3),
}


@pytest.mark.parametrize("what", KEY_MUTATIONS)
def test_the_snapshot_and_the_invariants_see_the_key_extents(what: str) -> None:
    cache = _small_cache("host_row")
    cache.retain_prefix("a", 5)
    check_table_invariants(cache)
    before = full_snapshot(cache)
    KEY_MUTATIONS[what](cache)
    with pytest.raises(AssertionError, match="changed"):
        assert_same_state(before, full_snapshot(cache))
    with pytest.raises(AssertionError):
        check_table_invariants(cache)


def test_invariants_hold_and_catch_a_stale_resident_entry() -> None:
    cache = _small_cache()
    check_table_invariants(cache)
    cache.tables.resident[0, 30] = 1  # a row nobody holds claims a slot
    with pytest.raises(AssertionError):
        check_table_invariants(cache)


def test_row_pattern_is_deterministic_and_rows_differ() -> None:
    positions = torch.arange(4096)
    rows = row_pattern(7, 1, positions, 32)
    assert torch.equal(rows, row_pattern(7, 1, positions, 32))
    assert len({bytes(r.numpy()) for r in rows}) == 4096
    others = [row_pattern(8, 1, positions, 32), row_pattern(7, 0, positions, 32)]
    assert all(not torch.equal(rows, o) for o in others)
    counts = torch.bincount(rows.flatten().long(), minlength=256)
    assert counts.min() > 0.7 * counts.float().mean()  # every byte value shows up evenly
