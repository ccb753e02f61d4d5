"""One host pool shared by tensor-parallel ranks (issue 23), with the ranks in one process.

Two (or more) caches of one process attach the same segment, each through its own mapping,
so the rules are exercised without process start-up: the writer's call runs, then each
reader's. tests/test_shared_pool_processes.py runs ranks as processes (faults, memory,
the fuzz).
"""

from __future__ import annotations

import os
import subprocess
import warnings

import numpy as np
import pytest
import torch

from conftest import random_bytes
from hisparse import HiSparseCache, HiSparseConfig
from hisparse.backends.cpu import CPU_FEATURES, CpuBackend
from hisparse.backends.features import Feature, FeatureTable, unsupported
from hisparse.core import shared_segment
from hisparse.core.host_pool import token_rows
from hisparse.core.shared_pool import SharedPoolSpec
from hisparse.errors import (
    FeatureDisabledWarning,
    InvalidInputError,
    PoolExhaustedError,
    SharedPoolError,
)

CONFIG = dict(num_layers=3, top_k=8, hot_slots=16, index_group_size=1, max_requests=4,
              max_seq_len=256, host_pool_tokens=512, extent_tokens=16)


def group(name: str, ranks: int, device: object = "cpu", **overrides: object
          ) -> list[HiSparseCache]:
    config = HiSparseConfig.from_preset("tiny", **{**CONFIG, **overrides})
    return [HiSparseCache(config, device, shared_pool=SharedPoolSpec(name, rank, ranks))
            for rank in range(ranks)]


def on_all(caches: list[HiSparseCache], call: str, *args: object, **kwargs: object) -> list:
    """The same call on every rank, the writer (rank 0) first, as a TP group makes it."""
    return [getattr(cache, call)(*args, **kwargs) for cache in caches]


def decode(caches: list[HiSparseCache], ids: list[str], newest: torch.Tensor,
           top_k: torch.Tensor) -> list[list[torch.Tensor]]:
    """One decode step on every rank; each rank's rows of every layer, gathered."""
    seen = []
    for cache in caches:
        step = cache.begin_decode_step(ids)
        rows = []
        for layer in range(cache.num_layers):
            step.write_newest(layer, newest[layer])
            out = step.swap_in(layer, top_k)
            rows.append(cache.device_kv(layer)[out.long()])
        step.end()
        seen.append(rows)
    return seen


@pytest.mark.requires(Feature.SHARED_HOST_POOL)
def test_ranks_read_the_writers_rows_and_the_readers_allocate_none(
        pool_name: str, rng: torch.Generator, backend: object) -> None:
    """Prefill (from the device), then decode steps whose top-k reaches back to host rows:
    every rank's swap-in returns exactly the tokens' bytes, though only rank 0 wrote any; the
    readers hold no host buffer of their own and see the same rows through their own
    mappings. On a GPU the three ranks share the one device."""
    caches = group(pool_name, 3, device=backend)
    L, W, prompt, steps = caches[0].num_layers, caches[0].row_bytes, 40, 6
    kv = random_bytes((L, prompt + steps, W), rng, caches[0].device)
    on_all(caches, "admit", "r", prompt)
    on_all(caches, "write_prefill", "r", kv[:, :prompt])
    on_all(caches, "commit_prefill", "r")
    for step in range(steps):
        length = prompt + step + 1
        picks = torch.randperm(length, generator=rng)[:8].sort().values.to(torch.int32)
        picks = picks.to(caches[0].device)
        for rank_rows in decode(caches, ["r"], kv[:, length - 1: length], picks[None]):
            for layer, rows in enumerate(rank_rows):
                assert torch.equal(rows[0], kv[layer, picks.long()]), (step, layer)
    assert caches[0]._pool._raw == [] and all(c._pool._raw == [] for c in caches)
    assert not any(c._pool.writes_rows for c in caches[1:]) and caches[0]._pool.writes_rows
    hosts = [c.host_tensors() for c in caches]
    assert len({h[0].data_ptr() for h in hosts}) == 3  # three mappings of one file
    rows = torch.from_numpy(token_rows(caches[1]._requests.get("r", "x").extents,
                                       caches[0].extent_tokens, 0, prompt + steps))
    for host in hosts:
        assert all(torch.equal(host[layer][rows], kv[layer].cpu()) for layer in range(L))
    layout = caches[0]._pool.segment.layout
    assert os.stat(shared_segment.segment_path(pool_name)).st_size == layout.total_bytes
    assert layout.header_bytes <= 64 << 10 < layout.data_bytes  # metadata stays small
    on_all(caches, "close")


