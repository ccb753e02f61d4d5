"""Triton union plan and scatter against the torch reference, on fresh random inputs.

On a GPU it runs natively (widths up to S x K = 8 x 2048, the bound launcher and a graph
replay with another real count); without one under TRITON_INTERPRET=1 at small sizes.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hisparse.kernels import union_reference as reference
from interpreted_kernels import (  # sets TRITON_INTERPRET before kernels compile
    DEVICE,
    KERNEL_MARK,
    ON_GPU,
    union_triton,
)

pytestmark = KERNEL_MARK

# (S, K, B): B batch rows of a capacity one larger.
SIZES = [(s, k, b) for s in (1, 2, 3) for k in (4, 16) for b in (1, 3)]
if ON_GPU:
    SIZES += [(2, 2048, 64), (4, 2048, 16), (8, 2048, 4), (8, 2048, 128), (5, 100, 7)]


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
    return (top_k.to(torch.int32).to(DEVICE), first.to(DEVICE),
            num_real.to(torch.int32).to(DEVICE))


def fresh_table(cap: int, first: torch.Tensor, S: int) -> torch.Tensor:
    """A presence table past every position of `first`'s requests (max_seq_len + D)."""
    return reference.presence_table(cap, int(first.max()) + S + 8, DEVICE)


def assert_table_empty(table: torch.Tensor) -> None:
    """A code left in the table would corrupt the next step's plan."""
    assert bool((table == reference.SENTINEL).all()), "the plan left its table dirty"


