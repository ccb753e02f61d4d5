"""Step 1 of a swap-in: the lookup (classify) kernel and the entry-level helpers it shares.

Grid (Bcap, K / chunk). Each top-k entry is resolved through the persistent `resident` map,
keyed by host row or key row (through `page_table`; a key row's miss reads its host row
through `key_host_extent`) or by position (the page table read for misses alone): short
regime, newest slot, hit, miss or invalid. A hit stamps its slot with the request's LRU
clock (`last_use`), which is all the LRU work a hit needs; misses are counted per batch row
(and, for a plan in address order, per address bucket).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hisparse.kernels.newest_triton import write_newest_row
from hisparse.kernels.swap_in.pdl import gdc_launch_dependents
from hisparse.kernels.union_reference import SENTINEL

# Above every stamp a clock reaches (it advances once per decode step).
_NO_STAMP = tl.constexpr(2**31 - 1)
# An empty presence-table entry (union_reference.presence_table).
_SENTINEL = tl.constexpr(SENTINEL)


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
def _verify_regime(pos, k_offsets, valid, invalid, result, candidate, first, draft_base,
                   last_visible, TOKEN_K: tl.constexpr):
    """`_entry_regime` for a verify row: the step's own tokens come from their draft slots,
    and a query token may select positions up to its own only, or in a ragged step's row
    (`last_visible` >= 0) up to its last appended row (union_reference.build_union)."""
    own = tl.where(last_visible >= 0, last_visible, first + k_offsets // TOKEN_K)
    after_own = valid & (pos > own)
    draft = valid & (pos >= first) & ~after_own
    result = tl.where(draft, draft_base + (pos - first), tl.where(after_own, -1, result))
    return valid & ~after_own, invalid | after_own, result, candidate & (pos < first)


@triton.jit
def _lookup_chunk(
    b, k_offsets, real, r, n, base,
    top_k_ptr,  # [Bcap, K] int32 positions, -1 = none
    page_table_ptr,  # [R, P] int32 host (or key) extent ids
    resident_ptr,  # [NUM_KEYS] int16 / int32 hot slot per residency key (this group)
    key_host_extent_ptr,  # [NUM_KEYS / E] int32 host extent per key extent (KEY_EXTENTS)
    K, H, E, P,
    N,  # host rows
    T,  # positions per request (keys by position: r * T + position)
    NUM_KEYS,  # entries of resident (N, unless keyed by position or by key extents)
    first,  # a verify step's first token position (DEDUP only)
    draft_base,  # the device row of its draft slot 0 (DEDUP only)
    last_visible,  # a ragged verify row's last appended position, else -1 (DEDUP only)
    EARLY_LOADS: tl.constexpr,
    POSITION_KEYED: tl.constexpr,
    KEY_EXTENTS: tl.constexpr,  # the page table holds key extents (host_row with aliases)
    DEDUP: tl.constexpr,  # the row is a verify step's S query tokens' top-k, flattened
    TOKEN_K: tl.constexpr,  # entries per query token (DEDUP only)
):
    """Resolve top-k entries: the device row of every non-miss (-1 for none/invalid), the hit
    slot / host row of long-regime entries, each entry's code (`_entry_codes`) and position."""
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
    if DEDUP:
        valid, invalid, result, candidate = _verify_regime(
            pos, k_offsets, valid, invalid, result, candidate, first, draft_base,
            last_visible, TOKEN_K)
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
        row = page * E + pos % E  # the key row (the host row without key extents)
        # A position without a key or host row would be an engine bug; counting it as invalid
        # keeps the kernel in bounds instead of copying from a wild address.
        lost = candidate & ((page < 0) | (row >= NUM_KEYS))
        candidate = candidate & ~lost
        slot = tl.load(resident_ptr + row, mask=candidate, other=-1).to(tl.int32)
        hit = candidate & (slot >= 0) & (slot < H)
        miss = candidate & (slot < 0)
        if KEY_EXTENTS:
            # A hit needs the key alone; a miss copies from the key extent's host extent,
            # which a shared one has under several keys (one per request holding it).
            host_extent = tl.load(key_host_extent_ptr + page, mask=miss, other=-1)
            row = host_extent * E + pos % E
            no_row = miss & ((host_extent < 0) | (row >= N))
            lost = lost | no_row
            miss = miss & ~no_row
    result = tl.where(hit, base + slot, result)
    code = _entry_codes(miss, row, valid & ~miss & ~lost, invalid | lost)
    return in_k, result, hit, slot, miss, row, code, pos


@triton.jit
def _entry_codes(miss, row, served, invalid):
    """What `miss_row` holds per top-k entry: a miss's host row (>= 0); else -3 served (hit,
    short regime or newest token), -2 invalid, -1 no entry; in a verify row, a miss whose
    position an earlier-claimed entry also selects is `-4 - row` (`_claim_positions`). The
    selection and the prefetching copy read the misses from it."""
    return tl.where(miss, row, tl.where(served, -3, tl.where(invalid, -2, -1)))


