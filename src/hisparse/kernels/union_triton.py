"""The verify step's union plan and scatter in Triton: one launch each, around the swap-in.

Same signatures and results as `union_reference` (its docstring: the union row, in
first-occurrence order, and the inverse codes). Each is one program per batch row, so a
verify swap-in costs two launches more than a single-token one instead of ~30 torch ops
(each 5-10 us of host time eagerly on an H200; benchmarks/NOTES.md, eighteenth pass).

The plan needs no sort: it de-duplicates through a presence table keyed by position, one
int32 row per batch row (`presence_table`: [batch rows, max_seq_len + D], all `SENTINEL`
between calls). Over the S * K entries, in chunks of `CHUNK`, four passes with a barrier
between each (global writes of the program's threads are visible to it after one):
1. every older entry e at position p: table[p] = min(table[p], e) (an atomic);
2. e is the first of its position iff table[p] == e; a cumsum carried across chunks gives each
   first its union column c: union[c] = p, table[p] = -2 - c (never an entry index, so a
   duplicate in the same chunk reads "not first" before or after the store);
3. every entry's code: the column -2 - table[p] for older entries, else draft / invalid / none;
4. table[p] = SENTINEL again for every older entry; the union row past the count is -1.
So the plan is O(S * K) per request (the sort it replaced cost 85-510 us at S = 2-8, K = 2048).
The scatter gathers the union's rows through the codes and adds the extras with two atomics.

Neither synchronises with the host and the grids depend on the batch rows alone, so a
captured graph replays them with another `num_real`; padding rows touch no table entry.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from hisparse.errors import InvalidInputError
from hisparse.kernels.launching import BoundLaunch
from hisparse.kernels.union_reference import SENTINEL

# An empty presence-table entry (union_reference.presence_table).
_SENTINEL = tl.constexpr(SENTINEL)
# The draft-token bit set is one int64 per request.
MAX_TOKENS = 63
# Entries per pass iteration: 8 per thread at 8 warps.
_CHUNK = 2048


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _entries(top_k_ptr, row, e, first, real, WIDTH: tl.constexpr, TOP_K: tl.constexpr):
    """(positions, older, draft, invalid, inside) of the entries `e` of one request."""
    inside = e < WIDTH
    pos = tl.load(top_k_ptr + row + e, mask=inside, other=-1)
    own = first + e // TOP_K
    # A scalar condition enters a vector mask through tl.where (see swap_in).
    live = tl.where(real, inside, False)
    selected = live & (pos >= 0) & (pos <= own)
    older = selected & (pos < first)
    draft = selected & (pos >= first)
    invalid = live & ((pos < -1) | (pos > own))
    return pos, older, draft, invalid, inside


@triton.jit
def union_plan_kernel(
    top_k_ptr,  # [R, S*K] int32 positions, -1 = none
    first_ptr,  # [>= R] int64 position of each request's first token of the step
    num_real_ptr,  # [1] int32: rows >= num_real are padding
    union_ptr,  # [>= R, S*K] int32 out: distinct older positions by first entry, then -1
    inverse_ptr,  # [>= R, S*K] int32 out: each entry's code (union_reference)
    table_ptr,  # [>= R, table_stride] int32 presence table, SENTINEL in and out
    table_stride,  # int: positions per table row (> every position before `first`)
    TOKENS: tl.constexpr,
    TOP_K: tl.constexpr,
    CHUNK: tl.constexpr,  # power of two: entries per pass iteration
):
    WIDTH: tl.constexpr = TOKENS * TOP_K
    b = tl.program_id(0)
    row = b.to(tl.int64) * WIDTH
    table = table_ptr + b.to(tl.int64) * table_stride
    real = b < tl.load(num_real_ptr)
    # Positions fit int32 (max_seq_len does): int32 compares and table offsets.
    first = tl.load(first_ptr + b).to(tl.int32)
    lane = tl.arange(0, CHUNK)
    for start in range(0, WIDTH, CHUNK):  # 1: the first entry of each position
        e = start + lane
        pos, older, _, _, _ = _entries(top_k_ptr, row, e, first, real, WIDTH, TOP_K)
        # Only the minimum matters, read after the barrier: no ordering needed.
        tl.atomic_min(table + pos, e, mask=older, sem="relaxed")
    tl.debug_barrier()
    count = tl.full([], 0, tl.int32)
    for start in range(0, WIDTH, CHUNK):  # 2: columns in first-occurrence order
        e = start + lane
        pos, older, _, _, _ = _entries(top_k_ptr, row, e, first, real, WIDTH, TOP_K)
        # .cg: from L2, where the atomics landed (never a stale L1 line).
        seen = tl.load(table + pos, mask=older, other=-1, cache_modifier=".cg")
        is_first = older & (seen == e)
        column = count + tl.cumsum(is_first.to(tl.int32), 0) - 1
        tl.store(union_ptr + row + column, pos, mask=is_first)
        tl.store(table + pos, -2 - column, mask=is_first)
        count += tl.sum(is_first.to(tl.int32), 0)
    tl.debug_barrier()
    for start in range(0, WIDTH, CHUNK):  # 3: every entry's code
        e = start + lane
        pos, older, draft, invalid, inside = _entries(top_k_ptr, row, e, first, real, WIDTH,
                                                      TOP_K)
        mark = tl.load(table + pos, mask=older, other=-2, cache_modifier=".cg")
        code = tl.where(draft, -2 - (pos - first), tl.where(invalid, WIDTH + 1, WIDTH))
        tl.store(inverse_ptr + row + e, tl.where(older, -2 - mark, code), mask=inside)
    tl.debug_barrier()  # every read of the table is done before it is reset
    for start in range(0, WIDTH, CHUNK):  # 4: the table empty again, the row padded
        e = start + lane
        pos, older, _, _, inside = _entries(top_k_ptr, row, e, first, real, WIDTH, TOP_K)
        tl.store(table + pos, tl.full([CHUNK], _SENTINEL, tl.int32), mask=older)
        tl.store(union_ptr + row + e, tl.full([CHUNK], -1, tl.int32), mask=inside & (e >= count))


@triton.jit
def union_scatter_kernel(
    inverse_ptr,  # [>= R, S*K] int32 codes from the plan
    union_rows_ptr,  # [R, S*K] int32 the swap-in's device rows of the union row
    draft_base_ptr,  # [>= R] int64 device row of each request's draft slot 0
    out_ptr,  # [R, S*K] int32 out: device row of every entry, -1 = none
    counters_ptr,  # [3] int64 the layer's (hits, misses, invalid)
    TOKENS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    WIDTH: tl.constexpr = TOKENS * TOP_K
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK)
    inside = e < WIDTH
    row = b.to(tl.int64) * WIDTH
    code = tl.load(inverse_ptr + row + e, mask=inside, other=WIDTH)
    column = (code >= 0) & (code < WIDTH)
    got = tl.load(union_rows_ptr + row + code, mask=column, other=-1)
    draft = code <= -2
    token = tl.where(draft, -2 - code, 0).to(tl.int64)
    drafts = (tl.load(draft_base_ptr + b) + token).to(tl.int32)
    tl.store(out_ptr + row + e, tl.where(draft, drafts, got), mask=inside)
    # Distinct draft tokens: a bit set per request, then its population count.
    bits = tl.reduce(tl.where(draft, tl.full([BLOCK], 1, tl.int64) << token, 0), 0, _or)
    hits = bits & 1
    for d in tl.static_range(1, TOKENS):
        hits += (bits >> d) & 1
    invalid = tl.sum((code == WIDTH + 1).to(tl.int64), 0)
    # Read only after the kernel: no ordering needed (as the swap-in's relaxed counters).
    tl.atomic_add(counters_ptr, hits, mask=hits > 0, sem="relaxed")
    tl.atomic_add(counters_ptr + 2, invalid, mask=invalid > 0, sem="relaxed")


def _shape(tokens: int, top_k: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the scatter at a union width: one block of S * K entries."""
    if not 1 <= tokens <= MAX_TOKENS:
        raise InvalidInputError(
            f"the Triton union serves 1..{MAX_TOKENS} tokens per verify step, got {tokens}; "
            "verify fewer tokens per step")
    block = triton.next_power_of_2(tokens * top_k)
    if block > 2**15:
        raise InvalidInputError(
            f"the Triton union serves at most 32768 entries per request, got S x K = "
            f"{tokens} x {top_k}; verify fewer tokens per step")
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    return block, warps


