"""Step 3 of a swap-in: the copy of the missing rows out of host memory, and its replay.

`copy_kernel`: a fixed number of programs per SM walk the flattened list of the miss plan in
order, so a single request's misses spread over the whole GPU instead of one block; the same
kernel replays a plan into a follower layer (shared-index prefetch). `copy_prefetched_kernel`
walks the top-k entries instead and fetches host rows while the selection still runs (B=1).
Rows move as int32 words; a 656-byte row is 41 aligned 16-byte vectors. Behind a verify row's
selection (DEDUP) either kernel also completes the union (`_complete_union`), or
`complete_union_kernel` does, where the plan says so (`LaunchPlan.union_completion`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hisparse.kernels.swap_in.lookup import _SENTINEL, _verify_misses
from hisparse.kernels.swap_in.pdl import gdc_wait


@triton.jit
def _claimed_positions(entry, code, top_k_ptr):
    """Which of `entry` (flattened top-k entries) the lookup claimed in the presence table
    (served and missing ones), and their positions: read before the copy waits for the
    selection, as the codes are."""
    claimed = (code == -3) | _verify_misses(code)
    return claimed, tl.load(top_k_ptr + entry, mask=claimed, other=0)


@triton.jit
def _union_entries(miss_row_ptr, top_k_ptr, entry, num_entries, MISS_ROW_CACHE: tl.constexpr):
    """The codes of `entry` and which of them the lookup claimed, at which positions."""
    code = tl.load(miss_row_ptr + entry, mask=entry < num_entries, other=-1,
                   cache_modifier=MISS_ROW_CACHE)
    claimed, pos = _claimed_positions(entry, code, top_k_ptr)
    return code, claimed, pos


@triton.jit
def _complete_union(entry, code, claimed, pos, out_ptr, presence_ptr, presence_stride, K,
                    CANDIDATES: tl.constexpr):
    """A verify row's work left after its selection, done here by many programs instead of
    the row's one: each repeat (marked `-2 - first entry` in `out` by the selection) takes
    its position's first entry's row, and each claimed presence-table entry is emptied for
    the next call (nothing reads the table after the selection). Returns the entries' device
    rows, where a miss's row goes. A first entry's row is never a mark, so no program reads
    another's rewrite. With CANDIDATES a mark may point at a smaller entry of the position
    that is marked itself (lookup.py): the pointers only decrease, so following them ends at
    the first entry, whether another program has resolved a mark on the way or not."""
    b = entry // K
    tl.store(presence_ptr + b.to(tl.int64) * presence_stride + pos,
             tl.full(pos.shape, _SENTINEL, tl.int32), mask=claimed)
    missed = _verify_misses(code)
    dst = tl.load(out_ptr + entry, mask=missed, other=0)
    repeat = missed & (dst <= -2)
    held = tl.load(out_ptr + b * K + (-2 - dst), mask=repeat, other=-1)
    if CANDIDATES:
        pending = repeat & (held <= -2)
        while tl.max(pending.to(tl.int32), axis=0) > 0:
            held = tl.where(pending, tl.load(out_ptr + b * K + (-2 - held), mask=pending,
                                             other=-1), held)
            pending = pending & (held <= -2)
    tl.store(out_ptr + entry, held, mask=repeat)
    return tl.where(repeat, held, dst)


@triton.jit
def copy_kernel(
    plan_src_ptr, plan_dst_ptr, plan_count_ptr, plan_stride,
    host_ptr,  # [N, ROW_WORDS] int32: this layer's host rows (registered host memory)
    device_ptr,  # [R*S, ROW_WORDS] int32: this layer's device rows
    num_rows,  # batch rows in the plan
    max_count,  # columns of the plan (K)
    num_host_rows,  # N: rows of host_ptr
    num_device_rows,  # rows of device_ptr
    # DEDUP only: the call's [Bcap * K] entry codes, top-k and out, the presence table, and
    # the entries in all and per batch row
    miss_row_ptr, top_k_ptr, out_ptr, presence_ptr, presence_stride, num_entries, K,
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_BATCH: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    DEDUP: tl.constexpr,  # behind a verify row's selection: complete its union too
    UNION_BLOCK: tl.constexpr,  # entries per iteration of that walk
    MISS_ROW_CACHE: tl.constexpr,  # as copy_prefetched_kernel's
    CANDIDATES: tl.constexpr,  # DEDUP: LaunchPlan.first_candidates
):
    union_entry = tl.program_id(0) * UNION_BLOCK + tl.arange(0, UNION_BLOCK)
    if DEDUP:  # the walk's first codes and positions are final once we run (the lookup is)
        code, claimed, pos = _union_entries(miss_row_ptr, top_k_ptr, union_entry, num_entries,
                                            MISS_ROW_CACHE)
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
    if DEDUP:  # the plan holds the first entries' rows; the walk gives the repeats theirs
        _complete_union(union_entry, code, claimed, pos, out_ptr, presence_ptr,
                        presence_stride, K, CANDIDATES)
        stride = tl.num_programs(0) * UNION_BLOCK
        for start in range(tl.program_id(0) * UNION_BLOCK + stride, num_entries, stride):
            entry = start + tl.arange(0, UNION_BLOCK)
            code, claimed, pos = _union_entries(miss_row_ptr, top_k_ptr, entry, num_entries,
                                                "")
            _complete_union(entry, code, claimed, pos, out_ptr, presence_ptr,
                            presence_stride, K, CANDIDATES)


@triton.jit
def _load_miss_rows(miss_row_ptr, host_ptr, top_k_ptr, entry, num_entries, words, in_row,
                    ROW_WORDS: tl.constexpr, MISS_ROW_CACHE: tl.constexpr,
                    DEDUP: tl.constexpr):
    """Everything the copy of `entry` (top-k entries, flattened) reads before the selection is
    done: the codes, the host rows of the misses (a source of -1 elsewhere) and, in a verify
    row, the claimed positions."""
    code = tl.load(miss_row_ptr + entry, mask=entry < num_entries, other=-1,
                   cache_modifier=MISS_ROW_CACHE)
    miss = code >= 0
    mask = miss[:, None] & in_row[None, :]
    data = tl.load(host_ptr + code.to(tl.int64)[:, None] * ROW_WORDS + words[None, :], mask=mask)
    claimed, pos = miss, entry
    if DEDUP:
        claimed, pos = _claimed_positions(entry, code, top_k_ptr)
    return code, data, miss, mask, claimed, pos


@triton.jit
def _store_miss_rows(out_ptr, device_ptr, entry, code, data, miss, mask, claimed, pos, words,
                     presence_ptr, presence_stride, K, ROW_WORDS: tl.constexpr,
                     DEDUP: tl.constexpr, CANDIDATES: tl.constexpr):
    """Store fetched rows into the slots the plan gave their entries (out = base + victim),
    after a verify row's union is complete."""
    if DEDUP:
        dst = _complete_union(entry, code, claimed, pos, out_ptr, presence_ptr,
                              presence_stride, K, CANDIDATES).to(tl.int64)
    else:
        dst = tl.load(out_ptr + entry, mask=miss, other=0).to(tl.int64)
    tl.store(device_ptr + dst[:, None] * ROW_WORDS + words[None, :], data, mask=mask)


