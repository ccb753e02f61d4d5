"""Step 2 of a swap-in: the victim selection kernel, one program per batch row.

A program owns all LRU state of its request (two rows of a batch never share a request slot),
so the LRU needs no atomics. A row without misses only advances its clock. A row with M misses
takes the M slots with the oldest stamps below the clock (ties by slot id): the oldest stamp
values first, a search over the stamp bits where a few values do not settle it; it gives them
to the misses in slot order and writes `slot_key`, `resident`, the stamps, the miss outputs and
the miss plan: batch row by batch row, or (large batches of scattered rows) in host-address
order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hisparse.kernels.swap_in.lookup import (
    _NO_STAMP,
    _address_bucket,
    _row_context,
    _verify_misses,
)
from hisparse.kernels.swap_in.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _select_victims(
    b, r, clock, num_misses, base,
    last_use_ptr, slot_key_ptr, resident_ptr, miss_row_ptr, top_k_ptr, out_ptr,
    order_ptr,  # [Bcap, H] int32 scratch: the victims in slot order
    plan_src_ptr, plan_dst_ptr, plan_stride,
    bucket_count_ptr, bucket_cursor_ptr, row_buckets_ptr, page_table_ptr,
    K, H, N, T, NUM_KEYS, E, P,
    presence_ptr, presence_stride,
    FAST_ROUNDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ADDRESS_ORDER: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    POSITION_KEYED: tl.constexpr,
    KEY_EXTENTS: tl.constexpr,
    DEDUP: tl.constexpr,
    CANDIDATES: tl.constexpr,
):
    """Give the misses of row b the slots with the oldest stamps below the clock (ties by
    slot id), in slot order, install them, and return how many were installed. A verify
    row's (DEDUP) are its positions' first entries; the copy gives the others their slots."""
    h = tl.arange(0, BLOCK_H)
    in_h = h < H
    k = tl.arange(0, BLOCK_K)
    stamp_row = last_use_ptr + r.to(tl.int64) * H
    # Everything this row reads, in flight together.
    stamps = tl.load(stamp_row + h, mask=in_h, other=0)
    keys_by_slot = tl.load(slot_key_ptr + r.to(tl.int64) * H + h, mask=in_h, other=-1)
    row = tl.load(miss_row_ptr + b * K + k, mask=k < K, other=-1)
    if DEDUP:
        row = _first_misses(b, k, K, row, top_k_ptr, presence_ptr, presence_stride, out_ptr,
                            CANDIDATES)
    # A statement, not a conditional expression: that would load the top-k row either way.
    if POSITION_KEYED:
        key = r * T + tl.load(top_k_ptr + b * K + k, mask=k < K, other=0)
    elif KEY_EXTENTS:
        # The lookup's codes hold a miss's host row, which a shared extent has under several
        # keys: the key comes from the page table again (misses only; hits never get here).
        missed = row >= 0
        pos = tl.load(top_k_ptr + b * K + k, mask=missed, other=0)
        page = tl.load(page_table_ptr + r.to(tl.int64) * P + pos // E, mask=missed, other=0)
        key = page * E + pos % E
    else:
        key = row
    candidate = in_h & (stamps < clock)  # this step's hits carry the clock
    # H >= K leaves at least M candidates; the minimum only keeps us in bounds.
    installed = tl.minimum(num_misses, tl.sum(candidate.to(tl.int32), axis=0))
    threshold, below = _victim_threshold(candidate, stamps, installed, FAST_ROUNDS)
    victim, victim_rank = _victim_ranks(candidate, stamps, threshold, below, installed,
                                        BLOCK_H)
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
        _plan_in_address_order(b, row, miss, base + slot, K, N, plan_src_ptr, plan_dst_ptr,
                               plan_stride, bucket_count_ptr, bucket_cursor_ptr,
                               row_buckets_ptr, NUM_BUCKETS)
    else:
        tl.store(plan_src_ptr + b * plan_stride + rank, row, mask=miss)
        tl.store(plan_dst_ptr + b * plan_stride + rank, base + slot, mask=miss)
    return installed


@triton.jit
def _first_misses(b, k, K, code, top_k_ptr, presence_ptr, presence_stride, out_ptr,
                  CANDIDATES: tl.constexpr):
    """The host row of each missing position's first entry (the lookup's atomic minimum left
    it in the presence table), -1 elsewhere: the entries that take victims. Every other miss
    of a position is marked `-2 - first entry` in `out`, which the copy kernel resolves
    (copy.py, `_complete_union`); with CANDIDATES, the misses the lookup already pointed at a
    smaller entry keep that mark and need no table read."""
    # The top-k row is read whole, so that its load flies with the codes' instead of after it.
    missed = _verify_misses(code)
    pos = tl.load(top_k_ptr + b * K + k, mask=k < K, other=0)
    if CANDIDATES:
        missed = missed & (tl.load(out_ptr + b * K + k, mask=k < K, other=-1) == -1)
    first_entry = tl.load(presence_ptr + b.to(tl.int64) * presence_stride + pos, mask=missed,
                          other=-1)
    first = missed & (first_entry == k)
    tl.store(out_ptr + b * K + k, -2 - first_entry, mask=missed & ~first)
    return tl.where(first, tl.where(code >= 0, code, -4 - code), -1)


@triton.jit
def _victim_threshold(candidate, stamps, installed, FAST_ROUNDS: tl.constexpr):
    """The threshold stamp and the candidates below it: every candidate below the threshold
    is a victim, and the first `installed - below` (by slot id) of those at it. A step stamps
    all the slots it uses alike, so a few stamp values hold the oldest slots: take them oldest
    first, one value per round..."""
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
    return threshold, below


@triton.jit
def _victim_ranks(candidate, stamps, threshold, below, installed, BLOCK_H: tl.constexpr):
    """Which slots are victims and each one's rank in slot order."""
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
    return victim, older_through + tl.minimum(tied_through, need) - 1


