"""Host time of the eager decode path: what a framework pays per call outside a CUDA graph.

A cache of the deepseek-v3.2 shape (61 layers, 656 B rows, top-k 2048, hot buffer 4096) decodes
B requests at `--seq-len` tokens each, eagerly, the way a framework drives it without graphs:
`begin_decode_step`, then per layer `write_newest` and `swap_in`, then `end_decode_step`. Every
call's host time (wall clock from call to return, no synchronisation inside the step) is
recorded; the device is synchronised between steps, so one step's launches never wait behind
the previous step's queue. Two traces: churn 0 (the top-k of each layer is the same every step,
so every warm step is miss-free) and churn 0.2 (a fifth of each row new every step). Each
layer draws its own top-k (DeepSeek-V3.2 has an indexer per layer).

The cells (batch x churn) are interleaved: a host's speed drifts (1.8x over tens of seconds
on the H200 machine), so cells timed one after another do not compare. After a warmup per
cell, each of `--rounds` rounds runs every cell, in an order shuffled every round (seeded),
for `--steps-per-round` timed steps (`--steps` in all per cell, pooled). The cells share one
cache and its first requests (`ids[:batch]`), so a cell first replays, untimed, its own last
top-k windows (`restore_steps`): its hot buffers then hold what its trace alone leaves there
(churn 0 stays miss-free, churn c misses c * K a row a step: `misses_per_step`) and its batch
is quiet again (a step after another batch's is planned). `--disjoint-requests` gives each
cell its own requests instead (memory for sum(batches) x churns requests).

Each (batch, churn) runs in both ways a framework can hand over a layer's new rows
(`--newest`): `separate`, `write_newest(layer, kv)` then `swap_in(layer, top_k)`, and `folded`,
`swap_in(layer, top_k, newest_kv=kv)` (on the GPUs the write rides in the swap-in's lookup
launch); a folded cell's `swap_in` is the whole per-layer call.

Before each cell's slot a reference (the median of 200 calls of a fixed workload) measures
the host's speed. Each cell reports the raw medians and, under `normalized`, its samples
scaled by the run's fastest-decile reference over their slot's; `reference` is the spread of
the references over the run (min, median, max): the drift, on record.

Besides the medians per call, `--breakdown` times every Triton launch the calls make (a wrapper
around `triton.runtime.jit.JITFunction.run`), which tells the launch cost from the Python
around it; it adds the wrapper's own cost, so its step figures are not the headline ones.
`--profile` runs one more pass per cell under cProfile, one profile per call, and keeps each
call's top 20 functions by own time (in the JSON and on stdout): what is left of each call.
`--warm` asks why a call costs more inside a step than its code needs: one more pass per cell
times the same calls back to back (`--warm-calls` of each, no device sync or other calls in
between), and the reference workload right after a sync against back to back (`warm_pass`);
the cell's `warm` holds their medians and the in-step medians over them.

    PYTHONPATH=src python benchmarks/host_overhead.py --device cuda \
        --output benchmarks/results/host-overhead-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

import hisparse
from hisparse.backends.registry import get_backend
from hisparse.kernels.swap_in.plan import tuning
from hisparse.tools.benchmarking import run_environment

CALLS = ("begin_decode_step", "write_newest", "swap_in", "end_decode_step")
# The device synchronisation before each timed step: its wall time and the process's CPU
# time in it.
WAITS = ("sync_before_step", "sync_before_step_cpu")
REFERENCE_CALLS = 200  # calls of the host-speed reference workload per measurement


def preset(shape: dict[str, int] | None, layers: int | None, **overrides: object
           ) -> hisparse.HiSparseConfig:
    """The deepseek-v3.2 preset with the run's shape (`--top-k`, `--row-bytes`, `--layers`)."""
    overrides |= shape or {}
    if layers is not None:
        overrides["num_layers"] = layers
    return hisparse.HiSparseConfig.from_preset("deepseek-v3.2", **overrides)


