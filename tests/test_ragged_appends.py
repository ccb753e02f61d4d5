"""Ragged appends (`begin_decode_step(ids, appends=[...])`): a step in which each request
appends 0 or 1 rows, as a compressed layer's entries appear only when a window closes.

Every request of every regime (short, switching to the newest slot, long needing an extent,
long inside one) appends at random over many steps; every returned row, every host row and
the device tables are checked against the rows written, and a request that appends nothing
keeps its length, its host rows byte for byte, and a newest slot that still serves its last
row. A cancelled ragged step leaves everything as before; the plan says which path it took.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hisparse
from hisparse.tools.combination_fuzz import swap_in_new_rows
from test_cancel_step import EXTENT, GROUP, HOT, LAYERS, TOP_K, WIDTH, random_top_k
from test_reliability_state import check_table_invariants, prefill_patterned, row_pattern

# Request -> (uid, prompt length): one of each regime, and two short ones (one may append
# into its own slot while the other appends nothing).
REQUESTS = {"short": (1, 5), "short2": (5, 2), "switch": (2, HOT), "long": (3, 20),
            "long2": (4, 13)}


def build(backend: Any, residency_map: str = "host_row") -> hisparse.HiSparseCache:
    """The requests above prefilled, on either residency map."""
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=LAYERS, row_bytes=WIDTH, top_k=TOP_K, hot_slots=HOT,
        index_group_size=GROUP, extent_tokens=EXTENT, max_requests=5, max_batch=5,
        host_pool_tokens=40 * EXTENT, max_seq_len=32, validate=True,
        residency_map=residency_map)
    cache = hisparse.HiSparseCache(config, device=backend)
    for name, (uid, tokens) in REQUESTS.items():
        prefill_patterned(cache, name, uid, tokens, LAYERS, WIDTH)
    return cache


def _rows(uid: int, layer: int, positions: list[int]) -> torch.Tensor:
    return row_pattern(uid, layer, torch.tensor(positions), WIDTH)


def _ragged_step(cache: hisparse.HiSparseCache, names: list[str], appends: list[int],
                 gen: torch.Generator, folded: bool) -> None:
    """One ragged step with the true rows (noise for a request that appends nothing: it must
    go nowhere), every returned row checked."""
    uids = {n: REQUESTS[n][0] for n in names}
    before = [cache.seq_len(n) for n in names]
    step = cache.begin_decode_step(names, appends=appends)
    assert step.appends == tuple(appends) and step.positions == tuple(before)
    after = [n + a for n, a in zip(before, appends, strict=True)]
    assert [cache.seq_len(n) for n in names] == after
    top_k = random_top_k(cache, names, gen)  # below each request's new length
    for layer in range(LAYERS):
        kv = torch.stack([
            _rows(uids[n], layer, [p])[0] if a else
            torch.randint(0, 256, (WIDTH,), dtype=torch.uint8, generator=gen)
            for n, p, a in zip(names, before, appends, strict=True)]).to(cache.device)
        rows = swap_in_new_rows(step, layer, top_k, kv, folded)
        device_kv = cache.device_kv(layer).cpu()
        for b, name in enumerate(names):
            picked = top_k[b].cpu()
            want = _rows(uids[name], layer, picked.tolist())
            got = device_kv[rows[b].cpu().long()]
            assert torch.equal(got[picked >= 0], want[picked >= 0]), (name, layer, appends)
    step.end()


def _bytes_backed_up(cache: hisparse.HiSparseCache) -> int:
    return cache.stats().layers[0].bytes_device_to_host


def _host_rows_hold_every_token(cache: hisparse.HiSparseCache, names: list[str]) -> None:
    cache.backend.synchronize()
    host = cache.host_tensors()
    for name in names:
        uid, n = REQUESTS[name][0], cache.seq_len(name)
        rows = torch.from_numpy(cache.host_rows(name))
        for layer in range(LAYERS):
            assert torch.equal(host[layer][rows], _rows(uid, layer, list(range(n)))), name


@pytest.mark.parametrize("residency_map", ["host_row", "position"])
@pytest.mark.parametrize("folded", [False, True], ids=["write-then-swap", "folded"])
def test_requests_append_only_where_asked_and_keep_everything_else(
        backend: Any, folded: bool, residency_map: str, rng: torch.Generator) -> None:
    cache = build(backend, residency_map)
    names = list(REQUESTS)
    for _ in range(12):
        appends = torch.randint(0, 2, (len(names),), generator=rng).tolist()
        if all(appends):
            appends[int(torch.randint(0, len(names), (1,), generator=rng))] = 0
        cache.backend.synchronize()
        host_before = [h.clone() for h in cache.host_tensors()]
        idle_rows = {n: torch.from_numpy(cache.host_rows(n)).clone()
                     for n, a in zip(names, appends, strict=True) if not a}
        backed_up = _bytes_backed_up(cache)
        _ragged_step(cache, names, appends, rng, folded)
        assert _bytes_backed_up(cache) - backed_up == sum(appends) * WIDTH
        check_table_invariants(cache)
        _host_rows_hold_every_token(cache, names)
        # An idle request's whole last extent (the row after its newest included) is as it was.
        cache.backend.synchronize()
        E = cache.extent_tokens
        for name, rows in idle_rows.items():
            extent = rows[-1] // E * E + torch.arange(E)
            for layer in range(LAYERS):
                assert torch.equal(cache.host_tensors()[layer][extent],
                                   host_before[layer][extent]), (name, appends)
    cache.close()


def test_a_step_where_nobody_appends_changes_no_length_and_no_host_row(
        backend: Any, rng: torch.Generator) -> None:
    cache = build(backend)
    names = list(REQUESTS)
    lengths = {n: cache.seq_len(n) for n in names}
    cache.backend.synchronize()
    host_before = [h.clone() for h in cache.host_tensors()]
    backed_up = _bytes_backed_up(cache)
    for _ in range(3):
        _ragged_step(cache, names, [0] * len(names), rng, folded=False)
    cache.backend.synchronize()
    assert {n: cache.seq_len(n) for n in names} == lengths
    assert all(torch.equal(a, b) for a, b in
               zip(host_before, cache.host_tensors(), strict=True))
    assert _bytes_backed_up(cache) == backed_up
    check_table_invariants(cache)
    cache.close()


def test_a_cancelled_ragged_step_leaves_every_request_as_before(
        backend: Any, rng: torch.Generator) -> None:
    cache = build(backend)
    names = list(REQUESTS)
    _ragged_step(cache, names, [1, 0, 1, 0, 1], rng, folded=False)
    lengths = {n: cache.seq_len(n) for n in names}
    used = cache.stats().occupancy.host_extents_used
    step = cache.begin_decode_step(names, appends=[0, 1, 1, 0, 1])
    noise = torch.randint(0, 256, (len(names), WIDTH), dtype=torch.uint8, generator=rng)
    top_k = random_top_k(cache, names, rng)
    for layer in range(LAYERS):  # a forward pass that then failed: noise everywhere
        step.write_newest(layer, noise.to(cache.device))
        step.swap_in(layer, top_k)
    step.cancel()
    assert {n: cache.seq_len(n) for n in names} == lengths
    assert cache.stats().occupancy.host_extents_used == used
    check_table_invariants(cache)
    # The next steps decode as if the cancelled one had never been: the newest slots and
    # every host row hold their tokens.
    _ragged_step(cache, names, [1, 1, 0, 1, 0], rng, folded=True)
    _ragged_step(cache, names, [0, 1, 1, 1, 1], rng, folded=False)
    _host_rows_hold_every_token(cache, names)
    cache.close()


def test_the_plan_of_a_ragged_step_is_planned_and_all_ones_stay_quiet() -> None:
    cache = build("cpu")
    names = ["long2", "long"]
    plan = cache.step_plan(2, appends="ragged")
    assert plan.appends == "ragged" and not plan.quiet_advance and not plan.union
    assert cache.step_plan(2).appends == "every" and cache.step_plan(2).quiet_advance
    assert "appends" in str(plan)
    step = cache.begin_decode_step(names, appends=torch.tensor([0, 1]))
    assert step.plan is plan
    step.cancel()
    # Every request appending one is the every-request path, whose unchanged batch moves on
    # by one device launch: the steps after the first upload nothing.
    uploads = []
    for _ in range(3):
        step = cache.begin_decode_step(names, appends=[1, 1])
        assert step.plan is cache.step_plan(2)
        uploads.append(cache._decode.buffers.block.uploads)
        for layer in range(LAYERS):
            step.write_newest(layer, torch.zeros(2, WIDTH, dtype=torch.uint8))
        step.end()
    assert uploads[1] == uploads[2], uploads
    with pytest.raises(hisparse.InvalidInputError, match="appends must be 'every' or 'ragged'"):
        cache.step_plan(2, appends="some")
    with pytest.raises(hisparse.InvalidInputError, match="dedupe=False"):
        cache.step_plan(2, dedupe=True, appends="ragged")
    cache.close()
