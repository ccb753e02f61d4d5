"""Reusable core of the benchmarks: SW-1 (the swap-in workload) and the copy-limit probes.

This module is the one definition of the SW-1 workload, which `hisparse bench` and
`benchmarks/swap_in.py` both run (`sw1_cell`: graph replays where the backend captures
graphs, eager launches elsewhere). It calls the backend's kernels directly on hand-built
`CacheTables` (one layer, one group), so the host layout is under the benchmark's control:
  * scattered: every token at a random row of a pool holding all B x seq_len tokens;
  * extents: contexts built from `extent_tokens`-token extents by the library's allocator;
  * shuffled-extents (extent sweeps): `extent_tokens`-token extents in random order.
Before each timed step the device caches are flushed (in a model, the other layers' work runs
between two swap-ins of one layer), then that step's top-k is written. Every cell checks the
rows it returned against the host pool, byte for byte.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from hisparse.backends.base import Backend, SwapInFn
from hisparse.backends.features import Feature
from hisparse.core.host_pool import ExtentAllocator
from hisparse.errors import InvalidInputError
from hisparse.kernels.swap_in.plan import current_tuning
from hisparse.layout.tables import (
    CacheTables,
    MissPlan,
    ResidencyMap,
    residency_dtype,
    unshared_key_extents,
)
from hisparse.tools.sw1_steps import CellSteps
from hisparse.tools.sw1_steps import rows_match as rows_match  # the benchmarks call both here
from hisparse.tools.sw1_steps import wrong_rows as wrong_rows

LAYOUTS = ("scattered", "extents")
SWEEP_LAYOUT = "shuffled-extents"


@dataclass(frozen=True)
class SW1Sizes:
    """SW-1: one layer, 656 B rows, top-k 2048, hot buffer 4096+1, every request at 32768 tokens
    in the host pool, batch x churn x host layout; `quick()` shrinks it for a CPU."""

    seq_len: int = 32768
    top_k: int = 2048
    hot_slots: int = 4096
    row_bytes: int = 656
    extent_tokens: int = 512
    warmup_steps: int = 8
    timed_steps: int = 40

    @classmethod
    def quick(cls) -> SW1Sizes:
        return cls(seq_len=16384, warmup_steps=2, timed_steps=5)

    def check(self) -> None:
        problems = []
        if self.hot_slots < self.top_k:
            problems.append(f"hot_slots ({self.hot_slots}) must be >= top_k ({self.top_k})")
        # Fresh positions come from those older than the seeded hot buffer, and must have left
        # it before they come round again (at churn 1.0 that takes H + K of them).
        if self.seq_len <= 2 * self.hot_slots + self.top_k:
            problems.append(f"seq_len ({self.seq_len}) must exceed 2 x hot_slots + top_k "
                            f"({2 * self.hot_slots + self.top_k}) so that every fresh position "
                            "misses")
        if self.row_bytes % 4:
            problems.append(f"row_bytes ({self.row_bytes}) must be a multiple of 4")
        if self.seq_len % self.extent_tokens:
            problems.append(f"seq_len ({self.seq_len}) must be a multiple of extent_tokens "
                            f"({self.extent_tokens})")
        if self.timed_steps < 1:
            problems.append(f"timed_steps must be >= 1, got {self.timed_steps}")
        if problems:
            raise InvalidInputError("invalid SW-1 sizes: " + "; ".join(problems))


@dataclass(frozen=True)
class SW1Cell:
    layout: str
    batch: int
    churn: float
    step_seconds: float  # median over the timed steps
    p90_seconds: float
    misses_per_step: float
    miss_bytes_per_second: float | None  # misses x row bytes / step time; None without misses
    verified: bool  # the rows of every checked step equal the host rows, byte for byte
    timing: str  # "graph replay" or "eager"
    extent_tokens: int
    skip_io_step_seconds: float | None = None  # median with skip_io=True (plan only)
    batch_capacity: int | None = None  # rows the kernel ran over (None: `batch`, no padding)
    misses_counted_by: str = "kernel counters"  # or "trace" (a kernel that counts nothing)
    residency_map: str = "host_row"  # what hisparse's residency map was keyed by
    p10_seconds: float | None = None  # the fastest timed steps' tail, beside p90

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


# ~100 us of GPU clock: a graph replay queued behind it starts the moment the GPU reaches it.
SLEEP_CYCLES = 200_000


class StepTimer:
    """Device events on an accelerator, the wall clock (after the call returns) on the CPU.

    `queued`: start the events behind a device-side sleep (CUDA and ROCm), so a call whose
    launch is cheap (a graph replay) is timed from when the GPU reaches it, not from when
    the host got there."""

    def __init__(self, backend: Backend, device: torch.device, queued: bool = False) -> None:
        self.backend = backend
        self.on_host = device.type == "cpu"
        self.device = device
        self.queued = queued and device.type == "cuda"

    def record(self, call: Callable[[], None]) -> Callable[[], float]:
        """Run `call` between two events without waiting for it; the returned function gives
        its seconds once the device has finished (after a synchronize)."""
        if self.on_host:
            start = time.perf_counter()
            call()
            seconds = time.perf_counter() - start
            return lambda: seconds
        begin = torch.Event(device=self.device, enable_timing=True)
        end = torch.Event(device=self.device, enable_timing=True)
        if self.queued:
            torch.cuda._sleep(SLEEP_CYCLES)
        begin.record()
        call()
        end.record()
        return lambda: begin.elapsed_time(end) / 1e3  # milliseconds

    def time(self, call: Callable[[], None]) -> float:
        elapsed = self.record(call)
        self.backend.synchronize()
        return elapsed()


def swap_in_kernel(backend: Backend) -> tuple[Callable[..., None], str]:
    """The kernel the engine runs (the fused zero-copy one where the backend has it), and its
    name."""
    kernel = backend.kernels.swap_in
    return kernel, f"{kernel.__module__}.{kernel.__name__}"


def fill_pool(pool: torch.Tensor) -> None:
    """Bytes that differ from row to row, so a wrong row cannot pass the byte check."""
    words = pool.view(torch.int32)
    rows, width = words.shape
    columns = torch.arange(width, dtype=torch.int32)[None, :] * 40503 + 7
    chunk = max(1, (64 << 20) // pool.shape[1])  # 64 MiB at a time: no pool-sized temporaries
    for start in range(0, rows, chunk):
        row_ids = torch.arange(start, min(start + chunk, rows), dtype=torch.int32)[:, None]
        # Multiplicative hashing (wraps in int32): cheap, and different in every word.
        words[start : start + row_ids.shape[0]] = row_ids * -1640531535 + columns


def page_table_for(layout: str, batch: int, sizes: SW1Sizes, rng: np.random.Generator
                   ) -> tuple[np.ndarray, int]:
    """(page_table [B, P], extent size) for a pool of exactly B x seq_len rows."""
    if layout == "scattered":
        # One-token extents: a page-table entry per token, at a random row of the pool.
        return rng.permutation(batch * sizes.seq_len).reshape(batch, sizes.seq_len), 1
    extents_per_request = sizes.seq_len // sizes.extent_tokens
    if layout == "extents":
        allocator = ExtentAllocator(batch * extents_per_request)
        table = [allocator.allocate(extents_per_request) for _ in range(batch)]
        return np.asarray(table, dtype=np.int64), sizes.extent_tokens
    if layout == SWEEP_LAYOUT:
        order = rng.permutation(batch * extents_per_request)
        return order.reshape(batch, extents_per_request), sizes.extent_tokens
    raise InvalidInputError(f"unknown host layout {layout!r}; use one of "
                            f"{', '.join((*LAYOUTS, SWEEP_LAYOUT))}")


def build_tables(
    backend: Backend, pool: torch.Tensor, layout: str, batch: int, sizes: SW1Sizes,
    rng: np.random.Generator, mirror: torch.Tensor | None = None,
    residency_map: ResidencyMap = "host_row", key_extents: bool = True,
) -> tuple[CacheTables, np.ndarray]:
    """One layer with B requests of seq_len tokens, hot buffers seeded (ARCHITECTURE.md), the
    residency map keyed by `residency_map`. `key_extents` (host_row): as the engine's default
    config builds them (`alias_extents` as many as the pool's extents, none taken: every key
    extent its own host extent), so that a miss reads its host row through `key_host_extent`;
    False: the plain host-row tables of `alias_extents: 0`.

    `mirror`: the pool's rows on the device, to seed the hot buffers from (faster than a
    host gather of B x (H+1) rows)."""
    device = backend.device()
    hot_slots, slots, n = sizes.hot_slots, sizes.hot_slots + 1, sizes.seq_len
    pages, extent = page_table_for(layout, batch, sizes, rng)
    host_rows = token_host_rows(pages, extent, n)  # [B, seq_len]
    num_rows = batch * n
    i32 = {"dtype": torch.int32, "device": device}
    host = pool[:num_rows]
    seeded = host_rows[:, n - 1 - hot_slots:]  # the H tokens before the newest, then the newest
    device_kv = torch.zeros(1, batch * slots, sizes.row_bytes, dtype=torch.uint8, device=device)
    source = host if mirror is None else mirror
    seeded_rows = torch.from_numpy(seeded.reshape(-1)).to(source.device)
    device_kv[0].view(batch, slots, -1).copy_(source[seeded_rows].view(batch, slots, -1))
    # The positions every page table maps (a pool of B x seq_len rows: as many keys either way).
    positions = pages.shape[1] * extent
    if residency_map == "position":
        lru_keys = (np.arange(batch)[:, None] * positions + np.arange(n - 1 - hot_slots, n - 1))
        num_keys = batch * positions
    else:
        lru_keys, num_keys = seeded[:, :hot_slots], num_rows
    key_host_extent = None
    if residency_map == "host_row" and key_extents:
        host_extents = -(-num_rows // extent)
        key_host_extent = unshared_key_extents(host_extents, host_extents, device)
        num_keys = 2 * host_extents * extent
    resident = torch.full((1, num_keys), -1, dtype=residency_dtype(hot_slots), device=device)
    resident[0, torch.from_numpy(lru_keys.reshape(-1)).to(device)] = torch.arange(
        hot_slots, dtype=resident.dtype, device=device).repeat(batch)
    tables = CacheTables(
        device_kv=device_kv,
        host_kv=[host],
        # Row-major copies: the kernels index these tables as contiguous rows, and numpy's
        # fancy indexing above can hand back column-major arrays (torch keeps their strides).
        page_table=torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int32)).to(device),
        seq_lens=torch.full((batch,), n, **i32),
        slot_key=torch.from_numpy(
            np.ascontiguousarray(lru_keys, dtype=np.int32)).to(device)[None],
        # The engine's seeded state: one stamp for all, ties by slot id (oldest token first).
        last_use=torch.full((1, batch, hot_slots), -1, **i32),
        lru_clock=torch.zeros(1, batch, **i32),
        resident=resident,
        counters=torch.zeros(1, 3, dtype=torch.int64, device=device),
        hot_slots=hot_slots,
        extent_tokens=extent,
        residency_map=residency_map,
        key_host_extent=key_host_extent,
    )
    return tables, host_rows


def token_host_rows(pages: np.ndarray, extent: int, seq_len: int) -> np.ndarray:
    positions = np.arange(seq_len)
    return pages[:, positions // extent] * extent + positions % extent


class ChurnTrace:
    """SW-1's top-k: each step keeps (1 - churn) of the previous one, in a new order, and takes
    the rest from positions not in the hot buffer, so that every step misses churn x top_k rows.

    Fresh positions cycle through a per-request permutation of the positions older than the
    seeded hot buffer. At churn 1.0 `SW1Sizes.check` makes the cycle long enough that the hot
    buffer has evicted a position before it comes round again; at lower churn one cycle takes
    (seq_len - 1 - H) / (churn x K) steps (SW-1 at churn 0.2: 70), and a position could
    still be resident when it comes back only if it stayed in the top-k for most of them.
    The seeded positions and the newest token are never selected."""

    def __init__(self, batch: int, sizes: SW1Sizes, churn: float, rng: np.random.Generator):
        self.rng = rng
        self.top_k = sizes.top_k
        self.fresh_per_step = round(churn * sizes.top_k)
        older = sizes.seq_len - 1 - sizes.hot_slots  # positions never seeded into a hot slot
        self.order = np.argsort(rng.random((batch, older)), axis=1)
        self.current = self.order[:, : sizes.top_k].copy()
        self.cursor = sizes.top_k

    def step(self) -> np.ndarray:
        fresh = self.fresh_per_step
        if fresh:
            span = self.order.shape[1]
            take = (self.cursor + np.arange(fresh)) % span
            self.cursor = (self.cursor + fresh) % span
            keep = self.rng.permuted(self.current, axis=1)[:, : self.top_k - fresh]
            self.current = np.concatenate([keep, self.order[:, take]], axis=1)
        return self.current.astype(np.int32)


def sw1_cell(
    backend: Backend, pool: torch.Tensor, layout: str, batch: int, churn: float,
    sizes: SW1Sizes, seed: int = 0, mirror: torch.Tensor | None = None,
    skip_io: bool = False, batch_capacity: int | None = None, flush: str = "write",
    kernel_for: Callable[[CacheTables, np.ndarray], SwapInFn] | None = None,
    residency_map: ResidencyMap = "host_row",
) -> SW1Cell:
    """One SW-1 cell: an untimed first step, `warmup_steps`, then `timed_steps` timed ones.

    Where the backend captures graphs the step is captured once and replayed (the launch cost
    a serving loop avoids the same way), else each step is launched eagerly. `mirror` (the
    pool on the device) checks every step's rows on the device; without it the last step's
    rows are checked on the host. `skip_io` then times as many steps planned without moving
    bytes (the skip-IO probe). `batch_capacity`: run the kernel over that many rows, those
    past `batch` padding (-1 top-k, as a graph captured at a larger batch runs it). `flush`:
    how the caches are evicted before each step (`CacheFlusher`). `kernel_for(tables,
    host_rows)`: another swap-in kernel to time on the same tables and trace (a peer's, for a
    side-by-side run); one that leaves `tables.counters` alone gets the trace's miss count,
    which SW-1's trace fixes at churn x K per row and step for any exact LRU. `residency_map`:
    what hisparse's residency map is keyed by (`CacheTables.residency_map`)."""
    rng = np.random.default_rng([seed, batch, round(churn * 1000),
                                 (*LAYOUTS, SWEEP_LAYOUT).index(layout)])
    capacity = batch if batch_capacity is None else batch_capacity
    _check_cell_options(batch, capacity, skip_io, kernel_for)
    tables, host_rows = build_tables(backend, pool, layout, batch, sizes, rng, mirror=mirror,
                                     residency_map=residency_map)
    kernel = swap_in_kernel(backend)[0] if kernel_for is None else kernel_for(tables, host_rows)
    trace = ChurnTrace(batch, sizes, churn, rng)
    steps = sizes.warmup_steps + sizes.timed_steps
    planned = sizes.timed_steps if skip_io else 0
    graphs = backend.features.supports(Feature.GRAPH_CAPTURE)
    timer = StepTimer(backend, backend.device(), queued=graphs)
    cell = CellSteps(backend, tables, host_rows, trace, batch, capacity, sizes.top_k, mirror,
                     graphs, timer, CacheFlusher(backend.device(), flush), 1 + steps + planned)
    elapsed, misses_after = cell.time_kernel(kernel, steps)
    times = [seconds() for seconds in elapsed[sizes.warmup_steps:]]
    misses = misses_after.diff()[sizes.warmup_steps:].tolist()
    counted_by = "kernel counters"
    if kernel_for is not None and not any(misses):
        misses, counted_by = [trace.fresh_per_step * batch] * len(misses), "trace"
    verified = cell.rows_verified(host_rows, steps)
    skip_io_seconds = cell.time_planning(1 + steps, planned) if skip_io else None
    verified = verified and cell.padding_untouched()  # padding returns nothing
    times.sort()
    step_seconds = statistics.median(times)
    p10_seconds, _ = spread(times)
    misses_per_step = statistics.mean(misses)
    return SW1Cell(
        layout=layout,
        batch=batch,
        churn=churn,
        step_seconds=step_seconds,
        p90_seconds=times[min(len(times) - 1, math.ceil(0.9 * len(times)) - 1)],
        p10_seconds=p10_seconds,
        misses_per_step=misses_per_step,
        miss_bytes_per_second=(misses_per_step * sizes.row_bytes / step_seconds
                               if misses_per_step else None),
        verified=verified,
        timing="graph replay" if graphs else "eager",
        extent_tokens=1 if layout == "scattered" else sizes.extent_tokens,
        skip_io_step_seconds=skip_io_seconds,
        batch_capacity=batch_capacity,
        misses_counted_by=counted_by,
        residency_map=residency_map,
    )


