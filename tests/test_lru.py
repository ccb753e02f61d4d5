"""The swap-in kernel bound by each backend against the oracle, on hand-built tables.

Covers the LRU rule itself (docs/ARCHITECTURE.md, swap_in semantics) without the engine: the
worked example SGLang's kernel test uses, then random states, batches with padding and the
recorded miss plan.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hisparse
from hisparse.layout.tables import CacheTables, MissPlan
from oracle import CacheModel

BACKENDS = hisparse.available_backends()
ROW_BYTES = 8


def make_tables(backend, requests, hot, extent, num_rows, layers=1, seed=0):
    """`requests`: list of (seq_len, {position: slot}, last_use, clock, extents) per request
    slot."""
    g = torch.Generator().manual_seed(seed)
    device = backend.device()
    num_requests, slots = len(requests), hot + 1
    pages = max(len(r[4]) for r in requests)
    # Host rows from the backend: fused kernels read them in place (registered memory).
    host = [backend.alloc_host(num_rows * ROW_BYTES).view(num_rows, ROW_BYTES)
            for _ in range(layers)]
    for layer in host:
        layer.copy_(torch.randint(0, 256, layer.shape, dtype=torch.uint8, generator=g))
    t = CacheTables(
        device_kv=torch.zeros(layers, num_requests * slots + 1, ROW_BYTES, dtype=torch.uint8,
                              device=device),
        host_kv=host,
        page_table=torch.full((num_requests, pages), -1, dtype=torch.int32),
        seq_lens=torch.tensor([r[0] for r in requests], dtype=torch.int32),
        slot_key=torch.full((1, num_requests, hot), -1, dtype=torch.int32),
        last_use=torch.tensor([[r[2] for r in requests]], dtype=torch.int32),
        lru_clock=torch.tensor([[r[3] for r in requests]], dtype=torch.int32),
        resident=torch.full((1, num_rows), -1, dtype=torch.int32),
        counters=torch.zeros(layers, 3, dtype=torch.int64),
        hot_slots=hot,
        extent_tokens=extent,
    )
    for r, (_, slot_of, _, _, extents) in enumerate(requests):
        t.page_table[r, : len(extents)] = torch.tensor(extents, dtype=torch.int32)
        for position, slot in slot_of.items():
            row = extents[position // extent] * extent + position % extent
            t.slot_key[0, r, slot] = row
            t.resident[0, row] = slot
            for layer in range(layers):
                t.device_kv[layer, r * slots + slot] = host[layer][row].to(device)
    for name in ("page_table", "seq_lens", "slot_key", "last_use", "lru_clock", "resident",
                 "counters"):
        setattr(t, name, getattr(t, name).to(device))
    return t


def run_swap_in(backend, t, req_slots, top_k, num_real, plan=None):
    device = t.device_kv.device
    top_k = torch.tensor(top_k, dtype=torch.int32, device=device)
    out = torch.full(top_k.shape, -7, dtype=torch.int32, device=device)  # poison
    backend.kernels.swap_in(
        t, 0, 0, torch.tensor(req_slots, dtype=torch.int32, device=device), top_k,
        torch.tensor([num_real], dtype=torch.int32, device=device), out, plan=plan)
    return out.cpu()


def lru_order(t: CacheTables, r: int) -> list[int]:
    """Request slot r's hot slots, least recently used first (ties by slot id)."""
    stamps = t.last_use[0, r].tolist()
    return sorted(range(len(stamps)), key=lambda s: (stamps[s], s))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_worked_example(backend_name: str) -> None:
    """H = 4, slots hold tokens 1, 4, 2, 5; {4, 2, newest} then {6} (SGLang's kernel test)."""
    backend = hisparse.get_backend(backend_name)
    t = make_tables(backend, [(8, {1: 0, 4: 1, 2: 2, 5: 3}, [-1] * 4, 0, [0, 1])], hot=4,
                    extent=4, num_rows=16)
    out = run_swap_in(backend, t, [0], [[4, 2, 7]], 1)
    assert out.tolist() == [[1, 2, 4]]  # hits in slots 1 and 2, the newest in slot H = 4
    assert t.last_use[0, 0].tolist() == [-1, 0, 0, -1] and t.lru_clock[0, 0].item() == 1
    assert lru_order(t, 0) == [0, 3, 1, 2]
    out = run_swap_in(backend, t, [0], [[6, -1, -1]], 1)
    assert out.tolist() == [[0, -1, -1]]  # slot 0 (token 1) is evicted for token 6
    assert t.last_use[0, 0].tolist() == [1, 0, 0, -1] and t.lru_clock[0, 0].item() == 2
    assert lru_order(t, 0) == [3, 1, 2, 0]
    assert t.resident[0, 1].item() == -1 and t.resident[0, 6].item() == 0
    assert torch.equal(t.device_kv[0, 0].cpu(), t.host_kv[0][6])
    assert t.counters[0].tolist() == [3, 1, 0]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", range(6))
