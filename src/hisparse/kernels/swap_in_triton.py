"""Swap-in and planned copy in Triton, reading host rows in place (zero-copy over the link).

Same signature and semantics as `kernels/swap_in_reference.py` (docs/ARCHITECTURE.md). Up to
three launches, each with a grid fixed by `Bcap` and `K` so that a CUDA graph can capture them
and replay with another `num_real`:

1. classify (unless the lookups are folded into the plan, `Tuning.lookup_in_plan`): grid
   (Bcap, K / chunk). Each top-k entry is resolved through `page_table` and the persistent
   `resident` map: short regime, newest slot, hit, miss or invalid. Hits mark their slot in
   a per-row flag buffer.
2. plan: one program per batch row. It owns all LRU state of its request (two rows of a batch
   never share a request slot), so it needs no atomics: it ranks the evictable slots in LRU
   order, gives the m-th miss the m-th of them, writes the new LRU order, `slot_row`,
   `resident`, the miss outputs and the miss plan; with the lookups in the plan it also does
   step 1 itself. Two kernels: `_plan_direct_kernel` (the default where K and H each fit one
   block: every slot's final LRU position in one pass, about 5 dependent global round trips)
   and `_plan_kernel` (any K and H, in chunks: three passes over scratch).
3. copy: a fixed number of programs per SM walk the flattened (request, miss) list of the
   plan, so a single request's misses spread over the whole GPU instead of one block. Rows
   move as int32 words; a 656-byte row is 41 aligned 16-byte vectors.

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
from hisparse.core.widths import INT16_MAX_HOT_SLOTS
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
    resident_ptr,  # [N] int16 / int32 hot slot per host row (this group)
    K,
    H,
    E,
    P,
    N,
    EARLY_LOADS: tl.constexpr,
):
    """Resolve top-k entries: the device row of every non-miss (-1 for none/invalid), the hit
    slot / host row of long-regime entries, and each entry's code (`_entry_codes`)."""
    in_k = k_offsets < K
    if EARLY_LOADS:
        # Neither load waits for num_real or seq_len: the top-k row is read unconditionally
        # and the page table is masked by position alone (r is already clamped in range).
        pos = tl.load(top_k_ptr + b * K + k_offsets, mask=in_k, other=-1)
        pos = tl.where(real, pos, -1)
        page_index = pos // E
        page = tl.load(page_table_ptr + r.to(tl.int64) * P + page_index,
                       mask=(pos >= 0) & (page_index < P), other=-1)
    else:
        # Scalar conditions enter vectors through tl.where: `vector & scalar` gives an integer
        # mask under TRITON_INTERPRET=1 (triton 3.9), which tl.load rejects.
        pos = tl.load(top_k_ptr + b * K + k_offsets, mask=tl.where(real, in_k, False),
                      other=-1)
    valid, invalid, result, candidate = _entry_regime(pos, n, base, H)
    if not EARLY_LOADS:
        page_index = pos // E
        page = tl.load(page_table_ptr + r.to(tl.int64) * P + page_index,
                       mask=candidate & (page_index < P), other=-1)
    row = page * E + pos % E
    # A position without a host row would be an engine bug; counting it as invalid keeps the
    # kernel in bounds instead of copying from a wild address.
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
    short regime or newest token), -2 invalid, -1 no entry. The plan reads the misses from it
    and, with COUNTS_IN_PLAN, the statistics too (`_count_codes`)."""
    return tl.where(miss, row, tl.where(served, -3, tl.where(invalid, -2, -1)))


@triton.jit
def _count_codes(code):
    """(hits, misses, invalid) among entry codes; hits count every served entry."""
    n_hit = tl.sum((code == -3).to(tl.int32), axis=0)
    n_miss = tl.sum((code >= 0).to(tl.int32), axis=0)
    n_invalid = tl.sum((code == -2).to(tl.int32), axis=0)
    return n_hit, n_miss, n_invalid


@triton.jit
def _classify_chunk(
    b,
    k_offsets,
    real,
    r,
    n,
    base,
    top_k_ptr,
    out_ptr,  # [Bcap, K] int32 device rows
    page_table_ptr,
    resident_ptr,
    hit_flag_ptr,  # [Bcap, H] int8 scratch: 1 = slot hit this step (cleared by the plan)
    miss_row_ptr,  # [Bcap, K] int32 scratch: each entry's code (_entry_codes)
    K,
    H,
    E,
    P,
    N,
    EARLY_LOADS: tl.constexpr,
):
    in_k, result, hit, slot, _, _, code = _lookup_chunk(
        b, k_offsets, real, r, n, base, top_k_ptr, page_table_ptr, resident_ptr,
        K, H, E, P, N, EARLY_LOADS,
    )
    tl.store(out_ptr + b * K + k_offsets, result, mask=in_k)
    tl.store(hit_flag_ptr + b * H + slot, tl.full(slot.shape, 1, tl.int8), mask=hit)
    tl.store(miss_row_ptr + b * K + k_offsets, code, mask=in_k)
    return code


@triton.jit
def _add_counters(counters_ptr, n_hit, n_miss, n_invalid, SEM: tl.constexpr):
    tl.atomic_add(counters_ptr + 0, n_hit.to(tl.int64), mask=n_hit != 0, sem=SEM)
    tl.atomic_add(counters_ptr + 1, n_miss.to(tl.int64), mask=n_miss != 0, sem=SEM)
    tl.atomic_add(counters_ptr + 2, n_invalid.to(tl.int64), mask=n_invalid != 0, sem=SEM)


@triton.jit
def _add_code_counts(counters_ptr, code, SEM: tl.constexpr):
    """Add the hits, misses and invalid entries among `code` to this layer's counters."""
    n_hit, n_miss, n_invalid = _count_codes(code)
    _add_counters(counters_ptr, n_hit, n_miss, n_invalid, SEM)


