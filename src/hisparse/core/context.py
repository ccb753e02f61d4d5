"""What every decode step of one cache shares: `DecodeContext`, built once with the cache.

The tables, the host pool, the traffic counters, the batch buffers, the single-token path's
kernels, the barriers, the index groups' replays and the streams; a step (core/step.py) holds
what lives for one step, and the step plan (core/plan.py) which path it takes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hisparse.backends.base import Backend
from hisparse.core.batch import BatchBuffers, QuietRun
from hisparse.core.host_pool import HostPool
from hisparse.core.kernels import DecodeKernels
from hisparse.core.ordering import DecodeOrdering
from hisparse.core.replay import GroupReplay, group_replays, miss_plans
from hisparse.core.stats import TrafficCounters
from hisparse.layout.tables import CacheTables

if TYPE_CHECKING:
    from hisparse.config import HiSparseConfig


@dataclass(eq=False)
class DecodeContext:
    """What every decode step of one cache shares, built once with the cache."""

    tables: CacheTables
    pool: HostPool
    traffic: TrafficCounters
    buffers: BatchBuffers
    kernels: DecodeKernels
    order: DecodeOrdering
    replays: list[GroupReplay | None]  # per group; None: a group of one layer replays nothing
    layer_group: list[int]  # per layer
    layer_kv: list[torch.Tensor]  # per layer: `device_kv[layer]`, the sink row included
    lock: threading.RLock
    device: torch.device
    batch_capacity: int
    max_seq_len: int
    validate: bool
    prefetch_stream: Any | None  # where followers replay (None: inline)
    shared: Any | None = None  # a shared host pool's SharedPoolSync (core/shared_pool.py)
    slots: Any = None  # the cache's SlotAllocator: lengths and host pages per request slot
    quiet: QuietRun | None = None  # the last step's batch, while its next steps move on

    @classmethod
    def build(cls, config: HiSparseConfig, backend: Backend, device: torch.device,
              tables: CacheTables, pool: HostPool, traffic: TrafficCounters,
              lock: threading.RLock, slots: Any = None) -> DecodeContext:
        """The buffers, kernels, streams, barriers and group replays for `tables`."""
        L, schedule = config.num_layers, config.index_schedule
        capacity = config.max_batch or config.max_requests
        num_groups = schedule.num_groups
        padding_row = int(tables.device_kv.shape[1]) - 1
        buffers = BatchBuffers(capacity, config.top_k, num_groups, padding_row,
                               tables.resident.dtype, device, backend, config.max_draft_tokens)
        plans = miss_plans(schedule, capacity, config.top_k, device)
        kernels = DecodeKernels(backend, config.skip_io, tables,
                                buffers.req_slots, buffers.num_real, buffers.out, plans,
                                (buffers.newest_rows, buffers.newest_rows_long),
                                (buffers.field("batch_slots"), buffers.num_real,
                                 buffers.newest_host_rows, buffers.field("new_seq_lens")),
                                # Where this rank writes host rows (a reader does not); a
                                # shared writer's plan waits for readers at the begin.
                                newest_host_rows=(buffers.newest_host_rows
                                                  if pool.writes_rows else None))
        backup_stream = backend.new_stream() if config.async_backup else None
        prefetch = config.shared_index_prefetch and schedule.shares
        prefetch_stream = backend.new_stream() if prefetch else None
        order = DecodeOrdering(backend, device, backup_stream)
        replays = group_replays(schedule, plans, tables, kernels, backend, device,
                                prefetch_stream)
        return cls(tables=tables, pool=pool, traffic=traffic, buffers=buffers,
                   kernels=kernels, order=order, replays=replays,
                   layer_group=list(schedule.layer_groups),
                   layer_kv=[tables.device_kv[layer] for layer in range(L)], lock=lock,
                   device=device, batch_capacity=capacity, max_seq_len=config.max_seq_len,
                   validate=config.validate, prefetch_stream=prefetch_stream, slots=slots)

    def __post_init__(self) -> None:
        t = self.tables
        self.num_layers = len(self.layer_kv)
        self.row_bytes = t.row_bytes
        self.top_k_columns = self.buffers.out.shape[2]
        self.page_entries = t.page_table.view(-1)  # for one flat index_copy_ per step

    def back_up_newest(self) -> None:
        """A single-token step's end: the batch's newest rows to their host rows."""
        b = self.buffers
        self.kernels.launch_backup(self.tables, b.newest_rows, b.newest_host_rows, b.num_real)