@pytest.mark.parametrize("order", ["writer_first", "writer_last"])
def test_the_last_rank_to_close_frees_the_pool(pool_name: str, order: str) -> None:
    caches = group(pool_name, 3)
    path = shared_segment.segment_path(pool_name)
    closing = caches if order == "writer_first" else caches[::-1]
    for index, cache in enumerate(closing):
        assert os.path.exists(path)
        cache.close()
        assert os.path.exists(path) is (index < len(closing) - 1)
    cache.close()  # idempotent


def test_bad_specs_are_refused_before_anything_is_made(pool_name: str) -> None:
    config = HiSparseConfig.from_preset("tiny", **CONFIG)
    for kwargs, complaint in [
            (dict(rank=2, ranks=2), "rank=2 must be an int in 0..1"),
            (dict(rank=0, ranks=0), "ranks=0 must be an int in 1..64"),
            (dict(rank=0, ranks=2, writer_rank=5), "writer_rank=5"),
            (dict(rank=0, ranks=2, wait_timeout_s=0), "wait_timeout_s=0"),
            (dict(rank=0, ranks=2, liveness_period_s=-1), "liveness_period_s=-1")]:
        with pytest.raises(InvalidInputError, match=complaint):
            SharedPoolSpec(pool_name, **kwargs)
    for name in ["", "../etc", "a/b", ".hidden", "x" * 201]:
        with pytest.raises(InvalidInputError, match="not usable as a file name"):
            HiSparseCache(config, "cpu", shared_pool=SharedPoolSpec(name, 0, 2))
    with pytest.raises(InvalidInputError, match="must be a SharedPoolSpec"):
        HiSparseCache(config, "cpu", shared_pool=pool_name)  # type: ignore[arg-type]
    assert not os.path.exists(shared_segment.segment_path(pool_name))


