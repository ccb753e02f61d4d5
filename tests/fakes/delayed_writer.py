"""A CPU backend whose newest-token backup lands late, as an asynchronous copy does.

The backup's bytes are taken when it is launched (what a copy engine would read) and written
to the host rows `delay_s` later on a thread of their own. Its events behave like CUDA's: one
recorded now completes once every backup launched before it has landed, and
`synchronize_event` blocks for that. So a shared pool's writer that published its rows
before its copies completed, or a reader that read without waiting for the publication,
shows up as stale rows (tests/test_shared_pool_processes.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from hisparse.backends.base import BackupFn
from hisparse.backends.cpu import CpuBackend
from hisparse.layout.tables import CacheTables


class _Event:
    def __init__(self) -> None:
        self.landings: list[threading.Thread] = []


class DelayedBackupBackend(CpuBackend):
    name = "cpu-delayed-backup"

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self._landings: list[threading.Thread] = []

    def new_event(self) -> Any:
        return _Event()

    def record_event(self, event: Any, device: torch.device | None = None) -> None:
        if event is not None:
            event.landings = list(self._landings)

    def synchronize_event(self, event: Any) -> None:
        for landing in getattr(event, "landings", []):
            landing.join()

    def synchronize(self, device: torch.device | None = None) -> None:
        for landing in list(self._landings):
            landing.join()

    def backup_kernel(self) -> BackupFn:
        def delayed_backup(tables: CacheTables, newest_rows: torch.Tensor,
                           host_rows: torch.Tensor, num_real: torch.Tensor) -> None:
            count = int(num_real[0])
            targets = host_rows[:count].long().clone()
            rows = tables.device_kv[:, newest_rows[:count].long()].clone()  # read at launch
            hosts = list(tables.host_kv)

            def land() -> None:
                time.sleep(self.delay_s)
                for layer, host in enumerate(hosts):
                    host[targets] = rows[layer]

            landing = threading.Thread(target=land, daemon=True)
            landing.start()
            self._landings.append(landing)

        return delayed_backup