def _check_cell_options(batch: int, capacity: int, skip_io: bool,
                        kernel_for: Callable[..., SwapInFn] | None) -> None:
    if capacity < batch:
        raise InvalidInputError(f"batch_capacity {capacity} is smaller than the batch {batch}; "
                                "pass at least the batch size")
    if skip_io and kernel_for is not None:
        raise InvalidInputError("skip_io times hisparse's own planning, which cannot follow "
                                "another kernel (its tables are not hisparse's); pass one of "
                                "skip_io and kernel_for")


FLUSH_MODES = ("write", "read", "none")


class CacheFlusher:
    """Evicts the device's caches before a timed step, as a model's other layers would.

    Goes over a buffer of twice the last-level cache (CUDA and ROCm report its size; elsewhere
    256 MiB); nothing to do on a CPU, whose timings are host wall time anyway. "write" (SW-1's
    default) leaves every cached line dirty, so the step's own misses first write back what
    they evict: the worst case. "read" leaves clean lines, as streaming weights and keys do.
    "none" leaves the caches as the previous step left them: SW-1 with tables warm at churn 0
    (at churn 0 the same top-k every step, so the step's tables stay in L2)."""

    def __init__(self, device: torch.device, mode: str = "write") -> None:
        if mode not in FLUSH_MODES:
            raise InvalidInputError(f"unknown cache flush mode {mode!r}; use one of "
                                    f"{', '.join(FLUSH_MODES)}")
        self.mode = mode
        self.scratch: torch.Tensor | None = None
        if device.type == "cpu" or mode == "none":
            return
        size = 256 << 20
        if device.type == "cuda":
            size = max(2 * torch.cuda.get_device_properties(device).L2_cache_size, 64 << 20)
        self.scratch = torch.empty(size, dtype=torch.uint8, device=device)

    def flush(self) -> None:
        if self.scratch is None:
            return
        if self.mode == "write":
            self.scratch.fill_(1)
        else:
            self.scratch.amax()  # a reduction reads every byte and writes one


