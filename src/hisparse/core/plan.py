"""The step plan: every choice of a decode step's path, made once, in one function.

`plan_step` takes what a step's path depends on (the batch size, S, `dedupe`, whether the
requests append 0..S rows each, the pool's role, the config, and what the bound swap-in
launchers can do, as frozen records) and returns a frozen, printable `StepPlan`;
`HiSparseCache.step_plan(batch_size, num_tokens)` shows it. The cache computes each plan once
per (batch size, S, dedupe, ragged) and the step reads its fields; one level down,
`kernels.swap_in.plan.LaunchPlan` holds the kernels' own launch choices.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from hisparse.errors import InvalidInputError
from hisparse.kernels.swap_in.plan import LauncherCapabilities


class PoolRole(enum.Enum):
    """Who writes the host rows a cache reads."""

    PRIVATE = "private"  # its own host pool: it writes every row
    WRITER = "shared, writer"  # a shared pool's writer rank: it writes every rank's rows
    READER = "shared, reader"  # a shared pool's other ranks: they only read the writer's


@dataclass(frozen=True)
class StepPlan:
    """The path of a decode step of `batch_size` requests and `num_tokens` tokens each."""

    batch_size: int
    num_tokens: int
    dedupe: bool
    # "every": each request appends `num_tokens` rows; "ragged": each appends 0..S rows
    # (`begin_decode_step(appends=...)`; S > 1 takes the union path): always planned and
    # uploaded, never a quiet advance.
    appends: str
    pool_role: PoolRole
    # S > 1 or dedupe: the top-k rows are swapped in as one de-duplicated union per request
    # (core/verify.py); else one row per request (core/step.py).
    union: bool
    # The union is de-duplicated inside the swap-in's own kernels (the Triton launcher);
    # else a union plan before the swap-in and a scatter after it (kernels/union_reference).
    fused_union: bool
    # A batch unchanged since the last single-token step moves on by one device launch
    # (core/batch.py QuietRun) instead of a planned upload.
    quiet_advance: bool
    # A reader waits, at the begin, until the writer's rows of every earlier operation are
    # complete (every path reads host rows the steps before wrote).
    wait_for_writer: bool
    # The writer waits, at the begin, until every reader is done with rows freed since it
    # last waited: its lookups write host rows before the step's end waits for that.
    wait_for_readers_at_begin: bool
    # Whether this rank writes host rows at all (a reader leaves them to the writer).
    writes_host_rows: bool
    # `swap_in(layer, top_k, newest_kv=)` writes the new rows inside the lookup's launch.
    fold_newest: bool
    # ... and backs them up to their host rows there: the end copies only the other layers.
    backup_in_lookup: bool
    # Where the end's host-row copies run: "side stream", "compute stream" or "none".
    backup: str
    # Where an index group's followers replay the anchor's misses: "side stream", "inline"
    # or "none" (every layer runs its own indexer).
    follower_replay: str
    # The kernels bound and how their launches reach the device (the backend's KernelSet:
    # Triton with direct launches, Triton through its dispatch, or the torch reference).
    kernels: str

    def __str__(self) -> str:
        rows = [(name, getattr(self, name)) for name in self.__dataclass_fields__]
        width = max(len(name) for name, _ in rows)
        return "StepPlan\n" + "\n".join(
            f"  {name:<{width}}  {value.value if isinstance(value, PoolRole) else value}"
            for name, value in rows)


def plan_step(batch_size: int, num_tokens: int, dedupe: bool, role: PoolRole,
              single: LauncherCapabilities, union: LauncherCapabilities | None,
              *, ragged: bool = False, advance: bool, async_backup: bool, shares_index: bool,
              side_stream_replay: bool, kernels: str) -> StepPlan:
    """The plan of one step. `single` / `union`: what the single-token launcher and the
    verify width's launcher (None: not built, S = 1 without dedupe) can do; `ragged`: the
    requests append 0..S rows each (no dedupe); `advance`: the
    backend binds a batch advance; `async_backup`: the backup has a side stream;
    `shares_index`: some index group has followers; `side_stream_replay`: they replay on the
    prefetch stream; `kernels`: the bound kernels' implementation."""
    is_union = num_tokens > 1 or dedupe
    caps = union if is_union and union is not None else single
    writes = role is not PoolRole.READER
    fold = caps.writes_newest and not is_union
    lookup_backup = fold and caps.backs_up_newest and writes
    return StepPlan(
        batch_size=batch_size, num_tokens=num_tokens, dedupe=dedupe,
        appends="ragged" if ragged else "every", pool_role=role,
        union=is_union, fused_union=is_union and caps.fuses_union,
        quiet_advance=advance and not is_union and not ragged,
        wait_for_writer=role is PoolRole.READER,
        wait_for_readers_at_begin=lookup_backup and role is PoolRole.WRITER,
        writes_host_rows=writes, fold_newest=fold, backup_in_lookup=lookup_backup,
        backup=("none" if not writes else "side stream" if async_backup else "compute stream"),
        follower_replay=("none" if not shares_index else
                         "side stream" if side_stream_replay else "inline"),
        kernels=kernels,
    )


