"""The swap-in launcher: binds tables, buffers and a launch plan to the three kernels.

Two ways in, one binding (`_bind`):
* `SwapInLauncher`, which an engine builds once over its tables and persistent batch buffers.
  It checks everything when it is built, keeps one launch plan per batch size and one set of
  bound launches per (layer, group, batch size), and replays them directly on the driver
  (`kernels.launching.BoundLaunch`): the eager host path.
* `swap_in_triton` / `copy_planned_triton`, the standalone calls with the reference's
  signature (tests, benchmarks), which check their arguments and bind anew on every call.

Neither synchronises with the host, and every grid is sized from the batch rows and K alone,
so a call can be captured in a graph (after one eager call) and replayed with another
`num_real`. Scratch is allocated once per (tables, batch capacity, K).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from hisparse.kernels.launching import BoundLaunch
from hisparse.kernels.swap_in.checks import (
    check_int32,
    check_plan,
    check_tables,
    fail,
    layer_rows,
)
from hisparse.kernels.swap_in.copy import (
    complete_union_kernel,
    copy_kernel,
    copy_prefetched_kernel,
)
from hisparse.kernels.swap_in.lookup import classify_kernel
from hisparse.kernels.swap_in.plan import (
    CopyPlan,
    DeviceTraits,
    LauncherCapabilities,
    LaunchPlan,
    Tuning,
    current_tuning,
    plan_launch,
    replay_plan,
)
from hisparse.kernels.swap_in.select import select_kernel
from hisparse.kernels.union_reference import SENTINEL
from hisparse.layout.tables import (
    CacheTables,
    DraftUnion,
    MissPlan,
    NewestRows,
    residency_dtype,
    word_rows,
)
from hisparse.layout.widths import INT16_MAX_HOT_SLOTS


@dataclass(eq=False)
class Scratch:
    """The kernels' working memory for one batch capacity; the counts are zero between
    calls (the selection resets what the lookup adds)."""

    order: torch.Tensor  # [Bcap, H] int32: each row's victims in slot order
    miss_row: torch.Tensor  # [Bcap, K] int32: each entry's code (lookup.py, _entry_codes)
    miss_count: torch.Tensor  # [Bcap] int32: misses per batch row
    hit_count: torch.Tensor  # [Bcap] int32: hits per batch row (per-request counters)
    # [2 * buckets + 1] int32: misses per host-address bucket, entries handed out per bucket,
    # selection programs done
    address_order: torch.Tensor
    row_buckets: torch.Tensor  # [Bcap, buckets] int32: a row's misses per bucket
    plan: MissPlan  # the plan of a call that records none for followers

    @classmethod
    def allocate(cls, batch_cap: int, top_k: int, hot_slots: int, buckets: int,
                 device: torch.device) -> Scratch:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        return cls(order=zeros(batch_cap, hot_slots), miss_row=zeros(batch_cap, top_k),
                   miss_count=zeros(batch_cap), hit_count=zeros(batch_cap),
                   address_order=zeros(2 * buckets + 1),
                   row_buckets=zeros(batch_cap, buckets),
                   plan=MissPlan.empty(batch_cap, top_k, device))

    @property
    def buckets(self) -> int:
        return (self.address_order.numel() - 1) // 2

    def reset_counts(self) -> None:
        """After a launch failed behind the lookup (which adds to the counts the selection
        resets)."""
        self.miss_count.zero_()
        self.hit_count.zero_()
        self.address_order.zero_()
        self.row_buckets.zero_()


_scratch: weakref.WeakKeyDictionary[CacheTables, dict[tuple[int, int], Scratch]] = (
    weakref.WeakKeyDictionary()
)


def scratch_for(tables: CacheTables, batch_cap: int, top_k: int) -> Scratch:
    """The standalone calls' scratch for (tables, Bcap, K), checking the tables the first time
    (once per allocation rather than per call: tables are never rebound)."""
    per_shape = _scratch.setdefault(tables, {})
    scratch = per_shape.get((batch_cap, top_k))
    buckets = current_tuning().address_buckets
    if scratch is None or scratch.buckets != buckets:
        check_tables(tables)
        scratch = per_shape[(batch_cap, top_k)] = Scratch.allocate(
            batch_cap, top_k, tables.hot_slots, buckets, tables.last_use.device)
    return scratch


@functools.cache
def _compute_units(device: torch.device) -> int:
    """SMs / CUs / Xe cores as Triton's own driver reports them; 1 on the CPU."""
    if device.type == "cpu":
        return 1
    driver = triton.runtime.driver.active
    index = device.index if device.index is not None else driver.get_current_device()
    return int(driver.utils.get_device_properties(index)["multiprocessor_count"])


