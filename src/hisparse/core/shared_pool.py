"""One host pool for the tensor-parallel ranks of a node (docs/integration.md, "One host pool
per node").

MLA's latent KV is the same on every tensor-parallel rank, so the ranks of a group map one
shared segment (`core.shared_segment`) instead of keeping a copy each. Every rank keeps its
own device hot buffers, tables and allocator; the rules that make that safe:

- **Same decisions, checked.** Every rank makes the same cache calls in the same order (the
  ranks of a TP group run one scheduler's output), so every rank's allocator hands out the
  same extents. Each counted call is an *operation*; after each, a rank chains a hash of
  the call, its request id and its allocator's decisions, and publishes it. The writer
  compares every reader's hash at every operation, each reader the writer's: whichever
  reaches operation k second compares, and a mismatch fails the pool for every rank.
- **One writer.** Only `writer_rank` writes host rows (prefill, the newest-token backup, a
  shared prefix's boundary and private copies (core/sharing.py); a PD transfer engine writes
  only the writer's reservation). The writer publishes
  `written_through = k` once operation k's writes are complete (after a host wait on the
  event of its asynchronous copies, on a publisher thread). A reader, before an operation
  that reads host rows (seeding, a decode step, a cancel), waits until `written_through`
  covers every operation before it (`complete_transfer`, and a decode step that moved a
  request to a private copy: that operation too).
- **No write into rows still read.** An extent several holders share is freed by its last
  holder only, on every rank alike. A reader that frees rows (finish, abort,
  `release_prefix`, a cancel that returns an extent) first waits on the host for its last
  step's end, then publishes `reads_done`; the writer writes rows again only once every
  reader's `reads_done` covers the operation that freed them: before its host writes
  (`HostRowGuard.drain`), before a step's end backup, and, where its lookups back new rows
  up during the step, before the step's begin (the step plan's `wait_for_readers_at_begin`).
- **Faults.** Every wait checks that the ranks it waits for are alive (and every operation
  checks all ranks at most every `SharedPoolSpec.liveness_period_s`); a dead rank, a
  divergence or a timeout marks the pool failed, and every rank's next operation raises
  SharedPoolError.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hisparse.backends.base import Backend
from hisparse.backends.features import Feature
from hisparse.core.host_pool import HostPool
from hisparse.core.shared_segment import (
    CLOSED,
    F_FAILED,
    F_WRITTEN,
    MAX_RANKS,
    RING,
    S_HASH,
    S_READS_DONE,
    S_SEQ,
    S_STATE,
    SegmentLayout,
    SharedSegment,
)
from hisparse.errors import FeatureDisabledWarning, InvalidInputError, SharedPoolError

if TYPE_CHECKING:
    from hisparse.config import HiSparseConfig


@dataclass(frozen=True)
class SharedPoolSpec:
    """How one rank joins its group's shared host pool; pass it as `shared_pool=` to
    `HiSparseCache`. `writer_rank` creates the pool (reclaiming a stale one of that name);
    the other ranks attach, waiting up to `attach_timeout_s` for it. A rank waits at most
    `wait_timeout_s` for another rank before the pool fails, and an operation checks that
    every rank still runs once `liveness_period_s` has passed since the last check (0: every
    operation, one read of /proc per rank)."""

    name: str
    rank: int
    ranks: int
    writer_rank: int = 0
    attach_timeout_s: float = 60.0
    wait_timeout_s: float = 60.0
    liveness_period_s: float = 0.25

    def __post_init__(self) -> None:
        def count(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        problems = []
        if not count(self.ranks) or not 1 <= self.ranks <= MAX_RANKS:
            problems.append(f"ranks={self.ranks!r} must be an int in 1..{MAX_RANKS}")
        else:
            for field in ("rank", "writer_rank"):
                value = getattr(self, field)
                if not count(value) or not 0 <= value < self.ranks:
                    problems.append(f"{field}={value!r} must be an int in 0..{self.ranks - 1}")
        for field in ("attach_timeout_s", "wait_timeout_s"):
            value = getattr(self, field)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                problems.append(f"{field}={value!r} must be a positive number of seconds")
        period = self.liveness_period_s
        if not isinstance(period, int | float) or isinstance(period, bool) or not period >= 0:
            problems.append(f"liveness_period_s={period!r} must be a number of seconds >= 0")
        if problems:
            raise InvalidInputError(
                "bad SharedPoolSpec: " + "; ".join(problems) + "; pass the rank's index in "
                "its tensor-parallel group, the group's size, and the writer's index")

    @property
    def is_writer(self) -> bool:
        return self.rank == self.writer_rank


def build_host_pool(backend: Backend, config: HiSparseConfig, spec: SharedPoolSpec | None
                    ) -> tuple[HostPool, SharedPoolSync | None]:
    """The cache's host pool: private, or its rank's view of the group's shared one. A
    backend that cannot share (Feature.SHARED_HOST_POOL) gets a private pool and one
    FeatureDisabledWarning: correct, only without the memory saving."""
    E = config.extent_tokens
    num_extents = -(-config.host_pool_tokens // E)
    if spec is not None and not isinstance(spec, SharedPoolSpec):
        raise InvalidInputError(
            f"shared_pool must be a SharedPoolSpec or None, got {type(spec).__name__} "
            f"{spec!r:.80}; build one with SharedPoolSpec(name, rank, ranks)")
    if spec is not None and not backend.features.supports(Feature.SHARED_HOST_POOL):
        support = backend.features[Feature.SHARED_HOST_POOL]
        warnings.warn(
            f"shared_pool was requested but {Feature.SHARED_HOST_POOL} is {support.status} on "
            f"the {backend.name} backend: {support.reason}; turning it off. Instead, "
            f"{support.instead}.", FeatureDisabledWarning, stacklevel=3)
        spec = None
    if spec is None:
        return HostPool(backend, config.num_layers, num_extents, E, config.row_bytes), None
    layout = SegmentLayout(config.num_layers, num_extents * E, config.row_bytes, E,
                           spec.ranks, spec.writer_rank)
    segment = open_segment(spec, backend, layout)
    pool = HostPool(backend, config.num_layers, num_extents, E, config.row_bytes,
                    segment=segment, writes_rows=spec.is_writer)
    sync = SharedPoolSync(segment, spec, backend, lambda: pool.decisions)
    pool.before_close = sync.close
    return pool, sync


def open_segment(spec: SharedPoolSpec, backend: Backend, layout: SegmentLayout
                 ) -> SharedSegment:
    """Create (the writer) or attach (the others) the segment, registered for the device;
    nothing is left behind when that fails."""
    backend.require(Feature.SHARED_HOST_POOL)
    if spec.is_writer:
        segment = SharedSegment.create(spec.name, layout, spec.rank)
    else:
        segment = SharedSegment.attach(spec.name, layout, spec.rank, spec.attach_timeout_s)
    try:
        backend.register_host(segment.mapping, shared=True)
    except BaseException:
        segment.close()
        raise
    return segment


class SharedPoolSync:
    """One rank's side of the rules above, driven by the cache at each counted operation."""

    def __init__(self, segment: SharedSegment, spec: SharedPoolSpec, backend: Backend,
                 decisions: Callable[[], int]) -> None:
        self.segment = segment
        self.spec = spec
        self.is_writer = spec.is_writer
        self._backend = backend
        self._decisions = decisions  # the allocator's running digest (HostPool.decisions)
        # Every field as an index into the header's words (one plain-int access each).
        self._words = segment.words
        self._own = segment.slot_at(spec.rank)
        self._own_ring = segment.ring_at(spec.rank)
        self._writer_slot = segment.slot_at(spec.writer_rank)
        self._readers = [r for r in range(spec.ranks) if r != spec.writer_rank]
        self._reader_slots = [segment.slot_at(r) for r in self._readers]
        # The rings this rank compares with: every reader's (the writer), the writer's (a reader).
        peers = self._readers if self.is_writer else [spec.writer_rank]
        self._peer_rings = [(peer, segment.ring_at(peer)) for peer in peers]
        self.seq = 0  # operations completed
        self._hash = 0
        self._last_calls: dict[str, tuple[object, int]] = {}  # by call name
        self._next_liveness = time.monotonic() + spec.liveness_period_s
        self._pending_event: Any | None = None
        self._recycled_at = 0  # writer: the last operation that freed rows
        self._reads_confirmed = 0  # writer: every reader's reads_done covers this
        self._publisher = _Publisher(backend, segment.words) if self.is_writer else None
        self.skip_read_waits = False  # tests only: shows that a missing wait reads stale rows
        self.waited_s = 0.0  # host time spent waiting for other ranks (for benchmarks)

    # --- operations ------------------------------------------------------------------------
    def begin_op(self) -> None:
        """Refuse on a failed pool; now and then, check that every rank still runs."""
        if self._words[F_FAILED]:
            raise SharedPoolError(f"shared host pool {self.segment.path} failed: "
                                  f"{self.segment.failure()}; rebuild the group's caches")
        if time.monotonic() >= self._next_liveness:
            self._next_liveness = time.monotonic() + self.spec.liveness_period_s
            self._check_alive(range(self.spec.ranks))

    def end_op(self, name: str, key: object) -> None:
        """Operation `seq + 1` succeeded: chain and publish its hash, compare, publish the
        writer's rows once its copies are done."""
        seq = self.seq + 1
        digest = hash((self._hash, self._call_code(name, key), self._decisions()))
        words, entry = self._words, self._own_ring + 2 * (seq % RING)
        words[entry] = -1  # a peer reading the entry mid-update sees no operation
        words[entry + 1] = digest
        words[entry] = seq
        own = self._own
        words[own + S_HASH] = digest
        words[own + S_SEQ] = seq
        self.seq, self._hash = seq, digest
        for peer, ring in self._peer_rings:
            at = ring + 2 * (seq % RING)
            first, theirs, second = words[at], words[at + 1], words[at]
            if first == seq == second and theirs != digest:
                self._diverged(peer, seq, name, key)
        if self._publisher is not None:
            event, self._pending_event = self._pending_event, None
            self._publisher.publish(seq, event)
            self._limit_lead(seq)

    def wrote(self, stream: Any | None = None) -> None:
        """The writer issued host-row copies in this operation, on `stream` (None: the
        current one): its publication waits for them."""
        backend = self._backend
        event = backend.new_event()
        if event is not None:
            with backend.stream_scope(stream):
                backend.record_event(event)
            self._pending_event = event

    def before_read(self, current: bool = False) -> None:
        """A reader waits until the writer's rows of every earlier operation (and of this one,
        `current`: a PD landing) are complete."""
        if self.is_writer or self.skip_read_waits:
            return
        need = self.seq + (1 if current else 0)
        words = self._words
        if words[F_WRITTEN] >= need:
            return
        self._wait(lambda: words[F_WRITTEN] >= need, [self.spec.writer_rank],
                   f"the writer's host rows of operation {need}")

    def before_write(self) -> None:
        """The writer waits until every reader is done reading the rows freed last."""
        if not self.is_writer or self._recycled_at <= self._reads_confirmed:
            return
        need = self._recycled_at
        words, slots = self._words, self._reader_slots  # (a reader that closed reads no more)
        self._wait(lambda: all(words[s + S_READS_DONE] >= need or words[s + S_STATE] == CLOSED
                               for s in slots),
                   self._readers,
                   f"every reader to stop reading the rows freed at operation {need}")
        self._reads_confirmed = need

    def rows_recycled(self, reads_done: Callable[[], None]) -> None:
        """Rows were freed in the operation under way; `reads_done` blocks the host until this
        rank's device reads of them are over."""
        if self.is_writer:
            self._recycled_at = self.seq + 1
        else:
            reads_done()
            self._words[self._own + S_READS_DONE] = self.seq + 1

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close()

    # --- internals -------------------------------------------------------------------------
    def _call_code(self, name: str, key: object) -> int:
        """The call as a number every process computes alike: its text through crc32 (str
        hashes are salted per process). A decode step's batch is usually the last step's, and
        its text costs ~0.15 us an id: a call equal to the last one of its name reuses its
        number."""
        last = self._last_calls.get(name)  # (a plain call's: never one with a tensor)
        if last is not None:
            try:
                if last[0] == key:
                    return last[1]
            except (RuntimeError, TypeError):  # (a tensor in `key` compares elementwise)
                pass
        plain = not _has_tensor(key)
        code = zlib.crc32(f"{name}|{_short_repr(key)}".encode())
        # Kept only without tensors (a prefill's rows must not stay alive), and as a copy (a
        # caller may reuse its list and change it).
        if plain:
            self._last_calls[name] = (_copied(key), code)
        return code

    def _diverged(self, peer: int, seq: int, name: str, key: object) -> None:
        self._fail(f"rank {self.spec.rank}'s allocation decisions diverged from rank {peer}'s "
                   f"at operation {seq} ({name} {_short_repr(key)}): every rank must make the "
                   "same cache calls (admit, write_prefill, commit_prefill, decode steps, "
                   "preempt, resume, finish, abort, PD) in the same order with the same "
                   "request ids and lengths")

    def _limit_lead(self, seq: int) -> None:
        """The writer keeps within RING - 1 operations of every reader, so that each
        operation's hashes are still in the ring when the later rank compares them."""
        words, slots = self._words, self._reader_slots
        floor = seq - (RING - 2)
        def caught_up() -> bool:
            return all(words[s + S_SEQ] >= floor or words[s + S_STATE] == CLOSED for s in slots)

        if caught_up():
            return
        self._wait(caught_up, self._readers,
                   f"every reader to reach operation {floor}")

    def _wait(self, done: Callable[[], bool], peers: list[int], what: str) -> None:
        started = time.perf_counter()
        try:
            self._wait_until(done, peers, what)
        finally:
            self.waited_s += time.perf_counter() - started

    def _wait_until(self, done: Callable[[], bool], peers: list[int], what: str) -> None:
        deadline = time.monotonic() + self.spec.wait_timeout_s
        next_check, spins = 0.0, 0
        while not done():
            if self._words[F_FAILED]:
                self.begin_op()  # raises with the pool's failure
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.005
                self._check_alive(peers)
                if now > deadline:
                    self._fail(f"rank {self.spec.rank} waited {self.spec.wait_timeout_s:g} s "
                               f"for {what}; a rank is stuck or made other calls")
            # A few yields, then sleeps: a spinning rank must not take the core its writer
            # needs (ranks may share cores, as in CI).
            spins += 1
            if spins < 20:
                os.sched_yield()
            else:
                time.sleep(min(1e-3, 2e-5 * (spins - 19)))

    def _check_alive(self, ranks: Any) -> None:
        writer = self.spec.writer_rank
        if (not self.is_writer and writer in ranks
                and self._words[self._writer_slot + S_STATE] == CLOSED):
            self._fail(f"the writer (rank {writer}) closed its cache while rank "
                       f"{self.spec.rank} still made calls; close every rank's cache together")
        dead = [(r, pid) for r, pid in self.segment.dead_ranks() if r in ranks]
        if dead:
            rank, pid = dead[0]
            role = "the writer" if rank == self.spec.writer_rank else "a reader"
            self._fail(f"rank {rank} ({role}, pid {pid}) of the group exited without closing "
                       "its cache (killed?); the rows it owed cannot be trusted")

    def _fail(self, reason: str) -> None:
        self.segment.mark_failed(reason)
        raise SharedPoolError(f"shared host pool {self.segment.path} failed: "
                              f"{self.segment.failure()}; rebuild the group's caches")


