"""The swap-in that de-duplicates a verify step's `[B, S * K]` rows itself (`DraftUnion`)
against the union reference: the union plan, the reference swap-in over the union row, and
the scatter back to `[B, S, K]` (`kernels.union_reference`).

Both must leave every table alike (the misses take their victims in the same order), return
the same rows, count the same hits, misses and invalid entries, and the presence table must
be empty again after every call. On a GPU the kernels run natively at DeepSeek-V3.2 sizes;
without one under TRITON_INTERPRET=1 at small sizes.
"""

from __future__ import annotations

import os

import pytest
import torch

from hisparse.errors import InvalidInputError
from hisparse.kernels.swap_in.plan import tuning
from hisparse.kernels.swap_in.reference import swap_in_reference
from hisparse.kernels.union_reference import (
    SENTINEL,
    presence_table,
    union_plan_reference,
    union_scatter_reference,
)
from hisparse.layout.tables import CacheTables, DraftUnion, MissPlan
from interpreted_kernels import DEVICE, KERNEL_MARK, ON_GPU  # sets TRITON_INTERPRET first
from interpreted_kernels import swap_in_triton as triton_kernels
from test_swap_in_triton import POISON, SWAP_IN_CALLS, Sizes, clone_tables, make_tables

pytestmark = KERNEL_MARK

# (sizes, S): H >= S x K, as a cache with max_draft_tokens = S requires.
CASES = [
    (Sizes(top_k=16, hot=32, row_bytes=16, extent=8, batch_cap=3, num_requests=4), 2),
    (Sizes(top_k=16, hot=64, row_bytes=16, extent=1, batch_cap=4, num_requests=5,
           resident_dtype=torch.int32), 4),
    (Sizes(top_k=24, hot=48, row_bytes=24, extent=4, batch_cap=3, num_requests=4), 1),
] + ([(Sizes(top_k=2048, hot=4096, row_bytes=656, extent=64, batch_cap=8,
             num_requests=10), 2),
      (Sizes(top_k=2048, hot=16384, row_bytes=656, extent=64, batch_cap=4,
             num_requests=6), 8)]
     # HISPARSE_TRITON_TEST_SIZES=small: the small sizes alone (compute-sanitizer runs).
     if ON_GPU and os.environ.get("HISPARSE_TRITON_TEST_SIZES") != "small" else [])
VARIANTS = [("host_row", False), ("host_row", True), ("position", False)]