def default_traits(device: torch.device) -> DeviceTraits:
    """The traits of `device` as its backend states them (PDL is a backend feature)."""
    from hisparse.backends.registry import get_backend

    if device.type == "cpu":
        return DeviceTraits(compute_units=1, pdl=False, interpreted=True)
    return get_backend(device.type).kernel_traits(device)


_host_addresses: weakref.WeakKeyDictionary[CacheTables, list[int]] = weakref.WeakKeyDictionary()


def _host_address(tables: CacheTables, layer: int) -> int:
    """The raw address a kernel must receive for `host_kv[layer]` (read back once per tables:
    `host_kv_addresses` is the backend's device-side address, which on ROCm differs from the
    host pointer)."""
    addresses = _host_addresses.get(tables)
    if addresses is None:
        source = tables.host_kv_addresses
        addresses = _host_addresses[tables] = (
            source.tolist() if source is not None else [h.data_ptr() for h in tables.host_kv])
    return addresses[layer]


def _bind(tables: CacheTables, plan: LaunchPlan, layer: int, group: int,
          req_slots: torch.Tensor, top_k: torch.Tensor, num_real: torch.Tensor,
          out: torch.Tensor, miss_plan: MissPlan, scratch: Scratch, direct: bool,
          newest: NewestRows | None = None, union: DraftUnion | None = None
          ) -> tuple[BoundLaunch, ...]:
    """The lookup, selection and (unless skip-IO) copy launches of one call; with `newest`,
    the lookup also writes the layer's new rows; with `union`, `top_k` is a verify step's
    flattened `[rows, S * K]`, de-duplicated per row."""
    t, device = tables, tables.last_use.device
    num_requests, max_pages = t.page_table.shape
    rows, k, hot_slots = plan.rows, plan.top_k, plan.hot_slots
    n_rows, positions = t.num_host_rows, t.positions_per_request
    buckets = plan.address_buckets
    bucket_count, bucket_cursor, done = (scratch.address_order[:buckets],
                                         scratch.address_order[buckets:-1],
                                         scratch.address_order[-1:])
    resident, last_use, lru_clock = t.resident[group], t.last_use[group], t.lru_clock[group]
    request_counts = t.request_counters
    # Without key extents the kernels never read it: the page table stands in (a pointer).
    key_extents = t.key_host_extent if t.key_host_extent is not None else t.page_table
    shared = {"EARLY_LOADS": plan.early_loads, "POSITION_KEYED": plan.position_keyed,
              "KEY_EXTENTS": plan.key_extents, "USE_PDL": plan.pdl,
              "ADDRESS_ORDER": plan.address_order, "NUM_BUCKETS": buckets,
              "REQUEST_COUNTS": request_counts is not None}
    # Placeholders the kernel never reads, unless the call writes (and backs up) new rows.
    new_kv, new_rows, layer_words, device_rows = out, req_slots, out, 0
    host_rows, host_words, addresses = req_slots, out, {}
    write = {"WRITE_NEWEST": False, "BACKUP_NEWEST": False, "ROW_WORDS": 1, "BLOCK_WORDS": 1}
    if newest is not None:
        host_layer, layer_words = layer_rows(t, layer)
        new_kv, new_rows, device_rows = newest.kv, newest.rows, layer_words.shape[0]
        write = {"WRITE_NEWEST": True, "BACKUP_NEWEST": newest.host_rows is not None,
                 "ROW_WORDS": layer_words.shape[1],
                 "BLOCK_WORDS": triton.next_power_of_2(layer_words.shape[1])}
        if newest.host_rows is not None:
            host_rows, host_words = newest.host_rows, host_layer
            addresses = {_HOST_WORDS_ARG: _host_address(t, layer)}
    # Placeholders again, unless the call de-duplicates a verify row.
    first, draft_base, last_visible, presence = req_slots, req_slots, req_slots, req_slots
    dedup = {"DEDUP": False, "CANDIDATES": False}
    if union is not None:
        first, draft_base, presence = union.first, union.draft_base, union.table()
        last_visible = union.last_visible
        _check_presence_table(presence, rows, t.positions_per_request, device)
        dedup = {"DEDUP": True, "CANDIDATES": plan.first_candidates}
    presence_stride = presence.stride(0) if union is not None else 0
    launches = [
        BoundLaunch(classify_kernel, plan.classify_grid, (
            num_real, req_slots, t.seq_lens, top_k, out, t.page_table, resident, last_use,
            lru_clock, key_extents, scratch.miss_row, scratch.miss_count, t.counters[layer],
            bucket_count, scratch.hit_count, new_kv, new_rows, layer_words, host_rows,
            host_words, num_requests, t.slots_per_request, k, hot_slots, t.extent_tokens,
            max_pages, n_rows, positions, resident.shape[0], device_rows, first, draft_base,
            last_visible, presence, presence_stride),
            {**shared, "COUNTER_SEM": plan.counter_sem, "CHUNK_K": plan.classify_chunk,
             "num_warps": plan.classify_warps, **write, **dedup,
             "TOKEN_K": union.top_k if union is not None else 1}, device=device,
            addresses=addresses, direct=direct),
        BoundLaunch(select_kernel, (rows,), (
            num_real, req_slots, t.seq_lens, top_k, out, resident, t.slot_key[group], last_use,
            lru_clock, scratch.miss_row, scratch.miss_count, scratch.order, miss_plan.src,
            miss_plan.dst, miss_plan.count, miss_plan.src.stride(0), bucket_count,
            bucket_cursor, done, scratch.row_buckets, scratch.hit_count,
            request_counts if request_counts is not None else t.counters, t.page_table,
            num_requests, t.slots_per_request, k, hot_slots, n_rows, positions,
            resident.shape[0], t.extent_tokens, max_pages, presence, presence_stride),
            {**shared, **dedup, "FAST_ROUNDS": plan.select_fast_rounds, "BLOCK_K": plan.block_k,
             "BLOCK_H": plan.block_h, "num_warps": plan.select_warps,
             **({"launch_pdl": True} if plan.pdl else {})}, device=device, direct=direct),
    ]
    completion = (_UnionCompletion(top_k, presence, presence_stride, k, plan.first_candidates)
                  if union is not None else None)
    return (*launches, *_bind_copies(t, plan, layer, scratch.miss_row, out, miss_plan, direct,
                                     completion))


