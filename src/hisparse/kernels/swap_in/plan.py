"""Every path choice of a swap-in, made once per shape: the launch plan, and the tuning it reads.

`plan_launch` turns (tables, batch rows, top-k, the device's capabilities) into a frozen
`LaunchPlan`: chunking, programmatic dependent launch, the copy variant, address order, grids
and warps. The launcher computes one per shape it sees and keeps it, so the path a shape takes
is one object that can be printed (`str(plan)`) and tested, instead of thresholds read at
every launch. The thresholds themselves are `Tuning`, as measured on an H200. (No triton
import here: the backends read `DeviceTraits` without it.)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

CopyVariant = Literal["prefetched", "planned", "none"]


@dataclass(frozen=True)
class Tuning:
    """Launch parameters, as measured on an H200 with SW-1 (benchmarks/NOTES.md; the A/B
    rounds that chose them are benchmarks/results/swap-in-ab-*.json and git history)."""

    # Request slot, top-k row and page table loaded without waiting for num_real and seq_len:
    # two dependent global round trips less per program (-0.5 us at B=1).
    early_loads: bool = True
    # Hit/miss/invalid counters added without acquire/release fences: -1 us on every step
    # from B=16 on, -0.3..-0.6 at B=1 (H200; the classify grid is Bcap x 8 programs).
    relaxed_counters: bool = True
    # The victim selection takes this many stamp values oldest first (a min and a count per
    # value) before it falls back to a search over the stamp bits (one block reduction per
    # bit of the stamp range). A step stamps all its slots alike, so on SW-1 the oldest
    # slots share one or two values. H200 (benchmarks/NOTES.md, thirteenth pass): 2 rounds
    # against the bit search alone, B=1 churn 0.05 16.1-16.8 -> 14.1-14.5 us, B=16 41-42
    # -> 39-40 us.
    select_fast_rounds: int = 2
    # Warps of a selection program, which holds its row's H stamps and K entries in registers;
    # rows wider than 512 per warp get more warps, up to 32. H200: 8 for the old list plan (4:
    # +7 us per step at B=1; 16: no gain).
    select_warps: int = 8
    classify_chunk_k: int = 256
    # Up to Bcap `small_batch_max` the classify grid uses this chunk instead (None: the one
    # above): at B=1, 32 programs spread the lookups over more SMs than 8. H200: -0.5..-1 us
    # on every B=1 cell, B=16 within 0.3 us; at B=128 (4096 programs) the warm miss-free step
    # took 2.6 us longer, hence small batches only.
    small_batch_classify_chunk_k: int | None = 64
    small_batch_max: int = 16
    classify_warps: int = 4
    # 2 rows x 2 warps per iteration. 8 programs per SM rather than 32 (the copy_limits.py
    # sweep's pick): H200, miss-free B=128 step 17.7 -> 15.9 us, extents c=0.2 at B=128
    # 39 -> 42 GB/s, c=1.0 47.1 -> 45.7 GB/s; B=1 unchanged (1056 programs still cover
    # 2048 rows in one pass).
    copy_rows: int = 2
    copy_warps: int = 2
    copy_programs_per_unit: int = 8  # copy programs per SM / CU
    # From this batch capacity on, `large_batch_copy_programs_per_unit` instead (None: never).
    # It depends on Bcap alone, so a captured graph keeps it. The width sets how many rows are
    # in flight at once: more hides host latency, fewer keeps the link's reads within fewer
    # requests' extents. H200, extents B=128: 1 per SM (264 rows in flight) c=0.2 838 ->
    # 780 us, c=1.0 -2%; 2 per SM 787-805 us; 4 no gain; scattered B=64 -2% with 1 per SM;
    # 16-32 per SM gave scattered B=128 +1-2% but cost extents. Below B=64 no change.
    large_batch_copy_min_batch: int | None = 64
    large_batch_copy_programs_per_unit: int = 1
    # Large-batch copies over a page table of extents up to `fine_extent_max_tokens` tokens
    # (token-granular tables such as SGLang's: rows scattered over the pool) use this width
    # instead (None: the one above). With the plan in batch-row order, 4 per SM gave
    # scattered B=64 / 128 -1..-3% (round fine-extent-copy); in address order the narrow
    # window wins there too (round address-order-2, B=128 churn 0.05 / 0.2 / 1.0: 4 per SM
    # 317 / 828 / 3797 us, 1 per SM 297 / 757 / 3685).
    fine_extent_copy_programs_per_unit: int | None = None
    fine_extent_max_tokens: int = 16
    # Warps of a large-batch copy program (None: copy_warps). Meant to keep a copy launched
    # early (PDL) from crowding onto the SMs the plan leaves idle; H200 (round copy-pdl-wide):
    # 32 warps cost extents B=128 churn 0.2 10% with or without PDL, 16 warps with PDL 3%,
    # and the miss-free step gained at most 0.6 us, so it stays off.
    large_batch_copy_warps: int | None = None
    # Programmatic dependent launch between our kernels (NVIDIA sm_90+), where True and the
    # device and triton support it: the classify kernel lets the selection launch at its
    # start, the selection lets the copy launch once it has waited for the classify grid, and
    # each waits on the device (griddepcontrol) before it reads what the previous wrote
    # (tests/test_pdl_launch_order.py). Off by default until the fix of the race it exposed
    # in the selection (select.py, the counts' barrier) has run clean on a shared GPU: it
    # saves 4.5-12.7 us a call at B <= 16 with misses (benchmarks/NOTES.md, thirty-third pass).
    pdl: bool = False
    # The copy is launched that way only up to this batch capacity (None: always; 0: never).
    pdl_copy_max_batch: int | None = 16
    # Up to this batch capacity (None: always; 0: never) the copy walks the top-k entries
    # instead of the plan, with the lookups split: a miss's host row is known once the
    # classify kernel is done, so with PDL each copy program fetches its first rows over the
    # link while the selection still chooses victims. One pass over the entries needs
    # Bcap x K <= copy programs x copy_rows; past that the later passes overlap nothing.
    # Measured on the H200 at B=1 (benchmarks/NOTES.md, eighth pass) and, since programs take
    # more rows instead of passes, at B=16 (twenty-sixth pass): faster wherever a step misses,
    # at the price of ~2.5 us on a miss-free B=16 step (its 4096 programs find nothing).
    prefetch_copy_max_batch: int | None = 16
    # A prefetched copy takes up to this many programs per SM (instead of
    # copy_programs_per_unit), so that one pass covers a verify row's S x K entries as it
    # covers a K = 2048 row: a verify row's misses lie all over it, and every pass after the
    # first fetches its rows only after the selection (benchmarks/NOTES.md, twenty-fifth
    # pass). 32 programs of 2 warps fill an SM's 64 warps.
    prefetch_copy_programs_per_unit: int = 32
    # A verify row's first-entry test reads the presence table only for the misses that were
    # their position's smallest entry when they claimed it: the lookup points every other miss
    # at the smaller entry it found, and the copy follows those pointers to the first entry's
    # slot. About a third of the table reads at S = 8 with 90%-overlapping rows; measured
    # faster or level in every SW-2 cell at B = 1 and 16 (benchmarks/NOTES.md, twenty-sixth pass).
    verify_first_candidates: bool = True
    # From this batch capacity on (None: never), the selection writes the plan in host-address
    # order (`address_buckets` equal ranges of the layer's host rows, ascending) instead of
    # batch row by batch row, and the copy reads the pool front to back. Misses scattered over
    # a large pool then share the link's address translations. H200, the planned copy of
    # fresh random rows of a 2.56 GiB pool (benchmarks/NOTES.md, fourteenth pass): 13056 /
    # 52480 / 262144 rows 371 / 1336 / 5978 us as drawn, 293 / 811 / 3731 us in 256 buckets.
    # SW-1 scattered B=128 churn 0.05 / 0.2 / 1.0 (round address-order-2): 396 / 1398 / 6191
    # -> 317 / 828 / 3797 us; from B=16 it cost 3-15 us (round address-order).
    address_order_min_batch: int | None = 64
    # ...over a page table of extents up to this many tokens (None: any): an extent pool
    # already keeps each request's rows together, and the bucket work cost it 0.5-2% there.
    address_order_max_extent_tokens: int | None = 16
    # A power of two. More buckets, less contention on each bucket's count: SW-1 scattered
    # B=128 churn 1.0 256 / 1024 / 4096 buckets 3849 / 3797 / 3814 us (4096: +1.4 us on the
    # miss-free step).
    address_buckets: int = 1024
    interpreter_copy_programs: int = 2  # each program costs ~1 ms under TRITON_INTERPRET=1


_tuning = Tuning()


@contextlib.contextmanager
def tuning(**overrides: object) -> Iterator[Tuning]:
    """Temporarily change launch parameters (benchmarks and tests; not thread-safe)."""
    global _tuning
    previous = _tuning
    _tuning = dataclasses.replace(previous, **overrides)
    try:
        yield _tuning
    finally:
        _tuning = previous


def current_tuning() -> Tuning:
    return _tuning


@dataclass(frozen=True)
class DeviceTraits:
    """What a plan needs to know of the device: from the backend, not from the kernels."""

    compute_units: int  # SMs / CUs / Xe cores
    pdl: bool  # programmatic dependent launch (backend feature, device and triton permitting)
    interpreted: bool  # TRITON_INTERPRET=1 on the CPU: keep grids tiny
    # Launches may skip triton's dispatch after their first (kernels.launching): backends whose
    # launcher takes raw addresses as triton 3.3+ calls it (CUDA, ROCm).
    direct_launch: bool = False
    # Lanes per warp / wavefront: 32 on NVIDIA, 64 on AMD. A program has at most 1024 lanes.
    warp_size: int = 32


@dataclass(frozen=True)
class LauncherCapabilities:
    """What a bound swap-in launcher can do beyond the swap-in itself (the step plan reads
    this record, never the launcher's attributes)."""

    writes_newest: bool = False  # `swap_in(..., newest_kv)` writes the new rows in its lookup
    backs_up_newest: bool = False  # ... and to their host rows too
    fuses_union: bool = False  # de-duplicates a verify width's flattened rows itself


@dataclass(frozen=True)
class CopyPlan:
    """The copy of one call's misses (or a replay of a plan): which kernel and its grid."""

    variant: CopyVariant
    programs: int
    warps: int
    rows_per_iteration: int
    pdl: bool  # launched as a programmatic dependent of the selection


@dataclass(frozen=True)
class LaunchPlan:
    """The three launches of a swap-in over `rows` batch rows of `top_k` entries."""

    rows: int
    top_k: int
    hot_slots: int
    position_keyed: bool
    early_loads: bool
    counter_sem: str  # memory order of the counter atomics
    pdl: bool  # between classify and select (and select and copy, where copy.pdl)
    classify_chunk: int
    classify_grid: tuple[int, int]
    classify_warps: int
    select_warps: int
    select_fast_rounds: int
    block_k: int
    block_h: int
    address_order: bool
    address_buckets: int
    copy: CopyPlan
    # Where a verify row's union is completed (copy.py, `_complete_union`): by the copy, or
    # (no copy, or the large-batch copy's one program per SM, which walked 2 M entries at
    # B = 128, S = 8 in 300 us) by a kernel of its own between the selection and the copy.
    union_completion: Literal["copy", "own kernel"] = "copy"
    # Tuning.verify_first_candidates: the lookup points later misses at earlier entries.
    first_candidates: bool = False
    # Keyed by host row through key extents (shared prefixes): a miss reads its host row
    # through `key_host_extent`, and the selection its key through the page table.
    key_extents: bool = False

    @property
    def keys(self) -> str:
        """What the residency map is keyed by, as `str(plan)` names it."""
        return "position" if self.position_keyed else "key row" if self.key_extents else (
            "host row")

    def __str__(self) -> str:
        copy = self.copy
        order = (f"in host-address order ({self.address_buckets} buckets)" if self.address_order
                 else "by batch row")
        return (
            f"swap-in plan B={self.rows} K={self.top_k} H={self.hot_slots}"
            f" keys={self.keys}\n"
            f"  classify: grid {self.classify_grid[0]}x{self.classify_grid[1]} (chunk "
            f"{self.classify_chunk}), {self.classify_warps} warps, counters {self.counter_sem}"
            f"{', early loads' if self.early_loads else ''}\n"
            f"  select:   grid {self.rows}, {self.select_warps} warps, {self.select_fast_rounds}"
            f" fast rounds, plan {order}{', PDL behind classify' if self.pdl else ''}\n"
            f"  copy:     {copy.variant}, {copy.programs} programs x {copy.warps} warps, "
            f"{copy.rows_per_iteration} rows each{', PDL behind select' if copy.pdl else ''}\n"
            f"  a verify row's union completed by {self.union_completion}"
            f"{', first entries among candidates' if self.first_candidates else ''}"
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _within(rows: int, limit: int | None) -> bool:
    return limit is None or rows <= limit


def copy_plan(rows: int, top_k: int, extent_tokens: int, device: DeviceTraits,
              variant: CopyVariant, pdl: bool, tune: Tuning) -> CopyPlan:
    """The copy's grid over `rows` batch rows of a host layout of `extent_tokens`-token
    extents (Tuning's copy fields say why each width)."""
    large = _large_batch(rows, tune)
    if device.interpreted:
        max_programs = tune.interpreter_copy_programs
    else:
        per_unit = tune.large_batch_copy_programs_per_unit if large else tune.copy_programs_per_unit
        if variant == "prefetched":
            per_unit = tune.prefetch_copy_programs_per_unit
        if (large and tune.fine_extent_copy_programs_per_unit is not None
                and extent_tokens <= tune.fine_extent_max_tokens):
            per_unit = tune.fine_extent_copy_programs_per_unit
        max_programs = device.compute_units * per_unit
    warps = tune.large_batch_copy_warps if large and tune.large_batch_copy_warps else (
        tune.copy_warps)
    rows_each = tune.copy_rows
    if variant == "prefetched" and not device.interpreted:
        # Where the widest grid still needs two passes (S = 8), more rows per program instead:
        # the whole row's host reads then fly before the selection is done.
        rows_each *= _next_power_of_2(_cdiv(rows * top_k, max_programs * tune.copy_rows))
    programs = max(1, min(_cdiv(rows * top_k, rows_each), max_programs))
    return CopyPlan(variant, programs, warps, rows_each, pdl)


def plan_launch(rows: int, top_k: int, hot_slots: int, extent_tokens: int,
                position_keyed: bool, device: DeviceTraits, skip_io: bool = False,
                tune: Tuning | None = None, key_extents: bool = False) -> LaunchPlan:
    """The launch plan of a swap-in over `rows` batch rows (the grids' batch size)."""
    tune = tune or _tuning
    pdl = device.pdl and tune.pdl
    chunk = tune.classify_chunk_k
    if tune.small_batch_classify_chunk_k is not None and rows <= tune.small_batch_max:
        chunk = tune.small_batch_classify_chunk_k
    chunk = min(_next_power_of_2(top_k), chunk)
    order_min, fine = tune.address_order_min_batch, tune.address_order_max_extent_tokens
    address_order = (order_min is not None and rows >= order_min
                     and (fine is None or extent_tokens <= fine))
    block_k, block_h = _next_power_of_2(top_k), _next_power_of_2(hot_slots)
    if skip_io:
        variant: CopyVariant = "none"
    elif _within(rows, tune.prefetch_copy_max_batch):
        variant = "prefetched"
    else:
        variant = "planned"
    return LaunchPlan(
        rows=rows, top_k=top_k, hot_slots=hot_slots, position_keyed=position_keyed,
        early_loads=tune.early_loads,
        counter_sem="relaxed" if tune.relaxed_counters else "acq_rel",
        pdl=pdl, classify_chunk=chunk, classify_grid=(rows, _cdiv(top_k, chunk)),
        classify_warps=tune.classify_warps,
        select_warps=min(1024 // device.warp_size,
                         max(tune.select_warps, max(block_h, block_k) // (32 * 16))),
        select_fast_rounds=tune.select_fast_rounds, block_k=block_k, block_h=block_h,
        address_order=address_order, address_buckets=tune.address_buckets,
        copy=copy_plan(rows, top_k, extent_tokens, device, variant,
                       pdl and _within(rows, tune.pdl_copy_max_batch), tune),
        union_completion="own kernel" if variant == "none" or _large_batch(rows, tune) else (
            "copy"),
        first_candidates=tune.verify_first_candidates,
        key_extents=key_extents and not position_keyed,
    )


def _large_batch(rows: int, tune: Tuning) -> bool:
    threshold = tune.large_batch_copy_min_batch
    return threshold is not None and rows >= threshold


def replay_plan(rows: int, top_k: int, extent_tokens: int, device: DeviceTraits,
                tune: Tuning | None = None) -> CopyPlan:
    """The copy that replays a recorded miss plan into a follower layer. Never a dependent
    launch: it follows an event wait or foreign work, not our selection kernel."""
    return copy_plan(rows, top_k, extent_tokens, device, "planned", False, tune or _tuning)