@triton.jit
def _publish_total(total_ptr, num_misses):
    """Sum the misses of all plan programs into total[2] for the copy kernel's early exit.

    total[0] accumulates, total[1] counts arrivals; the last program to arrive moves the sum
    to total[2] and zeroes both, so the next call starts clean without a memset launch.
    """
    tl.atomic_add(total_ptr + 0, num_misses)
    # acq_rel (the default) on the ticket orders this program's add before it, and lets the
    # last arrival see every add.
    arrived = tl.atomic_add(total_ptr + 1, 1)
    if arrived == tl.num_programs(0) - 1:
        grand_total = tl.atomic_xchg(total_ptr + 0, 0)
        tl.atomic_xchg(total_ptr + 1, 0)
        tl.store(total_ptr + 2, grand_total)


@triton.jit
def _classify_kernel(
    num_real_ptr, req_slots_ptr, seq_lens_ptr, top_k_ptr, out_ptr, page_table_ptr,
    resident_ptr, hit_flag_ptr, miss_row_ptr, counters_ptr,  # counters: [3] int64 this layer
    R, S, K, H, E, P, N,
    EARLY_LOADS: tl.constexpr,
    USE_PDL: tl.constexpr,
    COUNTER_SEM: tl.constexpr,  # atomics' memory order
    COUNTS_IN_PLAN: tl.constexpr,  # the plan counts the codes; no atomics here
    CHUNK_K: tl.constexpr,
):
    if USE_PDL:  # the plan kernel may start now: it waits (gdc_wait) before reading our output
        gdc_launch_dependents()
    b = tl.program_id(0)
    real, r, n, base = _row_context(b, num_real_ptr, req_slots_ptr, seq_lens_ptr, R, S,
                                    EARLY_LOADS)
    k_offsets = tl.program_id(1) * CHUNK_K + tl.arange(0, CHUNK_K)
    code = _classify_chunk(
        b, k_offsets, real, r, n, base, top_k_ptr, out_ptr, page_table_ptr, resident_ptr,
        hit_flag_ptr, miss_row_ptr, K, H, E, P, N, EARLY_LOADS,
    )
    if not COUNTS_IN_PLAN:
        _add_code_counts(counters_ptr, code, COUNTER_SEM)


