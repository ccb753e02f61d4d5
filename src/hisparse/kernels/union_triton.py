"""The verify step's union plan and scatter in Triton: one launch each, around the swap-in.

Same signatures and results as `union_reference` (its docstring: the union row and the
inverse codes). Each is one program per batch row over a power-of-two block of S * K entries,
so a verify swap-in costs two launches more than a single-token one instead of ~30 torch
ops (each 5-10 us of host time eagerly on an H200; benchmarks/NOTES.md, eighteenth pass).

The plan sorts the older entries by key = position * BLOCK + entry index (others sort last),
stores the sorted positions into the union row itself and reads them back one to the left
(a barrier between: the program's threads exchange them through memory), so the first of
each run of equal positions is found without a second sort; a cumsum gives each run its
column, and every entry's code is stored at its own index (the key carries it). The scatter
gathers the union's rows through the codes and adds the extras with two atomics per row.

Neither synchronises with the host and the grids depend on the batch rows alone, so a
captured graph replays them with another `num_real`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.errors import InvalidInputError
from hisparse.kernels.launching import BoundLaunch

# Sorts after every real key (positions are < 2**31, entry indices < 2**15).
_ABSENT = tl.constexpr(2**62)
# The draft-token bit set is one int64 per request.
MAX_TOKENS = 63


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def union_plan_kernel(
    top_k_ptr,  # [R, S*K] int32 positions, -1 = none
    first_ptr,  # [>= R] int64 position of each request's first token of the step
    num_real_ptr,  # [1] int32: rows >= num_real are padding
    union_ptr,  # [>= R, S*K] int32 out: distinct older positions ascending, then -1
    inverse_ptr,  # [>= R, S*K] int32 out: each entry's code (union_reference)
    TOKENS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,  # power of two >= S*K
    SHIFT: tl.constexpr,  # log2(BLOCK): the entry index's bits in a key
):
    WIDTH: tl.constexpr = TOKENS * TOP_K
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK)
    inside = e < WIDTH
    row = b.to(tl.int64) * WIDTH
    real = b < tl.load(num_real_ptr)
    first = tl.load(first_ptr + b)
    pos = tl.load(top_k_ptr + row + e, mask=inside, other=-1).to(tl.int64)
    own = first + e // TOP_K
    # A scalar condition enters a vector mask through tl.where (see swap_in).
    live = tl.where(real, inside, False)
    selected = live & (pos >= 0) & (pos <= own)
    older = selected & (pos < first)
    draft = selected & (pos >= first)
    invalid = live & ((pos < -1) | (pos > own))
    key = tl.sort(tl.where(older, (pos << SHIFT) + e, _ABSENT), 0)
    present = key != _ABSENT
    ordered = (key >> SHIFT).to(tl.int32)
    entry = (key & (BLOCK - 1)).to(tl.int32)
    tl.store(union_ptr + row + e, tl.where(present, ordered, -1), mask=inside)
    tl.debug_barrier()
    previous = tl.load(union_ptr + row + e - 1, mask=inside & (e > 0), other=-1)
    tl.debug_barrier()  # every read of the sorted row is done before it is overwritten
    distinct = present & (previous != ordered)
    rank = tl.cumsum(distinct.to(tl.int32), 0) - 1
    count = tl.sum(distinct.to(tl.int32), 0)
    tl.store(union_ptr + row + rank, ordered, mask=distinct)
    tl.store(union_ptr + row + e, tl.full([BLOCK], -1, tl.int32), mask=inside & (e >= count))
    tl.store(inverse_ptr + row + entry, rank, mask=present)
    code = tl.where(draft, -2 - (pos - first), tl.where(invalid, WIDTH + 1, WIDTH))
    tl.store(inverse_ptr + row + e, code.to(tl.int32), mask=inside & ~older)


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


def _shape(tokens: int, top_k: int) -> tuple[int, int, int]:
    """(BLOCK, SHIFT, num_warps) of a union width: 8-16 warps keep a 4k-16k-entry sort at
    16-32 keys per lane."""
    if not 1 <= tokens <= MAX_TOKENS:
        raise InvalidInputError(
            f"the Triton union serves 1..{MAX_TOKENS} tokens per verify step, got {tokens}; "
            "verify fewer tokens per step")
    block = triton.next_power_of_2(tokens * top_k)
    if block > 2**15:
        raise InvalidInputError(
            f"the Triton union sorts at most 32768 entries per request, got S x K = "
            f"{tokens} x {top_k}; verify fewer tokens per step")
    warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    return block, block.bit_length() - 1, warps


def _plan_launch(tokens: int, k: int, top_k: torch.Tensor, first: torch.Tensor,
                 num_real: torch.Tensor, union_top_k: torch.Tensor, inverse: torch.Tensor,
                 direct: bool) -> BoundLaunch:
    rows = top_k.shape[0]
    block, shift, warps = _shape(tokens, k)
    return BoundLaunch(union_plan_kernel, (rows,), (top_k, first, num_real, union_top_k, inverse),
                       {"TOKENS": tokens, "TOP_K": k, "BLOCK": block, "SHIFT": shift,
                        "num_warps": warps}, device=top_k.device, direct=direct)


def _scatter_launch(inverse: torch.Tensor, union_rows: torch.Tensor, draft_base: torch.Tensor,
                    out: torch.Tensor, counters: torch.Tensor, direct: bool) -> BoundLaunch:
    rows, tokens, k = out.shape
    block, _, warps = _shape(tokens, k)
    return BoundLaunch(union_scatter_kernel, (rows,),
                       (inverse, union_rows, draft_base, out, counters),
                       {"TOKENS": tokens, "TOP_K": k, "BLOCK": block, "num_warps": warps},
                       device=out.device, direct=direct)


def union_plan_triton(top_k: torch.Tensor, first: torch.Tensor, num_real: torch.Tensor,
                      union_top_k: torch.Tensor, inverse: torch.Tensor) -> None:
    """`union_reference.union_plan_reference`, bound anew on every call (tests)."""
    rows, tokens, k = top_k.shape
    if rows:
        _plan_launch(tokens, k, top_k, first, num_real, union_top_k, inverse, direct=False)()


def union_scatter_triton(inverse: torch.Tensor, union_rows: torch.Tensor,
                         draft_base: torch.Tensor, out: torch.Tensor,
                         counters: torch.Tensor) -> None:
    """`union_reference.union_scatter_reference`, bound anew on every call (tests)."""
    if out.shape[0]:
        _scatter_launch(inverse, union_rows, draft_base, out, counters, direct=False)()


class UnionLauncher:
    """The union plan and scatter of one verify width, bound to its persistent buffers: one
    bound launch per batch size (the plan) and per (layer, group, batch size) (the scatter),
    replayed on the driver (`kernels.launching`). Buffers as `ReferenceUnionLauncher`'s."""

    def __init__(self, tokens: int, top_k: int, first: torch.Tensor, draft_base: torch.Tensor,
                 num_real: torch.Tensor, union_top_k: torch.Tensor, union_out: torch.Tensor,
                 rows: torch.Tensor, counters: torch.Tensor, *, direct: bool) -> None:
        _shape(tokens, top_k)  # refuses a width the kernels cannot sort, at build
        self.tokens, self.top_k, self._direct = tokens, top_k, direct
        self._first, self._draft_base, self._num_real = first, draft_base, num_real
        self._union_top_k, self._union_out, self._rows = union_top_k, union_out, rows
        self._counters = counters
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
                self._union_top_k, self.inverse, self._direct)
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
