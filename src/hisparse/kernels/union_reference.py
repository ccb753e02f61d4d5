"""The verify step's union plan and scatter in plain torch ops: the reference path.

A verify step's `[B, S, K]` top-k is swapped in as one de-duplicated `[B, U]` row per request
(U = S * K; `core.union`). Around the ordinary swap-in two calls do the rest:
* `union_plan_reference` writes each request's distinct older positions (before the step's
  first token), in first-occurrence order (by the index s * K + k of the first entry that
  selects each), then -1, into the union row, and the inverse code of every entry;
* `union_scatter_reference`, after the swap-in, writes `[B, S, K]` rows back from the union's
  rows (or the draft slots) and adds what the swap-in did not count to the layer's counters.

The inverse code of an entry (int32): 0..U-1 its union column; U nothing (-1, padding rows
included); U + 1 an invalid entry (-1, counted as invalid); -2 - d the step's own token d
(0 <= d < S), served from draft slot d. Both calls are torch ops with no host sync, so a
captured graph replays them: production on the CPU backend and wherever triton is missing,
and the oracle of the Triton swap-in, which de-duplicates the same rows in its own kernels
(`layout.tables.DraftUnion`, tests/test_swap_in_union.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Sorts after every real position (positions are < 2**31).
_ABSENT = 2**62
# An empty entry of the Triton plan's presence table: above every entry index, so the
# table's atomic minimum keeps each position's first entry.
SENTINEL = 2**31 - 1


@dataclass(frozen=True)
class Union:
    """One `[B, S, K]` top-k, reduced: see `build_union`."""

    positions: torch.Tensor  # [B, U] int64 distinct older positions, by first entry, then -1
    inverse: torch.Tensor  # [B, S*K] int64 union column of each entry; U = not in the union
    draft: torch.Tensor  # [B, S, K] bool: the entry selects one of the step's own tokens
    invalid: torch.Tensor  # [B, S, K] bool: below -1, or after the query token's own position


def build_union(top_k: torch.Tensor, first: torch.Tensor, real: torch.Tensor,
                last_visible: torch.Tensor | None = None) -> Union:
    """Reduce `top_k [B, S, K]` to each request's distinct positions before `first [B]`.

    Query token s of row b is at position `first[b] + s` and may select any position up to
    its own, or, where `last_visible [B]` is not -1 (a ragged step), up to that; rows where
    `real [B]` is False (padding) select nothing.
    """
    B, S, K = top_k.shape
    U = S * K
    pos = top_k.long()
    own = first[:, None, None] + torch.arange(S, device=pos.device)[None, :, None]
    if last_visible is not None:
        last = last_visible[:, None, None]
        own = torch.where(last >= 0, last, own)
    real = real[:, None, None]
    selected = real & (pos >= 0) & (pos <= own)
    older = selected & (pos < first[:, None, None])
    flat = torch.where(older, pos, _ABSENT).reshape(B, U)
    ordered, order = flat.sort(dim=1, stable=True)
    present = ordered < _ABSENT
    distinct = present.clone()
    distinct[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    rank = distinct.long().cumsum(1) - 1  # ascending rank of each run of equal positions
    # Stable: a run's first sorted element is its first entry. The columns follow those
    # entries (the kernel's first-occurrence order): sort the runs by them.
    first_entry = torch.full((B, U + 1), U, dtype=torch.long, device=pos.device)
    first_entry.scatter_(1, torch.where(distinct, rank, U), torch.where(distinct, order, U))
    by_entry = first_entry[:, :U].sort(dim=1).indices  # column j holds run by_entry[j]
    column_of_run = torch.empty_like(by_entry).scatter_(
        1, by_entry, torch.arange(U, device=pos.device).expand(B, U).contiguous())
    column = column_of_run.gather(1, rank.clamp(min=0))  # duplicates share their first's
    # Column U collects what is not written anywhere; it is dropped.
    positions = torch.full((B, U + 1), -1, dtype=torch.long, device=pos.device)
    positions.scatter_(1, torch.where(distinct, column, U), torch.where(distinct, ordered, -1))
    inverse = torch.empty_like(order).scatter_(1, order, torch.where(present, column, U))
    return Union(positions=positions[:, :U], inverse=inverse, draft=selected & ~older,
                 invalid=real & ((pos < -1) | (pos > own)))


def presence_table(rows: int, positions: int, device: torch.device | str) -> torch.Tensor:
    """The Triton swap-in's `[rows, positions]` int32 scratch for verify rows, all SENTINEL
    (between calls too): rows = the batch capacity, positions = every position a request's
    page table can map (the larger of max_seq_len + D and P x E). 4 bytes an entry, about
    max_batch x (max_seq_len + D) x 4 bytes in all (32 MiB at 64 x 128k), made once per cache
    at its first verify step and shared by every S."""
    return torch.full((rows, positions), SENTINEL, dtype=torch.int32, device=device)


def union_plan_reference(
    top_k: torch.Tensor,  # [R, S, K] int32 positions, -1 = none
    first: torch.Tensor,  # [>= R] int64 position of each request's first token of the step
    num_real: torch.Tensor,  # [1] int32 device scalar: rows >= num_real are padding
    union_top_k: torch.Tensor,  # [>= R, U] int32 out: the union rows the swap-in reads
    inverse: torch.Tensor,  # [>= R, U] int32 out: each entry's code (module docstring)
    last_visible: torch.Tensor | None = None,  # [>= R] int64 (build_union; None: all -1)
) -> None:
    """Write the first R union rows and inverse codes of `top_k`."""
    rows, S, K = top_k.shape
    U = S * K
    start = first[:rows]
    real = torch.arange(rows, device=top_k.device) < num_real.long()
    union = build_union(top_k, start, real,
                        None if last_visible is None else last_visible[:rows])
    union_top_k[:rows].copy_(union.positions)
    code = torch.where(union.invalid, U + 1, union.inverse.view(rows, S, K))
    code = torch.where(union.draft, -2 - (top_k.long() - start[:, None, None]), code)
    inverse[:rows].copy_(code.view(rows, U))


def union_scatter_reference(
    inverse: torch.Tensor,  # [>= R, U] int32 codes from `union_plan_reference`
    union_rows: torch.Tensor,  # [R, U] int32 the swap-in's device rows of the union row
    draft_base: torch.Tensor,  # [>= R] int64 device row of each request's draft slot 0
    out: torch.Tensor,  # [R, S, K] int32 out: the device row of every entry, -1 = none
    counters: torch.Tensor,  # [3] int64 the layer's (hits, misses, invalid) counters
    request_counters: torch.Tensor | None = None,  # [R, 2] int64 hits and misses per slot
    req_slots: torch.Tensor | None = None,  # [>= rows] int32 request slot per batch row
    num_real: torch.Tensor | None = None,  # [1] int32: rows >= num_real are padding
) -> None:
    """Write `out` from the union's rows and the draft slots; count each distinct draft
    position a request selected as one hit (as the newest token is in a single-token step),
    in the layer's counters and its request's, and every invalid entry as one invalid
    entry."""
    rows, S, K = out.shape
    U = S * K
    code = inverse[:rows].long()
    column = torch.where((code >= 0) & (code < U), code, U)
    padded = torch.cat([union_rows.long(), union_rows.new_full((rows, 1), -1).long()], dim=1)
    draft = code <= -2
    token = torch.where(draft, -2 - code, S)
    drafts = draft_base[:rows, None] + token
    out.copy_(torch.where(draft, drafts, padded.gather(1, column)).view(rows, S, K))
    used = torch.zeros(rows, S + 1, dtype=torch.bool, device=out.device)
    used.scatter_(1, token, True)
    draft_hits = used[:, :S].sum(1)
    counters[0] += draft_hits.sum()
    counters[2] += (code == U + 1).sum()
    if request_counters is not None:
        real = torch.arange(rows, device=out.device) < num_real.long()
        request_counters[:, 0].index_add_(0, req_slots[:rows][real].long(), draft_hits[real])


class ReferenceUnionLauncher:
    """A verify width's union plan and scatter over the torch reference: bound once to a
    union width's persistent buffers (graph capture holds their addresses)."""

    def __init__(self, tokens: int, top_k: int, first: torch.Tensor, draft_base: torch.Tensor,
                 num_real: torch.Tensor, union_top_k: torch.Tensor, union_out: torch.Tensor,
                 rows: torch.Tensor, counters: torch.Tensor,
                 request_counts: tuple[torch.Tensor | None, torch.Tensor] | None = None,
                 last_visible: torch.Tensor | None = None) -> None:
        self.tokens, self.top_k = tokens, top_k
        self._last_visible = last_visible
        self._request_counters, self._req_slots = request_counts or (None, None)
        self._first, self._draft_base, self._num_real = first, draft_base, num_real
        self._union_top_k, self._union_out, self._rows = union_top_k, union_out, rows
        self._counters = counters
        self.inverse = torch.full_like(union_top_k, tokens * top_k)

    def plan(self, rows: int, top_k: torch.Tensor) -> None:
        """The union rows and inverse codes of `top_k [rows, S, K]` (`[rows, K]` when S = 1)."""
        union_plan_reference(top_k.view(rows, self.tokens, self.top_k), self._first,
                             self._num_real, self._union_top_k, self.inverse,
                             self._last_visible)

    def scatter(self, layer: int, group: int, rows: int) -> None:
        """`rows[group][:rows]` from the union's rows of `group`; `layer`'s counters."""
        union_scatter_reference(self.inverse, self._union_out[group][:rows], self._draft_base,
                                self._rows[group][:rows], self._counters[layer],
                                self._request_counters, self._req_slots, self._num_real)
