"""The host pool: every layer's KV rows in backend host memory, handed out in extents.

A request owns whole extents of `extent_tokens` consecutive rows; token `p` of a request lives
at row `extents[p // E] * E + p % E` in every layer. Keeping a request's rows physically
adjacent is what makes the zero-copy gather fast (measured on an H200: 46 GB/s from 512-token
extents against 18 GB/s from rows scattered one by one over a 44 GiB pool), so the allocator
extends a request's last extent when the next one is free and otherwise takes the lowest run
that fits whole.

An extent can have several holders (requests that share a prefix, retained prefixes:
core/prefixes.py): the pool counts them and frees an extent when its last holder lets go.

The rows may live in a segment the tensor-parallel ranks of a node share (core/shared_pool.py):
then only the writer rank copies rows in (`writes_rows`), and `decisions`, a running digest
of every allocation, lets the ranks check that their allocators agree.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hisparse.backends._host_memory import available_host_bytes, format_bytes
from hisparse.backends.base import Backend
from hisparse.errors import HostAllocationError, InvalidInputError, PoolExhaustedError

if TYPE_CHECKING:
    from hisparse.core.shared_segment import SharedSegment


class ExtentAllocator:
    """Free extents kept as sorted, maximal runs `(start, length)` of consecutive extent ids."""

    def __init__(self, num_extents: int) -> None:
        if num_extents < 1:
            raise InvalidInputError(
                f"a host pool needs at least one extent, got {num_extents}; "
                "raise host_pool_tokens"
            )
        self.num_extents = num_extents
        self._run_starts: list[int] = [0]  # sorted; a run is never adjacent to another
        self._run_length: dict[int, int] = {0: num_extents}
        self._free = num_extents

    @property
    def free_extents(self) -> int:
        return self._free

    @property
    def used_extents(self) -> int:
        return self.num_extents - self._free

    def free_runs(self) -> list[tuple[int, int]]:
        return [(start, self._run_length[start]) for start in self._run_starts]

    def is_free(self, extent: int) -> bool:
        index = bisect.bisect_right(self._run_starts, extent) - 1
        if index < 0:
            return False
        start = self._run_starts[index]
        return extent < start + self._run_length[start]

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """Take `count` extents, continuing right after extent `after` where that one is free.

        The caller checks `free_extents` first; asking for more than is free is a bug here.
        """
        if count > self._free:
            raise AssertionError(f"allocate({count}) with only {self._free} extents free")
        taken: list[int] = []
        if after is not None and (after + 1) in self._run_length:
            taken += self._take(after + 1, count)
        remaining = count - len(taken)
        if remaining:
            whole = next((s for s in self._run_starts if self._run_length[s] >= remaining), None)
            if whole is not None:
                taken += self._take(whole, remaining)
            else:
                # Fragmented pool: the longest runs first keep the request in the fewest pieces.
                by_length = sorted(self._run_starts, key=lambda s: (-self._run_length[s], s))
                for start in by_length:
                    taken += self._take(start, remaining)
                    remaining = count - len(taken)
                    if not remaining:
                        break
        return taken

    def release(self, extents: Iterable[int]) -> None:
        """Return extents to the free runs; every one must be allocated and listed once."""
        ordered = sorted(extents)
        bad = [
            e for i, e in enumerate(ordered)
            if not 0 <= e < self.num_extents or self.is_free(e) or (i and ordered[i - 1] == e)
        ]
        if bad:
            raise InvalidInputError(
                f"cannot release extents {bad[:8]}: out of range, already free or listed twice; "
                "this is a double free in the caller"
            )
        for start, length in _runs_of(ordered):
            self._insert_run(start, length)
        self._free += len(ordered)

    def _take(self, start: int, count: int) -> list[int]:
        length = self._run_length.pop(start)
        self._run_starts.pop(bisect.bisect_left(self._run_starts, start))
        used = min(count, length)
        if used < length:
            self._run_length[start + used] = length - used
            bisect.insort(self._run_starts, start + used)
        self._free -= used
        return list(range(start, start + used))

    def _insert_run(self, start: int, length: int) -> None:
        index = bisect.bisect_left(self._run_starts, start)
        if index > 0:
            before = self._run_starts[index - 1]
            if before + self._run_length[before] == start:  # merge with the run on the left
                start, length = before, length + self._run_length.pop(before)
                self._run_starts.pop(index - 1)
                index -= 1
        after = start + length
        if after in self._run_length:  # merge with the run on the right
            length += self._run_length.pop(after)
            self._run_starts.pop(index)
        self._run_starts.insert(index, start)
        self._run_length[start] = length


def _runs_of(sorted_ids: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for extent in sorted_ids:
        if runs and runs[-1][0] + runs[-1][1] == extent:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((extent, 1))
    return runs


def token_rows(extents: Sequence[int], extent_tokens: int, start: int, stop: int) -> np.ndarray:
    """Host rows (int64) of tokens `start..stop-1` of a request that owns `extents`."""
    positions = np.arange(start, stop, dtype=np.int64)
    pages = np.asarray(extents, dtype=np.int64)[positions // extent_tokens]
    return pages * extent_tokens + positions % extent_tokens


def token_runs(
    extents: Sequence[int], extent_tokens: int, start: int, stop: int
) -> list[tuple[int, int, int]]:
    """Tokens `start..stop-1` as maximal runs of adjacent host rows: `(token, row, length)`."""
    runs: list[tuple[int, int, int]] = []
    token = start
    while token < stop:
        page, offset = divmod(token, extent_tokens)
        row = extents[page] * extent_tokens + offset
        length = min(stop, (page + 1) * extent_tokens) - token
        if runs and runs[-1][1] + runs[-1][2] == row:
            first_token, first_row, old_length = runs[-1]
            runs[-1] = (first_token, first_row, old_length + length)
        else:
            runs.append((token, row, length))
        token += length
    return runs


@dataclass(frozen=True)
class LayerRegion:
    """Where one layer's host rows live, for a transfer engine: row `n` is at
    `base_address + n * row_bytes`."""

    layer: int
    base_address: int
    num_bytes: int


@dataclass(frozen=True)
class HostReservation:
    """Host rows reserved for a request whose KV another node will write (PD decode side).

    `rows[i]` is the host row of token `prefix_tokens + i` in every layer: the rows the
    transfer engine writes. `extents` lists the same rows as `(first_row, num_rows)` runs,
    for transfer engines that take contiguous regions. `host_tensors[l]` is layer `l`'s
    whole `[N, W]` uint8 pool tensor. `prefix_tokens` (0 unless reserved with a shared
    prefix) tokens are already on the host: their rows are shared, and must not be written.
    """

    request_id: object
    num_tokens: int
    row_bytes: int
    extents: list[tuple[int, int]]
    rows: np.ndarray
    layers: list[LayerRegion]
    host_tensors: list[torch.Tensor]
    prefix_tokens: int = 0


class HostPool:
    """One `[N, W]` uint8 host tensor per layer, from `backend.alloc_host` (or the layers of a
    shared segment, registered by the caller), plus the allocator."""

    def __init__(
        self,
        backend: Backend,
        num_layers: int,
        num_extents: int,
        extent_tokens: int,
        row_bytes: int,
        segment: SharedSegment | None = None,
        writes_rows: bool = True,
    ) -> None:
        self.backend = backend
        self.segment = segment
        # False on a shared pool's readers: the writer rank copies every row in once.
        self.writes_rows = writes_rows
        self.before_close: Callable[[], None] | None = None  # a shared pool's publisher
        self.decisions = 0  # a running digest of allocate/share/release (same on every rank)
        self.extent_tokens = extent_tokens
        self.row_bytes = row_bytes
        self.num_rows = num_extents * extent_tokens
        self.allocator = ExtentAllocator(num_extents)
        # Holders of each extent (0 = free): a request, or a retained prefix, each counts once.
        self._holders = [0] * num_extents
        self._shared = 0  # extents with two or more holders: stats() is cheap while none are
        self._raw: list[torch.Tensor] = []
        self.layers: list[torch.Tensor] = []
        layer_bytes = self.num_rows * row_bytes
        if segment is not None:
            self.layers.extend(segment.layers)
            return
        # One buffer per layer, but the config sizes them together: a failure names the total.
        needs = (f"the host pool needs {format_bytes(num_layers * layer_bytes)} in all "
                 f"({num_layers} layers x {self.num_rows} rows x {row_bytes} B; the rows are "
                 f"host_pool_tokens rounded up to whole {extent_tokens}-token extents)")
        advice = "lower host_pool_tokens (rows per layer) or free host memory"
        available = available_host_bytes()
        if available is not None and num_layers * layer_bytes > available:
            # Each layer's buffer may fit on its own and the pool still not: plain memory is
            # overcommitted, and the process would be killed when the rows are written.
            raise HostAllocationError(
                f"{needs}, but only {format_bytes(available)} of host memory is available; "
                f"{advice}.")
        try:
            for _ in range(num_layers):
                self._raw.append(backend.alloc_host(layer_bytes))
        except HostAllocationError as exc:
            allocated = len(self._raw)
            self.close()  # a half-built pool must not keep what it got
            raise HostAllocationError(
                f"{needs}; layer {allocated}'s buffer of {format_bytes(layer_bytes)} failed "
                f"after {allocated} of {num_layers} layers were allocated ({exc}); "
                f"{advice}.") from exc
        except BaseException:
            self.close()  # a half-built pool must not keep what it got
            raise
        self.layers.extend(raw.view(self.num_rows, row_bytes) for raw in self._raw)

    @property
    def num_extents(self) -> int:
        return self.allocator.num_extents

    def extents_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.extent_tokens)

    @property
    def shared_extents(self) -> int:
        """Extents that two or more holders hold."""
        return self._shared

    def holders(self, extent: int) -> int:
        return self._holders[extent]

    def allocate(self, num_extents: int, after: int | None = None) -> list[int]:
        """Take extents for one holder; raises PoolExhaustedError, allocating nothing."""
        self.check_free(num_extents)
        taken = self.allocator.allocate(num_extents, after)
        for extent in taken:
            self._holders[extent] = 1
        self.decisions = hash((self.decisions, 1, *taken))  # ints hash alike in every process
        return taken

    def share(self, extents: Iterable[int]) -> None:
        """One more holder for each extent, all of them already held."""
        extents = list(extents)
        idle = [e for e in extents if not 0 <= e < self.num_extents or not self._holders[e]]
        if idle:  # a bug in the engine, not a caller's input: sharing a free extent
            raise AssertionError(f"share of extents {idle[:8]} that nobody holds")
        for extent in extents:
            self._holders[extent] += 1
            self._shared += self._holders[extent] == 2
        self.decisions = hash((self.decisions, 2, *extents))

    def check_free(self, num_extents: int) -> None:
        free = self.allocator.free_extents
        if num_extents > free:
            e = self.extent_tokens
            raise PoolExhaustedError(
                f"host pool exhausted: asked for {num_extents} extents ({num_extents * e} tokens), "
                f"{free} of {self.num_extents} are free ({free * e} of {self.num_rows} tokens per "
                "layer); finish, abort or preempt requests, or raise host_pool_tokens"
            )

    def release(self, extents: Iterable[int]) -> list[int]:
        """One holder lets go of each extent; returns those it was the last holder of, freed.

        Checked whole before anything changes: an extent nobody holds, or listed twice (one
        holder never holds an extent twice), is a double free and changes nothing.
        """
        extents = list(extents)
        listed = Counter(extents)
        bad = sorted(
            e for e, n in listed.items()
            if n > 1 or not 0 <= e < self.num_extents or self._holders[e] < 1
        )
        if bad:
            raise InvalidInputError(
                f"cannot release extents {bad[:8]}: out of range, already free or listed twice; "
                "this is a double free in the caller"
            )
        freed = []
        for extent in extents:
            self._holders[extent] -= 1
            self._shared -= self._holders[extent] == 1
            if not self._holders[extent]:
                freed.append(extent)
        self.allocator.release(freed)
        self.decisions = hash((self.decisions, 3, *extents))
        return freed

    def region(self, layer: int) -> LayerRegion:
        tensor = self.layers[layer]
        return LayerRegion(layer, int(tensor.data_ptr()), tensor.numel())

    def write_rows(self, layer: int, extents: Sequence[int], start: int,
                   rows: torch.Tensor) -> None:
        """Copy `rows` `[T, W]` to tokens `start .. start+T-1` of a request holding `extents`,
        in `layer` (asynchronously from device memory)."""
        if not self.writes_rows:
            return  # a shared pool's reader: the writer rank writes these rows
        host, count = self.layers[layer], rows.shape[0]
        for token, row, length in token_runs(extents, self.extent_tokens, start, start + count):
            host[row : row + length].copy_(rows[token - start : token - start + length],
                                           non_blocking=True)

    def write_layers(self, layers: Sequence[int], extents: Sequence[int], start: int,
                     rows: torch.Tensor) -> None:
        """`write_rows` for each of `layers`, from `rows` `[len(layers), T, W]` (one layer:
        `[T, W]` too)."""
        rows = rows if rows.dim() == 3 else rows[None]
        for index, layer in enumerate(layers):
            self.write_rows(layer, extents, start, rows[index])

    def reservation(self, request_id: object, extents: Sequence[int], num_tokens: int,
                    prefix_tokens: int = 0) -> HostReservation:
        """Where a transfer engine writes rows `prefix_tokens .. num_tokens - 1` of
        `extents` (the rows before are a shared prefix's, already in the pool)."""
        E = self.extent_tokens
        return HostReservation(
            request_id=request_id,
            num_tokens=num_tokens,
            row_bytes=self.row_bytes,
            extents=[(row, n) for _, row, n in token_runs(extents, E, prefix_tokens,
                                                          num_tokens)],
            rows=token_rows(extents, E, prefix_tokens, num_tokens),
            layers=[self.region(layer) for layer in range(len(self.layers))],
            host_tensors=list(self.layers),
            prefix_tokens=prefix_tokens,
        )

    def close(self) -> None:
        """Free every buffer exactly once; safe to call again."""
        if self.before_close is not None:
            hook, self.before_close = self.before_close, None
            hook()
        raw, self._raw = self._raw, []
        # Emptied in place: the engine's CacheTables.host_kv is this same list, and a view
        # left in it would keep its buffer's memory alive after close.
        self.layers.clear()
        for buffer in raw:
            self.backend.free_host(buffer)
        segment, self.segment = self.segment, None
        if segment is not None and not segment.closed:
            try:
                self.backend.unregister_host(segment.mapping, shared=True)
            finally:
                segment.close()
