"""Multi-process runs of one shared host pool: running a group, and the memory measurement
that tests/test_shared_pool_processes.py and benchmarks/shared_pool.py drive (the fuzz is in
hisparse.tools.combination_fuzz, the per-step timing in hisparse.tools.shared_pool_timing).

Every rank of a group is a process of its own (a forkserver child that has torch imported
already) and runs the same seeded schedule of cache calls, as the ranks of a tensor-parallel
group run one scheduler's output. The KV of token `p` of a request is a pure function of the
request's seed, `p` and the layer (`kv_at`), so every rank knows what each row must hold
without the rows ever crossing a pipe: what a non-writing rank finds can only have come
through the shared pool.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hisparse.errors import SharedPoolError

_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)


def kv_at(seeds: np.ndarray, positions: np.ndarray, layer: int, row_bytes: int) -> np.ndarray:
    """uint8 `[*shape, W]`: the row of token `positions` of the requests with `seeds`, in
    `layer` (a splitmix64 of the four, per byte)."""
    with np.errstate(over="ignore"):
        x = (np.asarray(seeds, np.uint64)[..., None] * np.uint64(_MIX[0])
             + np.asarray(positions, np.uint64)[..., None] * np.uint64(_MIX[1])
             + np.uint64(layer) * np.uint64(_MIX[2])
             + np.arange(row_bytes, dtype=np.uint64) * np.uint64(_MIX[3]))
        x ^= x >> np.uint64(30)
        x *= np.uint64(_MIX[1])
        x ^= x >> np.uint64(27)
        x *= np.uint64(_MIX[2])
        x ^= x >> np.uint64(31)
    return (x & np.uint64(0xFF)).astype(np.uint8)


def prompt_rows(seed: int, start: int, stop: int, num_layers: int, row_bytes: int
                ) -> torch.Tensor:
    """`[L, stop - start, W]` uint8: a request's rows of tokens start..stop-1."""
    positions = np.arange(start, stop)
    seeds = np.full_like(positions, seed)
    return torch.from_numpy(np.stack([kv_at(seeds, positions, layer, row_bytes)
                                      for layer in range(num_layers)]))


