"""Rank processes for tests/test_shared_pool_processes.py: the ordering check against a
writer whose backups land late, and the SIGKILL scenarios. Run through
`hisparse.tools.shared_pool_run.run_group`, one process per rank."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import torch

from fakes.gated_writer import OPEN_ALL, GatedBackupBackend, ReaderPosts, gate_reader, gate_writer
from hisparse import HiSparseCache, HiSparseConfig
from hisparse.backends.cpu import CpuBackend
from hisparse.core.shared_pool import SharedPoolSpec
from hisparse.core.shared_segment import segment_path
from hisparse.errors import SharedPoolError
from hisparse.tools.shared_pool_run import kv_at, prompt_rows

CONFIG = dict(num_layers=2, top_k=4, hot_slots=8, index_group_size=1, max_requests=2,
              max_seq_len=256, host_pool_tokens=512, extent_tokens=16, max_draft_tokens=2)
PROMPT = 24  # more tokens than hot slots: the previous token is read from the host


def _start(name: str, rank: int, ranks: int, backend: Any, liveness_period_s: float = 0.25,
           **overrides: Any) -> tuple[HiSparseCache, int]:
    config = HiSparseConfig.from_preset("tiny", **{**CONFIG, **overrides})
    cache = HiSparseCache(config, backend, shared_pool=SharedPoolSpec(
        name, rank, ranks, wait_timeout_s=20.0, liveness_period_s=liveness_period_s))
    cache.admit("r", PROMPT)
    cache.write_prefill("r", prompt_rows(1, 0, PROMPT, cache.num_layers, cache.row_bytes))
    cache.commit_prefill("r")
    return cache, PROMPT


def _step(cache: HiSparseCache, length: int, request: str = "r", seed: int = 1,
          picks: list[int] | None = None, origin: int = 1, mode: str = "single") -> tuple[int, int]:
    """Decode from token `length` of `request` (KV seed `seed`): one token (`mode` "single"),
    one with a de-duplicated top-k ("dedupe", its picks listed twice) or a verify step of two
    tokens, both accepted ("verify"). Asks for tokens `picks` (default: those the step before
    wrote, which only the host holds now), whose KV has seed `origin`. Returns how many of
    their rows, over the layers, were not their bytes, and the new length."""
    tokens = 2 if mode == "verify" else 1
    step = cache.begin_decode_step([request], num_tokens=tokens, dedupe=mode == "dedupe")
    picks = picks or ([length - 2, length - 1] if mode == "verify" else [length - 1])
    listed = picks * 2 if mode == "dedupe" else picks
    row = listed + [-1] * (cache.top_k - len(listed))
    top_k = torch.tensor([[row] * tokens if tokens > 1 else row], dtype=torch.int32)
    positions = np.arange(length, length + tokens)[None]
    stale = 0
    for layer in range(cache.num_layers):
        kv = torch.from_numpy(kv_at(np.full_like(positions, seed), positions, layer,
                                    cache.row_bytes))
        step.write_newest(layer, kv if tokens > 1 else kv[:, 0])
        rows = step.swap_in(layer, top_k).view(tokens, -1)
        for index, position in enumerate(listed):
            for s in range(tokens):
                got = cache.device_kv(layer)[int(rows[s, index])]
                expected = kv_at(np.array(origin), np.array(position), layer, cache.row_bytes)
                stale += not np.array_equal(got.numpy(), expected)
    after_reads = getattr(cache, "after_reads", None)
    if after_reads is not None:
        after_reads()
    step.end(accepted=[tokens] if tokens > 1 else None)
    return stale, length + tokens


def _gated(name: str, rank: int, ranks: int) -> tuple[Any, ReaderPosts]:
    """The rank's backend (the writer's backups gated on the readers' posts) and the posts."""
    posts = ReaderPosts(name, ranks - 1)
    return (GatedBackupBackend(posts) if rank == 0 else CpuBackend()), posts


def _gate(cache: HiSparseCache, posts: ReaderPosts, rank: int, early_publish: bool = False
          ) -> None:
    if rank == 0:
        gate_writer(cache)
    else:
        cache.after_reads = gate_reader(cache, posts, rank - 1, post_on_wait=not early_publish)


def _ungate(barrier: Any, posts: ReaderPosts, rank: int) -> None:
    """The end of a gated run: readers read no more, then the writer removes the posts."""
    if rank:
        posts.post(rank - 1, OPEN_ALL)
    barrier.wait()
    if rank == 0:
        posts.unlink()


def ordering_rank(barrier: Any, name: str, rank: int, ranks: int, steps: int,
                  mode: str = "single", skip_waits: bool = False,
                  early_publish: bool = False) -> dict[str, Any]:
    """Rank 0's backups land only once rank 1 has read past them or waits for them; rank 1
    counts the stale rows it reads: with the read wait, without it (`skip_waits`), or with
    a writer that publishes its rows without waiting for its copies (`early_publish`)."""
    backend, posts = _gated(name, rank, ranks)
    cache, length = _start(name, rank, ranks, backend)
    _gate(cache, posts, rank, early_publish)
    cache._shared.skip_read_waits = skip_waits
    if early_publish and rank == 0:
        cache._shared.wrote = lambda stream=None: None  # publish at once, copies in flight
    barrier.wait()
    stale = 0
    for _ in range(steps):
        stale_here, length = _step(cache, length, mode=mode)
        stale += stale_here if rank else 0  # the writer reads its own late rows: not checked
    _ungate(barrier, posts, rank)
    cache.close()
    return {"rank": rank, "stale": stale}


