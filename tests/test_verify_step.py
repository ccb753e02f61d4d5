"""Verify steps (speculative decoding, issue 22): S tokens per request, the union swap-in,
accept and rollback, against the plain-Python oracle (`oracle.CacheModel.verify_swap_in`).

The fuzz drives random S, overlapping top-k rows with repeats, random accept counts, cancels
at random layers, single-token steps in between, preempt/resume, finish, index groups and
both residency maps; after every step the returned rows must be the oracle's slots and hold
the right bytes, and every host row, hot row, table and counter must match. Output buffers
are poisoned before each call, so a row the swap-in never wrote shows.

The fuzz, attention, dedupe and end-to-end tests run on every usable backend (the `backend`
fixture: `./scripts/test --backend cuda` runs them on the GPU's Triton kernels); the refusals
of bad input are checked before any kernel runs and stay on the CPU.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

import hisparse
from hisparse.attention import LATENT_DIM, ROPE_DIM, sparse_mla_decode_reference
from hisparse.core.requests import RequestState
from hisparse.core.union import build_union
from hisparse.errors import (
    ConfigError,
    InvalidInputError,
    PoolExhaustedError,
    RequestStateError,
)
from oracle import CacheModel
from test_engine_trace import assert_unchanged, snapshot

FUZZ_EXAMPLES = int(os.environ.get("HISPARSE_FUZZ_EXAMPLES", "60"))
NUM_LAYERS = 4
ROW_BYTES = 32
POISON = -7
# (hot slots H, top_k K, extent tokens E, index group size, max_draft_tokens D), H >= D * K.
SHAPES = [(8, 2, 4, 1, 4), (12, 4, 2, 2, 3), (16, 4, 4, 4, 4), (9, 3, 8, 2, 2)]


@functools.cache
def _config(hot: int, top_k: int, extent: int, group: int, drafts: int, validate: bool,
            residency_map: str, row_bytes: int = ROW_BYTES,
            num_layers: int = NUM_LAYERS) -> hisparse.HiSparseConfig:
    return hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=num_layers, row_bytes=row_bytes, top_k=top_k,
        hot_slots=hot, index_group_size=group, extent_tokens=extent, max_requests=4,
        max_batch=3, host_pool_tokens=40 * extent, max_seq_len=40 * extent, validate=validate,
        residency_map=residency_map, max_draft_tokens=drafts)


def build_cache(*args: object, device: object = "cpu", **kwargs: object
                ) -> hisparse.HiSparseCache:
    return hisparse.HiSparseCache(_config(*args, **kwargs), device=device)


# --- the union ---------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_union_lists_each_older_position_once_and_maps_every_entry(tokens: int) -> None:
    rng = np.random.default_rng(tokens)
    B, K = 3, 5
    first = torch.tensor([0, 4, 20])
    top_k = torch.from_numpy(rng.integers(-2, 28, (B, tokens, K))).to(torch.int32)
    top_k[1, 0, :2] = 3  # a repeat inside one row
    real = torch.tensor([True, True, False])
    union = build_union(top_k, first, real)
    for b in range(B):
        own = [int(first[b]) + s for s in range(tokens)]
        # First-occurrence order: s-major, then k (the union kernels' order).
        older = list(dict.fromkeys(int(p) for s in range(tokens) for p in top_k[b, s] if
                                   0 <= p < first[b])) if real[b] else []
        row = union.positions[b].tolist()
        assert row == older + [-1] * (tokens * K - len(older))
        for s in range(tokens):
            for k in range(K):
                p, j = int(top_k[b, s, k]), int(union.inverse[b, s * K + k])
                assert (j < tokens * K) == (p in older)
                if j < tokens * K:
                    assert row[j] == p
                draft = bool(real[b]) and int(first[b]) <= p <= own[s]
                assert bool(union.draft[b, s, k]) == draft
                assert bool(union.invalid[b, s, k]) == (bool(real[b]) and (p < -1 or p > own[s]))


# --- the fuzz ----------------------------------------------------------------------------
class VerifyTrace(RuleBasedStateMachine):
    """The verify-step fuzz on one backend: inputs are made on the host and moved to the
    cache's device; everything read back is copied to the host once per check (a GPU would
    otherwise sync per element)."""

    def __init__(self, backend: object = "cpu") -> None:
        super().__init__()
        self.backend = backend
        self.cache = None

    @initialize(shape=st.sampled_from(SHAPES), validate=st.booleans(),
                residency_map=st.sampled_from(["host_row", "position"]),
                seed=st.integers(0, 2**31 - 1), prompts=st.lists(st.integers(1, 30),
                                                                 min_size=1, max_size=3))
    def build(self, shape, validate, residency_map, seed, prompts) -> None:
        hot, top_k, extent, group, drafts = shape
        self.cache = build_cache(hot, top_k, extent, group, drafts, validate, residency_map,
                                 device=self.backend)
        self.device = self.cache.device
        self.model = CacheModel(NUM_LAYERS, hot, group)
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.truth: dict[int, list[list[bytes]]] = {}
        self.next_id = 0
        for prompt in [hot + 5, *prompts]:  # one long request: misses and evictions
            self.admit(prompt)

    def rows(self, *shape: int) -> torch.Tensor:
        return torch.randint(0, 256, (*shape, ROW_BYTES), dtype=torch.uint8, generator=self.gen)

    def running(self) -> list[int]:
        return [r.request_id for r in self.cache._requests if r.state is RequestState.RUNNING]

    @rule(prompt=st.integers(1, 30))
    def admit(self, prompt: int) -> None:
        free = self.cache.stats().occupancy
        if free.request_slots_used == free.request_slots_total:
            return
        if -(-prompt // self.cache.extent_tokens) + 12 > (
                free.host_extents_total - free.host_extents_used):
            return
        rid, self.next_id = self.next_id, self.next_id + 1
        kv = self.rows(NUM_LAYERS, prompt)
        self.cache.admit(rid, prompt)
        self.cache.write_prefill(rid, kv)
        self.cache.commit_prefill(rid)
        self.truth[rid] = [[bytes(kv[layer, p].tolist()) for p in range(prompt)]
                           for layer in range(NUM_LAYERS)]
        self.model.add(rid, self.truth[rid])
        self.model.seed(rid)

    def top_k(self, first: list[int], tokens: int, overlap: float) -> torch.Tensor:
        """Each query token's row: mostly the previous token's (overlap), repeats allowed
        (without validate's refusal only for verify steps), own drafts included."""
        K = self.cache.top_k
        out = torch.full((self.cache.batch_capacity, tokens, K), -1, dtype=torch.int32)
        for b, n0 in enumerate(first):
            previous = None
            for s in range(tokens):
                row = self.rng.integers(-1, n0 + s + 1, K)
                if previous is not None:
                    keep = self.rng.random(K) < overlap
                    row = np.where(keep, previous, row)
                out[b, s] = torch.from_numpy(row)
                previous = row
        return out

    @rule(data=st.data())
    def verify_step(self, data) -> None:
        cache, model = self.cache, self.model
        ids = self.running()
        if not ids:
            return
        batch = [int(i) for i in self.rng.permutation(ids)[: cache.batch_capacity]]
        if any(cache.seq_len(r) + cache.max_draft_tokens > cache.max_seq_len for r in batch):
            return
        tokens = data.draw(st.integers(1, cache.max_draft_tokens), "S")
        plain = tokens == 1 and data.draw(st.booleans(), "plain")
        before = snapshot(cache)
        try:
            step = cache.begin_decode_step(batch, num_tokens=tokens, dedupe=not plain)
        except PoolExhaustedError:  # refused before anything changed
            assert_unchanged(before, cache)
            return
        first = [cache.seq_len(r) - tokens for r in batch]
        rows = 1 if plain else tokens
        new = self.rows(NUM_LAYERS, cache.batch_capacity, rows)
        for b, rid in enumerate(batch):
            fresh = [[bytes(new[layer, b, s].tolist()) for s in range(rows)]
                     for layer in range(NUM_LAYERS)]
            if plain:
                model.append(rid, [layer_rows[0] for layer_rows in fresh])
            else:
                model.append_drafts(rid, fresh)
        cancel_at = (data.draw(st.integers(0, NUM_LAYERS - 1), "cancel at")
                     if data.draw(st.booleans(), "cancel") else None)
        top_k = self.top_k(first, rows, data.draw(st.sampled_from([0.5, 0.9]), "overlap"))
        if plain:  # the single-token path refuses repeats under validate: none here
            top_k.fill_(-1)
            for b, n0 in enumerate(first):
                chosen = self.rng.permutation(n0 + 1)[: cache.top_k]
                top_k[b, 0, : len(chosen)] = torch.from_numpy(chosen)
        B = len(batch) + int(self.rng.integers(cache.batch_capacity - len(batch) + 1))
        # One device tensor per step: an index group's followers must get the anchor's own.
        given = (top_k[:B] if rows > 1 else top_k[:B, 0]).to(self.device)
        for layer in range(NUM_LAYERS):
            kv = new[layer, :B] if rows > 1 else new[layer, :B, 0]
            cache.write_newest(layer, kv.to(self.device))
            if cancel_at == layer:
                break
            self.swap_in(layer, batch, first, top_k[:B], given, plain)
        if cancel_at is not None:
            cache.cancel_decode_step()
            # The followers of an anchor that swapped in count its lookups (the engine copies
            # the anchor's counters to them when it plans), called or not.
            G = cache.index_group_size
            for layer in range(cancel_at, -(-cancel_at // G) * G):
                if layer % G:
                    model.verify_swap_in(layer, batch, first, []) if not plain else \
                        model.swap_in(layer, batch, [])
            for rid, n0 in zip(batch, first, strict=True):
                if plain:
                    model.unappend(rid)
                else:
                    model.accept(rid, n0, 0)
            return
        accepted = [int(self.rng.integers(1, rows + 1)) for _ in batch]
        given: object = accepted if not plain or self.rng.random() < 0.5 else None
        if given is not None and self.rng.random() < 0.5:  # as a device tensor (one read)
            given = torch.tensor(accepted, dtype=torch.int32, device=self.device)
        step.end(accepted=given)
        for rid, n0, a in zip(batch, first, accepted, strict=True):
            if not plain:
                model.accept(rid, n0, a)
            assert cache.seq_len(rid) == n0 + a

    def swap_in(self, layer: int, batch: list[int], first: list[int], top_k: torch.Tensor,
                given: torch.Tensor, plain: bool) -> None:
        cache = self.cache
        group_size = cache.index_group_size
        if layer % group_size == 0:  # unwritten rows must show (followers return the anchor's)
            for width in cache._verify.widths.values():
                width.rows.fill_(POISON)
                width.union_out.fill_(POISON)
            cache._decode.buffers.out.fill_(POISON)
        follower = layer % group_size and self.rng.random() < 0.5
        out = cache.swap_in(layer, None if follower else given).cpu()
        if plain:
            slots = self.model.swap_in(layer, batch, top_k[: len(batch), 0].tolist())
            slots = [[row] for row in slots]
            out = out[:, None]
        else:
            slots = self.model.verify_swap_in(layer, batch, first, top_k[: len(batch)].tolist())
            out = out if out.dim() == 3 else out[:, None]
        assert out.shape[0] == given.shape[0]
        assert bool((out[len(batch):] == -1).all())
        SPR = cache.slots_per_request
        device_kv = cache.device_kv(layer).cpu()
        for b, rid in enumerate(batch):
            base = cache.request_slot(rid) * SPR
            for s, row in enumerate(slots[b]):
                for k, slot in enumerate(row):
                    got = int(out[b, s, k])
                    assert got == (base + slot if slot >= 0 else -1), (layer, rid, s, k)
                    if slot >= 0:
                        p = int(top_k[b, s, k])
                        assert bytes(device_kv[got].tolist()) == \
                            self.model.requests[rid].rows[layer][p]

    @rule()
    def preempt_resume(self) -> None:
        ids = self.running()
        if ids:
            rid = int(self.rng.choice(ids))
            self.cache.preempt(rid)
            self.model.release(rid)
            self.cache.resume(rid)
            self.model.seed(rid)

    @rule()
    def finish(self) -> None:
        ids = self.running()
        if len(ids) > 1:
            rid = int(self.rng.choice(ids))
            self.cache.finish(rid)
            self.model.remove(rid)

    @invariant()
    def matches_the_model(self) -> None:
        if self.cache is None:
            return
        cache, model, t = self.cache, self.model, self.cache.tables
        SPR, H = cache.slots_per_request, cache.hot_slots
        cache.backend.synchronize()  # host rows: the backups land asynchronously on a GPU
        seq_lens, device_kv = t.seq_lens.cpu(), t.device_kv.cpu()
        resident, slot_key = t.resident.cpu(), t.slot_key.cpu()
        for rid in self.running():
            request = model.requests[rid]
            n = request.length
            assert cache.seq_len(rid) == n
            slot = cache.request_slot(rid)
            assert int(seq_lens[slot]) == n
            host_rows = cache.host_rows(rid)
            for layer in range(NUM_LAYERS):
                host = t.host_kv[layer]
                for p in range(n):
                    assert bytes(host[host_rows[p]].tolist()) == request.rows[layer][p]
                newest = slot * SPR + model.newest_slot(rid)
                assert bytes(device_kv[layer, newest].tolist()) == request.rows[layer][n - 1]
            for group, buffer in enumerate(request.buffers):
                for p, hot in buffer.slot_of.items():
                    key = int(t.residency_keys(slot, p, int(host_rows[p])))
                    assert int(resident[group, key]) == hot
                    assert int(slot_key[group, slot, hot]) == key
                    for layer in range(group * cache.index_group_size,
                                       min((group + 1) * cache.index_group_size, NUM_LAYERS)):
                        assert bytes(device_kv[layer, slot * SPR + hot].tolist()) == \
                            request.rows[layer][p]
                held = int((slot_key[group, slot] >= 0).sum())
                assert held == len(buffer.slot_of) or n <= H
        counters = t.counters.tolist()
        for layer, counts in enumerate(model.counts):
            assert counters[layer] == [counts.hits, counts.misses, counts.invalid], layer


FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES, stateful_step_count=12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_verify_steps_match_the_oracle(backend: object) -> None:
    """The fuzz above, on `backend` (HISPARSE_FUZZ_EXAMPLES=N sets its examples)."""
    run_state_machine_as_test(lambda: VerifyTrace(backend), settings=FUZZ_SETTINGS)


# --- attention over the returned rows ----------------------------------------------------
def test_sparse_attention_over_verify_rows_equals_attention_over_the_full_kv(
        backend: object, device: torch.device, seed: int) -> None:
    """Every query token of a verify step, drafts' own KV included, sees exactly the KV it
    selected: attention over `device_kv` at the returned rows equals attention over the full
    KV (prompt + the step's drafts) at the positions."""
    width = LATENT_DIM + ROPE_DIM
    cache = build_cache(16, 4, 4, 1, 4, True, "host_row", row_bytes=2 * width, num_layers=1,
                        device=backend)
    gen = torch.Generator().manual_seed(seed)

    def kv(n: int) -> torch.Tensor:
        return torch.randn(n, width, generator=gen).to(torch.bfloat16)

    prompts = {"a": kv(30), "b": kv(9)}
    for rid, rows in prompts.items():
        cache.admit(rid, len(rows))
        cache.write_prefill(rid, rows.view(torch.uint8), layer=0)
        cache.commit_prefill(rid)
    S, K = 4, 4
    for _ in range(3):
        step = cache.begin_decode_step(list(prompts), num_tokens=S)
        drafts = torch.stack([kv(S) for _ in prompts])  # [B, S, width]
        cache.write_newest(0, drafts.view(torch.uint8).to(device))
        top_k = torch.stack([torch.stack([torch.randint(-1, n0 + s + 1, (K,), generator=gen)
                                          for s in range(S)])
                             for n0 in (len(p) for p in prompts.values())]).to(torch.int32)
        top_k[:, :, 0] = torch.tensor(step.positions)  # each token attends to itself
        rows = cache.swap_in(0, top_k.to(device))
        q = torch.randn(len(prompts) * S, 8, width, generator=gen).to(torch.bfloat16).to(device)
        got = sparse_mla_decode_reference(q, cache.device_kv(0), rows.view(-1, K), 0.1)
        full = [torch.cat([p, d]) for p, d in zip(prompts.values(), drafts, strict=True)]
        offsets = [0, len(full[0])]
        flat = torch.cat(full).view(torch.uint8).to(device)
        indices = torch.where(top_k >= 0, top_k + torch.tensor(offsets)[:, None, None], -1)
        want = sparse_mla_decode_reference(q, flat, indices.view(-1, K).to(torch.int32)
                                           .to(device), 0.1)
        assert torch.equal(got, want)
        accepted = [int(torch.randint(1, S + 1, (1,), generator=gen)) for _ in prompts]
        cache.end_decode_step(accepted=accepted)
        for (rid, p), d, a in zip(list(prompts.items()), drafts, accepted, strict=True):
            prompts[rid] = torch.cat([p, d[:a]])
            assert cache.seq_len(rid) == len(prompts[rid])


# --- bad input ---------------------------------------------------------------------------
def _running_cache(drafts: int = 3, validate: bool = True,
                   device: object = "cpu") -> hisparse.HiSparseCache:
    cache = build_cache(12, 4, 2, 2, drafts, validate, "host_row", device=device)
    for rid, n in ((0, 20), (1, 5)):
        cache.admit(rid, n)
        cache.write_prefill(rid, torch.zeros(NUM_LAYERS, n, ROW_BYTES, dtype=torch.uint8))
        cache.commit_prefill(rid)
    return cache


@pytest.mark.parametrize("num_tokens", [0, 4, -1, "2", 2.0, True])
def test_num_tokens_out_of_range_is_refused_and_changes_nothing(num_tokens: object) -> None:
    cache = _running_cache()
    before = snapshot(cache)
    with pytest.raises(InvalidInputError, match="max_draft_tokens"):
        cache.begin_decode_step([0, 1], num_tokens=num_tokens)
    assert_unchanged(before, cache)
    cache.begin_decode_step([0, 1], num_tokens=3).cancel()  # still usable
    assert_unchanged(before, cache)


def test_a_cache_without_draft_slots_refuses_verify_steps() -> None:
    cache = _running_cache(drafts=1)
    before = snapshot(cache)
    with pytest.raises(InvalidInputError, match=r"1\.\.1 \(max_draft_tokens\)"):
        cache.begin_decode_step([0, 1], num_tokens=2)
    assert_unchanged(before, cache)


def test_a_hot_buffer_too_small_for_the_union_is_refused_at_build() -> None:
    with pytest.raises(ConfigError, match=r"hot_slots.*max_draft_tokens"):
        _config(12, 4, 2, 2, 4, True, "host_row")
    # Derived, it makes room: max(2, D) * top_k.
    config = hisparse.HiSparseConfig.from_preset("tiny", top_k=4, max_draft_tokens=5,
                                               hot_slots=None)
    assert config.hot_slots == 20 and config.slots_per_request == 25


@pytest.mark.parametrize("validate", [True, False])
def test_bad_shapes_and_accept_counts_are_refused_and_the_step_stays_open(
        validate: bool) -> None:
    cache = _running_cache(validate=validate)
    step = cache.begin_decode_step([0, 1], num_tokens=3)
    kv = torch.zeros(2, 3, ROW_BYTES, dtype=torch.uint8)
    with pytest.raises(InvalidInputError, match=r"\[B, 3, W\]"):
        cache.write_newest(0, kv[:, :2])
    with pytest.raises(InvalidInputError):
        cache.write_newest(0, kv[:, 0])
    for layer in range(NUM_LAYERS):
        cache.write_newest(layer, kv)
    top_k = torch.full((2, 3, 4), -1, dtype=torch.int32)
    with pytest.raises(InvalidInputError, match=r"\[B, 3, 4\]"):
        cache.swap_in(0, top_k[:, :2].contiguous())
    with pytest.raises(InvalidInputError, match="int32"):
        cache.swap_in(0, top_k.long())
    if validate:
        bad = top_k.clone()
        bad[1, 0, 0] = 6  # request 1's first query token is at position 5
        with pytest.raises(InvalidInputError, match=r"up to its own"):
            cache.swap_in(0, bad)
    cache.swap_in(0, top_k)
    before = snapshot(cache)
    for accepted in ([0, 1], [1, 4], [1], [1, 1, 1], [1.0, 2], torch.tensor([1.0, 2.0]), "12",
                     [True, 2], [[1], [2]], 2, {1: 1, 2: 2}, object()):
        with pytest.raises(InvalidInputError, match="accepted"):
            cache.end_decode_step(accepted=accepted)
        assert_unchanged(before, cache)
    assert step.is_open
    cache.end_decode_step(accepted=torch.tensor([3, 1], dtype=torch.int32))
    assert (cache.seq_len(0), cache.seq_len(1)) == (23, 6)
    with pytest.raises(RequestStateError):
        step.end(accepted=[1, 1])


def test_a_single_token_step_refuses_accept_counts_but_ones() -> None:
    cache = _running_cache()
    cache.begin_decode_step([0, 1])
    with pytest.raises(InvalidInputError, match="single-token"):
        cache.end_decode_step(accepted=[1, 2])


# --- the repeated-position defect (validate off) -----------------------------------------
@pytest.mark.parametrize("dedupe", [False, True])
def test_a_repeated_missing_position_takes_one_slot_only_when_deduplicated(
        dedupe: bool, backend: object, device: torch.device) -> None:
    """The plain single-token path gives each repeat of a missing position its own slot and
    counts each as a miss (validate refuses such rows; without it the kernels do not look
    across a row's entries, by design of their one-pass lookup). `dedupe=True` routes the
    step through the union: one lookup, one miss, one slot."""
    cache = _running_cache(validate=False, device=backend)
    cache.begin_decode_step([0, 1], dedupe=dedupe)
    for layer in range(NUM_LAYERS):
        cache.write_newest(layer, torch.zeros(2, ROW_BYTES, dtype=torch.uint8, device=device))
    top_k = torch.tensor([[2, 2, 3, 2], [-1, -1, -1, -1]], dtype=torch.int32,
                         device=device)  # 2, 3: misses
    rows = cache.swap_in(0, top_k).cpu()
    misses = int(cache.tables.counters[0, 1])
    held = int((cache.tables.slot_key[0, cache.request_slot(0)] >= 0).sum())
    cache.end_decode_step()
    if dedupe:
        assert misses == 2 and held == 12
        assert int(rows[0, 0]) == int(rows[0, 1]) == int(rows[0, 3])
    else:
        assert misses == 4  # the defect, kept on the plain path
