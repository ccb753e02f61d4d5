"""The steps of one SW-1 cell (`benchmarking.sw1_cell`) and the checks of the rows they return.

`CellSteps` holds what a cell steps through: the kernel's batch buffers at the run's capacity,
every step's top-k staged on the device, the timer and the cache flusher, and the per-step
row check on the device where the pool has a mirror there.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hisparse.backends.features import Feature
from hisparse.layout.tables import CacheTables

if TYPE_CHECKING:
    from hisparse.backends.base import Backend, SwapInFn
    from hisparse.tools.benchmarking import CacheFlusher, ChurnTrace, StepTimer


class LauncherSwapIn:
    """The swap-in as the engine calls it, behind the kernel function's signature: the
    backend's bound launcher (`KernelSet.swap_in_launcher`), made at the first call over that
    call's batch buffers and made again only when they change. Its eager host time is what the
    engine pays per layer; `benchmarking.swap_in_kernel`'s entry point checks and binds its
    launches on every call (the same kernels on the device)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._launcher: Any = None
        self._bound_to: tuple[int, ...] = ()

    def __call__(self, tables: CacheTables, layer: int, group: int, req_slots: torch.Tensor,
                 top_k: torch.Tensor, num_real: torch.Tensor, out: torch.Tensor) -> None:
        buffers = (id(tables), req_slots.data_ptr(), num_real.data_ptr(), out.data_ptr(),
                   *out.shape)
        if buffers != self._bound_to:
            self._launcher = self._backend.kernels.swap_in_launcher(
                tables, req_slots, num_real, out.unsqueeze(0))
            self._bound_to = buffers
        self._launcher.swap_in(layer, group, top_k.shape[0], top_k)


