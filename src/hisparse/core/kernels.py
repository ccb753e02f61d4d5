"""Every kernel the decode path launches, bound once from the backend.

This is the one place that knows the kernels' signatures, so that they can be re-pointed
without touching the step: `swap_in(tables, layer, group, req_slots, top_k, num_real, out,
plan=, skip_io=)`, `copy_planned(tables, layer, plan)` and `backup(tables, newest_rows,
host_rows, num_real)` (`hisparse.backends.base`).
"""

from __future__ import annotations

import torch

from hisparse.backends.base import Backend, BackupFn, CopyPlannedFn, SwapInFn
from hisparse.core.tables import CacheTables, MissPlan
from hisparse.errors import HisparseError, RequestStateError
from hisparse.kernels.swap_in_reference import backup_newest_reference


class DecodeKernels:
    """The swap-in, replay and backup kernels, and why a launch of theirs failed, if one did.

    hisparse's own errors are raised before any launch. Anything else may have left one
    kernel of a call queued and the next not: the device tables may then name rows that were
    never copied (a plan installed, its rows never moved), so no later step can trust them.
    `failure` keeps the reason and every decode call but a cancel refuses from then on.
    """

    def __init__(self, backend: Backend, skip_io: bool, zero_copy: bool) -> None:
        self.skip_io = skip_io
        self.swap_in: SwapInFn = (
            backend.skip_io_swap_in_kernel() if skip_io
            else backend.zero_copy_swap_in_kernel() if zero_copy
            else backend.swap_in_kernel()
        )
        self.copy_planned: CopyPlannedFn = backend.copy_planned_kernel()
        # Fused backup kernels come with the GPU path; every backend has the reference.
        backup_kernel = getattr(backend, "backup_kernel", None)
        self.backup: BackupFn = backup_kernel() if backup_kernel else backup_newest_reference
        self.failure: str | None = None

    def launch_swap_in(self, tables: CacheTables, layer: int, group: int,
                       req_slots: torch.Tensor, top_k: torch.Tensor, num_real: torch.Tensor,
                       out: torch.Tensor, plan: MissPlan | None) -> None:
        try:  # (a try costs nothing until it catches; a context manager would, per layer)
            self.swap_in(tables, layer, group, req_slots, top_k, num_real, out, plan=plan,
                         skip_io=self.skip_io)
        except BaseException as exc:
            self._failed(f"swap_in({layer})", exc)
            raise

    def launch_replay(self, tables: CacheTables, layer: int, plan: MissPlan) -> None:
        """Copy the plan's misses on `layer` (nothing to copy for the skip-IO probe)."""
        if self.skip_io:
            return
        try:
            self.copy_planned(tables, layer, plan)
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
