"""What an LRU kept as per-slot step stamps would save on SW-1, before the library changes to it.

The library keeps each request's LRU as an ordered list of its hot slots. Every step with a
long sequence, even one without a miss, the plan kernel reads that list, ranks the slots hit
this step and writes the list back: on SW-1's cold miss-free B=128 step that is about 7 us of
the 17-18 (benchmarks/NOTES.md, twelfth pass). With a stamp per slot (the request's step
counter when the slot was last used), a hit is one store in the classify kernel, and a step
without misses needs no plan at all; a step with m misses selects the m non-hit slots with the
oldest stamps (ties broken by slot id) by a radix search over the stamp row.

That changes which slot each miss takes when several slots were last used in the same step:
the library moves a step's slots to the recent end in miss order, then the hits in their old
order; stamps order them by slot id. Which rows stay resident after any step is the same for
SW-1's trace; so is every byte the byte check compares. This probe measures the gain before
the engine, the reference, PD and every kernel change. Variants:

- `stamps-3`: classify (lookups + stamps of the hits + miss counts), a selection kernel that
  returns at once for a row without misses, and the library's copy.
- `stamps-fused`: the last classify program of each batch row (an arrival counter) runs that
  row's selection, so a step is two launches: classify and the library's copy.

`--self-check` compares both variants with a plain-Python model of the stamp LRU on small
random tables (ties included) before anything is timed; under TRITON_INTERPRET=1 it runs on
a CPU.

    PYTHONPATH=src python benchmarks/stamp_lru_probe.py --out-dir DIR [--churns 0 0.2 1]
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/stamp_lru_probe.py --self-check-only
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from hisparse import benchmarking
from hisparse.backends.registry import get_backend
from hisparse.core.tables import CacheTables, MissPlan, residency_dtype
from hisparse.kernels import swap_in_triton as kernels
from hisparse.kernels.swap_in_triton import (
    _add_code_counts,
    _lookup_chunk,
    _row_context,
    gdc_launch_dependents,
    gdc_wait,
)

_NO_STAMP = tl.constexpr(2147483647)


@triton.jit
def _select_victims(
    b, r, t, num_misses, base,
    stamp_ptr,  # [R, H] int32 step of each slot's last use
    slot_row_ptr,  # [R, H] int32 this group's host row per hot slot
    resident_ptr, miss_row_ptr, out_ptr,
    order_ptr,  # [Bcap, H] int32 scratch: the victims in slot order
    plan_src_ptr, plan_dst_ptr, plan_stride,
    K, H, N,
    CACHE: tl.constexpr,  # ".cg" where other programs of this kernel wrote what we read
    FAST_ROUNDS: tl.constexpr,  # stamp values taken oldest first before the radix search
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Give the m misses of row b the m slots with the oldest stamps below t (ties by slot
    id), in slot order, and install them."""
    h = tl.arange(0, BLOCK_H)
    in_h = h < H
    k = tl.arange(0, BLOCK_K)
    stamp_row = stamp_ptr + r.to(tl.int64) * H
    # Everything this row reads, in flight together.
    stamps = tl.load(stamp_row + h, mask=in_h, other=0, cache_modifier=CACHE)
    rows_by_slot = tl.load(slot_row_ptr + r.to(tl.int64) * H + h, mask=in_h, other=-1)
    row = tl.load(miss_row_ptr + b * K + k, mask=k < K, other=-1, cache_modifier=CACHE)
    candidate = in_h & (stamps < t)  # this step's hits carry t
    installed = tl.minimum(num_misses, tl.sum(candidate.to(tl.int32), axis=0))
    # The threshold stamp: every candidate below it is a victim, and the first `installed -
    # below` (by slot id) of those at it. A step stamps all the slots it uses alike, so a few
    # stamp values hold the oldest slots: take them oldest first, one value per round...
    threshold = tl.min(tl.where(candidate, stamps, _NO_STAMP), axis=0)
    below = 0
    at = tl.sum((candidate & (stamps == threshold)).to(tl.int32), axis=0)
    for _ in tl.static_range(FAST_ROUNDS):
        if below + at < installed:
            below += at
            threshold = tl.min(tl.where(candidate & (stamps > threshold), stamps, _NO_STAMP),
                               axis=0)
            at = tl.sum((candidate & (stamps == threshold)).to(tl.int32), axis=0)
    if below + at < installed:
        # ...and where that does not settle it, search the ages' bits from the top: the
        # largest age with fewer than `installed` candidates below it.
        lowest = tl.min(tl.where(candidate, stamps, _NO_STAMP), axis=0)
        age = tl.where(candidate, stamps - lowest, _NO_STAMP)  # no trial exceeds _NO_STAMP
        highest = tl.max(tl.where(candidate, age, 0), axis=0)
        found = 0
        for bit in range(30, -1, -1):
            trial = found | (1 << bit)
            # A larger trial has every candidate below it: never taken. (Nested, so that the
            # reduction is skipped: a joined condition would evaluate it always.)
            if trial <= highest:  # noqa: SIM102
                if tl.sum((age < trial).to(tl.int32), axis=0) < installed:
                    found = trial
        threshold = lowest + found
        below = tl.sum((candidate & (stamps < threshold)).to(tl.int32), axis=0)
    older = candidate & (stamps < threshold)
    tied = candidate & (stamps == threshold)
    need = installed - below
    # One scan for both prefix counts (each < 2^16): a victim's rank is the older slots
    # before it plus the tied ones before it, at most `need` of those.
    packed = tl.cumsum(older.to(tl.int32) * 65536 + tied.to(tl.int32), axis=0)
    tied_through = packed & 65535
    victim = older | (tied & (tied_through <= need))
    victim_rank = (packed >> 16) + tl.minimum(tied_through, need) - 1
    tl.store(order_ptr + b * H + victim_rank, h, mask=victim)
    # A victim's old row is in no top-k entry of this step (it was not hit, and a miss row is
    # held by no slot), so this never touches a row a miss installs below.
    tl.store(resident_ptr + rows_by_slot,
             tl.full(rows_by_slot.shape, -1, resident_ptr.dtype.element_ty),
             mask=victim & (rows_by_slot >= 0) & (rows_by_slot < N))
    tl.store(stamp_row + h, tl.full(h.shape, 0, tl.int32) + t, mask=victim)
    tl.debug_barrier()  # the victims in `order` are visible to every thread
    miss = row >= 0
    rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    miss = miss & (rank < installed)
    slot = tl.load(order_ptr + b * H + rank, mask=miss, other=0)
    tl.store(resident_ptr + row, slot.to(resident_ptr.dtype.element_ty), mask=miss)
    tl.store(slot_row_ptr + r.to(tl.int64) * H + slot, row, mask=miss)
    tl.store(out_ptr + b * K + k, base + slot, mask=miss)
    tl.store(plan_src_ptr + b * plan_stride + rank, row, mask=miss)
    tl.store(plan_dst_ptr + b * plan_stride + rank, base + slot, mask=miss)
    return installed


