"""The per-slot arrays a decode step reads (`SlotAllocator.lengths` and `pages`) agree with the
records and the device tables after random lifecycles.

`begin_decode_step` reads each request's length and the extent of its new token from numpy
arrays indexed by request slot instead of from the records, and reuses the last batch's
records and slots while nothing changed. Every lifecycle call that moves a request (admit,
commit, PD transfer, steps, verify steps and their accept counts, cancel, preempt, resume,
finish, abort, a private copy of a shared prefix) must keep them right; this walks random
mixes of them and checks, after each call, the arrays against the records' extents and the
device page table and lengths (on the CPU the tables are readable).
"""

from __future__ import annotations

import random
from collections.abc import Hashable

import numpy as np
import pytest
import torch

import hisparse
from hisparse.core.requests import RequestState
from hisparse.errors import HisparseError
from test_reliability_state import check_key_extents

L, W, K, HOT, E = 2, 16, 4, 8, 4


def _cache(validate: bool, group: int, residency_map: str = "position"
           ) -> hisparse.HiSparseCache:
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=L, row_bytes=W, top_k=K, hot_slots=HOT, index_group_size=group,
        extent_tokens=E, max_requests=4, max_batch=3, host_pool_tokens=80 * E,
        max_seq_len=24 * E, max_draft_tokens=2, validate=validate,
        residency_map=residency_map)
    return hisparse.HiSparseCache(config, device="cpu")


def check_slot_arrays(cache: hisparse.HiSparseCache) -> None:
    """Every slot holder's length and pages are its own and the device tables'; free slots
    hold nothing."""
    slots, tables = cache._slots, cache.tables
    held = {}
    for record in cache._requests:
        if record.slot is None:
            assert record._lengths is None
            continue
        assert record.slot not in held, f"slot {record.slot} held twice"
        held[record.slot] = record
        assert record.num_tokens == int(slots.lengths[record.slot])
        row = slots.pages[record.slot]
        count = len(record.extents)
        assert row[:count].tolist() == record.extents and (row[count:] == -1).all()
        assert slots.held[record.slot] == count
        if record.state is RequestState.RUNNING:  # seeded: the device tables hold it too
            # (host_row: the key extents, the host ones but for the aliases of shared ones)
            keys = (record.key_extents() if tables.residency_map == "host_row"
                    else record.extents)
            assert tables.page_table[record.slot].tolist()[:count] == keys
            assert (tables.page_table[record.slot][count:] == -1).all()
            assert int(tables.seq_lens[record.slot]) == record.num_tokens
    check_key_extents(cache)
    for slot in set(range(slots.num_slots)) - set(held):
        assert slots.lengths[slot] == 0 and (slots.pages[slot] == -1).all()
        assert slots.held[slot] == 0


def _step(cache: hisparse.HiSparseCache, rng: random.Random, ids: list[Hashable]) -> None:
    tokens = rng.choice([1, 1, 2])
    step = cache.begin_decode_step(ids, num_tokens=tokens)
    check_slot_arrays(cache)
    B = len(ids)
    for layer in range(L):
        shape = (B, W) if tokens == 1 else (B, tokens, W)
        step.write_newest(layer, torch.randint(0, 256, shape, dtype=torch.uint8))
        if layer % cache.index_group_size == 0:
            lengths = [cache.seq_len(i) for i in ids]
            top_k = torch.tensor(  # distinct positions each row, -1 padded
                [[(rng.sample(range(n - tokens + s + 1), min(K, n - tokens + s + 1))
                   + [-1] * K)[:K] for s in range(tokens)] for n in lengths],
                dtype=torch.int32)
            step.swap_in(layer, top_k[:, 0] if tokens == 1 else top_k)
    if rng.random() < 0.25:
        step.cancel()
    elif tokens > 1:
        step.end(accepted=[rng.randint(1, tokens) for _ in ids])
    else:
        step.end()


def _lifecycle_call(cache: hisparse.HiSparseCache, rng: random.Random, names: list[str],
                    handles: list[object]) -> None:
    live = {r.request_id: r for r in cache._requests}
    running = [i for i, r in live.items() if r.state is RequestState.RUNNING]
    choice = rng.random()
    if choice < 0.45 and running:
        batch = rng.sample(running, min(len(running), rng.randint(1, 3)))
        # The same batch again often: the remembered-batch path.
        for _ in range(rng.randint(1, 3)):
            _step(cache, rng, batch)
        return
    name = f"r{len(names)}"
    if choice < 0.6:
        names.append(name)
        tokens = rng.randint(1, 20)
        prefix = rng.choice(handles) if handles and rng.random() < 0.5 else None
        cache.admit(name, tokens, prefix=prefix)
        first = prefix.num_tokens if prefix is not None else 0
        if tokens > first:
            cache.write_prefill(name, torch.randint(0, 256, (L, tokens - first, W),
                                                    dtype=torch.uint8), start=first)
        cache.commit_prefill(name)
    elif choice < 0.68:
        names.append(name)
        cache.reserve_host_slots(name, rng.randint(1, 20))
        cache.complete_transfer(name)
    elif choice < 0.74 and running:
        source = rng.choice(running)
        handles.append(cache.retain_prefix(source, rng.randint(1, cache.seq_len(source))))
    elif choice < 0.78 and handles:
        cache.release_prefix(handles.pop(rng.randrange(len(handles))))
    elif live:
        request_id, record = rng.choice(list(live.items()))
        if record.state is RequestState.RUNNING and rng.random() < 0.5:
            cache.preempt(request_id)
        elif record.state is RequestState.PREEMPTED and rng.random() < 0.7:
            cache.resume(request_id)
        elif record.state is RequestState.RESERVED or rng.random() < 0.3:
            cache.abort(request_id)
        else:
            cache.finish(request_id)


@pytest.mark.parametrize("residency_map", ["host_row", "position"])
@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_the_slot_arrays_agree_with_records_and_tables_after_random_lifecycles(
        validate: bool, group: int, seed: int, residency_map: str) -> None:
    rng = random.Random(seed)
    cache = _cache(validate, group, residency_map)
    names: list[str] = []
    handles: list[object] = []
    calls = 0
    for _ in range(150):
        try:
            _lifecycle_call(cache, rng, names, handles)
            calls += 1
        except HisparseError:
            step = cache._step
            if step is not None:  # a refused verb of an open step: leave it cancelled
                step.cancel()
        check_slot_arrays(cache)
    assert calls > 75
    cache.close()


def test_a_repeated_batch_reuses_its_records_until_a_request_changes() -> None:
    cache = _cache(False, 1)
    for name in ("a", "b"):
        cache.admit(name, 6)
        cache.write_prefill(name, torch.zeros(L, 6, W, dtype=torch.uint8))
        cache.commit_prefill(name)

    def run(ids: list[str]) -> tuple[list[object], np.ndarray]:
        step = cache.begin_decode_step(ids)
        for layer in range(L):
            step.write_newest(layer, torch.zeros(len(ids), W, dtype=torch.uint8))
            step.swap_in(layer, torch.zeros(len(ids), K, dtype=torch.int32))
        records = step._records
        slots = cache._slots.slots_of(records)
        step.end()
        return records, slots

    first, slots = run(["a", "b"])
    again, slots_again = run(["a", "b"])
    assert again is first and slots_again is slots and not slots.flags.writeable
    cache.preempt("b")
    cache.resume("b")  # a change: looked up afresh (b may hold another slot now)
    third, _ = run(["a", "b"])
    assert third is not first
    assert [cache.seq_len(i) for i in ("a", "b")] == [9, 9]
    check_slot_arrays(cache)
    cache.close()