@triton.jit
def _plan_in_address_order(b, row, miss, dst, K, N, plan_src_ptr, plan_dst_ptr, plan_stride,
                           bucket_count_ptr, bucket_cursor_ptr, row_buckets_ptr,
                           NUM_BUCKETS: tl.constexpr):
    """Every miss the classify grid counted takes an entry of its address bucket; the plan
    holds the call's misses bucket by bucket, K to a plan row. (A miss left without a slot,
    which H >= K rules out, would leave a source of -1 that the copy skips.)"""
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
    tl.store(plan_dst_ptr + entry, dst, mask=counted)


@triton.jit
def _add_request_counts(r, real, num_hits, num_misses, request_counts_ptr):
    """Add a row's hits and misses (the lookup's counts) to its request slot's counters. The
    program owns its request for this call: no atomics."""
    counts = request_counts_ptr + r.to(tl.int64) * 2
    tl.store(counts, tl.load(counts, mask=real, other=0) + num_hits.to(tl.int64), mask=real)
    tl.store(counts + 1, tl.load(counts + 1, mask=real, other=0) + num_misses.to(tl.int64),
             mask=real)


@triton.jit
def _count_address_ordered_plan(b, K, plan_count_ptr, bucket_count_ptr, bucket_cursor_ptr,
                                done_ptr, NUM_BUCKETS: tl.constexpr):
    """Plan row b's entry count (K to a row, in address order), and the last program done
    zeroes the bucket state for the next call (a call without misses left it zero). Every
    program's loads and claims returned before its plan stores, which precede this (a
    barrier, then the program's single ticket exchange), so none can see the zeroes."""
    total = tl.sum(tl.load(bucket_count_ptr + tl.arange(0, NUM_BUCKETS)), axis=0)
    tl.store(plan_count_ptr + b, tl.minimum(tl.maximum(total - b * K, 0), K))
    if total > 0:
        tl.debug_barrier()
        ticket = tl.atomic_add(done_ptr, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            bins = tl.arange(0, NUM_BUCKETS)
            tl.store(bucket_count_ptr + bins, tl.zeros(bins.shape, tl.int32))
            tl.store(bucket_cursor_ptr + bins, tl.zeros(bins.shape, tl.int32))
            tl.store(done_ptr, 0)


@triton.jit
def select_kernel(
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
    hit_count_ptr,  # [Bcap] int32 scratch: the lookup's hits per batch row (zero between calls)
    request_counts_ptr,  # [R, 2] int64 hits and misses per request slot (REQUEST_COUNTS only)
    page_table_ptr,  # [R, P] int32 key extents (KEY_EXTENTS only)
    R, S, K, H, N,
    T,  # positions per request
    NUM_KEYS,  # entries of this group's residency map
    E, P,
    presence_ptr,  # [Bcap, presence_stride] int32 the lookup's presence table (DEDUP only)
    presence_stride,
    EARLY_LOADS: tl.constexpr,
    POSITION_KEYED: tl.constexpr,
    KEY_EXTENTS: tl.constexpr,  # a miss's key is its key row, not its host row
    USE_PDL: tl.constexpr,
    FAST_ROUNDS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K: the whole top-k row lives in registers
    BLOCK_H: tl.constexpr,  # >= H: the whole stamp row lives in registers
    # The plan lists the call's misses in host-address order (K per plan row) instead of
    # batch row by batch row: the copy then reads the pool front to back, and scattered rows
    # that share the link's address translations are read together.
    ADDRESS_ORDER: tl.constexpr,
    NUM_BUCKETS: tl.constexpr,
    REQUEST_COUNTS: tl.constexpr,  # add the row's hits and misses to its request's counters
    DEDUP: tl.constexpr,  # a verify row: misses are de-duplicated (lookup.py, _claim_positions)
    CANDIDATES: tl.constexpr,  # DEDUP: LaunchPlan.first_candidates
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
        # the classify output before that wait, so the classify grid must be done.
        gdc_launch_dependents()
    num_misses = tl.load(miss_count_ptr + b)
    num_hits = 0
    if REQUEST_COUNTS:
        num_hits = tl.load(hit_count_ptr + b)
    # Every thread reads the counts before one zeroes them (for the next call): a warp that
    # read a zeroed count would skip the selection and its barriers, and the other warps'
    # layout conversions would then read shared memory it never wrote (kernels/ptx_races.py).
    tl.debug_barrier()
    tl.store(miss_count_ptr + b, 0, mask=num_misses != 0)
    if REQUEST_COUNTS:
        tl.store(hit_count_ptr + b, 0, mask=num_hits != 0)
        _add_request_counts(r, real, num_hits, num_misses, request_counts_ptr)
    installed = 0
    if real & (n > H):
        if num_misses > 0:
            installed = _select_victims(
                b, r, clock, num_misses, base, last_use_ptr, slot_key_ptr, resident_ptr,
                miss_row_ptr, top_k_ptr, out_ptr, order_ptr, plan_src_ptr, plan_dst_ptr,
                plan_stride, bucket_count_ptr, bucket_cursor_ptr, row_buckets_ptr,
                page_table_ptr, K, H, N, T, NUM_KEYS, E, P, presence_ptr, presence_stride,
                FAST_ROUNDS, BLOCK_K, BLOCK_H, ADDRESS_ORDER, NUM_BUCKETS, POSITION_KEYED,
                KEY_EXTENTS, DEDUP, CANDIDATES,
            )
        tl.store(lru_clock_ptr + r, clock + 1)
    if ADDRESS_ORDER:
        _count_address_ordered_plan(b, K, plan_count_ptr, bucket_count_ptr, bucket_cursor_ptr,
                                    done_ptr, NUM_BUCKETS)
    else:
        tl.store(plan_count_ptr + b, installed)