def _bind_copies(tables: CacheTables, plan: LaunchPlan, layer: int, miss_row: torch.Tensor,
                 out: torch.Tensor, miss_plan: MissPlan, direct: bool,
                 completion: _UnionCompletion | None) -> list[BoundLaunch]:
    """What follows the selection: the copy (none where IO is skipped), and a verify row's
    union completion, in the copy or as its own launch before it (`plan.union_completion`)."""
    launches = []
    rows, k = plan.rows, plan.top_k
    if completion is not None and plan.union_completion == "own kernel":
        launches.append(_bind_completion(completion, miss_row, out, rows,
                                         tables.last_use.device, direct))
        completion = None
    if plan.copy.variant == "prefetched":
        launches.append(_bind_prefetched_copy(tables, layer, plan.copy, miss_row, out,
                                              rows * k, direct, completion))
    elif plan.copy.variant == "planned":
        launches.append(_bind_copy(tables, layer, plan.copy, miss_plan, rows, direct,
                                   miss_row, out, completion))
    return launches


@dataclass(frozen=True)
class _UnionCompletion:
    """What a copy behind a verify row's selection reads to complete its union (copy.py,
    `_complete_union`)."""

    top_k: torch.Tensor  # [rows, S * K] the call's flattened top-k
    presence: torch.Tensor
    presence_stride: int
    row_entries: int  # S * K
    candidates: bool = False  # LaunchPlan.first_candidates


def _copy_constants(tables: CacheTables, copy: CopyPlan) -> dict[str, object]:
    row_words = tables.row_bytes // 4
    return {"ROW_WORDS": row_words, "BLOCK_WORDS": triton.next_power_of_2(row_words),
            "ROWS": copy.rows_per_iteration, "USE_PDL": copy.pdl, "num_warps": copy.warps,
            **({"launch_pdl": True} if copy.pdl else {})}


