"""The shared-memory segment behind a host pool that the tensor-parallel ranks of a node share.

One file in /dev/shm (a tmpfs), mapped by every rank: a small header of int64 fields (the
layout, per-rank slots, per-rank rings of decision hashes) and, page-aligned after it, every
layer's `[N, W]` rows. The file is ours, not `multiprocessing.shared_memory`'s: on Python
3.11/3.12 its resource tracker unlinks a segment when any process that opened it exits.

Lifetime rule (docs/integration.md, "One host pool per node"): every change to the rank
slots is made under an exclusive `flock` on the file. A rank's close clears its slot and, if
no slot left holds a live process, unlinks the file. A rank killed by SIGKILL leaves its slot
behind; the liveness check (`/proc/<pid>/stat`: the pid exists, is not a zombie, and started
when the slot says) sees it as dead, so the last survivor to close unlinks, and a creator that
finds a segment whose every rank is dead reclaims it.

Each header field has one writer (a rank writes only its own slot and ring; the writer rank
alone writes `written_through`): readers need aligned 8-byte loads and stores, which numpy
makes on x86-64 and aarch64, and no locks on the hot path.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import numpy as np
import torch

from hisparse.backends._host_memory import available_host_bytes, format_bytes
from hisparse.errors import HostAllocationError, InvalidInputError, SharedPoolError

MAGIC = 0x48495350_41525345  # "HISPARSE"
VERSION = 1
MAX_RANKS = 64
RING = 256  # decision hashes kept per rank: a rank this far ahead skips a check, not misses it
PAGE = mmap.PAGESIZE
# Header int64 fields.
F_MAGIC, F_VERSION, F_READY, F_LAYERS, F_ROWS, F_ROW_BYTES, F_EXTENT = range(7)
F_RANKS, F_WRITER, F_FAILED, F_WRITTEN, F_HEADER_BYTES, F_DATA_BYTES = range(7, 13)
FAILURE_AT, FAILURE_BYTES = 256, 512  # utf-8 reason of a failed pool, NUL-padded
SLOTS_AT, SLOT_FIELDS = 1024, 8
# Per-rank slot fields.
S_PID, S_START, S_STATE, S_SEQ, S_HASH, S_READS_DONE = range(6)
EMPTY, ATTACHED, CLOSED = 0, 1, 2


def shm_directory() -> str:
    """Where segments live: /dev/shm (memory, not disk) where it exists."""
    return os.environ.get("HISPARSE_SHM_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm")
                                                  else "/tmp")


def segment_path(name: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 200 or not all(
            c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise InvalidInputError(
            f"shared pool name {name!r:.220} is not usable as a file name; pass 1..200 "
            "letters, digits, '-', '_' or '.', not starting with '.' (e.g. 'job42-tp0')")
    return os.path.join(shm_directory(), f"hisparse-{name}")


@dataclass(frozen=True)
class SegmentLayout:
    """What every rank's cache must agree on to share the rows."""

    num_layers: int
    num_rows: int
    row_bytes: int
    extent_tokens: int
    ranks: int
    writer_rank: int

    @property
    def header_bytes(self) -> int:
        ring_at = SLOTS_AT + self.ranks * SLOT_FIELDS * 8
        return _pages(ring_at + self.ranks * RING * 16)

    @property
    def ring_at(self) -> int:
        return (SLOTS_AT + self.ranks * SLOT_FIELDS * 8) // 8

    @property
    def layer_bytes(self) -> int:
        return self.num_rows * self.row_bytes

    @property
    def data_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + _pages(self.data_bytes)

    def fields(self) -> dict[int, int]:
        return {F_LAYERS: self.num_layers, F_ROWS: self.num_rows, F_ROW_BYTES: self.row_bytes,
                F_EXTENT: self.extent_tokens, F_RANKS: self.ranks, F_WRITER: self.writer_rank,
                F_HEADER_BYTES: self.header_bytes, F_DATA_BYTES: self.data_bytes}


_FIELD_NAMES = {F_LAYERS: "num_layers", F_ROWS: "rows per layer", F_ROW_BYTES: "row_bytes",
                F_EXTENT: "extent_tokens", F_RANKS: "ranks", F_WRITER: "writer_rank",
                F_HEADER_BYTES: "header bytes", F_DATA_BYTES: "data bytes"}


