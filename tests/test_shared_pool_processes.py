"""One host pool shared by tensor-parallel ranks (issue 23), each rank a process of its own.

The ranks are forkserver children (torch imported once), driven by
`hisparse.tools.shared_pool_run.run_group`; each derives every row it expects from seeds
(`kv_at`), so what a non-writing rank reads can only have come through the shared pool.
CI runs these on CPU; `--backend cuda` adds the GPU variants (several ranks on one GPU).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import shared_pool_workers as workers
from hisparse.core.shared_segment import segment_path
from hisparse.tools.combination_fuzz import FUZZ_CONFIG, FuzzRank, fuzz_rank
from hisparse.tools.shared_pool_run import _cache, describe_failure, memory_rank, run_group
from hisparse.tools.shared_pool_timing import PHASES, _shared_first, paired_rank, paired_summary

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA GPU (several ranks share one)")


def ranks_of(name: str, ranks: int, **args: object) -> list[dict[str, object]]:
    return [dict(name=name, rank=rank, ranks=ranks, **args) for rank in range(ranks)]


@pytest.mark.parametrize("mode", ["single", "dedupe", "verify"])
@pytest.mark.parametrize("broken", [None, "skip_waits", "early_publish"])
def test_a_reader_reads_the_writers_late_rows_only_through_the_wait(
        pool_name: str, broken: str | None, mode: str) -> None:
    """The writer's backups land only once the reader has read past them or waits for them
    (tests/fakes/gated_writer.py). A reader that skips the wait on the writer's published
    sequence, or a writer that publishes before its copies have landed, reads the rows the
    step before wrote stale, every time; with both rules kept, never: for single-token,
    de-duplicated and verify steps alike."""
    flags = {broken: True} if broken else {}
    results = run_group(workers.ordering_rank, ranks_of(
        pool_name, 2, steps=4, mode=mode, **flags), timeout_s=120)
    assert not describe_failure(results), describe_failure(results)
    stale = results[1]["stale"]
    assert (stale > 0) if broken else (stale == 0), stale


@pytest.mark.parametrize("broken", [False, True], ids=["waits", "skip_waits"])
def test_a_reader_reads_the_writers_prefix_copies_only_through_the_wait(
        pool_name: str, broken: bool) -> None:
    """Prefix sharing's host copies (an admit's boundary tail, a decoding request's private
    copy) are the writer's alone, made once the late backups of their rows have landed: a
    reader that skips the wait on the writer's published sequence reads both stale."""
    results = run_group(workers.prefix_ordering_rank, ranks_of(
        pool_name, 2, skip_waits=broken), timeout_s=120)
    assert not describe_failure(results), describe_failure(results)
    stale = results[1]
    assert (stale["boundary"] > 0 and stale["private"] > 0) if broken else (
        stale["boundary"] == stale["private"] == 0), stale


@pytest.mark.parametrize("victim", [0, 2], ids=["writer", "reader"])
def test_a_rank_killed_by_sigkill_fails_the_survivors_and_leaks_nothing(
        pool_name: str, victim: int) -> None:
    results = run_group(workers.killed_rank, ranks_of(pool_name, 3, victim=victim),
                        timeout_s=120)
    assert results[victim] == {"exitcode": -9}
    role = "the writer" if victim == 0 else "a reader"
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        assert not describe_failure([result]), describe_failure([result])
        assert f"rank {victim} ({role}, pid " in result["outcome"], result
        assert "exited without closing its cache" in result["outcome"]
        assert result["stale"] == 0  # no wrong row before the error
    assert not os.path.exists(segment_path(pool_name))  # the last survivor unlinked it


def test_a_group_killed_whole_is_reclaimed_by_the_next_writer(pool_name: str) -> None:
    results = run_group(workers.all_killed_rank, ranks_of(pool_name, 2), timeout_s=120)
    assert results == [{"exitcode": -9}] * 2
    assert os.path.exists(segment_path(pool_name))  # nobody was left to unlink it
    from hisparse import HiSparseCache, HiSparseConfig
    from hisparse.core.shared_pool import SharedPoolSpec

    config = HiSparseConfig.from_preset("tiny", **workers.CONFIG)
    HiSparseCache(config, "cpu", shared_pool=SharedPoolSpec(pool_name, 0, 2)).close()
    assert not os.path.exists(segment_path(pool_name))