class _Publisher:
    """The writer's `written_through`, advanced in operation order once each operation's
    copies are complete: inline when nothing is in flight, else on a thread that waits on
    the copies' events (so the writer's host never blocks for its own backups)."""

    def __init__(self, backend: Backend, words: memoryview) -> None:
        self._backend = backend
        self._words = words
        self._queue: deque[tuple[int, Any]] = deque()
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def publish(self, seq: int, event: Any | None) -> None:
        with self._ready:
            if event is None and not self._queue:
                self._words[F_WRITTEN] = seq
                return
            self._queue.append((seq, event))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="hisparse-shared-pool-publisher")
                self._thread.start()
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._stopping:
                    self._ready.wait()
                if not self._queue:
                    return
                seq, event = self._queue[0]
            if event is not None:
                self._backend.synchronize_event(event)
            with self._ready:
                self._queue.popleft()
                self._words[F_WRITTEN] = max(self._words[F_WRITTEN], seq)
                self._ready.notify_all()

    def close(self) -> None:
        """Publish everything still queued (readers may be waiting for it), then stop."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()


def _has_tensor(key: object) -> bool:
    return isinstance(key, torch.Tensor) or (
        type(key) is tuple and any(isinstance(k, torch.Tensor) for k in key))


def _copied(key: object) -> object:
    if type(key) is tuple:
        return tuple(list(k) if type(k) is list else k for k in key)
    return key


def _short_repr(key: object) -> str:
    """A call's arguments as text to hash: tensors by shape (their bytes are the writer's
    business), the rest by repr."""
    if isinstance(key, torch.Tensor):
        return f"tensor{tuple(key.shape)}"
    if isinstance(key, tuple) and any(isinstance(k, torch.Tensor) for k in key):
        return "(" + ", ".join(_short_repr(k) for k in key) + ")"
    text = repr(key)
    return text if len(text) <= 200 else text[:200] + "..."
