"""The CPU backend with the GPU backends' Triton kernels, run under TRITON_INTERPRET=1.

`InterpretedTritonCpu()` is what the CUDA backend binds (the bound `SwapInLauncher`, its
replays and the Triton backup), on CPU tensors: the engine paths that only a GPU takes (a
launcher per verify width U = S x K that de-duplicates the union in its own kernels,
draft-slot backups, sharing through the fused kernels) can then be checked here at small sizes
before a GPU run. Import it before anything else from `hisparse.kernels` (it imports
`interpreted_kernels`, which sets the interpreter).
"""

from __future__ import annotations

from typing import Any

import torch

from hisparse.backends.base import BackupFn, CopyPlannedFn, SwapInFn
from hisparse.backends.cpu import CpuBackend
from interpreted_kernels import ON_GPU, advance_triton, backup_triton, swap_in_triton


class InterpretedTritonCpu(CpuBackend):
    """CpuBackend whose kernels are the Triton ones (interpreted), bound as on a GPU."""

    name = "cpu-triton-interpreted"

    def unavailable_reason(self) -> str | None:
        # On a GPU the module-level reload did not happen (the kernels are compiled for it):
        # the CUDA backend runs them there.
        return "a GPU is visible: its own backend runs the Triton kernels" if ON_GPU else None

    def swap_in_kernel(self) -> SwapInFn:
        return swap_in_triton.swap_in_triton

    def copy_planned_kernel(self) -> CopyPlannedFn:
        return swap_in_triton.copy_planned_triton

    def backup_kernel(self) -> BackupFn:
        return backup_triton.backup_newest_triton

    def swap_in_launcher(self, tables: Any, req_slots: torch.Tensor, num_real: torch.Tensor,
                         out: torch.Tensor, *, plans: Any = None, skip_io: bool = False,
                         newest_rows: torch.Tensor | None = None,
                         newest_host_rows: torch.Tensor | None = None, union: Any = None) -> Any:
        return swap_in_triton.SwapInLauncher(
            tables, req_slots, num_real, out, traits=self.kernel_traits(tables.last_use.device),
            plans=plans, skip_io=skip_io, newest_rows=newest_rows,
            newest_host_rows=newest_host_rows, union=union)

    def batch_advance(self, batch_slots: torch.Tensor, num_real: torch.Tensor,
                      newest_host_rows: torch.Tensor, new_seq_lens: torch.Tensor,
                      seq_lens: torch.Tensor) -> Any:
        return advance_triton.AdvanceTriton(batch_slots, num_real, newest_host_rows,
                                            new_seq_lens, seq_lens, direct=False)
