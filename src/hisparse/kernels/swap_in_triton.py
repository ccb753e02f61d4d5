"""Swap-in and planned copy in Triton, reading host rows in place (zero-copy over the link).

Same signature and semantics as `kernels/swap_in_reference.py` (docs/ARCHITECTURE.md). Three
launches, each with a grid fixed by `Bcap` and `K` so that a CUDA graph can capture them and
replay with another `num_real`:

1. classify: grid (Bcap, K / chunk). Each top-k entry is resolved through the persistent
   `resident` map, keyed by host row (through `page_table`) or by position (the page table
   read for misses alone): short regime, newest slot, hit, miss or invalid. A hit stamps
   its slot with the request's LRU clock (`last_use`), which is all the LRU work a hit needs;
   misses are counted per batch row (and, for a plan in address order, per address bucket).
2. select: one program per batch row. It owns all LRU state of its request (two rows of a batch
   never share a request slot), so the LRU needs no atomics. A row without misses only
   advances its clock. A row with M misses takes the M slots with the oldest stamps below the
   clock (ties by slot id): the oldest stamp values first, a search over the stamp bits where
   a few values do not settle it; it gives them to the misses in slot order and writes
   `slot_key`, `resident`, the stamps, the miss outputs and the miss plan: batch row by batch
   row, or (large batches of scattered rows) in host-address order.
3. copy: a fixed number of programs per SM walk the flattened list of the plan in order, so a
   single request's misses spread over the whole GPU instead of one block. Rows
   move as int32 words; a 656-byte row is 41 aligned 16-byte vectors. At B=1 the copy walks
   the top-k entries instead and fetches host rows while the selection runs.

Host rows come from `tables.host_kv[layer]`, a registered (pinned) CPU tensor: the Triton
launchers of CUDA and ROCm turn such a pointer into its device-accessible address.
Scratch buffers are allocated once per (tables, Bcap, K) and reused; call once before graph
capture so that allocation and compilation happen outside the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hisparse.core.tables import CacheTables, MissPlan, residency_dtype
from hisparse.core.widths import INT16_MAX_HOT_SLOTS, RESIDENCY_MAPS
from hisparse.errors import InvalidInputError

try:  # grid dependency control (programmatic dependent launch): NVIDIA sm_90+, triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE_GDC = True
except ImportError:  # the kernels only call these under USE_PDL, which is then never set
    _HAVE_GDC = False

    @triton.jit
    def gdc_wait() -> None:
        pass

    @triton.jit
    def gdc_launch_dependents() -> None:
        pass


# Above every stamp a clock reaches (it advances once per decode step).
_NO_STAMP = tl.constexpr(2**31 - 1)


@triton.jit
def _row_context(
    b,
    num_real_ptr,  # [1] int32: rows >= num_real are padding
    req_slots_ptr,  # [Bcap] int32 request slot per batch row
    seq_lens_ptr,  # [R] int32 tokens per request slot
    R,
    S,
    EARLY_LOADS: tl.constexpr,
):
    if EARLY_LOADS:
        # b < Bcap always, so the request slot needs no mask and its load flies together with
        # num_real's instead of after it (one global round trip less).
        real = b < tl.load(num_real_ptr)
        r = tl.load(req_slots_ptr + b)
    else:
        real = b < tl.load(num_real_ptr)
        r = tl.load(req_slots_ptr + b, mask=real, other=0)
    # A bad slot on a real row is the caller's bug; treating the row as padding keeps every
    # access in bounds (the engine's validate mode rejects it before the call).
    real = real & (r >= 0) & (r < R)
    r = tl.where(real, r, 0)
    n = tl.load(seq_lens_ptr + r, mask=real, other=0)
    return real, r, n, r * S


@triton.jit
def _entry_regime(pos, n, base, H):
    """What a top-k position needs before any lookup: (valid, invalid, the device row of a
    short-regime entry or of the newest token (-1 elsewhere), and whether the hot buffer's
    map must be asked: a long-regime position other than the newest)."""
    valid = (pos >= 0) & (pos < n)  # padding rows read -1 and have n = 0: neither flag is set
    invalid = (pos < -1) | (pos >= n)
    long_seq = n > H
    newest = valid & (pos == n - 1)
    result = tl.where(long_seq, tl.where(newest, base + H, -1), tl.where(valid, base + pos, -1))
    candidate = tl.where(long_seq, valid & (pos != n - 1), False)
    return valid, invalid, result, candidate


@triton.jit
def _lookup_chunk(
    b,
    k_offsets,
    real,
    r,
    n,
    base,
    top_k_ptr,  # [Bcap, K] int32 positions, -1 = none
    page_table_ptr,  # [R, P] int32 extent ids
    resident_ptr,  # [N] or [R * T] int16 / int32 hot slot per residency key (this group)
    K,
    H,
    E,
    P,
    N,
    T,  # positions per request (keys by position: r * T + position)
    EARLY_LOADS: tl.constexpr,
    POSITION_KEYED: tl.constexpr,
):
    """Resolve top-k entries: the device row of every non-miss (-1 for none/invalid), the hit
    slot / host row of long-regime entries, and each entry's code (`_entry_codes`)."""
    in_k = k_offsets < K
    if EARLY_LOADS:
        # Neither load waits for num_real or seq_len: the top-k row is read unconditionally
        # and the page table is masked by position alone (r is already clamped in range).
        pos = tl.load(top_k_ptr + b * K + k_offsets, mask=in_k, other=-1)
        pos = tl.where(real, pos, -1)
        if not POSITION_KEYED:  # keyed by position, the page table is read for misses alone
            page_index = pos // E
            page = tl.load(page_table_ptr + r.to(tl.int64) * P + page_index,
                           mask=(pos >= 0) & (page_index < P), other=-1)
    else:
        # Scalar conditions enter vectors through tl.where: `vector & scalar` gives an integer
        # mask under TRITON_INTERPRET=1 (triton 3.9), which tl.load rejects.
        pos = tl.load(top_k_ptr + b * K + k_offsets, mask=tl.where(real, in_k, False),
                      other=-1)
    valid, invalid, result, candidate = _entry_regime(pos, n, base, H)
    if POSITION_KEYED:
        # A hit needs no host row; a position the page table cannot map is lost (below).
        lost = candidate & (pos >= T)
        candidate = candidate & ~lost
        slot = tl.load(resident_ptr + r.to(tl.int64) * T + pos, mask=candidate,
                       other=-1).to(tl.int32)
        hit = candidate & (slot >= 0) & (slot < H)
        miss = candidate & (slot < 0)
        page_index = pos // E
        page = tl.load(page_table_ptr + r.to(tl.int64) * P + page_index, mask=miss, other=-1)
        row = page * E + pos % E
        no_row = miss & ((page < 0) | (row >= N))
        lost = lost | no_row
        miss = miss & ~no_row
    else:
        if not EARLY_LOADS:
            page_index = pos // E
            page = tl.load(page_table_ptr + r.to(tl.int64) * P + page_index,
                           mask=candidate & (page_index < P), other=-1)
        row = page * E + pos % E
        # A position without a host row would be an engine bug; counting it as invalid keeps
        # the kernel in bounds instead of copying from a wild address.
        lost = candidate & ((page < 0) | (row >= N))
        candidate = candidate & ~lost
        slot = tl.load(resident_ptr + row, mask=candidate, other=-1).to(tl.int32)
        hit = candidate & (slot >= 0) & (slot < H)
        miss = candidate & (slot < 0)
    result = tl.where(hit, base + slot, result)
    code = _entry_codes(miss, row, valid & ~miss & ~lost, invalid | lost)
    return in_k, result, hit, slot, miss, row, code


