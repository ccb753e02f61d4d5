"""Per-request hit rates in `stats()`, against the plain-Python model of the same trace.

Each running request's hits and misses since it got its device slot come from the swap-in's
per-slot counters (the torch reference on the CPU, the Triton kernels on a GPU); the model
(tests/oracle.py) decides independently which top-k entries were resident."""

from __future__ import annotations

import random

import torch

import hisparse
from oracle import CacheModel


def _config(**overrides: object) -> hisparse.HiSparseConfig:
    base = {"num_layers": 4, "top_k": 4, "hot_slots": 6, "extent_tokens": 4,
            "max_requests": 3, "host_pool_tokens": 512, "max_seq_len": 64,
            "index_group_size": 2}
    return hisparse.HiSparseConfig.from_preset("tiny", **{**base, **overrides})


def test_each_running_request_reports_its_own_hits_and_misses() -> None:
    rng = random.Random(int(torch.randint(0, 2**31, ()).item()))
    config = _config()
    cache = hisparse.HiSparseCache(config, device="cpu")
    model = CacheModel(config.num_layers, cache.hot_slots, config.index_group_size)
    width = config.row_bytes
    for request_id, length in {"a": 20, "b": 5, "c": 12}.items():
        kv = torch.randint(0, 256, (config.num_layers, length, width), dtype=torch.uint8)
        cache.admit(request_id, length)
        cache.write_prefill(request_id, kv)
        cache.commit_prefill(request_id)
        model.add(request_id, [[bytes(r) for r in layer.tolist()] for layer in kv])
        model.seed(request_id)
    for step in range(8):
        if step == 4:  # a preempted request stops reporting; resumed, it counts from zero
            cache.preempt("c")
            model.release("c")
            cache.resume("c")
            model.seed("c")
        batch = rng.sample(["a", "b", "c"], rng.randint(1, 3))
        cache.begin_decode_step(batch)
        new = torch.randint(0, 256, (config.num_layers, len(batch), width), dtype=torch.uint8)
        for b, request_id in enumerate(batch):
            model.append(request_id, [bytes(new[layer, b].tolist())
                                      for layer in range(config.num_layers)])
        rows = []
        for request_id in batch:
            n = model.requests[request_id].length
            chosen = rng.sample(range(n), min(n, config.top_k))
            rows.append(chosen + [-1] * (config.top_k - len(chosen)))
        top_k = torch.tensor(rows, dtype=torch.int32)
        for layer in range(config.num_layers):
            cache.write_newest(layer, new[layer])
            cache.swap_in(layer, top_k)
            model.swap_in(layer, batch, rows)
        cache.end_decode_step()
    stats = cache.stats()
    got = {r.request_id: r for r in stats.requests}
    assert sorted(got) == ["a", "b", "c"]
    for request_id, want in model.request_counts.items():
        assert (got[request_id].hits, got[request_id].misses) == (want.hits, want.misses)
        looked_up = want.hits + want.misses
        assert got[request_id].hit_rate == (want.hits / looked_up if looked_up else None)
    assert stats.to_dict()["requests"][0]["request_id"] == "a"
    cache.preempt("b")
    assert "b" not in {r.request_id for r in cache.stats().requests}
    cache.close()


def _verify_trace(cache: hisparse.HiSparseCache, rng: random.Random, steps: int) -> None:
    """Random verify and de-duplicated steps over three requests, some top-k entries on the
    steps' own draft tokens and repeated."""
    L, W, K = cache.num_layers, cache.row_bytes, cache.top_k
    lengths = {"a": 20, "b": 9, "c": 14}
    for request_id, length in lengths.items():
        cache.admit(request_id, length)
        cache.write_prefill(request_id, torch.randint(0, 256, (L, length, W), dtype=torch.uint8))
        cache.commit_prefill(request_id)
    ids = list(lengths)
    for _ in range(steps):
        tokens = rng.choice([1, 2, 3])
        step = cache.begin_decode_step(ids, num_tokens=tokens, dedupe=tokens == 1)
        rows = [[[rng.randrange(lengths[r] + s + 1) for _ in range(K)] for s in range(tokens)]
                for r in ids]
        top_k = torch.tensor(rows, dtype=torch.int32)
        if tokens == 1:
            top_k = top_k[:, 0]
        for layer in range(L):
            shape = (len(ids), tokens, W) if tokens > 1 else (len(ids), W)
            step.write_newest(layer, torch.randint(0, 256, shape, dtype=torch.uint8))
            step.swap_in(layer, top_k)
        accepted = [rng.randint(1, tokens) for _ in ids]
        step.end(accepted if tokens > 1 else None)
        for request_id, kept in zip(ids, accepted, strict=True):
            lengths[request_id] += kept


def test_request_hits_and_misses_add_up_to_the_layers_in_verify_and_dedupe_steps() -> None:
    """Each distinct position counts once in both (its draft tokens' included): the requests'
    hits and misses sum to the layers' (stats().layers counts every layer of a group)."""
    rng = random.Random(int(torch.randint(0, 2**31, ()).item()))
    cache = hisparse.HiSparseCache(_config(max_draft_tokens=3, hot_slots=12, index_group_size=1),
                                   device="cpu")
    _verify_trace(cache, rng, steps=6)
    stats = cache.stats()
    assert sum(r.hits for r in stats.requests) == sum(layer.hits for layer in stats.layers)
    assert sum(r.misses for r in stats.requests) == sum(layer.misses for layer in stats.layers)
    assert sum(r.hits for r in stats.requests) > 0