def test_random_states_match_model(backend_name: str, case: int, seed: int) -> None:
    backend = hisparse.get_backend(backend_name)
    device = backend.device()
    rng = np.random.default_rng([seed, case])  # fresh states each run; the seed replays them
    hot, extent, k, num_requests, capacity = 6, 4, 5, 3, 5
    pages = 6
    extents = rng.permutation(num_requests * pages).reshape(num_requests, pages).tolist()
    model = CacheModel(num_layers=1, hot_slots=hot, index_group_size=1)
    requests = []
    for r in range(num_requests):
        n = int(rng.integers(1, pages * extent + 1))
        model.add(r, [[b""] * n])
        clock = int(rng.integers(0, 4))
        if n > hot:  # long: any older positions in any slots, any stamps below the clock
            held = rng.permutation(n - 1)[: rng.integers(0, hot + 1)]
            slot_of = {int(p): int(s) for p, s in zip(held, rng.permutation(hot), strict=False)}
            last_use = rng.integers(-2, clock, hot).tolist()  # ties included
        else:  # short: the identity layout
            slot_of, last_use = {p: p for p in range(n)}, [-1] * hot
        model.seed(r)
        buffer = model.requests[r].buffers[0]
        buffer.slot_of, buffer.last_use, buffer.clock = dict(slot_of), list(last_use), clock
        requests.append((n, slot_of, last_use, clock, extents[r]))
    t = make_tables(backend, requests, hot, extent, num_requests * pages * extent,
                    seed=seed + case)
    plan = MissPlan.empty(capacity, k, device)
    for _ in range(4):  # several calls: the LRU state carries over
        batch = rng.permutation(num_requests)[: rng.integers(1, num_requests + 1)].tolist()
        top_k = np.full((capacity, k), -1)
        for b, r in enumerate(batch):
            n = model.requests[r].length
            chosen = rng.permutation(n)[: rng.integers(0, k + 1)].tolist()
            if chosen and rng.random() < 0.3:
                chosen[0] = int(rng.choice([n, -4]))  # invalid: -1 out, counted
            top_k[b, : len(chosen)] = chosen
            top_k[b] = rng.permutation(top_k[b])
        top_k[len(batch):] = rng.integers(-2, 30, size=(capacity - len(batch), k))
        req_slots = batch + [0] * (capacity - len(batch))
        misses_before = model.counts[0].misses
        out = run_swap_in(backend, t, req_slots, top_k.tolist(), len(batch), plan)
        expected = model.swap_in(0, batch, top_k[: len(batch)].tolist())
        slots = hot + 1
        for b, r in enumerate(batch):
            assert out[b].tolist() == [r * slots + s if s >= 0 else -1 for s in expected[b]]
        assert (out[len(batch):] == -1).all()
        for r in range(num_requests):
            buffer = model.requests[r].buffers[0]
            assert t.last_use[0, r].tolist() == buffer.last_use
            assert t.lru_clock[0, r].item() == buffer.clock
            for position, slot in buffer.slot_of.items():
                row = extents[r][position // extent] * extent + position % extent
                assert t.slot_key[0, r, slot].item() == row
                assert t.resident[0, row].item() == slot
                assert torch.equal(t.device_kv[0, r * slots + slot].cpu(), t.host_kv[0][row])
        # The plan lists exactly this call's misses, replayable on another layer.
        count = plan.count.cpu()
        assert int(count[len(batch):].sum()) == 0
        assert int(count.sum()) == model.counts[0].misses - misses_before
        for b in range(len(batch)):
            sources = plan.src[b, : int(count[b])].cpu()
            targets = plan.dst[b, : int(count[b])].cpu()
            for source, target in zip(sources.tolist(), targets.tolist(), strict=True):
                assert torch.equal(t.device_kv[0, target].cpu(), t.host_kv[0][source])
    counts = model.counts[0]
    assert t.counters[0].tolist() == [counts.hits, counts.misses, counts.invalid]