def _miss_row_cache(copy: CopyPlan) -> str:
    # Only a launch behind a running selection needs the L2 read (the lookup's codes are
    # read before the wait); after an ordinary kernel boundary a plain load is right on
    # every vendor's backend.
    return ".cg" if copy.pdl else ""


def _bind_prefetched_copy(tables: CacheTables, layer: int, copy: CopyPlan,
                          miss_row: torch.Tensor, out: torch.Tensor, entries: int,
                          direct: bool, completion: _UnionCompletion | None = None
                          ) -> BoundLaunch:
    host, device = layer_rows(tables, layer)
    constants = {**_copy_constants(tables, copy), "MISS_ROW_CACHE": _miss_row_cache(copy),
                 "DEDUP": completion is not None,
                 "CANDIDATES": completion is not None and completion.candidates}
    c = completion or _UnionCompletion(miss_row, miss_row, 0, 1)  # placeholders: never read
    return BoundLaunch(copy_prefetched_kernel, (copy.programs,),
                       (miss_row, out, host, device, entries, c.top_k, c.presence,
                        c.presence_stride, c.row_entries), constants,
                       device=device.device, addresses={2: _host_address(tables, layer)},
                       direct=direct)


def _bind_copy(tables: CacheTables, layer: int, copy: CopyPlan, plan: MissPlan, rows: int,
               direct: bool, miss_row: torch.Tensor | None = None,
               out: torch.Tensor | None = None, completion: _UnionCompletion | None = None
               ) -> BoundLaunch:
    host, device = layer_rows(tables, layer)
    c = completion or _UnionCompletion(plan.src, plan.src, 0, 1)  # placeholders: never read
    return BoundLaunch(copy_kernel, (copy.programs,), (
        plan.src, plan.dst, plan.count, plan.src.stride(0), host, device, rows,
        plan.src.shape[1], host.shape[0], device.shape[0],
        miss_row if miss_row is not None else plan.src, c.top_k,
        out if out is not None else plan.src, c.presence, c.presence_stride,
        rows * c.row_entries, c.row_entries),
        {**_copy_constants(tables, copy), "BLOCK_BATCH": triton.next_power_of_2(rows),
         "DEDUP": completion is not None, "UNION_BLOCK": _UNION_BLOCK,
         "CANDIDATES": completion is not None and completion.candidates,
         "MISS_ROW_CACHE": _miss_row_cache(copy)},
        device=device.device, addresses={4: _host_address(tables, layer)}, direct=direct)


# Entries per iteration of the planned copy's union walk: the walk is a few loads and stores
# per entry, so wider than the row copy's iterations.
_UNION_BLOCK = 128
# Entries per program of the union's own kernel.
_COMPLETION_BLOCK = 1024


def _bind_completion(completion: _UnionCompletion, miss_row: torch.Tensor, out: torch.Tensor,
                     rows: int, device: torch.device, direct: bool) -> BoundLaunch:
    entries = rows * completion.row_entries
    return BoundLaunch(complete_union_kernel, (triton.cdiv(entries, _COMPLETION_BLOCK),), (
        miss_row, completion.top_k, out, completion.presence, completion.presence_stride,
        entries, completion.row_entries),
        {"BLOCK": _COMPLETION_BLOCK, "num_warps": 4, "CANDIDATES": completion.candidates},
        device=device, direct=direct)


def _run(launches: tuple[BoundLaunch, ...], scratch: Scratch,
         union: DraftUnion | None = None) -> None:
    """Launch a call's kernels. A launch that fails after the lookup leaves counts (and a
    verify row's presence table) that the selection or the copy would have reset: reset here
    instead, queued behind the lookup, so that the next call starts clean."""
    # Read once for the call's two or three launches (None: each reads its own, as triton's
    # own path does before the first call has compiled, and under the interpreter).
    stream = launches[0].current_stream() if launches[0].direct else None
    launches[0](stream)
    try:
        for launch in launches[1:]:
            launch(stream)
    except BaseException:
        scratch.reset_counts()
        if union is not None:
            union.table().fill_(SENTINEL)
        raise


