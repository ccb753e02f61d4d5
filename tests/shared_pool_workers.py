"""Rank processes for tests/test_shared_pool_processes.py: the ordering check against a
writer whose backups land late, and the SIGKILL scenarios. Run through
`hisparse.tools.shared_pool_run.run_group`, one process per rank."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import torch

from fakes.delayed_writer import DelayedBackupBackend
from hisparse import HiSparseCache, HiSparseConfig
from hisparse.backends.cpu import CpuBackend
from hisparse.core.shared_pool import SharedPoolSpec
from hisparse.core.shared_segment import segment_path
from hisparse.errors import SharedPoolError
from hisparse.tools.shared_pool_run import kv_at, prompt_rows

CONFIG = dict(num_layers=2, top_k=4, hot_slots=8, index_group_size=1, max_requests=2,
              max_seq_len=256, host_pool_tokens=512, extent_tokens=16)
PROMPT = 24  # more tokens than hot slots: the previous token is read from the host


def _start(name: str, rank: int, ranks: int, backend: Any, **overrides: Any
           ) -> tuple[HiSparseCache, int]:
    config = HiSparseConfig.from_preset("tiny", **{**CONFIG, **overrides})
    cache = HiSparseCache(config, backend, shared_pool=SharedPoolSpec(
        name, rank, ranks, wait_timeout_s=20.0))
    cache.admit("r", PROMPT)
    cache.write_prefill("r", prompt_rows(1, 0, PROMPT, cache.num_layers, cache.row_bytes))
    cache.commit_prefill("r")
    return cache, PROMPT


def _step(cache: HiSparseCache, length: int, request: str = "r", seed: int = 1,
          picks: list[int] | None = None, origin: int = 1) -> int:
    """Decode token `length` of `request` (KV seed `seed`), asking for tokens `picks`
    (default: token `length - 1`, backed up by the step before), whose KV has seed
    `origin`: returns how many of their rows, over the layers, were not their bytes."""
    step = cache.begin_decode_step([request])
    picks = picks or [length - 1]
    top_k = torch.tensor([picks + [-1] * (cache.top_k - len(picks))], dtype=torch.int32)
    stale = 0
    for layer in range(cache.num_layers):
        step.write_newest(layer, torch.from_numpy(kv_at(np.array([seed]), np.array([length]),
                                                        layer, cache.row_bytes)))
        rows = step.swap_in(layer, top_k)
        for index, position in enumerate(picks):
            got = cache.device_kv(layer)[int(rows[0, index])]
            expected = kv_at(np.array(origin), np.array(position), layer, cache.row_bytes)
            stale += not np.array_equal(got.numpy(), expected)
    step.end()
    return stale


def ordering_rank(barrier: Any, name: str, rank: int, ranks: int, steps: int, delay_s: float,
                  skip_waits: bool = False, early_publish: bool = False) -> dict[str, Any]:
    """Rank 0's backups land `delay_s` late; rank 1 counts the stale rows it reads: with the
    read wait, without it (`skip_waits`), or with a writer that publishes its rows without
    waiting for its copies to complete (`early_publish`)."""
    backend = DelayedBackupBackend(delay_s) if rank == 0 else CpuBackend()
    cache, length = _start(name, rank, ranks, backend)
    cache._shared.skip_read_waits = skip_waits
    if early_publish and rank == 0:
        cache._shared.wrote = lambda stream=None: None  # publish at once, copies in flight
    barrier.wait()
    stale = 0
    for _ in range(steps):
        stale_here = _step(cache, length)
        stale += stale_here if rank else 0  # the writer reads its own late rows: not checked
        length += 1
    barrier.wait()
    cache.close()
    return {"rank": rank, "stale": stale}


def prefix_ordering_rank(barrier: Any, name: str, rank: int, ranks: int, delay_s: float,
                         skip_waits: bool = False) -> dict[str, Any]:
    """The copies prefix sharing makes, against a writer whose backups land `delay_s` late
    (so its copies of the rows they back up wait for them): rank 1 counts the stale rows it
    reads of an admit's boundary copy, and of a decoding request's private copy of the
    extent a retained prefix's tail holds, with or without (`skip_waits`) the read wait."""
    backend = DelayedBackupBackend(delay_s) if rank == 0 else CpuBackend()
    cache, length = _start(name, rank, ranks, backend, residency_map="position")
    cache._shared.skip_read_waits = skip_waits
    E = cache.extent_tokens
    _step(cache, length)  # token 24's backup lands late on the writer
    length += 1
    barrier.wait()
    # "s" is the first 25 tokens of "r": 16 shared, rows 16..24 copied by the writer once
    # the late backup landed; seeding "s" reads them (its hot rows) at once.
    cache.admit("s", length, prefix=("r", length))
    cache.commit_prefill("s")
    boundary = _step(cache, length, "s", 2, picks=[16, 18, 20, 24])
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
    private = _step(cache, 47, "p", 3, picks=[2 * E, 2 * E + 1, 2 * E + 2, 2 * E + 3],
                    origin=3)
    assert cache._requests.get("p", "x").extents[-1] != before  # the private copy
    barrier.wait()
    cache.close()
    return {"rank": rank, "boundary": boundary if rank else 0, "private": private if rank else 0}


def killed_rank(barrier: Any, name: str, rank: int, ranks: int, victim: int) -> dict[str, Any]:
    """Every rank decodes two steps; then `victim` dies by SIGKILL, and each survivor tries
    to go on: what it gets is reported."""
    cache, length = _start(name, rank, ranks, CpuBackend())
    for _ in range(2):
        _step(cache, length)
        length += 1
    barrier.wait()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.4)  # past LIVENESS_PERIOD_S: the next call checks the group
    outcome, stale = "no error", 0
    try:
        for _ in range(3):
            stale += _step(cache, length)
            length += 1
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

