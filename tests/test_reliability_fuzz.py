"""Oracle fuzzing: random lifecycles and top-k traces, engine and plain-Python model in lockstep.

`LockstepRun` drives one cache and one `oracle.CacheModel` with the same random operations
(admit with whole or per-layer prefill, PD reserve + complete, decode steps with churned,
padded and partly invalid top-k, preempt, resume, finish, abort) plus calls that must be
rejected (checked against a full state snapshot). Every swap-in result is compared with the
model's, and the bytes of every returned row with the model's bytes; every few operations the
whole device state is compared too. A mismatch is counted and recorded, and the run starts
over with a fresh cache so a long run reports every independent failure.

CI: hypothesis picks the shape, seed, validate mode, pool size and operation mix, bounded to
a few seconds. Long mode: `scripts/fuzz-long` (HISPARSE_FUZZ_STEPS=100000) runs the same
driver for that many decode steps per backend and prints steps, mismatches, bytes verified.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hisparse
from hisparse.core.requests import RequestState
from hisparse.errors import HisparseError, InvalidInputError, PoolExhaustedError
from oracle import CacheModel
from test_engine_trace import build_cache, check_against_model, rejected_top_k
from test_reliability_state import assert_same_state, full_snapshot

NUM_LAYERS, ROW_BYTES = 4, 32
POISON = -7
# (hot slots H, top_k K, extent tokens E, index group size): small, so CI stays fast, yet
# every regime shows up: short/long switch, K == H, extents of 2 and 8, groups of 1, 2 and 4.
SHAPES = [(8, 4, 4, 1), (8, 8, 2, 2), (16, 8, 8, 2), (12, 6, 4, 4), (6, 6, 3, 1)]
OPERATIONS = ("decode", "admit", "reserve", "preempt", "resume", "finish", "abort", "bad_call")
DEFAULT_WEIGHTS = (8, 2, 1, 1, 1, 1, 1, 1)
CI_EXAMPLES = int(os.environ.get("HISPARSE_FUZZ_CI_EXAMPLES", "40"))


@dataclass
class FuzzCounts:
    decode_steps: int = 0
    operations: int = 0
    rejected_calls: int = 0  # bad calls that raised and left the snapshot unchanged
    rows_verified: int = 0
    bytes_verified: int = 0
    full_checks: int = 0
    mismatches: int = 0
    failures: list[str] = field(default_factory=list)  # the first few, with their replay

    def add(self, other: FuzzCounts) -> None:
        for name in ("decode_steps", "operations", "rejected_calls", "rows_verified",
                     "bytes_verified", "full_checks", "mismatches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.failures += other.failures[: max(0, 5 - len(self.failures))]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LockstepRun:
    """One cache and its oracle, driven by one seeded random stream."""

    def __init__(self, backend: Any, shape: tuple[int, int, int, int], validate: bool,
                 pool_extents: int, seed: int, weights: tuple[int, ...] = DEFAULT_WEIGHTS,
                 full_check_every: int = 1, residency_map: str = "host_row") -> None:
        hot, top_k, extent, group = shape
        self.cache = build_cache(backend, hot, top_k, extent, group, validate, pool_extents,
                                 residency_map=residency_map)
        self.model = CacheModel(NUM_LAYERS, hot, group)
        self.rng = np.random.default_rng(seed)
        self.replay = (f"shape={shape} validate={validate} pool_extents={pool_extents} "
                       f"seed={seed} weights={weights} residency_map={residency_map}")
        probabilities = np.asarray(weights, dtype=float)
        self.probabilities = probabilities / probabilities.sum()
        self.full_check_every = full_check_every
        self.counts = FuzzCounts()
        self.next_id = 0
        self.previous_top_k: dict[int, set[int]] = {}

    # --- driving ------------------------------------------------------------------------
    def run(self, decode_steps: int, max_operations: int | None = None) -> FuzzCounts:
        """Run until `decode_steps` steps decoded (or `max_operations`); a mismatch ends it."""
        limit = max_operations or 50 * decode_steps
        try:
            while self.counts.decode_steps < decode_steps and self.counts.operations < limit:
                operation = OPERATIONS[self.rng.choice(len(OPERATIONS), p=self.probabilities)]
                getattr(self, operation)()
                self.counts.operations += 1
                if self.counts.operations % self.full_check_every == 0:
                    self.cache.backend.synchronize()  # host rows: backups land asynchronously
                    check_against_model(self.cache, self.model)
                    self.counts.full_checks += 1
            self._check_counters()
        except (AssertionError, HisparseError) as exc:  # an engine error here is a mismatch
            self.counts.mismatches += 1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self.counts.failures.append(
                f"{type(exc).__name__} after {self.counts.operations} operations "
                f"({where.name}:{where.lineno}): {str(exc)[:300]} | replay: {self.replay}"
            )
        finally:
            self.cache.close()
        return self.counts

    def ids(self, state: RequestState) -> list[int]:
        return [r.request_id for r in self.cache._requests if r.state is state]

    def pick(self, ids: list[int]) -> int:
        return ids[int(self.rng.integers(len(ids)))]

    def rows(self, tokens: int) -> np.ndarray:
        return self.rng.integers(0, 256, (NUM_LAYERS, tokens, ROW_BYTES), dtype=np.uint8)

    def expect_rejection(self, error: type[Exception], call: Any) -> None:
        before = full_snapshot(self.cache)
        try:
            call()
        except error:
            pass
        else:
            raise AssertionError(f"expected {error.__name__}, the call went through")
        assert_same_state(before, full_snapshot(self.cache))
        self.counts.rejected_calls += 1

    # --- operations ---------------------------------------------------------------------
    def admit(self, pd: bool = False) -> None:
        cache = self.cache
        tokens = int(self.rng.integers(1, 3 * cache.hot_slots))
        request_id, self.next_id = self.next_id, self.next_id + 1
        free_extents = cache._pool.allocator.free_extents
        no_rows = -(-tokens // cache.extent_tokens) > free_extents
        no_slot = cache._slots.free_slots == 0
        if tokens > cache.max_seq_len:
            self.expect_rejection(InvalidInputError, lambda: cache.admit(request_id, tokens))
            return
        if no_rows or (no_slot and not pd):
            start = cache.reserve_host_slots if pd else cache.admit
            self.expect_rejection(PoolExhaustedError, lambda: start(request_id, tokens))
            return
        rows = self.rows(tokens)
        if pd:
            reservation = cache.reserve_host_slots(request_id, tokens)
            for layer, host in enumerate(reservation.host_tensors):
                host[torch.from_numpy(reservation.rows)] = torch.from_numpy(rows[layer])
            if no_slot:
                self.expect_rejection(PoolExhaustedError,
                                      lambda: cache.complete_transfer(request_id))
                cache.abort(request_id)
                return
            cache.complete_transfer(request_id)
        else:
            cache.admit(request_id, tokens)
            if self.rng.random() < 0.5:
                cache.write_prefill(request_id, torch.from_numpy(rows).to(cache.device))
            else:  # layer by layer, in two chunks
                cut = int(self.rng.integers(tokens + 1))
                for layer in range(NUM_LAYERS):
                    for start, stop in ((0, cut), (cut, tokens)):
                        if stop > start:
                            chunk = torch.from_numpy(rows[layer, start:stop]).to(cache.device)
                            cache.write_prefill(request_id, chunk, layer=layer, start=start)
            cache.commit_prefill(request_id)
        self.model.add(request_id, [[bytes(r) for r in layer] for layer in rows])
        self.model.seed(request_id)

    def reserve(self) -> None:
        self.admit(pd=True)

    def preempt(self) -> None:
        running = self.ids(RequestState.RUNNING)
        if running:
            request_id = self.pick(running)
            self.cache.preempt(request_id)
            self.model.release(request_id)

    def resume(self) -> None:
        preempted = self.ids(RequestState.PREEMPTED)
        if not preempted:
            return
        request_id = self.pick(preempted)
        if self.cache._slots.free_slots == 0:
            self.expect_rejection(PoolExhaustedError, lambda: self.cache.resume(request_id))
            return
        self.cache.resume(request_id)
        self.model.seed(request_id)

    def finish(self, abort: bool = False) -> None:
        live = [r.request_id for r in self.cache._requests]
        if live:
            request_id = self.pick(live)
            (self.cache.abort if abort else self.cache.finish)(request_id)
            self.model.remove(request_id)
            self.previous_top_k.pop(request_id, None)

    def abort(self) -> None:
        self.finish(abort=True)

    def bad_call(self) -> None:
        """A call in the wrong state or order; it must raise and change nothing."""
        cache = self.cache
        running = self.ids(RequestState.RUNNING)
        calls: list[tuple[type[Exception], Any]] = [
            (InvalidInputError, lambda: cache.finish(self.next_id + 1000)),  # never admitted
            (InvalidInputError, lambda: cache.swap_in(0, torch.zeros(1, cache.top_k,
                                                                    dtype=torch.int32))),
            (InvalidInputError, lambda: cache.end_decode_step()),
            (InvalidInputError, lambda: cache.admit(self.next_id, 0)),
        ]
        if running:
            live = self.pick(running)
            calls += [
                (InvalidInputError, lambda: cache.resume(live)),
                (InvalidInputError, lambda: cache.commit_prefill(live)),
                (InvalidInputError, lambda: cache.begin_decode_step([live, live])),
            ]
        preempted = self.ids(RequestState.PREEMPTED)
        if preempted:
            parked = self.pick(preempted)
            calls.append((InvalidInputError, lambda: cache.begin_decode_step([parked])))
        error, call = calls[int(self.rng.integers(len(calls)))]
        self.expect_rejection(error, call)

    def decode(self) -> None:
        cache, model, rng = self.cache, self.model, self.rng
        running = self.ids(RequestState.RUNNING)
        if not running:
            return
        count = int(rng.integers(1, min(len(running), cache.batch_capacity) + 1))
        batch = [running[i] for i in rng.permutation(len(running))[:count]]
        padded = int(rng.integers(count, cache.batch_capacity + 1))
        grow = sum(cache.seq_len(i) % cache.extent_tokens == 0 for i in batch)
        if any(cache.seq_len(i) == cache.max_seq_len for i in batch):
            self.expect_rejection(InvalidInputError, lambda: cache.begin_decode_step(batch))
            return
        if grow > cache._pool.allocator.free_extents:
            self.expect_rejection(PoolExhaustedError, lambda: cache.begin_decode_step(batch))
            return
        step = cache.begin_decode_step(batch)
        assert list(step.positions) == [model.requests[i].length for i in batch]
        new_rows = rng.integers(0, 256, (NUM_LAYERS, padded, ROW_BYTES), dtype=np.uint8)
        for b, request_id in enumerate(batch):
            model.append(request_id, [bytes(new_rows[layer, b]) for layer in range(NUM_LAYERS)])
        # Per group: the top-k on the host (for the model), and on the device the one tensor
        # its layers pass (a follower must pass its anchor's own tensor).
        top_k_of_group: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(NUM_LAYERS):
            cache.write_newest(layer, torch.from_numpy(new_rows[layer]).to(cache.device))
            group = layer // cache.index_group_size
            if group not in top_k_of_group:
                host_top_k = self._top_k(batch, padded)
                top_k_of_group[group] = host_top_k, host_top_k.to(cache.device)
                if cache.config.validate and rng.random() < 0.1:
                    self._rejected_swap_in(layer, batch, host_top_k)
            top_k, device_top_k = top_k_of_group[group]
            if layer % cache.index_group_size == 0:
                # So an entry the kernel failed to write shows.
                cache._decode.buffers.out.fill_(POISON)
            got = cache.swap_in(layer, device_top_k).cpu()
            expected = model.swap_in(layer, batch, top_k[:count].tolist())
            self._verify(layer, batch, top_k, got, expected)
        cache.end_decode_step()
        self.counts.decode_steps += 1

    # --- pieces of a step ---------------------------------------------------------------
    def _top_k(self, batch: list[int], padded: int) -> torch.Tensor:
        cache, rng, k = self.cache, self.rng, self.cache.top_k
        top_k = np.full((padded, k), -1, dtype=np.int32)
        for b, request_id in enumerate(batch):
            n = cache.seq_len(request_id)
            churn = rng.random()
            keep = [p for p in self.previous_top_k.get(request_id, ()) if p < n
                    and rng.random() > churn]
            fresh = [p for p in rng.permutation(n).tolist() if p not in keep]
            chosen = (keep + fresh)[: int(rng.integers(1, k + 1))]
            if n - 1 not in chosen and rng.random() < 0.5:
                chosen = [*chosen[: k - 1], n - 1]
            if not cache.config.validate and rng.random() < 0.2 and len(chosen) < k:
                chosen.append(int(rng.choice([n, n + 7, -2, -100])))  # counted, ignored
            self.previous_top_k[request_id] = {p for p in chosen if 0 <= p < n}
            top_k[b] = rng.permutation(chosen + [-1] * (k - len(chosen)))
        top_k[len(batch):] = rng.integers(-3, 60, size=(padded - len(batch), k))
        return torch.from_numpy(top_k)

    def _rejected_swap_in(self, layer: int, batch: list[int], top_k: torch.Tensor) -> None:
        bad = rejected_top_k(self.cache, batch, top_k, self.rng)
        self.expect_rejection(InvalidInputError,
                              lambda: self.cache.swap_in(layer, bad.to(self.cache.device)))

    def _verify(self, layer: int, batch: list[int], top_k: torch.Tensor, got: torch.Tensor,
                expected: list[list[int]]) -> None:
        cache, count = self.cache, len(batch)
        assert (got[count:] == -1).all(), f"padding rows must return -1, got {got[count:]}"
        S = cache.slots_per_request
        want = torch.tensor(
            [[cache.request_slot(i) * S + s if s >= 0 else -1 for s in row]
             for i, row in zip(batch, expected, strict=True)], dtype=torch.int32)
        assert torch.equal(got[:count], want), (layer, got[:count].tolist(), want.tolist())
        valid = want >= 0
        held = cache.device_kv(layer)[want[valid].long().to(cache.device)].cpu().numpy()
        positions = top_k[:count][valid].tolist()
        owners = [batch[b] for b in valid.nonzero()[:, 0].tolist()]
        for row, position, owner in zip(held, positions, owners, strict=True):
            assert row.tobytes() == self.model.requests[owner].rows[layer][position], (
                f"layer {layer} request {owner} position {position}: wrong bytes")
        self.counts.rows_verified += len(positions)
        self.counts.bytes_verified += len(positions) * ROW_BYTES

    def _check_counters(self) -> None:
        stats = self.cache.stats()
        for layer, counts in enumerate(self.model.counts):
            got = stats.layers[layer]
            assert (got.hits, got.misses, got.invalid) == (
                counts.hits, counts.misses, counts.invalid), f"layer {layer} counters"


def fuzz(backend: Any, decode_steps: int, seed: int, run_steps: int = 400,
         full_check_every: int = 1, deadline: float | None = None) -> FuzzCounts:
    """Fresh random runs of about `run_steps` decode steps each until `decode_steps` ran, or
    until the wall clock (time.time()) passes `deadline`, checked between runs."""
    total = FuzzCounts()
    rng = np.random.default_rng(seed)
    while total.decode_steps < decode_steps and (deadline is None or time.time() < deadline):
        run = LockstepRun(
            backend, SHAPES[int(rng.integers(len(SHAPES)))], bool(rng.random() < 0.5),
            int(rng.integers(10, 48)), int(rng.integers(2**31)),
            (int(rng.integers(8, 17)), *(int(w) for w in rng.integers(1, 5, len(OPERATIONS) - 1))),
            full_check_every, "position" if rng.random() < 0.5 else "host_row",
        )
        counts = run.run(min(run_steps, decode_steps - total.decode_steps))
        if counts.decode_steps == 0 and not counts.mismatches:
            counts.decode_steps = 1  # an operation mix that never decodes still ends
        total.add(counts)
    return total


# --- CI ---------------------------------------------------------------------------------
@settings(max_examples=CI_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(SHAPES), validate=st.booleans(),
       pool_extents=st.integers(8, 40), seed=st.integers(0, 2**31 - 1),
       weights=st.tuples(*[st.integers(1, 9) for _ in OPERATIONS]),
       residency_map=st.sampled_from(["host_row", "position"]))
def test_random_lifecycles_match_the_oracle(backend: Any, shape: tuple[int, int, int, int],
                                            validate: bool, pool_extents: int, seed: int,
                                            weights: tuple[int, ...], residency_map: str) -> None:
    counts = LockstepRun(backend, shape, validate, pool_extents, seed, weights,
                         residency_map=residency_map).run(decode_steps=25, max_operations=120)
    assert counts.mismatches == 0, counts.failures
    assert counts.bytes_verified == counts.rows_verified * ROW_BYTES


def test_the_fuzzer_finds_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """An LRU that forgets to evict shows up as a counted, replayable mismatch."""
    from hisparse.kernels.swap_in import reference as swap_in_reference

    real = swap_in_reference.swap_in_reference

    def forgetful(tables, layer, *args, **kwargs):
        real(tables, layer, *args, **kwargs)
        tables.last_use.fill_(-1)  # forget every use: hot slots are evicted like cold ones

    monkeypatch.setattr(hisparse.backends.cpu, "swap_in_reference", forgetful)
    counts = fuzz("cpu", decode_steps=20, seed=5, run_steps=20)
    assert counts.mismatches >= 1
    assert "replay: shape=" in counts.failures[0]


def test_long_mode_counts_add_up(seed: int) -> None:
    """What scripts/fuzz-long prints: steps, operations, rows and bytes, no mismatches."""
    counts = fuzz("cpu", decode_steps=60, seed=seed, run_steps=30, full_check_every=4)
    assert counts.mismatches == 0, counts.failures
    assert counts.decode_steps >= 60 and counts.rows_verified > 0
    assert counts.bytes_verified == counts.rows_verified * ROW_BYTES