class CellSteps:
    """One SW-1 cell's state: rows of the batch buffers past the batch are padding (request
    slot 0, top-k -1); `mirror` (the pool on the device) checks every step's rows there.
    `device_rows(out)` reads the rows a kernel returned (default: `tables.device_kv[0]` at
    `out`; a peer keeping its own device layout passes its own reader)."""

    def __init__(self, backend: Backend, tables: CacheTables, host_rows: np.ndarray,
                 trace: ChurnTrace, batch: int, capacity: int, top_k: int,
                 mirror: torch.Tensor | None, graphs: bool, timer: StepTimer,
                 flusher: CacheFlusher, num_steps: int,
                 device_rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        device = backend.device()
        self.backend, self.tables, self.batch, self.mirror = backend, tables, batch, mirror
        self.device_rows = device_rows
        self.graphs, self.timer, self.flusher = graphs, timer, flusher
        self.req_slots = torch.zeros(capacity, dtype=torch.int32, device=device)  # pad: slot 0
        self.req_slots[:batch] = torch.arange(batch, dtype=torch.int32, device=device)
        self.num_real = torch.tensor([batch], dtype=torch.int32, device=device)
        self.padded_top_k = torch.full((capacity, top_k), -1, dtype=torch.int32, device=device)
        self.top_k = self.padded_top_k[:batch]  # the real rows, rewritten every step
        self.padded_out = torch.full((capacity, top_k), -1, dtype=torch.int32, device=device)
        self.out = self.padded_out[:batch]
        self.host_rows_on_device = (None if mirror is None
                                    else torch.from_numpy(host_rows).to(device))
        self.wrong = torch.zeros((), dtype=torch.int64, device=device)
        # Every top-k of the cell is drawn up front and staged on the device: no host work
        # sits between two steps but a synchronization, so each step starts on an empty
        # queue. (Queueing all steps back to back instead, with the per-step byte check
        # between them, made extents B=128 churn 0.2 16% slower and much noisier on the H200:
        # sustained load is not what one layer's swap-in sees inside a model either.)
        staged = torch.from_numpy(np.stack([trace.step() for _ in range(num_steps)]))
        self.staged = staged.to(device)

    def call(self, io_kernel: Callable[..., None], **options: object) -> None:
        io_kernel(self.tables, 0, 0, self.req_slots, self.padded_top_k, self.num_real,
                  self.padded_out, **options)

    def step_for(self, io_kernel: Callable[..., None], **options: object) -> Callable[[], None]:
        """One step of `io_kernel`: a graph replay where the backend captures graphs."""
        def call() -> None:
            self.call(io_kernel, **options)

        if not self.graphs:
            return call
        with self.backend.graph_capture() as graph:
            call()
        return graph.replay

    def check(self) -> None:
        if self.host_rows_on_device is not None:
            self.wrong.add_(wrong_rows(self.tables, self.mirror, self.host_rows_on_device,
                                       self.top_k, self.out, self.device_rows))

    def next_top_k(self, index: int) -> None:
        self.flusher.flush()  # the rest of a model runs between two swap-ins of one layer...
        self.top_k.copy_(self.staged[index])  # ...and the indexer writes the top-k last

    def time_kernel(self, kernel: SwapInFn,
                    steps: int) -> tuple[list[Callable[[], float]], torch.Tensor]:
        """An untimed first step (it compiles and allocates), then `steps` timed ones: their
        timers and the miss counter after each step (the first one's included)."""
        misses_after = torch.zeros(1 + steps, dtype=torch.int64, device=self.backend.device())
        self.next_top_k(0)
        self.call(kernel)
        self.check()
        misses_after[0] = self.tables.counters[0, 1]
        run = self.step_for(kernel)
        elapsed = []
        for step in range(1, 1 + steps):
            self.next_top_k(step)
            elapsed.append(self.timer.record(run))
            misses_after[step].copy_(self.tables.counters[0, 1])
            self.check()
            self.backend.synchronize()
        return elapsed, misses_after

    def rows_verified(self, host_rows: np.ndarray, last_step: int) -> bool:
        """Every step's rows on the device where there is a mirror, else the last step's."""
        return int(self.wrong) == 0 and (self.mirror is not None or rows_match(
            self.tables, host_rows, self.staged[last_step].cpu().numpy(), self.out,
            self.device_rows))

    def time_planning(self, first: int, count: int) -> float:
        """Median seconds of `count` skip-IO steps: planned, no bytes moved."""
        self.backend.require(Feature.SKIP_IO_PROBE)
        run_planning = self.step_for(self.backend.kernels.swap_in, skip_io=True)
        planning = []
        for index in range(first, first + count):
            self.next_top_k(index)
            planning.append(self.timer.record(run_planning))
            self.backend.synchronize()
        return statistics.median(seconds() for seconds in planning)

    def padding_untouched(self) -> bool:
        return bool((self.padded_out[self.batch:] == -1).all())


def wrong_rows(tables: CacheTables, pool_rows: torch.Tensor, host_rows: torch.Tensor,
               top_k: torch.Tensor, out: torch.Tensor,
               device_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> torch.Tensor:
    """Scalar tensor on `pool_rows`' device: top-k entries whose returned device row differs
    from their token's host row, or that returned none (docs/ARCHITECTURE.md, swap_in semantics).

    `pool_rows` is the host pool or a copy of it on the device (which keeps a per-step check
    on the device); `host_rows` [B, seq_len] and `top_k` are moved to its device."""
    where = pool_rows.device
    token_rows = host_rows.to(where).gather(1, top_k.to(where, torch.int64))
    expected = pool_rows[token_rows]
    returned = out.to(where, torch.int64)
    safe = out.clamp(min=0).long()
    got = (tables.device_kv[0][safe] if device_rows is None else device_rows(safe)).to(where)
    return ((got != expected).any(dim=-1) | (returned < 0)).sum()


def rows_match(tables: CacheTables, host_rows: np.ndarray, positions: np.ndarray,
               out: torch.Tensor,
               device_rows: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:
    """Every returned device row holds the host row of its token, checked on the host."""
    wrong = wrong_rows(tables, tables.host_kv[0], torch.from_numpy(host_rows),
                       torch.from_numpy(positions), out, device_rows)
    return int(wrong) == 0


__all__ = ["CellSteps", "rows_match", "wrong_rows"]
