"""Step 3 of a swap-in: the copy of the missing rows out of host memory, and its replay.

`copy_kernel`: a fixed number of programs per SM walk the flattened list of the miss plan in
order, so a single request's misses spread over the whole GPU instead of one block; the same
kernel replays a plan into a follower layer (shared-index prefetch). `copy_prefetched_kernel`
walks the top-k entries instead and fetches host rows while the selection still runs (B=1).
Rows move as int32 words; a 656-byte row is 41 aligned 16-byte vectors.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hisparse.kernels.swap_in.pdl import gdc_wait


@triton.jit
def copy_kernel(
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
def copy_prefetched_kernel(
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
