"""The verify union's torch reference (`kernels.union_reference`: the CPU backend's path and
the oracle of the Triton swap-in that de-duplicates in its own kernels) against a plain-Python
walk over the entries, on fresh random inputs with repeats, drafts and invalid entries."""

from __future__ import annotations

import torch

from hisparse.kernels import union_reference as reference


def random_inputs(S: int, K: int, B: int, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`top_k [B, S, K]` drawn from a small pool per request (repeats within and across
    rows), with -1, invalid entries (below -1, after the query token) and draft positions;
    `first [B + 1]`, and a real count in 1..B."""
    cap = B + 1
    first = torch.randint(0, 3 * K, (cap,), generator=gen)
    first[0] = 0  # a request with nothing older
    span = first[:B, None, None] + S + 3
    draw = torch.rand(B, S, K, generator=gen)
    top_k = (draw * (span + 4)).long() - 4  # -4..first+S+2: invalid, -1, older, drafts
    pool = torch.randint(0, max(1, K // 2), (B, S, K), generator=gen)
    repeat = torch.rand(B, S, K, generator=gen) < 0.4
    top_k = torch.where(repeat & (pool < first[:B, None, None]), pool, top_k)
    num_real = torch.randint(1, B + 1, (1,), generator=gen)
    return top_k.to(torch.int32), first, num_real.to(torch.int32)


def walk(top_k: torch.Tensor, first: torch.Tensor, num_real: int, union_rows: torch.Tensor,
         draft_base: torch.Tensor) -> tuple[list[list[int]], list[list[int]], int, int]:
    """(union rows, `[B][S*K]` device rows, distinct drafts, invalid entries), entry by entry."""
    B, S, K = top_k.shape
    unions, outs, drafts, invalid = [], [], 0, 0
    for b in range(B):
        columns: dict[int, int] = {}
        out, seen = [], set()
        for e, pos in enumerate(top_k[b].flatten().tolist()):
            own = int(first[b]) + e // K
            if b >= num_real or pos == -1:
                out.append(-1)
            elif pos < -1 or pos > own:
                invalid += b < num_real
                out.append(-1)
            elif pos >= int(first[b]):
                seen.add(pos)
                out.append(int(draft_base[b]) + pos - int(first[b]))
            else:
                column = columns.setdefault(pos, len(columns))
                out.append(int(union_rows[b, column]))
        drafts += len(seen)
        unions.append(list(columns) + [-1] * (S * K - len(columns)))
        outs.append(out)
    return unions, outs, drafts, invalid


def test_the_reference_union_and_scatter_follow_the_entries(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for S, K, B in ((1, 4, 1), (2, 16, 3), (3, 8, 4), (4, 16, 2)):
        top_k, first, num_real = random_inputs(S, K, B, gen)
        cap, U = B + 1, S * K
        union_top_k = torch.full((cap, U), 77, dtype=torch.int32)
        inverse = torch.full((cap, U), 99, dtype=torch.int32)
        reference.union_plan_reference(top_k, first, num_real, union_top_k, inverse)
        union_rows = torch.randint(0, 10**6, (B, U), generator=gen, dtype=torch.int32)
        draft_base = torch.arange(cap) * 10**7
        out = torch.full((B, S, K), 55, dtype=torch.int32)
        counters = torch.tensor([5, 6, 7], dtype=torch.int64)
        reference.union_scatter_reference(inverse, union_rows, draft_base, out, counters)
        unions, outs, drafts, invalid = walk(top_k, first, int(num_real), union_rows,
                                             draft_base)
        real = int(num_real)
        assert union_top_k[:real].tolist() == unions[:real]
        assert out.view(B, U).tolist() == outs
        assert counters.tolist() == [5 + drafts, 6, 7 + invalid]
        # The padding row past B is untouched.
        assert bool((union_top_k[B] == 77).all()) and bool((inverse[B] == 99).all())


def test_union_is_in_first_occurrence_order() -> None:
    """The union row lists the distinct older positions by their first entry (s, then k)."""
    top_k = torch.tensor([[[9, 3, 9, -1], [7, 3, 1, 12]]], dtype=torch.int32)
    first = torch.tensor([10, 0])
    num_real = torch.tensor([1], dtype=torch.int32)
    union_top_k = torch.zeros(2, 8, dtype=torch.int32)
    inverse = torch.zeros_like(union_top_k)
    reference.union_plan_reference(top_k, first, num_real, union_top_k, inverse)
    assert union_top_k[0].tolist() == [9, 3, 7, 1, -1, -1, -1, -1]
    # 12 > own position 11: invalid (U + 1); -1: nothing (U).
    assert inverse[0].tolist() == [0, 1, 0, 8, 2, 1, 3, 9]


def test_reference_codes_follow_build_union(seed: int) -> None:
    """The codes are `build_union`'s inverse, draft and invalid flags, packed."""
    S, K, B = 3, 8, 3
    top_k, first, num_real = random_inputs(S, K, B, torch.Generator().manual_seed(seed))
    U = S * K
    union_top_k = torch.empty(B + 1, U, dtype=torch.int32)
    inverse = torch.empty_like(union_top_k)
    reference.union_plan_reference(top_k, first, num_real, union_top_k, inverse)
    real = torch.arange(B) < num_real.long()
    union = reference.build_union(top_k, first[:B], real)
    code = inverse[:B].long().view(B, S, K)
    assert torch.equal(union_top_k[:B].long(), union.positions)
    assert torch.equal(code <= -2, union.draft)
    assert torch.equal(code == U + 1, union.invalid)
    columns = (code >= 0) & (code <= U)
    assert torch.equal(code[columns], union.inverse.view(B, S, K)[columns])
    drafts = top_k.long() - first[:B, None, None]
    assert torch.equal((-2 - code)[union.draft], drafts[union.draft])
