"""The CPU backend with the GPU backends' Triton kernels, run under TRITON_INTERPRET=1.

`InterpretedTritonCpu()` is what the CUDA backend binds (the bound `SwapInLauncher`, its
replays and the Triton backup), on CPU tensors: the engine paths that only a GPU takes (a
launcher per verify width U = S x K that de-duplicates the union in its own kernels,
draft-slot backups, sharing through the fused kernels) can then be checked here at small sizes
before a GPU run. Import it before anything else from `hisparse.kernels` (it imports
`interpreted_kernels`, which sets the interpreter).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from hisparse.backends.base import KernelSet
from hisparse.backends.cpu import CpuBackend
from hisparse.backends.kernel_set import reference_kernels
from interpreted_kernels import ON_GPU, advance_triton, backup_triton, swap_in_triton


class InterpretedTritonCpu(CpuBackend):
    """CpuBackend whose kernels are the Triton ones (interpreted), bound as on a GPU."""

    name = "cpu-triton-interpreted"

    def unavailable_reason(self) -> str | None:
        # On a GPU the module-level reload did not happen (the kernels are compiled for it):
        # the CUDA backend runs them there.
        return "a GPU is visible: its own backend runs the Triton kernels" if ON_GPU else None

    @property
    def kernels(self) -> KernelSet:
        return dataclasses.replace(
            reference_kernels(swap_in_triton.swap_in_triton, swap_in_triton.copy_planned_triton,
                              backup_triton.backup_newest_triton),
            swap_in_launcher=self._swap_in_launcher,
            batch_advance=functools.partial(advance_triton.AdvanceTriton, direct=False))

    def _swap_in_launcher(self, tables: Any, *args: Any, **options: Any) -> Any:
        return swap_in_triton.SwapInLauncher(
            tables, *args, traits=self.kernel_traits(tables.last_use.device), **options)
