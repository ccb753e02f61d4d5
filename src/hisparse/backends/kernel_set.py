"""The kernels a backend runs, as one frozen record (`Backend.kernels`), and the torch
references every backend starts from (the GPU backends replace them with Triton launchers in
`backends/_accelerator.py`), so the engine asks one object for every kernel it binds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hisparse.kernels.advance_reference import AdvanceReference
from hisparse.kernels.backup_reference import backup_newest_reference
from hisparse.kernels.newest_reference import NewestWriterReference
from hisparse.kernels.swap_in.reference import (
    ReferenceSwapInLauncher,
    copy_planned_reference,
    swap_in_reference,
)
from hisparse.kernels.union_reference import ReferenceUnionLauncher

# swap_in(tables, layer, group, req_slots, top_k, num_real, out, plan=None, skip_io=False)
SwapInFn = Callable[..., None]
# copy_planned(tables, layer, plan)
CopyPlannedFn = Callable[..., None]
# backup(tables, newest_rows, host_rows, num_real)
BackupFn = Callable[..., None]


@dataclass(frozen=True)
class KernelSet:
    """Two kernels called as they are, and the factories that bind a launcher to one cache's
    tensors once (each returns the launcher the decode path calls every step)."""

    # One layer's swap-in and the copy-only replay of a miss plan (tools and tests call them).
    swap_in: SwapInFn
    copy_planned: CopyPlannedFn
    # `()` -> backup(tables, newest_rows, host_rows, num_real): every layer's newest rows back
    # to the host at a step's end; one per cache (a GPU launcher binds to its buffers).
    backup_launcher: Callable[[], BackupFn]
    # `(tables, req_slots, num_real, out, *, plans, skip_io, newest_rows, newest_host_rows,
    # union)` -> an object with `swap_in(layer, group, rows, top_k[, newest_kv])`,
    # `replay(layer, group, rows)` and `capabilities` (a LauncherCapabilities). The Triton one
    # also writes a layer's new rows into `newest_rows` (and backs them up to
    # `newest_host_rows`) and, given `union`, de-duplicates a verify width's rows itself.
    swap_in_launcher: Callable[..., Any]
    # `(tokens, top_k, first, draft_base, num_real, union_top_k, union_out, rows, counters,
    # request_counts=, last_visible=)` -> a verify width's union `plan(rows, top_k)` and
    # `scatter(layer, group, rows)`, for a swap-in launcher that does not de-duplicate.
    union_launcher: Callable[..., Any]
    # `(device_kv, newest_rows, newest_rows_long)` -> `write_newest`'s `writer(layer, rows)`.
    newest_writer: Callable[..., Any]
    # `(batch_slots, num_real, newest_host_rows, new_seq_lens, seq_lens)` -> a quiet step's
    # `advance(rows)` of the batch buffers and the tables' lengths.
    batch_advance: Callable[..., Any]
    # Which kernels these are and how their launches reach the device, as the step plan
    # prints it (`StepPlan.kernels`).
    implementation: str = "torch reference"


def reference_kernels(swap_in: SwapInFn = swap_in_reference,
                      copy_planned: CopyPlannedFn = copy_planned_reference,
                      backup: BackupFn = backup_newest_reference) -> KernelSet:
    """The torch references, with the swap-in launcher running `swap_in` and `copy_planned`
    (a backend or a test fake may hand its own in)."""

    def swap_in_launcher(tables: Any, req_slots: torch.Tensor, num_real: torch.Tensor,
                         out: torch.Tensor, *, plans: Any = None, skip_io: bool = False,
                         newest_rows: torch.Tensor | None = None,
                         newest_host_rows: torch.Tensor | None = None,
                         union: Any = None) -> ReferenceSwapInLauncher:
        # The reference writes no newest rows and takes no union: the step's newest writer
        # and the union plan and scatter do that around it (its capabilities say so).
        return ReferenceSwapInLauncher(tables, req_slots, num_real, out, plans=plans,
                                       skip_io=skip_io, swap_in=swap_in,
                                       copy_planned=copy_planned)

    return KernelSet(swap_in=swap_in, copy_planned=copy_planned,
                     backup_launcher=lambda: backup,
                     swap_in_launcher=swap_in_launcher,
                     union_launcher=ReferenceUnionLauncher,
                     newest_writer=NewestWriterReference,
                     batch_advance=AdvanceReference)