# Positions of the top-k tensor among the lookup's and the selection's arguments, and of the
# new rows and the layer's host rows among the lookup's.
_TOP_K_ARG = 3
_NEWEST_KV_ARG = 15
_HOST_WORDS_ARG = 19


class SwapInLauncher:
    """The Triton swap-in of one cache, over its tables and persistent batch buffers.

    `req_slots [Bcap]`, `num_real [1]` and `out [G, Bcap, K]` are the engine's; a call over
    `rows <= Bcap` batch rows uses their first rows. A group with a plan in `plans` (index
    groups with followers) records its misses there for its followers to replay.
    """

    def __init__(self, tables: CacheTables, req_slots: torch.Tensor, num_real: torch.Tensor,
                 out: torch.Tensor, *, traits: DeviceTraits,
                 plans: Sequence[MissPlan | None] | None = None, skip_io: bool = False,
                 newest_rows: torch.Tensor | None = None,
                 newest_host_rows: torch.Tensor | None = None,
                 union: DraftUnion | None = None) -> None:
        device = tables.last_use.device
        check_tables(tables)
        groups, batch_cap, top_k = out.shape
        check_int32("req_slots", req_slots, (batch_cap,), device)
        check_int32("num_real", num_real, (1,), device)
        check_int32("out", out, (groups, batch_cap, top_k), device)
        _check_shape(tables, top_k)
        self.tables, self.traits, self.skip_io = tables, traits, skip_io
        self.batch_capacity, self.top_k = batch_cap, top_k
        self._req_slots, self._num_real, self._out = req_slots, num_real, out
        self.plans = list(plans) if plans is not None else [None] * groups
        for plan in self.plans:
            if plan is not None:
                check_plan(plan, batch_cap, top_k, device)
        for name, rows in (("newest_rows", newest_rows), ("newest_host_rows", newest_host_rows)):
            if rows is not None:
                check_int32(name, rows, (batch_cap,), device)
        if newest_host_rows is not None and newest_rows is None:
            raise fail("newest_host_rows (where the lookup backs new rows up) needs "
                       "newest_rows (where it writes them)", "newest_rows=None",
                       "pass both or neither")
        self._newest_rows = newest_rows
        self._newest_host_rows = newest_host_rows
        if union is not None:
            _check_union(union, batch_cap, top_k, device)
        self.union = union
        self._tuning: Tuning | None = None
        self._reset()

    @property
    def writes_newest(self) -> bool:
        """Whether `swap_in` can write the layer's new rows in its lookup (`newest_kv`)."""
        return self._newest_rows is not None and self.tables.device_kv.is_contiguous()

    @property
    def backs_up_newest(self) -> bool:
        """Whether a lookup that writes the new rows also writes them to their host rows
        (`newest_host_rows`), so that the step's backup has nothing left to copy."""
        return self.writes_newest and self._newest_host_rows is not None

    @property
    def capabilities(self) -> LauncherCapabilities:
        return LauncherCapabilities(writes_newest=self.writes_newest,
                                    backs_up_newest=self.backs_up_newest,
                                    fuses_union=self.union is not None)

    def _reset(self) -> None:
        tune = current_tuning()
        self._tuning = tune
        self._scratch = Scratch.allocate(self.batch_capacity, self.top_k,
                                         self.tables.hot_slots, tune.address_buckets,
                                         self.tables.last_use.device)
        self._launch_plans: dict[int, LaunchPlan] = {}
        self._swap_ins: dict[tuple[int, int, int, bool], tuple[BoundLaunch, ...]] = {}
        self._replays: dict[tuple[int, int, int], BoundLaunch] = {}

    def launch_plan(self, rows: int) -> LaunchPlan:
        """The plan of a call over `rows` batch rows (computed once per batch size)."""
        plan = self._launch_plans.get(rows)
        if plan is None:
            t = self.tables
            plan = self._launch_plans[rows] = plan_launch(
                rows, self.top_k, t.hot_slots, t.extent_tokens, t.residency_map == "position",
                self.traits, skip_io=self.skip_io, tune=self._tuning,
                key_extents=t.key_host_extent is not None)
        return plan

    def swap_in(self, layer: int, group: int, rows: int, top_k: torch.Tensor,
                newest_kv: torch.Tensor | None = None) -> None:
        """Swap in `layer` of `group` for the first `rows` batch rows. `top_k` must be an
        int32 `[rows, K]` contiguous tensor on the device (the engine checks it); `newest_kv`
        (where `writes_newest`), the layer's new rows `[rows, W]` as `word_rows` takes them,
        written by the lookup kernel."""
        if current_tuning() is not self._tuning:
            self._reset()
        key = (layer, group, rows, newest_kv is not None)
        launches = self._swap_ins.get(key)
        if launches is None:
            recorded = self.plans[group]
            plan = recorded.first_rows(rows) if recorded is not None else self._scratch.plan
            newest = (NewestRows(newest_kv, self._newest_rows, self._newest_host_rows)
                      if newest_kv is not None else None)
            launches = self._swap_ins[key] = _bind(
                self.tables, self.launch_plan(rows), layer, group, self._req_slots[:rows],
                top_k, self._num_real, self._out[group][:rows], plan, self._scratch,
                direct=self.traits.direct_launch, newest=newest, union=self.union)
        else:
            if launches[0].address(_TOP_K_ARG) != top_k.data_ptr():
                # Another top-k tensor (the bound launches keep the last one alive).
                launches[0].rebind(_TOP_K_ARG, top_k)
                launches[1].rebind(_TOP_K_ARG, top_k)
                if self.union is not None:  # the launch that completes the union reads it
                    for launch in launches[2:]:
                        launch.rebind(launch.kernel.arg_names.index("top_k_ptr"), top_k)
            if newest_kv is not None and launches[0].address(_NEWEST_KV_ARG) != (
                    newest_kv.data_ptr()):
                launches[0].rebind(_NEWEST_KV_ARG, newest_kv)
        _run(launches, self._scratch, self.union)

    def replay(self, layer: int, group: int, rows: int) -> None:
        """Copy the rows `group`'s last swap-in recorded into `layer` (a follower)."""
        key = (layer, group, rows)
        launch = self._replays.get(key)
        if launch is None:
            t = self.tables
            copy = replay_plan(rows, self.top_k, t.extent_tokens, self.traits, self._tuning)
            launch = self._replays[key] = _bind_copy(t, layer, copy,
                                                     self.plans[group].first_rows(rows), rows,
                                                     direct=self.traits.direct_launch)
        launch()


