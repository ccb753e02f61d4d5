"""Oracle fuzzing: random lifecycles and top-k traces, engine and plain-Python model in lockstep.

`LockstepRun` drives one cache and one `oracle.CacheModel` with the same random operations
(admit with whole or per-layer prefill, PD reserve + complete, decode steps with churned,
padded and partly invalid top-k, cancelled steps, preempt, resume, finish, abort; shared
prefixes: retain, release, admit and PD reserve on a retained prefix or on a live request's
first tokens) plus calls that must be rejected (checked against a full state snapshot). Every
swap-in result is compared with the model's, and the bytes of every returned row with the
model's bytes; every few operations the whole device state is compared too, with the host
pool's holder counts, the bytes of every retained prefix, and a checksum of every held host
row, which must not change while a holder (request or retained prefix) holds it. A run ends by
releasing everything: the pool must be whole again. A mismatch is counted and recorded, and
the run starts over with a fresh cache so a long run reports every independent failure.
Both residency maps share: under `host_row` a request admitted on a prefix takes alias key
extents (the small `alias_extents` of some runs exhausts them: refused, unchanged), and the
full checks compare the key extents of every request and their host extents too.

CI: hypothesis picks the shape, seed, validate mode, pool size and operation mix, bounded to
a few seconds. Long mode: `scripts/fuzz-long` (HISPARSE_FUZZ_STEPS=100000) runs the same
driver for that many decode steps per backend and prints steps, mismatches, bytes verified.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hisparse
from hisparse.core.host_pool import token_rows
from hisparse.core.prefixes import PrefixHandle
from hisparse.core.requests import RequestRecord, RequestState
from hisparse.errors import (
    HisparseError,
    InvalidInputError,
    PoolExhaustedError,
    RequestStateError,
)
from oracle import CacheModel
from test_engine_trace import build_cache, check_against_model, rejected_top_k
from test_reliability_state import (
    assert_same_state,
    check_holders,
    check_key_extents,
    full_snapshot,
)

NUM_LAYERS, ROW_BYTES = 4, 32
POISON = -7
# (hot slots H, top_k K, extent tokens E, index group size): small, so CI stays fast, yet
# every regime shows up: short/long switch, K == H, extents of 2 and 8, groups of 1, 2 and 4.
SHAPES = [(8, 4, 4, 1), (8, 8, 2, 2), (16, 8, 8, 2), (12, 6, 4, 4), (6, 6, 3, 1)]
OPERATIONS = ("decode", "admit", "reserve", "preempt", "resume", "finish", "abort", "bad_call",
              "retain", "release", "admit_shared", "reserve_shared", "cancel")
DEFAULT_WEIGHTS = (8, 2, 1, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1)
CI_EXAMPLES = int(os.environ.get("HISPARSE_FUZZ_CI_EXAMPLES", "40"))


@dataclass
class FuzzCounts:
    decode_steps: int = 0
    operations: int = 0
    rejected_calls: int = 0  # bad calls that raised and left the snapshot unchanged
    rows_verified: int = 0
    bytes_verified: int = 0
    full_checks: int = 0
    shared_admits: int = 0  # requests admitted or reserved on a shared prefix
    private_copies: int = 0  # decode steps' moves off an extent a retained prefix holds
    cancelled_steps: int = 0
    shared_rows_watched: int = 0  # host-row checksums compared after the row was shared
    mismatches: int = 0
    failures: list[str] = field(default_factory=list)  # the first few, with their replay

    def add(self, other: FuzzCounts) -> None:
        for name in ("decode_steps", "operations", "rejected_calls", "rows_verified",
                     "bytes_verified", "full_checks", "shared_admits", "shared_rows_watched",
                     "private_copies", "cancelled_steps", "mismatches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.failures += other.failures[: max(0, 5 - len(self.failures))]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class LockstepRun:
    """One cache and its oracle, driven by one seeded random stream."""

    # Assert at every step that each new token lands in an extent its request holds alone
    # (off to show that the checksums alone catch a write into a shared row).
    check_newest_extent = True

    def __init__(self, backend: Any, shape: tuple[int, int, int, int], validate: bool,
                 pool_extents: int, seed: int, weights: tuple[int, ...] = DEFAULT_WEIGHTS,
                 full_check_every: int = 1, residency_map: str = "host_row",
                 alias_extents: int | None = None) -> None:
        hot, top_k, extent, group = shape
        self.cache = build_cache(backend, hot, top_k, extent, group, validate, pool_extents,
                                 residency_map=residency_map, alias_extents=alias_extents)
        self.model = CacheModel(NUM_LAYERS, hot, group)
        self.rng = np.random.default_rng(seed)
        self.replay = (f"shape={shape} validate={validate} pool_extents={pool_extents} "
                       f"seed={seed} weights={weights} residency_map={residency_map} "
                       f"alias_extents={alias_extents}")
        probabilities = np.asarray(weights, dtype=float)
        self.probabilities = probabilities / probabilities.sum()
        self.full_check_every = full_check_every
        self.counts = FuzzCounts()
        self.next_id = 0
        self.previous_top_k: dict[int, set[int]] = {}
        # Refused only under host_row without alias key extents (alias_extents: 0).
        self.sharing = residency_map == "position" or self.cache.config.alias_extents > 0
        # handle id -> (handle, the bytes of its rows per layer); released handles
        self.handles: dict[int, tuple[PrefixHandle, list[list[bytes]]]] = {}
        self.released: list[PrefixHandle] = []
        # host row -> (checksum over layers, its holders at the last check)
        self.watched: dict[int, tuple[int, frozenset[object]]] = {}

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
                    self._check_sharing()  # first: a shared row that changed shows as such
                    check_against_model(self.cache, self.model)
                    self.counts.full_checks += 1
            self._check_counters()
            self._release_everything()
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
        if self._fill(request_id, tokens, rows, pd, no_slot):
            self.model.add(request_id, [[bytes(r) for r in layer] for layer in rows])
            self.model.seed(request_id)

    def _fill(self, request_id: int, tokens: int, own: np.ndarray, pd: bool, no_slot: bool,
              prefix: object = None, shared: int = 0) -> bool:
        """Admit (or PD reserve) and write the rows after a prefix of `shared` tokens: whole,
        or layer by layer in two chunks; False when the transfer found no slot (aborted)."""
        cache, rng = self.cache, self.rng
        if pd:
            reservation = cache.reserve_host_slots(request_id, tokens, prefix=prefix)
            assert reservation.prefix_tokens == shared
            assert len(reservation.rows) == tokens - shared
            for layer, host in enumerate(reservation.host_tensors):
                host[torch.from_numpy(reservation.rows)] = torch.from_numpy(own[layer])
            if no_slot:
                self.expect_rejection(PoolExhaustedError,
                                      lambda: cache.complete_transfer(request_id))
                cache.abort(request_id)
                return False
            cache.complete_transfer(request_id)
            return True
        cache.admit(request_id, tokens, prefix=prefix)
        if shared and rng.random() < 0.2:  # the shared rows are never written
            into = int(rng.integers(shared))
            kv = torch.zeros(NUM_LAYERS, tokens - into, ROW_BYTES, dtype=torch.uint8)
            self.expect_rejection(InvalidInputError, lambda: cache.write_prefill(
                request_id, kv, start=into))
        if tokens > shared and rng.random() < 0.5:
            cache.write_prefill(request_id, torch.from_numpy(own).to(cache.device), start=shared)
        else:  # layer by layer, in two chunks
            cut = int(rng.integers(shared, tokens + 1))
            for layer in range(NUM_LAYERS):
                for first, stop in ((shared, cut), (cut, tokens)):
                    if stop > first:
                        chunk = torch.from_numpy(own[layer, first - shared : stop - shared])
                        cache.write_prefill(request_id, chunk.to(cache.device), layer=layer,
                                            start=first)
        cache.commit_prefill(request_id)
        return True

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
        calls.append((InvalidInputError, lambda: cache.release_prefix((self.next_id, 1))))
        if self.sharing and running:
            longer = self.pick(running)
            calls.append((InvalidInputError, lambda: cache.admit(
                self.next_id, 1, prefix=(longer, cache.seq_len(longer) + 1))))
        error, call = calls[int(self.rng.integers(len(calls)))]
        self.expect_rejection(error, call)

    def decode(self, cancel: bool = False) -> None:
        cache, model, rng = self.cache, self.model, self.rng
        running = self.ids(RequestState.RUNNING)
        if not running:
            return
        count = int(rng.integers(1, min(len(running), cache.batch_capacity) + 1))
        batch = [running[i] for i in rng.permutation(len(running))[:count]]
        padded = int(rng.integers(count, cache.batch_capacity + 1))
        records = [cache._requests.get(i, "fuzz") for i in batch]
        # A new extent for a full last one, or a private copy of one a retained prefix holds.
        grow = sum(cache.seq_len(i) % cache.extent_tokens == 0 for i in batch)
        writers = len(cache._prefixes.writers_in(records))
        grow += writers
        if any(cache.seq_len(i) == cache.max_seq_len for i in batch):
            self.expect_rejection(InvalidInputError, lambda: cache.begin_decode_step(batch))
            return
        if grow > cache._pool.allocator.free_extents:
            self.expect_rejection(PoolExhaustedError, lambda: cache.begin_decode_step(batch))
            return
        step = cache.begin_decode_step(batch)
        self.counts.private_copies += writers
        assert list(step.positions) == [model.requests[i].length for i in batch]
        for record, position in zip(records, step.positions if self.check_newest_extent
                                    else (), strict=False):
            extent = record.extents[position // cache.extent_tokens]
            assert cache._pool.holders(extent) == 1, (
                f"request {record.request_id}'s newest token lands in extent {extent}, which "
                f"{cache._pool.holders(extent)} holders hold")
        new_rows = rng.integers(0, 256, (NUM_LAYERS, padded, ROW_BYTES), dtype=np.uint8)
        for b, request_id in enumerate(batch):
            model.append(request_id, [bytes(new_rows[layer, b]) for layer in range(NUM_LAYERS)])
        # A cancelled step stops at an index-group boundary (tests/test_engine_trace.py: a
        # group left half done replays into its skipped followers, which the model does not).
        groups = cache.num_groups
        stop = int(rng.integers(0, groups + 1)) * cache.index_group_size if cancel else None
        # Per group: the top-k on the host (for the model), and on the device the one tensor
        # its layers pass (a follower must pass its anchor's own tensor).
        top_k_of_group: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(NUM_LAYERS):
            if layer == stop:
                break
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
        self.counts.decode_steps += 1
        if not cancel:
            cache.end_decode_step()
            return
        cache.cancel_decode_step()
        for request_id in batch:
            model.unappend(request_id)
        self.counts.cancelled_steps += 1

    def cancel(self) -> None:
        """A decode step whose forward pass fails part way: cancel_decode_step."""
        self.decode(cancel=True)

    # --- shared prefixes ----------------------------------------------------------------
    def _prefix_source(self) -> tuple[object, list[list[bytes]]] | None:
        """A retained handle, or a running or preempted request with its bytes per layer."""
        sources: list[tuple[object, list[list[bytes]]]] = [
            (handle, rows) for handle, rows in self.handles.values()]
        sources += [(r.request_id, self.model.requests[r.request_id].rows)
                    for r in self.cache._requests
                    if r.state in (RequestState.RUNNING, RequestState.PREEMPTED)]
        return sources[int(self.rng.integers(len(sources)))] if sources else None

    def retain(self) -> None:
        cache, rng = self.cache, self.rng
        picked = self._prefix_source()
        if picked is None:
            return
        source, rows = picked
        length = len(rows[0])
        if not self.sharing:
            self.expect_rejection(InvalidInputError, lambda: cache.retain_prefix(source, 1))
            return
        if rng.random() < 0.1:
            self.expect_rejection(InvalidInputError,
                                  lambda: cache.retain_prefix(source, length + 1))
            return
        # Half the time all of it, as a prefix cache inserting a request's tokens does: the
        # request then decodes into the extent holding the prefix's tail (a private copy).
        tokens = length if rng.random() < 0.5 else int(rng.integers(1, length + 1))
        handle = cache.retain_prefix(source, tokens)
        assert handle.num_tokens == tokens
        self.handles[handle.handle_id] = (handle, [layer[:tokens] for layer in rows])

    def release(self) -> None:
        cache, rng = self.cache, self.rng
        if self.released and rng.random() < 0.2:
            stale = self.released[int(rng.integers(len(self.released)))]
            self.expect_rejection(RequestStateError, lambda: cache.release_prefix(stale))
            return
        if not self.handles:
            return
        handle_id = list(self.handles)[int(rng.integers(len(self.handles)))]
        handle, _ = self.handles.pop(handle_id)
        cache.release_prefix(handle)
        self.released.append(handle)

    def reserve_shared(self) -> None:
        self.admit_shared(pd=True)

    def admit_shared(self, pd: bool = False) -> None:
        cache, rng, E = self.cache, self.rng, self.cache.extent_tokens
        picked = self._prefix_source()
        if picked is None:
            return
        source, rows = picked
        request_id, self.next_id = self.next_id, self.next_id + 1
        start = cache.reserve_host_slots if pd else cache.admit
        if isinstance(source, PrefixHandle):
            prefix, shared = source, len(rows[0])
        else:
            shared = int(rng.integers(1, len(rows[0]) + 1))
            prefix = (source, shared)
        if not self.sharing:
            self.expect_rejection(InvalidInputError,
                                  lambda: start(request_id, shared + 1, prefix=prefix))
            return
        tokens = shared + int(rng.integers(0, 2 * cache.hot_slots))
        if tokens > cache.max_seq_len:
            self.expect_rejection(InvalidInputError,
                                  lambda: start(request_id, tokens, prefix=prefix))
            return
        no_slot = cache._slots.free_slots == 0
        needed = -(-tokens // E) - shared // E
        aliases = cache._prefixes.aliases  # host_row: an alias key extent per shared extent
        if needed > cache._pool.allocator.free_extents or (no_slot and not pd) or (
                aliases is not None and shared // E > aliases.free):
            self.expect_rejection(PoolExhaustedError,
                                  lambda: start(request_id, tokens, prefix=prefix))
            return
        own = self.rows(tokens - shared)
        if not self._fill(request_id, tokens, own, pd, no_slot, prefix, shared):
            return
        self.model.add(request_id, [rows[layer][:shared] + [bytes(r) for r in own[layer]]
                                    for layer in range(NUM_LAYERS)])
        self.model.seed(request_id)
        self.counts.shared_admits += 1

    def _holder_rows(self) -> dict[object, np.ndarray]:
        """Host rows of every holder's tokens: live requests, and retained prefixes."""
        cache, E = self.cache, self.cache.extent_tokens
        held: dict[object, np.ndarray] = {
            ("request", r.request_id): token_rows(r.extents, E, 0, r.num_tokens)
            for r in cache._requests}
        for handle_id, (_, rows) in cache._prefixes._retained.items():
            held[("prefix", handle_id)] = token_rows(rows.extents, E, 0, rows.num_tokens)
        return held

    def _check_sharing(self) -> None:
        """Holder counts, retained prefixes' bytes, and shared rows unchanged while shared."""
        cache = self.cache
        check_holders(cache)
        check_key_extents(cache)
        held = self._holder_rows()
        host = [h.numpy() for h in cache.host_tensors()]
        for handle_id, (_, rows) in self.handles.items():
            got = [host[layer][held[("prefix", handle_id)]] for layer in range(NUM_LAYERS)]
            assert [[bytes(r) for r in layer] for layer in got] == rows, (
                f"retained prefix #{handle_id}'s rows changed")
        # A holding is a holder at a position: a request that copied off a retained prefix's
        # tail may get the freed row back for a later position, a new holding of new bytes.
        holders_of: dict[int, set[tuple[object, int]]] = {}
        for holder, rows in held.items():
            for position, row in enumerate(rows.tolist()):
                holders_of.setdefault(row, set()).add((holder, position))

        def checksum(row: int) -> int:
            return zlib.crc32(b"".join(host[layer][row].tobytes() for layer in range(NUM_LAYERS)))

        # Every row a holder holds keeps its bytes until that holder lets go (a request's rows
        # below its length are written for good: prefill, transfer and backups land within the
        # operation that made the row its). So no row changes while another holder holds it,
        # shared or about to be (a boundary extent shared instead of copied shows here).
        for row, (before, holders) in self.watched.items():
            still = holders & holders_of.get(row, set())
            if still:
                assert checksum(row) == before, (
                    f"host row {row} changed while {sorted(map(str, still))} (holder, "
                    f"position) held it")
                self.counts.shared_rows_watched += len(holders) > 1
        self.watched = {row: (checksum(row), frozenset(holders))
                        for row, holders in holders_of.items()}

    def _release_everything(self) -> None:
        """Every handle released and request aborted, the pool is whole: nothing leaked."""
        cache = self.cache
        for handle, _ in self.handles.values():
            cache.release_prefix(handle)
        self.handles.clear()
        for request_id in [r.request_id for r in cache._requests]:
            cache.abort(request_id)
        pool = cache._pool
        assert pool.allocator.free_runs() == [(0, pool.num_extents)], "extents leaked"
        assert not any(pool._holders) and not cache._prefixes.writers
        aliases = cache._prefixes.aliases
        assert aliases is None or aliases.free == aliases.capacity, "alias key extents leaked"

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
            None if rng.random() < 0.7 else int(rng.integers(0, 4)),  # alias_extents
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
       residency_map=st.sampled_from(["host_row", "position"]),
       alias_extents=st.sampled_from([None, None, 2]))