@triton.jit
def _verify_misses(code):
    """Which entry codes of a verify row are misses: the copying one (`row >= 0`) and the
    repeats `_claim_positions` coded `-4 - row`."""
    return (code >= 0) | (code <= -4)


@triton.jit
def _claim_positions(b, k_offsets, pos, miss, row, code, presence_ptr, presence_stride,
                     SEM: tl.constexpr):
    """A verify row's de-duplication: every served or missing entry takes the minimum of its
    position's presence-table entry and its own index (the selection then knows each
    position's first entry by it; the copy empties the entry). The entry that found it empty is
    the position's one count; the other misses of a position are coded `-4 - row`, so that
    only one entry per position copies its row (copy.py reads misses as codes >= 0). Also
    returns what each entry found there (a smaller entry index: this one is not the first)."""
    tracked = (code == -3) | miss
    entry = presence_ptr + b.to(tl.int64) * presence_stride + pos
    old = tl.atomic_min(entry, k_offsets, mask=tracked, sem=SEM)
    unique = tracked & (old == _SENTINEL)
    return tl.where(miss & ~unique, -4 - row, code), unique, old


@triton.jit
def _deduplicate(b, k_offsets, in_k, pos, miss, row, code, result, presence_ptr,
                 presence_stride, SEM: tl.constexpr, DEDUP: tl.constexpr,
                 CANDIDATES: tl.constexpr):
    """(codes, which entries count, results): in a verify row (DEDUP) `_claim_positions`', and
    with CANDIDATES a miss that found a smaller entry (so cannot be its position's first)
    points at it in its result, `-2 - entry` (the copy follows the pointers, copy.py
    `_complete_union`; the selection tests only the others). Elsewhere every entry counts."""
    unique = in_k
    if DEDUP:
        code, unique, found = _claim_positions(b, k_offsets, pos, miss, row, code,
                                               presence_ptr, presence_stride, SEM)
        if CANDIDATES:
            result = tl.where(miss & (found < k_offsets), -2 - found, result)
    return code, unique, result


@triton.jit
def _count_codes(code, unique):
    """(hits, misses, invalid) among entry codes; hits count every served entry that is its
    position's first (`unique`: all of them but a verify row's repeats)."""
    n_hit = tl.sum(((code == -3) & unique).to(tl.int32), axis=0)
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
def _add_request_hits(hit_count_ptr, n_hit, SEM: tl.constexpr):
    """A request's hits are the layer's: each distinct position once, its draft tokens'
    included (as the union's scatter counts them)."""
    tl.atomic_add(hit_count_ptr, n_hit, mask=n_hit > 0, sem=SEM)


@triton.jit
def _back_up_row(b, write, data, newest_host_rows_ptr, host_words_ptr, num_host_rows,
                 ROW_WORDS: tl.constexpr, BLOCK_WORDS: tl.constexpr):
    """Batch row b's new row `data` into its host row, where `write` (a real row whose device
    write happened) and the host row is in range (padding rows have none)."""
    host_row = tl.load(newest_host_rows_ptr + b)
    write = write & (host_row >= 0) & (host_row < num_host_rows)
    words = tl.arange(0, BLOCK_WORDS)
    mask = tl.where(write, words < ROW_WORDS, False)
    tl.store(host_words_ptr + host_row.to(tl.int64) * ROW_WORDS + words, data, mask=mask)