def _check_union(union: DraftUnion, batch_cap: int, width: int, device: torch.device
                 ) -> None:
    if union.tokens * union.top_k != width:
        raise fail("a verify union's launcher reads S x K entries per row",
                   f"out width {width} for S={union.tokens}, K={union.top_k}",
                   "bind it to a [G, Bcap, S * K] out")
    for name in ("first", "draft_base", "last_visible"):
        field = getattr(union, name)
        if field.dtype != torch.int64 or tuple(field.shape) != (batch_cap,) or (
                field.device != device):
            raise fail(f"union.{name} must be int64 [{batch_cap}] on {device}",
                       f"{field.dtype} {list(field.shape)} on {field.device}",
                       "pass the verify step's persistent begin-block field")


def _check_presence_table(table: torch.Tensor, rows: int, positions: int,
                          device: torch.device) -> None:
    # A column for every position a page table can map: the kernels index it by position.
    if (table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] < rows
            or table.shape[1] < positions or table.device != device or table.stride(1) != 1):
        raise fail(f"union.table() must be an int32 [>= {rows}, >= {positions}] presence "
                   f"table on {device}", f"{table.dtype} {list(table.shape)} on {table.device}",
                   "make it with union_reference.presence_table(rows, "
                   "tables.positions_per_request)")


def _check_shape(tables: CacheTables, top_k: int) -> None:
    hot_slots = tables.hot_slots
    if hot_slots < top_k:
        raise fail("the hot buffer must hold at least top_k slots", f"H={hot_slots} < K={top_k}",
                   "raise hot_slots to at least top_k")
    if tables.resident.dtype not in (residency_dtype(hot_slots), torch.int32):
        raise fail(f"tables.resident must be int16 (while H <= {INT16_MAX_HOT_SLOTS}) or int32",
                   f"{tables.resident.dtype} with H={hot_slots}",
                   "allocate it with layout.tables.residency_dtype(hot_slots)")