def prefix_ordering_rank(barrier: Any, name: str, rank: int, ranks: int,
                         skip_waits: bool = False) -> dict[str, Any]:
    """The copies prefix sharing makes, against a writer whose backups land only once the
    reader read past them or waits for them (so the writer's copies of the rows they back up
    wait for them too): rank 1 counts the stale rows it reads of an admit's boundary copy,
    and of a decoding request's private copy of the extent a retained prefix's tail holds,
    with or without (`skip_waits`) the read wait."""
    backend, posts = _gated(name, rank, ranks)
    cache, length = _start(name, rank, ranks, backend, residency_map="position")
    _gate(cache, posts, rank)
    cache._shared.skip_read_waits = skip_waits
    E = cache.extent_tokens
    _, length = _step(cache, length)  # token 24's backup lands late on the writer
    barrier.wait()
    # "s" is the first 25 tokens of "r": 16 shared, rows 16..24 copied by the writer once
    # the late backup landed; seeding "s" reads them (its hot rows) at once.
    cache.admit("s", length, prefix=("r", length))
    cache.commit_prefill("s")
    boundary, _ = _step(cache, length, "s", 2, picks=[16, 18, 20, 24])
    barrier.wait()
    for request in ("r", "s"):
        cache.finish(request)
    # "p": 46 tokens, its last extent's rows 32..45 more than the hot slots hold, so that
    # a swap-in of rows 32..35 reads the host through the page table.
    cache.admit("p", 46)
    cache.write_prefill("p", prompt_rows(3, 0, 46, cache.num_layers, cache.row_bytes))
    cache.commit_prefill("p")
    _step(cache, 46, "p", 3, origin=3)  # token 46's backup lands late
    barrier.wait()
    cache.retain_prefix("p", 47)  # its tail is in p's last extent: p copies before writing
    before = cache._requests.get("p", "x").extents[-1]
    private, _ = _step(cache, 47, "p", 3, picks=[2 * E, 2 * E + 1, 2 * E + 2, 2 * E + 3],
                       origin=3)
    assert cache._requests.get("p", "x").extents[-1] != before  # the private copy
    _ungate(barrier, posts, rank)
    cache.close()
    return {"rank": rank, "boundary": boundary if rank else 0, "private": private if rank else 0}


def killed_rank(barrier: Any, name: str, rank: int, ranks: int, victim: int) -> dict[str, Any]:
    """Every rank decodes two steps; then `victim` dies by SIGKILL, and each survivor tries
    to go on, every operation checking the group, until a call fails or the request is full
    (the victim may take a moment to die): what it gets is reported."""
    cache, length = _start(name, rank, ranks, CpuBackend(), liveness_period_s=0.0)
    for _ in range(2):
        _, length = _step(cache, length)
    barrier.wait()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    outcome, stale = "no error", 0
    try:
        while length + 2 < cache.max_seq_len:
            stale_here, length = _step(cache, length)
            stale += stale_here
    except SharedPoolError as exc:
        outcome = str(exc)
    cache.close()
    return {"rank": rank, "outcome": outcome, "stale": stale,
            "exists_after_close": os.path.exists(segment_path(name))}


def all_killed_rank(barrier: Any, name: str, rank: int, ranks: int) -> dict[str, Any]:
    """Attach, then die without closing: the whole group is gone, its file left behind."""
    _start(name, rank, ranks, CpuBackend())
    barrier.wait()
    os.kill(os.getpid(), signal.SIGKILL)
    return {}



def gated_fuzz_rank(barrier: Any, name: str, rank: int, ranks: int, seed: int, steps: int,
                    overrides: dict[str, Any], gate_share: float) -> dict[str, Any]:
    """One rank of the combination fuzz on CPU whose writer's backups land late at random
    (`gate_share` of them only once every reader has read past them or waits for them), so
    that any wait missing anywhere shows up as a mismatch on a reader."""
    from hisparse.tools.combination_fuzz import FUZZ_CONFIG, FuzzRank
    from hisparse.tools.shared_pool_run import _cache

    posts = ReaderPosts(name, ranks - 1)
    backend = GatedBackupBackend(posts, gate_share, seed) if rank == 0 else CpuBackend()
    cache = _cache(name, rank, ranks, backend, {**FUZZ_CONFIG, **overrides})
    after_reads = None
    if rank == 0:
        gate_writer(cache)
    else:
        after_reads = gate_reader(cache, posts, rank - 1)
    barrier.wait()
    try:
        fuzz = FuzzRank(cache, seed, writer=rank == 0, after_reads=after_reads)
        fuzz.checks_reads = rank != 0  # the fake's late copies have no stream order
        counts = fuzz.run(steps)
    finally:
        _ungate(barrier, posts, rank)
        cache.close()
    details = {"mismatch_details": fuzz.mismatch_details} if fuzz.mismatch_details else {}
    return {**counts, "rank": rank, **details}