def test_random_lifecycles_match_the_oracle(backend: Any, shape: tuple[int, int, int, int],
                                            validate: bool, pool_extents: int, seed: int,
                                            weights: tuple[int, ...], residency_map: str,
                                            alias_extents: int | None) -> None:
    counts = LockstepRun(backend, shape, validate, pool_extents, seed, weights,
                         residency_map=residency_map, alias_extents=alias_extents).run(
                             decode_steps=25, max_operations=120)
    assert counts.mismatches == 0, counts.failures
    assert counts.bytes_verified == counts.rows_verified * ROW_BYTES


# Sharing-heavy: decode, admit, reserve, preempt, resume, finish, abort, bad_call, retain,
# release, admit_shared, reserve_shared, cancel.
SHARING_WEIGHTS = (6, 1, 1, 2, 2, 2, 1, 1, 3, 1, 4, 2, 2)


@pytest.mark.parametrize("residency_map", ["host_row", "position"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_sharing_lifecycles_match_the_oracle_and_leave_the_pool_whole(
    shape: tuple[int, int, int, int], seed: int, backend: Any, residency_map: str,
) -> None:
    """Retain, release, shared admits and reserves, private copies, cancels, in any order;
    under host_row the last run has only 3 alias key extents, so shared admits run out of
    them (refused, unchanged) and get them back as sharing requests end."""
    total = FuzzCounts()
    for run in range(4):
        aliases = 3 if run == 3 and residency_map == "host_row" else None
        total.add(LockstepRun(backend, shape, bool(run % 2), 24, seed + run, SHARING_WEIGHTS,
                              residency_map=residency_map, alias_extents=aliases).run(
                                  decode_steps=30, max_operations=150))
    assert total.mismatches == 0, total.failures
    assert total.shared_admits > 0 and total.shared_rows_watched > 0, total
    assert total.cancelled_steps > 0, total


def test_the_fuzzer_finds_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    """An LRU that forgets to evict shows up as a counted, replayable mismatch."""
    from hisparse.kernels.swap_in import reference as swap_in_reference

    real = swap_in_reference.swap_in_reference

    def forgetful(tables, layer, *args, **kwargs):
        real(tables, layer, *args, **kwargs)
        tables.last_use.fill_(-1)  # forget every use: hot slots are evicted like cold ones

    from hisparse.backends.kernel_set import reference_kernels

    monkeypatch.setattr(hisparse.backends.cpu.CpuBackend, "kernels",
                        property(lambda self: reference_kernels(swap_in=forgetful)))
    counts = fuzz("cpu", decode_steps=20, seed=5, run_steps=20)
    assert counts.mismatches >= 1
    assert "replay: shape=" in counts.failures[0]


BROKEN_SHARES = ("shares the boundary extent", "skips the private copy", "frees a shared extent")
KEY_BUGS = ("keys the shared rows by host row", "misses read the key row")  # host_row's own
BROKEN = [(bug, residency_map) for residency_map in ("host_row", "position")
          for bug in BROKEN_SHARES + (KEY_BUGS if residency_map == "host_row" else ())]


@pytest.mark.parametrize(("bug", "residency_map"), BROKEN)
def test_the_fuzzer_catches_a_broken_share(bug: str, residency_map: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each a counted mismatch: the extent at a prefix's boundary shared instead of copied
    (the new request's prefill then writes rows its source holds: the checksums see it, with
    the new-token check off), a writer that decodes into the extent of a retained prefix's
    tail without its private copy, a release that frees extents another holder still has;
    under host_row, page tables naming shared extents by their host extents (no aliases: two
    requests' tokens on one `resident` entry, with the key-extent check off) and a miss that
    copies from its key row instead of its key extent's host row."""
    from hisparse.core import host_pool, prefixes

    if bug == "shares the boundary extent":
        def share_all(self, prefix, num_tokens, drain, action):
            if prefix is None:
                return self.pool.allocate(self.pool.extents_for(num_tokens)), ()
            shared = list(prefix.extents)
            own = self.pool.extents_for(num_tokens) - len(shared)
            if self.aliases is not None:  # (a key extent each, so only the rows go wrong)
                self.aliases.check_free(len(shared), action)
            self.pool.share(shared)
            aliases = self.aliases.take(len(shared)) if self.aliases is not None else ()
            return shared + (self.pool.allocate(own) if own else []), aliases

        monkeypatch.setattr(prefixes.PrefixRegistry, "extents_for_new", share_all)
        monkeypatch.setattr(LockstepRun, "check_newest_extent", False)
    elif bug == "skips the private copy":
        monkeypatch.setattr(prefixes.PrefixRegistry, "writers_in", lambda self, records: [])
    elif bug == "keys the shared rows by host row":  # no alias key extents in the tables
        monkeypatch.setattr(RequestRecord, "key_extents", lambda self: self.extents)
        monkeypatch.setattr(sys.modules[__name__], "check_key_extents", lambda cache: None)
    elif bug == "misses read the key row":  # the translation left out
        from hisparse.kernels.swap_in import reference

        monkeypatch.setattr(reference, "_key_and_host_rows",
                            lambda t, page, offset: (page * t.extent_tokens + offset,) * 2)
    else:
        real = host_pool.HostPool.release

        def release_all(self, extents):
            extents = list(extents)
            for extent in extents:  # as if this holder were the last one
                self._holders[extent] = min(self._holders[extent], 1)
            return real(self, extents)

        monkeypatch.setattr(host_pool.HostPool, "release", release_all)
    total = FuzzCounts()
    for seed in range(12):
        shape = SHAPES[seed % len(SHAPES)]
        total.add(LockstepRun("cpu", shape, False, 24, seed, SHARING_WEIGHTS,
                              residency_map=residency_map).run(decode_steps=30,
                                                               max_operations=150))
    assert total.mismatches >= 1
    if bug == "shares the boundary extent":
        assert any("changed while" in failure for failure in total.failures), total.failures


def test_long_mode_counts_add_up(seed: int) -> None:
    """What scripts/fuzz-long prints: steps, operations, rows and bytes, no mismatches."""
    counts = fuzz("cpu", decode_steps=60, seed=seed, run_steps=30, full_check_every=4)
    assert counts.mismatches == 0, counts.failures
    assert counts.decode_steps >= 60 and counts.rows_verified > 0
    assert counts.bytes_verified == counts.rows_verified * ROW_BYTES
