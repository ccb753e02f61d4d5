"""Random traces of the whole engine, compared step by step with the plain-Python oracle.

Hypothesis drives the lifecycle (admit or PD reserve, prefill, decode with churn, preempt,
resume, finish, abort); after every rule the device tables, the hot rows' bytes and the host
rows are checked against `oracle.CacheModel`. Scale up with HISPARSE_FUZZ_EXAMPLES.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

import hisparse
from hisparse.core.requests import RequestState
from hisparse.errors import InvalidInputError, PoolExhaustedError
from oracle import CacheModel

FUZZ_EXAMPLES = int(os.environ.get("HISPARSE_FUZZ_EXAMPLES", "100"))
NUM_LAYERS = 4
ROW_BYTES = 32
POISON = -7
# (hot slots H, top_k K, extent tokens E, index group size): small enough for 2 CI cores.
SHAPES = [(8, 4, 4, 1), (8, 8, 2, 2), (16, 8, 8, 2), (12, 6, 4, 4)]


def build_cache(backend: str, hot: int, top_k: int, extent: int, group: int, validate: bool,
                pool_extents: int, max_requests: int = 4, max_batch: int = 3):
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=NUM_LAYERS, row_bytes=ROW_BYTES, top_k=top_k,
        device_buffer_size=hot, index_group_size=group, extent_tokens=extent,
        max_requests=max_requests, max_batch=max_batch, host_pool_tokens=pool_extents * extent,
        max_seq_len=pool_extents * extent, validate=validate,
    )
    return hisparse.HiSparseCache(config, device=backend)


def snapshot(cache) -> dict[str, object]:
    """Everything a rejected call must leave unchanged."""
    t = cache.tables
    tensors = {name: getattr(t, name).clone().cpu() for name in
               ("page_table", "seq_lens", "slot_row", "lru", "resident", "counters")}
    tensors["device_kv"] = t.device_kv[:, : cache.max_requests * cache.slots_per_request].clone()
    tensors["host_kv"] = [h.clone() for h in t.host_kv]
    requests = {r.request_id: (r.state, r.num_tokens, list(r.extents), r.slot)
                for r in cache._requests}
    return {"tensors": tensors, "requests": requests,
            "free_runs": cache._pool.allocator.free_runs(), "free_slots": cache._slots.free_slots}


def assert_unchanged(before: dict[str, object], cache) -> None:
    after = snapshot(cache)
    assert after["requests"] == before["requests"]
    assert after["free_runs"] == before["free_runs"]
    assert after["free_slots"] == before["free_slots"]
    for name, value in before["tensors"].items():
        if isinstance(value, list):
            pairs = zip(value, after["tensors"][name], strict=True)
            assert all(torch.equal(a, b) for a, b in pairs)
        else:
            assert torch.equal(value, after["tensors"][name]), name


class EngineTrace(RuleBasedStateMachine):
    backend = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.cache = None

    @initialize(shape=st.sampled_from(SHAPES), validate=st.booleans(),
                pool_extents=st.integers(12, 40), seed=st.integers(0, 2**31 - 1),
                prompts=st.lists(st.integers(1, 40), min_size=1, max_size=3))
    def build(self, shape, validate, pool_extents, seed, prompts) -> None:
        hot, top_k, extent, group = shape
        self.cache = build_cache(self.backend, hot, top_k, extent, group, validate, pool_extents)
        self.model = CacheModel(NUM_LAYERS, hot, group)
        self.rng = np.random.default_rng(seed)
        self.torch_rng = torch.Generator().manual_seed(seed)
        self.next_id = 0
        self.previous_top_k: dict[int, set[int]] = {}
        for prompt in prompts:  # start with requests so that short traces still decode
            self.admit(prompt, pd=False, per_layer=False)

    # --- helpers --------------------------------------------------------------------------
    def random_rows(self, *shape: int) -> torch.Tensor:
        return torch.randint(0, 256, (*shape, ROW_BYTES), dtype=torch.uint8,
                             generator=self.torch_rng)

    def ids_in(self, state: RequestState) -> list[int]:
        return [r.request_id for r in self.cache._requests if r.state is state]

    def pick(self, ids: list[int]) -> int:
        return ids[int(self.rng.integers(len(ids)))]

    # --- rules ----------------------------------------------------------------------------
    @rule(prompt=st.integers(1, 40), pd=st.booleans(), per_layer=st.booleans())
    def admit(self, prompt: int, pd: bool, per_layer: bool) -> None:
        cache, request_id = self.cache, self.next_id
        self.next_id += 1
        rows = self.random_rows(NUM_LAYERS, prompt)
        needed = -(-prompt // cache.extent_tokens)
        free = cache.stats().occupancy
        out_of_rows = needed > free.host_extents_total - free.host_extents_used
        out_of_slots = free.request_slots_used == free.request_slots_total
        before = snapshot(cache)
        if prompt > cache.max_seq_len:
            with pytest.raises(InvalidInputError, match="max_seq_len"):
                (cache.reserve_host_slots if pd else cache.admit)(request_id, prompt)
            assert_unchanged(before, cache)
            return
        if pd:
            if out_of_rows:
                with pytest.raises(PoolExhaustedError):
                    cache.reserve_host_slots(request_id, prompt)
                assert_unchanged(before, cache)
                return
            res = cache.reserve_host_slots(request_id, prompt)
            runs = np.concatenate([np.arange(f, f + n) for f, n in res.extents])
            assert np.array_equal(runs, res.rows) and len(res.rows) == prompt
            for layer, host in enumerate(res.host_tensors):
                host[torch.from_numpy(res.rows)] = rows[layer]
            if out_of_slots:
                with pytest.raises(PoolExhaustedError):
                    cache.complete_transfer(request_id)
                cache.abort(request_id)
                return
            cache.complete_transfer(request_id)
        else:
            if out_of_rows or out_of_slots:
                with pytest.raises(PoolExhaustedError):
                    cache.admit(request_id, prompt)
                assert_unchanged(before, cache)
                return
            cache.admit(request_id, prompt)
            if per_layer:  # layer by layer, in two chunks, to exercise `start`
                cut = int(self.rng.integers(prompt + 1))
                for layer in range(NUM_LAYERS):
                    for start, stop in ((0, cut), (cut, prompt)):
                        if stop > start:
                            chunk = rows[layer, start:stop].to(cache.device)
                            cache.write_prefill(request_id, chunk, layer=layer, start=start)
            else:  # all layers at once, as bf16 to check the byte view
                cache.write_prefill(request_id, rows.to(cache.device).view(torch.bfloat16))
            cache.commit_prefill(request_id)
        self.model.add(request_id, [[bytes(r.numpy()) for r in layer] for layer in rows])
        self.model.seed(request_id)

    # Rules without preconditions: hypothesis gives up on traces where most rules are
    # disabled, so a rule with nothing to act on just returns.
    @rule(data=st.data(), steps=st.integers(1, 4))
    def decode(self, data, steps: int) -> None:
        for _ in range(steps):
            self._decode_step(data)
            check_against_model(self.cache, self.model)

    def _decode_step(self, data) -> None:
        cache, model = self.cache, self.model
        running = self.ids_in(RequestState.RUNNING)
        if not running:
            return
        count = data.draw(st.integers(1, min(len(running), cache.batch_capacity)))
        batch = [running[i] for i in self.rng.permutation(len(running))[:count]]
        padded = data.draw(st.integers(count, cache.batch_capacity))
        # A request owns ceil(n / E) extents, so the next token needs a new one at n % E == 0.
        grow = sum(cache.seq_len(i) % cache.extent_tokens == 0 for i in batch)
        occupancy = cache.stats().occupancy
        at_limit = any(cache.seq_len(i) == cache.max_seq_len for i in batch)
        if at_limit or grow > occupancy.host_extents_total - occupancy.host_extents_used:
            before = snapshot(cache)
            error = InvalidInputError if at_limit else PoolExhaustedError
            with pytest.raises(error):
                cache.begin_decode_step(batch)
            assert_unchanged(before, cache)
            return
        step = cache.begin_decode_step(batch)
        assert list(step.positions) == [model.requests[i].length for i in batch]
        new_rows = self.random_rows(NUM_LAYERS, padded)
        for request_id, b in zip(batch, range(count), strict=False):
            model.append(request_id, [bytes(new_rows[layer, b].numpy())
                                      for layer in range(NUM_LAYERS)])
        top_k_by_group: dict[int, torch.Tensor] = {}
        for layer in range(NUM_LAYERS):
            cache.write_newest(layer, new_rows[layer].to(cache.device))
            group = layer // cache.index_group_size
            if group not in top_k_by_group:
                top_k_by_group[group] = self._top_k(batch, padded)
                if cache.config.validate and self.rng.random() < 0.2:
                    self._rejected_swap_in(layer, batch, top_k_by_group[group])
            top_k = top_k_by_group[group]
            if layer % cache.index_group_size == 0:  # followers return the anchor's buffer
                cache._out.fill_(POISON)
            got = cache.swap_in(layer, top_k.to(cache.device)).cpu()
            expected = model.swap_in(layer, batch, top_k[:count].tolist())
            self._check_rows(layer, batch, top_k, got, expected, padded)
        cache.end_decode_step()

    def _top_k(self, batch: list[int], padded: int) -> torch.Tensor:
        cache, k = self.cache, self.cache.top_k
        top_k = np.full((padded, k), -1, dtype=np.int32)
        for b, request_id in enumerate(batch):
            n = cache.seq_len(request_id)
            keep = [p for p in self.previous_top_k.get(request_id, ()) if p < n]
            churn = self.rng.random()
            keep = [p for p in keep if self.rng.random() > churn]
            fresh = [p for p in self.rng.permutation(n).tolist() if p not in keep]
            chosen = (keep + fresh)[: int(self.rng.integers(1, k + 1))]
            if n - 1 not in chosen and self.rng.random() < 0.5:
                chosen = [*chosen[: k - 1], n - 1]
            if not cache.config.validate and self.rng.random() < 0.2 and len(chosen) < k:
                chosen.append(int(self.rng.choice([n, n + 5, -2, -9])))  # counted, ignored
            self.previous_top_k[request_id] = {p for p in chosen if 0 <= p < n}
            row = chosen + [-1] * (k - len(chosen))
            top_k[b] = self.rng.permutation(row)
        top_k[len(batch):] = self.rng.integers(-3, 50, size=(padded - len(batch), k))
        return torch.from_numpy(top_k)

    def _rejected_swap_in(self, layer: int, batch: list[int], top_k: torch.Tensor) -> None:
        bad = top_k.clone()
        b = int(self.rng.integers(len(batch)))
        n = self.cache.seq_len(batch[b])
        if self.rng.random() < 0.5 or self.cache.top_k < 2:
            bad[b, 0] = int(self.rng.choice([n, n + 3, -2]))
        else:
            bad[b, 0] = bad[b, 1] = int(self.rng.integers(n))
        before = snapshot(self.cache)
        with pytest.raises(InvalidInputError):
            self.cache.swap_in(layer, bad.to(self.cache.device))
        assert_unchanged(before, self.cache)

    def _check_rows(self, layer, batch, top_k, got, expected, padded) -> None:
        cache = self.cache
        assert got.shape == (padded, cache.top_k)
        assert (got[len(batch):] == -1).all(), "padding rows must return -1"
        device_kv = cache.device_kv(layer).cpu()
        for b, request_id in enumerate(batch):
            base = cache.request_slot(request_id) * cache.slots_per_request
            want = [base + s if s >= 0 else -1 for s in expected[b]]
            assert got[b].tolist() == want, (layer, request_id, top_k[b].tolist())
            rows = self.model.requests[request_id].rows[layer]
            for position, device_row in zip(top_k[b].tolist(), want, strict=True):
                if device_row >= 0:
                    assert bytes(device_kv[device_row].numpy()) == rows[position]

    @rule()
    def preempt(self) -> None:
        running = self.ids_in(RequestState.RUNNING)
        if not running:
            return
        request_id = self.pick(running)
        self.cache.preempt(request_id)
        self.model.release(request_id)

    @rule()
    def resume(self) -> None:
        preempted = self.ids_in(RequestState.PREEMPTED)
        if not preempted:
            return
        request_id = self.pick(preempted)
        occupancy = self.cache.stats().occupancy
        if occupancy.request_slots_used == occupancy.request_slots_total:
            before = snapshot(self.cache)
            with pytest.raises(PoolExhaustedError):
                self.cache.resume(request_id)
            assert_unchanged(before, self.cache)
            return
        self.cache.resume(request_id)
        self.model.seed(request_id)

    @rule(abort=st.booleans())
    def end(self, abort: bool) -> None:
        live = [r.request_id for r in self.cache._requests]
        if not live:
            return
        request_id = self.pick(live)
        if abort:
            self.cache.abort(request_id)
        else:
            self.cache.finish(request_id)
        self.model.remove(request_id)
        self.previous_top_k.pop(request_id, None)

    # --- invariants -----------------------------------------------------------------------
    @invariant()
    def tables_match_model(self) -> None:
        if self.cache is None:
            return
        check_against_model(self.cache, self.model)

    def teardown(self) -> None:
        if self.cache is None:
            return
        stats = self.cache.stats()
        event(f"misses > 0: {stats.misses > 0}")
        event(f"invalid > 0: {stats.invalid > 0}")
        for layer, counts in enumerate(self.model.counts):
            got = stats.layers[layer]
            assert (got.hits, got.misses, got.invalid) == (
                counts.hits, counts.misses, counts.invalid)
        for request_id in [r.request_id for r in self.cache._requests]:
            self.cache.abort(request_id)
        check_empty(self.cache)
        self.cache.close()


def check_against_model(cache, model: CacheModel) -> None:
    t = cache.tables
    H, S = cache.hot_slots, cache.slots_per_request
    expected_resident = torch.full_like(t.resident, -1).cpu()
    lru, slot_row, seq_lens = t.lru.cpu(), t.slot_row.cpu(), t.seq_lens.cpu()
    device_kv = t.device_kv.cpu()
    assert {r.request_id for r in cache._requests} == set(model.requests)
    for request_id, request in model.requests.items():
        n = request.length
        assert cache.seq_len(request_id) == n
        rows = cache.host_rows(request_id)
        for layer in range(cache.num_layers):  # the host holds every token's bytes
            host = t.host_kv[layer][torch.from_numpy(rows)]
            assert host.numpy().tobytes() == b"".join(request.rows[layer])
        if not request.running:
            assert cache.request_slot(request_id) is None
            continue
        r = cache.request_slot(request_id)
        assert int(seq_lens[r]) == n
        for group, buffer in enumerate(request.buffers):
            assert lru[group, r].tolist() == buffer.lru
            want = [-1] * H
            for position, slot in buffer.slot_of.items():
                want[slot] = int(rows[position])
                expected_resident[group, int(rows[position])] = slot
            assert slot_row[group, r].tolist() == want
            layers = range(group * cache.index_group_size,
                           min((group + 1) * cache.index_group_size, cache.num_layers))
            for layer in layers:  # every held slot holds its token's bytes
                for position, slot in buffer.slot_of.items():
                    got = bytes(device_kv[layer, r * S + slot].numpy())
                    assert got == request.rows[layer][position]
                newest = bytes(device_kv[layer, r * S + model.newest_slot(request_id)].numpy())
                assert newest == request.rows[layer][n - 1]
    assert torch.equal(t.resident.cpu(), expected_resident)


def check_empty(cache) -> None:
    occupancy = cache.stats().occupancy
    assert occupancy.host_extents_used == 0 and occupancy.host_rows_used == 0
    assert occupancy.request_slots_used == 0
    assert cache._pool.allocator.free_runs() == [(0, cache._pool.num_extents)]
    t = cache.tables
    assert (t.resident == -1).all() and (t.slot_row == -1).all()
    assert (t.page_table == -1).all() and (t.seq_lens == 0).all()


def _machine_for(backend: str) -> type:
    machine = type(f"EngineTrace_{backend}", (EngineTrace,), {"backend": backend})
    machine.TestCase.settings = settings(
        max_examples=FUZZ_EXAMPLES, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return machine


for _backend in hisparse.available_backends():
    globals()[f"TestEngineTrace_{_backend}"] = _machine_for(_backend).TestCase
