"""A CPU backend whose newest-token backups land only once every reader has had its chance to
read too early: a shared pool's missing wait shows up on every run, not by timing.

The backup's bytes are taken at launch (what a copy engine reads) and written to the host rows
later, on a thread of their own, once every reader has *posted* a sequence number at least the
writer's operation that launched them. A reader posts (`ReaderPosts.post`) where it is about
to wait for the writer's rows (so a correct reader never deadlocks) and after each step's
reads (so a reader that read without waiting has read before the landing: stale rows, always).
A writer that publishes its rows before its copies land is caught the same way. Events behave
like CUDA's: one recorded now completes once every backup launched before it has landed.
`gate_share` below 1 gates only that share of the backups (drawn from `seed`): the rest land
at once, as a random mix of slow and fast copies.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hisparse.backends.base import BackupFn, KernelSet
from hisparse.backends.cpu import CpuBackend
from hisparse.backends.kernel_set import reference_kernels
from hisparse.layout.tables import CacheTables

OPEN_ALL = 1 << 62  # a reader that posts this lets every landing through (it reads no more)


class ReaderPosts:
    """One int64 per reader in a small /dev/shm file: how far each reader has read."""

    def __init__(self, name: str, readers: int) -> None:
        self.path = f"/dev/shm/hisparse-gate-{name}"
        self.readers = readers
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 8 * readers:
                os.ftruncate(fd, 8 * readers)
        finally:
            os.close(fd)

    def _view(self) -> np.ndarray:
        return np.memmap(self.path, dtype=np.int64, mode="r+", shape=(self.readers,))

    def post(self, reader: int, seq: int) -> None:
        view = self._view()
        view[reader] = max(int(view[reader]), seq)
        view.flush()

    def lowest(self) -> int:
        return int(self._view().min())

    def wait_for(self, seq: int) -> None:
        """Block until every reader posted `seq` or more (polled: the posts are another
        process's; nothing here depends on how long anything takes)."""
        pause = threading.Event()
        while self.lowest() < seq:
            pause.wait(2e-4)

    def unlink(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


class GatedBackupBackend(CpuBackend):
    """The writer's backend: backups land once every reader posted the operation's number."""

    name = "cpu-gated-backup"

    def __init__(self, posts: ReaderPosts, gate_share: float = 1.0, seed: int = 0) -> None:
        super().__init__()
        self.posts = posts
        self.gate_share = gate_share
        self._rng = random.Random(seed)
        self.operation: Callable[[], int] = lambda: 0  # the writer's operation under way
        self._landings: list[threading.Thread] = []

    def new_event(self) -> Any:
        return _Event()

    def record_event(self, event: Any, device: torch.device | None = None) -> None:
        if event is not None:
            event.landings = list(self._landings)

    def synchronize_event(self, event: Any) -> None:
        for landing in getattr(event, "landings", []):
            landing.join()

    def event_done(self, event: Any) -> bool:
        return all(not landing.is_alive() for landing in getattr(event, "landings", []))

    def synchronize(self, device: torch.device | None = None) -> None:
        for landing in list(self._landings):
            landing.join()

    @property
    def kernels(self) -> KernelSet:
        return reference_kernels(backup=self._gated_backup())

    def _gated_backup(self) -> BackupFn:
        def gated_backup(tables: CacheTables, newest_rows: torch.Tensor,
                         host_rows: torch.Tensor, num_real: torch.Tensor) -> None:
            count = int(num_real[0])
            keep = host_rows[:count].long() >= 0
            targets = host_rows[:count].long()[keep].clone()
            rows = tables.device_kv[:, newest_rows[:count].long()[keep]].clone()  # at launch
            hosts = list(tables.host_kv)
            gate = self.operation() if self._rng.random() < self.gate_share else None
            previous = self._landings[-1] if self._landings else None

            def land() -> None:
                if previous is not None:
                    previous.join()  # copies land in launch order, as on one stream
                if gate is not None:
                    self.posts.wait_for(gate)
                for layer, host in enumerate(hosts):
                    host[targets] = rows[layer]

            landing = threading.Thread(target=land, daemon=True)
            landing.start()
            self._landings.append(landing)

        return gated_backup


class _Event:
    def __init__(self) -> None:
        self.landings: list[threading.Thread] = []


def gate_reader(cache: Any, posts: ReaderPosts, reader: int, post_on_wait: bool = True
                ) -> Callable[[], None]:
    """Make a reader rank post where it waits for the writer; returns `after_reads()`, which
    the rank calls once a step's reads are done. `post_on_wait=False` for a writer that does
    not wait for its copies before it publishes: a reader that is merely ahead of it must not
    let the copies land before it reads."""
    sync = cache._shared
    wait = sync._wait
    if not post_on_wait:
        return lambda: posts.post(reader, sync.seq)

    # A reader that completed operation k has read (or is about to wait for) the rows of the
    # writer's operation k: a backup launched in operation k may land from then on.
    def posting_wait(done: Callable[[], bool], peers: list[int], what: str) -> None:
        posts.post(reader, sync.seq)
        wait(done, peers, what)

    sync._wait = posting_wait
    return lambda: posts.post(reader, sync.seq)


def gate_writer(cache: Any) -> None:
    """Let the writer's backend number each backup by the operation that launches it."""
    sync = cache._shared
    cache.backend.operation = lambda: sync.seq + 1