@triton.jit
def _finish_row(
    b, r, n, real, base, t, num_misses, step_ptr, stamp_ptr, slot_row_ptr, resident_ptr,
    miss_row_ptr, out_ptr, order_ptr, plan_src_ptr, plan_dst_ptr, plan_count_ptr, plan_stride,
    K, H, N,
    CACHE: tl.constexpr,
    FAST_ROUNDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    installed = 0
    if real & (n > H):
        if num_misses > 0:
            installed = _select_victims(
                b, r, t, num_misses, base, stamp_ptr, slot_row_ptr, resident_ptr,
                miss_row_ptr, out_ptr, order_ptr, plan_src_ptr, plan_dst_ptr, plan_stride,
                K, H, N, CACHE, FAST_ROUNDS, BLOCK_K, BLOCK_H,
            )
        tl.store(step_ptr + r, t + 1)
    tl.store(plan_count_ptr + b, installed)


@triton.jit
def _classify_stamp_kernel(
    num_real_ptr, req_slots_ptr, seq_lens_ptr, top_k_ptr, out_ptr, page_table_ptr,
    resident_ptr, slot_row_ptr,
    stamp_ptr,  # [R, H] int32
    step_ptr,  # [R] int32 each request's step counter
    miss_row_ptr,  # [Bcap, K] int32 scratch: entry codes (the library's `_entry_codes`)
    miss_count_ptr,  # [Bcap] int32 scratch, zero between calls
    arrivals_ptr,  # [Bcap] int32 scratch, zero between calls (FUSED)
    order_ptr, plan_src_ptr, plan_dst_ptr, plan_count_ptr, plan_stride, counters_ptr,
    R, S, K, H, E, P, N,
    EARLY_LOADS: tl.constexpr,
    USE_PDL: tl.constexpr,
    COUNTER_SEM: tl.constexpr,
    FUSED: tl.constexpr,
    FAST_ROUNDS: tl.constexpr,
    CHUNK_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    real, r, n, base = _row_context(b, num_real_ptr, req_slots_ptr, seq_lens_ptr, R, S,
                                    EARLY_LOADS)
    t = tl.load(step_ptr + r)
    k_offsets = tl.program_id(1) * CHUNK_K + tl.arange(0, CHUNK_K)
    in_k, result, hit, slot, miss, _, code = _lookup_chunk(
        b, k_offsets, real, r, n, base, top_k_ptr, page_table_ptr, resident_ptr,
        K, H, E, P, N, EARLY_LOADS,
    )
    tl.store(out_ptr + b * K + k_offsets, result, mask=in_k)
    tl.store(miss_row_ptr + b * K + k_offsets, code, mask=in_k)
    tl.store(stamp_ptr + r.to(tl.int64) * H + slot, tl.full(slot.shape, 0, tl.int32) + t,
             mask=hit)
    _add_code_counts(counters_ptr, code, COUNTER_SEM)
    chunk_misses = tl.sum(miss.to(tl.int32), axis=0)
    if FUSED:
        tl.atomic_add(miss_count_ptr + b, chunk_misses, mask=chunk_misses > 0, sem="relaxed")
        # Every thread's stores above come before the arrival (release); the last program to
        # arrive acquires them all.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + b, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            tl.atomic_xchg(arrivals_ptr + b, 0)
            num_misses = tl.atomic_xchg(miss_count_ptr + b, 0)
            _finish_row(
                b, r, n, real, base, t, num_misses, step_ptr, stamp_ptr, slot_row_ptr,
                resident_ptr, miss_row_ptr, out_ptr, order_ptr, plan_src_ptr, plan_dst_ptr,
                plan_count_ptr, plan_stride, K, H, N, ".cg", FAST_ROUNDS, BLOCK_K, BLOCK_H,
            )
    else:
        tl.atomic_add(miss_count_ptr + b, chunk_misses, mask=chunk_misses > 0, sem="relaxed")


@triton.jit
def _select_kernel(
    num_real_ptr, req_slots_ptr, seq_lens_ptr, out_ptr, resident_ptr, slot_row_ptr, stamp_ptr,
    step_ptr, miss_row_ptr, miss_count_ptr, order_ptr, plan_src_ptr, plan_dst_ptr,
    plan_count_ptr, plan_stride, R, S, K, H, N,
    EARLY_LOADS: tl.constexpr,
    USE_PDL: tl.constexpr,
    DEPENDENTS_READ_LOOKUPS: tl.constexpr,
    FAST_ROUNDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    if USE_PDL and not DEPENDENTS_READ_LOOKUPS:
        gdc_launch_dependents()
    b = tl.program_id(0)
    # Written before the classify kernel began: read while it may still run.
    real, r, n, base = _row_context(b, num_real_ptr, req_slots_ptr, seq_lens_ptr, R, S,
                                    EARLY_LOADS)
    t = tl.load(step_ptr + r)
    if USE_PDL:
        gdc_wait()
        if DEPENDENTS_READ_LOOKUPS:
            gdc_launch_dependents()
    num_misses = tl.load(miss_count_ptr + b)
    tl.store(miss_count_ptr + b, 0, mask=num_misses != 0)
    _finish_row(
        b, r, n, real, base, t, num_misses, step_ptr, stamp_ptr, slot_row_ptr, resident_ptr,
        miss_row_ptr, out_ptr, order_ptr, plan_src_ptr, plan_dst_ptr, plan_count_ptr,
        plan_stride, K, H, N, "", FAST_ROUNDS, BLOCK_K, BLOCK_H,
    )


class StampLRU:
    """A swap-in with the SwapInFn signature that keeps its LRU as stamps (group 0 only)."""

    def __init__(self, tables: CacheTables, fused: bool, fast_rounds: int = 2) -> None:
        lru = tables.lru[0]
        num_requests, hot = lru.shape
        device = lru.device
        # The list's order becomes distinct stamps below every step counter: the same LRU.
        ranks = (torch.arange(hot, device=device, dtype=torch.int32) - hot).expand_as(lru)
        self.stamps = torch.empty_like(lru).scatter_(1, lru.long(), ranks.contiguous())
        # A list in slot order is one stamp for all (ties go by slot id): the state the engine
        # would leave after seeding a hot buffer in position order, as SW-1's tables are.
        in_slot_order = (lru == torch.arange(hot, device=device, dtype=lru.dtype)).all(dim=1)
        self.stamps[in_slot_order] = -1
        self.step = torch.zeros(num_requests, dtype=torch.int32, device=device)
        self.fused = fused
        self.fast_rounds = fast_rounds
        self.scratch: dict[tuple[int, int], dict[str, object]] = {}

    def _scratch(self, batch_cap: int, k: int, device: torch.device) -> dict[str, object]:
        found = self.scratch.get((batch_cap, k))
        if found is None:
            hot = self.stamps.shape[1]
            found = {
                "miss_row": torch.empty(batch_cap, k, dtype=torch.int32, device=device),
                "miss_count": torch.zeros(batch_cap, dtype=torch.int32, device=device),
                "arrivals": torch.zeros(batch_cap, dtype=torch.int32, device=device),
                "order": torch.empty(batch_cap, hot, dtype=torch.int32, device=device),
                "plan": MissPlan.empty(batch_cap, k, device),
            }
            self.scratch[(batch_cap, k)] = found
        return found

    def __call__(self, tables: CacheTables, layer: int, group: int, req_slots: torch.Tensor,
                 top_k: torch.Tensor, num_real: torch.Tensor, out: torch.Tensor,
                 plan: MissPlan | None = None, skip_io: bool = False) -> None:
        if group != 0 or skip_io:
            raise ValueError("the probe keeps stamps for group 0 and always moves rows")
        t = tables
        device = top_k.device
        batch_cap, k = top_k.shape
        hot = t.hot_slots
        scratch = self._scratch(batch_cap, k, device)
        used_plan = plan if plan is not None else scratch["plan"]
        tune = kernels._tuning
        pdl = tune.pdl is not False and kernels._pdl_supported(device)
        pdl_copy = pdl and kernels._within(batch_cap, tune.pdl_copy_max_batch)
        prefetch = not self.fused and kernels._within(batch_cap, tune.prefetch_copy_max_batch)
        num_requests, max_pages = t.page_table.shape
        num_host_rows = t.resident.shape[1]
        sizes = (num_requests, t.slots_per_request, k, hot, t.extent_tokens, max_pages,
                 num_host_rows)
        chunk = tune.classify_chunk_k
        if tune.small_batch_classify_chunk_k is not None and batch_cap <= tune.small_batch_max:
            chunk = tune.small_batch_classify_chunk_k
        chunk = min(triton.next_power_of_2(k), chunk)
        block_k, block_h = triton.next_power_of_2(k), triton.next_power_of_2(hot)
        counter_sem = "relaxed" if tune.relaxed_counters else "acq_rel"
        resident, slot_row = t.resident[group], t.slot_row[group]
        _classify_stamp_kernel[(batch_cap, triton.cdiv(k, chunk))](
            num_real, req_slots, t.seq_lens, top_k, out, t.page_table, resident, slot_row,
            self.stamps, self.step, scratch["miss_row"], scratch["miss_count"],
            scratch["arrivals"], scratch["order"], used_plan.src, used_plan.dst,
            used_plan.count, used_plan.src.stride(0), t.counters[layer], *sizes,
            EARLY_LOADS=tune.early_loads, USE_PDL=pdl, COUNTER_SEM=counter_sem,
            FUSED=self.fused, FAST_ROUNDS=self.fast_rounds, CHUNK_K=chunk, BLOCK_K=block_k,
            BLOCK_H=block_h,
            num_warps=tune.plan_warps if self.fused else tune.classify_warps,
        )
        if not self.fused:
            _select_kernel[(batch_cap,)](
                num_real, req_slots, t.seq_lens, out, resident, slot_row, self.stamps,
                self.step, scratch["miss_row"], scratch["miss_count"], scratch["order"],
                used_plan.src, used_plan.dst, used_plan.count, used_plan.src.stride(0),
                num_requests, t.slots_per_request, k, hot, num_host_rows,
                EARLY_LOADS=tune.early_loads, USE_PDL=pdl,
                DEPENDENTS_READ_LOOKUPS=prefetch and pdl_copy, FAST_ROUNDS=self.fast_rounds,
                BLOCK_K=block_k,
                BLOCK_H=block_h, num_warps=tune.plan_warps,
                **({"launch_pdl": True} if pdl else {}),
            )
        if prefetch:
            kernels._launch_prefetched_copy(t, layer, scratch["miss_row"], out, pdl=pdl_copy)
        else:
            kernels._launch_copy(t, layer, used_plan, batch_cap, None,
                                 pdl=pdl_copy and not self.fused)


# --- self-check against a plain-Python model of the stamp LRU ---------------------------------
def model_step(state: dict[str, np.ndarray], req_slots: np.ndarray, top_k: np.ndarray,
               num_real: int, hot: int, extent: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """One swap-in of the stamp LRU, entry by entry: (out, [(host row, device row)] copied)."""
    stamps, step, resident = state["stamps"], state["step"], state["resident"]
    slot_row, page_table, seq_lens = state["slot_row"], state["page_table"], state["seq_lens"]
    slots = hot + 1
    out = np.full(top_k.shape, -1, dtype=np.int64)
    copies = []
    for b in range(num_real):
        r = int(req_slots[b])
        n, t, base = int(seq_lens[r]), int(step[r]), r * slots
        misses = []
        for k, pos in enumerate(top_k[b]):
            pos = int(pos)
            if not 0 <= pos < n:
                continue
            if n <= hot:
                out[b, k] = base + pos
            elif pos == n - 1:
                out[b, k] = base + hot
            else:
                row = int(page_table[r, pos // extent]) * extent + pos % extent
                slot = int(resident[row])
                if slot >= 0:
                    out[b, k] = base + slot
                    stamps[r, slot] = t
                else:
                    misses.append((k, row))
        if n <= hot:
            continue
        candidates = sorted((int(stamps[r, s]), s) for s in range(hot) if stamps[r, s] < t)
        victims = sorted(s for _, s in candidates[: len(misses)])
        for slot in victims:
            if slot_row[r, slot] >= 0:
                resident[slot_row[r, slot]] = -1
        for (k, row), slot in zip(misses, victims, strict=True):
            resident[row] = slot
            slot_row[r, slot] = row
            stamps[r, slot] = t
            out[b, k] = base + slot
            copies.append((row, base + slot))
        step[r] = t + 1
    return out, copies


def self_check(device: torch.device, trials: int = 6, seed: int | None = None) -> None:
    """Both variants against `model_step` on small random tables: stamps drawn from a narrow
    range so that ties decide victims, some requests short, some batch rows padding."""
    rng = np.random.default_rng(seed)
    hot, k, extent, row_words = 64, 32, 4, 4
    num_requests, pages = 4, 64
    num_rows = num_requests * pages * extent
    for trial in range(trials):
        for fused, fast_rounds in ((False, 2), (True, 2), (False, 0)):
            host = torch.from_numpy(rng.integers(-2**31, 2**31 - 1, (num_rows, row_words),
                                                 dtype=np.int64).astype(np.int32))
            host_bytes = host.view(torch.uint8).view(num_rows, row_words * 4)
            if device.type == "cuda":
                host_bytes = host_bytes.pin_memory()
            # Requests own disjoint extents, as the host pool hands them out.
            page_table = rng.permutation(num_requests * pages).reshape(num_requests, pages)
            page_table = page_table.astype(np.int32)
            seq_lens = rng.integers(hot + 2, pages * extent, num_requests).astype(np.int32)
            seq_lens[0] = rng.integers(1, hot + 1)  # one short request
            resident = np.full(num_rows, -1, dtype=np.int64)
            slot_row = np.full((num_requests, hot), -1, dtype=np.int64)
            for r in range(num_requests):
                positions = rng.choice(int(seq_lens[r]) - 1, size=min(hot, int(seq_lens[r]) - 1),
                                       replace=False)
                for slot, pos in enumerate(positions[: rng.integers(hot // 2, hot + 1)]):
                    row = int(page_table[r, pos // extent]) * extent + pos % extent
                    resident[row], slot_row[r, slot] = slot, row
            if trial % 2:  # a few far-apart stamps (every radix digit), ties among them
                values = rng.integers(-2**30, 2**30, 12)
                stamps = rng.choice(values, (num_requests, hot)).astype(np.int64)
                step = np.full(num_requests, 2**30 + 3, dtype=np.int64)
            else:  # a narrow range: ties decide most victims
                stamps = rng.integers(0, 3, (num_requests, hot)).astype(np.int64)
                step = rng.integers(3, 6, num_requests).astype(np.int64)
            batch_cap = 4
            num_real = int(rng.integers(1, batch_cap + 1))
            req_slots = rng.permutation(num_requests)[:batch_cap].astype(np.int32)
            top_k = np.full((batch_cap, k), -1, dtype=np.int32)
            for b in range(num_real):
                n = int(seq_lens[req_slots[b]])
                chosen = rng.choice(n, size=min(k, n), replace=False)
                top_k[b, : len(chosen)] = chosen
            top_k[0, -1] = -5  # an invalid entry
            state = {"stamps": stamps.copy(), "step": step.copy(), "resident": resident.copy(),
                     "slot_row": slot_row.copy(), "page_table": page_table,
                     "seq_lens": seq_lens}
            expected_out, copies = model_step(state, req_slots, top_k, num_real, hot, extent)

            def on(array: np.ndarray, dtype: torch.dtype = torch.int32) -> torch.Tensor:
                return torch.from_numpy(np.ascontiguousarray(array)).to(device=device,
                                                                        dtype=dtype)

            slots = hot + 1
            tables = CacheTables(
                device_kv=torch.zeros(1, num_requests * slots, row_words * 4, dtype=torch.uint8,
                                      device=device),
                host_kv=[host_bytes],
                page_table=on(page_table), seq_lens=on(seq_lens),
                slot_row=on(slot_row)[None].contiguous(),
                lru=torch.arange(hot, dtype=torch.int32, device=device).repeat(1, num_requests, 1),
                resident=on(resident, residency_dtype(hot))[None].contiguous(),
                counters=torch.zeros(1, 3, dtype=torch.int64, device=device),
                hot_slots=hot, extent_tokens=extent,
            )
            probe = StampLRU(tables, fused=fused, fast_rounds=fast_rounds)
            probe.stamps.copy_(on(stamps))
            probe.step.copy_(on(step))
            poison = -7
            out = torch.full((batch_cap, k), poison, dtype=torch.int32, device=device)
            probe(tables, 0, 0, on(req_slots), on(top_k),
                  torch.tensor([num_real], dtype=torch.int32, device=device), out)
            variant = "fused" if fused else "three kernels"
            name = f"trial {trial} {variant}, {fast_rounds} fast rounds"
            got_out = out.cpu().numpy()
            expected = np.where(np.arange(batch_cap)[:, None] < num_real, expected_out, -1)
            if not np.array_equal(got_out, expected):
                raise AssertionError(f"{name}: out differs at {np.argwhere(got_out != expected)}")
            for key, got in (("stamps", probe.stamps), ("step", probe.step),
                             ("resident", tables.resident[0]), ("slot_row", tables.slot_row[0])):
                if not np.array_equal(got.cpu().numpy(), state[key]):
                    raise AssertionError(f"{name}: {key} differs from the model")
            device_rows = tables.device_kv[0].cpu()
            for host_row, device_row in copies:
                if not torch.equal(device_rows[device_row], host_bytes[host_row].cpu()):
                    raise AssertionError(f"{name}: device row {device_row} was not copied")
            print(f"self-check {name}: {len(copies)} misses, out/stamps/resident/slot_row/rows "
                  "match the model", flush=True)


VARIANTS: dict[str, Callable[[CacheTables, np.ndarray], object] | None] = {
    "library": None,
    "stamps-3": lambda tables, rows: StampLRU(tables, fused=False),
    "stamps-3-bitwise": lambda tables, rows: StampLRU(tables, fused=False, fast_rounds=0),
    "stamps-fused": lambda tables, rows: StampLRU(tables, fused=True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--churns", type=float, nargs="+", default=[0.0, 0.05, 0.2, 1.0])
    parser.add_argument("--rounds", type=int, default=2, help="each variant this many times")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--output", default="stamp-lru-probe-cuda.json")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--self-check-only", action="store_true",
                        help="compare with the model and stop (any device; CPU: interpreter)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    self_check(device)
    if args.self_check_only:
        return 0
    if device.type != "cuda":
        print("stamp_lru_probe: timing needs a CUDA GPU", file=sys.stderr)
        return 2
    backend = get_backend("cuda")
    sizes = benchmarking.SW1Sizes()
    variants = {name: VARIANTS[name] for name in args.variants}
    records = []
    with benchmarking.sw1_pool(backend, max(args.batches), sizes) as pool:
        mirror = pool.to("cuda")
        for round_index in range(args.rounds):
            for name, kernel_for in variants.items():
                for layout in benchmarking.LAYOUTS:
                    for batch in args.batches:
                        for churn in args.churns:
                            cell = benchmarking.sw1_cell(backend, pool, layout, batch, churn,
                                                         sizes, mirror=mirror,
                                                         kernel_for=kernel_for)
                            record = {"variant": name, "round": round_index, **cell.to_dict()}
                            records.append(record)
                            print(json.dumps(record), flush=True)
            # Written after every round: a run stopped by a time limit keeps what it measured.
            write_results(records, Path(args.out_dir) / args.output)
    return report(records)


def write_results(records: list[dict[str, object]], out: Path) -> None:
    results = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": "python " + " ".join(sys.argv),
        "workload": "SW-1 (benchmarking.sw1_cell, write flush), swap-in kernel per variant",
        "all_correct": all(r["verified"] for r in records),
        "records": records,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}", flush=True)


def report(records: list[dict[str, object]]) -> int:
    table: dict[tuple[str, str, int, float], list[float]] = {}
    for r in records:
        table.setdefault((r["layout"], r["batch"], r["churn"], r["variant"]), []).append(
            round(r["step_seconds"] * 1e6, 1))
    for key, values in sorted(table.items()):
        print(*key, values)
    return 0 if all(r["verified"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
