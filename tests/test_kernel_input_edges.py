"""Kernel entry points on edge inputs: the Triton kernels and the torch reference must agree,
stay in bounds and never write where the documented semantics says nothing is written.

Out-of-range top-k positions, request slots, real counts and plan entries are caller bugs the
kernels cannot raise on without a host sync; each is documented (or, for the copy and backup
rows, commented in the kernels) to be skipped or counted as invalid. Tables and outputs live
inside larger guard buffers where a write past them would otherwise go unnoticed.
"""

from __future__ import annotations

import pytest
import torch

import test_backup_triton as backup_helpers
from hisparse.errors import InvalidInputError
from hisparse.kernels.backup_reference import backup_newest_reference
from hisparse.kernels.swap_in.reference import copy_planned_reference, swap_in_reference
from hisparse.layout.tables import CacheTables, MissPlan
from interpreted_kernels import (  # sets TRITON_INTERPRET before kernels compile
    DEVICE,
    KERNEL_MARK,
    ON_GPU,
    backup_triton,
)
from interpreted_kernels import swap_in_triton as triton_kernels
from test_swap_in_triton import (
    POISON,
    SMALL,
    VARIANTS,
    assert_same_state,
    clone_tables,
    make_tables,
    poisoned_plan,
)

pytestmark = KERNEL_MARK

SIZES = SMALL[0]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# The default, and the selection's bit search alone (the fallback of its oldest-values rounds).
EDGE_VARIANTS = ("default", "bit-search")


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _run_both(tables: CacheTables, req_slots: torch.Tensor, top_k: torch.Tensor,
              num_real: torch.Tensor, variant: str
              ) -> tuple[CacheTables, torch.Tensor, MissPlan, CacheTables, torch.Tensor, MissPlan]:
    """The reference and the Triton swap-in of layer 0 on twins of `tables`, poisoned outputs."""
    want, got = clone_tables(tables), clone_tables(tables)
    out_want, out_got = torch.full_like(top_k, POISON), torch.full_like(top_k, POISON)
    plan_want, plan_got = poisoned_plan(SIZES), poisoned_plan(SIZES)
    swap_in_reference(want, 0, 0, req_slots, top_k, num_real, out_want, plan_want)
    with triton_kernels.tuning(**VARIANTS[variant]):
        triton_kernels.swap_in_triton(got, 0, 0, req_slots, top_k, num_real, out_got, plan_got)
    return want, out_want, plan_want, got, out_got, plan_got


def _assert_agree(want: CacheTables, out_want: torch.Tensor, plan_want: MissPlan,
                  got: CacheTables, out_got: torch.Tensor, plan_got: MissPlan) -> None:
    assert torch.equal(out_got, out_want), "outputs"
    assert torch.equal(plan_got.count, plan_want.count), "plan counts"
    for b, count in enumerate(plan_want.count.tolist()):
        for name in ("src", "dst"):
            assert torch.equal(getattr(plan_got, name)[b, :count],
                               getattr(plan_want, name)[b, :count]), f"plan.{name} row {b}"
    assert_same_state(got, want)


