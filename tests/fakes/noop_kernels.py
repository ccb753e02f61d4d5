"""The CPU backend with kernels that do nothing: what is left of a call is the engine's Python.

On a GPU every kernel launch and torch op is asynchronous, so a call's host time is its Python
and its launch overhead. The plain CPU backend runs the torch reference kernels synchronously,
and their run time (a swap-in over [B, K], a 61-layer backup) hides the Python around them.
Here the swap-in, replay, union, backup, batch-advance and newest-token launchers return at
once, and streams and events are the CPU's (None, no-ops), so timing a call measures the
engine's own per-call work plus the few small torch ops it issues itself (the batch upload,
the table updates), which on a GPU are launches too. Rows and tables are left as they were:
for host-overhead benchmarks only, never for correctness
(`benchmarks/host_overhead.py --noop-kernels`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hisparse.backends.base import KernelSet
from hisparse.backends.cpu import CpuBackend
from hisparse.kernels.swap_in.plan import LauncherCapabilities


class _NoopSwapIn:
    """The swap-in launcher's interface (`swap_in`, `replay`), doing nothing; like Triton's,
    it takes a layer's new rows into its own call (and backs them up there, if given their
    host rows)."""

    def __init__(self, backs_up_newest: bool) -> None:
        self.capabilities = LauncherCapabilities(writes_newest=True,
                                                 backs_up_newest=backs_up_newest)

    def swap_in(self, layer: int, group: int, rows: int, top_k: torch.Tensor,
                newest_kv: torch.Tensor | None = None) -> None:
        pass

    def replay(self, layer: int, group: int, rows: int) -> None:
        pass


class _NoopUnion:
    """The verify union launcher's interface (`plan`, `scatter`), doing nothing."""

    def __init__(self, tokens: int, top_k: int) -> None:
        self.tokens, self.top_k = tokens, top_k

    def plan(self, rows: int, top_k: torch.Tensor) -> None:
        pass

    def scatter(self, layer: int, group: int, rows: int) -> None:
        pass


def _noop(*args: Any, **kwargs: Any) -> None:
    pass


class NoopKernelCpu(CpuBackend):
    name = "cpu-noop-kernels"

    @property
    def kernels(self) -> KernelSet:
        return dataclasses.replace(
            super().kernels,
            swap_in_launcher=lambda *args, newest_host_rows=None, **kwargs: _NoopSwapIn(
                newest_host_rows is not None),
            union_launcher=lambda tokens, top_k, *args, **kwargs: _NoopUnion(tokens, top_k),
            backup_launcher=lambda: _noop, batch_advance=lambda *args: _noop,
            newest_writer=lambda *args: _noop)