@triton.jit
def _entry_codes(miss, row, served, invalid):
    """What `miss_row` holds per top-k entry: a miss's host row (>= 0); else -3 served (hit,
    short regime or newest token), -2 invalid, -1 no entry. The selection and the prefetching
    copy read the misses from it."""
    return tl.where(miss, row, tl.where(served, -3, tl.where(invalid, -2, -1)))


@triton.jit
def _count_codes(code):
    """(hits, misses, invalid) among entry codes; hits count every served entry."""
    n_hit = tl.sum((code == -3).to(tl.int32), axis=0)
    n_miss = tl.sum((code >= 0).to(tl.int32), axis=0)
    n_invalid = tl.sum((code == -2).to(tl.int32), axis=0)
    return n_hit, n_miss, n_invalid


@triton.jit
def _address_bucket(row, N, NUM_BUCKETS: tl.constexpr):
    """Which of NUM_BUCKETS equal ranges of the layer's N host rows `row` lies in."""
    return (row.to(tl.int64) * NUM_BUCKETS // N).to(tl.int32)


@triton.jit
def _add_counters(counters_ptr, n_hit, n_miss, n_invalid, SEM: tl.constexpr):
    tl.atomic_add(counters_ptr + 0, n_hit.to(tl.int64), mask=n_hit != 0, sem=SEM)
    tl.atomic_add(counters_ptr + 1, n_miss.to(tl.int64), mask=n_miss != 0, sem=SEM)
    tl.atomic_add(counters_ptr + 2, n_invalid.to(tl.int64), mask=n_invalid != 0, sem=SEM)


@triton.jit
def _classify_kernel(
    num_real_ptr, req_slots_ptr, seq_lens_ptr, top_k_ptr, out_ptr, page_table_ptr,
    resident_ptr,  # [N] or [R * T] int16 / int32 this group's residency map
    last_use_ptr,  # [R, H] int32 this group's LRU stamps
    lru_clock_ptr,  # [R] int32 this group's LRU clocks
    miss_row_ptr,  # [Bcap, K] int32 scratch: each entry's code (_entry_codes)
    miss_count_ptr,  # [Bcap] int32 scratch: misses per batch row (zero between calls)
    counters_ptr,  # [3] int64 this layer's counters
    bucket_count_ptr,  # [NUM_BUCKETS] int32 scratch: misses per host-address bucket (zero
    # between calls; ADDRESS_ORDER only)
    R, S, K, H, E, P, N, T,
    EARLY_LOADS: tl.constexpr,
    POSITION_KEYED: tl.constexpr,  # resident is indexed by r * T + position, not by host row
    USE_PDL: tl.constexpr,
    COUNTER_SEM: tl.constexpr,  # atomics' memory order
    CHUNK_K: tl.constexpr,
    ADDRESS_ORDER: tl.constexpr,  # the selection writes the plan in host-address order
    NUM_BUCKETS: tl.constexpr,
):
    if USE_PDL:  # the selection kernel may start now: it waits (gdc_wait) before our output
        gdc_launch_dependents()
    b = tl.program_id(0)
    real, r, n, base = _row_context(b, num_real_ptr, req_slots_ptr, seq_lens_ptr, R, S,
                                    EARLY_LOADS)
    clock = tl.load(lru_clock_ptr + r)
    k_offsets = tl.program_id(1) * CHUNK_K + tl.arange(0, CHUNK_K)
    in_k, result, hit, slot, miss, row, code = _lookup_chunk(
        b, k_offsets, real, r, n, base, top_k_ptr, page_table_ptr, resident_ptr,
        K, H, E, P, N, T, EARLY_LOADS, POSITION_KEYED,
    )
    if ADDRESS_ORDER:
        tl.atomic_add(bucket_count_ptr + _address_bucket(row, N, NUM_BUCKETS),
                      tl.full(row.shape, 1, tl.int32), mask=miss, sem=COUNTER_SEM)
    tl.store(out_ptr + b * K + k_offsets, result, mask=in_k)
    tl.store(miss_row_ptr + b * K + k_offsets, code, mask=in_k)
    # A hit is the whole LRU update of its slot: it takes the clock's value.
    tl.store(last_use_ptr + r.to(tl.int64) * H + slot, tl.zeros(slot.shape, tl.int32) + clock,
             mask=hit)
    # One count of the chunk's codes serves the layer's counters and the row's miss count.
    n_hit, n_miss, n_invalid = _count_codes(code)
    _add_counters(counters_ptr, n_hit, n_miss, n_invalid, COUNTER_SEM)
    tl.atomic_add(miss_count_ptr + b, n_miss, mask=n_miss > 0, sem=COUNTER_SEM)


@triton.jit
def _select_victims(
    b, r, clock, num_misses, base,
    last_use_ptr, slot_key_ptr, resident_ptr, miss_row_ptr, top_k_ptr, out_ptr,
    order_ptr,  # [Bcap, H] int32 scratch: the victims in slot order
    plan_src_ptr, plan_dst_ptr, plan_stride,
    bucket_count_ptr, bucket_cursor_ptr, row_buckets_ptr,
    K, H, N, T, NUM_KEYS,
    FAST_ROUNDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ADDRESS_ORDER: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    POSITION_KEYED: tl.constexpr,
):
    """Give the misses of row b the slots with the oldest stamps below the clock (ties by
    slot id), in slot order, install them, and return how many were installed."""
    h = tl.arange(0, BLOCK_H)
    in_h = h < H
    k = tl.arange(0, BLOCK_K)
    stamp_row = last_use_ptr + r.to(tl.int64) * H
    # Everything this row reads, in flight together.
    stamps = tl.load(stamp_row + h, mask=in_h, other=0)
    keys_by_slot = tl.load(slot_key_ptr + r.to(tl.int64) * H + h, mask=in_h, other=-1)
    row = tl.load(miss_row_ptr + b * K + k, mask=k < K, other=-1)
    # A statement, not a conditional expression: that would load the top-k row either way.
    if POSITION_KEYED:  # noqa: SIM108
        key = r * T + tl.load(top_k_ptr + b * K + k, mask=k < K, other=0)
    else:
        key = row
    candidate = in_h & (stamps < clock)  # this step's hits carry the clock
    # H >= K leaves at least M candidates; the minimum only keeps us in bounds.
    installed = tl.minimum(num_misses, tl.sum(candidate.to(tl.int32), axis=0))
    # The threshold stamp: every candidate below it is a victim, and the first `installed -
    # below` (by slot id) of those at it. A step stamps all the slots it uses alike, so a few
    # stamp values hold the oldest slots: take them oldest first, one value per round...
    lowest = tl.min(tl.where(candidate, stamps, _NO_STAMP), axis=0)
    threshold = lowest
    below = 0
    at = tl.sum((candidate & (stamps == threshold)).to(tl.int32), axis=0)
    for _ in tl.static_range(FAST_ROUNDS):
        if below + at < installed:
            below += at
            threshold = tl.min(tl.where(candidate & (stamps > threshold), stamps, _NO_STAMP),
                               axis=0)
            at = tl.sum((candidate & (stamps == threshold)).to(tl.int32), axis=0)
    if below + at < installed:
        # ...and where that does not settle it, search the ages' bits from the top: the
        # largest age with fewer than `installed` candidates below it.
        age = tl.where(candidate, stamps - lowest, _NO_STAMP)  # no trial exceeds _NO_STAMP
        highest = tl.max(tl.where(candidate, age, 0), axis=0)
        found = 0
        for bit in range(30, -1, -1):
            trial = found | (1 << bit)
            # A larger trial has every candidate below it: never taken. (Nested, so that the
            # reduction is skipped: a joined condition would evaluate it always.)
            if trial <= highest:  # noqa: SIM102
                if tl.sum((age < trial).to(tl.int32), axis=0) < installed:
                    found = trial
        threshold = lowest + found
        below = tl.sum((candidate & (stamps < threshold)).to(tl.int32), axis=0)
    older = candidate & (stamps < threshold)
    tied = candidate & (stamps == threshold)
    need = installed - below
    # One scan for both prefix counts, packed in one int32 while they fit (each <= H <= 2^14:
    # the older count times 2^16 stays below 2^31), else two: a victim's rank is the older
    # slots before it plus the tied ones before it, at most `need` of those.
    if BLOCK_H <= 16384:
        packed = tl.cumsum(older.to(tl.int32) * 65536 + tied.to(tl.int32), axis=0)
        older_through = packed >> 16
        tied_through = packed & 65535
    else:
        older_through = tl.cumsum(older.to(tl.int32), axis=0)
        tied_through = tl.cumsum(tied.to(tl.int32), axis=0)
    victim = older | (tied & (tied_through <= need))
    victim_rank = older_through + tl.minimum(tied_through, need) - 1
    tl.store(order_ptr + b * H + victim_rank, h, mask=victim)
    # A victim's old token is in no top-k entry of this step (it was not hit, and a miss's
    # token is held by no slot), so this never touches a key a miss installs below.
    tl.store(resident_ptr + keys_by_slot,
             tl.full(keys_by_slot.shape, -1, resident_ptr.dtype.element_ty),
             mask=victim & (keys_by_slot >= 0) & (keys_by_slot < NUM_KEYS))
    tl.store(stamp_row + h, tl.zeros(h.shape, tl.int32) + clock, mask=victim)
    tl.debug_barrier()  # the victims in `order` are visible to every thread
    miss = row >= 0
    rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    miss = miss & (rank < installed)
    slot = tl.load(order_ptr + b * H + rank, mask=miss, other=0)
    tl.store(resident_ptr + key, slot.to(resident_ptr.dtype.element_ty), mask=miss)
    tl.store(slot_key_ptr + r.to(tl.int64) * H + slot, key, mask=miss)
    tl.store(out_ptr + b * K + k, base + slot, mask=miss)
    if ADDRESS_ORDER:
        # Every miss the classify grid counted takes an entry of its address bucket; the plan
        # holds the call's misses bucket by bucket, K to a plan row. (A miss left without a
        # slot, which H >= K rules out, would leave a source of -1 that the copy skips.)
        bins = tl.arange(0, NUM_BUCKETS)
        counted = row >= 0
        bucket = tl.where(counted, _address_bucket(row, N, NUM_BUCKETS), 0)
        # The miss's rank in its bucket within this row, from counters only this program
        # touches: one shared cursor per bucket, claimed by every miss of the batch, cost
        # 30-140 us per step at churn 0.2-1.0 in contention (H200, round address-order).
        row_buckets = row_buckets_ptr + b * NUM_BUCKETS
        within_row = tl.atomic_add(row_buckets + bucket, tl.full(bucket.shape, 1, tl.int32),
                                   mask=counted, sem="relaxed")
        tl.debug_barrier()  # every thread's count is in (at L2, where the load below reads)
        row_counts = tl.load(row_buckets + bins, cache_modifier=".cg")
        # The row's entries of each bucket in one claim per bucket.
        row_first = tl.atomic_add(bucket_cursor_ptr + bins, row_counts, mask=row_counts > 0,
                                  sem="relaxed")
        tl.store(row_buckets + bins, tl.zeros(bins.shape, tl.int32), mask=row_counts > 0)
        bucket_counts = tl.load(bucket_count_ptr + bins)
        first = tl.cumsum(bucket_counts, axis=0) - bucket_counts + row_first
        entry = tl.gather(first, bucket, 0) + within_row
        entry = (entry // K) * plan_stride + entry % K
        tl.store(plan_src_ptr + entry, tl.where(miss, row, -1), mask=counted)
        tl.store(plan_dst_ptr + entry, base + slot, mask=counted)
    else:
        tl.store(plan_src_ptr + b * plan_stride + rank, row, mask=miss)
        tl.store(plan_dst_ptr + b * plan_stride + rank, base + slot, mask=miss)
    return installed


@triton.jit
def _select_kernel(
    num_real_ptr, req_slots_ptr, seq_lens_ptr, top_k_ptr, out_ptr, resident_ptr,
    slot_key_ptr,  # [R, H] int32 this group's residency key per hot slot
    last_use_ptr, lru_clock_ptr, miss_row_ptr, miss_count_ptr, order_ptr,
    plan_src_ptr, plan_dst_ptr,  # [Bcap, >=K] int32 host / device rows of each miss
    plan_count_ptr,  # [>=Bcap] int32 entries per plan row
    plan_stride,
    bucket_count_ptr,  # [NUM_BUCKETS] int32 scratch: the classify grid's misses per bucket
    bucket_cursor_ptr,  # [NUM_BUCKETS] int32 scratch: entries of each bucket handed out
    done_ptr,  # [1] int32 scratch: programs done with the two above (all zero between calls)
    row_buckets_ptr,  # [Bcap, NUM_BUCKETS] int32 scratch: a row's misses per bucket (zero
    # between calls)
    R, S, K, H, N,
    T,  # positions per request
    NUM_KEYS,  # entries of this group's residency map
    EARLY_LOADS: tl.constexpr,
    POSITION_KEYED: tl.constexpr,
    USE_PDL: tl.constexpr,
    FAST_ROUNDS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K: the whole top-k row lives in registers
    BLOCK_H: tl.constexpr,  # >= H: the whole stamp row lives in registers
    # The plan lists the call's misses in host-address order (K per plan row) instead of
    # batch row by batch row: the copy then reads the pool front to back, and scattered rows
    # that share the link's address translations are read together.
    ADDRESS_ORDER: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
):
    """One program per batch row. It owns all LRU state of its request (two rows of a batch
    never share a request slot), so the LRU needs no atomics (the address-ordered plan's
    entries are claimed with some). A row without misses only advances
    its clock: the hits were stamped by the classify kernel."""
    b = tl.program_id(0)
    # Written before the classify kernel began: read while it may still run.
    real, r, n, base = _row_context(b, num_real_ptr, req_slots_ptr, seq_lens_ptr, R, S,
                                    EARLY_LOADS)
    clock = tl.load(lru_clock_ptr + r)
    if USE_PDL:
        gdc_wait()
        # Only now may the copy launch: it waits for our plan, and the prefetching copy reads
        # the classify output before that wait. Triggered at our start instead, the copy ran
        # while the classify grid still did (three grids in flight), and on an H200 shared by
        # 8 processes that gave illegal addresses and wrong rows about once per 27k calls
        # (benchmarks/NOTES.md, sixteenth pass).
        gdc_launch_dependents()
    num_misses = tl.load(miss_count_ptr + b)
    tl.store(miss_count_ptr + b, 0, mask=num_misses != 0)  # zero for the next call
    installed = 0
    if real & (n > H):
        if num_misses > 0:
            installed = _select_victims(
                b, r, clock, num_misses, base, last_use_ptr, slot_key_ptr, resident_ptr,
                miss_row_ptr, top_k_ptr, out_ptr, order_ptr, plan_src_ptr, plan_dst_ptr,
                plan_stride, bucket_count_ptr, bucket_cursor_ptr, row_buckets_ptr, K, H, N, T,
                NUM_KEYS, FAST_ROUNDS, BLOCK_K, BLOCK_H, ADDRESS_ORDER, NUM_BUCKETS,
                POSITION_KEYED,
            )
        tl.store(lru_clock_ptr + r, clock + 1)
    if ADDRESS_ORDER:
        total = tl.sum(tl.load(bucket_count_ptr + tl.arange(0, NUM_BUCKETS)), axis=0)
        tl.store(plan_count_ptr + b, tl.minimum(tl.maximum(total - b * K, 0), K))
        # The last program done zeroes the bucket state for the next call (a call without
        # misses left it zero). Every program's loads and claims above returned before its
        # plan stores, which precede this (a barrier, then the program's single ticket
        # exchange), so none can see the zeroes.
        if total > 0:
            tl.debug_barrier()
            ticket = tl.atomic_add(done_ptr, 1, sem="acq_rel")
            if ticket == tl.num_programs(0) - 1:
                bins = tl.arange(0, NUM_BUCKETS)
                tl.store(bucket_count_ptr + bins, tl.zeros(bins.shape, tl.int32))
                tl.store(bucket_cursor_ptr + bins, tl.zeros(bins.shape, tl.int32))
                tl.store(done_ptr, 0)
    else:
        tl.store(plan_count_ptr + b, installed)


@triton.jit
def _copy_kernel(
    plan_src_ptr, plan_dst_ptr, plan_count_ptr, plan_stride,
    host_ptr,  # [N, ROW_WORDS] int32: this layer's host rows (registered host memory)
    device_ptr,  # [R*S, ROW_WORDS] int32: this layer's device rows
    num_rows,  # batch rows in the plan
    max_count,  # columns of the plan (K)
    num_host_rows,  # N: rows of host_ptr
    num_device_rows,  # rows of device_ptr
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_BATCH: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # launched early behind the selection kernel: wait for its plan
        gdc_wait()
    batch = tl.arange(0, BLOCK_BATCH)
    counts = tl.load(plan_count_ptr + batch, mask=batch < num_rows, other=0)
    counts = tl.minimum(tl.maximum(counts, 0), max_count)
    ends = tl.cumsum(counts, axis=0)
    total = tl.sum(counts, axis=0)
    words = tl.arange(0, BLOCK_WORDS)
    in_row = words < ROW_WORDS
    num_chunks = tl.cdiv(total, ROWS)
    for chunk in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        flat = chunk * ROWS + tl.arange(0, ROWS)
        # Batch row of each flat miss index = how many rows end at or before it.
        before = ends[None, :] <= flat[:, None]
        owner = tl.sum(before.to(tl.int32), axis=1)
        first = tl.sum(tl.where(before, counts[None, :], 0), axis=1)
        active = flat < total
        entry = owner * plan_stride + (flat - first)
        src = tl.load(plan_src_ptr + entry, mask=active, other=0).to(tl.int64)
        dst = tl.load(plan_dst_ptr + entry, mask=active, other=0).to(tl.int64)
        # Our selection kernel writes only rows in range, but copy_planned replays any plan it
        # is given: skipping a row outside the layer's rows (as the backup kernel does) keeps
        # every access in bounds, for two compares per row of a few hundred bytes.
        active = active & (src >= 0) & (src < num_host_rows) & (dst >= 0)
        active = active & (dst < num_device_rows)
        mask = active[:, None] & in_row[None, :]
        data = tl.load(host_ptr + src[:, None] * ROW_WORDS + words[None, :], mask=mask)
        tl.store(device_ptr + dst[:, None] * ROW_WORDS + words[None, :], data, mask=mask)


@triton.jit
def _load_miss_rows(miss_row_ptr, host_ptr, entry, num_entries, words, in_row,
                    ROW_WORDS: tl.constexpr, MISS_ROW_CACHE: tl.constexpr):
    """Host rows of the misses among `entry` (top-k entries, flattened), -1 source elsewhere."""
    src = tl.load(miss_row_ptr + entry, mask=entry < num_entries, other=-1,
                  cache_modifier=MISS_ROW_CACHE)
    miss = src >= 0
    mask = miss[:, None] & in_row[None, :]
    data = tl.load(host_ptr + src.to(tl.int64)[:, None] * ROW_WORDS + words[None, :], mask=mask)
    return data, miss, mask


@triton.jit
def _store_miss_rows(out_ptr, device_ptr, entry, data, miss, mask, words,
                     ROW_WORDS: tl.constexpr):
    """Store fetched rows into the slots the plan gave their entries (out = base + victim)."""
    dst = tl.load(out_ptr + entry, mask=miss, other=0).to(tl.int64)
    tl.store(device_ptr + dst[:, None] * ROW_WORDS + words[None, :], data, mask=mask)


@triton.jit
def _copy_prefetched_kernel(
    miss_row_ptr,  # [Bcap * K] int32 host row of each missing entry, -1 otherwise (classify)
    out_ptr,  # [Bcap * K] int32 device row of each entry; the plan writes the misses' victims
    host_ptr,  # [N, ROW_WORDS] int32 this layer's host rows
    device_ptr,  # [R*S, ROW_WORDS] int32 this layer's device rows
    num_entries,  # Bcap * K
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    MISS_ROW_CACHE: tl.constexpr,  # ".cg" when launched early: read at L2, as the classify
    # grid left it
):
    """The copy by top-k entry instead of by plan: a miss's host row depends on the lookups
    alone, so each program fetches its first rows over the link while the selection still
    chooses victims, and waits for it only to learn where they go. Launched behind a selection
    kernel, which lets it start once the classify grid is done."""
    words = tl.arange(0, BLOCK_WORDS)
    in_row = words < ROW_WORDS
    first = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    data, miss, mask = _load_miss_rows(miss_row_ptr, host_ptr, first, num_entries, words,
                                       in_row, ROW_WORDS, MISS_ROW_CACHE)
    if USE_PDL:
        gdc_wait()
    _store_miss_rows(out_ptr, device_ptr, first, data, miss, mask, words, ROW_WORDS)
    stride = tl.num_programs(0) * ROWS
    for start in range(tl.program_id(0) * ROWS + stride, num_entries, stride):
        entry = start + tl.arange(0, ROWS)
        data, miss, mask = _load_miss_rows(miss_row_ptr, host_ptr, entry, num_entries, words,
                                           in_row, ROW_WORDS, MISS_ROW_CACHE)
        _store_miss_rows(out_ptr, device_ptr, entry, data, miss, mask, words, ROW_WORDS)


@dataclass(frozen=True)
class Tuning:
    """Launch parameters, as measured on an H200 with SW-1 (benchmarks/NOTES.md; the A/B
    rounds that chose them are benchmarks/results/sw1-cuda-ab-*.json)."""

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
    # Programmatic dependent launch between our kernels (NVIDIA sm_90+): the classify kernel
    # lets the selection launch at its start, the selection lets the copy launch once it has
    # waited for the classify grid, and each waits on the device (griddepcontrol) before it
    # reads what the previous wrote, so launch latency and the copy prologue overlap the
    # selection. Never more than two of our grids in flight (tests/test_pdl_launch_order.py).
    # None: wherever the device and triton support it.
    pdl: bool | None = None
    # The copy is launched that way only up to this batch capacity (None: always; 0: never).
    pdl_copy_max_batch: int | None = 16
    # Up to this batch capacity (None: always; 0: never) the copy walks the top-k entries
    # instead of the plan, with the lookups split: a miss's host row is known once the
    # classify kernel is done, so with PDL each copy program fetches its first rows over the
    # link while the selection still chooses victims. One pass over the entries needs
    # Bcap x K <= copy programs x copy_rows; past that the later passes overlap nothing.
    # H200, B=1: churn 0.05 / 0.2 / 1.0 18.4 / 23.7 / 48.9 -> 15.8 / 16.6 / 38.0 us; at
    # B=16 (16 passes) miss-free +3 us, with misses -2..-3%: B=1 only.
    prefetch_copy_max_batch: int | None = 1
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


@dataclass(eq=False)
class _Scratch:
    order: torch.Tensor  # [Bcap, H] int32
    miss_row: torch.Tensor  # [Bcap, K] int32
    miss_count: torch.Tensor  # [Bcap] int32, all zero between calls
    # [2 * NUM_BUCKETS + 1] int32, all zero between calls: misses per host-address bucket,
    # entries handed out per bucket, selection programs done
    address_order: torch.Tensor
    row_buckets: torch.Tensor  # [Bcap, NUM_BUCKETS] int32, all zero between calls
    plan: MissPlan  # used when the caller passes none


_scratch: weakref.WeakKeyDictionary[CacheTables, dict[tuple[int, int], _Scratch]] = (
    weakref.WeakKeyDictionary()
)
_checked_host: weakref.WeakKeyDictionary[CacheTables, set[int]] = weakref.WeakKeyDictionary()


def _get_scratch(tables: CacheTables, batch_cap: int, top_k: int) -> _Scratch:
    per_shape = _scratch.setdefault(tables, {})
    scratch = per_shape.get((batch_cap, top_k))
    if scratch is not None and scratch.address_order.numel() != 2 * _tuning.address_buckets + 1:
        scratch = None  # the bucket count changed (tuning(...)): its state needs a new size
    if scratch is None:
        # Checked here, once per allocation rather than per call (host time on every layer):
        # the tables are never rebound (CacheTables).
        _check_tables(tables)
        device = tables.last_use.device
        hot = tables.hot_slots
        scratch = _Scratch(
            order=torch.empty(batch_cap, hot, dtype=torch.int32, device=device),
            miss_row=torch.empty(batch_cap, top_k, dtype=torch.int32, device=device),
            miss_count=torch.zeros(batch_cap, dtype=torch.int32, device=device),
            address_order=torch.zeros(2 * _tuning.address_buckets + 1, dtype=torch.int32,
                                      device=device),
            row_buckets=torch.zeros(batch_cap, _tuning.address_buckets, dtype=torch.int32,
                                    device=device),
            plan=MissPlan.empty(batch_cap, top_k, device),
        )
        per_shape[(batch_cap, top_k)] = scratch
    return scratch


def _fail(what: str, seen: object, fix: str) -> InvalidInputError:
    return InvalidInputError(f"{what} (got {seen}); {fix}.")


def _check_tables(tables: CacheTables) -> None:
    """The kernels index every table with sizes taken from the others (R from the page table,
    G from the LRU stamps, H = hot_slots, N from resident or the host rows, L from device_kv)
    and as contiguous rows: a table that disagrees would be read or written past its end.
    Shapes only, no sync."""
    t = tables
    device = t.last_use.device
    if t.page_table.dim() != 2 or t.last_use.dim() != 3 or t.resident.dim() != 2:
        raise _fail("tables.page_table must be [R, P], tables.last_use [G, R, H] and "
                    "tables.resident [G, N] or [G, R * T]",
                    [list(t.page_table.shape), list(t.last_use.shape), list(t.resident.shape)],
                    "build the tables as docs/ARCHITECTURE.md lays them out")
    if t.residency_map not in RESIDENCY_MAPS:
        raise _fail(f"tables.residency_map must be one of {', '.join(RESIDENCY_MAPS)}",
                    t.residency_map,
                    "build the tables as docs/ARCHITECTURE.md lays them out")
    num_requests, num_groups = t.page_table.shape[0], t.last_use.shape[0]
    num_layers = t.device_kv.shape[0]
    position_keyed = t.residency_map == "position"
    num_keys = (num_requests * t.positions_per_request if position_keyed
                else t.resident.shape[1])
    grid = (num_groups, num_requests, t.hot_slots)
    expected = (  # (name, tensor, shape, dtype or None where checked per call)
        ("page_table", t.page_table, tuple(t.page_table.shape), torch.int32),
        ("seq_lens", t.seq_lens, (num_requests,), torch.int32),
        ("slot_key", t.slot_key, grid, torch.int32),
        ("last_use", t.last_use, grid, torch.int32),
        ("lru_clock", t.lru_clock, (num_groups, num_requests), torch.int32),
        ("resident", t.resident, (num_groups, num_keys), None),
        ("counters", t.counters, (num_layers, 3), torch.int64),
    )
    for name, tensor, shape, dtype in expected:
        if (tuple(tensor.shape) != shape or not tensor.is_contiguous()
                or tensor.device != device or dtype not in (None, tensor.dtype)):
            raise _fail(f"tables.{name} must be a contiguous {list(shape)} "
                        f"{dtype or 'int16/int32'} tensor on {device}",
                        f"{tensor.dtype} {list(tensor.shape)} stride {tensor.stride()} on "
                        f"{tensor.device}",
                        "build the tables as docs/ARCHITECTURE.md lays them out")
    if num_keys >= 2**31:
        raise _fail("tables.resident must have fewer than 2**31 entries per group (int32 keys)",
                    num_keys, "use fewer request slots or a shorter page table")
    device_rows = num_requests * t.slots_per_request
    if t.device_kv.dim() != 3 or t.device_kv.shape[1] < device_rows:
        raise _fail(f"tables.device_kv must be [L, >= R*S = {device_rows}, W]",
                    list(t.device_kv.shape), "allocate one row per hot slot of every request")
    for layer, host in enumerate(t.host_kv):
        if position_keyed:  # N is the host rows themselves (CacheTables.num_host_rows)
            if host.dim() != 2 or host.shape[0] != t.num_host_rows:
                raise _fail(f"tables.host_kv[{layer}] must hold N = {t.num_host_rows} rows, as "
                            "every layer does", list(host.shape),
                            "allocate every layer's host pool with the same rows")
            continue
        if host.dim() != 2 or host.shape[0] < t.resident.shape[1]:
            raise _fail(f"tables.host_kv[{layer}] must hold at least N = {t.resident.shape[1]} "
                        "rows (tables.resident's width)", list(host.shape),
                        "allocate every layer's host pool with the rows resident maps")


def _check_int32(name: str, tensor: torch.Tensor, shape: tuple[int, ...], device: torch.device):
    if tensor.dtype != torch.int32:
        raise _fail(f"{name} must be int32", tensor.dtype, f"pass {name}.to(torch.int32)")
    if tensor.device != device:
        raise _fail(f"{name} must be on the cache device {device}", tensor.device,
                    f"move {name} to {device}")
    if tuple(tensor.shape) != shape:
        raise _fail(f"{name} must have shape {list(shape)}", list(tensor.shape),
                    "pass one entry per batch row (padded to the batch capacity)")
    if not tensor.is_contiguous():
        raise _fail(f"{name} must be contiguous", tuple(tensor.stride()),
                    f"pass {name}.contiguous()")


def _check_plan(plan: MissPlan, batch_cap: int, top_k: int, device: torch.device) -> None:
    for name, tensor in (("plan.src", plan.src), ("plan.dst", plan.dst)):
        if tensor.dtype != torch.int32 or tensor.device != device or tensor.dim() != 2:
            raise _fail(f"{name} must be a 2-D int32 tensor on {device}",
                        f"{tensor.dtype} {list(tensor.shape)} on {tensor.device}",
                        "allocate it with MissPlan.empty(batch_capacity, top_k, device)")
        if tensor.shape[0] < batch_cap or tensor.shape[1] < top_k or tensor.stride(1) != 1:
            raise _fail(f"{name} must hold at least [{batch_cap}, {top_k}] with unit column "
                        "stride", f"shape {list(tensor.shape)}, stride {tensor.stride()}",
                        "allocate it with MissPlan.empty(batch_capacity, top_k, device)")
        # Rows closer than their width (an expanded tensor) would share entries: one batch
        # row's misses would overwrite another's and the copy would move the wrong rows.
        if tensor.shape[0] > 1 and tensor.stride(0) < tensor.shape[1]:
            raise _fail(f"{name}'s rows must not overlap (row stride >= its {tensor.shape[1]} "
                        "columns)", f"stride {tensor.stride()}",
                        "allocate it with MissPlan.empty(batch_capacity, top_k, device)")
    if plan.src.stride(0) != plan.dst.stride(0):
        raise _fail("plan.src and plan.dst must have the same row stride",
                    (plan.src.stride(0), plan.dst.stride(0)), "allocate them together")
    count = plan.count
    if count.dtype != torch.int32 or count.device != device or count.dim() != 1 or (
        count.shape[0] < batch_cap or not count.is_contiguous()
    ):
        raise _fail(f"plan.count must be a contiguous int32 vector of at least {batch_cap} on "
                    f"{device}", f"{count.dtype} {list(count.shape)} on {count.device}",
                    "allocate it with MissPlan.empty(batch_capacity, top_k, device)")


def _layer_rows(tables: CacheTables, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's host and device rows viewed as int32 words."""
    num_layers = tables.device_kv.shape[0]
    if not 0 <= layer < num_layers or len(tables.host_kv) != num_layers:
        raise _fail(f"layer must be in [0, {num_layers}) with one host tensor per layer",
                    f"layer {layer}, {len(tables.host_kv)} host tensors", "pass a valid layer")
    row_bytes = tables.row_bytes
    if row_bytes % 4:
        raise _fail("the Triton swap-in moves rows as 4-byte words; row_bytes must be a "
                    "multiple of 4", row_bytes, "pad rows to a multiple of 4 bytes or use the "
                    "torch reference swap-in")
    host = tables.host_kv[layer]
    device = tables.device_kv[layer]
    if host.dtype != torch.uint8 or host.dim() != 2 or host.shape[1] != row_bytes:
        raise _fail(f"host_kv[{layer}] must be a uint8 [N, {row_bytes}] tensor",
                    f"{host.dtype} {list(host.shape)}", "allocate it through the backend")
    if not host.is_contiguous() or not device.is_contiguous():
        raise _fail("host and device rows must be contiguous",
                    (host.stride(), device.stride()), "allocate them through the backend")
    checked = _checked_host.setdefault(tables, set())
    if host.device.type == "cpu" and device.device.type != "cpu" and layer not in checked:
        if not host.is_pinned():
            raise _fail(f"host_kv[{layer}] must be registered (pinned) host memory for the "
                        "device to read it", "pageable memory",
                        "allocate the pool with backend.alloc_host() or register it")
        checked.add(layer)
    return host.view(torch.int32), device.view(torch.int32)


@functools.cache
def _compute_units(device: torch.device) -> int:
    """SMs / CUs / Xe cores of `device`, as Triton's own driver reports them (so the kernels
    need no per-vendor branch); 1 where no Triton GPU driver is active."""
    if device.type == "cpu":
        return 1
    utils = triton.runtime.driver.active.utils
    index = device.index if device.index is not None else (
        triton.runtime.driver.active.get_current_device())
    return int(utils.get_device_properties(index)["multiprocessor_count"])


@functools.cache
def _pdl_supported(device: torch.device) -> bool:
    """Grid dependency control: the active triton backend must launch with `launch_pdl` and
    target an architecture that has it (compute capability 9.0 or newer)."""
    if not _HAVE_GDC or device.type == "cpu":
        return False
    from triton.compiler.compiler import make_backend

    target = triton.runtime.driver.active.get_current_target()
    options = make_backend(target).parse_options({})
    # An integer arch is a compute capability (90 = sm_90); other vendors name theirs.
    return hasattr(options, "launch_pdl") and isinstance(target.arch, int) and target.arch >= 90


def _copy_grid(host: torch.Tensor, device: torch.device, num_rows: int,
               num_entries: int, extent_tokens: int) -> tuple[int, int]:
    """(programs, warps per program) of a copy over `num_rows` batch rows of a host layout
    with `extent_tokens`-token extents."""
    t = _tuning
    threshold = t.large_batch_copy_min_batch
    large = threshold is not None and num_rows >= threshold
    if host.device.type == "cpu" and device.type == "cpu":
        max_programs = t.interpreter_copy_programs
    else:
        per_unit = t.large_batch_copy_programs_per_unit if large else t.copy_programs_per_unit
        fine = (t.fine_extent_copy_programs_per_unit is not None
                and extent_tokens <= t.fine_extent_max_tokens)
        if large and fine:
            per_unit = t.fine_extent_copy_programs_per_unit
        max_programs = _compute_units(device) * per_unit
    warps = t.large_batch_copy_warps if large and t.large_batch_copy_warps else t.copy_warps
    return max(1, min(triton.cdiv(num_entries, t.copy_rows), max_programs)), warps


def _copy_launch(tables: CacheTables, layer: int, num_rows: int, num_entries: int, pdl: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[int], dict[str, object]]:
    """What both copy kernels launch with: this layer's host and device rows, the grid, and
    the options they share. `pdl`: a programmatic dependent launch behind our selection kernel
    on the same stream."""
    host, device = _layer_rows(tables, layer)
    row_words = tables.row_bytes // 4
    programs, warps = _copy_grid(host, device.device, num_rows, num_entries,
                                 tables.extent_tokens)
    options: dict[str, object] = {
        "ROW_WORDS": row_words, "BLOCK_WORDS": triton.next_power_of_2(row_words),
        "ROWS": _tuning.copy_rows, "USE_PDL": pdl, "num_warps": warps,
        **({"launch_pdl": True} if pdl else {}),
    }
    return host, device, (programs,), options


def _launch_prefetched_copy(tables: CacheTables, layer: int, miss_row: torch.Tensor,
                            out: torch.Tensor, pdl: bool) -> None:
    """The copy of `_copy_prefetched_kernel`; `pdl`: launched behind our selection kernel."""
    num_rows, top_k = out.shape
    host, device, grid, options = _copy_launch(tables, layer, num_rows, num_rows * top_k, pdl)
    # Only a launch behind a running plan needs the L2 read; after an ordinary kernel boundary
    # a plain load is right on every vendor's backend.
    _copy_prefetched_kernel[grid](miss_row, out, host, device, num_rows * top_k,
                                  MISS_ROW_CACHE=".cg" if pdl else "", **options)


def _launch_copy(tables: CacheTables, layer: int, plan: MissPlan, num_rows: int,
                 pdl: bool = False) -> None:
    """`pdl`: launch as a programmatic dependent of the kernel just before it, which must be
    our selection kernel on the same stream."""
    top_k = plan.src.shape[1]
    host, device, grid, options = _copy_launch(tables, layer, num_rows, num_rows * top_k, pdl)
    _copy_kernel[grid](
        plan.src, plan.dst, plan.count, plan.src.stride(0),
        host, device, num_rows, top_k, host.shape[0], device.shape[0],
        BLOCK_BATCH=triton.next_power_of_2(num_rows), **options,
    )


def _address_order(batch_cap: int, extent_tokens: int) -> bool:
    """Whether the selection writes the plan in host-address order (Tuning)."""
    t = _tuning
    threshold, fine = t.address_order_min_batch, t.address_order_max_extent_tokens
    return (threshold is not None and batch_cap >= threshold
            and (fine is None or extent_tokens <= fine))


@contextlib.contextmanager
def _reset_counts_on_failure(scratch: _Scratch) -> Iterator[None]:
    try:
        yield
    except BaseException:
        scratch.miss_count.zero_()
        scratch.address_order.zero_()
        scratch.row_buckets.zero_()
        raise


def _within(batch_cap: int, limit: int | None) -> bool:
    return limit is None or batch_cap <= limit


def swap_in_triton(
    tables: CacheTables,
    layer: int,
    group: int,
    req_slots: torch.Tensor,  # [Bcap] int32 request slot per batch row
    top_k: torch.Tensor,  # [Bcap, K] int32 token positions, -1 = none
    num_real: torch.Tensor,  # [1] int32 device scalar: rows >= num_real are padding
    out: torch.Tensor,  # [Bcap, K] int32: device row per entry, -1 = none
    plan: MissPlan | None = None,
    skip_io: bool = False,
) -> None:
    """Swap-in of one layer for a padded batch; see docs/ARCHITECTURE.md for the semantics.

    Never synchronises with the host and sizes every grid from `Bcap` and `K` alone, so the
    call can be captured in a graph (after one eager call) and replayed with another
    `num_real`. Raises InvalidInputError, before any launch, for inputs it cannot use.
    """
    t = tables
    device = t.last_use.device
    if top_k.dim() != 2:
        raise _fail("top_k must be [Bcap, K]", list(top_k.shape), "pass a 2-D tensor")
    batch_cap, k = top_k.shape
    if k < 1:
        raise _fail("top_k needs at least one column", list(top_k.shape),
                    "pass [Bcap, K] positions with K >= 1 (-1 marks an unused entry)")
    _check_int32("top_k", top_k, (batch_cap, k), device)
    _check_int32("out", out, (batch_cap, k), device)
    _check_int32("req_slots", req_slots, (batch_cap,), device)
    _check_int32("num_real", num_real, (1,), device)
    hot = t.hot_slots
    if hot < k:
        raise _fail("the hot buffer must hold at least top_k slots", f"H={hot} < K={k}",
                    "raise device_buffer_size to at least top_k")
    if t.resident.dtype not in (residency_dtype(hot), torch.int32):
        raise _fail(f"tables.resident must be int16 (while H <= {INT16_MAX_HOT_SLOTS}) or int32",
                    f"{t.resident.dtype} with H={hot}",
                    "allocate it with core.tables.residency_dtype(hot_slots)")
    num_groups = t.last_use.shape[0]
    if not 0 <= group < num_groups:
        raise _fail(f"group must be in [0, {num_groups})", group, "pass the layer's index group")
    _layer_rows(t, layer)
    if plan is not None:
        _check_plan(plan, batch_cap, k, device)

    scratch = _get_scratch(t, batch_cap, k)
    used_plan = plan if plan is not None else scratch.plan
    num_requests, max_pages = t.page_table.shape
    num_host_rows, positions = t.num_host_rows, t.positions_per_request
    position_keyed = t.residency_map == "position"
    tune = _tuning
    pdl = tune.pdl is not False and _pdl_supported(device)
    # The counters order nothing (they are read after the kernels end), so they need no
    # acquire/release fence around each atomic, which is the default memory order.
    counter_sem = "relaxed" if tune.relaxed_counters else "acq_rel"
    pdl_copy = pdl and _within(batch_cap, tune.pdl_copy_max_batch)
    prefetch = not skip_io and _within(batch_cap, tune.prefetch_copy_max_batch)
    chunk = tune.classify_chunk_k
    if tune.small_batch_classify_chunk_k is not None and batch_cap <= tune.small_batch_max:
        chunk = tune.small_batch_classify_chunk_k
    chunk = min(triton.next_power_of_2(k), chunk)
    address_order = _address_order(batch_cap, t.extent_tokens)
    buckets = tune.address_buckets
    bucket_count, bucket_cursor, done = (scratch.address_order[:buckets],
                                         scratch.address_order[buckets:-1],
                                         scratch.address_order[-1:])
    resident, last_use, lru_clock = t.resident[group], t.last_use[group], t.lru_clock[group]
    _classify_kernel[(batch_cap, triton.cdiv(k, chunk))](
        num_real, req_slots, t.seq_lens, top_k, out, t.page_table, resident, last_use,
        lru_clock, scratch.miss_row, scratch.miss_count, t.counters[layer], bucket_count,
        num_requests, t.slots_per_request, k, hot, t.extent_tokens, max_pages, num_host_rows,
        positions, EARLY_LOADS=tune.early_loads, POSITION_KEYED=position_keyed, USE_PDL=pdl,
        COUNTER_SEM=counter_sem, CHUNK_K=chunk,
        ADDRESS_ORDER=address_order, NUM_BUCKETS=buckets, num_warps=tune.classify_warps,
    )
    block_k, block_h = triton.next_power_of_2(k), triton.next_power_of_2(hot)
    # The classify grid is queued and adds to counts that only the selection resets: if its
    # launch fails (a compile error on a new device, say), reset them behind the classify
    # grid, or the next call would place its misses after stale counts.
    with _reset_counts_on_failure(scratch):
        _select_kernel[(batch_cap,)](
            num_real, req_slots, t.seq_lens, top_k, out, resident, t.slot_key[group],
            last_use, lru_clock, scratch.miss_row, scratch.miss_count, scratch.order,
            used_plan.src, used_plan.dst, used_plan.count, used_plan.src.stride(0),
            bucket_count, bucket_cursor, done, scratch.row_buckets,
            num_requests, t.slots_per_request, k, hot, num_host_rows, positions,
            resident.shape[0], EARLY_LOADS=tune.early_loads, POSITION_KEYED=position_keyed,
            USE_PDL=pdl,
            FAST_ROUNDS=tune.select_fast_rounds,
            BLOCK_K=block_k, BLOCK_H=block_h, ADDRESS_ORDER=address_order, NUM_BUCKETS=buckets,
            num_warps=min(32, max(tune.select_warps, max(block_h, block_k) // (32 * 16))),
            **({"launch_pdl": True} if pdl else {}),  # behind the classify kernel
        )
    if prefetch:
        _launch_prefetched_copy(t, layer, scratch.miss_row, out, pdl=pdl_copy)
    elif not skip_io:
        # A shared-index replay (copy_planned_triton) follows an event wait or foreign work
        # and is never launched this way.
        _launch_copy(t, layer, used_plan, batch_cap, pdl=pdl_copy)


def copy_planned_triton(tables: CacheTables, layer: int, plan: MissPlan) -> None:
    """Copy the rows a plan recorded into `layer`'s device rows (shared-index replay)."""
    device = tables.last_use.device
    if plan.src.dim() != 2:
        raise _fail("plan.src must be [Bcap, K]", list(plan.src.shape),
                    "allocate it with MissPlan.empty(batch_capacity, top_k, device)")
    batch_cap, k = plan.src.shape
    _check_plan(plan, batch_cap, k, device)
    _launch_copy(tables, layer, plan, batch_cap)