def run_both(S: int, K: int, B: int, seed: int, top_k: torch.Tensor | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    drawn, first, num_real = random_inputs(S, K, B, gen)
    top_k = drawn if top_k is None else top_k
    cap, U = B + 1, S * K
    table = fresh_table(cap, first, S)
    triton_plan = functools.partial(union_triton.union_plan_triton, table=table)
    union_rows = torch.randint(0, 10**6, (B, U), generator=gen).to(torch.int32).to(DEVICE)
    draft_base = (torch.arange(cap) * 10**7).to(DEVICE)
    got = []
    for plan, scatter in ((reference.union_plan_reference, reference.union_scatter_reference),
                          (triton_plan, union_triton.union_scatter_triton)):
        union_top_k = torch.full((cap, U), 77, dtype=torch.int32, device=DEVICE)
        inverse = torch.full((cap, U), 99, dtype=torch.int32, device=DEVICE)
        out = torch.full((B, S, K), 55, dtype=torch.int32, device=DEVICE)
        counters = torch.tensor([5, 6, 7], dtype=torch.int64, device=DEVICE)
        plan(top_k, first, num_real, union_top_k, inverse)
        scatter(inverse, union_rows, draft_base, out, counters)
        got.append([t.cpu() for t in (union_top_k, inverse, out, counters)])
    for name, want, have in zip(("union", "inverse", "out", "counters"), *got, strict=True):
        assert torch.equal(want, have), (name, S, K, B, seed)
    assert_table_empty(table)
    # The padding row past B is untouched.
    assert bool((got[1][0][B] == 77).all()) and bool((got[1][1][B] == 99).all())


@pytest.mark.parametrize(("S", "K", "B"), SIZES)
def test_union_kernels_equal_the_reference(S: int, K: int, B: int, seed: int) -> None:
    for trial in range(2 if ON_GPU else 1):
        run_both(S, K, B, seed * 1000 + S * 100 + K + B + trial)


def test_all_duplicate_and_nothing_older_rows(seed: int) -> None:
    """Rows of one repeated position, rows all -1 and rows all draft tokens."""
    S, K, B = (8, 2048, 6) if ON_GPU else (3, 8, 4)
    gen = torch.Generator().manual_seed(seed)
    _, first, _ = random_inputs(S, K, B, gen)
    first = first.cpu()
    first[:B] = first[:B].clamp(min=1)
    top_k = torch.full((B, S, K), -1, dtype=torch.int32)
    top_k[0] = int(first[0]) - 1  # one position, every entry
    top_k[1, :, ::2] = 0  # one position, every other entry
    top_k[2] = int(first[2])  # the step's first token only: every entry a draft
    if B > 3:
        top_k[3, -1] = torch.arange(K) % max(1, int(first[3]))  # repeats only in the last row
    run_both(S, K, B, seed, top_k.to(DEVICE))


def test_union_is_in_first_occurrence_order() -> None:
    """The union row lists the distinct older positions by their first entry (s, then k)."""
    top_k = torch.tensor([[[9, 3, 9, -1], [7, 3, 1, 12]]], dtype=torch.int32, device=DEVICE)
    first = torch.tensor([10, 0], device=DEVICE)
    num_real = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    for plan in (reference.union_plan_reference,
                 functools.partial(union_triton.union_plan_triton,
                                   table=reference.presence_table(2, 16, DEVICE))):
        union_top_k = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
        inverse = torch.zeros_like(union_top_k)
        plan(top_k, first, num_real, union_top_k, inverse)
        assert union_top_k[0].tolist() == [9, 3, 7, 1, -1, -1, -1, -1]
        # 12 > own position 11: invalid (U + 1); -1: nothing (U).
        assert inverse[0].tolist() == [0, 1, 0, 8, 2, 1, 3, 9]


def test_reference_codes_follow_build_union(seed: int) -> None:
    """The codes are `build_union`'s inverse, draft and invalid flags, packed."""
    S, K, B = 3, 8, 3
    top_k, first, num_real = random_inputs(S, K, B, torch.Generator().manual_seed(seed))
    U = S * K
    union_top_k = torch.empty(B + 1, U, dtype=torch.int32, device=DEVICE)
    inverse = torch.empty_like(union_top_k)
    reference.union_plan_reference(top_k, first, num_real, union_top_k, inverse)
    real = torch.arange(B, device=DEVICE) < num_real.long()
    union = reference.build_union(top_k, first[:B], real)
    code = inverse[:B].long().view(B, S, K)
    assert torch.equal(union_top_k[:B].long(), union.positions)
    assert torch.equal(code <= -2, union.draft)
    assert torch.equal(code == U + 1, union.invalid)
    columns = (code >= 0) & (code <= U)
    assert torch.equal(code[columns], union.inverse.view(B, S, K)[columns])
    drafts = top_k.long() - first[:B, None, None]
    assert torch.equal((-2 - code)[union.draft], drafts[union.draft])


def launchers(S: int, K: int, cap: int, groups: int, layers: int
              ) -> tuple[list[object], list[dict[str, torch.Tensor]]]:
    """A Triton and a reference launcher of one width over buffers of their own."""
    made, buffers = [], []
    first = torch.randint(0, 3 * K, (cap,)).to(DEVICE)
    draft_base = (torch.arange(cap) * 10**7).to(DEVICE)
    num_real = torch.tensor([cap], dtype=torch.int32, device=DEVICE)
    table = reference.presence_table(cap, 3 * K + S + 8, DEVICE)
    for kind in (union_triton.UnionLauncher, reference.ReferenceUnionLauncher):
        b = {"union_top_k": torch.full((cap, S * K), -1, dtype=torch.int32, device=DEVICE),
             "union_out": torch.zeros(groups, cap, S * K, dtype=torch.int32, device=DEVICE),
             "rows": torch.full((groups, cap, S, K), -1, dtype=torch.int32, device=DEVICE),
             "counters": torch.zeros(layers, 3, dtype=torch.int64, device=DEVICE),
             "num_real": num_real.clone()}
        extra = ({"direct": ON_GPU, "table": lambda: table}
                 if kind is union_triton.UnionLauncher else {})
        b["table"] = table
        made.append(kind(S, K, first, draft_base, b["num_real"], b["union_top_k"],
                         b["union_out"], b["rows"], b["counters"], **extra))
        buffers.append(b)
    return made, buffers


def test_bound_launcher_rebinds_top_k_and_follows_num_real(seed: int) -> None:
    S, K, cap = (4, 512, 8) if ON_GPU else (2, 4, 3)
    gen = torch.Generator().manual_seed(seed)
    made, buffers = launchers(S, K, cap, groups=2, layers=3)
    for call in range(4):
        rows = cap - call % 2
        top_k, _, _ = random_inputs(S, K, rows, gen)  # a new tensor each call: a rebind
        real = 1 + call % rows
        fill = torch.randint(0, 10**6, (2, cap, S * K), generator=gen).to(torch.int32)
        for launcher, b in zip(made, buffers, strict=True):
            b["num_real"].fill_(real)
            b["union_out"].copy_(fill.to(DEVICE))
            launcher.plan(rows, top_k)  # type: ignore[attr-defined]
            launcher.scatter(call % 3, call % 2, rows)  # type: ignore[attr-defined]
        for name in ("union_top_k", "rows", "counters"):
            want, have = buffers[1][name], buffers[0][name]
            assert torch.equal(want.cpu(), have.cpu()), (name, call)
        assert_table_empty(buffers[0]["table"])


@pytest.mark.skipif(not ON_GPU, reason="graph capture needs a GPU")
def test_captured_union_replays_with_another_real_count(seed: int) -> None:
    S, K, cap = 4, 1024, 8
    gen = torch.Generator().manual_seed(seed)
    made, buffers = launchers(S, K, cap, groups=1, layers=1)
    triton_launcher, ref = made
    top_k, _, _ = random_inputs(S, K, cap, gen)
    triton_launcher.plan(cap, top_k)  # type: ignore[attr-defined]  (eager first: compiles)
    triton_launcher.scatter(0, 0, cap)  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_launcher.plan(cap, top_k)  # type: ignore[attr-defined]
        triton_launcher.scatter(0, 0, cap)  # type: ignore[attr-defined]
    for real in (cap, 3, 1):
        top_k.copy_(random_inputs(S, K, cap, gen)[0])
        for b in buffers:
            b["num_real"].fill_(real)
            b["counters"].zero_()
        graph.replay()
        ref.plan(cap, top_k)  # type: ignore[attr-defined]
        ref.scatter(0, 0, cap)  # type: ignore[attr-defined]
        for name in ("union_top_k", "rows", "counters"):
            assert torch.equal(buffers[0][name].cpu(), buffers[1][name].cpu()), (name, real)
        assert_table_empty(buffers[0]["table"])