@triton.jit
def _plan_kernel(
    num_real_ptr, req_slots_ptr, seq_lens_ptr, top_k_ptr, out_ptr, page_table_ptr,
    resident_ptr,  # [N] int16 / int32 this group's residency map
    slot_row_ptr,  # [R, H] int32 this group's host row per hot slot
    lru_ptr,  # [R, H] int32 this group's LRU order, index 0 = least recent
    hit_flag_ptr, miss_row_ptr,
    order_ptr,  # [Bcap, H] int32 scratch: evictable slots from the front, hit slots from the back
    plan_src_ptr, plan_dst_ptr,  # [Bcap, >=K] int32 host / device rows of each miss
    plan_count_ptr,  # [>=Bcap] int32 misses per batch row
    plan_stride,
    counters_ptr,
    total_ptr,  # [3] int32 scratch for _publish_total (WRITE_TOTAL)
    R, S, K, H, E, P, N,
    LOOKUP_IN_PLAN: tl.constexpr,
    EARLY_LOADS: tl.constexpr,
    WRITE_TOTAL: tl.constexpr,
    USE_PDL: tl.constexpr,
    COUNTER_SEM: tl.constexpr,  # atomics' memory order
    COUNTS_IN_PLAN: tl.constexpr,  # the split classify left the counting to us
    DEPENDENTS_READ_LOOKUPS: tl.constexpr,  # the next kernel reads the classify output
    CHUNK_K: tl.constexpr,
    CHUNK_H: tl.constexpr,
):
    if USE_PDL:
        if not DEPENDENTS_READ_LOOKUPS:
            gdc_launch_dependents()
        if not LOOKUP_IN_PLAN:  # launched early behind the classify kernel: its output first
            gdc_wait()
            if DEPENDENTS_READ_LOOKUPS:  # only now is the classify grid known to be done
                gdc_launch_dependents()
    b = tl.program_id(0)
    real, r, n, base = _row_context(b, num_real_ptr, req_slots_ptr, seq_lens_ptr, R, S,
                                    EARLY_LOADS)
    if LOOKUP_IN_PLAN or COUNTS_IN_PLAN:
        total_hit = 0
        total_miss = 0
        total_invalid = 0
        for k0 in range(0, K, CHUNK_K):
            k_offsets = k0 + tl.arange(0, CHUNK_K)
            if LOOKUP_IN_PLAN:
                code = _classify_chunk(
                    b, k_offsets, real, r, n, base, top_k_ptr, out_ptr, page_table_ptr,
                    resident_ptr, hit_flag_ptr, miss_row_ptr, K, H, E, P, N, EARLY_LOADS,
                )
            else:  # the split classify kernel left its codes
                code = tl.load(miss_row_ptr + b * K + k_offsets, mask=k_offsets < K, other=-1)
            n_hit, n_miss, n_invalid = _count_codes(code)
            total_hit += n_hit
            total_miss += n_miss
            total_invalid += n_invalid
        _add_counters(counters_ptr, total_hit, total_miss, total_invalid, COUNTER_SEM)
    if LOOKUP_IN_PLAN:
        # Hit flags and miss rows written by other threads of this program must be visible.
        tl.debug_barrier()

    num_misses = 0
    if real & (n > H):
        lru_row = lru_ptr + r.to(tl.int64) * H
        # Pass 1: rank slots in LRU order. Evictable slots fill `order` from the front (their
        # rank is the victim index of the rank-th miss), hit slots from the back.
        num_evictable = 0
        num_hit_slots = 0
        for h0 in range(0, H, CHUNK_H):
            h_offsets = h0 + tl.arange(0, CHUNK_H)
            in_h = h_offsets < H
            slot = tl.load(lru_row + h_offsets, mask=in_h, other=0)
            flagged = tl.load(hit_flag_ptr + b * H + slot, mask=in_h, other=0) != 0
            tl.store(hit_flag_ptr + b * H + slot, tl.zeros(slot.shape, tl.int8), mask=in_h)
            evictable = in_h & ~flagged
            is_hit = in_h & flagged
            evict_rank = num_evictable + tl.cumsum(evictable.to(tl.int32), axis=0) - 1
            hit_rank = num_hit_slots + tl.cumsum(is_hit.to(tl.int32), axis=0) - 1
            tl.store(order_ptr + b * H + evict_rank, slot, mask=evictable)
            tl.store(order_ptr + b * H + (H - 1 - hit_rank), slot, mask=is_hit)
            num_evictable += tl.sum(evictable.to(tl.int32), axis=0)
            num_hit_slots += tl.sum(is_hit.to(tl.int32), axis=0)
        tl.debug_barrier()

        # Pass 2: misses in top-k order take the evictable slots in LRU order.
        for k0 in range(0, K, CHUNK_K):
            k_offsets = k0 + tl.arange(0, CHUNK_K)
            row = tl.load(miss_row_ptr + b * K + k_offsets, mask=k_offsets < K, other=-1)
            miss = row >= 0
            rank = num_misses + tl.cumsum(miss.to(tl.int32), axis=0) - 1
            # rank < num_evictable always holds when H >= K; the mask only keeps us in bounds.
            miss = miss & (rank < num_evictable)
            victim = tl.load(order_ptr + b * H + rank, mask=miss, other=0)
            slot_row_addr = slot_row_ptr + r.to(tl.int64) * H + victim
            old_row = tl.load(slot_row_addr, mask=miss, other=-1)
            # An evictable slot's old row is not in this step's top-k, so these stores never
            # touch a row another lane is installing.
            tl.store(resident_ptr + old_row,
                     tl.full(old_row.shape, -1, resident_ptr.dtype.element_ty),
                     mask=miss & (old_row >= 0) & (old_row < N))
            tl.store(resident_ptr + row, victim.to(resident_ptr.dtype.element_ty), mask=miss)
            tl.store(slot_row_addr, row, mask=miss)
            tl.store(out_ptr + b * K + k_offsets, base + victim, mask=miss)
            tl.store(plan_src_ptr + b * plan_stride + rank, row, mask=miss)
            tl.store(plan_dst_ptr + b * plan_stride + rank, base + victim, mask=miss)
            num_misses += tl.sum(miss.to(tl.int32), axis=0)

        # Pass 3: new LRU = untouched evictables, then the victims in miss order, then the hits.
        untouched = num_evictable - num_misses
        for h0 in range(0, H, CHUNK_H):
            h_offsets = h0 + tl.arange(0, CHUNK_H)
            source = tl.where(
                h_offsets < untouched,
                h_offsets + num_misses,
                tl.where(h_offsets < num_evictable, h_offsets - untouched,
                         H - 1 - (h_offsets - num_evictable)),
            )
            in_h = h_offsets < H
            slot = tl.load(order_ptr + b * H + source, mask=in_h, other=0)
            tl.store(lru_row + h_offsets, slot, mask=in_h)
    tl.store(plan_count_ptr + b, num_misses)
    if WRITE_TOTAL:
        _publish_total(total_ptr, num_misses)