def make_cache(device: object, max_batch: int, seq_len: int, steps: int, layers: int | None,
               shape: dict[str, int] | None = None, ragged: bool = False
               ) -> hisparse.HiSparseCache:
    """Room for `max_batch` requests of `seq_len` tokens that decode `steps` more each."""
    overrides: dict[str, object] = {"max_requests": max_batch,
                                    "max_seq_len": seq_len + steps + 8}
    probe = preset(shape, layers, **overrides)
    if ragged:  # room for `admit_all`'s up to extent_tokens - 1 more tokens a request
        seq_len += probe.extent_tokens
        overrides["max_seq_len"] = seq_len + steps + 8
    # Whole extents for every request and its decoded tokens, nothing more (host RAM).
    per_request = -(-(seq_len + steps + 1) // probe.extent_tokens) + 1
    overrides["host_pool_tokens"] = max_batch * per_request * probe.extent_tokens
    return hisparse.HiSparseCache(preset(shape, layers, **overrides), device=device)


def admit_all(cache: hisparse.HiSparseCache, count: int, seq_len: int,
              ragged: bool = False) -> list[str]:
    """Requests whose host rows are reserved and marked transferred (the PD path: no prefill
    bytes to write; the rows' content does not change host time). `ragged`: request i has
    `(97 * i) % extent_tokens` more tokens, so that the batch's requests start their next
    extents at different steps, as a served batch's do (every step that one does is planned,
    the others are quiet: core.batch.QuietRun)."""
    ids = [f"r{i}" for i in range(count)]
    for index, request_id in enumerate(ids):
        extra = (97 * index) % cache.extent_tokens if ragged else 0
        cache.reserve_host_slots(request_id, seq_len + extra)
        cache.complete_transfer(request_id)
    return ids


class TopK:
    """Per layer and request, a window of a fixed random permutation of the first `seq_len`
    positions: unique entries in every row; churn c moves the window by c * K each step."""

    def __init__(self, layers: int, batch: int, seq_len: int, top_k: int, churn: float,
                 device: torch.device, seed: int) -> None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
        keys = torch.rand(layers, batch, seq_len - 1, generator=generator)
        self.perm = keys.argsort(dim=-1).to(torch.int32).to(device)
        self.shift = round(churn * top_k)
        self.columns = torch.arange(top_k, device=device)
        self.span = seq_len - 1

    def step(self, index: int) -> torch.Tensor:
        """[L, B, K] int32, contiguous per layer."""
        window = (self.columns + index * self.shift) % self.span
        return self.perm.index_select(2, window).contiguous()


@contextlib.contextmanager
def launch_timer(record: dict[str, list[float]]) -> Iterator[None]:
    """Time every Triton JIT launch (dispatch, argument binding and the driver call)."""
    import triton.runtime.jit as jit

    original = jit.JITFunction.run

    def timed(self: object, *args: object, **kwargs: object) -> object:
        start = time.perf_counter_ns()
        try:
            return original(self, *args, **kwargs)
        finally:
            record[getattr(self, "__name__", "?")].append((time.perf_counter_ns() - start) / 1e3)

    jit.JITFunction.run = timed
    try:
        yield
    finally:
        jit.JITFunction.run = original


class Profiled:
    """The cache, with each call of `CALLS` run under its own profiler (every other attribute
    is the cache's)."""

    def __init__(self, cache: hisparse.HiSparseCache) -> None:
        self._cache = cache
        self.profiles = {name: cProfile.Profile() for name in CALLS}
        self.calls = dict.fromkeys(CALLS, 0)
        for name in CALLS:
            setattr(self, name, self._wrap(name, getattr(cache, name)))

    def _wrap(self, name: str, call: callable) -> callable:
        profile = self.profiles[name]

        def profiled(*args: object, **kwargs: object) -> object:
            self.calls[name] += 1
            return profile.runcall(call, *args, **kwargs)

        return profiled

    def __getattr__(self, name: str) -> object:
        return getattr(self._cache, name)

    def top(self, count: int = 20) -> dict[str, list[str]]:
        """Each call's `count` costliest functions by own time, in us per call of it (pstats
        prints milliseconds at best); cProfile's own cost inflates every row alike."""
        tables = {}
        for name, profile in self.profiles.items():
            if not self.calls[name]:
                continue  # (a folded cell makes no write_newest call)
            stats = pstats.Stats(profile).stats
            per_call = 1e6 / max(self.calls[name], 1)
            rows = sorted(stats.items(), key=lambda item: -item[1][2])[:count]
            tables[name] = [f"{'own us':>8} {'cum us':>8} {'calls':>6}  function"] + [
                f"{tt * per_call:8.2f} {ct * per_call:8.2f} {nc / max(self.calls[name], 1):6.1f}"
                f"  {Path(file).name}:{line}({func})"
                for (file, line, func), (_, nc, tt, ct, _) in rows]
        return tables


class Cell:
    """One (batch, churn) cell: its requests, top-k trace and rows, where its trace stands,
    and its timed slots, each a host-speed reference and the samples taken just after it."""

    def __init__(self, batch: int, churn: float, ids: list[str], trace: TopK, kv: torch.Tensor,
                 restore: int, newest: str = "separate") -> None:
        self.batch, self.churn, self.ids, self.trace, self.kv = batch, churn, ids, trace, kv
        self.newest = newest  # how the new rows reach the cache: "separate" or "folded"
        self.restore, self.index = restore, 0  # its replayed windows; its next trace step
        self.slots: list[tuple[float, dict[str, list[float]]]] = []
        self.hits = self.misses = 0  # over the timed steps (the cache's counters)

    def run(self, cache: hisparse.HiSparseCache, count: int, sync: Callable[[], None],
            times: dict[str, list[float]] | None = None) -> None:
        """`count` steps on from where the trace stands, timed into `times` if given."""
        run_steps(cache, self, range(self.index, self.index + count), sync, times)
        self.index += count

    def rejoin(self, cache: hisparse.HiSparseCache, sync: Callable[[], None]) -> None:
        """Replay the cell's last `restore` windows, untimed: other cells' steps changed the
        shared requests' hot buffers and ended the batch's quiet run (core.batch.QuietRun)."""
        run_steps(cache, self, range(self.index - self.restore, self.index), sync, None)


def restore_steps(churn: float, top_k: int, hot_slots: int, span: int) -> int:
    """The windows a cell replays so that its requests' LRU hot buffers hold what its trace
    alone leaves there. Churn 0: its window (every step after it is miss-free). Churn c: m
    windows that cover the hot slots (top_k + (m - 1) * shift positions), so that no row
    another cell left resident turns a miss into a hit."""
    shift = round(churn * top_k)
    return 1 if shift == 0 else max(1, -(-(min(hot_slots, span) - top_k) // shift) + 1)


def decode_layer(cache: hisparse.HiSparseCache, layer: int, top_k: torch.Tensor,
                 kv: torch.Tensor, folded: bool) -> tuple[float | None, float]:
    """One layer's calls of a step (`top_k [L, B, K]`, `kv [L, B, W]`), in the cell's newest
    mode: (write_newest's host us, None when folded into the swap-in; swap_in's host us)."""
    clock = time.perf_counter_ns
    if folded:
        b = clock()
        cache.swap_in(layer, top_k[layer], newest_kv=kv[layer])
        return None, (clock() - b) / 1e3
    a = clock()
    cache.write_newest(layer, kv[layer])
    b = clock()
    cache.swap_in(layer, top_k[layer])
    return (b - a) / 1e3, (clock() - b) / 1e3


def run_steps(cache: hisparse.HiSparseCache, cell: Cell, indices: range,
              sync: Callable[[], None], times: dict[str, list[float]] | None) -> None:
    """Decode steps of `cell` at its trace's `indices`, each call's host time (us) added to
    `times` if given."""
    ids, kv, keep, layers = cell.ids, cell.kv, times is not None, cache.num_layers
    clock, folded = time.perf_counter_ns, cell.newest == "folded"
    for index in indices:
        top_k = cell.trace.step(index)
        waited, waited_cpu = clock(), time.process_time_ns()
        sync()
        synced, synced_cpu = clock(), time.process_time_ns()
        if keep:  # whether the host spun (CPU time = wall) or slept through the wait
            times["sync_before_step"].append((synced - waited) / 1e3)
            times["sync_before_step_cpu"].append((synced_cpu - waited_cpu) / 1e3)
        t0 = clock()
        cache.begin_decode_step(ids)
        t1 = clock()
        for layer in range(layers):
            write_us, swap_us = decode_layer(cache, layer, top_k, kv, folded)
            if keep:
                if write_us is not None:
                    times["write_newest"].append(write_us)
                times["swap_in"].append(swap_us)
        t2 = clock()
        cache.end_decode_step()
        t3 = clock()
        if keep:
            times["begin_decode_step"].append((t1 - t0) / 1e3)
            times["end_decode_step"].append((t3 - t2) / 1e3)
            times["step"].append((t3 - t0) / 1e3)
        sync()


def _pausing(sync: Callable[[], None], pause_ms: float, kind: str) -> Callable[[], None]:
    """`sync`, then `pause_ms` of `kind`: "sleep" leaves the core idle before the step that
    follows, "spin" keeps it busy in a Python loop for as long."""
    seconds = pause_ms / 1e3

    def sync_then_pause() -> None:
        sync()
        if kind == "sleep":
            time.sleep(seconds)
        else:
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                pass

    return sync_then_pause


def _quantile(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


def summarize(slots: list[tuple[float, dict[str, list[float]]]], fastest: float = 0.0
              ) -> dict[str, dict[str, float]]:
    """Median and tails per call, begin + end and step, over the slots' samples; with
    `fastest`, each scaled by `fastest / its slot's reference` (a sample taken while the host
    ran at half speed counts half). The 10th percentile too: on a shared machine (the CPU
    runs) other work inflates the median by 2x from run to run, while the fastest tenth of
    the calls stays put."""
    times: dict[str, list[float]] = defaultdict(list)
    for reference, samples in slots:
        for name, values in samples.items():
            times[name] += [v * fastest / reference if fastest else v for v in values]
    times["begin_plus_end"] = [b + e for b, e in zip(
        times["begin_decode_step"], times["end_decode_step"], strict=True)]
    return {name: {"median_us": statistics.median(v), "p10_us": _quantile(v, 0.1),
                   "p90_us": _quantile(v, 0.9), "steps" if name == "step" else "calls": len(v)}
            for name, v in ((n, times[n]) for n in (*CALLS, "begin_plus_end", "step", *WAITS))
            if v}


def reference_workload(device: torch.device) -> Callable[[], int]:
    """A fixed host workload of the kind a call is made of: a dict-and-arithmetic Python loop
    and one tiny torch op on the device (a launch, on a GPU)."""
    src, dst = torch.zeros(2, 64, dtype=torch.int32, device=device)
    table = {key: key * 3 for key in range(32)}

    def work() -> int:
        total = 0
        for key in range(32):
            total += table[key] ^ key
        dst.copy_(src)
        return total

    return work


def reference_us(work: Callable[[], int], sync: Callable[[], None],
                 calls: int = REFERENCE_CALLS) -> float:
    """Median host time of `calls` calls of the reference workload (about 1 ms in all)."""
    clock, samples = time.perf_counter_ns, []
    for _ in range(calls):
        start = clock()
        work()
        samples.append(clock() - start)
    sync()
    return statistics.median(samples) / 1e3


def split_rounds(steps: int, rounds: int) -> list[int]:
    """Timed steps per round: `steps` spread over `rounds` as evenly as they go."""
    rounds = min(rounds, steps)
    return [steps // rounds + (r < steps % rounds) for r in range(rounds)]


def make_cells(cache: hisparse.HiSparseCache, batches: list[int], churns: list[float],
               seq_len: int, seed: int, ragged: bool, disjoint: bool,
               newest_modes: tuple[str, ...] = ("separate",)) -> list[Cell]:
    """Every cell's state up front: `ids[:batch]` of one set of requests, or (`disjoint`)
    a set of its own, with one untimed step before a slot to take its quiet run back."""
    dev = cache.device
    count = len(newest_modes) * len(churns) * sum(batches) if disjoint else max(batches)
    ids = admit_all(cache, count, seq_len, ragged)
    cells, offset = [], 0
    for batch in batches:
        kv = torch.randint(0, 256, (cache.num_layers, batch, cache.row_bytes),
                           dtype=torch.uint8, device=dev)
        for churn in churns:
            trace = TopK(cache.num_layers, batch, seq_len, cache.top_k, churn, dev, seed + batch)
            restore = 1 if disjoint else restore_steps(
                churn, cache.top_k, cache.config.hot_slots, trace.span)
            for newest in newest_modes:
                cells.append(Cell(batch, churn, ids[offset:offset + batch], trace, kv, restore,
                                  newest))
                offset += batch if disjoint else 0
    return cells


def run_rounds(cache: hisparse.HiSparseCache, cells: list[Cell], warmup: int,
               per_round: list[int], sync: Callable[[], None], seed: int
               ) -> list[list[float]]:
    """Warm every cell up, then in each round every cell in a fresh (seeded) order: a
    reference, the cell's replay, its timed steps. Returns each round's references."""
    work = reference_workload(cache.device)
    reference_us(work, sync)  # its first calls
    for cell in cells:
        cell.run(cache, warmup, sync)
    order, rng, last = list(cells), random.Random(seed), cells[-1]
    references = []
    for count in per_round:
        rng.shuffle(order)
        references.append([])
        for cell in order:
            reference = reference_us(work, sync)
            references[-1].append(reference)
            if cell is not last:
                cell.rejoin(cache, sync)
            before = cache.stats()
            times: dict[str, list[float]] = defaultdict(list)
            cell.run(cache, count, sync, times)
            after = cache.stats()
            cell.hits += after.hits - before.hits
            cell.misses += after.misses - before.misses
            cell.slots.append((reference, times))
            last = cell
    return references


def back_to_back_steps(cache: hisparse.HiSparseCache, ids: list[str], calls: int,
                       sync: Callable[[], None]) -> dict[str, float]:
    """`calls` steps of begin then end, no layer's call in between and no sync but before and
    after the loop: the two calls' cost on a host that runs nothing else. (With no swap-in
    every end launches the whole backup, as a step whose lookups did not write it does.)"""
    clock, begins, ends = time.perf_counter_ns, [], []
    sync()
    for _ in range(calls):
        t0 = clock()
        cache.begin_decode_step(ids)
        t1 = clock()
        cache.end_decode_step()
        t2 = clock()
        begins.append((t1 - t0) / 1e3)
        ends.append((t2 - t1) / 1e3)
    sync()
    return {"begin_back_to_back": statistics.median(begins), "begin_first_of_back_to_back":
            begins[0], "end_back_to_back": statistics.median(ends),
            "end_first_of_back_to_back": ends[0]}


def back_to_back_layer(cache: hisparse.HiSparseCache, cell: Cell, calls: int,
                       sync: Callable[[], None]) -> dict[str, float]:
    """One complete step of the cell at its next trace step, layer 0's call (the cell's
    newest mode, timed as `run_steps` times it) made `calls` times back to back with the
    same top-k: the engine takes a layer's swap-in again within a step (the repeats hit what
    the first brought in). Separate: each repeat is write_newest then swap_in, each timed."""
    top_k, kv, folded = cell.trace.step(cell.index), cell.kv, cell.newest == "folded"
    cell.index += 1
    swaps, writes = [], []
    sync()
    cache.begin_decode_step(cell.ids)
    for _ in range(calls):
        write_us, swap_us = decode_layer(cache, 0, top_k, kv, folded)
        if write_us is not None:
            writes.append(write_us)
        swaps.append(swap_us)
    for layer in range(1, cache.num_layers):  # the rest of the step, untimed
        decode_layer(cache, layer, top_k, kv, folded)
    cache.end_decode_step()
    sync()
    result = {"swap_in_back_to_back": statistics.median(swaps),
              "swap_in_first_of_back_to_back": swaps[0]}
    if writes:
        result |= {"write_newest_back_to_back": statistics.median(writes),
                   "write_newest_first_of_back_to_back": writes[0]}
    return result


def reference_after_sync(work: Callable[[], int], calls: int, sync: Callable[[], None]
                         ) -> dict[str, float]:
    """The reference workload, one call timed after each of `calls` syncs, against `calls`
    calls back to back: is the host slower at the same code right after a sync? (On a GPU
    the sync waits for the last call's copy only; `--pause-ms` makes the wait a long one.)"""
    clock, after_sync = time.perf_counter_ns, []
    for _ in range(calls):
        sync()
        start = clock()
        work()
        after_sync.append((clock() - start) / 1e3)
    sync()
    cold, warm = statistics.median(after_sync), reference_us(work, sync, calls)
    return {"reference_after_sync": cold, "reference_warm": warm,
            "reference_after_sync_over_warm": cold / warm}


def warm_pass(cache: hisparse.HiSparseCache, cell: Cell, calls: int,
              sync: Callable[[], None], record: dict[str, object]) -> dict[str, object]:
    """`--warm`: the cell's calls back to back (medians, us), untimed by its statistics, and
    each call's in-step median (the timed rounds') over its back-to-back one."""
    cell.rejoin(cache, sync)  # its batch quiet again, as before its timed steps
    warm: dict[str, object] = {"calls": calls}
    warm |= back_to_back_steps(cache, cell.ids, calls, sync)
    warm |= back_to_back_layer(cache, cell, calls, sync)
    warm |= reference_after_sync(reference_workload(cache.device), calls, sync)
    for name, call in (("begin", "begin_decode_step"), ("end", "end_decode_step"),
                       ("swap_in", "swap_in"), ("write_newest", "write_newest")):
        if call in record and f"{name}_back_to_back" in warm:
            warm[f"{name}_in_step_over_back_to_back"] = (
                record[call]["median_us"] / warm[f"{name}_back_to_back"])
    return warm


def extra_passes(cache: hisparse.HiSparseCache, cell: Cell, steps: int, breakdown: bool,
                 profile: bool, sync: Callable[[], None], record: dict[str, object],
                 warm_calls: int = 0) -> None:
    """`--breakdown`, `--profile` and `--warm` (`warm_calls` > 0): one more pass each over the
    cell (after the rounds)."""
    if breakdown:
        cell.rejoin(cache, sync)
        launches: dict[str, list[float]] = defaultdict(list)
        with launch_timer(launches):
            cell.run(cache, steps, sync)
        record["triton_launches"] = {name: {"median_us": statistics.median(v), "calls": len(v)}
                                     for name, v in sorted(launches.items())}
    if profile:
        cell.rejoin(cache, sync)
        profiled = Profiled(cache)
        # Without the collector: a collection lands on whichever call allocates when it is
        # due, and one of 100+ us in a mean over few calls hides the rest.
        gc.collect()
        gc.disable()
        try:
            cell.run(profiled, steps, sync)
        finally:
            gc.enable()
        record["profile_top20"] = profiled.top()
        for name, table in record["profile_top20"].items():
            print(f"--- cProfile, B={cell.batch} churn={cell.churn}: {name} ({steps} steps, "
                  "per call)\n" + "\n".join(table), flush=True)
    if warm_calls:
        record["warm"] = warm_pass(cache, cell, warm_calls, sync, record)


def measure(device: object, batches: list[int], churns: list[float], seq_len: int, warmup: int,
            steps: int, layers: int | None, breakdown: bool, profile: bool, seed: int,
            shape: dict[str, int] | None = None, ragged: bool = False, rounds: int | None = None,
            steps_per_round: int = 2, disjoint: bool = False,
            newest_modes: tuple[str, ...] = ("separate",), pause_ms: float = 0.0,
            pause_kind: str = "sleep", warm_calls: int = 0) -> dict[str, object]:
    per_round = split_rounds(steps, rounds or -(-steps // steps_per_round))
    probe = preset(shape, layers)
    restore = 1 if disjoint else max(
        restore_steps(c, probe.top_k, probe.hot_slots, seq_len - 1) for c in churns)
    # Tokens the busiest request decodes: its own cell's (disjoint) or every cell's.
    own = warmup + len(per_round) * restore + steps + (breakdown + profile) * (restore + steps)
    own += (restore + warm_calls + 1) if warm_calls else 0  # `warm_pass`'s steps
    cells_per_batch = len(churns) * len(newest_modes)
    cache = make_cache(device, cells_per_batch * sum(batches) if disjoint else max(batches),
                       seq_len, own * (1 if disjoint else len(batches) * cells_per_batch),
                       layers, shape, ragged)
    dev = cache.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (
        (lambda: torch.xpu.synchronize(dev)) if dev.type == "xpu" else (lambda: None))
    if pause_ms > 0:
        sync = _pausing(sync, pause_ms, pause_kind)
    cells = make_cells(cache, batches, churns, seq_len, seed, ragged, disjoint, newest_modes)
    references = run_rounds(cache, cells, warmup, per_round, sync, seed)
    everything = [value for round_ in references for value in round_]
    fastest = _quantile(everything, 0.1)
    records = []
    for cell in cells:
        record: dict[str, object] = {"batch": cell.batch, "churn": cell.churn,
                                     "newest": cell.newest, "mode": "eager"}
        record.update(summarize(cell.slots))
        record["normalized"] = summarize(cell.slots, fastest)
        record["reference_us"] = [reference for reference, _ in cell.slots]
        record |= {"restore_steps": cell.restore, "timed_hits": cell.hits,
                   "timed_misses": cell.misses, "misses_per_step": cell.misses / steps}
        extra_passes(cache, cell, steps, breakdown, profile, sync, record, warm_calls)
        records.append(record)
    stats = cache.stats().to_dict()
    for record in records:
        record["hit_rate_so_far"] = stats.get("hit_rate")  # the cache's, over the whole run
        print_cell(record)
    cache.close()
    summary = {"min_us": min(everything), "median_us": statistics.median(everything),
               "max_us": max(everything), "fastest_decile_us": fastest,
               "max_over_min": max(everything) / min(everything)}
    print(json.dumps({"reference": summary}), flush=True)
    summary |= {"calls_per_sample": REFERENCE_CALLS,
                "workload": " ".join(reference_workload.__doc__.split()),
                "per_round_median_us": [statistics.median(r) for r in references]}
    return {"cells": records, "reference": summary, "interleave": {
        "rounds": len(per_round), "steps_per_round": per_round, "warmup": warmup,
        "order": f"shuffled every round (seed {seed})",
        "requests": "disjoint" if disjoint else "shared", "max_restore_steps": restore}}


def print_cell(record: dict[str, object]) -> None:
    norm = record["normalized"]
    keys = [k for k in (*CALLS, "begin_plus_end", "step") if k in record]
    print(json.dumps({k: record[k] for k in ("batch", "churn", "newest", "misses_per_step")} |
                     {k: round(record[k]["median_us"], 1) for k in keys} |
                     {f"{k}_p10": round(record[k]["p10_us"], 1)
                      for k in ("begin_decode_step", "end_decode_step", "begin_plus_end")} |
                     {f"{k}_norm": round(norm[k]["median_us"], 1) for k in keys}), flush=True)
    if "warm" in record:
        print(json.dumps({k: record[k] for k in ("batch", "churn", "newest")} | {"warm": {
            k: round(v, 2) for k, v in record["warm"].items()}}), flush=True)


def _nop_kernel() -> object:
    import triton
    import triton.language as tl

    # Annotations are strings here (`from __future__`): triton resolves them in globals.
    globals()["tl"] = tl

    @triton.jit
    def nop(a, b, c, d, e, f, g, h, n0, n1, n2, n3, X: tl.constexpr, Y: tl.constexpr):
        pass

    return nop


def launch_floors(device: str, repeats: int = 2000) -> dict[str, float]:
    """Median host cost of the primitives an eager call is built from, on this machine."""
    _nop = _nop_kernel()
    dev = torch.device(device)
    t = [torch.zeros(64, dtype=torch.int32, device=dev) for _ in range(8)]
    ints = (7, 9, 2048, 4096)

    def median_us(call: callable) -> float:
        for _ in range(20):
            call()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter_ns()
            call()
            samples.append(time.perf_counter_ns() - start)
        torch.cuda.synchronize(dev) if dev.type == "cuda" else None
        return statistics.median(samples) / 1e3

    kernel = _nop[(1,)](*t, *ints, X=1, Y=2)
    floors = {"triton_jit_launch_12_args": median_us(lambda: _nop[(1,)](*t, *ints, X=1, Y=2))}
    if hasattr(kernel, "packed_metadata"):
        from triton.runtime import driver

        stream = driver.active.get_current_stream(dev.index or 0)
        ptrs = [x.data_ptr() for x in t]
        args = (*ptrs, *ints, 1, 2)
        run, fn, meta = kernel.run, kernel.function, kernel.packed_metadata
        floors["compiled_run_12_args"] = median_us(
            lambda: run(1, 1, 1, stream, fn, meta, None, None, None, *args))
        floors["get_current_stream"] = median_us(
            lambda: driver.active.get_current_stream(dev.index or 0))
    src, dst = t[0], t[1]
    floors["torch_copy_"] = median_us(lambda: dst.copy_(src))
    index = torch.zeros(4, dtype=torch.long, device=dev)
    rows = torch.zeros(4, 656, dtype=torch.uint8, device=dev)
    table = torch.zeros(2, 64, 656, dtype=torch.uint8, device=dev)
    floors["torch_index_copy_"] = median_us(lambda: table[1].index_copy_(0, index, rows))
    floors["torch_view_index"] = median_us(lambda: table[1])
    floors["torch_slice"] = median_us(lambda: src[:4])
    event = torch.Event(device=dev)
    floors["event_record"] = median_us(lambda: event.record())
    if dev.type == "cuda":  # the stream and event calls an ordering barrier is built from
        floors |= _stream_floors(dev, median_us)
    pinned = torch.zeros(256, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    landing = torch.empty(256, dtype=torch.uint8, device=dev)
    floors["h2d_copy_256_bytes"] = median_us(lambda: landing.copy_(pinned, non_blocking=True))
    values, index = np.arange(128), np.arange(8)
    floors["numpy_fancy_index_8"] = median_us(lambda: values[index])
    floors["numpy_tolist_128"] = median_us(values.tolist)
    return floors


def _stream_floors(dev: torch.device, median_us: Callable[[Callable[[], object]], float]
                   ) -> dict[str, float]:
    backend = get_backend(dev)
    side = torch.cuda.Stream(dev)
    cuda_event, event = torch.cuda.Event(), backend.new_event()

    def cuda_scope() -> None:
        with torch.cuda.stream(side):
            pass

    def hisparse_scope() -> None:
        with backend.stream_scope(side):
            pass

    return {"cuda_current_stream_of_device": median_us(lambda: torch.cuda.current_stream(dev)),
            "cuda_event_record_current": median_us(lambda: cuda_event.record()),
            "hisparse_record_event": median_us(lambda: backend.record_event(event, dev)),
            "hisparse_wait_event": median_us(lambda: backend.wait_event(event, dev)),
            "cuda_stream_scope": median_us(cuda_scope),
            "hisparse_stream_scope": median_us(hisparse_scope),
            "event_query": median_us(event.query)}


TARGETS_US = {"swap_in": 25.0, "write_newest": 8.0, "begin_plus_end": 60.0, "step": 2500.0}


# --pdl: the launch-plan overrides of each mode (kernels.swap_in.plan.Tuning).
PDL_MODES: dict[str, dict[str, object]] = {
    "default": {}, "on": {"pdl": True}, "off": {"pdl": False},
    "no-early-copy": {"pdl": True, "pdl_copy_max_batch": 0}}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="backend or device (default: best here)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--churns", type=float, nargs="+", default=[0.0, 0.2])
    parser.add_argument("--seq-len", type=int, default=6144,
                        help="tokens per request (> the hot buffer: the long regime)")
    parser.add_argument("--layers", type=int, default=None,
                        help="fewer layers than the preset's 61 (quick runs only)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per cell, in all")
    parser.add_argument("--steps-per-round", type=int, default=2, help="timed steps a round")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds to spread each cell's steps over (default: steps / "
                             "steps-per-round); wins over --steps-per-round")
    parser.add_argument("--disjoint-requests", action="store_true",
                        help="each cell its own requests (sum of batches x churns of them: "
                             "host and device memory), instead of replaying its windows")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each Triton JIT launch (an extra pass per cell)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile each call (cProfile top 20 per call, an extra pass)")
    parser.add_argument("--floors", action="store_true",
                        help="also time the primitives (a Triton launch, a torch copy, ...)")
    parser.add_argument("--top-k", type=int, default=None,
                        help="another top-k (hot buffer 2x): smaller tables for a CPU run")
    parser.add_argument("--row-bytes", type=int, default=None,
                        help="another row width: a smaller host pool for a CPU run")
    parser.add_argument("--noop-kernels", action="store_true",
                        help="the CPU backend with kernels that do nothing "
                             "(tests/fakes/noop_kernels.py): the engine's own Python per call")
    parser.add_argument("--ragged", action="store_true",
                        help="request lengths spread over an extent (a served batch), instead "
                             "of one length: the batch starts extents at different steps")
    parser.add_argument("--newest", nargs="+", choices=["separate", "folded"],
                        default=["separate", "folded"],
                        help="how each cell hands over a layer's new rows: write_newest then "
                             "swap_in, or swap_in(..., newest_kv=) (default: both, side by side)")
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="pause this long after each device synchronisation, before the "
                             "step: is the host slower right after a long wait for the device?")
    parser.add_argument("--pause-kind", choices=["sleep", "spin"], default="sleep",
                        help="how --pause-ms waits: an idle core, or a busy one")
    parser.add_argument("--warm", action="store_true",
                        help="also time the calls back to back and the reference right after "
                             "a sync (an extra pass per cell): the in-step cost over the code's")
    parser.add_argument("--warm-calls", type=int, default=40,
                        help="calls of each kind in the --warm pass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pdl", choices=sorted(PDL_MODES), default="default",
                        help="programmatic dependent launch of the swap-in's kernels "
                             "(Tuning.pdl; default: the shipped tuning, off; on: where the "
                             "device allows; no-early-copy: on, but the copy in order)")
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "steps_per_round", "rounds", "warm_calls"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    device: object = args.device or str(hisparse.get_backend().device())
    if args.noop_kernels:
        # The fake lives with the tests' other fakes; the repository root makes it importable.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from fakes.noop_kernels import NoopKernelCpu

        device = NoopKernelCpu()
    shape = {name: value for name, value in (("top_k", args.top_k),
                                             ("row_bytes", args.row_bytes))
             if value is not None}
    launch = tuning(**PDL_MODES[args.pdl]) if PDL_MODES[args.pdl] else contextlib.nullcontext()
    with launch:
        cells = measure(device, args.batches, args.churns, args.seq_len, args.warmup, args.steps,
                        args.layers, args.breakdown, args.profile, args.seed, shape, args.ragged,
                        args.rounds, args.steps_per_round, args.disjoint_requests,
                        tuple(dict.fromkeys(args.newest)), args.pause_ms, args.pause_kind,
                        args.warm_calls if args.warm else 0)
    result = {
        "benchmark": "host-overhead",
        "command": "python benchmarks/host_overhead.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "mode": "eager calls (no graph), host wall time per call; device synchronised "
                "between steps only" + (f", then {args.pause_ms:g} ms of {args.pause_kind}"
                                        if args.pause_ms else ""),
        "environment": run_environment("cpu" if args.noop_kernels else device),
        "targets_us": TARGETS_US,
        "lengths": "ragged" if args.ragged else "equal",
        "pdl": args.pdl,
        **cells,
    }
    if args.floors:
        try:
            result["floors_us"] = launch_floors(device)
        except Exception as exc:  # the floors are context; the cells are the measurement
            result["floors_us"] = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result["floors_us"]))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