@pytest.mark.parametrize("period", [0.0, 3600.0])
def test_an_operation_checks_the_group_once_the_liveness_period_passed(
        pool_name: str, period: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that dies while no one waits for it is found by the first operation after
    `liveness_period_s` (0: every operation), which fails the pool naming it; not before."""
    config = HiSparseConfig.from_preset("tiny", **CONFIG)
    writer, reader = (HiSparseCache(config, "cpu", shared_pool=SharedPoolSpec(
        pool_name, rank, 2, liveness_period_s=period)) for rank in range(2))
    with monkeypatch.context() as patch:  # the reader's process "died" (both ranks are ours)
        patch.setattr(shared_segment.SharedSegment, "dead_ranks", lambda self: [(1, 4242)])
        if period:
            writer.admit("a", 4)
            assert writer.seq_len("a") == 4
        else:
            with pytest.raises(SharedPoolError, match=r"rank 1 \(a reader, pid 4242\) of the "
                               "group exited without closing"):
                writer.admit("a", 4)
            with pytest.raises(SharedPoolError, match="failed"):
                reader.admit("a", 4)
    writer.close()
    reader.close()


def test_bad_handles_give_clear_errors_and_leave_the_group_working(
        pool_name: str, rng: torch.Generator) -> None:
    config = HiSparseConfig.from_preset("tiny", **CONFIG)
    with pytest.raises(SharedPoolError, match=r"no shared host pool .* was ready to join within"):
        HiSparseCache(config, "cpu", shared_pool=SharedPoolSpec(pool_name, 1, 2,
                                                                attach_timeout_s=0.05))
    assert not os.path.exists(shared_segment.segment_path(pool_name))
    writer, reader = group(pool_name, 2)
    other = config.replace(host_pool_tokens=1024)
    with pytest.raises(SharedPoolError, match=r"rows per layer: the pool has 512, this cache "
                       "1024.*data bytes"):
        HiSparseCache(other, "cpu", shared_pool=SharedPoolSpec(pool_name, 1, 2))
    with pytest.raises(SharedPoolError, match="row_bytes: the pool has 64, this cache 32"):
        HiSparseCache(config.replace(row_bytes_by_dtype={"fp8": 32, "bf16": 64}), "cpu",
                      shared_pool=SharedPoolSpec(pool_name, 1, 2))
    with pytest.raises(SharedPoolError, match=r"rank 1 .* is already attached by live process"):
        HiSparseCache(config, "cpu", shared_pool=SharedPoolSpec(pool_name, 1, 2))
    with pytest.raises(SharedPoolError, match="exists and is attached by live processes"):
        HiSparseCache(config, "cpu", shared_pool=SharedPoolSpec(pool_name, 0, 2))
    # None of that touched the group: it still shares rows.
    kv = random_bytes((writer.num_layers, 30, writer.row_bytes), rng)
    for cache in (writer, reader):
        cache.admit("r", 30)
        cache.write_prefill("r", kv)
        cache.commit_prefill("r")
    rows = torch.from_numpy(token_rows(reader._requests.get("r", "x").extents, 16, 0, 30))
    assert torch.equal(reader.host_tensors()[2][rows], kv[2])
    writer.close()
    reader.close()


def test_a_rank_whose_calls_diverge_fails_every_rank(pool_name: str) -> None:
    """The reader admits another length than the writer did: the allocators disagree, and
    the reader's admit (the later one) raises; from then on every rank's calls raise."""
    writer, reader = group(pool_name, 2)
    writer.admit("a", 40)
    with pytest.raises(SharedPoolError, match="diverged from rank 0's at operation 1 "
                       r"\(admit \('a', 41\)\)"):
        reader.admit("a", 41)
    for cache in (writer, reader):
        with pytest.raises(SharedPoolError, match="diverged"):
            cache.admit("b", 10)
    writer.close()
    reader.close()


def test_another_request_order_is_a_divergence_too(pool_name: str) -> None:
    writer, reader = group(pool_name, 2)
    writer.admit("a", 20)
    writer.admit("b", 20)
    with pytest.raises(SharedPoolError, match=r"diverged .* at operation 1 \(admit \('b'"):
        reader.admit("b", 20)  # the same extents, for another request: caught by its id
    writer.close()
    reader.close()


def test_a_batch_list_changed_in_place_is_compared_by_its_new_ids(
        pool_name: str, rng: torch.Generator) -> None:
    """The ranks compare each call by its arguments, and reuse the last call's number when a
    decode step repeats its batch: a caller that keeps one list and reorders it in place still
    has its new order compared (a reader whose rows are in another order than the writer's
    would put each request's tokens in another's rows)."""
    writer, reader = group(pool_name, 2)
    L, W = writer.num_layers, writer.row_bytes
    for request in ("a", "b"):
        on_all([writer, reader], "admit", request, 20)
        on_all([writer, reader], "write_prefill", request, random_bytes((L, 20, W), rng))
        on_all([writer, reader], "commit_prefill", request)
    kv = torch.zeros(2, W, dtype=torch.uint8)
    batches = {writer: ["a", "b"], reader: ["a", "b"]}  # each rank's one list, reused
    for _ in range(2):
        for cache in (writer, reader):
            step = cache.begin_decode_step(batches[cache])
            for layer in range(L):
                step.write_newest(layer, kv)
            step.end()
    writer.begin_decode_step(batches[writer]).cancel()
    batches[reader].reverse()
    with pytest.raises(SharedPoolError, match=r"diverged .* \(begin_decode_step \(\['b', 'a'\]"):
        reader.begin_decode_step(batches[reader])
    writer.close()
    reader.close()


def test_exhaustion_is_the_same_on_every_rank_and_changes_nothing(pool_name: str) -> None:
    caches = group(pool_name, 2, host_pool_tokens=128, max_seq_len=128)
    on_all(caches, "admit", "a", 100)
    before = [c.stats().occupancy for c in caches]
    for cache in caches:
        with pytest.raises(PoolExhaustedError, match="host pool exhausted"):
            cache.admit("b", 40)
    assert [c.stats().occupancy for c in caches] == before
    assert [c._shared.seq for c in caches] == [1, 1]  # a refused call is no operation
    on_all(caches, "admit", "b", 16)  # and the ranks still agree afterwards
    on_all(caches, "close")


@pytest.mark.parametrize("residency_map", ["host_row", "position"])
def test_shared_prefixes_keep_every_rank_byte_exact_and_give_every_extent_back(
        pool_name: str, rng: torch.Generator, residency_map: str) -> None:
    """Sharing on a shared pool: "b" is admitted on a retained prefix of "a" that ends inside
    an extent (its tail copied, by the writer only), and "a", decoding on, moves to a private
    copy of that extent at its next step (again copied by the writer only). Every rank reads
    every token's bytes, holds the same extents, page table (under host_row: the same alias
    key extents, whose host extents agree too) and gets every extent and alias back."""
    caches = group(pool_name, 2, residency_map=residency_map)
    L, W, E = caches[0].num_layers, caches[0].row_bytes, caches[0].extent_tokens
    kv = {r: random_bytes((L, 64, W), rng) for r in "ab"}
    on_all(caches, "admit", "a", 40)
    on_all(caches, "write_prefill", "a", kv["a"][:, :40])
    on_all(caches, "commit_prefill", "a")
    handles = on_all(caches, "retain_prefix", "a", 40)  # 40 = 2 extents + an 8-row tail
    assert handles[0].handle_id == handles[1].handle_id and repr(handles[0]) == repr(handles[1])
    for cache, handle in zip(caches, handles, strict=True):
        cache.admit("b", 50, prefix=handle)
    kv["b"][:, :40] = kv["a"][:, :40]  # b's first 40 tokens are a's
    on_all(caches, "write_prefill", "b", kv["b"][:, 40:50], start=40)
    on_all(caches, "commit_prefill", "b")
    lengths = {"a": 40, "b": 50}

    def step(ids: list[str]) -> None:
        top_k = torch.stack([torch.randperm(lengths[r] + 1, generator=rng)[:8]
                             for r in ids]).to(torch.int32)
        newest = torch.stack([kv[r][:, lengths[r]] for r in ids], dim=1)
        for rank_rows in decode(caches, ids, newest, top_k):
            for layer, rows in enumerate(rank_rows):
                for b, r in enumerate(ids):
                    assert torch.equal(rows[b], kv[r][layer, top_k[b].long()]), (r, layer)
        for r in ids:
            lengths[r] += 1

    tail = caches[0]._requests.get("a", "x").extents[2]  # the extent the handle's tail is in
    step(["a", "b"])  # a's next token lands in the retained tail's extent: a private copy
    records = [{r: c._requests.get(r, "x").extents for r in "ab"} for c in caches]
    assert records[0] == records[1] and records[0]["a"][2] != tail
    assert [c._pool.holders(tail) for c in caches] == [1, 1]  # the handle's alone now
    assert torch.equal(caches[0].tables.page_table, caches[1].tables.page_table)
    if residency_map == "host_row":
        assert caches[0]._requests.get("b", "x").aliases == (
            caches[1]._requests.get("b", "x").aliases) != ()
        assert torch.equal(caches[0].tables.key_host_extent, caches[1].tables.key_host_extent)
    assert caches[1].stats().occupancy == caches[0].stats().occupancy
    for _ in range(3):
        step(["a", "b"])
    for cache, handle in zip(caches, handles, strict=True):
        cache.release_prefix(handle)
    on_all(caches, "finish", "a")  # b keeps the two extents it shares
    step(["b"])
    rows = torch.from_numpy(token_rows(records[1]["b"], E, 0, lengths["b"]))
    for cache in caches:
        assert all(torch.equal(cache.host_tensors()[layer][rows], kv["b"][layer, :lengths["b"]])
                   for layer in range(L))
    on_all(caches, "finish", "b")
    assert [c._pool.allocator.free_extents for c in caches] == [c._pool.num_extents
                                                                 for c in caches]
    assert [c.stats().occupancy.alias_extents_used for c in caches] == [0, 0]
    assert caches[0]._shared.seq == caches[1]._shared.seq
    on_all(caches, "close")


def test_a_rank_that_retains_what_the_writer_did_not_fails_the_group(pool_name: str) -> None:
    writer, reader = group(pool_name, 2, residency_map="position")
    for cache in (writer, reader):
        cache.admit("a", 40)
        cache.write_prefill("a", torch.zeros(cache.num_layers, 40, cache.row_bytes,
                                             dtype=torch.uint8))
        cache.commit_prefill("a")
    writer.retain_prefix("a", 32)
    with pytest.raises(SharedPoolError, match=r"diverged from rank 0's at operation 4 "
                       r"\(retain_prefix \('a', 16\)\)"):
        reader.retain_prefix("a", 16)
    with pytest.raises(SharedPoolError, match="diverged"):
        writer.finish("a")
    writer.close()
    reader.close()


class NoSharingBackend(CpuBackend):
    name = "cpu-no-sharing"
    features = FeatureTable(dict(CPU_FEATURES) | {Feature.SHARED_HOST_POOL: unsupported(
        "this test's backend cannot share", "each rank keeps a private pool")})


def test_a_backend_that_cannot_share_warns_once_and_keeps_a_private_pool(
        pool_name: str, rng: torch.Generator) -> None:
    config = HiSparseConfig.from_preset("tiny", **CONFIG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = HiSparseCache(config, NoSharingBackend(),
                              shared_pool=SharedPoolSpec(pool_name, 1, 2))
    assert [w.category for w in caught] == [FeatureDisabledWarning]
    message = str(caught[0].message)
    assert "shared_host_pool is unsupported on the cpu-no-sharing backend" in message
    assert "each rank keeps a private pool" in message
    assert cache._shared is None and cache._pool.writes_rows
    kv = random_bytes((cache.num_layers, 20, cache.row_bytes), rng)
    cache.admit("r", 20)
    cache.write_prefill("r", kv)  # a private pool: this rank writes its own rows
    rows = torch.from_numpy(token_rows(cache._requests.get("r", "x").extents, 16, 0, 20))
    assert torch.equal(cache.host_tensors()[1][rows], kv[1])
    cache.close()


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_segment_whose_ranks_all_died_is_reclaimed(pool_name: str) -> None:
    """A group killed whole leaves its file; the next writer of that name reclaims it."""
    writer, reader = group(pool_name, 2)
    for cache in (writer, reader):
        # As SIGKILL leaves the slots:
        cache._pool.segment.slot(cache._shared.spec.rank)[shared_segment.S_PID] = dead_pid()
    fresh = group(pool_name, 2)
    assert fresh[0]._pool.segment.path == writer._pool.segment.path
    for cache in (writer, reader):  # the old group's closes leave the new file alone
        cache.close()
    assert os.path.exists(shared_segment.segment_path(pool_name))
    on_all(fresh, "close")


def test_a_dead_rank_fails_the_survivors(pool_name: str) -> None:
    writer, reader = group(pool_name, 2)
    writer._pool.segment.slot(0)[shared_segment.S_PID] = dead_pid()
    reader._shared._next_liveness = 0.0  # the next call checks now, not in 0.25 s
    with pytest.raises(SharedPoolError, match=r"rank 0 \(the writer, pid \d+\) of the group "
                       "exited without closing its cache"):
        reader.admit("a", 10)
    with pytest.raises(SharedPoolError, match="exited without closing"):
        writer.admit("a", 10)  # the pool stays failed, for every rank
    reader.close()
    writer.close()


def test_the_fake_cuda_runtime_registers_the_whole_mapping(
        pool_name: str, fake_env: object) -> None:
    """On CUDA each rank registers its own mapping of the segment, from its first page (where
    torch's is_pinned looks), once, and unregisters it when it closes."""
    from hisparse.core.shared_pool import open_segment
    from hisparse.core.shared_segment import SegmentLayout

    env = fake_env("cuda")  # type: ignore[operator]
    import hisparse

    backend = hisparse.get_backend("cuda")
    layout = SegmentLayout(2, 256, 64, 16, 2, 0)
    writer = open_segment(SharedPoolSpec(pool_name, 0, 2), backend, layout)
    reader = open_segment(SharedPoolSpec(pool_name, 1, 2), backend, layout)
    bases = {writer.mapping.data_ptr(), reader.mapping.data_ptr()}
    assert {b: s for b, (s, _) in env.cudart.registered.items()} == {
        b: layout.total_bytes for b in bases}
    for segment in (reader, writer):
        backend.unregister_host(segment.mapping, shared=True)
        segment.close()
    assert env.cudart.registered == {} and sorted(env.cudart.unregister_calls) == sorted(bases)


def test_decision_hashes_survive_many_operations(pool_name: str, rng: torch.Generator) -> None:
    """More operations than the hash ring holds, the writer a few ahead: no false alarm."""
    caches = group(pool_name, 2)
    order = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=rng)))
    for index in range(shared_segment.RING + 40):
        tokens = int(order.integers(1, 40))
        on_all(caches, "admit", index, tokens)
        on_all(caches, "abort", index)
    assert caches[0]._shared.seq == caches[1]._shared.seq == 2 * (shared_segment.RING + 40)
    on_all(caches, "close")