def test_a_group_killed_whole_comes_back_whichever_rank_starts_first(
        pool_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the whole group is killed, a reader that starts before the new writer does not
    join the dead pool (the writer could then not reclaim the name): it waits, and joins the
    writer's new pool; both then decode and the reader reads the writer's rows."""
    import threading

    from hisparse import HiSparseCache, HiSparseConfig
    from hisparse.core import shared_segment
    from hisparse.core.shared_pool import SharedPoolSpec

    results = run_group(workers.all_killed_rank, ranks_of(pool_name, 2), timeout_s=120)
    assert results == [{"exitcode": -9}] * 2 and os.path.exists(segment_path(pool_name))
    passed_over = threading.Event()
    not_joinable = shared_segment._not_joinable

    def noting(fd: int, path: str) -> str | None:
        reason = not_joinable(fd, path)
        if reason is not None:
            passed_over.set()
        return reason

    monkeypatch.setattr(shared_segment, "_not_joinable", noting)
    config = HiSparseConfig.from_preset("tiny", **workers.CONFIG)
    caches: dict[int, object] = {}

    def start_reader() -> None:
        try:
            caches[1] = HiSparseCache(config, "cpu", shared_pool=SharedPoolSpec(
                pool_name, 1, 2, attach_timeout_s=30))
        except BaseException as exc:  # reported below
            caches[1] = exc

    reader = threading.Thread(target=start_reader)
    reader.start()
    while not passed_over.is_set() and reader.is_alive():
        passed_over.wait(0.01)
    assert passed_over.is_set(), f"the reader joined the dead pool: {caches.get(1)!r}"
    writer = HiSparseCache(config, "cpu", shared_pool=SharedPoolSpec(pool_name, 0, 2))
    reader.join()
    assert isinstance(caches[1], HiSparseCache), caches[1]
    group = [writer, caches[1]]
    rows = workers.prompt_rows(1, 0, workers.PROMPT, writer.num_layers, writer.row_bytes)
    for cache in group:  # the same calls on both ranks, in turn (one thread: no waits block)
        cache.admit("r", workers.PROMPT)
        cache.write_prefill("r", rows)
        cache.commit_prefill("r")
    stale = [workers._step(cache, workers.PROMPT)[0] for cache in group]
    assert stale == [0, 0]
    for cache in reversed(group):
        cache.close()


def check_memory(name: str | None, ranks: int, device: str, pool_tokens: int = 1 << 17
                 ) -> list[dict[str, object]]:
    results = run_group(memory_rank, [dict(name=name, rank=r, ranks=ranks, device=device,
                                           pool_tokens=pool_tokens) for r in range(ranks)],
                        timeout_s=180)
    assert not describe_failure(results), describe_failure(results)
    return results


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_group_holds_one_pool_in_host_memory(pool_name: str, ranks: int) -> None:
    """n ranks: one pool's worth of shared memory and almost nothing private each; n private
    pools (today) take n pools of private memory."""
    shared = check_memory(pool_name, ranks, "cpu")
    pool = shared[0]["pool_bytes"]  # 4 layers x 128k rows x 64 B = 32 MiB
    assert {r["checksum"] for r in shared} == {shared[0]["checksum"]} != {0}
    assert pool <= shared[0]["shm_bytes"] <= pool + (1 << 20)
    assert all(r["private_delta"] < pool // 8 for r in shared), [r["private_delta"]
                                                               for r in shared]
    private = check_memory(None, 2, "cpu")
    assert all(r["private_delta"] > 0.9 * pool for r in private)


@pytest.mark.parametrize("residency_map", ["host_row", "position"])
def test_multi_process_fuzz_with_shared_prefixes_is_byte_exact_and_leaks_nothing(
        pool_name: str, residency_map: str) -> None:
    """The fuzz with prefix sharing on (host_row through alias key extents, or position):
    retains and releases, admits and PD reservations on a retained prefix or a live
    request's first tokens, random finish order, preempt/resume, cancel, and decoding
    requests sent to a private copy of a retained tail's extent. Both ranks read every
    token's bytes (their origin's, across the prefix), and once everything is released every
    extent is free again on both."""
    # A private copy needs a retained prefix that ends inside a decoding request's last
    # extent, which a seed's 300 steps miss now and then: a run that misses a path is
    # checked like the others and followed by one with a fresh seed, up to three.
    paths = ("retains", "releases", "shared_admits", "private_copies")
    for _run in range(3):
        seed = int(torch.randint(0, 2**31, (1,)))
        results = run_group(fuzz_rank, ranks_of(pool_name, 2, seed=seed, steps=300,
                                                overrides=dict(residency_map=residency_map)),
                            timeout_s=240)
        assert not describe_failure(results), describe_failure(results)
        counts = [{k: v for k, v in r.items() if k not in ("rank", "seconds")}
                  for r in results]
        assert counts[0] == counts[1], (seed, counts)
        assert counts[0]["mismatches"] == counts[0]["leaked_extents"] == 0, (seed, counts)
        if min(counts[0][k] for k in paths) > 0:
            break
    assert min(counts[0][k] for k in paths) > 0, (seed, counts)


def test_paired_timing_times_a_reader_of_the_shared_pool_against_its_own_private_cache(
        pool_name: str) -> None:
    """benchmarks/shared_pool.py's `timing_paired`, small: every rank of the group times a
    step on its shared cache and one on a private cache of its own, each step. The reader's
    shared cache is attached to the pool and holds the writer's prompt rows (it prefilled
    blank ones); its private one is not; every per-step ratio is a positive finite number."""
    steps = 5
    results = run_group(paired_rank, ranks_of(
        pool_name, 2, steps=steps, batch=2, warmup=2,
        overrides=dict(num_layers=2, max_seq_len=512, host_pool_tokens=1024)), timeout_s=120)
    assert not describe_failure(results), describe_failure(results)
    for result in results:
        for which in ("shared", "private"):
            samples = result[which]
            assert len(samples["host_us"]) == len(samples["busy_us"]) == steps
            assert samples["device_ms"] == []  # (on a GPU only)
            for step in range(steps):  # begin, the layers and end make up the step
                parts = sum(samples[phase][step] for phase in PHASES)
                assert 0 < parts <= samples["host_us"][step] * (1 + 1e-9), (which, step)
    summary = paired_summary(results)
    reader, writer = summary["ranks"][1], summary["ranks"][0]
    assert (reader["writer"], writer["writer"]) == (False, True)
    assert reader["shared_pool_attached"] and reader["prompt_rows_from_writer"]
    assert not reader["private_pool_shared"] and not writer["private_pool_shared"]
    for stats in (summary["non_writer"], summary["writer"], reader, writer):
        assert stats["steps"] == steps and "device" not in stats
        for metric in ("host", "host_busy"):
            numbers = [stats[metric]["ratio_median"], *stats[metric]["ratio_quartiles"],
                       stats[metric]["shared_median"], stats[metric]["private_median"]]
            assert all(math.isfinite(n) and n > 0 for n in numbers), stats


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_paired_timing_puts_each_cache_first_equally_often_at_every_place_in_the_rotation(
        ranks: int) -> None:
    """A paired rank's place in its group's rotation moves on by one a step; the cache it
    times first must not follow it (every other step would make the reader's shared step
    always the one after the other process's turn, the cold one, with 2 ranks)."""
    for rank in range(ranks):
        seen = [((rank + step) % ranks, _shared_first(step, ranks)) for step in range(2 * ranks)]
        assert sorted(seen) == sorted((place, first) for place in range(ranks)
                                      for first in (False, True)), (rank, seen)


@requires_cuda
@pytest.mark.parametrize("residency_map", ["host_row", "position"])  # both: with sharing
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_fuzz_with_ranks_sharing_one_gpu(pool_name: str, ranks: int,
                                             residency_map: str) -> None:
    results = run_group(fuzz_rank, ranks_of(pool_name, ranks, seed=ranks, steps=2500,
                                            device="cuda",
                                            overrides=dict(residency_map=residency_map)),
                        timeout_s=580)
    assert not describe_failure(results), describe_failure(results)
    assert all(r["mismatches"] == 0 and r["steps"] == 2500 for r in results), results
    assert all(r["leaked_extents"] == 0 and r["shared_admits"] > 0 for r in results), results
    assert all(0 < r["folded_steps"] < r["steps"] for r in results), results


@requires_cuda
@pytest.mark.parametrize("ranks", [2, 4])
def test_gpu_group_holds_one_registered_pool(pool_name: str, ranks: int) -> None:
    """On one GPU: each rank's private growth is a pool smaller than with private pools
    (the device runtime's own host memory is in both), and the segment is one pool."""
    shared = check_memory(pool_name, ranks, "cuda", pool_tokens=1 << 20)
    private = check_memory(None, ranks, "cuda", pool_tokens=1 << 20)
    pool = shared[0]["pool_bytes"]  # 256 MiB
    assert pool <= shared[0]["shm_bytes"] <= pool + (1 << 20)
    assert {r["checksum"] for r in shared} == {shared[0]["checksum"]} != {0}
    worst_shared = max(r["private_delta"] for r in shared)
    least_private = min(r["private_delta"] for r in private)
    assert worst_shared < least_private - 0.8 * pool, (worst_shared, least_private, pool)


def test_a_fuzz_mismatch_is_reported_with_where_it_was_and_the_actions_before_it() -> None:
    """A host row changed behind the cache's back fails the fuzz's final check, which says
    which layer, position and host row, at which step, after which actions."""
    cache = _cache(None, 0, 1, "cpu", FUZZ_CONFIG)
    try:
        fuzz = FuzzRank(cache, int(torch.randint(0, 2**31, (1,))), writer=True)
        for _ in range(3):
            fuzz.admit()
        for _ in range(6):
            fuzz.decode()
        fuzz.check_host_rows()
        assert fuzz.counts["mismatches"] == 0 and not fuzz.mismatch_details
        request = next(r for r, n in fuzz.length.items() if n > 0)
        extents = cache._requests.get(request, "check").extents
        host_row = extents[0] * cache.extent_tokens  # the request's token 0
        cache.host_tensors()[1][host_row] ^= 0xFF
        fuzz.check_host_rows()
    finally:
        cache.close()
    assert fuzz.counts["mismatches"] >= 1
    report = fuzz.mismatch_details[0]
    assert (report["where"], report["layer"], report["position"]) == (
        "host rows at the end", 1, 0)
    assert report["host_row"] == host_row and report["step"] == fuzz.counts["steps"] == 6
    assert report["recent"] and all(isinstance(s, int) for s, _ in report["recent"])
