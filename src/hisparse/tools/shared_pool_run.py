"""Multi-process runs of one shared host pool: the fuzz and the memory measurement that
tests/test_shared_pool_processes.py and benchmarks/shared_pool.py drive (the per-step timing
is in hisparse.tools.shared_pool_timing).

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
import random
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hisparse.core.host_pool import token_rows
from hisparse.errors import PoolExhaustedError, SharedPoolError

# The fuzz's cache: short extents and a tight pool, so requests span extents, the pool runs
# out now and then, and most requests are long (more tokens than hot slots): their swap-ins
# read host rows.
FUZZ_CONFIG: dict[str, Any] = dict(
    num_layers=3, row_bytes_by_dtype={"fp8": 32, "bf16": 64}, top_k=8, hot_slots=16,
    index_group_size=1, max_requests=8, max_seq_len=160, host_pool_tokens=1024,
    extent_tokens=16, validate=True)
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


# --- the fuzz -------------------------------------------------------------------------------
# Where a request's (or a retained prefix's) KV comes from: `(end, seed)` runs in order,
# token `p` being the row of `seed` for the first run with `p < end`. A request admitted on
# an n-token prefix has its source's runs cut at n, then its own seed to the end.
Origin = tuple[tuple[int, int], ...]
_NO_END = 1 << 40


def seeds_at(origin: Origin, positions: np.ndarray) -> np.ndarray:
    """The KV seed of each of `positions` (any shape) of a holder of `origin`."""
    ends = np.array([end for end, _ in origin], dtype=np.int64)
    seeds = np.array([seed for _, seed in origin], dtype=np.int64)
    return seeds[np.searchsorted(ends, positions, side="right")]


def cut(origin: Origin, num_tokens: int) -> Origin:
    """The runs of the first `num_tokens` tokens."""
    kept, start = [], 0
    for end, seed in origin:
        if start >= num_tokens:
            break
        kept.append((min(end, num_tokens), seed))
        start = end
    return tuple(kept)


class FuzzRank:
    """One rank's run of the seeded schedule, checking every row it reads.

    Where the cache can share (`residency_map: position`, or host_row with alias key
    extents: `alias_extents > 0`) it shares prefixes too (`retain_prefix`, `release_prefix`,
    `admit` and `reserve_host_slots` on a retained prefix or on a live request's first
    tokens); a retained prefix that ends inside a running request's last extent sends that
    request to a private copy at its next decode step (counted as `private_copies`). Alias
    key extents that run out are refused like a full pool, alike on every rank."""

    MAX_HANDLES = 4  # retained at once: the tight pool must still admit

    def __init__(self, cache: Any, seed: int, writer: bool, folded: float = 0.5) -> None:
        self.folded = folded  # the share of steps that hand the new rows to swap_in
        self.cache, self.writer = cache, writer
        self.rng = random.Random(seed)
        self.L, self.W = cache.num_layers, cache.row_bytes
        config = cache.config
        self.sharing = config.residency_map == "position" or config.alias_extents > 0
        self.seeds: dict[int, int] = {}  # request id -> its own KV seed
        self.origin: dict[int, Origin] = {}  # request id -> where each token's KV comes from
        self.length: dict[int, int] = {}  # tokens so far
        self.state: dict[int, str] = {}  # running / preempted / reserved
        self.handles: list[tuple[Any, Origin]] = []  # retained prefixes, oldest first
        self.next_id = 0
        self.counts = dict(steps=0, cancels=0, checked_rows=0, mismatches=0, admits=0, pd=0,
                           finishes=0, aborts=0, preempts=0, resumes=0, exhausted=0,
                           folded_steps=0)
        # For a mismatch's report: the last actions, and the first mismatches themselves.
        self.recent: deque[tuple[int, str]] = deque(maxlen=16)
        self.mismatch_details: list[dict[str, Any]] = []
        if self.sharing:
            self.counts.update(retains=0, releases=0, shared_admits=0, private_copies=0,
                               leaked_extents=0)

    def ids(self, state: str) -> list[int]:
        return [r for r, s in self.state.items() if s == state]

    def run(self, steps: int) -> dict[str, Any]:
        actions = [(self.admit, 3), (self.pd, 2), (self.finish, 1), (self.abort, 1),
                   (self.preempt, 1), (self.resume, 2), (self.decode, 12)]
        if self.sharing:
            actions += [(self.retain, 2), (self.release, 1)]
        while self.counts["steps"] < steps:
            action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
            self.recent.append((self.counts["steps"], action.__name__))
            try:
                action()
            except PoolExhaustedError:
                self.counts["exhausted"] += 1  # the same on every rank: nothing changed
        self.check_host_rows()
        if self.sharing:
            self.give_everything_back()
        return self.counts

    def _new(self, tokens: int, prefix: tuple[Any, int, Origin] | None = None) -> int:
        request = self.next_id
        self.next_id += 1
        seed = self.seeds[request] = self.rng.getrandbits(40)
        self.origin[request] = (prefix[2] if prefix else ()) + ((_NO_END, seed),)
        self.length[request] = tokens
        return request

    def _forget(self, request: int) -> None:
        for table in (self.seeds, self.origin, self.length, self.state):
            table.pop(request, None)

    def _prefix(self) -> tuple[Any, int, Origin] | None:
        """Half the time (when sharing): `(prefix=, its tokens, its origin)` of a retained
        prefix or of the first tokens of a running or preempted request."""
        sources = self.ids("running") + self.ids("preempted")
        if not self.sharing or self.rng.random() < 0.5 or not (sources or self.handles):
            return None
        if self.handles and (not sources or self.rng.random() < 0.5):
            handle, origin = self.rng.choice(self.handles)
            return handle, handle.num_tokens, origin
        source = self.rng.choice(sources)
        tokens = self.rng.randint(1, self.length[source])
        return (source, tokens), tokens, cut(self.origin[source], tokens)

    def _new_length(self, prefix: tuple[Any, int, Origin] | None) -> int:
        first = prefix[1] if prefix else 0
        return min(self.cache.max_seq_len, first + self.rng.randint(0 if first else 1, 48))

    def admit(self) -> None:
        prefix = self._prefix()
        tokens = self._new_length(prefix)
        request = self._new(tokens, prefix)
        try:
            self.cache.admit(request, tokens, prefix=prefix[0] if prefix else None)
        except PoolExhaustedError:
            self._forget(request)
            raise
        first = prefix[1] if prefix else 0  # the prefix's rows are in the pool already
        rows = prompt_rows(self.seeds[request], first, tokens, self.L, self.W)
        split = self.rng.randint(first, tokens)  # in two calls, as a chunked prefill writes
        # From the device, as a prefill's KV comes (on CPU that is the host).
        rows = rows.to(self.cache.device)
        if split > first:
            self.cache.write_prefill(request, rows[:, : split - first], start=first)
        if split < tokens:
            self.cache.write_prefill(request, rows[:, split - first:], start=split)
        self.cache.commit_prefill(request)
        self.state[request] = "running"
        self.counts["admits"] += 1
        if prefix:
            self.counts["shared_admits"] += 1

    def pd(self) -> None:
        """A PD transfer: every rank reserves the rows; the transfer engine writes only the
        writer's reservation; every rank then completes."""
        prefix = self._prefix()
        tokens = self._new_length(prefix)
        request = self._new(tokens, prefix)
        try:
            reservation = self.cache.reserve_host_slots(
                request, tokens, prefix=prefix[0] if prefix else None)
        except PoolExhaustedError:
            self._forget(request)
            raise
        self.state[request] = "reserved"
        if self.writer:
            rows = prompt_rows(self.seeds[request], reservation.prefix_tokens, tokens, self.L,
                               self.W)
            index = torch.from_numpy(reservation.rows)
            for layer, host in enumerate(reservation.host_tensors):
                host[index] = rows[layer]
        self.cache.complete_transfer(request)  # no free slot: it stays reserved
        self.state[request] = "running"
        self.counts["pd"] += 1

    def retain(self) -> None:
        sources = self.ids("running") + self.ids("preempted")
        if len(self.handles) >= self.MAX_HANDLES or not (sources or self.handles):
            return
        if self.handles and (not sources or self.rng.random() < 0.3):  # cut a shorter one
            handle, origin = self.rng.choice(self.handles)
            tokens = self.rng.randint(1, handle.num_tokens)
            self.handles.append((self.cache.retain_prefix(handle, tokens), cut(origin, tokens)))
        else:  # often the whole request: it decodes into the retained tail's extent next
            source = self.rng.choice(sources)
            length = self.length[source]
            tokens = length if self.rng.random() < 0.5 else self.rng.randint(1, length)
            self.handles.append((self.cache.retain_prefix(source, tokens),
                                 cut(self.origin[source], tokens)))
        self.counts["retains"] += 1

    def release(self) -> None:
        if self.handles:
            handle, _ = self.handles.pop(self.rng.randrange(len(self.handles)))
            self.cache.release_prefix(handle)
            self.counts["releases"] += 1

    def give_everything_back(self) -> None:
        """Release every prefix and end every request, in random order: the pool is full
        again (an extent not given back, or given back twice, shows here or raises), and so
        are host_row's alias key extents (one not given back counts as a leaked extent)."""
        ends = [("release", h) for h, _ in self.handles] + [("abort", r) for r in self.state]
        self.rng.shuffle(ends)
        for call, what in ends:
            (self.cache.release_prefix if call == "release" else self.cache.abort)(what)
        self.handles = []
        for request in list(self.state):
            self._forget(request)
        pool, aliases = self.cache._pool, self.cache._prefixes.aliases
        self.counts["leaked_extents"] += pool.num_extents - pool.allocator.free_extents
        if aliases is not None:
            self.counts["leaked_extents"] += aliases.capacity - aliases.free

    def finish(self) -> None:
        done = self.ids("running") + self.ids("preempted")
        if done:
            request = self.rng.choice(done)
            self.cache.finish(request)
            self._forget(request)
            self.counts["finishes"] += 1

    def abort(self) -> None:
        if self.state:
            request = self.rng.choice(sorted(self.state))
            self.cache.abort(request)
            self._forget(request)
            self.counts["aborts"] += 1

    def preempt(self) -> None:
        running = self.ids("running")
        if running:
            request = self.rng.choice(running)
            self.cache.preempt(request)
            self.state[request] = "preempted"
            self.counts["preempts"] += 1

    def resume(self) -> None:
        waiting = self.ids("preempted") + self.ids("reserved")
        if waiting:
            request = self.rng.choice(waiting)
            if self.state[request] == "reserved":
                self.cache.complete_transfer(request)
            else:
                self.cache.resume(request)
            self.state[request] = "running"
            self.counts["resumes"] += 1

    def decode(self) -> None:
        full = [r for r in self.ids("running") if self.length[r] >= self.cache.max_seq_len]
        for request in full:
            self.cache.finish(request)
            self._forget(request)
        running = self.ids("running")
        if not running:
            return
        batch = self.rng.sample(running, self.rng.randint(1, len(running)))
        if self.sharing:  # (requests the step is about to move to a private copy)
            writers = self.cache._prefixes.writers
            self.counts["private_copies"] += sum(
                id(self.cache._requests.get(r, "x")) in writers for r in batch)
        step = self.cache.begin_decode_step(batch)
        positions = np.array([self.length[r] for r in batch])
        seeds = np.array([self.seeds[r] for r in batch])  # a new token is the request's own
        K = self.cache.top_k
        top_k = np.full((len(batch), K), -1, dtype=np.int64)
        for b, position in enumerate(positions):
            picks = self.rng.sample(range(position + 1), min(K, position + 1))
            top_k[b, : len(picks)] = picks
        device = self.cache.device
        top = torch.from_numpy(top_k.astype(np.int32)).to(device)
        # `folded` of the steps hand the new rows to the swap-in, whose lookup then writes
        # them (the writer's host rows still come from the step's backup on a shared pool).
        folded = self.rng.random() < self.folded
        self.counts["folded_steps"] += folded
        self.recent.append((self.counts["steps"], "folded" if folded else "separate"))
        for layer in range(self.L):
            kv = torch.from_numpy(kv_at(seeds, positions, layer, self.W)).to(device)
            if folded:
                rows = step.swap_in(layer, top, newest_kv=kv)
            else:
                step.write_newest(layer, kv)
                rows = step.swap_in(layer, top)
            self.check(layer, rows, top_k, batch)
        if self.rng.random() < 0.1:
            step.cancel()
            self.counts["cancels"] += 1
        else:
            step.end()
            for request in batch:
                self.length[request] += 1
        self.counts["steps"] += 1

    def check(self, layer: int, rows: torch.Tensor, top_k: np.ndarray, batch: list[int]
              ) -> None:
        """Every row swap_in returned holds the bytes of the token asked for, exactly."""
        valid = top_k >= 0
        device_rows = rows.cpu().numpy().astype(np.int64)
        got = self.cache.device_kv(layer).cpu().numpy()[np.where(valid, device_rows, 0)]
        picked = np.where(valid, top_k, 0)
        seeds = np.stack([seeds_at(self.origin[r], picked[b]) for b, r in enumerate(batch)])
        expected = kv_at(seeds, picked, layer, self.W)
        wrong = valid & ((device_rows < 0) | (got != expected).any(axis=-1))
        self.counts["checked_rows"] += int(valid.sum())
        self.counts["mismatches"] += int(wrong.sum())
        for b, k in zip(*np.nonzero(wrong), strict=True):
            request = batch[b]
            self._report("swap_in", layer=layer, request=request,
                         position=int(top_k[b, k]), length=self.length[request] + 1,
                         device_row=int(device_rows[b, k]),
                         hot_slot=int(device_rows[b, k]) % (self.cache.hot_slots + 1))

    def check_host_rows(self) -> None:
        """At the end: every live request's and retained prefix's rows in the host pool,
        once the writer's copies of every operation so far have landed."""
        shared = self.cache._shared
        if shared is not None:
            shared.before_read()
        host = self.cache.host_tensors()
        holders = [(self.cache._requests.get(r, "check").extents, n, self.origin[r])
                   for r, n in self.length.items()]
        retained = self.cache._prefixes._retained
        holders += [(retained[h.handle_id][1].extents, h.num_tokens, origin)
                    for h, origin in self.handles]
        for extents, length, origin in holders:
            rows = token_rows(extents, self.cache.extent_tokens, 0, length)
            positions = np.arange(length)
            expected = torch.from_numpy(np.stack([
                kv_at(seeds_at(origin, positions), positions, layer, self.W)
                for layer in range(self.L)]))
            for layer in range(self.L):
                wrong = (host[layer][torch.from_numpy(rows)] != expected[layer]).any(dim=-1)
                self.counts["checked_rows"] += length
                self.counts["mismatches"] += int(wrong.sum())
                for position in torch.nonzero(wrong).flatten().tolist():
                    self._report("host rows at the end", layer=layer, position=position,
                                 length=length, host_row=int(rows[position]))

    def _report(self, where: str, **what: Any) -> None:
        if len(self.mismatch_details) < 5:
            self.mismatch_details.append({"where": where, "step": self.counts["steps"], **what,
                                          "recent": list(self.recent)})


def fuzz_rank(barrier: Any, name: str | None, rank: int, ranks: int, seed: int, steps: int,
              device: str = "cpu", overrides: dict[str, Any] | None = None,
              folded: float = 0.5) -> dict[str, Any]:
    """One rank of the fuzz: the same schedule as every other rank of the group; `folded`
    of its steps hand the new rows to swap_in (`newest_kv=`), the rest write them first."""
    cache = _cache(name, rank, ranks, device, {**FUZZ_CONFIG, **(overrides or {})})
    barrier.wait()
    started = time.perf_counter()
    try:
        fuzz = FuzzRank(cache, seed, writer=rank == 0, folded=folded)
        counts = fuzz.run(steps)
    finally:
        barrier.wait()  # no rank closes while another may still wait on its rows
        cache.close()
    details = {"mismatch_details": fuzz.mismatch_details} if fuzz.mismatch_details else {}
    return {**counts, "rank": rank, "seconds": time.perf_counter() - started, **details}


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


__all__ = ["FUZZ_CONFIG", "FuzzRank", "SharedPoolError", "describe_failure", "fuzz_rank",
           "kv_at", "memory_rank", "memory_status", "prompt_rows", "run_group"]
