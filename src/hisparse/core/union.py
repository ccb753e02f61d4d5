"""The union swap-in of a verify step: S query tokens' top-k, de-duplicated per request.

A verify step hands `swap_in` a `[B, S, K]` top-k. Per request the S x K entries are reduced
to the distinct older positions (those before the step's first token) in one `[B, U]` row,
U = S * K, padded with -1; the ordinary swap-in kernel runs over that row (so a position is
looked up once, missed at most once and held in one slot, and the LRU sees one step's use),
and its `[B, U]` rows are scattered back to `[B, S, K]` through the inverse index. The
step's own tokens (its draft positions) never enter the union: they are served from the
request's draft slots. Everything here is torch ops that stay on the device with no host
sync (sort, cumsum, scatter, gather), so a captured graph replays it; one graph per (batch
bucket, S), since U is part of every shape.

The Triton kernels are built for one top-k width: each S gets its own launcher bound to an
out buffer of width U (`backend.swap_in_launcher`), its own miss plans and group replays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hisparse.backends.base import Backend
from hisparse.core.kernels import DecodeKernels
from hisparse.core.ordering import SideStreamReplay
from hisparse.core.replay import GroupReplay
from hisparse.layout.tables import CacheTables, MissPlan

# Sorts after every real position (positions are < 2**31).
_ABSENT = 2**62
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16}
_ALIGN = 16


@dataclass(frozen=True)
class Union:
    """One `[B, S, K]` top-k, reduced: see `build_union`."""

    positions: torch.Tensor  # [B, U] int64 distinct older positions, ascending, then -1
    inverse: torch.Tensor  # [B, S*K] int64 union column of each entry; U = not in the union
    draft: torch.Tensor  # [B, S, K] bool: the entry selects one of the step's own tokens
    invalid: torch.Tensor  # [B, S, K] bool: below -1, or after the query token's own position


def build_union(top_k: torch.Tensor, first: torch.Tensor, real: torch.Tensor) -> Union:
    """Reduce `top_k [B, S, K]` to each request's distinct positions before `first [B]`.

    Query token s of row b is at position `first[b] + s` and may select any position up to
    its own; rows where `real [B]` is False (padding) select nothing.
    """
    B, S, K = top_k.shape
    U = S * K
    pos = top_k.long()
    own = first[:, None, None] + torch.arange(S, device=pos.device)[None, :, None]
    real = real[:, None, None]
    selected = real & (pos >= 0) & (pos <= own)
    older = selected & (pos < first[:, None, None])
    flat = torch.where(older, pos, _ABSENT).reshape(B, U)
    ordered, order = flat.sort(dim=1, stable=True)
    present = ordered < _ABSENT
    distinct = present.clone()
    distinct[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    rank = distinct.long().cumsum(1) - 1  # duplicates share their first occurrence's column
    # Column U collects what is not written anywhere; it is dropped.
    positions = torch.full((B, U + 1), -1, dtype=torch.long, device=pos.device)
    positions.scatter_(1, torch.where(distinct, rank, U), torch.where(distinct, ordered, -1))
    inverse = torch.empty_like(order).scatter_(1, order, torch.where(present, rank, U))
    return Union(positions=positions[:, :U], inverse=inverse, draft=selected & ~older,
                 invalid=real & ((pos < -1) | (pos > own)))


def scatter_rows(union: Union, union_rows: torch.Tensor, draft_base: torch.Tensor,
                 first: torch.Tensor, top_k: torch.Tensor, out: torch.Tensor) -> None:
    """`out [B, S, K]` = the union's device row of each entry, or its draft slot's row.

    `draft_base [B]` is the device row of each request's first draft slot (slot H).
    """
    B, S, K = top_k.shape
    padded = torch.cat([union_rows.long(), union_rows.new_full((B, 1), -1).long()], dim=1)
    rows = padded.gather(1, union.inverse).view(B, S, K)
    drafts = draft_base[:, None, None] + top_k.long() - first[:, None, None]
    out.copy_(torch.where(union.draft, drafts, rows).to(out.dtype))


def count_extras(counters: torch.Tensor, union: Union, top_k: torch.Tensor,
                 first: torch.Tensor) -> None:
    """Add what the union kernel did not see to `counters [3]`: each distinct draft position a
    request selected is one hit (as the newest token is in a single-token step), and every
    invalid entry is one invalid entry."""
    B, S, K = top_k.shape
    column = torch.where(union.draft, top_k.long() - first[:, None, None], S).view(B, S * K)
    used = torch.zeros(B, S + 1, dtype=torch.bool, device=top_k.device)
    used.scatter_(1, column, True)
    counters[0] += used[:, :S].sum()
    counters[2] += union.invalid.sum()


class _UnionKernels(DecodeKernels):
    """A launcher for one union width whose failures stop the whole cache: a swap-in of any
    width that failed part way may have left the shared tables inconsistent."""

    def __init__(self, main: DecodeKernels, *args: Any, **kwargs: Any) -> None:
        self._main = main
        super().__init__(*args, **kwargs)

    def _failed(self, what: str, exc: BaseException) -> None:
        super()._failed(what, exc)
        if self.failure is not None and self._main.failure is None:
            self._main.failure = self.failure


@dataclass(eq=False)
class UnionWidth:
    """What the verify steps of one S share (persistent: graph capture holds the addresses)."""

    tokens: int  # S
    union_top_k: torch.Tensor  # [Bcap, U] int32: the union row the kernel reads
    union_out: torch.Tensor  # [G, Bcap, U] int32: the kernel's rows for it
    rows: torch.Tensor  # [G, Bcap, S, K] int32: what swap_in returns
    kernels: _UnionKernels
    replays: list[GroupReplay | None]


def build_width(tokens: int, backend: Backend, main: DecodeKernels, tables: CacheTables,
                req_slots: torch.Tensor, num_real: torch.Tensor, top_k: int, num_layers: int,
                group_size: int, skip_io: bool, zero_copy: bool,
                prefetch_stream: Any | None) -> UnionWidth:
    """The launcher, buffers, miss plans and group replays for verify steps of `tokens`."""
    capacity = int(req_slots.shape[0])
    device = tables.seq_lens.device
    num_groups = -(-num_layers // group_size)
    width = tokens * top_k
    i32 = {"dtype": torch.int32, "device": device}
    union_out = torch.full((num_groups, capacity, width), -1, **i32)
    plans = [MissPlan.empty(capacity, width, device) if group_size > 1 else None
             for _ in range(num_groups)]
    kernels = _UnionKernels(main, backend, skip_io, zero_copy, tables, req_slots, num_real,
                            union_out, plans)
    replays: list[GroupReplay | None] = [None] * num_groups
    for group in range(num_groups if group_size > 1 else 0):
        anchor = group * group_size
        followers = range(anchor + 1, min(anchor + group_size, num_layers))
        side = (SideStreamReplay(backend, device, prefetch_stream, followers)
                if prefetch_stream is not None else None)
        plan = plans[group]
        assert plan is not None
        replays[group] = GroupReplay(group, anchor, followers, plan, tables, kernels, side)
    return UnionWidth(tokens=tokens, union_top_k=torch.full((capacity, width), -1, **i32),
                      union_out=union_out,
                      rows=torch.full((num_groups, capacity, tokens, top_k), -1, **i32),
                      kernels=kernels, replays=replays)


class DeviceBlock:
    """Named typed fields of one device byte block, refreshed in one host-to-device copy.

    Every field not given a value gets its padding; the views never move (graph capture).
    """

    def __init__(self, fields: list[tuple[str, torch.dtype, int, int]],
                 device: torch.device) -> None:
        self._fields: dict[str, tuple[torch.dtype, int, int]] = {}
        offset = 0
        for name, dtype, length, _ in fields:
            self._fields[name] = (dtype, offset, length)
            offset += -(-length * dtype.itemsize // _ALIGN) * _ALIGN
        self._block = torch.zeros(offset, dtype=torch.uint8, device=device)
        self._template = np.zeros(offset, dtype=np.uint8)
        self._whole: dict[str, torch.Tensor] = {}
        for name, _, _, padding in fields:
            self._host_view(self._template, name)[:] = padding

    def field(self, name: str, count: int | None = None) -> torch.Tensor:
        """The device view of a field (its first `count` entries). A whole field is the same
        tensor every call: a launch bound to it (the backup's) is replayed, not bound again."""
        if count is None:
            whole = self._whole.get(name)
            if whole is None:
                whole = self._whole[name] = self.field(name, self._fields[name][2])
            return whole
        dtype, offset, _ = self._fields[name]
        return self._block[offset : offset + count * dtype.itemsize].view(dtype)

    def upload(self, values: dict[str, Any]) -> None:
        host = self._template.copy()
        for name, value in values.items():
            array = np.asarray(value)
            self._host_view(host, name)[: array.size] = array.reshape(-1)
        self._block.copy_(torch.from_numpy(host), non_blocking=True)

    def _host_view(self, host: np.ndarray, name: str) -> np.ndarray:
        dtype, offset, length = self._fields[name]
        return host[offset : offset + length * dtype.itemsize].view(_NUMPY[dtype])
