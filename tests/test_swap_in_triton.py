"""Triton swap-in against the torch reference on random multi-step traces.

On a GPU the kernels run natively at DeepSeek-V3.2 sizes; without one they run on CPU tensors
under TRITON_INTERPRET=1 at small sizes (the interpreter costs about 1 ms per program).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

from hisparse.errors import InvalidInputError
from hisparse.kernels.swap_in.reference import copy_planned_reference, swap_in_reference
from hisparse.layout.tables import CacheTables, MissPlan, NewestRows, ResidencyMap
from interpreted_kernels import (  # sets TRITON_INTERPRET before kernels compile
    DEVICE,
    KERNEL_MARK,
    ON_GPU,
)
from interpreted_kernels import swap_in_triton as triton_kernels

POISON = -7  # never a valid output: every entry must be written over it
LAYER_GROUPS = (0, 0, 1)  # layer 1 replays layer 0's plan; layer 2 has its own group
SWAP_IN_CALLS = ((0, 0), (2, 1))  # (layer, group) of each step's swap-in calls

pytestmark = KERNEL_MARK


@dataclass(frozen=True)
class Sizes:
    top_k: int
    hot: int
    row_bytes: int
    extent: int
    batch_cap: int
    num_requests: int
    # The engine's choice (layout.tables.residency_dtype) is int16; int32 is what hot buffers of
    # more than 32767 slots get, exercised here on small ones.
    resident_dtype: torch.dtype = torch.int16


SMALL = [
    Sizes(top_k=16, hot=32, row_bytes=16, extent=8, batch_cap=3, num_requests=4),
    Sizes(top_k=48, hot=48, row_bytes=24, extent=1, batch_cap=4, num_requests=5,
          resident_dtype=torch.int32),
    Sizes(top_k=64, hot=128, row_bytes=64, extent=16, batch_cap=4, num_requests=4),
]
LARGE = [
    Sizes(top_k=2048, hot=4096, row_bytes=656, extent=64, batch_cap=8, num_requests=10),
    Sizes(top_k=128, hot=200, row_bytes=1152, extent=1, batch_cap=16, num_requests=16,
          resident_dtype=torch.int32),
]
# HISPARSE_TRITON_TEST_SIZES=small keeps the small sizes on a GPU (for compute-sanitizer runs).
SIZES = LARGE if ON_GPU and os.environ.get("HISPARSE_TRITON_TEST_SIZES") != "small" else SMALL


def _host_tensor(rows: int, row_bytes: int, gen: torch.Generator) -> torch.Tensor:
    data = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=gen)
    return data.pin_memory() if ON_GPU else data


def make_tables(sizes: Sizes, gen: torch.Generator, residency_map: ResidencyMap = "host_row",
                key_extents: bool = False) -> CacheTables:
    """Random requests (free, short, at the switch, long) seeded as docs/ARCHITECTURE.md says,
    their residency map keyed by host row or by (request slot, position). `key_extents`
    (host_row): the page tables hold key extents out of twice the pool's extents, each held
    by one request, whose host extents `key_host_extent` gives at random, so requests share
    host extents under distinct keys and a key row is some other token's host row (a miss
    that copied from its key row would copy another token's bytes)."""
    hot, ext, num_req = sizes.hot, sizes.extent, sizes.num_requests
    slots = hot + 1
    kinds = torch.randint(0, 4, (num_req,), generator=gen).tolist()
    seq_lens = []
    for kind in kinds:
        if kind == 0:
            seq_lens.append(0)
        elif kind == 1:
            seq_lens.append(int(torch.randint(1, hot + 1, (1,), generator=gen)))
        elif kind == 2:
            seq_lens.append(hot + 1)
        else:
            seq_lens.append(int(torch.randint(hot + 2, 4 * hot, (1,), generator=gen)))
    seq_lens[0] = 3 * hot  # at least one long request
    if num_req > 1:
        seq_lens[1] = hot  # and one exactly at the hot buffer's size: the last short length
    pages = [math.ceil(n / ext) for n in seq_lens]
    max_pages = max(pages) + 1
    num_extents = sum(pages) + 3  # some extents stay free
    num_keys = 2 * num_extents if key_extents else num_extents
    extent_ids = torch.randperm(num_keys, generator=gen).tolist()
    page_table = torch.full((num_req, max_pages), -1, dtype=torch.int32)
    for r, count in enumerate(pages):
        page_table[r, :count] = torch.tensor(extent_ids[:count], dtype=torch.int32)
        extent_ids = extent_ids[count:]
    num_host_rows = num_extents * ext
    key_host_extent = None
    if key_extents:  # every held key extent names a host extent; a few share one
        key_host_extent = torch.full((num_keys,), -1, dtype=torch.int32)
        held = page_table[page_table >= 0].long()
        key_host_extent[held] = torch.randint(0, num_extents, (held.numel(),), generator=gen,
                                              dtype=torch.int32)
    num_layers, num_groups = len(LAYER_GROUPS), max(LAYER_GROUPS) + 1
    host_kv = [_host_tensor(num_host_rows, sizes.row_bytes, gen) for _ in range(num_layers)]
    device_kv = torch.randint(
        0, 256, (num_layers, num_req * slots, sizes.row_bytes), dtype=torch.uint8, generator=gen
    )
    positions = max_pages * ext
    by_position = residency_map == "position"
    slot_key = torch.full((num_groups, num_req, hot), -1, dtype=torch.int32)
    resident = torch.full((num_groups, num_req * positions if by_position else num_keys * ext),
                          -1, dtype=sizes.resident_dtype)
    # Seeded (-1, clock 0) or later states: stamps below the clock, in a narrow range (ties
    # decide most victims) or spread over 2^20 steps (the selection's bit search decides).
    last_use = torch.full((num_groups, num_req, hot), -1, dtype=torch.int32)
    lru_clock = torch.zeros(num_groups, num_req, dtype=torch.int32)
    for g in range(num_groups):
        for r, n in enumerate(seq_lens):
            kind = int(torch.randint(0, 3, (1,), generator=gen)) if n > hot else 0
            if kind:
                clock = int(torch.randint(1, 6 if kind == 1 else 1 << 20, (1,), generator=gen))
                low = -2 if kind == 1 else -(1 << 20)
                lru_clock[g, r] = clock
                last_use[g, r] = torch.randint(low, clock, (hot,), generator=gen,
                                               dtype=torch.int32)

    def key_row(r: int, pos: int) -> int:
        return int(page_table[r, pos // ext]) * ext + pos % ext

    def host_row(r: int, pos: int) -> int:
        page = int(page_table[r, pos // ext])
        host = page if key_host_extent is None else int(key_host_extent[page])
        return host * ext + pos % ext

    for r, n in enumerate(seq_lens):
        if n == 0:
            continue
        if n <= hot:
            seeded = {p: p for p in range(n)}
        else:
            seeded = {s: n - 1 - hot + s for s in range(hot)}
            for layer in range(num_layers):
                device_kv[layer, r * slots + hot] = host_kv[layer][host_row(r, n - 1)]
        for s, pos in seeded.items():
            row = host_row(r, pos)
            key = r * positions + pos if by_position else key_row(r, pos)
            slot_key[:, r, s] = key
            resident[:, key] = s
            for layer in range(num_layers):
                device_kv[layer, r * slots + s] = host_kv[layer][row]
    return CacheTables(
        device_kv=device_kv.to(DEVICE),
        host_kv=host_kv,
        page_table=page_table.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        slot_key=slot_key.to(DEVICE),
        last_use=last_use.to(DEVICE),
        lru_clock=lru_clock.to(DEVICE),
        resident=resident.to(DEVICE),
        counters=torch.zeros(num_layers, 3, dtype=torch.int64, device=DEVICE),
        hot_slots=hot,
        extent_tokens=ext,
        residency_map=residency_map,
        # Not zero: the swap-in must add to what a request has counted, not overwrite it.
        request_counters=torch.randint(0, 1000, (num_req, 2), generator=gen,
                                       dtype=torch.int64).to(DEVICE),
        key_host_extent=None if key_host_extent is None else key_host_extent.to(DEVICE),
    )


def clone_tables(t: CacheTables) -> CacheTables:
    return CacheTables(
        device_kv=t.device_kv.clone(),
        host_kv=t.host_kv,  # read-only for swap-in
        page_table=t.page_table,
        seq_lens=t.seq_lens,
        slot_key=t.slot_key.clone(),
        last_use=t.last_use.clone(),
        lru_clock=t.lru_clock.clone(),
        resident=t.resident.clone(),
        counters=t.counters.clone(),
        hot_slots=t.hot_slots,
        extent_tokens=t.extent_tokens,
        residency_map=t.residency_map,
        request_counters=(None if t.request_counters is None
                          else t.request_counters.clone()),
        key_host_extent=t.key_host_extent,  # read-only for swap-in
    )


def next_top_k(
    tables: CacheTables, sizes: Sizes, previous: dict[int, list[int]], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step's padded batch: churned top-k, -1 and out-of-range entries, padding rows."""
    k = sizes.top_k
    seq_lens = tables.seq_lens.tolist()
    num_real = int(torch.randint(1, sizes.batch_cap + 1, (1,), generator=gen))
    requests = torch.randperm(sizes.num_requests, generator=gen)[:num_real].tolist()
    if 0 not in requests:  # request 0 is long: every batch has misses to plan
        requests[int(torch.randint(0, num_real, (1,), generator=gen))] = 0
    if num_real > 1 and 1 not in requests:  # request 1 sits at n = H (short, not long)
        requests[requests.index(0) - 1] = 1
    top_k = torch.randint(-3, 4 * sizes.hot, (sizes.batch_cap, k), generator=gen)
    # Padding rows carry garbage request slots; they must not matter.
    req_slots = torch.randint(-5, 50, (sizes.batch_cap,), generator=gen)
    for b, r in enumerate(requests):
        req_slots[b] = r
        n = seq_lens[r]
        keep = [p for p in previous.get(r, []) if p < n]
        churn = float(torch.rand(1, generator=gen))
        keep = keep[: int(len(keep) * (1 - churn))]
        kept = set(keep)
        fresh = [p for p in torch.randperm(n, generator=gen).tolist() if p not in kept]
        count = min(n, k - int(torch.randint(0, k // 4 + 1, (1,), generator=gen)))
        chosen = (keep + fresh)[:count]
        if n > sizes.hot and n - 1 not in chosen and torch.rand(1, generator=gen) < 0.5:
            chosen[-1:] = [n - 1]  # the newest token
        row = torch.full((k,), -1, dtype=torch.long)
        row[: len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        bad = torch.randint(0, 3, (1,), generator=gen).item()  # out-of-range entries
        row[k - bad :] = torch.tensor([-2, n, n + 5][:bad], dtype=torch.long)
        row = row[torch.randperm(k, generator=gen)]
        previous[r] = [p for p in row.tolist() if 0 <= p < n]
        top_k[b] = row
    return (
        req_slots.to(torch.int32).to(DEVICE),
        top_k.to(torch.int32).to(DEVICE),
        torch.tensor([num_real], dtype=torch.int32, device=DEVICE),
    )


def poisoned_plan(sizes: Sizes) -> MissPlan:
    plan = MissPlan.empty(sizes.batch_cap, sizes.top_k, DEVICE)
    for tensor in (plan.src, plan.dst, plan.count):
        tensor.fill_(POISON)
    return plan


def assert_same_state(got: CacheTables, want: CacheTables) -> None:
    for name in ("last_use", "lru_clock", "slot_key", "resident", "counters",
                 "request_counters"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.device_kv, want.device_kv), "device rows differ"


def assert_rows_match_host(
    tables: CacheTables, layer: int, req_slots: torch.Tensor, top_k: torch.Tensor, out: torch.Tensor
) -> None:
    """DESIGN 3.1, checked independently of both implementations: every valid entry's device
    row holds the bytes of that token's host row."""
    ext = tables.extent_tokens
    out, top_k = out.cpu().long(), top_k.cpu().long()
    written = out >= 0
    requests = req_slots.cpu().long()[:, None].expand_as(top_k)[written]
    positions = top_k[written]
    extents = tables.page_table.cpu().long()[requests, positions // ext]
    if tables.key_host_extent is not None:  # key extents: their host extents hold the rows
        extents = tables.key_host_extent.cpu().long()[extents]
    host_rows = extents * ext + positions % ext
    device_rows = tables.device_kv[layer][out[written].to(DEVICE)].cpu()
    assert torch.equal(device_rows, tables.host_kv[layer][host_rows].cpu())


# Launch variants (swap_in_triton.Tuning), each against the reference; every flag spelled
# out, so that a name means the same whatever the defaults.
VARIANTS = {
    "default": {},  # what ships (Tuning's defaults)
    # Without programmatic dependent launch (the default uses it where the GPU can), and the
    # large-batch copy grids; they change only how kernels launch, so nothing else may change.
    "no-pdl": {"pdl": False},
    "large-batch-copy": {"large_batch_copy_min_batch": 1},
    "fine-extent-copy": {"large_batch_copy_min_batch": 1, "fine_extent_copy_programs_per_unit": 4,
                         "fine_extent_max_tokens": 1 << 30},
    "late-loads": {"early_loads": False},
    "fenced-counters": {"relaxed_counters": False},
    # The victim selection: the bit search alone, and one round of oldest values before it.
    "bit-search": {"select_fast_rounds": 0},
    "one-fast-round": {"select_fast_rounds": 1},
    # The copy by top-k entry (host rows fetched before the selection is done) at every
    # batch size, and never.
    "prefetched-copy": {"prefetch_copy_max_batch": None},
    "no-prefetched-copy": {"prefetch_copy_max_batch": 0},
    # Small batches classify in their own chunk size (two chunks of a K=16 row).
    "small-batch-chunk": {"small_batch_classify_chunk_k": 8, "small_batch_max": 64},
    # The copy launched early at every batch size, its programs 32 warps wide.
    "pdl-copy-wide": {"pdl_copy_max_batch": None, "large_batch_copy_min_batch": 1,
                      "large_batch_copy_warps": 32},
    # The plan in host-address order at every batch size (few buckets: many misses share
    # one), and never.
    "address-order": {"address_order_min_batch": 1, "address_order_max_extent_tokens": None,
                      "address_buckets": 4},
    "address-order-fine": {"address_order_min_batch": 1,
                           "address_order_max_extent_tokens": None, "address_buckets": 256},
    "batch-row-order": {"address_order_min_batch": None},
}
# The variants run again over a residency map keyed by position (CacheTables.residency_map),
# those whose lookup or selection code differs there.
POSITION_KEYED = ("default", "late-loads", "address-order", "prefetched-copy")
CASES = [pytest.param(v, "host_row", id=v) for v in VARIANTS] + [
    pytest.param(v, "position", id=f"position-keyed-{v}") for v in POSITION_KEYED] + [
    # ...and over key extents (host_row with shared prefixes): the same four differ there.
    pytest.param(v, "key_row", id=f"key-rows-{v}") for v in POSITION_KEYED]


def plans_in_address_order(tune: triton_kernels.Tuning, sizes: Sizes) -> bool:
    """Tuning's rule: from `address_order_min_batch` rows, over extents of at most
    `address_order_max_extent_tokens` tokens."""
    threshold, fine = tune.address_order_min_batch, tune.address_order_max_extent_tokens
    return (threshold is not None and sizes.batch_cap >= threshold
            and (fine is None or sizes.extent <= fine))


def assert_plan_matches(got: MissPlan, want: MissPlan, address_order: bool, buckets: int,
                        num_host_rows: int, poisoned: bool = True) -> None:
    """The reference lists each batch row's misses in its own plan row. A plan in address
    order must hold the same (host row, device row) pairs, K to a plan row, with their
    address buckets ascending. `poisoned`: both plans started as poisoned_plan(), so every
    entry past a row's count must still hold the poison."""
    if not address_order:
        assert torch.equal(got.count, want.count)
        if poisoned:
            assert torch.equal(got.src, want.src) and torch.equal(got.dst, want.dst)
        for b, c in enumerate(want.count.tolist()):
            assert torch.equal(got.src[b, :c], want.src[b, :c]), f"plan row {b} sources"
            assert torch.equal(got.dst[b, :c], want.dst[b, :c]), f"plan row {b} targets"
        return
    top_k = want.src.shape[1]
    want_count, got_count = want.count.tolist(), got.count.tolist()
    pairs = sorted((s, d) for b, c in enumerate(want_count)
                   for s, d in zip(want.src[b, :c].tolist(), want.dst[b, :c].tolist(),
                                   strict=True))
    total = len(pairs)
    assert got_count == [min(max(total - b * top_k, 0), top_k) for b in range(len(got_count))]
    listed = [(s, d) for b, c in enumerate(got_count)
              for s, d in zip(got.src[b, :c].tolist(), got.dst[b, :c].tolist(), strict=True)]
    assert sorted(listed) == pairs, "the plan must list exactly the reference's misses"
    order = [s * buckets // num_host_rows for s, _ in listed]
    assert order == sorted(order), "address buckets must ascend through the plan"
    for b, c in enumerate(got_count):
        if poisoned:
            assert (got.src[b, c:] == POISON).all() and (got.dst[b, c:] == POISON).all()


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"K{s.top_k}-H{s.hot}-W{s.row_bytes}")
@pytest.mark.parametrize(("variant", "residency_map"), CASES)
def test_matches_reference_over_a_trace(sizes: Sizes, variant: str, residency_map: str,
                                        rng: torch.Generator) -> None:
    gen = rng
    key_extents = residency_map == "key_row"
    want = make_tables(sizes, gen, "host_row" if key_extents else residency_map, key_extents)
    got = clone_tables(want)
    previous: dict[int, list[int]] = {}
    overrides: dict[str, object] = {"classify_chunk_k": 16, "small_batch_classify_chunk_k": None,
                                    **VARIANTS[variant]}
    if sizes in SMALL:
        overrides.setdefault("copy_rows", 4)
    with triton_kernels.tuning(**overrides) as tune:
        address_order = plans_in_address_order(tune, sizes)
        for step in range(5):
            if step != 3:  # step 3 repeats step 2's batch: all hits, a miss-free plan
                req_slots, top_k, num_real = next_top_k(want, sizes, previous, gen)
            for layer, group in SWAP_IN_CALLS:
                out_want = torch.full_like(top_k, POISON)
                out_got = torch.full_like(top_k, POISON)
                plan_want, plan_got = poisoned_plan(sizes), poisoned_plan(sizes)
                swap_in_reference(want, layer, group, req_slots, top_k, num_real, out_want,
                                  plan_want)
                triton_kernels.swap_in_triton(got, layer, group, req_slots, top_k, num_real,
                                              out_got, plan_got)
                assert torch.equal(out_got, out_want), f"step {step} layer {layer}: outputs"
                assert_plan_matches(plan_got, plan_want, address_order, tune.address_buckets,
                                    got.num_host_rows)
                if step == 3:
                    assert int(plan_got.count.sum()) == 0, "a repeated batch must all hit"
                scratch = triton_kernels.scratch_for(got, sizes.batch_cap, sizes.top_k)
                assert int(scratch.miss_count.abs().sum()) == 0, "miss counts reset per call"
                assert int(scratch.address_order.abs().sum()) == 0, "bucket state reset per call"
                if layer == 0:  # follower layer 1 of group 0 replays the anchor's plan
                    copy_planned_reference(want, 1, plan_want)
                    triton_kernels.copy_planned_triton(got, 1, plan_got)
                    assert_rows_match_host(got, 1, req_slots, top_k, out_got)
                assert_same_state(got, want)
                assert_rows_match_host(got, layer, req_slots, top_k, out_got)
    assert int(got.counters[:, 1].sum()) > 0, "trace produced no misses: the test is too weak"


@pytest.mark.parametrize("bug", ["key row as host row", "alias to the wrong extent"])
def test_the_trace_catches_a_miss_copied_from_the_wrong_host_row(
        bug: str, rng: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over key extents a miss must copy from its key extent's host extent: a reference that
    took the key row for the host row (another token's row, or none past the pool), or read
    the next key extent's host extent, serves other bytes, and the comparison of the trace
    above (outputs, tables and bytes against the Triton kernels and the host) says so."""
    from hisparse.kernels.swap_in import reference

    real = reference._key_and_host_rows

    def wrong(t: CacheTables, page: torch.Tensor, offset: torch.Tensor):
        key_row, host_row = real(t, page, offset)
        if bug == "key row as host row":
            return key_row, torch.where(key_row < t.num_host_rows, key_row, -1)
        _, shifted = real(t, torch.where(page >= 0, (page + 1) % t.key_host_extent.numel(),
                                         page), offset)
        return key_row, torch.where(host_row >= 0, shifted, -1)

    monkeypatch.setattr(reference, "_key_and_host_rows", wrong)
    sizes = SMALL[0]
    want = make_tables(sizes, rng, key_extents=True)
    got = clone_tables(want)
    previous: dict[int, list[int]] = {}
    with pytest.raises(AssertionError), triton_kernels.tuning(classify_chunk_k=16,
                                                              copy_rows=4):
        for _ in range(5):
            req_slots, top_k, num_real = next_top_k(want, sizes, previous, rng)
            for layer, group in SWAP_IN_CALLS:
                out_want = torch.full_like(top_k, POISON)
                out_got = torch.full_like(top_k, POISON)
                swap_in_reference(want, layer, group, req_slots, top_k, num_real, out_want)
                triton_kernels.swap_in_triton(got, layer, group, req_slots, top_k, num_real,
                                              out_got)
                assert torch.equal(out_got, out_want)
                assert_same_state(got, want)
                assert_rows_match_host(want, layer, req_slots, top_k, out_want)


def test_skip_io_plans_without_moving_rows(rng: torch.Generator) -> None:
    sizes = SIZES[0]
    gen = rng
    want = make_tables(sizes, gen)
    got = clone_tables(want)
    rows_before = got.device_kv.clone()
    previous: dict[int, list[int]] = {}
    for _ in range(2):
        req_slots, top_k, num_real = next_top_k(want, sizes, previous, gen)
        out_want, out_got = torch.full_like(top_k, POISON), torch.full_like(top_k, POISON)
        plan_want, plan_got = poisoned_plan(sizes), poisoned_plan(sizes)
        swap_in_reference(want, 0, 0, req_slots, top_k, num_real, out_want, plan_want, True)
        triton_kernels.swap_in_triton(got, 0, 0, req_slots, top_k, num_real, out_got, plan_got,
                                      skip_io=True)
        assert torch.equal(out_got, out_want)
        assert torch.equal(plan_got.count, plan_want.count)
        assert_same_state(got, want)
    assert torch.equal(got.device_kv, rows_before)
    assert int(got.counters[0, 1]) > 0


def test_copy_planned_replays_an_arbitrary_plan(rng: torch.Generator) -> None:
    sizes = SIZES[0]
    gen = rng
    want = make_tables(sizes, gen)
    got = clone_tables(want)
    plan = MissPlan.empty(sizes.batch_cap, sizes.top_k, DEVICE)
    num_host_rows, num_device_rows = want.resident.shape[1], want.device_kv.shape[1]
    counts = torch.randint(0, sizes.top_k + 1, (sizes.batch_cap,), generator=gen)
    counts[0] = 0  # an empty row between full ones
    destinations = torch.randperm(num_device_rows, generator=gen)
    for b, count in enumerate(counts.tolist()):
        plan.count[b] = count
        plan.src[b] = torch.randint(0, num_host_rows, (sizes.top_k,), generator=gen).to(DEVICE)
        take = destinations[b * sizes.top_k : (b + 1) * sizes.top_k]
        plan.dst[b, : take.numel()] = take.to(torch.int32).to(DEVICE)
        plan.dst[b, take.numel() :] = -1  # beyond the count: must never be read
    copy_planned_reference(want, 2, plan)
    triton_kernels.copy_planned_triton(got, 2, plan)
    assert torch.equal(got.device_kv, want.device_kv)


def _bad_call(t: CacheTables, sizes: Sizes, **change: object) -> None:
    args: dict[str, object] = {
        "tables": t, "layer": 0, "group": 0,
        "req_slots": torch.zeros(sizes.batch_cap, dtype=torch.int32, device=DEVICE),
        "top_k": torch.zeros(sizes.batch_cap, sizes.top_k, dtype=torch.int32, device=DEVICE),
        "num_real": torch.ones(1, dtype=torch.int32, device=DEVICE),
        "out": torch.zeros(sizes.batch_cap, sizes.top_k, dtype=torch.int32, device=DEVICE),
    }
    args.update(change)
    triton_kernels.swap_in_triton(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"top_k": "int64"}, "top_k must be int32"),
        ({"out": "short"}, "out must have shape"),
        ({"num_real": "cpu-float"}, "num_real must be int32"),
        ({"layer": 7}, "layer must be in"),
        ({"group": 5}, "group must be in"),
        ({"plan": "small"}, "plan.src must hold at least"),
        ({"tables": "int64-resident"}, "tables.resident must be int16"),
    ],
)
def test_bad_input_raises_and_changes_nothing(
    change: dict[str, object], message: str, rng: torch.Generator
) -> None:
    sizes = SIZES[0]
    gen = rng
    tables = make_tables(sizes, gen)
    before = clone_tables(tables)
    key, kind = next(iter(change.items()))
    value: object = kind
    if kind == "int64":
        value = torch.zeros(sizes.batch_cap, sizes.top_k, dtype=torch.int64, device=DEVICE)
    elif kind == "short":
        value = torch.zeros(sizes.batch_cap, sizes.top_k - 1, dtype=torch.int32, device=DEVICE)
    elif kind == "cpu-float":
        value = torch.ones(1)
    elif kind == "small":
        value = MissPlan.empty(sizes.batch_cap, sizes.top_k // 2, DEVICE)
    elif kind == "int64-resident":
        tables.resident = tables.resident.long()
        before.resident = before.resident.long()
        value = tables
    with pytest.raises(InvalidInputError, match=message):
        _bad_call(tables, sizes, **{key: value})
    assert_same_state(tables, before)


def test_row_size_not_a_multiple_of_four_is_refused() -> None:
    sizes = Sizes(top_k=8, hot=8, row_bytes=18, extent=4, batch_cap=2, num_requests=2)
    tables = make_tables(sizes, torch.Generator().manual_seed(1))
    with pytest.raises(InvalidInputError, match="multiple of 4"):
        _bad_call(tables, sizes)


def test_hot_buffer_smaller_than_top_k_is_refused() -> None:
    sizes = Sizes(top_k=16, hot=8, row_bytes=16, extent=4, batch_cap=2, num_requests=2)
    tables = make_tables(sizes, torch.Generator().manual_seed(2))
    with pytest.raises(InvalidInputError, match="at least top_k"):
        _bad_call(tables, sizes)


def test_compute_units_come_from_the_triton_driver() -> None:
    """Grid sizing asks Triton's driver, not a vendor module; it must agree with torch's and
    with the backend's traits."""
    from hisparse.kernels.swap_in.launch import _compute_units

    if not ON_GPU:
        assert _compute_units(torch.device("cpu")) == 1
        return
    expected = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert _compute_units(DEVICE) == expected
    assert _compute_units(torch.device("cuda", torch.cuda.current_device())) == expected
    assert triton_kernels.default_traits(DEVICE).compute_units == expected


@pytest.mark.parametrize("extent_tokens", [1, 16, 17, 512])
def test_copy_width_follows_batch_and_extent_size(extent_tokens: int) -> None:
    """Small batches copy over `copy_programs_per_unit` programs per SM; from the large-batch
    threshold on the narrow width, or the fine-extent one for token-granular tables."""
    from hisparse.kernels.swap_in.plan import copy_plan

    units = int(torch.randint(1, 200, ()).item())
    gpu = triton_kernels.DeviceTraits(compute_units=units, pdl=False, interpreted=False)
    top_k = 1 << 24  # more entries than any grid, so the width alone decides

    def programs(rows: int, device: object = gpu) -> int:
        return copy_plan(rows, top_k, extent_tokens, device, "planned", False,
                         triton_kernels.current_tuning()).programs

    with triton_kernels.tuning(large_batch_copy_min_batch=64, copy_programs_per_unit=8,
                               large_batch_copy_programs_per_unit=1,
                               fine_extent_copy_programs_per_unit=None):
        assert (programs(63), programs(64)) == (8 * units, units)
    with triton_kernels.tuning(large_batch_copy_min_batch=64, copy_programs_per_unit=8,
                               large_batch_copy_programs_per_unit=1,
                               fine_extent_copy_programs_per_unit=4, fine_extent_max_tokens=16):
        fine = extent_tokens <= 16
        assert (programs(63), programs(64)) == (8 * units, (4 if fine else 1) * units)
    # The interpreter's grid stays tiny whatever the layout.
    interpreted = triton_kernels.DeviceTraits(compute_units=units, pdl=False, interpreted=True)
    assert programs(64, interpreted) == triton_kernels.current_tuning().interpreter_copy_programs


def test_hot_buffers_past_16384_slots_scan_their_counts_separately(rng: torch.Generator) -> None:
    """The selection packs its two prefix counts into one int32 scan up to 16384 slots; a wider
    row (here 16400 slots, a 32768-slot block) scans them apart. Both must match the
    reference."""
    sizes = Sizes(top_k=16, hot=16400, row_bytes=16, extent=1024, batch_cap=2, num_requests=2)
    want = make_tables(sizes, rng)
    got = clone_tables(want)
    previous: dict[int, list[int]] = {}
    for step in range(3):
        req_slots, top_k, num_real = next_top_k(want, sizes, previous, rng)
        out_want, out_got = torch.full_like(top_k, POISON), torch.full_like(top_k, POISON)
        swap_in_reference(want, 0, 0, req_slots, top_k, num_real, out_want)
        triton_kernels.swap_in_triton(got, 0, 0, req_slots, top_k, num_real, out_got)
        assert torch.equal(out_got, out_want), f"step {step}"
        assert_same_state(got, want)
        assert_rows_match_host(got, 0, req_slots, top_k, out_got)
    assert int(got.counters[0, 1]) > 0, "no misses: the selection never ran"


@pytest.mark.parametrize("sizes", SIZES[:2], ids=lambda s: f"K{s.top_k}-H{s.hot}")
def test_the_bound_launcher_matches_the_reference(sizes: Sizes, rng: torch.Generator) -> None:
    """The engine's launcher: persistent batch buffers bound once, one plan and one set of
    launches per (layer, group, batch rows), a new top-k tensor on most calls (its address
    swapped into the bound launches), follower replays of the recorded plan. On a GPU its
    launches go straight to triton's compiled launcher after the first."""
    want = make_tables(sizes, rng)
    got = clone_tables(want)
    groups = max(LAYER_GROUPS) + 1
    req_buffer = torch.zeros(sizes.batch_cap, dtype=torch.int32, device=DEVICE)
    real_buffer = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out_buffer = torch.full((groups, sizes.batch_cap, sizes.top_k), POISON, dtype=torch.int32,
                            device=DEVICE)
    traits = triton_kernels.default_traits(DEVICE)
    launcher = triton_kernels.SwapInLauncher(got, req_buffer, real_buffer, out_buffer,
                                             traits=traits, plans=[
                                                 MissPlan.empty(sizes.batch_cap, sizes.top_k,
                                                                DEVICE), None])
    previous: dict[int, list[int]] = {}
    kept_top_k = None
    for step in range(6):
        req_slots, top_k, num_real = next_top_k(want, sizes, previous, rng)
        rows = int(torch.randint(int(num_real), sizes.batch_cap + 1, ()).item())
        req_buffer.copy_(req_slots)
        real_buffer.copy_(num_real)
        # Steps 2 and 4 reuse the tensor of the step before (same address, new contents).
        if step in (2, 4) and kept_top_k is not None and kept_top_k.shape[0] == rows:
            kept_top_k.copy_(top_k[:rows])
            call_top_k = kept_top_k
        else:
            call_top_k = kept_top_k = top_k[:rows].clone()
        for layer, group in SWAP_IN_CALLS:
            out_want = torch.full((rows, sizes.top_k), POISON, dtype=torch.int32, device=DEVICE)
            plan_want = poisoned_plan(sizes).first_rows(rows)
            swap_in_reference(want, layer, group, req_slots[:rows], top_k[:rows], num_real,
                              out_want, plan_want)
            out_buffer[group].fill_(POISON)
            launcher.swap_in(layer, group, rows, call_top_k)
            out_got = out_buffer[group][:rows]
            assert torch.equal(out_got, out_want), f"step {step} layer {layer} rows {rows}"
            if layer == 0:
                copy_planned_reference(want, 1, plan_want)
                launcher.replay(1, 0, rows)
                assert_rows_match_host(got, 1, req_slots[:rows], top_k[:rows], out_got)
            assert_same_state(got, want)
            assert_rows_match_host(got, layer, req_slots[:rows], top_k[:rows], out_got)
    assert int(got.counters[:, 1].sum()) > 0, "no misses: the test is too weak"
    bound = list(launcher._swap_ins.values())
    assert all(launch.direct == traits.direct_launch for launches in bound
               for launch in launches), "launches did not (or wrongly did) go direct"


def _newest_device_rows(sizes: Sizes, req_slots: torch.Tensor, real: int) -> torch.Tensor:
    """`[Bcap]` newest device rows: each real row's newest slot (slot H), which no lookup of
    the call picks as a victim or returns. Padding rows go where the engine's sink row would:
    a row no lookup of the call reads, here the newest slot of a request outside the batch."""
    outside = min(set(range(sizes.num_requests)) - set(req_slots[:real].tolist()),
                  default=0)  # (a full batch has no padding rows)
    newest = torch.full((sizes.batch_cap,), outside * (sizes.hot + 1) + sizes.hot,
                        dtype=torch.int32, device=DEVICE)
    newest[:real] = req_slots[:real] * (sizes.hot + 1) + sizes.hot
    return newest


def _new_rows(sizes: Sizes, rows: int, real: int, rng: torch.Generator) -> torch.Tensor:
    """A layer's random new rows; padding rows all land on the sink: one value, any order."""
    kv = torch.randint(0, 256, (rows, sizes.row_bytes), dtype=torch.uint8,
                       generator=rng).to(DEVICE)
    kv[real:] = 0
    return kv


@pytest.mark.parametrize("sizes", SIZES[:2], ids=lambda s: f"K{s.top_k}-H{s.hot}")
def test_a_swap_in_handed_the_new_rows_writes_them_in_its_lookup(
        sizes: Sizes, rng: torch.Generator) -> None:
    """`swap_in(..., newest_kv)`: the lookup kernel also writes each batch row's new token
    into its newest device row (a padding row into a sink), as `write_newest` followed by
    the swap-in would: the same outputs, tables and device rows as the reference, on fresh
    rows at a new address every step."""
    want = make_tables(sizes, rng)
    got = clone_tables(want)
    groups = max(LAYER_GROUPS) + 1
    req_buffer = torch.zeros(sizes.batch_cap, dtype=torch.int32, device=DEVICE)
    real_buffer = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    newest_buffer = torch.zeros(sizes.batch_cap, dtype=torch.int32, device=DEVICE)
    out_buffer = torch.full((groups, sizes.batch_cap, sizes.top_k), POISON, dtype=torch.int32,
                            device=DEVICE)
    launcher = triton_kernels.SwapInLauncher(
        got, req_buffer, real_buffer, out_buffer, traits=triton_kernels.default_traits(DEVICE),
        newest_rows=newest_buffer)
    assert launcher.writes_newest
    previous: dict[int, list[int]] = {}
    written = 0
    for step in range(5):
        req_slots, top_k, num_real = next_top_k(want, sizes, previous, rng)
        rows = int(torch.randint(int(num_real), sizes.batch_cap + 1, ()).item())
        real = int(num_real)
        newest = _newest_device_rows(sizes, req_slots, real)
        req_buffer.copy_(req_slots)
        real_buffer.copy_(num_real)
        newest_buffer.copy_(newest)
        for layer, group in SWAP_IN_CALLS:
            kv = _new_rows(sizes, rows, real, rng)
            out_want = torch.full((rows, sizes.top_k), POISON, dtype=torch.int32, device=DEVICE)
            swap_in_reference(want, layer, group, req_slots[:rows], top_k[:rows], num_real,
                              out_want, poisoned_plan(sizes).first_rows(rows),
                              newest=NewestRows(kv, newest[:rows]))
            out_buffer[group].fill_(POISON)
            launcher.swap_in(layer, group, rows, top_k[:rows].clone(), kv.clone())
            assert torch.equal(out_buffer[group][:rows], out_want), f"step {step} layer {layer}"
            assert_same_state(got, want)
            assert torch.equal(got.device_kv[layer][newest[:real].long()], kv[:real])
            written += real
    assert written > 0
    assert len({key[3] for key in launcher._swap_ins}) == 1, "bound without the new rows"


@pytest.mark.parametrize("sizes", SIZES[:2], ids=lambda s: f"K{s.top_k}-H{s.hot}")
def test_a_lookup_given_the_new_rows_host_rows_backs_them_up_there(
        sizes: Sizes, rng: torch.Generator) -> None:
    """With `newest_host_rows`, the lookup also writes each real batch row's new token into
    its host row (the newest token's, which no lookup reads: it is served from slot H), as
    the reference does; padding rows write none, even when handed a host row, and no other
    host row changes."""
    want = make_tables(sizes, rng)
    got = clone_tables(want)
    got.host_kv = [h.clone().pin_memory() if ON_GPU else h.clone() for h in want.host_kv]
    want.host_kv = [h.clone().pin_memory() if ON_GPU else h.clone() for h in want.host_kv]
    before = [h.clone() for h in got.host_kv]
    groups = max(LAYER_GROUPS) + 1
    req_buffer = torch.zeros(sizes.batch_cap, dtype=torch.int32, device=DEVICE)
    real_buffer = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    newest_buffer = torch.zeros(sizes.batch_cap, dtype=torch.int32, device=DEVICE)
    host_row_buffer = torch.zeros(sizes.batch_cap, dtype=torch.int32, device=DEVICE)
    out_buffer = torch.full((groups, sizes.batch_cap, sizes.top_k), POISON, dtype=torch.int32,
                            device=DEVICE)
    launcher = triton_kernels.SwapInLauncher(
        got, req_buffer, real_buffer, out_buffer, traits=triton_kernels.default_traits(DEVICE),
        newest_rows=newest_buffer, newest_host_rows=host_row_buffer)
    assert launcher.backs_up_newest
    page_table, seq_lens, ext = want.page_table.cpu(), want.seq_lens.cpu(), want.extent_tokens
    req_slots, top_k, num_real = next_top_k(want, sizes, {}, rng)
    real = int(num_real)
    rows = sizes.batch_cap
    slots = req_slots.cpu().tolist()
    # A real row of a request with no token (a free slot, which the tables may hold) has no
    # host row to write: -1, as on a padding row.
    newest_host = [int(page_table[r, (int(seq_lens[r]) - 1) // ext]) * ext
                   + (int(seq_lens[r]) - 1) % ext if int(seq_lens[r]) > 0 else -1
                   for r in slots[:real]]
    backed_up = torch.tensor([h >= 0 for h in newest_host])
    # A padding row is handed a host row no real row writes: only `num_real` keeps it out.
    spare = min(set(range(want.host_kv[0].shape[0])) - set(newest_host))
    host_rows = torch.tensor(newest_host + [spare] * (rows - real), dtype=torch.int32)
    newest = _newest_device_rows(sizes, req_slots, real)
    req_buffer.copy_(req_slots)
    real_buffer.copy_(num_real)
    newest_buffer.copy_(newest)
    host_row_buffer.copy_(host_rows)
    for layer, group in SWAP_IN_CALLS:
        kv = _new_rows(sizes, rows, real, rng)
        out_want = torch.full((rows, sizes.top_k), POISON, dtype=torch.int32, device=DEVICE)
        swap_in_reference(want, layer, group, req_slots, top_k, num_real, out_want,
                          poisoned_plan(sizes).first_rows(rows),
                          newest=NewestRows(kv, newest_buffer, host_row_buffer))
        out_buffer[group].fill_(POISON)
        launcher.swap_in(layer, group, rows, top_k.clone(), kv.clone())
        if ON_GPU:
            torch.cuda.synchronize()
        assert torch.equal(out_buffer[group], out_want), f"layer {layer}"
        assert_same_state(got, want)
        assert torch.equal(got.host_kv[layer], want.host_kv[layer]), f"layer {layer}"
        expected = before[layer].clone()
        expected[torch.tensor(newest_host, dtype=torch.long)[backed_up]] = kv[:real].cpu()[
            backed_up]
        assert torch.equal(got.host_kv[layer], expected), f"layer {layer}: other host rows"
        before[layer] = expected


def test_the_standalone_swap_in_refuses_new_rows_it_cannot_read(rng: torch.Generator) -> None:
    sizes = SMALL[0]
    t = make_tables(sizes, rng)
    before = clone_tables(t)
    req_slots, top_k, num_real = next_top_k(t, sizes, {}, rng)
    out = torch.full((sizes.batch_cap, sizes.top_k), POISON, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(sizes.batch_cap, dtype=torch.int32, device=DEVICE)
    strided = torch.zeros(sizes.batch_cap, 2 * sizes.row_bytes, dtype=torch.uint8,
                          device=DEVICE)[:, ::2]
    with pytest.raises(InvalidInputError, match=r"newest\.kv must be a dense uint8"):
        triton_kernels.swap_in_triton(t, 0, 0, req_slots, top_k, num_real, out,
                                      newest=NewestRows(strided, rows))
    assert_same_state(t, before)
    assert bool((out == POISON).all())