@pytest.mark.parametrize("variant", EDGE_VARIANTS)
@pytest.mark.parametrize("num_real_kind", ["some", "over-capacity", "negative"])
def test_out_of_range_positions_return_minus_one_and_count_invalid(
    variant: str, num_real_kind: str, rng: torch.Generator
) -> None:
    """docs/ARCHITECTURE.md: a position < -1 or >= seq_len gives -1 and counts as invalid; -1
    gives -1 uncounted; padding rows count nothing. Both implementations, same results."""
    tables = make_tables(SIZES, rng)
    batch_cap, k = SIZES.batch_cap, SIZES.top_k
    num_requests = tables.seq_lens.shape[0]
    seq_lens = tables.seq_lens.cpu().long()
    # Distinct request slots (rows never share one), request 0 (long) first: misses and hits.
    req_slots = torch.cat([torch.zeros(1, dtype=torch.long),
                           torch.randperm(num_requests - 1, generator=rng)[: batch_cap - 1] + 1])
    num_real = {"some": 2, "over-capacity": batch_cap + 3, "negative": -2}[num_real_kind]
    top_k = torch.full((batch_cap, k), -1, dtype=torch.long)
    for b, r in enumerate(req_slots.tolist()):
        n = int(seq_lens[r])
        bad = [-2, -5, INT32_MIN, n, n + 1, INT32_MAX, 1 << 24]
        good = torch.randperm(n, generator=rng)[: k - len(bad) - 2].tolist() if n else []
        row = torch.tensor(bad + good + [-1] * (k - len(bad) - len(good)), dtype=torch.long)
        top_k[b] = row[torch.randperm(k, generator=rng)]
    real = torch.arange(batch_cap) < num_real
    lengths = seq_lens[req_slots][:, None]
    invalid = real[:, None] & ((top_k < -1) | (top_k >= lengths))
    results = _run_both(tables, _int32(req_slots.tolist()), top_k.to(torch.int32).to(DEVICE),
                        _int32([num_real]), variant)
    _assert_agree(*results)
    got, out_got = results[3], results[4].cpu()
    none = ~real[:, None] | (top_k < 0) | (top_k >= lengths)
    assert bool((out_got[none] == -1).all()), "an invalid, empty or padding entry got a row"
    assert bool((out_got[~none] >= 0).all()), "a valid entry got no row"
    assert int(got.counters[0, 2]) == int(invalid.sum()), "invalid entries miscounted"
    served = int(got.counters[0, 0]) + int(got.counters[0, 1])
    assert served == int((~none).sum()), "valid entries miscounted"


