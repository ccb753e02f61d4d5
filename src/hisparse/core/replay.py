"""Index-group replay: an anchor layer plans a group's misses, its followers copy them.

Layers of one index group (an anchor layer that runs the model's indexer and the followers up
to the next one: `IndexSchedule`) share one indexer top-k and one residency table. The
anchor's `swap_in` runs the full swap-in (LRU, tables, its own copies) and records its misses
in a `MissPlan`; a follower replays only the plan's copies on its own layer and returns the
anchor's rows.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch

from hisparse.core.kernels import DecodeKernels
from hisparse.core.ordering import SideStreamReplay
from hisparse.errors import InvalidInputError, RequestStateError
from hisparse.layout.index_schedule import IndexSchedule
from hisparse.layout.tables import CacheTables, MissPlan


def miss_plans(schedule: IndexSchedule, capacity: int, width: int,
               device: torch.device) -> list[MissPlan | None]:
    """One miss plan per index group with followers; a group of one layer replays nothing."""
    return [MissPlan.empty(capacity, width, device) if schedule.followers_of(group) else None
            for group in range(schedule.num_groups)]


def group_replays(schedule: IndexSchedule, plans: list[MissPlan | None], tables: CacheTables,
                  kernels: Any, backend: Any, device: torch.device,
                  prefetch_stream: Any | None) -> list[GroupReplay | None]:
    """Per group, its `GroupReplay` (None for a group of one layer); followers replay on
    `prefetch_stream` where one is given, else inline."""
    replays: list[GroupReplay | None] = [None] * schedule.num_groups
    for group, plan in enumerate(plans):
        if plan is None:
            continue
        followers = schedule.followers_of(group)
        side = (SideStreamReplay(backend, device, prefetch_stream, followers)
                if prefetch_stream is not None else None)
        replays[group] = GroupReplay(group, followers.start - 1, followers, plan, tables,
                                     kernels, side)
    return replays


class GroupReplay:
    """One index group's anchor and followers, across the steps of a cache.

    Persistent (graph capture holds its addresses): the plan's storage. Per anchor call:
    `step` (the step it planned in), `rows`, `out` and the signature of the top-k tensor it
    got, which a follower passes again (that tensor, equal contents, or None). A follower
    looks up the same top-k in the same tables, so its hits, misses and invalid entries are
    its anchor's: one copy of the anchor's counters after each of its calls keeps every
    follower's (not an add per replay).

    Inline (no prefetch stream) a follower replays at its own `swap_in`; followers the caller
    skipped are `owed` and replay before the anchor plans again or the step ends. On the
    prefetch stream the anchor queues every follower's replay at once (`SideStreamReplay`
    orders them); a follower's `swap_in` waits for its own, and the step's end waits for the
    ones no `swap_in` waited for (`unwaited`).
    """

    def __init__(self, group: int, anchor: int, followers: range, plan: MissPlan,
                 tables: CacheTables, kernels: DecodeKernels,
                 side: SideStreamReplay | None) -> None:
        self.group = group
        self.anchor = anchor
        self.followers = followers
        self.plan = plan
        self._tables = tables
        self._kernels = kernels
        self._side = side
        self._anchor_counters = tables.counters[anchor]
        self._follower_counters = tables.counters[followers.start : followers.stop]
        # The last anchor call's; `step` is None once that step is over.
        self.step: object | None = None
        self.rows = 0
        self.out: torch.Tensor | None = None
        self._top_k: tuple[int, torch.Size, tuple[int, ...]] | None = None
        self.top_k: torch.Tensor | None = None
        self.owed: set[int] = set()
        self.unwaited: set[int] = set()

    # --- the anchor -----------------------------------------------------------------------
    def begin_plan(self) -> None:
        """Before the anchor's swap-in rewrites the plan: every replay of the last plan has
        run."""
        if self.owed:
            self.replay_owed()
        if self._side is not None:
            self._side.wait_for_all()

    def finish_plan(self, step: object, top_k: torch.Tensor, out: torch.Tensor) -> None:
        """After the anchor's swap-in: count it for the followers, remember what it got and
        issue their replays."""
        if self.followers:
            self._follower_counters.copy_(self._anchor_counters)
        self.step, self.rows, self.out = step, top_k.shape[0], out
        self._top_k = (top_k.data_ptr(), top_k.shape, top_k.stride())
        self.top_k = top_k  # what `validate` compares a follower's contents with
        if self._side is None:
            self.owed = set(self.followers)
        else:
            self.unwaited = set(self.followers)
            self._side.issue(self._replay)

    # --- a follower -----------------------------------------------------------------------
    def is_anchor_top_k(self, top_k: object) -> TypeGuard[torch.Tensor]:
        """`top_k` holds what the anchor swapped in: its own tensor (same address, shape and
        strides: free to check), or a tensor of equal contents, compared on the device (one
        host sync: a framework that makes a new tensor per layer pays it per follower; passing
        the anchor's tensor or None skips it)."""
        if not isinstance(top_k, torch.Tensor):
            return False
        if (top_k.data_ptr(), top_k.shape, top_k.stride()) == self._top_k:
            return True
        anchor = self.top_k
        return (anchor is not None and top_k.shape == anchor.shape
                and top_k.dtype == anchor.dtype and top_k.device == anchor.device
                and torch.equal(top_k, anchor))

    def ready_rows(self, layer: int) -> torch.Tensor:
        """The anchor's rows, once `layer` holds the plan's copies."""
        if self._side is not None:
            self._side.wait_for(layer)
            self.unwaited.discard(layer)
        elif layer in self.owed:
            self._replay(layer)
            self.owed.discard(layer)
        assert self.out is not None
        return self.out

    def not_anchored(self, layer: int) -> RequestStateError:
        return RequestStateError(
            f"layer {layer} shares the top-k of its anchor layer {self.anchor}, which has not "
            f"swapped in during this step; call swap_in({self.anchor}, top_k) first"
        )

    def other_top_k(self, layer: int, top_k: torch.Tensor) -> InvalidInputError:
        """The error for a follower handed a tensor that is not its anchor's."""
        layers = f"layers {self.anchor}..{self.followers[-1]} share one indexer"
        instead = (f"pass the anchor's top-k (that tensor or equal contents), or call "
                   f"swap_in({layer}) without one to get the anchor's rows")
        if top_k.shape[0] != self.rows:
            return InvalidInputError(
                f"layer {layer}'s top_k has {top_k.shape[0]} rows, its anchor layer "
                f"{self.anchor} swapped in {self.rows}; {layers}, so {instead}"
            )
        return InvalidInputError(
            f"layer {layer} got a top-k that differs from what its anchor layer "
            f"{self.anchor} swapped in; {layers} and return the anchor's rows, so {instead}. "
            "If the model runs an indexer at this layer, the cache's index schedule is not the "
            "model's: set index_anchors to the layers that run one"
        )

    def changed_top_k(self, layer: int) -> InvalidInputError:
        """The error for the anchor's tensor whose contents changed since its swap-in."""
        return InvalidInputError(
            f"layer {layer} got its anchor layer {self.anchor}'s top-k tensor, but its "
            f"contents differ from what layer {self.anchor} swapped in; layers "
            f"{self.anchor}..{self.followers[-1]} share one indexer, so leave the tensor "
            "unchanged until the group's last layer (or set index_anchors to the model's "
            "indexer layers)"
        )

    # --- the step's end -------------------------------------------------------------------
    def replay_owed(self) -> None:
        """Replay (inline) what no follower's swap_in replayed, so every layer of the group
        holds what the group's tables say."""
        owed, self.owed = self.owed, set()
        for layer in sorted(owed):
            self._replay(layer)

    def wait_unwaited(self) -> None:
        """The compute stream waits for side-stream replays no follower's swap_in waited for."""
        if self.unwaited and self._side is not None:
            self._side.wait_for_all()
        self.unwaited = set()

    def forget(self, step: object) -> None:
        """`step` is over: no follower of it may follow any more."""
        if self.step is step:
            self.step, self.out, self._top_k = None, None, None

    def _replay(self, layer: int) -> None:
        self._kernels.launch_replay(layer, self.group, self.rows)