def test_ranks_that_close_early_neither_hang_nor_mislead_the_others(
        pool_name: str, rng: torch.Generator) -> None:
    """A reader that closed holds the writer back from nothing; a reader whose writer closed
    still reads what the writer wrote before, and gets a clear error, not a hang, at its
    first read of anything the writer did not write."""
    writer, early, late = group(pool_name, 3, host_pool_tokens=64, max_seq_len=64)
    kv = random_bytes((writer.num_layers, 64, writer.row_bytes), rng)
    for cache in (writer, early, late):
        cache.admit("a", 64)
        cache.write_prefill("a", kv)
        cache.commit_prefill("a")
    early.close()
    for cache in (writer, late):
        cache.finish("a")  # frees every row
        cache.admit("b", 64)
    writer.write_prefill("b", kv)  # rewrites the freed rows without waiting for `early`
    writer.close()
    late.write_prefill("b", kv)
    late.commit_prefill("b")  # the writer wrote these rows before it closed
    rows = torch.from_numpy(token_rows(late._requests.get("b", "x").extents, 16, 0, 64))
    assert torch.equal(late.host_tensors()[0][rows], kv[0])
    with pytest.raises(SharedPoolError, match=r"the writer \(rank 0\) closed its cache"):
        late.begin_decode_step(["b"])  # needs the writer's rows of operations it never made
    late.close()


