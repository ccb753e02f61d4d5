"""Shared prefixes in the host tier (core/prefixes.py): whole extents shared by holder count,
the boundary extent copied, nothing shared ever written, and every bad call refused unchanged,
under both residency maps (host_row through alias key extents: their lookups, exhaustion,
release and the moved extent's keys have tests of their own below).

The random lifecycles with sharing (retain, release, shared admits and PD reserves, cancel,
preempt, finish in any order) run in tests/test_reliability_fuzz.py against the oracle.

The sharing, decode, index-group, PD and statistics tests run on every usable backend (the
`backend` fixture: `./scripts/test --backend cuda` decodes through the GPU's Triton kernels);
the refusals change nothing before any kernel runs and stay on the CPU."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable

import numpy as np
import pytest
import torch

import hisparse
from hisparse.core.prefixes import PrefixHandle
from hisparse.errors import (
    InvalidInputError,
    PoolExhaustedError,
    RequestStateError,
    UnknownRequestError,
)
from test_engine_trace import build_cache
from test_reliability_state import (
    assert_same_state,
    check_holders,
    check_key_extents,
    check_table_invariants,
    full_snapshot,
    row_pattern,
)
from test_validation import says_what_to_do

L, W, E, H, K = 4, 32, 4, 8, 4
MAPS = ["host_row", "position"]


@pytest.fixture(params=MAPS)
def residency_map(request: pytest.FixtureRequest) -> str:
    """Both residency maps share: host_row through alias key extents, position as it is."""
    return request.param


class Sharing:
    """A cache plus the bytes every request's tokens must have."""

    def __init__(self, group: int = 1, pool_extents: int = 32, max_requests: int = 4,
                 residency_map: str = "host_row", backend: object = "cpu",
                 alias_extents: int | None = None, drafts: int = 1) -> None:
        self.cache = build_cache(backend, H, K, E, group, True, pool_extents,
                                 max_requests=max_requests, max_batch=min(3, max_requests),
                                 residency_map=residency_map, alias_extents=alias_extents,
                                 max_draft_tokens=drafts)
        self.rows: dict[Hashable, torch.Tensor] = {}  # [L, n, W] per live request
        self.uid = 0
        self.rng = np.random.default_rng(0)
        # Every host row starts as bytes of its own that no token has: a read of a row nobody
        # wrote (a miss copied from the wrong row, a key row taken for a host row) shows.
        for layer, host in enumerate(self.cache.host_tensors()):
            host.copy_(row_pattern(10**6, layer, torch.arange(host.shape[0]), W))

    def fresh(self, count: int) -> torch.Tensor:
        self.uid += 1
        positions = torch.arange(count)
        return torch.stack([row_pattern(self.uid, layer, positions, W) for layer in range(L)])

    def prefill(self, request_id: Hashable, tokens: int, prefix: object = None,
                prefix_rows: torch.Tensor | None = None) -> None:
        cache = self.cache
        cache.admit(request_id, tokens, prefix=prefix)
        shared = 0 if prefix_rows is None else prefix_rows.shape[1]
        own = self.fresh(tokens - shared)
        if tokens > shared:
            cache.write_prefill(request_id, own, start=shared)
        cache.commit_prefill(request_id)
        self.rows[request_id] = own if prefix_rows is None else torch.cat([prefix_rows, own], 1)

    def host_bytes(self, request_id: Hashable) -> torch.Tensor:
        self.cache.backend.synchronize()  # the newest tokens' backups land asynchronously
        rows = torch.from_numpy(self.cache.host_rows(request_id))
        return torch.stack([h[rows] for h in self.cache.host_tensors()])

    def retained_bytes(self, handle: PrefixHandle) -> torch.Tensor:
        self.cache.backend.synchronize()
        rows = self.cache._prefixes._retained[handle.handle_id][1]
        positions = np.arange(rows.num_tokens)
        host = np.asarray(rows.extents)[positions // E] * E + positions % E
        return torch.stack([h[torch.from_numpy(host)] for h in self.cache.host_tensors()])

    def check(self) -> None:
        """Every live request's host rows hold its bytes, and the tables their invariants."""
        for request_id, rows in self.rows.items():
            assert torch.equal(self.host_bytes(request_id), rows), request_id
        check_table_invariants(self.cache)
        check_holders(self.cache)

    def step(self, ids: list[Hashable], cancel: bool = False) -> None:
        """One decode step over `ids` with random top-k, every returned row byte-checked."""
        cache = self.cache
        step = cache.begin_decode_step(ids)
        for request_id, position in zip(ids, step.positions, strict=True):
            record = cache._requests.get(request_id, "test")
            assert cache._pool.holders(record.extents[position // E]) == 1, (
                f"the newest token of {request_id!r} lands in an extent it shares")
        new = self.fresh(len(ids))  # [L, B, W]
        device = cache.device
        for layer in range(L):
            cache.write_newest(layer, new[layer].to(device))
            if layer % cache.index_group_size == 0:  # the layers of a group share a top-k
                positions = []
                for b in range(len(ids)):
                    chosen = self.rng.permutation(step.positions[b] + 1)[:K].tolist()
                    positions.append(chosen + [-1] * (K - len(chosen)))
                top_k = torch.tensor(positions, dtype=torch.int32, device=device)
            out = cache.swap_in(layer, top_k).cpu()
            held = cache.device_kv(layer).cpu()
            S = cache.slots_per_request
            for b, request_id in enumerate(ids):
                mine = torch.cat([self.rows[request_id][layer], new[layer, b : b + 1]])
                first = cache.request_slot(request_id) * S  # its own buffer's rows only
                for k, p in enumerate(positions[b]):
                    if p >= 0:
                        assert first <= int(out[b, k]) < first + S, (request_id, layer, p)
                        assert torch.equal(held[out[b, k]], mine[p]), (request_id, layer, p)
        if cancel:
            cache.cancel_decode_step()
            return
        cache.end_decode_step()
        for b, request_id in enumerate(ids):
            self.rows[request_id] = torch.cat([self.rows[request_id], new[:, b : b + 1]], 1)

    def verify(self, ids: list[Hashable], tokens: int) -> None:
        """One verify step of `tokens` tokens per request (each query token selecting up to
        its own position), every returned row byte-checked, a random count accepted."""
        cache = self.cache
        step = cache.begin_decode_step(ids, num_tokens=tokens)
        new = self.fresh(len(ids) * tokens).reshape(L, len(ids), tokens, W)
        S = cache.slots_per_request
        for layer in range(L):
            cache.write_newest(layer, new[layer].to(cache.device))
            if layer % cache.index_group_size == 0:
                top_k = torch.full((len(ids), tokens, K), -1, dtype=torch.int32)
                for b, first in enumerate(p[0] for p in step.positions):
                    for t in range(tokens):
                        chosen = self.rng.permutation(first + t + 1)[:K]
                        top_k[b, t, : len(chosen)] = torch.from_numpy(chosen)
                top_k_on_device = top_k.to(cache.device)  # a group's layers pass one tensor
            out = cache.swap_in(layer, top_k_on_device).cpu()
            held = cache.device_kv(layer).cpu()
            for b, request_id in enumerate(ids):
                mine = torch.cat([self.rows[request_id][layer], new[layer, b]])
                first = cache.request_slot(request_id) * S
                valid = top_k[b] >= 0
                assert ((out[b][valid] >= first) & (out[b][valid] < first + S)).all()
                assert torch.equal(held[out[b][valid].long()], mine[top_k[b][valid].long()]), (
                    request_id, layer)
        accepted = [int(a) for a in self.rng.integers(1, tokens + 1, len(ids))]
        cache.end_decode_step(accepted=accepted)
        for b, request_id in enumerate(ids):
            self.rows[request_id] = torch.cat([self.rows[request_id],
                                               new[:, b, : accepted[b]]], 1)

    def end(self, request_id: Hashable, how: str = "finish") -> None:
        getattr(self.cache, how)(request_id)
        del self.rows[request_id]


def extents_of(cache: hisparse.HiSparseCache, request_id: Hashable) -> list[int]:
    return list(cache._requests.get(request_id, "test").extents)


# --- sharing, copying, writing only the new rows -----------------------------------------
def test_a_request_on_a_retained_prefix_shares_whole_extents_and_copies_the_tail(
        backend: object, residency_map: str) -> None:
    s = Sharing(backend=backend, residency_map=residency_map)
    cache = s.cache
    s.prefill("a", 10)  # extents of 4: two whole, two tokens in the third
    handle = cache.retain_prefix("a", 10)
    assert (handle.num_tokens, handle.source) == (10, "a")
    offloaded = cache._traffic.offloaded_tokens.copy()
    s.prefill("b", 13, prefix=handle, prefix_rows=s.rows["a"][:, :10])
    a, b = extents_of(cache, "a"), extents_of(cache, "b")
    assert b[:2] == a[:2] and b[2] not in a  # the boundary extent is b's own copy
    assert (cache._traffic.offloaded_tokens - offloaded).tolist() == [3] * L  # only b's own
    s.check()
    s.step(["a", "b"])  # a decodes into the extent the handle holds: it moves to a copy first
    assert extents_of(cache, "a")[2] != a[2] and extents_of(cache, "a")[:2] == a[:2]
    assert torch.equal(s.retained_bytes(handle), s.rows["b"][:, :10])
    for _ in range(8):  # both past their hot buffers: misses read the shared rows
        s.step(["b", "a"])
    s.check()
    cache.release_prefix(handle)
    s.end("a")
    s.end("b", "abort")
    assert cache._pool.allocator.free_runs() == [(0, cache._pool.num_extents)]


@pytest.mark.parametrize("prefix", [8, 10])  # whole extents, and a tail to copy
@pytest.mark.parametrize("retained", [False, True])
def test_n_requests_on_a_p_token_prefix_hold_p_plus_n_times_their_own_rows(
    prefix: int, retained: bool, backend: object, residency_map: str,
) -> None:
    s = Sharing(max_requests=5, backend=backend, residency_map=residency_map)
    cache = s.cache
    s.prefill("src", prefix)
    named = cache.retain_prefix("src", prefix) if retained else ("src", prefix)
    own = [1, 5, 9, 4]
    for i, extra in enumerate(own):
        s.prefill(i, prefix + extra, prefix=named, prefix_rows=s.rows["src"])
    if retained:
        s.end("src")  # the handle keeps the prefix
    whole = prefix // E
    # The prefix once (its whole extents, and the source's or the handle's boundary extent),
    # then each request's own tokens from the prefix's last whole extent on.
    boundary = 1 if prefix % E else 0
    expected = whole + boundary + sum(-(-(prefix - whole * E + n) // E) for n in own)
    occupancy = cache.stats().occupancy
    assert occupancy.host_extents_used == expected
    assert occupancy.host_rows_used == prefix + sum(own) + sum(prefix % E for _ in own)
    assert occupancy.internal_fragmentation_rows >= 0
    # The whole extents have a holder more than the requests: the source or the handle; the
    # boundary extent has one holder (the requests hold copies).
    assert occupancy.shared_extents == whole
    assert occupancy.host_bytes_saved == len(own) * whole * E * W * L
    assert occupancy.retained_prefixes == int(retained)
    s.check()
    if retained:
        cache.release_prefix(named)
    for request_id in list(s.rows):
        s.end(request_id)
    assert cache.stats().occupancy.host_extents_used == 0
    assert cache._pool.allocator.free_extents == cache._pool.num_extents


def test_a_whole_prompt_prefix_needs_no_write_and_its_first_token_takes_a_new_extent(
        backend: object, residency_map: str) -> None:
    s = Sharing(backend=backend, residency_map=residency_map)
    cache = s.cache
    s.prefill("a", 8)
    s.prefill("b", 8, prefix=("a", 8), prefix_rows=s.rows["a"])  # nothing of b's own
    assert extents_of(cache, "b") == extents_of(cache, "a")
    s.step(["b"])
    assert len(extents_of(cache, "b")) == 3 and extents_of(cache, "b")[2] not in extents_of(
        cache, "a")
    s.step(["a", "b"])
    s.check()


def test_a_prefix_of_a_prefix_and_a_prefix_of_a_sharing_request(
        backend: object, residency_map: str) -> None:
    s = Sharing(backend=backend, residency_map=residency_map, max_requests=4)
    cache = s.cache
    s.prefill("a", 14)
    long = cache.retain_prefix("a", 14)
    short = cache.retain_prefix(long, 6)  # a radix node split at 6
    assert (short.num_tokens, short.source) == (6, "a")
    s.prefill("b", 9, prefix=short, prefix_rows=s.rows["a"][:, :6])
    s.prefill("c", 11, prefix=("b", 9), prefix_rows=s.rows["b"])
    assert extents_of(cache, "c")[:1] == extents_of(cache, "a")[:1]
    cache.release_prefix(long)
    s.end("a")
    for _ in range(6):
        s.step(["b", "c"])
    s.check()
    assert torch.equal(s.retained_bytes(short), s.rows["b"][:, :6])


def test_ending_or_parking_one_holder_never_changes_another_holders_rows(
        backend: object, residency_map: str) -> None:
    s = Sharing(backend=backend, residency_map=residency_map, max_requests=3)
    cache = s.cache
    s.prefill("a", 13)
    handle = cache.retain_prefix("a", 12)
    s.prefill("b", 15, prefix=handle, prefix_rows=s.rows["a"][:, :12])
    s.prefill("c", 12, prefix=("a", 12), prefix_rows=s.rows["a"][:, :12])
    prefix = s.rows["a"][:, :12].clone()
    cache.preempt("a")
    s.check()
    s.end("a")
    s.check()
    s.step(["b", "c"])
    cache.preempt("b")
    s.step(["c"])
    cache.resume("b")
    s.step(["b", "c"], cancel=True)
    s.step(["c", "b"])
    s.end("c", "abort")
    assert torch.equal(s.retained_bytes(handle), prefix)
    s.check()
    cache.release_prefix(handle)  # b still holds the rows: nothing it reads is freed
    s.step(["b"])
    s.check()
    s.end("b")
    assert cache._pool.allocator.free_runs() == [(0, cache._pool.num_extents)]


def test_a_cancelled_step_keeps_the_private_copy_and_the_rows(
        backend: object, residency_map: str) -> None:
    s = Sharing(backend=backend, residency_map=residency_map)
    cache = s.cache
    s.prefill("a", 10)
    handle = cache.retain_prefix("a", 9)
    before = extents_of(cache, "a")
    assert cache._prefixes.writers  # a's next token lands in the extent of the handle's tail
    s.step(["a"], cancel=True)
    after = extents_of(cache, "a")
    assert after[:2] == before[:2] and after[2] != before[2] and not cache._prefixes.writers
    assert cache._pool.holders(before[2]) == 1  # the handle's alone now
    s.check()
    s.step(["a"])
    assert torch.equal(s.retained_bytes(handle), s.rows["a"][:, :9])
    s.check()


def test_releasing_the_handle_first_spares_the_copy(
        backend: object, residency_map: str) -> None:
    s = Sharing(backend=backend, residency_map=residency_map)
    cache = s.cache
    s.prefill("a", 10)
    cache.release_prefix(cache.retain_prefix("a", 10))
    assert not cache._prefixes.writers
    before = extents_of(cache, "a")
    s.step(["a"])
    assert extents_of(cache, "a") == before
    s.check()


@pytest.mark.parametrize("group", [1, 2, 4])
def test_index_groups_decode_sharing_requests_side_by_side(
        group: int, backend: object, residency_map: str) -> None:
    s = Sharing(group=group, backend=backend, residency_map=residency_map)
    s.prefill("a", 21)
    s.prefill("b", 27, prefix=("a", 18), prefix_rows=s.rows["a"][:, :18])
    s.prefill("c", 19, prefix=("a", 19), prefix_rows=s.rows["a"][:, :19])
    for _ in range(5):
        s.step(["a", "b", "c"])
        s.check()


@pytest.mark.parametrize("group", [1, 2])
def test_verify_steps_decode_sharing_requests_side_by_side(
        group: int, backend: object, residency_map: str) -> None:
    """Verify steps (S = 2 tokens, a random count accepted) over requests that share a
    prefix, one of them moving to a private copy of the extent a retained prefix's tail
    holds: every returned row is the request's own, with its bytes."""
    s = Sharing(group=group, backend=backend, residency_map=residency_map, drafts=2)
    s.prefill("a", 21)
    handle = s.cache.retain_prefix("a", 21)  # a's next tokens land in the handle's tail
    s.prefill("b", 27, prefix=handle, prefix_rows=s.rows["a"])
    s.prefill("c", 19, prefix=("a", 18), prefix_rows=s.rows["a"][:, :18])
    for index in range(6):
        s.verify(["a", "b", "c"], 2)
        if index == 2:
            s.step(["c", "a"])
        s.check()
    assert torch.equal(s.retained_bytes(handle), s.rows["b"][:, :21])


# --- PD -----------------------------------------------------------------------------------
def test_a_pd_reservation_on_a_prefix_lists_only_the_rows_to_transfer(
        backend: object, residency_map: str) -> None:
    s = Sharing(backend=backend, residency_map=residency_map, max_requests=2)
    cache = s.cache
    s.prefill("a", 11)
    handle = cache.retain_prefix("a", 11)
    res = cache.reserve_host_slots("b", 17, prefix=handle)
    assert res.prefix_tokens == 11 and len(res.rows) == 6
    assert np.array_equal(np.concatenate([np.arange(f, f + n) for f, n in res.extents]),
                          res.rows)
    shared_rows = set(cache.host_rows("a")[:8].tolist())
    assert not shared_rows & set(res.rows.tolist())
    own = s.fresh(6)
    for layer, host in enumerate(res.host_tensors):
        host[torch.from_numpy(res.rows)] = own[layer]
    cache.complete_transfer("b")
    s.rows["b"] = torch.cat([s.rows["a"][:, :11], own], 1)
    s.check()
    s.step(["a", "b"])
    s.check()


def test_pd_failures_leave_every_holder_count_as_it_was(
        backend: object, residency_map: str) -> None:
    s = Sharing(backend=backend, residency_map=residency_map, max_requests=1)
    cache = s.cache
    s.prefill("a", 10)
    handle = cache.retain_prefix("a", 10)
    holders = list(cache._pool._holders)
    # A transfer that fails (time-out, refused descriptors): the endpoint aborts it.
    cache.reserve_host_slots("b", 14, prefix=handle)
    cache.abort("b")
    assert cache._pool._holders == holders
    # The rows landed but no device slot is free: the request stays reserved until aborted.
    res = cache.reserve_host_slots("c", 12, prefix=("a", 9))
    for host in res.host_tensors:
        host[torch.from_numpy(res.rows)] = 0
    with pytest.raises(PoolExhaustedError):
        cache.complete_transfer("c")
    cache.abort("c")
    assert cache._pool._holders == holders
    s.check()
    cache.release_prefix(handle)
    s.end("a")
    assert cache._pool.allocator.free_extents == cache._pool.num_extents


# --- statistics ---------------------------------------------------------------------------
def test_statistics_count_shared_extents_rows_and_bytes_saved(
        backend: object, residency_map: str) -> None:
    s = Sharing(backend=backend, residency_map=residency_map)
    cache = s.cache
    s.prefill("a", 10)
    empty = cache.stats().occupancy
    assert (empty.shared_extents, empty.shared_rows, empty.host_bytes_saved) == (0, 0, 0)
    handle = cache.retain_prefix("a", 10)
    s.prefill("b", 12, prefix=handle, prefix_rows=s.rows["a"])
    occupancy = cache.stats().occupancy
    # Extents 0 and 1 by a, b and the handle; extent 2 by a and the handle (its tail).
    assert occupancy.shared_extents == 3
    assert occupancy.shared_rows == 8 + 2
    assert occupancy.host_bytes_saved == (2 * 2 + 1) * E * W * L
    assert occupancy.retained_prefixes == 1
    assert occupancy.host_rows_used == 10 + 4  # a's 10, b's own extent (2 copied + 2 new)
    assert occupancy.host_extents_used == 4
    # host_row: b names the two whole extents it shares by alias key extents, of as many as
    # the pool has extents (alias_extents: null); position keys need none.
    aliases = (2, 32) if residency_map == "host_row" else (0, 0)
    assert (occupancy.alias_extents_used, occupancy.alias_extents_total) == aliases
    document = cache.stats().to_dict()["occupancy"]
    assert document["host_bytes_saved"] == occupancy.host_bytes_saved
    assert document["alias_extents_used"] == aliases[0]


# --- refused calls --------------------------------------------------------------------------
def _forged(cache: hisparse.HiSparseCache) -> PrefixHandle:
    return PrefixHandle(999, 3, "a", cache._prefixes.cache_id)


def _released(cache: hisparse.HiSparseCache) -> PrefixHandle:
    handle = cache.retain_prefix("a", 5)
    cache.release_prefix(handle)
    return handle


def _prefilling(cache: hisparse.HiSparseCache) -> None:
    cache.admit("p", 9, prefix=("a", 6))


def _other_cache_handle(cache: hisparse.HiSparseCache) -> PrefixHandle:
    other = Sharing().cache
    other.admit("x", 4)
    other.write_prefill("x", torch.zeros(L, 4, W, dtype=torch.uint8))
    other.commit_prefill("x")
    return other.retain_prefix("x", 4)


# name -> (error, setup run before the snapshot, the call, words the message must contain)
REFUSED: dict[str, tuple[type[Exception], Callable | None, Callable, str]] = {
    "an unknown handle": (InvalidInputError, None,
                          lambda c: c.admit("n", 9, prefix=_forged(c)), "not a prefix"),
    "releasing an unknown handle": (InvalidInputError, None,
                                    lambda c: c.release_prefix(_forged(c)), "retain_prefix"),
    "a double release": (RequestStateError, _released,
                         lambda c, h: c.release_prefix(h), "already released"),
    "admitting on a released handle": (RequestStateError, _released,
                                       lambda c, h: c.admit("n", 9, prefix=h),
                                       "already released"),
    "releasing a non-handle": (InvalidInputError, None, lambda c: c.release_prefix(("a", 3)),
                               "not a PrefixHandle"),
    "another cache's handle": (InvalidInputError, _other_cache_handle,
                               lambda c, h: c.admit("n", 9, prefix=h), "another HiSparseCache"),
    "a prefix longer than the request": (
        InvalidInputError, lambda c: c.retain_prefix("a", 10),
        lambda c, h: c.admit("n", 7, prefix=h), "more than the 7 tokens"),
    "a prefix longer than its source": (
        InvalidInputError, None, lambda c: c.admit("n", 20, prefix=("a", 11)),
        "cannot be longer"),
    "retaining more than the request": (
        InvalidInputError, None, lambda c: c.retain_prefix("a", 11), "cannot be longer"),
    "retaining more than a handle": (
        InvalidInputError, lambda c: c.retain_prefix("a", 6),
        lambda c, h: c.retain_prefix(h, 7), "cannot be longer"),
    "retaining zero tokens": (InvalidInputError, None, lambda c: c.retain_prefix("a", 0),
                              "1..10"),
    "retaining True tokens": (InvalidInputError, None, lambda c: c.retain_prefix("a", True),
                              "plain int"),
    "retaining from an unknown request": (UnknownRequestError, None,
                                          lambda c: c.retain_prefix("ghost", 3), "admit"),
    "retaining from a finished request": (
        RequestStateError, lambda c: c.finish("b"), lambda c, _: c.retain_prefix("b", 3),
        "already finished"),
    "retaining from a prefilling request": (
        RequestStateError, _prefilling, lambda c, _: c.retain_prefix("p", 3), "commit_prefill"),
    "sharing from a reserved request": (
        RequestStateError, lambda c: c.reserve_host_slots("r", 6),
        lambda c, _: c.admit("n", 9, prefix=("r", 3)), "complete_transfer"),
    "a prefix of the wrong type": (InvalidInputError, None,
                                   lambda c: c.admit("n", 9, prefix="a"), "PrefixHandle"),
    "a prefix triple": (InvalidInputError, None,
                        lambda c: c.reserve_host_slots("n", 9, prefix=("a", 3, 1)),
                        "(request_id, num_tokens)"),
    "writing into the shared prefix": (
        InvalidInputError, _prefilling,
        lambda c, _: c.write_prefill("p", torch.zeros(L, 4, W, dtype=torch.uint8), start=4),
        "start=6"),
    "committing without the own rows": (
        InvalidInputError, _prefilling, lambda c, _: c.commit_prefill("p"),
        "rows 6..8 of layer 0"),
    "retaining during the step": (
        RequestStateError, lambda c: c.begin_decode_step(["a"]),
        lambda c, _: c.retain_prefix("a", 3), "end_decode_step"),
    "admitting on a prefix in the step": (
        RequestStateError, lambda c: c.begin_decode_step(["b", "a"]),
        lambda c, _: c.admit("n", 9, prefix=("a", 3)), "end_decode_step"),
    "a live id on a prefix": (RequestStateError, None,
                              lambda c: c.admit("b", 12, prefix=("a", 3)), "already"),
    "no room for the own extents": (
        PoolExhaustedError, None, lambda c: c.admit("n", 120, prefix=("a", 10)),
        "host pool exhausted"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_bad_sharing_calls_are_refused_and_change_nothing(name: str, residency_map: str) -> None:
    s = Sharing(pool_extents=32, residency_map=residency_map)
    cache = s.cache
    s.prefill("a", 10)
    s.prefill("b", 6)
    error, setup, call, words = REFUSED[name]
    made = setup(cache) if setup else None
    before = full_snapshot(cache)
    with pytest.raises(error, match=re.escape(words)) as caught:
        call(cache, made) if setup else call(cache)
    assert_same_state(before, full_snapshot(cache))
    assert says_what_to_do(str(caught.value)), str(caught.value)


def _calls(cache: hisparse.HiSparseCache, prefix: object, request_id: str = "n"
           ) -> dict[str, Callable[[], object]]:
    return {
        "retain": lambda: cache.retain_prefix(*prefix),
        "admit": lambda: cache.admit(request_id, 12, prefix=prefix),
        "reserve": lambda: cache.reserve_host_slots(request_id, 12, prefix=prefix),
    }


@pytest.mark.parametrize("call", ["retain", "admit", "reserve"])
def test_a_host_row_map_without_alias_extents_refuses_sharing(call: str) -> None:
    """alias_extents: 0 keeps the plain host-row tables (no key extents: every page-table
    entry a host extent) and refuses every sharing call, naming both ways to share."""
    s = Sharing(residency_map="host_row", alias_extents=0)
    cache = s.cache
    assert cache.tables.key_host_extent is None
    assert cache.tables.num_keys == cache._pool.num_rows
    s.prefill("a", 10)
    before = full_snapshot(cache)
    with pytest.raises(InvalidInputError, match="alias_extents: 0") as caught:
        _calls(cache, ("a", 8))[call]()
    assert "residency_map: position" in str(caught.value)
    assert says_what_to_do(str(caught.value)), str(caught.value)
    assert_same_state(before, full_snapshot(cache))


@pytest.mark.parametrize("call", ["admit", "reserve"])
@pytest.mark.parametrize("retained", [False, True])
def test_running_out_of_alias_extents_is_refused_and_changes_nothing(
        call: str, retained: bool) -> None:
    """Two whole extents shared take two alias key extents: with alias_extents=3 a second
    such request finds one, is refused with what to raise, and leaves the cache as it was;
    a prefix inside one extent shares none and needs none."""
    s = Sharing(residency_map="host_row", alias_extents=3)
    cache = s.cache
    s.prefill("a", 10)
    prefix = cache.retain_prefix("a", 9) if retained else ("a", 9)
    s.prefill("b", 12, prefix=prefix, prefix_rows=s.rows["a"][:, :9])
    assert cache._requests.get("b", "test").aliases == (32, 33)  # after the 32 host extents
    assert cache._prefixes.aliases.free == 1
    before = full_snapshot(cache)
    with pytest.raises(PoolExhaustedError, match="alias_extents=3") as caught:
        _calls(cache, prefix)[call]()
    message = str(caught.value)
    assert "needs an alias key extent" in message and "raise alias_extents" in message
    assert says_what_to_do(message), message
    assert_same_state(before, full_snapshot(cache))
    _calls(cache, ("a", 3))[call]()  # no whole extent shared: no alias needed
    assert cache._requests.get("n", "test").aliases == ()
    assert cache._prefixes.aliases.free == 1
    check_key_extents(cache)


# How a request gives its alias key extents back (or keeps them, parked).
def _preempt_and_finish(s: Sharing, request_id: str) -> None:
    s.cache.preempt(request_id)
    assert s.cache._requests.get(request_id, "test").aliases  # a parked request keeps them
    s.cache.resume(request_id)
    s.check()
    s.step([request_id])
    s.cache.preempt(request_id)
    s.end(request_id)


def _cancel_then_abort(s: Sharing, request_id: str) -> None:
    s.step([request_id, "a"], cancel=True)
    s.step([request_id])
    s.end(request_id, "abort")


ENDINGS: dict[str, Callable[[Sharing, str], None]] = {
    "finish": lambda s, r: s.end(r),
    "abort": lambda s, r: s.end(r, "abort"),
    "preempt, resume, preempt, finish": _preempt_and_finish,
    "a cancelled step, then abort": _cancel_then_abort,
}


@pytest.mark.parametrize("how", ENDINGS)
def test_alias_key_extents_come_back_when_their_request_ends(how: str) -> None:
    s = Sharing(residency_map="host_row", alias_extents=6)
    cache = s.cache
    aliases = cache._prefixes.aliases
    s.prefill("a", 14)
    handle = cache.retain_prefix("a", 13)
    s.prefill("b", 15, prefix=handle, prefix_rows=s.rows["a"][:, :13])  # 3 whole extents
    s.prefill("c", 9, prefix=("b", 8), prefix_rows=s.rows["a"][:, :8])  # 2 of b's
    assert [len(cache._requests.get(r, "t").aliases) for r in "abc"] == [0, 3, 2]
    assert cache.stats().occupancy.alias_extents_used == 5
    s.check()
    ENDINGS[how](s, "b")
    assert aliases.free == 6 - 2  # c's two are still out
    s.check()
    ENDINGS[how](s, "c")
    assert aliases.free == aliases.capacity
    occupancy = cache.stats().occupancy
    assert (occupancy.alias_extents_used, occupancy.alias_extents_total) == (0, 6)
    # No page table names an alias now: every alias entry of key_host_extent is -1 again.
    assert (cache.tables.key_host_extent[cache._pool.num_extents:] == -1).all()
    cache.release_prefix(handle)
    s.check()


def test_pd_failures_give_the_alias_key_extents_back() -> None:
    s = Sharing(residency_map="host_row", max_requests=1, alias_extents=2)
    cache = s.cache
    aliases = cache._prefixes.aliases
    s.prefill("a", 10)
    cache.reserve_host_slots("b", 14, prefix=("a", 8))  # the transfer fails: aborted
    assert aliases.free == 0
    cache.abort("b")
    assert aliases.free == 2
    res = cache.reserve_host_slots("c", 12, prefix=("a", 9))  # landed, but no device slot
    for host in res.host_tensors:
        host[torch.from_numpy(res.rows)] = 0
    with pytest.raises(PoolExhaustedError):
        cache.complete_transfer("c")
    assert aliases.free == 0  # still reserved: it keeps them for a later completion
    cache.abort("c")
    assert aliases.free == 2
    s.check()


def test_a_shared_row_resident_in_two_buffers_serves_each_request_its_own_slot(
        residency_map: str, backend: object) -> None:
    """a and b hold the same 16 host rows, both resident in both hot buffers (each in its own
    slot): every lookup returns the request's own slot holding that token. Under host_row the
    two page tables name the shared extents by different key extents (b's aliases, whose
    host extents are a's), so the rows have two `resident` entries, one per request."""
    s = Sharing(residency_map=residency_map, backend=backend)
    cache = s.cache
    s.prefill("a", 20)
    s.prefill("b", 20, prefix=("a", 16), prefix_rows=s.rows["a"][:, :16])
    t = cache.tables
    ra, rb = cache.request_slot("a"), cache.request_slot("b")
    record = cache._requests.get("b", "test")
    if residency_map == "host_row":
        assert record.aliases == tuple(range(32, 36))
        assert t.page_table[rb, :4].tolist() == list(record.aliases)
        assert t.page_table[ra, :4].tolist() == extents_of(cache, "a")[:4]
        assert t.key_host_extent[list(record.aliases)].tolist() == extents_of(cache, "a")[:4]
    shared = [0, 1, 2, 3]  # four shared positions, in neither hot buffer after seeding
    S = cache.slots_per_request
    for repeat in range(3):
        step = cache.begin_decode_step(["a", "b"])
        top_k = torch.tensor([shared, shared], dtype=torch.int32, device=cache.device)
        new = s.fresh(2)
        for layer in range(L):
            cache.write_newest(layer, new[layer].to(cache.device))
            out = cache.swap_in(layer, top_k).cpu()
            for b, (request_id, r) in enumerate((("a", ra), ("b", rb))):
                assert ((out[b] >= r * S) & (out[b] < r * S + S)).all(), (repeat, request_id)
                assert torch.equal(cache.device_kv(layer).cpu()[out[b].long()],
                                   s.rows[request_id][layer, shared])
        step.end()
        for b, request_id in enumerate("ab"):
            s.rows[request_id] = torch.cat([s.rows[request_id], new[:, b : b + 1]], 1)
        s.check()
    stats = {r.request_id: r for r in cache.stats().requests}
    # Each request missed the four rows once (the first step) and hit them after, per group.
    G = cache.num_groups
    assert [(stats[r].misses, stats[r].hits) for r in "ab"] == [(4 * G, 8 * G)] * 2


def test_the_moved_extent_keeps_its_hot_slots_under_the_new_key(
        residency_map: str, monkeypatch: pytest.MonkeyPatch, backend: object) -> None:
    """a decodes into the extent a retained prefix's tail holds, so its step moves it to a
    private copy: a new host extent, and under host_row a new key extent, whose key rows its
    hot slots of that extent now hold. The tokens resident there stay hits, with their bytes;
    without the move of the keys (`move_keys` a no-op) the tables would name the old keys."""
    s = Sharing(residency_map=residency_map, backend=backend)
    cache = s.cache
    s.prefill("a", 11)  # extents of 4: positions 8..10 in the third; 2..9 resident (LRU)
    handle = cache.retain_prefix("a", 11)
    old = extents_of(cache, "a")[2]
    s.step(["a"])  # moves a to a copy of extent 2 first (its token 11 lands there)
    new = extents_of(cache, "a")[2]
    assert new != old and cache._pool.holders(old) == 1
    r = cache.request_slot("a")
    if residency_map == "host_row":
        assert int(cache.tables.page_table[r, 2]) == new
        keys = set(cache.tables.slot_key[:, r].flatten().tolist())
        assert not keys & set(range(old * E, old * E + E)) and keys & {new * E, new * E + 1}
    s.check()
    before = {q.request_id: q for q in cache.stats().requests}["a"]
    # Tokens 6..9 sit in the LRU's four newest slots: a step of K = 4 cannot have evicted
    # them, and 8, 9 are in the moved extent.
    step = cache.begin_decode_step(["a"])
    picked = [8, 9, 6, 7]
    top_k = torch.tensor([picked], dtype=torch.int32, device=cache.device)
    fresh = s.fresh(1)
    for layer in range(L):
        cache.write_newest(layer, fresh[layer].to(cache.device))
        out = cache.swap_in(layer, top_k).cpu()
        assert torch.equal(cache.device_kv(layer).cpu()[out[0].long()],
                           s.rows["a"][layer, picked])
    step.end()
    s.rows["a"] = torch.cat([s.rows["a"], fresh], 1)
    after = {q.request_id: q for q in cache.stats().requests}["a"]
    hits = 4 * cache.num_groups
    assert (after.hits - before.hits, after.misses - before.misses) == (hits, 0)
    s.check()
    cache.release_prefix(handle)
    if residency_map == "host_row":  # the same with the keys left where they were
        from hisparse.core import sharing

        monkeypatch.setattr(sharing, "move_keys", lambda *args: None)
        s.prefill("c", 11)
        cache.retain_prefix("c", 11)
        s.step(["c"])
        with pytest.raises(AssertionError):
            check_table_invariants(cache)


def test_a_miss_through_an_alias_reads_the_shared_host_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An alias key row lies past the host pool: a lookup that took it for the host row
    would find no row (or, for a key extent inside the pool, another token's). Mutated so,
    the engine's swap-in serves b a row that is not its token's, which the step's check
    catches."""
    from hisparse.kernels.swap_in import reference

    s = Sharing(residency_map="host_row")
    s.prefill("a", 20)
    s.prefill("b", 20, prefix=("a", 16), prefix_rows=s.rows["a"][:, :16])
    monkeypatch.setattr(reference, "_key_and_host_rows",
                        lambda t, page, offset: (page * E + offset,) * 2)
    with pytest.raises(AssertionError, match=r"\('b', 0"):
        for _ in range(6):
            s.step(["a", "b"])


def test_a_closed_cache_refuses_retain_and_release() -> None:
    s = Sharing()
    s.prefill("a", 5)
    handle = s.cache.retain_prefix("a", 5)
    s.cache.close()
    with pytest.raises(RequestStateError, match="closed"):
        s.cache.retain_prefix("a", 3)
    with pytest.raises(RequestStateError, match="closed"):
        s.cache.release_prefix(handle)


def test_why_host_row_sharing_needs_alias_key_extents(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the aliases taken out (every page table naming host extents), two running
    requests that hold one shared host row claim one `resident` entry: the ARCHITECTURE.md
    invariant breaks and a lookup of one request returns the other's slot id, a slot of its
    own buffer that holds another token."""
    import test_reliability_state
    from hisparse.core.requests import RequestRecord

    monkeypatch.setattr(RequestRecord, "key_extents", lambda self: self.extents)
    s = Sharing(residency_map="host_row")
    s.prefill("a", 20)
    check_table_invariants(s.cache)
    s.prefill("b", 20, prefix=("a", 16), prefix_rows=s.rows["a"][:, :16])
    with pytest.raises(AssertionError, match="is held by 'a' and 'b'"):
        check_table_invariants(s.cache)
    monkeypatch.setattr(test_reliability_state, "check_key_extents", lambda cache: None)
    with pytest.raises(AssertionError, match="held twice"):  # b's seeding took a's entries
        check_table_invariants(s.cache)
    with pytest.raises(AssertionError, match=r"\('[ab]', 0"):  # then swap-ins serve wrong bytes
        for _ in range(20):
            s.step(["a", "b"])