@triton.jit
def classify_kernel(
    num_real_ptr, req_slots_ptr, seq_lens_ptr, top_k_ptr, out_ptr, page_table_ptr,
    resident_ptr,  # [NUM_KEYS] int16 / int32 this group's residency map
    last_use_ptr,  # [R, H] int32 this group's LRU stamps
    lru_clock_ptr,  # [R] int32 this group's LRU clocks
    key_host_extent_ptr,  # [NUM_KEYS / E] int32 host extent per key extent (KEY_EXTENTS only)
    miss_row_ptr,  # [Bcap, K] int32 scratch: each entry's code (_entry_codes)
    miss_count_ptr,  # [Bcap] int32 scratch: misses per batch row (zero between calls)
    counters_ptr,  # [3] int64 this layer's counters
    bucket_count_ptr,  # [NUM_BUCKETS] int32: misses per address bucket (ADDRESS_ORDER)
    hit_count_ptr,  # [Bcap] int32: hits per batch row (REQUEST_COUNTS; zero between calls)
    newest_kv_ptr,  # [B, ROW_WORDS] the layer's new rows (WRITE_NEWEST only)
    newest_rows_ptr,  # [Bcap] int32 device row of each batch row's new token
    device_words_ptr,  # [D, ROW_WORDS] int32 the layer's device rows
    newest_host_rows_ptr,  # [Bcap] int32 host row of each batch row's new token (-1: padding)
    host_words_ptr,  # [N, ROW_WORDS] int32 the layer's host rows (BACKUP_NEWEST only)
    R, S, K, H, E, P, N, T, NUM_KEYS,
    D,  # device rows of the layer (the sink row included)
    # DEDUP only: [Bcap] int64 first token position, draft slot 0's device row and last
    # visible position (DraftUnion), and the [Bcap, stride] int32 presence table (SENTINEL)
    first_ptr, draft_base_ptr, last_visible_ptr, presence_ptr, presence_stride,
    EARLY_LOADS: tl.constexpr,
    POSITION_KEYED: tl.constexpr,  # resident is indexed by r * T + position, not by host row
    KEY_EXTENTS: tl.constexpr,  # resident is indexed by key row, the page table by key extent
    USE_PDL: tl.constexpr,
    COUNTER_SEM: tl.constexpr,  # atomics' memory order
    CHUNK_K: tl.constexpr,
    ADDRESS_ORDER: tl.constexpr,  # the selection writes the plan in host-address order
    NUM_BUCKETS: tl.constexpr,
    REQUEST_COUNTS: tl.constexpr,  # count hits per batch row for the per-request counters
    WRITE_NEWEST: tl.constexpr,  # also write the new token's row (write_newest's kernel)
    BACKUP_NEWEST: tl.constexpr,  # and back it up to its host row (the backup's kernel)
    ROW_WORDS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
    DEDUP: tl.constexpr, TOKEN_K: tl.constexpr,  # top_k: a verify row of S * TOKEN_K entries
    CANDIDATES: tl.constexpr,  # DEDUP: LaunchPlan.first_candidates
):
    if USE_PDL:  # the selection kernel may start now: it waits (gdc_wait) before our output
        gdc_launch_dependents()
    b = tl.program_id(0)
    real, r, n, base = _row_context(b, num_real_ptr, req_slots_ptr, seq_lens_ptr, R, S,
                                    EARLY_LOADS)
    clock = tl.load(lru_clock_ptr + r)
    first, draft_base, last_visible = 0, 0, -1
    if DEDUP:
        first, draft_base, last_visible = (tl.load(first_ptr + b), tl.load(draft_base_ptr + b),
                                           tl.load(last_visible_ptr + b))
    k_offsets = tl.program_id(1) * CHUNK_K + tl.arange(0, CHUNK_K)
    in_k, result, hit, slot, miss, row, code, pos = _lookup_chunk(
        b, k_offsets, real, r, n, base, top_k_ptr, page_table_ptr, resident_ptr,
        key_host_extent_ptr, K, H, E, P, N, T, NUM_KEYS, first, draft_base, last_visible,
        EARLY_LOADS, POSITION_KEYED, KEY_EXTENTS, DEDUP, TOKEN_K,
    )
    code, unique, result = _deduplicate(b, k_offsets, in_k, pos, miss, row, code, result,
                                        presence_ptr, presence_stride, COUNTER_SEM, DEDUP,
                                        CANDIDATES)
    if ADDRESS_ORDER:
        tl.atomic_add(bucket_count_ptr + _address_bucket(row, N, NUM_BUCKETS),
                      tl.full(row.shape, 1, tl.int32), mask=miss & unique, sem=COUNTER_SEM)
    tl.store(out_ptr + b * K + k_offsets, result, mask=in_k)
    tl.store(miss_row_ptr + b * K + k_offsets, code, mask=in_k)
    # A hit is the whole LRU update of its slot: it takes the clock's value.
    tl.store(last_use_ptr + r.to(tl.int64) * H + slot, tl.zeros(slot.shape, tl.int32) + clock,
             mask=hit)
    # One count of the chunk's codes serves the layer's counters and the row's miss count.
    n_hit, n_miss, n_invalid = _count_codes(code, unique)
    _add_counters(counters_ptr, n_hit, n_miss, n_invalid, COUNTER_SEM)
    tl.atomic_add(miss_count_ptr + b, n_miss, mask=n_miss > 0, sem=COUNTER_SEM)
    if REQUEST_COUNTS:
        _add_request_hits(hit_count_ptr + b, n_hit, COUNTER_SEM)
    if WRITE_NEWEST:  # noqa: SIM102 (a constexpr test alone: the branch compiles away)
        # The newest slot is never a victim, so this row is written by nothing else in the
        # call; attention reads it only after the call, like every row the call returns.
        if tl.program_id(1) == 0:
            data, moved = write_newest_row(b, newest_kv_ptr, newest_rows_ptr, device_words_ptr,
                                           D, ROW_WORDS, BLOCK_WORDS)
            if BACKUP_NEWEST:
                # The row's host row is this step's own (nothing reads it before the step's
                # end), so the store needs no ordering beyond the stream's.
                _back_up_row(b, real & moved, data, newest_host_rows_ptr, host_words_ptr, N,
                             ROW_WORDS, BLOCK_WORDS)