def test_a_pool_larger_than_the_host_is_refused_and_leaves_no_file(
        pool_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from hisparse.errors import HostAllocationError

    monkeypatch.setattr(shared_segment, "available_host_bytes", lambda: 1 << 16)
    with pytest.raises(HostAllocationError, match=r"needs 110592 B .* only 65536 B \(0.06 MiB\) "
                       "of host memory is available; lower host_pool_tokens"):
        group(pool_name, 2)


def test_verify_steps_keep_every_rank_byte_exact(pool_name: str, rng: torch.Generator) -> None:
    """Speculative decoding on a shared pool: each verify step writes S drafts, keeps the
    same random `accepted` on every rank, and only the writer backs the kept tokens up; the
    next step's top-k reaches them on every rank through the host."""
    caches = group(pool_name, 2, max_draft_tokens=3, hot_slots=32)
    L, W, prompt, S = caches[0].num_layers, caches[0].row_bytes, 60, 3
    tokens = random_bytes((L, prompt + 12 * S, W), rng)
    on_all(caches, "admit", "r", prompt)
    on_all(caches, "write_prefill", "r", tokens[:, :prompt])
    on_all(caches, "commit_prefill", "r")
    length = prompt
    for _ in range(10):
        accepted = int(torch.randint(1, S + 1, (1,), generator=rng))
        picks = torch.stack([torch.randperm(length + s + 1, generator=rng)[:8]
                             for s in range(S)]).to(torch.int32)[None]  # [1, S, K]
        for cache in caches:
            step = cache.begin_decode_step(["r"], num_tokens=S)
            for layer in range(L):
                step.write_newest(layer, tokens[layer, length: length + S][None])
                rows = step.swap_in(layer, picks)
                got = cache.device_kv(layer)[rows[0].long()]
                assert torch.equal(got, tokens[layer][picks[0].long()]), (length, layer)
            step.end(accepted=[accepted])
        length += accepted  # the rejected drafts' rows are written again by the next step
    assert caches[1].stats().misses > 0  # the reader did read rows only the writer wrote
    on_all(caches, "close")