@triton.jit
def copy_prefetched_kernel(
    miss_row_ptr,  # [Bcap * K] int32 host row of each missing entry, -1 otherwise (classify)
    out_ptr,  # [Bcap * K] int32 device row of each entry; the plan writes the misses' victims
    host_ptr,  # [N, ROW_WORDS] int32 this layer's host rows
    device_ptr,  # [R*S, ROW_WORDS] int32 this layer's device rows
    num_entries,  # Bcap * K
    # DEDUP only: the call's top-k, the presence table and the entries per row
    top_k_ptr, presence_ptr, presence_stride, K,
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    MISS_ROW_CACHE: tl.constexpr,  # ".cg" when launched early: read at L2, as the classify
    # grid left it
    DEDUP: tl.constexpr,  # behind a verify row's selection: complete its union too
    CANDIDATES: tl.constexpr,  # DEDUP: LaunchPlan.first_candidates
):
    """The copy by top-k entry instead of by plan: a miss's host row depends on the lookups
    alone, so each program fetches its first rows over the link while the selection still
    chooses victims, and waits for it only to learn where they go. Launched behind a selection
    kernel, which lets it start once the classify grid is done."""
    words = tl.arange(0, BLOCK_WORDS)
    in_row = words < ROW_WORDS
    first = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    code, data, miss, mask, claimed, pos = _load_miss_rows(
        miss_row_ptr, host_ptr, top_k_ptr, first, num_entries, words, in_row, ROW_WORDS,
        MISS_ROW_CACHE, DEDUP)
    if USE_PDL:
        gdc_wait()
    _store_miss_rows(out_ptr, device_ptr, first, code, data, miss, mask, claimed, pos, words,
                     presence_ptr, presence_stride, K, ROW_WORDS, DEDUP,
                     CANDIDATES)
    stride = tl.num_programs(0) * ROWS
    for start in range(tl.program_id(0) * ROWS + stride, num_entries, stride):
        entry = start + tl.arange(0, ROWS)
        code, data, miss, mask, claimed, pos = _load_miss_rows(
            miss_row_ptr, host_ptr, top_k_ptr, entry, num_entries, words, in_row, ROW_WORDS,
            MISS_ROW_CACHE, DEDUP)
        _store_miss_rows(out_ptr, device_ptr, entry, code, data, miss, mask, claimed, pos,
                         words, presence_ptr, presence_stride, K, ROW_WORDS, DEDUP,
                     CANDIDATES)


@triton.jit
def complete_union_kernel(
    miss_row_ptr,  # [Bcap * K] int32 each entry's code (classify)
    top_k_ptr,  # [Bcap * K] int32 the call's flattened top-k
    out_ptr,  # [Bcap * K] int32 device row of each entry (marks from the selection)
    presence_ptr, presence_stride,  # [Bcap, presence_stride] int32 the presence table
    num_entries,  # Bcap * K
    K,  # entries per batch row (S x the query tokens' K)
    BLOCK: tl.constexpr,
    CANDIDATES: tl.constexpr,  # LaunchPlan.first_candidates
):
    """`_complete_union` alone, one block of entries per program: behind the selection of a
    call whose copy is skipped or too narrow a grid to walk every entry."""
    entry = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    code, claimed, pos = _union_entries(miss_row_ptr, top_k_ptr, entry, num_entries, "")
    _complete_union(entry, code, claimed, pos, out_ptr, presence_ptr, presence_stride, K,
                    CANDIDATES)