@triton.jit
def _positions(BLOCK: tl.constexpr, LANES: tl.constexpr):
    """0..BLOCK-1 as the plan's tensors hold them. LANES = 0: in order. Else lane-major:
    element j is position (j % LANES) * (BLOCK / LANES) + j // LANES. A 1-D tensor gives
    element j to thread j % LANES, so each thread then owns a run of consecutive positions
    and a prefix sum over positions needs no per-register warp scans (`_prefix_sum`)."""
    j = tl.arange(0, BLOCK)
    if LANES == 0:
        return j
    else:
        return (j % LANES) * (BLOCK // LANES) + j // LANES


@triton.jit
def _element_of(position, BLOCK: tl.constexpr, LANES: tl.constexpr):
    """The tensor index that holds `position` under `_positions` (its inverse)."""
    if LANES == 0:
        return position
    else:
        per_lane: tl.constexpr = BLOCK // LANES
        return (position % per_lane) * LANES + position // per_lane


@triton.jit
def _prefix_sum(x, LANES: tl.constexpr):
    """Inclusive prefix sum of x over the positions `_positions(x.shape[0], LANES)` gave it.

    Lane-major, it is a scan down each thread's own run, plus one scan over the per-thread
    totals: Triton scans a 1-D tensor with one warp-level scan per register of each thread,
    16 for an LRU row of 4096 slots over 256 threads."""
    if LANES == 0:
        return tl.cumsum(x, axis=0)
    else:
        per_lane: tl.constexpr = x.shape[0] // LANES
        runs = tl.reshape(x, [per_lane, LANES])
        totals = tl.sum(runs, axis=0)
        before = tl.cumsum(totals, axis=0) - totals
        return tl.reshape(tl.cumsum(runs, axis=0) + before[None, :], [per_lane * LANES])


@triton.jit
def _rows_in_lru_order(row_ptr, lru_slots, h_offsets, mask, ON_CHIP: tl.constexpr,
                       LANES: tl.constexpr):
    """`row_ptr[lru_slots]` where `mask` holds, else -1 (a per-slot row read in LRU order).

    ON_CHIP reads the row in slot order (H / 32 coalesced sectors) and permutes it in shared
    memory, instead of one scattered global load per slot: on a cold L2 those loads are
    separate DRAM sector requests on the plan's critical path."""
    if ON_CHIP:
        in_slot_order = tl.load(row_ptr + h_offsets, mask=mask, other=-1)
        index = _element_of(lru_slots, h_offsets.shape[0], LANES)
        return tl.where(mask, tl.gather(in_slot_order, index, 0), -1)
    else:
        return tl.load(row_ptr + lru_slots, mask=mask, other=-1)


@triton.jit
def _plan_direct_kernel(
    num_real_ptr, req_slots_ptr, seq_lens_ptr, top_k_ptr, out_ptr, page_table_ptr,
    resident_ptr, slot_row_ptr, lru_ptr, hit_flag_ptr, miss_row_ptr,
    order_ptr,  # [Bcap, H] int32 scratch: the victims, in LRU order (first M entries)
    plan_src_ptr, plan_dst_ptr, plan_count_ptr, plan_stride, counters_ptr, total_ptr,
    R, S,
    K: tl.constexpr,  # compile-time sizes: masks and address arithmetic fold away
    H: tl.constexpr,
    E, P, N,
    LOOKUP_IN_PLAN: tl.constexpr,
    EARLY_LOADS: tl.constexpr,
    WRITE_TOTAL: tl.constexpr,
    USE_PDL: tl.constexpr,
    COUNTER_SEM: tl.constexpr,  # atomics' memory order
    COUNTS_IN_PLAN: tl.constexpr,  # the split classify left the counting to us
    DEPENDENTS_READ_LOOKUPS: tl.constexpr,  # the next kernel reads the classify output
    SLOT_ROW_READS: tl.constexpr,  # 0 all up front, 1 all for rows with misses, 2 victims
    ON_CHIP_GATHERS: tl.constexpr,  # flag and slot rows read whole, permuted by tl.gather
    CONTIGUOUS_FLAG_CLEAR: tl.constexpr,
    SKIP_UNMOVED_LRU: tl.constexpr,
    LANES_K: tl.constexpr,  # lane-major top-k / LRU positions (`_positions`), 0 in order
    LANES_H: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= K: the whole top-k row lives in registers
    BLOCK_H: tl.constexpr,  # >= H: the whole LRU row lives in registers
):
    """The plan of `_plan_kernel` with K and H in one block each, so that each slot's final
    LRU position comes straight from its ranks and the miss count M (no third pass), miss
    rows stay in registers (no scratch round trip), the victims' old rows leave `resident`
    before the victims are handed out, and a row without misses issues none of the victim
    work. Same inputs, outputs and state changes."""
    if USE_PDL and not DEPENDENTS_READ_LOOKUPS:  # the copy may start: it waits for our plan
        gdc_launch_dependents()
    b = tl.program_id(0)
    real, r, n, base = _row_context(b, num_real_ptr, req_slots_ptr, seq_lens_ptr, R, S,
                                    EARLY_LOADS)
    k_offsets = _positions(BLOCK_K, LANES_K)
    h_offsets = _positions(BLOCK_H, LANES_H)
    in_h = h_offsets < H
    lru_row = lru_ptr + r.to(tl.int64) * H
    # Issued before the lookups: it depends on the request slot alone. A short row's LRU is
    # read and left alone.
    lru_slots = tl.load(lru_row + h_offsets, mask=tl.where(real, in_h, False), other=0)
    if SLOT_ROW_READS == 0:  # every slot's host row, in flight together with the lookups
        slot_rows_all = _rows_in_lru_order(slot_row_ptr + r.to(tl.int64) * H, lru_slots,
                                           h_offsets, tl.where(real & (n > H), in_h, False),
                                           ON_CHIP_GATHERS, LANES_H)
    if LOOKUP_IN_PLAN:
        in_k, result, hit, slot, miss, row, code = _lookup_chunk(
            b, k_offsets, real, r, n, base, top_k_ptr, page_table_ptr, resident_ptr,
            K, H, E, P, N, EARLY_LOADS,
        )
        tl.store(hit_flag_ptr + b * H + slot, tl.full(slot.shape, 1, tl.int8), mask=hit)
        _add_code_counts(counters_ptr, code, COUNTER_SEM)
    else:  # the classify kernel resolved the entries and set the hit flags
        if USE_PDL:
            # Launched early behind it. Everything read above was written before the classify
            # kernel began; nothing is stored before this point (classify reads `resident`).
            gdc_wait()
            if DEPENDENTS_READ_LOOKUPS:  # the prefetching copy reads `miss_row` before its
                gdc_launch_dependents()  # own wait: the classify grid must be done by then
        in_k = k_offsets < K
        row = tl.load(miss_row_ptr + b * K + k_offsets, mask=in_k, other=-1)
        if COUNTS_IN_PLAN:
            _add_code_counts(counters_ptr, row, COUNTER_SEM)
        miss = row >= 0
        result = tl.full(row.shape, -1, tl.int32)
    victim = tl.zeros(row.shape, tl.int32)
    num_misses = 0
    if real & (n > H):
        if SLOT_ROW_READS == 1:
            # Every slot's host row, but only for a row with misses: in flight together with
            # the hit flags below, and no transactions at all on a miss-free step.
            has_miss = tl.sum(miss.to(tl.int32), axis=0) > 0
            slot_rows_all = _rows_in_lru_order(slot_row_ptr + r.to(tl.int64) * H, lru_slots,
                                               h_offsets, tl.where(has_miss, in_h, False),
                                               ON_CHIP_GATHERS, LANES_H)
        if LOOKUP_IN_PLAN:
            tl.debug_barrier()  # hit flags set by other threads of this program are visible
        flagged = _rows_in_lru_order(hit_flag_ptr + b * H, lru_slots, h_offsets, in_h,
                                     ON_CHIP_GATHERS, LANES_H) > 0
        if CONTIGUOUS_FLAG_CLEAR:
            # The whole flag row in slot order: H / 128 coalesced stores instead of one
            # scattered store per hit, once every thread has read its flags.
            tl.debug_barrier()
            tl.store(hit_flag_ptr + b * H + h_offsets, tl.zeros(h_offsets.shape, tl.int8),
                     mask=in_h)
        else:
            tl.store(hit_flag_ptr + b * H + lru_slots, tl.zeros(lru_slots.shape, tl.int8),
                     mask=in_h & flagged)
        evictable = in_h & ~flagged
        evict_rank = _prefix_sum(evictable.to(tl.int32), LANES_H) - 1
        hit_rank = h_offsets - 1 - evict_rank  # hit slots before h = h - evictables before h
        num_evictable = tl.sum(evictable.to(tl.int32), axis=0)
        # M <= num_evictable always holds when H >= K; the minimum only keeps us in bounds.
        installed = tl.minimum(tl.sum(miss.to(tl.int32), axis=0), num_evictable)
        # A step without misses issues none of the victim work below: the branch is uniform.
        if installed > 0:
            # New LRU = untouched evictables, then the victims in miss order, then the hits.
            new_position = tl.where(
                evictable,
                tl.where(evict_rank >= installed, evict_rank - installed,
                         num_evictable - installed + evict_rank),
                num_evictable + hit_rank,
            )
            victim_slot = evictable & (evict_rank < installed)
            tl.store(order_ptr + b * H + evict_rank, lru_slots, mask=victim_slot)
            if SLOT_ROW_READS == 2:  # the victims' old rows alone, one round trip later
                slot_rows = tl.load(slot_row_ptr + r.to(tl.int64) * H + lru_slots,
                                    mask=victim_slot, other=-1)
            else:
                slot_rows = slot_rows_all
            # A victim's old row is not in this step's top-k (it was not hit, and a miss row
            # is held by no slot), so this never touches a row a miss is installing below.
            tl.store(resident_ptr + slot_rows,
                     tl.full(slot_rows.shape, -1, resident_ptr.dtype.element_ty),
                     mask=victim_slot & (slot_rows >= 0) & (slot_rows < N))
            tl.debug_barrier()  # the victims in `order` are visible to every thread
            rank = _prefix_sum(miss.to(tl.int32), LANES_K) - 1
            miss = miss & (rank < num_evictable)
            victim = tl.load(order_ptr + b * H + rank, mask=miss, other=0)
            tl.store(resident_ptr + row, victim.to(resident_ptr.dtype.element_ty), mask=miss)
            tl.store(slot_row_ptr + r.to(tl.int64) * H + victim, row, mask=miss)
            tl.store(plan_src_ptr + b * plan_stride + rank, row, mask=miss)
            tl.store(plan_dst_ptr + b * plan_stride + rank, base + victim, mask=miss)
            num_misses += installed
        else:  # no misses (or, were H < K possible, no evictable slot)
            new_position = tl.where(evictable, evict_rank, num_evictable + hit_rank)
            miss = tl.zeros(row.shape, tl.int1)
        # Every thread read its LRU entries before the scans' barriers above, so this in-place
        # permutation reads nothing it overwrites.
        moved = (new_position != h_offsets) if SKIP_UNMOVED_LRU else True
        tl.store(lru_row + new_position, lru_slots, mask=in_h & moved)
    else:
        miss = tl.zeros(row.shape, tl.int1)  # short and padding rows have no misses
    if LOOKUP_IN_PLAN:
        tl.store(out_ptr + b * K + k_offsets, tl.where(miss, base + victim, result), mask=in_k)
    else:
        tl.store(out_ptr + b * K + k_offsets, base + victim, mask=miss)
    tl.store(plan_count_ptr + b, num_misses)
    if WRITE_TOTAL:
        _publish_total(total_ptr, num_misses)


@triton.jit
def _copy_kernel(
    plan_src_ptr, plan_dst_ptr, plan_count_ptr, plan_stride,
    total_ptr,  # [3] int32: total[2] = misses of the plan just made (TOTAL_GATE)
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
    TOTAL_GATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # launched early behind the plan kernel: wait for its plan
        gdc_wait()
    # A compile-time branch around a run-time one: joining them would emit the load always.
    if TOTAL_GATE:  # noqa: SIM102
        # One scalar load decides for a miss-free step; otherwise the counts below.
        if tl.load(total_ptr + 2) == 0:
            return
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
        # Our plan kernel writes only rows in range, but copy_planned replays any plan it is
        # given: skipping a row outside the layer's rows (as the backup kernel does) keeps
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
    alone, so each program fetches its first rows over the link while the plan still chooses
    victims, and waits for the plan only to learn where they go. Launched behind a plan kernel
    that lets it start once the classify grid is done (DEPENDENTS_READ_LOOKUPS)."""
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

    # Lookups in a split classify kernel over (Bcap, K/256) programs, or inside the plan
    # kernel (one launch less). None: split while the batch fills at most half the GPU's
    # units. H200: split saves 1.7 us at B=1 and, on SW-1's cold-L2 miss-free step at B=128,
    # 2.7 us (extents; 1.4 scattered); only a warm L2 favours the fused plan (+0.5 us).
    lookup_in_plan: bool | None = False
    # (b) request slot, top-k row and page table loaded without waiting for num_real and
    # seq_len: two dependent global round trips less per plan program (-0.5 us at B=1).
    early_loads: bool = True
    # (a) `_plan_direct_kernel` where K <= plan_chunk_k and H <= plan_chunk_h: final LRU
    # positions in one pass, miss rows in registers, no victim pass without misses.
    # H200: plan-only 17-21 -> 13-18 us at B=1, 33 -> 28 us at B=128.
    plan_direct: bool = True
    # (d) the plan kernel publishes its miss total; copy programs of a miss-free step exit on
    # one scalar load. Off: the plan programs' closing atomics cost more (+2.5 us per step
    # on the H200) than the copy prologue saves.
    copy_total_gate: bool = False
    # Direct plan only; each cuts the scattered memory transactions of a plan program (one
    # per SM at most). Which slots' host rows are read to clear the victims' `resident`
    # entries: "all" H with the lookups, "rows-with-misses" (all H, skipped on a miss-free
    # row) or "victims" alone (one dependent round trip later).
    slot_row_reads: str = "all"
    # Hit/miss/invalid counters added without acquire/release fences: -1 us on every step
    # from B=16 on, -0.3..-0.6 at B=1 (H200; the split classify grid is Bcap x 8 programs).
    relaxed_counters: bool = True
    # With the lookups split, the plan counts hits, misses and invalid entries from the codes
    # the classify kernel left in `miss_row` (one set of atomics per batch row), instead of
    # every classify program adding its chunk's counts (Bcap x K / chunk programs, all on the
    # same three addresses). H200 (round counts-in-plan): +0.5..+0.9 us at B=128, +0.8..+1.7
    # at B=1: the classify programs' atomics were off the critical path, the plan's three
    # reductions are on it. Off.
    counts_in_plan: bool = False
    # Hit flags and all slots' host rows read as whole rows and put into LRU order on chip
    # (tl.gather through shared memory) instead of gathered from global memory. Off: +0.7 us
    # on the cold and the warm miss-free B=128 step (the plan waits on latency, not sectors).
    on_chip_gathers: bool = False
    # Hit flags cleared by coalesced stores over the whole row instead of one per hit.
    contiguous_flag_clear: bool = True
    # LRU entries whose position does not change are not rewritten.
    skip_unmoved_lru_writes: bool = True
    # Direct plan: LRU and top-k positions laid out lane-major (`_positions`), so its prefix
    # sums scan each thread's own run instead of one warp scan per register. H200 (round
    # lane-major): the plan's instructions fell by 57% (12.7k -> 5.5k warp instructions at
    # B=1, registers 255 -> 145), but its loads and stores no longer coalesce: miss-free
    # B=16 / 64 -0.5..-1.5 us, B=1 +0.4..+1 us, churn 1.0 skip-IO +6..+15 us. Off.
    lane_major_plan: bool = False
    plan_chunk_k: int = 2048
    plan_chunk_h: int = 4096
    # 4 warps: +7 us per step at B=1; 16 warps: no spill on triton 3.6, no gain (H200, round
    # plan-warps: fewer instructions per warp, more in all).
    plan_warps: int = 8
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
    # instead (None: the one above): scattered rows share no locality for a narrow window to
    # keep. H200 (round fine-extent-copy, SGLang's kernel timed in the same call): scattered
    # B=64 / 128 -1..-3% with 2, 4 or 8 per SM alike (B=64 churn 0.2 486 -> 472 us, SGLang
    # 472), extents unchanged.
    fine_extent_copy_programs_per_unit: int | None = 4
    fine_extent_max_tokens: int = 16
    # Warps of a large-batch copy program (None: copy_warps). Meant to keep a copy launched
    # early (PDL) from crowding onto the SMs the plan leaves idle; H200 (round copy-pdl-wide):
    # 32 warps cost extents B=128 churn 0.2 10% with or without PDL, 16 warps with PDL 3%,
    # and the miss-free step gained at most 0.6 us, so it stays off.
    large_batch_copy_warps: int | None = None
    # Programmatic dependent launch between our kernels (NVIDIA sm_90+): each kernel lets the
    # next one launch at its start, and the next waits on the device (griddepcontrol) before
    # it reads what the previous wrote, so launch latency and the copy prologue overlap the
    # plan. None: wherever the device and triton support it.
    pdl: bool | None = None
    # The copy is launched that way only up to this batch capacity (None: always; 0: never).
    pdl_copy_max_batch: int | None = 16
    # Up to this batch capacity (None: always; 0: never) the copy walks the top-k entries
    # instead of the plan, with the lookups split: a miss's host row is known once the
    # classify kernel is done, so with PDL each copy program fetches its first rows over the
    # link while the plan still chooses victims. One pass over the entries needs
    # Bcap x K <= copy programs x copy_rows; past that the later passes overlap nothing.
    # H200, B=1: churn 0.05 / 0.2 / 1.0 18.4 / 23.7 / 48.9 -> 15.8 / 16.6 / 38.0 us; at
    # B=16 (16 passes) miss-free +3 us, with misses -2..-3%: B=1 only.
    prefetch_copy_max_batch: int | None = 1
    interpreter_copy_programs: int = 2  # each program costs ~1 ms under TRITON_INTERPRET=1


_tuning = Tuning()
_SLOT_ROW_READS = ("all", "rows-with-misses", "victims")


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
    hit_flag: torch.Tensor  # [Bcap, H] int8, all zero between calls
    order: torch.Tensor  # [Bcap, H] int32
    miss_row: torch.Tensor  # [Bcap, K] int32
    total: torch.Tensor  # [3] int32 for _publish_total: accumulator, arrivals (0 between
    # calls), the last plan's miss total
    plan: MissPlan  # used when the caller passes none


_scratch: weakref.WeakKeyDictionary[CacheTables, dict[tuple[int, int], _Scratch]] = (
    weakref.WeakKeyDictionary()
)
_checked_host: weakref.WeakKeyDictionary[CacheTables, set[int]] = weakref.WeakKeyDictionary()


def _get_scratch(tables: CacheTables, batch_cap: int, top_k: int) -> _Scratch:
    per_shape = _scratch.setdefault(tables, {})
    scratch = per_shape.get((batch_cap, top_k))
    if scratch is None:
        # Checked here, once per allocation rather than per call (host time on every layer):
        # the tables are never rebound (CacheTables).
        _check_tables(tables)
        device = tables.lru.device
        hot = tables.hot_slots
        scratch = _Scratch(
            hit_flag=torch.zeros(batch_cap, hot, dtype=torch.int8, device=device),
            order=torch.empty(batch_cap, hot, dtype=torch.int32, device=device),
            miss_row=torch.empty(batch_cap, top_k, dtype=torch.int32, device=device),
            total=torch.zeros(3, dtype=torch.int32, device=device),
            plan=MissPlan.empty(batch_cap, top_k, device),
        )
        per_shape[(batch_cap, top_k)] = scratch
    return scratch


def _fail(what: str, seen: object, fix: str) -> InvalidInputError:
    return InvalidInputError(f"{what} (got {seen}); {fix}.")


def _check_tables(tables: CacheTables) -> None:
    """The kernels index every table with sizes taken from the others (R from the page table,
    G from the LRU, H = hot_slots, N from resident, L from device_kv) and as contiguous rows:
    a table that disagrees would be read or written past its end. Shapes only, no sync."""
    t = tables
    device = t.lru.device
    if t.page_table.dim() != 2 or t.lru.dim() != 3 or t.resident.dim() != 2:
        raise _fail("tables.page_table must be [R, P], tables.lru [G, R, H] and tables.resident "
                    "[G, N]", [list(t.page_table.shape), list(t.lru.shape),
                               list(t.resident.shape)],
                    "build the tables as docs/ARCHITECTURE.md lays them out")
    num_requests, num_groups = t.page_table.shape[0], t.lru.shape[0]
    num_host_rows, num_layers = t.resident.shape[1], t.device_kv.shape[0]
    grid = (num_groups, num_requests, t.hot_slots)
    expected = (  # (name, tensor, shape, dtype or None where checked per call)
        ("page_table", t.page_table, tuple(t.page_table.shape), torch.int32),
        ("seq_lens", t.seq_lens, (num_requests,), torch.int32),
        ("slot_row", t.slot_row, grid, torch.int32),
        ("lru", t.lru, grid, torch.int32),
        ("resident", t.resident, (num_groups, num_host_rows), None),
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
    device_rows = num_requests * t.slots_per_request
    if t.device_kv.dim() != 3 or t.device_kv.shape[1] < device_rows:
        raise _fail(f"tables.device_kv must be [L, >= R*S = {device_rows}, W]",
                    list(t.device_kv.shape), "allocate one row per hot slot of every request")
    for layer, host in enumerate(t.host_kv):
        if host.dim() != 2 or host.shape[0] < num_host_rows:
            raise _fail(f"tables.host_kv[{layer}] must hold at least N = {num_host_rows} rows "
                        "(tables.resident's width)", list(host.shape),
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
    the options they share. `pdl`: a programmatic dependent launch behind our plan kernel on
    the same stream."""
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
    """The copy of `_copy_prefetched_kernel`; `pdl`: launched behind a plan kernel compiled
    with DEPENDENTS_READ_LOOKUPS."""
    num_rows, top_k = out.shape
    host, device, grid, options = _copy_launch(tables, layer, num_rows, num_rows * top_k, pdl)
    # Only a launch behind a running plan needs the L2 read; after an ordinary kernel boundary
    # a plain load is right on every vendor's backend.
    _copy_prefetched_kernel[grid](miss_row, out, host, device, num_rows * top_k,
                                  MISS_ROW_CACHE=".cg" if pdl else "", **options)


def _launch_copy(tables: CacheTables, layer: int, plan: MissPlan, num_rows: int,
                 total: torch.Tensor | None = None, pdl: bool = False) -> None:
    """`total`: the scratch the plan kernel just published its miss total in, or None (a
    replayed plan: its counts are all there is). `pdl`: launch as a programmatic dependent
    of the kernel just before it, which must be our plan kernel on the same stream."""
    top_k = plan.src.shape[1]
    host, device, grid, options = _copy_launch(tables, layer, num_rows, num_rows * top_k, pdl)
    gate = total is not None
    _copy_kernel[grid](
        plan.src, plan.dst, plan.count, plan.src.stride(0), total if gate else plan.count,
        host, device, num_rows, top_k, host.shape[0], device.shape[0],
        BLOCK_BATCH=triton.next_power_of_2(num_rows), TOTAL_GATE=gate, **options,
    )


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
    device = t.lru.device
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
    num_groups = t.lru.shape[0]
    if not 0 <= group < num_groups:
        raise _fail(f"group must be in [0, {num_groups})", group, "pass the layer's index group")
    _layer_rows(t, layer)
    if plan is not None:
        _check_plan(plan, batch_cap, k, device)

    scratch = _get_scratch(t, batch_cap, k)
    used_plan = plan if plan is not None else scratch.plan
    num_requests, max_pages = t.page_table.shape
    num_host_rows = t.resident.shape[1]
    sizes = (num_requests, t.slots_per_request, k, hot, t.extent_tokens, max_pages, num_host_rows)
    counters = t.counters[layer]
    tune = _tuning
    lookup_in_plan = tune.lookup_in_plan
    if lookup_in_plan is None:
        lookup_in_plan = 2 * batch_cap > _compute_units(device)
    pdl = tune.pdl is not False and _pdl_supported(device)
    # The counters order nothing (they are read after the kernels end), so they need no
    # acquire/release fence around each atomic, which is the default memory order.
    counter_sem = "relaxed" if tune.relaxed_counters else "acq_rel"
    pdl_copy = pdl and _within(batch_cap, tune.pdl_copy_max_batch)
    counts_in_plan = tune.counts_in_plan and not lookup_in_plan
    prefetch = (not skip_io and not lookup_in_plan
                and _within(batch_cap, tune.prefetch_copy_max_batch))
    if not lookup_in_plan:
        chunk = tune.classify_chunk_k
        if tune.small_batch_classify_chunk_k is not None and batch_cap <= tune.small_batch_max:
            chunk = tune.small_batch_classify_chunk_k
        chunk = min(triton.next_power_of_2(k), chunk)
        _classify_kernel[(batch_cap, triton.cdiv(k, chunk))](
            num_real, req_slots, t.seq_lens, top_k, out, t.page_table, t.resident[group],
            scratch.hit_flag, scratch.miss_row, counters, *sizes,
            EARLY_LOADS=tune.early_loads, USE_PDL=pdl,
            COUNTER_SEM=counter_sem, COUNTS_IN_PLAN=counts_in_plan, CHUNK_K=chunk,
            num_warps=tune.classify_warps,
        )
    block_k, block_h = triton.next_power_of_2(k), triton.next_power_of_2(hot)
    direct = tune.plan_direct and block_k <= tune.plan_chunk_k and block_h <= tune.plan_chunk_h
    plan_args = (
        num_real, req_slots, t.seq_lens, top_k, out, t.page_table, t.resident[group],
        t.slot_row[group], t.lru[group], scratch.hit_flag, scratch.miss_row, scratch.order,
        used_plan.src, used_plan.dst, used_plan.count, used_plan.src.stride(0), counters,
        scratch.total, *sizes,
    )
    flags = {"LOOKUP_IN_PLAN": lookup_in_plan, "EARLY_LOADS": tune.early_loads,
             "WRITE_TOTAL": tune.copy_total_gate, "USE_PDL": pdl,
             "COUNTER_SEM": counter_sem, "COUNTS_IN_PLAN": counts_in_plan,
             "DEPENDENTS_READ_LOOKUPS": prefetch and pdl_copy,
             "num_warps": tune.plan_warps}
    if pdl and not lookup_in_plan:  # behind the classify kernel (which reads no plan output)
        flags["launch_pdl"] = True
    if direct:
        lanes = 32 * tune.plan_warps  # one position of each lane-major slice per thread
        _plan_direct_kernel[(batch_cap,)](
            *plan_args, SLOT_ROW_READS=_SLOT_ROW_READS.index(tune.slot_row_reads),
            ON_CHIP_GATHERS=tune.on_chip_gathers, CONTIGUOUS_FLAG_CLEAR=tune.contiguous_flag_clear,
            SKIP_UNMOVED_LRU=tune.skip_unmoved_lru_writes,
            LANES_K=min(block_k, lanes) if tune.lane_major_plan else 0,
            LANES_H=min(block_h, lanes) if tune.lane_major_plan else 0,
            BLOCK_K=block_k, BLOCK_H=block_h,
            **flags,
        )
    else:
        _plan_kernel[(batch_cap,)](
            *plan_args, CHUNK_K=min(block_k, tune.plan_chunk_k),
            CHUNK_H=min(block_h, tune.plan_chunk_h), **flags,
        )
    if prefetch:
        _launch_prefetched_copy(t, layer, scratch.miss_row, out, pdl=pdl_copy)
    elif not skip_io:
        # A shared-index replay (copy_planned_triton) follows an event wait or foreign work
        # and is never launched this way.
        _launch_copy(t, layer, used_plan, batch_cap,
                     scratch.total if tune.copy_total_gate else None, pdl=pdl_copy)


def copy_planned_triton(tables: CacheTables, layer: int, plan: MissPlan) -> None:
    """Copy the rows a plan recorded into `layer`'s device rows (shared-index replay)."""
    device = tables.lru.device
    if plan.src.dim() != 2:
        raise _fail("plan.src must be [Bcap, K]", list(plan.src.shape),
                    "allocate it with MissPlan.empty(batch_capacity, top_k, device)")
    batch_cap, k = plan.src.shape
    _check_plan(plan, batch_cap, k, device)
    _launch_copy(tables, layer, plan, batch_cap)