def verify_top_k(tables: CacheTables, sizes: Sizes, S: int, gen: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(req_slots, top_k [Bcap, S, K], num_real, first): each real row's S query tokens pick,
    with repeats, from a small pool of its older positions and its own S tokens, with -1,
    invalid entries (below -1, or after the query token) and garbage on padding rows."""
    cap, K = sizes.batch_cap, sizes.top_k
    seq_lens = tables.seq_lens.tolist()
    # A verify step's requests hold its S tokens (seq_len = first + S); padding rows any.
    order = torch.randperm(sizes.num_requests, generator=gen).tolist()
    ready = [r for r in order if seq_lens[r] >= S]
    slots = torch.tensor((ready + [r for r in order if r not in ready])[:cap])
    num_real = int(torch.randint(1, min(cap, len(ready)) + 1, (1,), generator=gen))
    top_k = torch.randint(-3, 4 * sizes.hot, (cap, S, K), generator=gen, dtype=torch.int32)
    first = torch.zeros(cap, dtype=torch.int64)
    for b in range(num_real):
        n = seq_lens[int(slots[b])]
        first[b] = start = n - S
        older = torch.randint(0, max(start, 1), (max(K // 2, 1),), generator=gen)
        choices = torch.cat([older if start else older[:0], torch.arange(start, start + S),
                             torch.tensor([-1, -1, -2, n + 3])])
        pick = torch.randint(0, choices.numel(), (S, K), generator=gen)
        top_k[b] = choices[pick].to(torch.int32)
    return (slots.to(torch.int32).to(DEVICE), top_k.to(DEVICE),
            torch.tensor([num_real], dtype=torch.int32, device=DEVICE), first.to(DEVICE))


def union_path(t: CacheTables, layer: int, group: int, req_slots: torch.Tensor,
               top_k: torch.Tensor, num_real: torch.Tensor, first: torch.Tensor,
               draft_base: torch.Tensor) -> torch.Tensor:
    cap, S, K = top_k.shape
    union_top_k = torch.full((cap, S * K), -1, dtype=torch.int32, device=DEVICE)
    inverse = torch.full_like(union_top_k, S * K)
    union_plan_reference(top_k, first, num_real, union_top_k, inverse)
    union_rows = torch.full_like(union_top_k, POISON)
    swap_in_reference(t, layer, group, req_slots, union_top_k, num_real, union_rows)
    out = torch.full_like(top_k, POISON)
    union_scatter_reference(inverse, union_rows, draft_base, out, t.counters[layer],
                            t.request_counters, req_slots, num_real)
    return out


def fused_path(t: CacheTables, layer: int, group: int, req_slots: torch.Tensor,
               top_k: torch.Tensor, num_real: torch.Tensor, union: DraftUnion,
               plan: MissPlan, copy: str = "by size", candidates: bool = False
               ) -> torch.Tensor:
    """The fused swap-in, its copy as the plan picks it by batch size (the planned copy
    completes the union), or forced to walk the top-k entries ("prefetched", which completes
    it too), or the large-batch planned copy or none ("skip_io"), behind the union's own
    kernel. `candidates`: Tuning.verify_first_candidates."""
    cap, S, K = top_k.shape
    out = torch.full((cap, S * K), POISON, dtype=torch.int32, device=DEVICE)
    overrides = {"prefetched": {"prefetch_copy_max_batch": None},
                 "large-batch copy": {"prefetch_copy_max_batch": 0,
                                      "large_batch_copy_min_batch": 1}}.get(copy, {})
    with tuning(**overrides, verify_first_candidates=candidates):
        triton_kernels.swap_in_triton(t, layer, group, req_slots, top_k.view(cap, S * K),
                                      num_real, out, plan=plan, union=union,
                                      skip_io=copy == "skip_io")
    return out.view(cap, S, K)


@pytest.mark.parametrize(("sizes", "S"), CASES)
@pytest.mark.parametrize(("residency_map", "key_extents"), VARIANTS)
@pytest.mark.parametrize("copy", ["by size", "prefetched", "large-batch copy", "skip_io"])
@pytest.mark.parametrize("candidates", [False, True], ids=["all-misses", "candidates"])
def test_the_fused_union_swap_in_matches_the_union_reference(
        sizes: Sizes, S: int, residency_map: str, key_extents: bool, copy: str,
        candidates: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ref = make_tables(sizes, gen, residency_map, key_extents=key_extents)
    tri = clone_tables(ref)
    cap, K = sizes.batch_cap, sizes.top_k
    slots = sizes.hot + 1
    table = presence_table(cap, ref.positions_per_request, DEVICE)
    first = torch.zeros(cap, dtype=torch.int64, device=DEVICE)
    draft_base = torch.zeros(cap, dtype=torch.int64, device=DEVICE)
    union = DraftUnion(S, K, first, draft_base, lambda: table)
    for _step in range(3):
        req_slots, top_k, num_real, step_first = verify_top_k(ref, sizes, S, gen)
        first.copy_(step_first)
        # Any device rows will do: both paths hand the same ones out for the step's tokens.
        draft_base.copy_(req_slots.long() * slots + sizes.hot - S + 1)
        for layer, group in SWAP_IN_CALLS:
            plan = MissPlan.empty(cap, S * K, DEVICE)
            want = union_path(ref, layer, group, req_slots, top_k, num_real, first,
                              draft_base)
            got = fused_path(tri, layer, group, req_slots, top_k, num_real, union, plan, copy,
                             candidates)
            assert torch.equal(got, want), (layer, (got != want).nonzero()[:8].tolist())
            for name in ("resident", "slot_key", "last_use", "lru_clock", "counters",
                         "request_counters"):
                assert torch.equal(getattr(tri, name), getattr(ref, name)), (layer, name)
            if copy == "skip_io":
                tri.device_kv.copy_(ref.device_kv)  # skipped: the rows alone differ
            assert torch.equal(tri.device_kv, ref.device_kv), layer
            assert bool((table == SENTINEL).all()), "the presence table was left dirty"
            # The plan lists each missing position once: the rows the followers replay.
            count = plan.count[:cap].clamp(min=0)
            assert int(count.sum()) <= int(ref.counters[layer, 1])


def test_a_position_repeated_in_every_row_is_one_miss_and_one_slot() -> None:
    sizes = Sizes(top_k=16, hot=32, row_bytes=16, extent=8, batch_cap=1, num_requests=1)
    S, K = 2, sizes.top_k
    gen = torch.Generator().manual_seed(3)
    t = make_tables(sizes, gen)
    n = int(t.seq_lens[0])
    start = n - S
    # Position 0 is long evicted in a request of 3 H tokens: a miss in every entry.
    top_k = torch.zeros(1, S, K, dtype=torch.int32, device=DEVICE)
    table = presence_table(1, t.positions_per_request, DEVICE)
    union = DraftUnion(S, K, torch.tensor([start], device=DEVICE),
                       torch.zeros(1, dtype=torch.int64, device=DEVICE), lambda: table)
    before = t.counters[0].clone()
    out = fused_path(t, 0, 0, torch.zeros(1, dtype=torch.int32, device=DEVICE), top_k,
                     torch.ones(1, dtype=torch.int32, device=DEVICE), union,
                     MissPlan.empty(1, S * K, DEVICE))
    assert (t.counters[0] - before).tolist() == [0, 1, 0]
    assert out.unique().numel() == 1 and int(out[0, 0, 0]) >= 0
    row = t.device_kv[0, int(out[0, 0, 0])]
    host = int(t.page_table[0, 0]) * sizes.extent
    assert torch.equal(row.cpu(), t.host_kv[0][host].cpu())
    assert bool((table == SENTINEL).all())


@pytest.mark.skipif(not ON_GPU, reason="graph capture needs a GPU")
def test_a_captured_fused_union_replays_with_other_rows_and_real_counts(seed: int) -> None:
    # The widest S = 2 case: K = 2048 on a GPU, the small one under compute-sanitizer.
    sizes, S = next(case for case in reversed(CASES) if case[1] == 2)
    gen = torch.Generator().manual_seed(seed)
    ref = make_tables(sizes, gen)
    tri = clone_tables(ref)
    cap, K, slots = sizes.batch_cap, sizes.top_k, sizes.hot + 1
    table = presence_table(cap, ref.positions_per_request, DEVICE)
    inputs = verify_top_k(ref, sizes, S, gen)
    req_slots, top_k, num_real, first = (t.clone() for t in inputs)
    draft_base = req_slots.long() * slots + sizes.hot - S + 1
    union = DraftUnion(S, K, first, draft_base, lambda: table)
    out = torch.full((cap, S * K), POISON, dtype=torch.int32, device=DEVICE)
    plan = MissPlan.empty(cap, S * K, DEVICE)

    def fused() -> None:
        triton_kernels.swap_in_triton(tri, 0, 0, req_slots, top_k.view(cap, S * K), num_real,
                                      out, plan=plan, union=union)

    fused()  # eager first: compiles, and both tables take the same step
    union_path(ref, 0, 0, req_slots, top_k, num_real, first, draft_base)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused()
    for _step in range(3):
        for buffer, value in zip((req_slots, top_k, num_real, first),
                                 verify_top_k(ref, sizes, S, gen), strict=True):
            buffer.copy_(value)
        draft_base.copy_(req_slots.long() * slots + sizes.hot - S + 1)
        out.fill_(POISON)
        graph.replay()
        want = union_path(ref, 0, 0, req_slots, top_k, num_real, first, draft_base)
        assert torch.equal(out.view(cap, S, K), want)
        for name in ("resident", "slot_key", "last_use", "lru_clock", "counters",
                     "device_kv"):
            assert torch.equal(getattr(tri, name), getattr(ref, name)), name
        assert bool((table == SENTINEL).all())


def test_a_presence_table_narrower_than_the_page_tables_is_refused_before_any_launch() -> None:
    sizes, S = CASES[0]
    t = make_tables(sizes, torch.Generator().manual_seed(5))
    cap, K = sizes.batch_cap, sizes.top_k
    narrow = presence_table(cap, t.positions_per_request - 1, DEVICE)
    union = DraftUnion(S, K, torch.zeros(cap, dtype=torch.int64, device=DEVICE),
                       torch.zeros(cap, dtype=torch.int64, device=DEVICE), lambda: narrow)
    before = clone_tables(t)
    out = torch.full((cap, S * K), POISON, dtype=torch.int32, device=DEVICE)
    with pytest.raises(InvalidInputError, match="presence table"):
        triton_kernels.swap_in_triton(
            t, 0, 0, torch.zeros(cap, dtype=torch.int32, device=DEVICE),
            torch.zeros(cap, S * K, dtype=torch.int32, device=DEVICE),
            torch.ones(1, dtype=torch.int32, device=DEVICE), out, union=union)
    assert bool((out == POISON).all()) and bool((narrow == SENTINEL).all())
    for name in ("resident", "slot_key", "last_use", "lru_clock", "counters"):
        assert torch.equal(getattr(t, name), getattr(before, name)), name


@pytest.mark.parametrize("failing", [1, 2], ids=["selection", "copy"])
def test_a_launch_failing_behind_the_lookup_leaves_the_table_and_counts_clean(
        failing: int, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The selection and the copy empty what the lookup claimed and counted; when either
    fails to launch, the call resets those itself, so the next call de-duplicates right."""
    from hisparse.kernels.swap_in import launch as launch_module

    sizes, S = CASES[0]
    gen = torch.Generator().manual_seed(seed)
    t = make_tables(sizes, gen)
    cap, K = sizes.batch_cap, sizes.top_k
    table = presence_table(cap, t.positions_per_request, DEVICE)
    req_slots, top_k, num_real, first = verify_top_k(t, sizes, S, gen)
    union = DraftUnion(S, K, first, req_slots.long() * (sizes.hot + 1) + sizes.hot - S + 1,
                       lambda: table)
    bind = launch_module._bind

    def failing_bind(*args: object, **kwargs: object) -> tuple[object, ...]:
        launches = list(bind(*args, **kwargs))

        def fail(stream: object = None) -> None:
            raise RuntimeError("launch failed")

        launches[failing] = fail
        return tuple(launches)

    monkeypatch.setattr(launch_module, "_bind", failing_bind)
    with pytest.raises(RuntimeError, match="launch failed"):
        fused_path(t, 0, 0, req_slots, top_k, num_real, union, MissPlan.empty(cap, S * K,
                                                                               DEVICE))
    scratch = launch_module.scratch_for(t, cap, S * K)
    assert bool((table == SENTINEL).all())
    for counts in (scratch.miss_count, scratch.hit_count, scratch.address_order,
                   scratch.row_buckets):
        assert int(counts.abs().sum()) == 0


@pytest.mark.parametrize("block", [4, 64])
def test_the_completion_follows_pointer_chains_to_the_first_entry(block: int, seed: int
                                                                   ) -> None:
    """With first candidates the lookup points a later miss at whichever smaller entry it
    found in the table, itself perhaps pointing further (claims arrive in any order on a
    GPU; in order under the interpreter, where the chains stay one long). Chains built here
    by hand, resolved by programs of `block` entries in any order: every miss ends on its
    position's first entry's row, and every claimed table entry is emptied."""
    import triton

    from hisparse.kernels.swap_in.copy import complete_union_kernel

    gen = torch.Generator().manual_seed(seed)
    rows, K, positions = 2, 48, 16
    pos = torch.randint(0, positions, (rows, K), generator=gen, dtype=torch.int32)
    code = torch.full((rows, K), -3, dtype=torch.int32)  # served, unless missed below
    out = torch.full((rows, K), -1, dtype=torch.int32)
    want = torch.empty_like(out)
    missed_positions = torch.rand(rows, positions, generator=gen) < 0.6
    for b in range(rows):
        for p in range(positions):
            entries = (pos[b] == p).nonzero().flatten().tolist()
            if not entries:
                continue
            if not missed_positions[b, p]:
                out[b, entries] = want[b, entries] = 1000 + p  # served rows stay as they are
                continue
            first, slot = entries[0], 100 * b + p
            out[b, first] = want[b, entries] = slot
            code[b, entries] = -4 - (7 * p)  # a repeat's code, the host row folded in
            code[b, first] = 7 * p
            for i, entry in enumerate(entries[1:], 1):  # each at any smaller entry of its own
                pointer = entries[int(torch.randint(0, i, (1,), generator=gen))]
                out[b, entry] = -2 - pointer
    table = presence_table(rows, positions, "cpu")  # the lookup's claims: each first entry
    for b in range(rows):
        for p in pos[b].unique().tolist():
            table[b, p] = int((pos[b] == p).nonzero()[0])
    args = [code, pos, out, table]
    code, pos, out, table = (a.to(DEVICE) for a in args)
    entries = rows * K
    complete_union_kernel[(triton.cdiv(entries, block),)](
        code, pos, out, table, table.stride(0), entries, K, BLOCK=block, CANDIDATES=True)
    assert torch.equal(out.cpu(), want)
    assert bool((table == SENTINEL).all())