@pytest.mark.parametrize("variant", EDGE_VARIANTS)
def test_real_row_with_a_bad_request_slot_is_treated_as_padding(
    variant: str, rng: torch.Generator
) -> None:
    """A real row whose request slot is outside [0, R) must behave as padding in both
    implementations: -1 everywhere, nothing counted, no request's state touched. A negative
    slot must not wrap around to another request's LRU, residency or device rows."""
    tables = make_tables(SIZES, rng)
    num_requests = tables.seq_lens.shape[0]
    n0 = int(tables.seq_lens[0])  # request 0 is long
    k = SIZES.top_k
    top_k = torch.full((SIZES.batch_cap, k), -1, dtype=torch.int32)
    for b in range(SIZES.batch_cap):  # old positions of request 0: misses if they were its
        top_k[b, : k // 2] = torch.randperm(n0 - SIZES.hot - 1, generator=rng)[: k // 2]
    top_k = top_k.to(DEVICE)
    bad_slots = [0, -num_requests, num_requests]  # row 0 is fine; rows 1 and 2 are not
    results = _run_both(tables, _int32(bad_slots), top_k, _int32([3]), variant)
    _assert_agree(*results)
    # Independently: the same call with the bad rows as padding.
    padded = clone_tables(tables)
    out_padded = torch.full_like(top_k, POISON)
    swap_in_reference(padded, 0, 0, _int32(bad_slots), top_k, _int32([1]), out_padded)
    want, out_want = results[0], results[1]
    assert torch.equal(out_want, out_padded), "a bad request slot was not treated as padding"
    assert_same_state(want, padded)


@pytest.mark.parametrize("residency_map", ["host_row", "position"])
@pytest.mark.parametrize("variant", EDGE_VARIANTS)
def test_positions_without_a_host_row_count_invalid(variant: str, residency_map: str,
                                                    rng: torch.Generator) -> None:
    """A valid position whose page-table entry is -1, or points past the pool, has no host
    row (an engine bug, never a caller's): both implementations give it -1 and count it as
    invalid, and neither reads a wrapped or wild residency entry nor plans a copy from it.
    (Keyed by position, such a position is found out when it misses.)"""
    tables = make_tables(SIZES, rng, residency_map)
    ext, hot, k = SIZES.extent, SIZES.hot, SIZES.top_k
    n0 = int(tables.seq_lens[0])  # request 0 is long: its oldest pages are not resident
    assert n0 - 1 - hot >= 2 * ext, "request 0 needs two pages older than its hot buffer"
    num_rows = tables.num_host_rows
    tables.page_table[0, 0] = -1  # positions 0..ext-1: no extent
    tables.page_table[0, 1] = num_rows // ext + 3  # positions ext..2*ext-1: past the pool
    lost = torch.randperm(2 * ext, generator=rng)[: k // 2]
    good = torch.randperm(n0 - 2 * ext, generator=rng)[: k - lost.numel()] + 2 * ext
    top_k = torch.full((SIZES.batch_cap, k), -1, dtype=torch.int32)
    top_k[0] = torch.cat([lost, good])[torch.randperm(k, generator=rng)].to(torch.int32)
    results = _run_both(tables, _int32(list(range(SIZES.batch_cap))), top_k.to(DEVICE),
                        _int32([1]), variant)
    _assert_agree(*results)
    got, out_got, plan_got = results[3], results[4].cpu(), results[5]
    is_lost = (top_k[0] >= 0) & (top_k[0] < 2 * ext)
    assert bool((out_got[0][is_lost] == -1).all()), "a position without a host row got a row"
    assert bool((out_got[0][~is_lost] >= 0).all()), "a valid position got no row"
    assert int(got.counters[0, 2]) == int(is_lost.sum()), "lost positions not counted invalid"
    planned = plan_got.src[0, : int(plan_got.count[0])].cpu()
    assert bool(((planned >= 0) & (planned < num_rows)).all()), "a copy from no host row"


def _guarded_copy_tables(rng: torch.Generator) -> tuple[CacheTables, torch.Tensor, torch.Tensor]:
    """Tables whose layer-0 device rows and host rows sit inside larger guard buffers: one
    guard layer before and after `device_kv`, one guard row before and after `host_kv[0]`."""
    tables = make_tables(SIZES, rng)
    layers, rows, width = tables.device_kv.shape
    device_guard = torch.randint(0, 256, (layers + 2, rows, width), dtype=torch.uint8,
                                 generator=rng).to(DEVICE)
    tables.device_kv = device_guard[1 : layers + 1]
    host_rows = tables.host_kv[0].shape[0]
    host_guard = torch.randint(0, 256, (host_rows + 2, width), dtype=torch.uint8, generator=rng)
    if ON_GPU:
        host_guard = host_guard.pin_memory()
    tables.host_kv = [host_guard[1 : host_rows + 1], *tables.host_kv[1:]]
    return tables, device_guard, host_guard


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_copy_planned_skips_plan_entries_outside_the_rows(impl: str,
                                                          rng: torch.Generator) -> None:
    """Plan entries whose host or device row is out of range are skipped (as the backup and
    lookup kernels skip theirs), never read or written past the layer's rows."""
    tables, device_guard, host_guard = _guarded_copy_tables(rng)
    device_rows = tables.device_kv.shape[1]
    host_rows = tables.host_kv[0].shape[0]
    plan = MissPlan.empty(SIZES.batch_cap, SIZES.top_k, DEVICE)
    # Out by one row only, so that a copy that does not skip them lands in the guards.
    entries = [(5, 7), (-1, 8), (host_rows, 9), (6, -1), (6, device_rows)]
    plan.src[0, : len(entries)] = _int32([src for src, _ in entries])
    plan.dst[0, : len(entries)] = _int32([dst for _, dst in entries])
    plan.count[0] = len(entries)
    device_before, host_before = device_guard.clone(), host_guard.clone()
    copy = triton_kernels.copy_planned_triton if impl == "triton" else copy_planned_reference
    copy(tables, 0, plan)
    if ON_GPU:
        torch.cuda.synchronize()
    want = device_before.clone()
    want[1, 7] = host_before[1 + 5].to(DEVICE)  # device row 7 of layer 0 <- host row 5
    assert torch.equal(host_guard, host_before), "the copy wrote host memory"
    changed = (device_guard != want).any(-1).nonzero().tolist()
    assert changed == [], f"rows (guard layer, row) that must not change did: {changed}"


def test_triton_refuses_a_plan_whose_rows_overlap(rng: torch.Generator) -> None:
    """A plan whose rows share memory (row stride below its width, e.g. an expanded tensor)
    would let one batch row's misses overwrite another's: refused before any launch. (The
    reference writes it through torch indexing, which refuses such a tensor itself.)"""
    tables = make_tables(SIZES, rng)
    before = clone_tables(tables)
    k = SIZES.top_k
    plan = MissPlan(
        src=torch.zeros(k, dtype=torch.int32, device=DEVICE).expand(SIZES.batch_cap, k),
        dst=torch.zeros(k, dtype=torch.int32, device=DEVICE).expand(SIZES.batch_cap, k),
        count=torch.zeros(SIZES.batch_cap, dtype=torch.int32, device=DEVICE),
    )
    with pytest.raises(InvalidInputError, match="overlap"):
        triton_kernels.copy_planned_triton(tables, 0, plan)
    req_slots = _int32(list(range(SIZES.batch_cap)))
    top_k = torch.zeros(SIZES.batch_cap, k, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(top_k, POISON)
    with pytest.raises(InvalidInputError, match="overlap"):
        triton_kernels.swap_in_triton(tables, 0, 0, req_slots, top_k, _int32([1]), out, plan)
    assert_same_state(tables, before)
    assert bool((out == POISON).all())


@pytest.mark.parametrize(
    ("newest", "targets", "num_real"),
    [
        ([0, 1, 2, 3], [0, 1, -1, -1], -2),  # a negative real count: nothing is real
        ([0, 1, 2, 3], [0, 1, 2, 3], 9),  # more than the batch: every row is real
        ([0, 1, 2, 3], [0, -1, 2, 3], 4),  # host row -1 on a real row
        ([0, 1, 2, 3], [0, 12, 2, 3], 4),  # host row N
        ([0, -1, 2, 3], [0, 1, 2, 3], 4),  # device row -1
        ([0, 9, 2, 3], [0, 1, 2, 3], 4),  # device row D
    ],
    ids=["negative-count", "count-over-capacity", "host-minus-one", "host-past-end",
         "device-minus-one", "device-past-end"],
)
def test_backup_skips_rows_outside_the_batch_or_the_pools(
    newest: list[int], targets: list[int], num_real: int, rng: torch.Generator
) -> None:
    """The Triton backup moves only real rows (b < num_real) whose device and host rows are
    in range; the reference must do the same instead of wrapping a -1 around to the last host
    row, reading a negative count as a slice from the end, or raising halfway through."""
    layers, device_rows, host_rows = 2, 9, 12
    got = backup_helpers.make_tables(layers, device_rows, host_rows, 16, rng, True)
    want = backup_helpers.twin(got)
    before = [host.clone() for host in got.host_kv]
    args = (_int32(newest), _int32(targets), _int32([num_real]))
    backup_triton.backup_newest_triton(got, *args)
    backup_newest_reference(want, *args)
    if ON_GPU:
        torch.cuda.synchronize()
    plain = [host.clone() for host in before]
    device_kv = got.device_kv.cpu()
    for b in range(max(0, min(num_real, len(newest)))):
        if 0 <= newest[b] < device_rows and 0 <= targets[b] < host_rows:
            for layer in range(layers):
                plain[layer][targets[b]] = device_kv[layer, newest[b]]
    for layer in range(layers):
        assert torch.equal(got.host_kv[layer], plain[layer]), f"triton, layer {layer}"
        assert torch.equal(want.host_kv[layer], plain[layer]), f"reference, layer {layer}"
        guards = backup_helpers.guard_rows(got.host_kv[layer])
        assert bool((guards == backup_helpers.POISON_BYTE).all()), f"wrote past layer {layer}"


def _mismatch(tables: CacheTables, kind: str) -> None:
    """Make one of `tables`' tensors disagree with the others (still inside its allocation,
    so that a kernel that does not notice reads or writes neighbouring memory, not a wild
    address)."""
    _, requests, hot = tables.last_use.shape
    if kind == "seq-lens-short":
        tables.seq_lens = tables.seq_lens[: requests - 1]
    elif kind == "last-use-rows-short":
        tables.last_use = tables.last_use[:, : requests - 1]
    elif kind == "clock-rows-short":
        tables.lru_clock = tables.lru_clock[:, : requests - 1]
    elif kind == "slot-row-narrow":
        tables.slot_key = tables.slot_key[:, :, : hot - 1]
    elif kind == "last-use-not-contiguous":
        tables.last_use = tables.last_use.transpose(1, 2).contiguous().transpose(1, 2)
    elif kind == "device-rows-short":
        tables.device_kv = tables.device_kv[:, : requests * (hot + 1) - 1]
    elif kind == "host-rows-short":
        tables.host_kv = [host[:-1] for host in tables.host_kv]
    elif kind == "counters-narrow":
        tables.counters = tables.counters[:, :2]
    elif kind == "position-resident-narrow":
        tables.resident = tables.resident[:, :-1].contiguous()
    elif kind == "position-host-layers-differ":
        tables.host_kv = [tables.host_kv[0], tables.host_kv[1][:-1], *tables.host_kv[2:]]
    elif kind == "unknown-residency-map":
        tables.residency_map = "token"  # type: ignore[assignment]


@pytest.mark.parametrize("kind", ["seq-lens-short", "last-use-rows-short", "clock-rows-short",
                                  "slot-row-narrow", "last-use-not-contiguous",
                                  "device-rows-short", "host-rows-short", "counters-narrow",
                                  "position-resident-narrow", "position-host-layers-differ",
                                  "unknown-residency-map"])
def test_swap_in_refuses_tables_whose_shapes_disagree(kind: str, rng: torch.Generator) -> None:
    """The kernels index every table with sizes taken from the others (R from the page table,
    H from hot_slots, N from resident, or from the host rows where the map is keyed by
    position): a table smaller than that, or laid out otherwise, is refused before any launch
    instead of being read or written past its end."""
    tables = make_tables(SIZES, rng, "position" if kind.startswith("position") else "host_row")
    _mismatch(tables, kind)
    before = clone_tables(tables)
    num_requests = tables.page_table.shape[0]
    req_slots = _int32([0, *range(num_requests - SIZES.batch_cap + 1, num_requests)])
    top_k = torch.full((SIZES.batch_cap, SIZES.top_k), -1, dtype=torch.int32)
    top_k[0, : SIZES.top_k // 2] = torch.arange(SIZES.top_k // 2)  # request 0's oldest: misses
    top_k = top_k.to(DEVICE)
    out = torch.full_like(top_k, POISON)
    with pytest.raises(InvalidInputError, match="tables"):
        triton_kernels.swap_in_triton(tables, 0, 0, req_slots, top_k,
                                      _int32([SIZES.batch_cap]), out)
    assert_same_state(tables, before)
    assert bool((out == POISON).all())


def test_swap_in_refuses_a_top_k_without_columns(rng: torch.Generator) -> None:
    tables = make_tables(SIZES, rng)
    before = clone_tables(tables)
    top_k = torch.empty((SIZES.batch_cap, 0), dtype=torch.int32, device=DEVICE)
    with pytest.raises(InvalidInputError, match="at least one column"):
        triton_kernels.swap_in_triton(tables, 0, 0, _int32(list(range(SIZES.batch_cap))),
                                      top_k, _int32([SIZES.batch_cap]), torch.empty_like(top_k))
    assert_same_state(tables, before)
