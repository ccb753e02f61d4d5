"""Every kernel the decode path launches, bound once from the backend.

This is the one place that knows the kernels' interfaces, so that they can be re-pointed
without touching the step: the backend's swap-in launcher (`backend.kernels.swap_in_launcher`: its
`swap_in(layer, group, rows, top_k)` and `replay(layer, group, rows)`, bound to the tables,
the batch buffers and the groups' miss plans once), `backup(tables, newest_rows,
host_rows, num_real)` and `write_newest(layer, rows)` (`kernels.newest_writer`, bound to the
batch buffers' newest rows) (`hisparse.backends.base`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hisparse.backends.base import Backend, BackupFn
from hisparse.errors import HisparseError, RequestStateError
from hisparse.kernels.swap_in.plan import LauncherCapabilities
from hisparse.layout.tables import CacheTables, DraftUnion, MissPlan, word_rows


class DecodeKernels:
    """The swap-in, replay and backup kernels, and why a launch of theirs failed, if one did.

    hisparse's own errors are raised before any launch. Anything else may have left one
    kernel of a call queued and the next not: the device tables may then name rows that were
    never copied (a plan installed, its rows never moved), so no later step can trust them.
    `failure` keeps the reason and every decode call but a cancel refuses from then on.
    """

    def __init__(self, backend: Backend, skip_io: bool, tables: CacheTables,
                 req_slots: torch.Tensor, num_real: torch.Tensor, out: torch.Tensor,
                 plans: Sequence[MissPlan | None],
                 newest_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                 advance: tuple[torch.Tensor, ...] | None = None,
                 swap_in_writes_newest: bool = True,
                 newest_host_rows: torch.Tensor | None = None,
                 union: DraftUnion | None = None) -> None:
        self.skip_io = skip_io  # a backend without the probe refused it in resolve_features
        kernels = backend.kernels
        self.implementation = kernels.implementation  # (the step plan prints it)
        # `swap_in_writes_newest`: one newest row per batch row, which the swap-in may write
        # itself (a verify width's S rows per request are the union's business: False), and
        # with `newest_host_rows` (a private host pool's) back them up as well.
        folds = swap_in_writes_newest and newest_rows is not None
        # `union` (a verify width's): the launcher may de-duplicate the flattened rows itself
        # (Triton's); `fuses_union` says whether it took them.
        self.launcher: Any = kernels.swap_in_launcher(
            tables, req_slots, num_real, out, plans=plans, skip_io=skip_io,
            newest_rows=newest_rows[0] if folds else None,
            newest_host_rows=newest_host_rows if folds else None, union=union)
        # What the launcher can do beyond the swap-in (the step plan reads this record).
        self.capabilities: LauncherCapabilities = self.launcher.capabilities
        self.fuses_union = self.capabilities.fuses_union
        self._swap_in_writes_newest = self.capabilities.writes_newest
        self._swap_in_backs_up_newest = self.capabilities.backs_up_newest
        # The GPU backends bind the fused kernel; `Backend` gives every other the reference.
        self.backup: BackupFn = kernels.backup_launcher()
        # `write_newest(layer, rows)`: the new tokens' rows into the batch's newest device rows
        # (int32 rows and their int64 twin); a torch op, so a failure leaves the tables alone.
        # None for a launcher that writes no newest rows (a verify step's union widths).
        self.write_newest = (kernels.newest_writer(tables.device_kv, *newest_rows)
                             if newest_rows is not None else None)
        # A quiet step's `advance(rows)` of the batch buffers `(batch_slots, num_real,
        # newest_host_rows, new_seq_lens)` and the tables' lengths (core.batch.QuietRun).
        self._advance = (kernels.batch_advance(*advance, tables.seq_lens)
                         if advance is not None else None)
        self.failure: str | None = None

    def launch_swap_in(self, layer: int, group: int, rows: int, top_k: torch.Tensor,
                       newest_kv: torch.Tensor | None = None) -> bool:
        """Swap in `layer` for the first `rows` batch rows of the batch buffers; `top_k` is
        the caller's `[rows, K]` tensor, read in place (no copy). `newest_kv`: the layer's
        new rows (checked `[B, W]` uint8), written first: inside the swap-in's own lookup
        launch where the launcher can and the rows are `[rows, W]` words, else by
        `write_newest`. Returns whether the lookup also wrote them to their host rows (the
        step's backup then need not copy this layer)."""
        try:  # (a try costs nothing until it catches; a context manager would, per layer)
            if newest_kv is None:
                self.launcher.swap_in(layer, group, rows, top_k)
            elif (self._swap_in_writes_newest and newest_kv.shape[0] == rows
                  and word_rows(newest_kv)):
                self.launcher.swap_in(layer, group, rows, top_k, newest_kv)
                return self._swap_in_backs_up_newest
            else:
                self.write_newest(layer, newest_kv)
                self.launcher.swap_in(layer, group, rows, top_k)
        except BaseException as exc:
            self._failed(f"swap_in({layer})", exc)
            raise
        return False

    @property
    def can_advance(self) -> bool:
        """Whether a quiet step's batch can move on by `launch_advance`."""
        return self._advance is not None

    def launch_advance(self, rows: int) -> None:
        """Move the first `rows` batch rows and their lengths on by one token, on the device."""
        assert self._advance is not None
        try:
            self._advance(rows)
        except BaseException as exc:
            self._failed("the batch advance", exc)
            raise

    def launch_replay(self, layer: int, group: int, rows: int) -> None:
        """Copy the group's recorded misses of its last `rows`-row call on `layer` (nothing
        to copy for the skip-IO probe)."""
        if self.skip_io:
            return
        try:
            self.launcher.replay(layer, group, rows)
        except BaseException as exc:
            self._failed(f"the replay of layer {layer}", exc)
            raise

    def launch_backup(self, tables: CacheTables, newest_rows: torch.Tensor,
                      host_rows: torch.Tensor, num_real: torch.Tensor) -> None:
        try:
            self.backup(tables, newest_rows, host_rows, num_real)
        except BaseException as exc:
            self._failed("the newest-token backup", exc)
            raise

    def check_usable(self, action: str) -> None:
        if self.failure is not None:
            raise RequestStateError(
                f"cannot {action}: {self.failure}. This cache's device tables may no "
                "longer match its device rows, so it decodes no more; finish or abort its "
                "requests (their host KV is intact), close it and build a new cache"
            )

    def _failed(self, what: str, exc: BaseException) -> None:
        if not isinstance(exc, HisparseError):
            self.failure = f"{what} failed with {type(exc).__name__}: {exc}"