def swap_in_triton(
    tables: CacheTables,
    layer: int,
    group: int,
    req_slots: torch.Tensor,  # [Bcap] int32 request slot per batch row
    top_k: torch.Tensor,  # [Bcap, K] int32 token positions, -1 = none
    num_real: torch.Tensor,  # [1] int32 device scalar: rows >= num_real are padding
    out: torch.Tensor,  # [Bcap, K] int32: device row per entry, -1 = none
    plan: MissPlan | None = None,
    skip_io: bool = False,
    traits: DeviceTraits | None = None,
    newest: NewestRows | None = None,
    union: DraftUnion | None = None,
) -> None:
    """Swap-in of one layer for a padded batch (docs/ARCHITECTURE.md), checked and bound on
    every call. `traits`: the device's, by default as its backend states them; `newest`: the
    layer's new rows, written by the lookup; `union`: top_k is a verify step's `[Bcap, S * K]`
    rows, de-duplicated per row (as `core.union` swaps in their union). Raises
    InvalidInputError, before any launch, for inputs it cannot use."""
    t = tables
    device = t.last_use.device
    if top_k.dim() != 2:
        raise fail("top_k must be [Bcap, K]", list(top_k.shape), "pass a 2-D tensor")
    batch_cap, k = top_k.shape
    if k < 1:
        raise fail("top_k needs at least one column", list(top_k.shape),
                   "pass [Bcap, K] positions with K >= 1 (-1 marks an unused entry)")
    check_int32("top_k", top_k, (batch_cap, k), device)
    check_int32("out", out, (batch_cap, k), device)
    check_int32("req_slots", req_slots, (batch_cap,), device)
    check_int32("num_real", num_real, (1,), device)
    _check_shape(t, k)
    num_groups = t.last_use.shape[0]
    if not 0 <= group < num_groups:
        raise fail(f"group must be in [0, {num_groups})", group, "pass the layer's index group")
    layer_rows(t, layer)
    if plan is not None:
        check_plan(plan, batch_cap, k, device)
    if newest is not None:
        _check_newest(t, newest, batch_cap)
    if union is not None:
        _check_union(union, batch_cap, k, device)
    scratch = scratch_for(t, batch_cap, k)
    launch_plan = plan_launch(batch_cap, k, t.hot_slots, t.extent_tokens,
                              t.residency_map == "position", traits or default_traits(device),
                              skip_io=skip_io, key_extents=t.key_host_extent is not None)
    _run(_bind(t, launch_plan, layer, group, req_slots, top_k, num_real, out,
               plan if plan is not None else scratch.plan, scratch, direct=False,
               newest=newest, union=union), scratch, union)


def _check_newest(tables: CacheTables, newest: NewestRows, batch_cap: int) -> None:
    device = tables.last_use.device
    check_int32("newest.rows", newest.rows, (batch_cap,), device)
    if newest.host_rows is not None:
        check_int32("newest.host_rows", newest.host_rows, (batch_cap,), device)
    kv = newest.kv
    if (kv.dtype != torch.uint8 or tuple(kv.shape) != (batch_cap, tables.row_bytes)
            or kv.device != device or not word_rows(kv)):
        raise fail(f"newest.kv must be a dense uint8 [{batch_cap}, {tables.row_bytes}] tensor "
                   f"on {device} from a 4-byte aligned address",
                   f"{kv.dtype} {list(kv.shape)} on {kv.device}", "pass the layer's new rows")
    if not tables.device_kv.is_contiguous():
        raise fail("tables.device_kv must be contiguous", tuple(tables.device_kv.stride()),
                   "allocate it as one [L, rows, W] tensor")


def copy_planned_triton(tables: CacheTables, layer: int, plan: MissPlan,
                        traits: DeviceTraits | None = None) -> None:
    """Copy the rows a plan recorded into `layer`'s device rows (shared-index replay)."""
    device = tables.last_use.device
    if plan.src.dim() != 2:
        raise fail("plan.src must be [Bcap, K]", list(plan.src.shape),
                   "allocate it with MissPlan.empty(batch_capacity, top_k, device)")
    batch_cap, k = plan.src.shape
    check_plan(plan, batch_cap, k, device)
    copy = replay_plan(batch_cap, k, tables.extent_tokens, traits or default_traits(device))
    _bind_copy(tables, layer, copy, plan, batch_cap, direct=False)()