def run_sw1(
    backend: Backend,
    batches: Sequence[int],
    churns: Sequence[float],
    layouts: Sequence[str] = LAYOUTS,
    sizes: SW1Sizes | None = None,
    seed: int = 0,
    on_cell: Callable[[SW1Cell], None] | None = None,
    residency_map: ResidencyMap = "host_row",
) -> list[SW1Cell]:
    """Every (layout, batch, churn) cell over one host pool sized for the largest batch."""
    sizes = sizes or SW1Sizes()
    sizes.check()
    bad = [layout for layout in layouts if layout not in LAYOUTS]
    if bad:
        raise InvalidInputError(f"unknown host layouts {bad}; use {', '.join(LAYOUTS)}")
    cells = []
    with sw1_pool(backend, max(batches), sizes) as pool:
        for layout in layouts:
            for batch in batches:
                for churn in churns:
                    cell = sw1_cell(backend, pool, layout, batch, churn, sizes, seed,
                                    residency_map=residency_map)
                    cells.append(cell)
                    if on_cell is not None:
                        on_cell(cell)
    return cells


@contextlib.contextmanager
def sw1_pool(backend: Backend, max_batch: int, sizes: SW1Sizes) -> Iterator[torch.Tensor]:
    """SW-1's host pool for up to `max_batch` requests: registered rows filled by `fill_pool`,
    freed when the block ends (after the device has finished with them)."""
    rows = max_batch * sizes.seq_len
    raw = backend.alloc_host(rows * sizes.row_bytes)
    try:
        pool = raw.view(rows, sizes.row_bytes)
        fill_pool(pool)
        yield pool
    finally:
        backend.synchronize()
        backend.free_host(raw)