class SharedSegment:
    """One rank's mapping of the segment: `header` (int64 fields), `layers` (row tensors)."""

    def __init__(self, path: str, fd: int, layout: SegmentLayout, rank: int) -> None:
        self.path, self.layout, self.rank = path, layout, rank
        self._fd = fd
        self._map = mmap.mmap(fd, layout.total_bytes, flags=mmap.MAP_SHARED)
        self.header = np.frombuffer(self._map, dtype=np.int64, count=layout.header_bytes // 8)
        # The same header fields as plain ints: a decode step's protocol reads and writes a
        # dozen of them, and a memoryview item costs half a numpy scalar's access.
        with memoryview(self._map) as whole:
            self.words = whole[: layout.header_bytes].cast("q")
        # The whole mapping as one tensor: a registration for the device covers it from its
        # first page, where torch's is_pinned() looks.
        self.mapping = torch.frombuffer(self._map, dtype=torch.uint8)
        start, size = layout.header_bytes, layout.layer_bytes
        self.layers = [self.mapping[start + i * size: start + (i + 1) * size].view(
            layout.num_rows, layout.row_bytes) for i in range(layout.num_layers)]
        self.closed = False

    # --- creation and attach ---------------------------------------------------------------
    @classmethod
    def create(cls, name: str, layout: SegmentLayout, rank: int) -> SharedSegment:
        """Create the segment (reclaiming one whose every rank is dead) and take `rank`'s slot."""
        path = segment_path(name)
        fd = _create_file(path, layout)
        try:
            _reserve(fd, path, layout)
            segment = cls(path, fd, layout, rank)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        header = segment.header
        header[F_MAGIC], header[F_VERSION] = MAGIC, VERSION
        for index, value in layout.fields().items():
            header[index] = value
        segment._take_slot()
        header[F_READY] = 1  # last: an attaching rank reads the fields only after this
        return segment

    @classmethod
    def attach(cls, name: str, layout: SegmentLayout, rank: int,
               timeout_s: float) -> SharedSegment:
        """Open the segment another rank created (waiting up to `timeout_s` for it to appear
        and be ready), check its layout against ours, and take `rank`'s slot. A segment left
        by a group whose writer is gone (killed, or closed) or that failed is not joined: the
        new writer reclaims its name, so a restarted group comes up whichever rank starts
        first."""
        path = segment_path(name)
        deadline = time.monotonic() + timeout_s
        passed_over = ""  # why the segment there was not joined, for the timeout's message
        while True:
            fd = _open_ready(path, layout)
            if fd is not None:
                segment = None
                try:
                    with _flocked(fd):  # the writer's reclaim holds the same lock
                        passed_over = _not_joinable(fd, path) or ""
                        if not passed_over:
                            _check_layout(fd, path, layout)
                            segment = cls(path, fd, layout, rank)
                            segment._take_slot()
                            return segment
                except BaseException:
                    if segment is not None:
                        segment._unmap()
                    os.close(fd)
                    raise
                os.close(fd)
            if time.monotonic() > deadline:
                found = (f"; the pool there {passed_over}: start its writer (rank "
                         f"{layout.writer_rank}), which reclaims the name" if passed_over else
                         f"; create it on the writer rank (rank {layout.writer_rank}) with the "
                         "same name first, or raise attach_timeout_s")
                raise SharedPoolError(
                    f"no shared host pool {name!r} ({path}) was ready to join within "
                    f"{timeout_s:g} s{found}")
            time.sleep(0.01)

    def _take_slot(self) -> None:
        slot = self.slot(self.rank)
        if slot[S_STATE] == ATTACHED and process_alive(int(slot[S_PID]), int(slot[S_START])):
            raise SharedPoolError(
                f"rank {self.rank} of shared host pool {self.path} is already attached by live "
                f"process {int(slot[S_PID])}; give each rank of the group its own rank number")
        pid = os.getpid()
        slot[S_SEQ] = slot[S_HASH] = slot[S_READS_DONE] = 0
        slot[S_PID], slot[S_START] = pid, process_start_time(pid)
        slot[S_STATE] = ATTACHED

    # --- views -----------------------------------------------------------------------------
    def slot(self, rank: int) -> np.ndarray:
        at = self.slot_at(rank)
        return self.header[at: at + SLOT_FIELDS]

    def slot_at(self, rank: int) -> int:
        """The index of `rank`'s slot's first field in `header` and `words`."""
        return SLOTS_AT // 8 + rank * SLOT_FIELDS

    def ring_at(self, rank: int) -> int:
        """The index of `rank`'s ring's first entry in `header` and `words`: entry `i` is the
        two words at `ring_at + 2 * i`."""
        return self.layout.ring_at + rank * RING * 2

    def ring(self, rank: int) -> np.ndarray:
        """`[RING, 2]`: (op sequence, decision hash) of a rank's last RING operations."""
        at = self.ring_at(rank)
        return self.header[at: at + RING * 2].reshape(RING, 2)

    def failure(self) -> str | None:
        if not self.header[F_FAILED]:
            return None
        raw = bytes(self._map[FAILURE_AT: FAILURE_AT + FAILURE_BYTES]).rstrip(b"\0")
        return raw.decode("utf-8", "replace") or "a rank marked the pool failed"

    def mark_failed(self, reason: str) -> None:
        """Record why the pool can no longer be trusted, once: every rank then refuses."""
        with self.locked():
            if self.header[F_FAILED]:
                return
            data = reason.encode("utf-8")[: FAILURE_BYTES - 1]
            self._map[FAILURE_AT: FAILURE_AT + len(data)] = data
            self.header[F_FAILED] = 1

    def dead_ranks(self) -> list[tuple[int, int]]:
        """(rank, pid) of every slot attached by a process that no longer runs."""
        dead = []
        for rank in range(self.layout.ranks):
            slot = self.slot(rank)
            if slot[S_STATE] == ATTACHED and not process_alive(int(slot[S_PID]),
                                                                 int(slot[S_START])):
                dead.append((rank, int(slot[S_PID])))
        return dead

    @contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # --- closing ---------------------------------------------------------------------------
    def close(self) -> bool:
        """Leave the segment; unlink it if no live rank is left. Returns whether it did."""
        if self.closed:
            return False
        self.closed = True
        unlinked = False
        try:
            with self.locked():
                self.slot(self.rank)[S_STATE] = CLOSED
                live = [r for r in range(self.layout.ranks)
                        if self.slot(r)[S_STATE] == ATTACHED
                        and process_alive(int(self.slot(r)[S_PID]), int(self.slot(r)[S_START]))]
                if not live and _same_file(self._fd, self.path):
                    _unlink(self.path)
                    unlinked = True
        finally:
            self._unmap()
            os.close(self._fd)
        return unlinked

    def _unmap(self) -> None:
        self.layers.clear()
        self.words.release()
        self.header = self.mapping = self.words = None  # type: ignore[assignment]
        # A caller may still hold a view of the rows (host_tensors(), a reservation): the
        # mapping then goes with that view. The file is unlinked already, so nothing leaks.
        with suppress(BufferError):
            self._map.close()


def _check_layout(fd: int, path: str, layout: SegmentLayout) -> None:
    """Refuse a segment of another layout (or not ours) before mapping all of it."""
    with mmap.mmap(fd, SLOTS_AT, flags=mmap.MAP_SHARED) as view:
        header = np.frombuffer(view, dtype=np.int64, count=SLOTS_AT // 8).copy()
    if header[F_MAGIC] != MAGIC or header[F_VERSION] != VERSION:
        raise SharedPoolError(f"{path} is not a hisparse shared pool of version {VERSION}; "
                              "pass the name its writer rank created")
    wrong = [f"{_FIELD_NAMES[i]}: the pool has {int(header[i])}, this cache {value}"
             for i, value in layout.fields().items() if header[i] != value]
    size = os.fstat(fd).st_size
    if not wrong and size != layout.total_bytes:
        wrong.append(f"size: the file has {size} B, this cache's layout {layout.total_bytes} B")
    if wrong:
        raise SharedPoolError(
            f"shared host pool {path} does not match this cache ({'; '.join(wrong)}); every "
            "rank must use the same config (num_layers, row_bytes, host_pool_tokens, "
            "extent_tokens) and the same ranks and writer_rank")


def process_start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 where /proc is not there)."""
    stat = _proc_stat(pid)
    return int(stat[19]) if stat else 0


def process_alive(pid: int, start_time: int) -> bool:
    """Whether `pid` is the process that took the slot: running (not a zombie a parent has
    not reaped yet) and started when the slot says, so a reused pid does not count."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = _proc_stat(pid)
    if stat is None:
        return not os.path.isdir("/proc")
    return stat[0] not in ("Z", "X") and (not start_time or int(stat[19]) == start_time)


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: [state, ppid, ...] (field 3 onwards)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read().decode("utf-8", "replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _pages(num_bytes: int) -> int:
    return -(-num_bytes // PAGE) * PAGE


def _create_file(path: str, layout: SegmentLayout) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDWR)
    try:
        with _flocked(fd):
            stale = _stale_segment(fd)
            if stale is not True:
                raise SharedPoolError(
                    f"a shared host pool named {os.path.basename(path)!r} ({path}) exists and "
                    f"{stale}; pick another name for this group, or close that group first")
            _unlink(path)  # every rank of the old group is dead: reclaim the name
    finally:
        os.close(fd)
    return os.open(path, flags, 0o600)


def _stale_segment(fd: int) -> bool | str:
    """True when no rank of the segment in `fd` is alive; else why it is not stale."""
    size = os.fstat(fd).st_size
    if size < SLOTS_AT + 8 * SLOT_FIELDS:
        return True  # a creator died before writing the header
    with mmap.mmap(fd, SLOTS_AT, flags=mmap.MAP_SHARED) as view:
        header = np.frombuffer(view, dtype=np.int64, count=SLOTS_AT // 8).copy()
    if header[F_MAGIC] != MAGIC:
        return "is not a hisparse shared pool"
    ranks = int(header[F_RANKS])
    with mmap.mmap(fd, SLOTS_AT + ranks * SLOT_FIELDS * 8, flags=mmap.MAP_SHARED) as view:
        slots = np.frombuffer(view, dtype=np.int64)[SLOTS_AT // 8:].reshape(
            ranks, SLOT_FIELDS).copy()  # a copy: the mapping closes with no view left
    live = [int(s[S_PID]) for s in slots
            if s[S_STATE] == ATTACHED and process_alive(int(s[S_PID]), int(s[S_START]))]
    return True if not live else f"is attached by live processes {live}"


def _not_joinable(fd: int, path: str) -> str | None:
    """None when the ready segment open as `fd` is still the one `path` names, has not
    failed and its writer runs; else why a rank must not join it (a new writer will reclaim
    the name once no live rank holds it)."""
    if not _same_file(fd, path):
        return "was replaced while it was opened"
    with mmap.mmap(fd, SLOTS_AT + MAX_RANKS * SLOT_FIELDS * 8, flags=mmap.MAP_SHARED) as view:
        header = np.frombuffer(view, dtype=np.int64).copy()
    if header[F_FAILED]:
        return "failed"
    writer = int(header[F_WRITER])
    slot = header[SLOTS_AT // 8 + writer * SLOT_FIELDS:][:SLOT_FIELDS]
    if slot[S_STATE] != ATTACHED or not process_alive(int(slot[S_PID]), int(slot[S_START])):
        return f"has no live writer (rank {writer} exited)"
    return None


def _reserve(fd: int, path: str, layout: SegmentLayout) -> None:
    """Size the file and take its memory now: tmpfs pages that are only promised would kill
    a rank with SIGBUS at its first write once /dev/shm is full."""
    available = available_host_bytes()
    if available is not None and layout.total_bytes > available:
        raise HostAllocationError(
            f"the shared host pool needs {format_bytes(layout.total_bytes)} ({layout.num_layers}"
            f" layers x {layout.num_rows} rows x {layout.row_bytes} B), but only "
            f"{format_bytes(available)} of host memory is available; lower host_pool_tokens "
            "or free host memory.")
    try:
        os.posix_fallocate(fd, 0, layout.total_bytes)
    except OSError as exc:
        stats = os.statvfs(os.path.dirname(path))
        raise SharedPoolError(
            f"the shared host pool needs {format_bytes(layout.total_bytes)} in {path}, and "
            f"reserving it failed ({exc}); {os.path.dirname(path)} has "
            f"{format_bytes(stats.f_bavail * stats.f_frsize)} free. Lower host_pool_tokens, "
            "or enlarge /dev/shm (mount -o remount,size=...; docker --shm-size)") from exc


def _open_ready(path: str, layout: SegmentLayout) -> int | None:
    """An fd of the segment once its creator marked it ready, else None (not yet there)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    size = os.fstat(fd).st_size
    if size >= SLOTS_AT:
        with mmap.mmap(fd, SLOTS_AT, flags=mmap.MAP_SHARED) as view:
            ready = np.frombuffer(view, dtype=np.int64, count=F_READY + 1)[F_READY] == 1
        if ready:
            return fd
    os.close(fd)
    return None


@contextmanager
def _flocked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _same_file(fd: int, path: str) -> bool:
    """Whether `path` still names the file open as `fd` (a reclaimed name names a new one)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _unlink(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)