def _plan_shape(tokens: int, top_k: int) -> tuple[int, int]:
    """(CHUNK, num_warps) of the plan: a chunk of at most 2048 entries, 8 per thread."""
    chunk = min(triton.next_power_of_2(tokens * top_k), _CHUNK)
    return chunk, max(1, min(8, chunk // 256))


def _plan_launch(tokens: int, k: int, top_k: torch.Tensor, first: torch.Tensor,
                 num_real: torch.Tensor, union_top_k: torch.Tensor, inverse: torch.Tensor,
                 table: torch.Tensor, direct: bool) -> BoundLaunch:
    rows = top_k.shape[0]
    chunk, warps = _plan_shape(tokens, k)
    return BoundLaunch(union_plan_kernel, (rows,),
                       (top_k, first, num_real, union_top_k, inverse, table, table.stride(0)),
                       {"TOKENS": tokens, "TOP_K": k, "CHUNK": chunk, "num_warps": warps},
                       device=top_k.device, direct=direct)


def _scatter_launch(inverse: torch.Tensor, union_rows: torch.Tensor, draft_base: torch.Tensor,
                    out: torch.Tensor, counters: torch.Tensor, direct: bool) -> BoundLaunch:
    rows, tokens, k = out.shape
    block, warps = _shape(tokens, k)
    return BoundLaunch(union_scatter_kernel, (rows,),
                       (inverse, union_rows, draft_base, out, counters),
                       {"TOKENS": tokens, "TOP_K": k, "BLOCK": block, "num_warps": warps},
                       device=out.device, direct=direct)


def union_plan_triton(top_k: torch.Tensor, first: torch.Tensor, num_real: torch.Tensor,
                      union_top_k: torch.Tensor, inverse: torch.Tensor,
                      table: torch.Tensor) -> None:
    """`union_reference.union_plan_reference` through the presence table `table`
    (`presence_table`, left all SENTINEL), bound anew on every call (tests)."""
    rows, tokens, k = top_k.shape
    if rows:
        _shape(tokens, k)
        _plan_launch(tokens, k, top_k, first, num_real, union_top_k, inverse, table,
                     direct=False)()


def union_scatter_triton(inverse: torch.Tensor, union_rows: torch.Tensor,
                         draft_base: torch.Tensor, out: torch.Tensor,
                         counters: torch.Tensor) -> None:
    """`union_reference.union_scatter_reference`, bound anew on every call (tests)."""
    if out.shape[0]:
        _scatter_launch(inverse, union_rows, draft_base, out, counters, direct=False)()


class UnionLauncher:
    """The union plan and scatter of one verify width, bound to its persistent buffers: one
    bound launch per batch size (the plan) and per (layer, group, batch size) (the scatter),
    replayed on the driver (`kernels.launching`). Buffers as `ReferenceUnionLauncher`'s;
    `table()` hands the cache's presence table (`presence_table`), asked for at build."""

    def __init__(self, tokens: int, top_k: int, first: torch.Tensor, draft_base: torch.Tensor,
                 num_real: torch.Tensor, union_top_k: torch.Tensor, union_out: torch.Tensor,
                 rows: torch.Tensor, counters: torch.Tensor, *, direct: bool,
                 table: Callable[[], torch.Tensor]) -> None:
        _shape(tokens, top_k)  # refuses a width the kernels cannot serve, at build
        self.tokens, self.top_k, self._direct = tokens, top_k, direct
        self._first, self._draft_base, self._num_real = first, draft_base, num_real
        self._union_top_k, self._union_out, self._rows = union_top_k, union_out, rows
        self._counters = counters
        self._table = table()
        self.inverse = torch.full_like(union_top_k, tokens * top_k)
        self._plans: dict[int, BoundLaunch] = {}
        self._scatters: dict[tuple[int, int, int], BoundLaunch] = {}

    def plan(self, rows: int, top_k: torch.Tensor) -> None:
        """The union rows and inverse codes of `top_k [rows, S, K]` (int32, contiguous;
        `[rows, K]` when S = 1: the kernel reads only its address)."""
        launch = self._plans.get(rows)
        if launch is None:
            launch = self._plans[rows] = _plan_launch(
                self.tokens, self.top_k, top_k, self._first, self._num_real,
                self._union_top_k, self.inverse, self._table, self._direct)
        elif launch.address(0) != top_k.data_ptr():
            launch.rebind(0, top_k)  # another caller tensor (the launch keeps the last alive)
        launch()

    def scatter(self, layer: int, group: int, rows: int) -> None:
        """`rows[group][:rows]` from the union's rows of `group`; `layer`'s counters."""
        key = (layer, group, rows)
        launch = self._scatters.get(key)
        if launch is None:
            launch = self._scatters[key] = _scatter_launch(
                self.inverse, self._union_out[group][:rows], self._draft_base,
                self._rows[group][:rows], self._counters[layer], self._direct)
        launch()