# --- copy limits ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CopyResult:
    name: str  # "bulk host-to-device", "bulk device-to-host", "gather"
    num_bytes: int
    rows: int | None  # gathered rows (None for bulk copies)
    seconds: float  # median
    bytes_per_second: float
    p10_seconds: float | None = None  # the spread of the repeats around the median
    p90_seconds: float | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def spread(samples: Sequence[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles of `samples` (linear interpolation, as numpy's default)."""
    if len(samples) < 2:
        return samples[0], samples[0]
    deciles = statistics.quantiles(samples, n=10, method="inclusive")
    return deciles[0], deciles[-1]


def _timed(seconds: list[float]) -> dict[str, float]:
    """CopyResult's timing fields from the repeats' seconds."""
    p10, p90 = spread(seconds)
    return {"seconds": statistics.median(seconds), "p10_seconds": p10, "p90_seconds": p90}


def bulk_copies(backend: Backend, num_bytes: int, repeats: int = 5) -> list[CopyResult]:
    """One large copy each way between a backend host buffer and a device tensor."""
    device = backend.device()
    host = backend.alloc_host(num_bytes)
    try:
        target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        timer = StepTimer(backend, device)
        results = []
        for name, copy in (
            ("bulk host-to-device", lambda: target.copy_(host, non_blocking=True)),
            ("bulk device-to-host", lambda: host.copy_(target, non_blocking=True)),
        ):
            copy()  # first touch and any lazy setup
            backend.synchronize()
            timed = _timed([timer.time(copy) for _ in range(repeats)])
            results.append(CopyResult(name, num_bytes, None, bytes_per_second=num_bytes
                                      / timed["seconds"], **timed))
        return results
    finally:
        backend.synchronize()
        backend.free_host(host)


def scattered_gather(
    backend: Backend, pool_bytes: int, row_counts: Sequence[int], row_bytes: int = 656,
    repeats: int = 5, seed: int = 0,
) -> list[CopyResult]:
    """Random rows of a host pool into device rows with the backend's planned-copy kernel
    (the copy half of swap-in): the rate a miss can be served at."""
    device = backend.device()
    rows_in_pool = pool_bytes // row_bytes
    if max(row_counts) > rows_in_pool:
        raise InvalidInputError(f"cannot gather {max(row_counts)} distinct rows from a pool of "
                                f"{rows_in_pool}; raise the pool size or gather fewer rows")
    rng = np.random.default_rng(seed)
    top_k = 2048
    raw = backend.alloc_host(rows_in_pool * row_bytes)
    try:
        pool = raw.view(rows_in_pool, row_bytes)
        fill_pool(pool)
        copy = backend.kernels.copy_planned
        timer = StepTimer(backend, device)
        results = []
        for count in row_counts:
            batch = -(-count // top_k)
            tables = copy_only_tables(pool, batch * top_k, device)
            plan = MissPlan.empty(batch, top_k, device)
            src = np.zeros(batch * top_k, dtype=np.int64)  # past `count`: left out by counts
            src[:count] = rng.choice(rows_in_pool, size=count, replace=False)
            plan.src.copy_(torch.from_numpy(src.astype(np.int32)).view(batch, top_k))
            plan.dst.copy_(torch.arange(batch * top_k, dtype=torch.int32).view(batch, top_k))
            counts = np.minimum(top_k, np.maximum(0, count - top_k * np.arange(batch)))
            plan.count.copy_(torch.from_numpy(counts.astype(np.int32)))
            copy(tables, 0, plan)
            backend.synchronize()
            timed = _timed([timer.time(lambda t=tables, p=plan: copy(t, 0, p))
                            for _ in range(repeats)])
            got = tables.device_kv[0][:count].cpu()
            if not torch.equal(got, pool[torch.from_numpy(src[:count])]):
                raise AssertionError(f"gather of {count} rows returned wrong bytes")
            moved = count * row_bytes
            results.append(CopyResult("gather", moved, count,
                                      bytes_per_second=moved / timed["seconds"], **timed))
        return results
    finally:
        backend.synchronize()
        backend.free_host(raw)


def copy_only_tables(pool: torch.Tensor, rows: int, device: torch.device) -> CacheTables:
    """Tables that only the copy kernels read: host rows and `rows` device rows."""
    one = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    return CacheTables(
        device_kv=torch.zeros(1, rows, pool.shape[1], dtype=torch.uint8, device=device),
        host_kv=[pool],
        page_table=one[0],
        seq_lens=one[0, 0],
        slot_key=one,
        last_use=one,
        lru_clock=one[0],
        resident=one[0],
        counters=torch.zeros(1, 3, dtype=torch.int64, device=device),
        hot_slots=1,
        extent_tokens=1,
    )


def run_environment(device: str) -> dict[str, object]:
    """What produced a benchmark's numbers, for its JSON: python, torch, triton, cores, the
    card, its runtime versions, the launch tuning (PDL on or off) and the hisparse commit."""
    info: dict[str, object] = {"python": platform.python_version(), "torch": torch.__version__,
                               "triton": None, "cpu_count": os.cpu_count(),
                               "tuning": asdict(current_tuning())}
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    if device.startswith("cuda") and torch.cuda.is_available():
        info["card"] = torch.cuda.get_device_name()
        info["cuda_runtime"] = torch.version.cuda
    with contextlib.suppress(Exception):  # versions are context, never a reason to fail
        from hisparse.backends.registry import get_backend

        info.update(get_backend(device).runtime_versions())
    info["hisparse_commit"] = source_commit()
    return info


# `git archive` writes the commit into this file (.gitattributes: export-subst); a checkout
# keeps the placeholder, and git itself is asked.
ARCHIVED_COMMIT = Path(__file__).with_name("archived_commit.txt")


def source_commit() -> str | None:
    """The commit of this source tree: the one `git archive` exported it from, else the HEAD
    of the checkout it sits in (None where neither is known). An exported tree inside another
    checkout (the GPU runs' snapshot) would otherwise report that checkout's HEAD."""
    with contextlib.suppress(OSError):
        archived = ARCHIVED_COMMIT.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{40}", archived):
            return archived
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