# --- running a group ------------------------------------------------------------------------
def run_group(target: Callable[..., dict[str, Any]], ranks_args: list[dict[str, Any]],
              timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run `target(barrier=..., **args)` in one process per entry; their results, in order.

    A rank that raises reports `{"error": ...}`; one that dies (SIGKILL) reports
    `{"exitcode": -9}`; none is left running after the timeout.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "hisparse.core.engine"])
    queue, barrier = context.Queue(), context.Barrier(len(ranks_args))
    processes = [context.Process(target=_entry, args=(target, index, args, queue, barrier),
                                 daemon=True) for index, args in enumerate(ranks_args)]
    for process in processes:
        process.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < len(processes) and time.monotonic() < deadline:
        try:
            index, result = queue.get(timeout=0.1)
            results[index] = result
        except Exception:  # queue.Empty: see whether a rank died without a word
            for index, process in enumerate(processes):
                if index not in results and process.exitcode not in (None, 0):
                    results[index] = {"exitcode": process.exitcode}
    for index, process in enumerate(processes):
        process.join(timeout=max(0.1, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
        results.setdefault(index, {"exitcode": process.exitcode, "error": "timed out"})
    return [results[index] for index in range(len(processes))]


def _entry(target: Callable[..., dict[str, Any]], index: int, args: dict[str, Any],
           queue: Any, barrier: Any) -> None:
    torch.set_num_threads(1)  # ranks share the host's cores, as a node's ranks do
    try:
        result = target(barrier=barrier, **args)
    except BaseException as exc:  # reported to the parent, which asserts on it
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    queue.put((index, result))


def _cache(name: str | None, rank: int, ranks: int, device: str,
           overrides: dict[str, Any]) -> Any:
    from hisparse import HiSparseCache, HiSparseConfig
    from hisparse.core.shared_pool import SharedPoolSpec

    config = HiSparseConfig.from_preset("tiny", **overrides)
    spec = SharedPoolSpec(name, rank, ranks, wait_timeout_s=60.0) if name else None
    return HiSparseCache(config, device=device, shared_pool=spec)



# --- memory ---------------------------------------------------------------------------------
def memory_status() -> dict[str, int]:
    """This process's resident memory, in bytes: private (RssAnon), shared-memory pages it
    maps (RssShmem), and its proportional share of everything (Pss)."""
    found: dict[str, int] = {}
    for path, keys in (("/proc/self/status", ("RssAnon", "RssShmem", "VmRSS")),
                       ("/proc/self/smaps_rollup", ("Pss",))):
        try:
            with open(path) as handle:
                for line in handle:
                    key, _, value = line.partition(":")
                    if key in keys:
                        found[key] = int(value.split()[0]) * 1024
        except OSError:
            continue
    return found


def memory_rank(barrier: Any, name: str | None, rank: int, ranks: int, pool_tokens: int,
                device: str = "cpu", layers: int = 4) -> dict[str, Any]:
    """Build a rank's cache of `pool_tokens` rows per layer, fill the whole pool (the
    writer, or every rank on a private pool) and touch every row on the others; report the
    memory before and after."""
    overrides = dict(num_layers=layers, host_pool_tokens=pool_tokens, max_requests=8,
                     max_seq_len=pool_tokens)
    writer = name is None or rank == 0
    if device != "cpu":
        # The runtime's own host memory is not the pool's: a GPU runtime grows by hundreds of
        # MiB as it loads the kernels a fill runs, so a small private cache runs them first.
        warm = _cache(None, rank, ranks, device, dict(overrides, host_pool_tokens=4096,
                                                      max_seq_len=4096))
        _fill(warm, True)
        warm.close()
    before = memory_status()
    barrier.wait()
    cache = _cache(name, rank, ranks, device, overrides)
    barrier.wait()
    _fill(cache, writer)
    checksum = sum(int(layer.sum()) for layer in cache.host_tensors())  # every page touched
    after = memory_status()
    barrier.wait()
    segment = cache._pool.segment
    shm_bytes = os.fstat(segment._fd).st_blocks * 512 if segment is not None else 0
    pool_bytes = cache.num_layers * cache._pool.num_rows * cache.row_bytes
    barrier.wait()
    cache.close()
    return {"rank": rank, "before": before, "after": after, "shm_bytes": shm_bytes,
            "pool_bytes": pool_bytes, "checksum": checksum,
            "private_delta": after.get("RssAnon", 0) - before.get("RssAnon", 0)}


def _fill(cache: Any, writer: bool, chunk: int = 1024) -> None:
    """Admit four requests that fill the pool and offload their prompts in chunks (few
    temporaries to measure); a reader writes nothing, but makes the same calls."""
    request_tokens = cache._pool.num_rows // 4
    blank = torch.zeros(cache.num_layers, chunk, cache.row_bytes, dtype=torch.uint8)
    for request in range(4):
        cache.admit(request, request_tokens)
        for start in range(0, request_tokens, chunk):
            stop = min(start + chunk, request_tokens)
            rows = (prompt_rows(request, start, stop, cache.num_layers, cache.row_bytes)
                    if writer else blank[:, : stop - start])
            cache.write_prefill(request, rows.to(cache.device), start=start)
        cache.commit_prefill(request)


def describe_failure(results: list[dict[str, Any]]) -> str:
    """The first rank's error (with its traceback) in a result list, for an assert message."""
    for result in results:
        if "error" in result:
            return f"rank error: {result['error']}\n{result.get('traceback', '')}"
    return ""


__all__ = ["SharedPoolError", "describe_failure", "kv_at", "memory_rank", "memory_status",
           "prompt_rows", "run_group"]
