"""The union swap-in of a verify step: S query tokens' top-k, de-duplicated per request.

A verify step hands `swap_in` a `[B, S, K]` top-k. Per request the S x K entries are reduced
to the distinct older positions (those before the step's first token) in one `[B, U]` row,
U = S * K, in first-occurrence order (s-major, then k), padded with -1; the ordinary
swap-in kernel runs over that row (so a position is looked up once, missed at most once and
held in one slot, and the LRU sees one step's use; the misses take slots in that order),
and its `[B, U]` rows are scattered back to `[B, S, K]` through the inverse index. The
step's own tokens (its draft positions) never enter the union: they are served from the
request's draft slots. The union plan and the scatter are torch ops on the device with no
host sync (`kernels.union_reference`, bound per width through `kernels.union_launcher`), so a
captured graph replays them; one graph per (batch bucket, S), since U is part of every shape.

Each S gets its own swap-in launcher bound to an out buffer of width U
(`backend.kernels.swap_in_launcher`), its own miss plans and group replays. The Triton launcher
(the GPU backends') de-duplicates the flattened `[B, S * K]` rows inside its own lookup and
selection instead (`layout.tables.DraftUnion`; it `fuses_union`): then there is no union row,
plan or scatter, and its out buffer is the result. The misses take their slots in the same
order and every table ends the same as through the union (benchmarks/NOTES.md, twenty-fourth
pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hisparse.backends.base import Backend
from hisparse.core.kernels import DecodeKernels
from hisparse.core.replay import GroupReplay, group_replays, miss_plans
from hisparse.kernels.union_reference import Union, build_union
from hisparse.layout.index_schedule import IndexSchedule
from hisparse.layout.tables import CacheTables, DraftUnion

__all__ = ["Union", "UnionWidth", "build_union", "build_width"]


class _UnionKernels(DecodeKernels):
    """A launcher for one union width whose failures stop the whole cache: a swap-in of any
    width that failed part way may have left the shared tables inconsistent. `union` (set
    by `build_width`) is the width's union plan and scatter."""

    union: Any

    def __init__(self, main: DecodeKernels, *args: Any, **kwargs: Any) -> None:
        self._main = main
        super().__init__(*args, **kwargs)

    def launch_union_plan(self, rows: int, top_k: torch.Tensor) -> None:
        try:
            self.union.plan(rows, top_k)
        except BaseException as exc:
            self._failed("the verify union plan", exc)
            raise

    def launch_union_scatter(self, layer: int, group: int, rows: int) -> None:
        try:
            self.union.scatter(layer, group, rows)
        except BaseException as exc:
            self._failed(f"the verify union scatter of layer {layer}", exc)
            raise

    def _failed(self, what: str, exc: BaseException) -> None:
        super()._failed(what, exc)
        if self.failure is not None and self._main.failure is None:
            self._main.failure = self.failure


@dataclass(eq=False)
class UnionWidth:
    """What the verify steps of one S share (persistent: graph capture holds the addresses).
    The per-batch-size views are cached (`views`): a call per layer slices nothing."""

    tokens: int  # S
    union_top_k: torch.Tensor  # [Bcap, U] int32: the union row the kernel reads (unfused)
    union_out: torch.Tensor  # [G, Bcap, U] int32: the kernel's rows for it
    rows: torch.Tensor  # [G, Bcap, S, K] int32: what swap_in returns (fused: union_out's view)
    kernels: _UnionKernels
    replays: list[GroupReplay | None]
    _views: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
                 ] = field(default_factory=dict)

    def views(self, rows: int
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """(union row, each group's `[rows, S, K]` result, each group's `[rows, K]` result
        when S = 1) of the first `rows` batch rows."""
        views = self._views.get(rows)
        if views is None:
            out = tuple(self.rows[:, :rows].unbind(0))
            views = self._views[rows] = (self.union_top_k[:rows], out,
                                         tuple(o[:, 0] for o in out))
        return views


def build_width(tokens: int, backend: Backend, main: DecodeKernels, tables: CacheTables,
                req_slots: torch.Tensor, num_real: torch.Tensor, first: torch.Tensor,
                draft_base: torch.Tensor, last_visible: torch.Tensor,
                draft_rows: tuple[torch.Tensor, torch.Tensor],
                top_k: int, schedule: IndexSchedule,
                skip_io: bool, prefetch_stream: Any | None,
                table: Callable[[], torch.Tensor]) -> UnionWidth:
    """The launchers, buffers, miss plans and group replays for verify steps of `tokens`;
    `first`, `draft_base` and `last_visible` are the batch buffers' persistent `[Bcap]` int64
    fields (`layout.tables.DraftUnion`),
    `draft_rows` its `[Bcap * S]` device rows of the step's tokens (int32 and int64: what the
    width's newest writer writes to), `table` hands the cache's presence table to a launcher
    that needs it."""
    capacity = int(req_slots.shape[0])
    device = tables.seq_lens.device
    num_groups = schedule.num_groups
    width = tokens * top_k
    i32 = {"dtype": torch.int32, "device": device}
    union_out = torch.full((num_groups, capacity, width), -1, **i32)
    plans = miss_plans(schedule, capacity, width, device)
    kernels = _UnionKernels(main, backend, skip_io, tables, req_slots, num_real,
                            union_out, plans, draft_rows, swap_in_writes_newest=False,
                            union=DraftUnion(tokens, top_k, first, draft_base, table,
                                             last_visible))
    replays = group_replays(schedule, plans, tables, kernels, backend, device, prefetch_stream)
    if kernels.fuses_union:  # its swap-in reads the [B, S * K] rows and writes the result
        union_top_k = torch.empty((capacity, 0), **i32)
        rows = union_out.view(num_groups, capacity, tokens, top_k)
        kernels.union = None
    else:
        union_top_k = torch.full((capacity, width), -1, **i32)
        rows = torch.full((num_groups, capacity, tokens, top_k), -1, **i32)
        kernels.union = backend.kernels.union_launcher(
            tokens, top_k, first, draft_base, num_real, union_top_k, union_out, rows,
            tables.counters, request_counts=(tables.request_counters, req_slots),
            last_visible=last_visible)
    return UnionWidth(tokens=tokens, union_top_k=union_top_k, union_out=union_out, rows=rows,
                      kernels=kernels, replays=replays)