class StepPlanner:
    """A cache's plans, each computed once per (batch size, S, dedupe, ragged) from its decode
    context (`core.step.DecodeContext`), its verify context and its pool's role."""

    def __init__(self, shared: Any | None, decode: Any, verify: Any) -> None:
        self.role = (PoolRole.PRIVATE if shared is None else
                     PoolRole.WRITER if shared.is_writer else PoolRole.READER)
        self._decode, self._verify = decode, verify
        self._plans: dict[tuple[int, int, bool, bool], StepPlan] = {}
        # The single-token plans by batch size (most steps'): read without a key.
        self._single: list[StepPlan | None] = [None] * (decode.batch_capacity + 1)

    def checked_plan(self, batch_size: object, num_tokens: int, dedupe: bool,
                     appends: object = "every") -> StepPlan:
        """`plan` for a caller's batch size, refused unless it is one a step can take."""
        capacity = self._decode.batch_capacity
        if type(batch_size) is not int or not 1 <= batch_size <= capacity:
            raise InvalidInputError(
                f"batch_size must be an int in 1..{capacity} (max_batch), got {batch_size!r}; "
                "pass the number of requests the step decodes")
        if appends not in ("every", "ragged") or type(appends) is not str:
            raise InvalidInputError(
                f"appends must be 'every' or 'ragged', got {appends!r}; pass 'ragged' for a "
                "step whose requests append 0..num_tokens rows each")
        ragged = appends == "ragged"
        if ragged and dedupe:
            raise InvalidInputError(
                f"a ragged step takes no dedupe, got dedupe={dedupe}; pass dedupe=False "
                "with appends='ragged'")
        return self.plan(batch_size, num_tokens, dedupe, ragged)

    def plan(self, batch_size: int, num_tokens: int, dedupe: bool, ragged: bool = False
             ) -> StepPlan:
        usual = num_tokens == 1 and not (dedupe or ragged)  # a single-token step: a list index
        if usual:
            found = self._single[batch_size]
            if found is not None:
                return found
        key = (batch_size, num_tokens, dedupe, ragged)
        found = self._plans.get(key)
        if found is not None:
            return found
        d = self._decode
        union = (self._verify.width(d, num_tokens).kernels.capabilities
                 if num_tokens > 1 or dedupe else None)
        made = self._plans[key] = plan_step(
            batch_size, num_tokens, dedupe, self.role, d.kernels.capabilities, union,
            ragged=ragged, advance=d.kernels.can_advance,
            async_backup=d.order.backup.stream is not None,
            shares_index=any(replay is not None for replay in d.replays),
            side_stream_replay=d.prefetch_stream is not None,
            kernels=d.kernels.implementation)
        if usual:
            self._single[batch_size] = made
        return made
