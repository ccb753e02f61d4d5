"""The kernel bindings every backend starts from: the torch references.

`Backend` inherits them and the GPU backends (`backends/_accelerator.py`) override each with
its Triton launcher, so the engine asks one object for every kernel it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hisparse.kernels.backup_reference import backup_newest_reference

# swap_in(tables, layer, group, req_slots, top_k, num_real, out, plan=None, skip_io=False)
SwapInFn = Callable[..., None]
# copy_planned(tables, layer, plan)
CopyPlannedFn = Callable[..., None]
# backup(tables, newest_rows, host_rows, num_real)
BackupFn = Callable[..., None]


class ReferenceKernelBindings:
    """The launchers and kernels of the torch reference (a mixin of `Backend`)."""

    swap_in_kernel: Callable[[], SwapInFn]
    copy_planned_kernel: Callable[[], CopyPlannedFn]

    def swap_in_launcher(self, tables: Any, req_slots: torch.Tensor, num_real: torch.Tensor,
                         out: torch.Tensor, *, plans: Any = None, skip_io: bool = False,
                         newest_rows: torch.Tensor | None = None,
                         newest_host_rows: torch.Tensor | None = None, union: Any = None) -> Any:
        """The engine's swap-in over its tables and batch buffers: the torch reference here;
        the GPU backends bind the Triton launcher (which also writes a layer's new rows into
        `newest_rows`' device rows, and backs them up to `newest_host_rows`, when a call hands
        them over, and with `union` de-duplicates a verify width's flattened rows itself: here
        the union plan and scatter do that around the swap-in, so `union` is not taken)."""
        from hisparse.kernels.swap_in.reference import ReferenceSwapInLauncher

        return ReferenceSwapInLauncher(tables, req_slots, num_real, out,
                                       plans=plans, skip_io=skip_io,
                                       swap_in=self.swap_in_kernel(),
                                       copy_planned=self.copy_planned_kernel())

    def union_launcher(self, tokens: int, top_k: int, first: torch.Tensor,
                       draft_base: torch.Tensor, num_real: torch.Tensor,
                       union_top_k: torch.Tensor, union_out: torch.Tensor, rows: torch.Tensor,
                       counters: torch.Tensor,
                       request_counts: tuple[torch.Tensor | None, torch.Tensor] | None = None
                       ) -> Any:
        """A verify width's union plan and scatter (`kernels.union_reference`), for a
        swap-in launcher that does not de-duplicate the rows itself (the Triton one does).
        `request_counts`: the tables' per-request counters and the batch's request slots,
        which the scatter's draft hits are added to as well."""
        from hisparse.kernels.union_reference import ReferenceUnionLauncher

        return ReferenceUnionLauncher(tokens, top_k, first, draft_base, num_real, union_top_k,
                                      union_out, rows, counters, request_counts)

    def backup_kernel(self) -> BackupFn:
        """The copy of every layer's newest rows back to the host at the end of a step."""
        return backup_newest_reference

    def newest_writer(self, device_kv: torch.Tensor, newest_rows: torch.Tensor,
                      newest_rows_long: torch.Tensor) -> Callable[[int, torch.Tensor], None]:
        """`write_newest`'s copy, `writer(layer, rows [B, W] uint8)`, bound to the batch
        buffers' device rows (`newest_rows` int32, its int64 twin): an `index_copy_` here; the
        GPU backends bind a Triton launch."""
        from hisparse.kernels.newest_reference import NewestWriterReference

        return NewestWriterReference(device_kv, newest_rows, newest_rows_long)

    def batch_advance(self, batch_slots: torch.Tensor, num_real: torch.Tensor,
                      newest_host_rows: torch.Tensor, new_seq_lens: torch.Tensor,
                      seq_lens: torch.Tensor) -> Callable[[int], None]:
        """A quiet step's `advance(rows)` of the batch buffers and the tables' lengths
        (`kernels.advance_reference`): three torch ops here; the GPU backends bind a Triton
        launch."""
        from hisparse.kernels.advance_reference import AdvanceReference

        return AdvanceReference(batch_slots, num_real, newest_host_rows, new_seq_lens,
                                seq_lens)
