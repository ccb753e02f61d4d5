"""`HiSparseCache`: the hierarchical sparse KV cache a serving framework drives.

Full KV lives in the host pool; each running request owns a device request slot with `H` LRU
hot slots per index group plus slot `H` for its newest token (docs/ARCHITECTURE.md). This
module holds the policy: request lifecycle, seeding, the decode step, and which kernel runs on
which stream. The per-entry work is the backend's swap-in kernel.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import torch

from hisparse.backends.base import Backend
from hisparse.core.host_pool import HostPool, HostReservation, token_rows, token_runs
from hisparse.core.prefixes import PrefixHandle, PrefixRegistry, PrefixRows
from hisparse.core.requests import (
    PromptCoverage,
    RequestRecord,
    RequestState,
    RequestTable,
    SlotAllocator,
)
from hisparse.core.stats import CacheStats, Occupancy, TrafficCounters
from hisparse.core.tables import CacheTables, residency_dtype
from hisparse.core.validation import (
    as_rows,
    check_batch_rows,
    check_positions_against_lengths,
    check_tensor,
    same_device,
)
from hisparse.errors import ConfigError, HisparseError, InvalidInputError, RequestStateError
from hisparse.kernels.backup_reference import backup_newest_reference

LIVE = (RequestState.RESERVED, RequestState.PREFILLING, RequestState.RUNNING,
        RequestState.PREEMPTED)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _bookkeeping(
    method: Callable[Concatenate[HiSparseCache, _P], _R],
) -> Callable[Concatenate[HiSparseCache, _P], _R]:
    """Run a call under the cache's bookkeeping lock.

    A scheduler thread may admit, finish, preempt and read statistics while the model thread
    decodes (docs/reliability.md). Every call that reads or changes request records, the pool
    allocator or the step state takes the lock; the per-layer `write_newest` and `swap_in`
    do not: they touch only the open step's own slots and rows, which no locked call may
    change while the step is open.
    """

    @functools.wraps(method)
    def locked(self: HiSparseCache, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


@dataclass(frozen=True)
class DecodeStep:
    """The open decode step. Device tensors are the engine's persistent `[Bcap]` buffers."""

    request_ids: tuple[Hashable, ...]
    positions: tuple[int, ...]  # position of each request's new token (its seq_len - 1)
    req_slots: torch.Tensor  # [Bcap] int32 request slot per batch row (0 for padding)
    num_real: torch.Tensor  # [1] int32
    newest_rows: torch.Tensor  # [Bcap] int32 device row the new token is written to

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)


class HiSparseCache:
    """A hierarchical sparse KV cache on one device.

    Args:
        config: a `hisparse.HiSparseConfig`; feature flags are resolved against the backend
            (features it lacks are turned off with a `FeatureDisabledWarning`).
        device: None (the best backend here), a backend name or device string ("cuda:1"),
            a `torch.device`, or a `Backend`.

    Raises:
        ConfigError, UnsupportedFeatureError: from resolving the config on this backend.
        HostAllocationError: the host pool could not be allocated (nothing is kept).

    Example:
        >>> cache = HiSparseCache(HiSparseConfig.from_preset("tiny"), device="cpu")
        >>> cache.admit("r0", 100); cache.write_prefill("r0", kv); cache.commit_prefill("r0")
    """

    # Every table is a normal tensor even when the cache is built under torch.inference_mode():
    # inference mode is per thread, and an inference tensor refuses in-place updates outside
    # it, so a cache built on a model thread in inference mode could not be driven from a
    # scheduler thread (begin_decode_step failed halfway through). Normal tensors may be
    # updated in place inside inference mode too.
    @torch.inference_mode(False)
    def __init__(self, config: Any, device: str | torch.device | Backend | None = None) -> None:
        from hisparse.backends.registry import get_backend
        from hisparse.config import HiSparseConfig, resolve_features

        if not isinstance(config, HiSparseConfig):
            raise ConfigError(
                f"config must be a HiSparseConfig, got {type(config).__name__} {config!r:.80}; "
                "build one with HiSparseConfig.from_preset(name, ...), from_yaml(path) or "
                "from_dict(mapping)"
            )
        backend = get_backend(device)
        config, disabled = resolve_features(config, backend)
        self.config = config
        self.backend = backend
        self.disabled_features = [str(f) for f in disabled]
        self.device = _concrete(_device_of(backend, device))

        self.num_layers = L = config.num_layers
        self.row_bytes = W = config.row_bytes
        self.top_k = K = config.top_k
        self.hot_slots = H = config.device_buffer_size or 2 * K
        self.slots_per_request = S = H + 1
        self.max_requests = R = config.max_requests
        self.batch_capacity = B = config.max_batch or R
        self.extent_tokens = E = config.extent_tokens
        self.max_seq_len = config.max_seq_len
        self.index_group_size = config.index_group_size
        self.num_groups = G = -(-L // config.index_group_size)
        num_extents = -(-config.host_pool_tokens // E)
        pages = -(-config.max_seq_len // E)

        # Streams and events belong to the device current at their creation: make it ours.
        with backend.device_scope(self.device):
            self._lock = threading.RLock()
            self._pool = HostPool(backend, L, num_extents, E, W)
            dev = self.device
            try:
                i32 = {"dtype": torch.int32, "device": dev}
                # Row R*S of every layer is a sink for padded batch rows' newest-token writes, so
                # write_newest stays one index_copy a captured graph can replay with any real count.
                self._padding_row = R * S
                self.tables = CacheTables(
                    device_kv=torch.zeros(L, R * S + 1, W, dtype=torch.uint8, device=dev),
                    host_kv=self._pool.layers,
                    page_table=torch.full((R, pages), -1, **i32),
                    seq_lens=torch.zeros(R, **i32),
                    slot_key=torch.full((G, R, H), -1, **i32),
                    last_use=torch.full((G, R, H), -1, **i32),
                    lru_clock=torch.zeros(G, R, **i32),
                    # Keyed by position: one entry per position of every request slot.
                    resident=torch.full(
                        (G, R * pages * E if config.residency_map == "position"
                         else self._pool.num_rows), -1, dtype=residency_dtype(H), device=dev),
                    counters=torch.zeros(L, 3, dtype=torch.int64, device=dev),
                    hot_slots=H,
                    extent_tokens=E,
                    residency_map=config.residency_map,
                    # What the fused backup kernel writes through (device-side on ROCm).
                    host_kv_addresses=torch.tensor(
                        [backend.device_address(layer) for layer in self._pool.layers],
                        dtype=torch.int64, device=dev),
                )
                self._req_slots = torch.zeros(B, **i32)
                self._num_real = torch.zeros(1, **i32)
                self._newest_rows = torch.full((B,), self._padding_row, **i32)
                self._newest_rows_long = self._newest_rows.long()
                self._newest_host_rows = torch.full((B,), -1, **i32)
                self._out = torch.full((G, B, K), -1, **i32)
                # Views of `_out` by (group, batch rows), made once: a view costs host time.
                self._out_rows: dict[tuple[int, int], torch.Tensor] = {}
                has_followers = config.index_group_size > 1
                self._anchor_delta = torch.zeros(G, 3, dtype=torch.int64, device=dev)

                # Asked for by name so that a backend without the feature raises here.
                if config.skip_io:
                    backend.skip_io_swap_in_kernel()
                elif config.zero_copy_swap_in:
                    backend.zero_copy_swap_in_kernel()
                self._launcher = backend.swap_in_launcher(
                    self.tables, self._req_slots, self._num_real, self._out,
                    record_plans=has_followers, skip_io=config.skip_io)
                # Fused backup kernels come with the GPU path; every backend has the reference.
                backup_kernel = getattr(backend, "backup_kernel", None)
                self._backup = backup_kernel() if backup_kernel else backup_newest_reference
                self._backup_stream = backend.backup_stream() if config.async_backup else None
                prefetch = config.shared_index_prefetch and has_followers
                self._prefetch_stream = backend.prefetch_stream() if prefetch else None
                self._backup_done = backend.new_event()
                self._step_written = backend.new_event()
                self._planned = [backend.new_event() for _ in range(G)]
                self._follower_ready = [backend.new_event() for _ in range(L)]
                self._replay_done = [backend.new_event() for _ in range(G)]
                # Cross-stream order for bookkeeping issued from another thread (its own stream):
                # slot tables are released or seeded only after the last step's kernels ran, and
                # a step starts only after the seeding it may read.
                self._step_done = backend.new_event()
                self._tables_changed = backend.new_event()
                self._host_io_pending = False  # async device<->host copies the CPU must not race
                # Freed host rows may still be read by a step in flight; their next writer waits.
                self._rows_recycled = False

                self._requests = RequestTable()
                self._prefixes = PrefixRegistry(self._pool, config.residency_map)
                self._slots = SlotAllocator(R)
                self._traffic = TrafficCounters(L)
                self._step: DecodeStep | None = None
                self._step_records: list[RequestRecord] = []
                self._step_grew: set[int] = set()  # id() of the step's records given an extent
                # group -> batch rows its anchor swapped in during the open step (followers match)
                self._anchored: dict[int, int] = {}
                # group -> the top-k tensor its anchor swapped in (validate compares followers')
                self._anchor_top_k: dict[int, torch.Tensor] = {}
                # group -> followers whose side-stream replay no swap_in of theirs waited for
                self._unwaited_replays: dict[int, set[int]] = {}
                self._pending_replay: dict[int, set[int]] = {}  # group -> followers not yet copied
                self._written_layers: set[int] = set()  # layers given write_newest this step
                self._closed = False
                # Why a kernel launch failed part way through a decode call, if one did.
                self._failed_launch: str | None = None
            except BaseException:
                # Nothing half-built may keep host memory: free every buffer allocated so far.
                self._pool.close()
                raise

    # --- admission and prefill ------------------------------------------------------------
    @_bookkeeping
    def admit(self, request_id: Hashable, num_tokens: int,
              prefix: PrefixHandle | tuple[Hashable, int] | None = None) -> None:
        """Take host extents for a `num_tokens` prompt and a device request slot.

        `prefix`: the prompt's first tokens are already in the host pool, as a `PrefixHandle`
        from `retain_prefix` or `(request_id, num_tokens)` of a running or preempted request.
        Their whole extents are shared, the boundary extent's rows are copied, and
        `write_prefill` writes only the rows after the prefix (needs `residency_map:
        position`; docs/integration.md, "Shared prefixes").

        Raises:
            RequestStateError: the id is live, or the prefix's request cannot share now.
            InvalidInputError: bad `num_tokens` or `prefix`.
            PoolExhaustedError: no slot or too few extents (nothing is taken).
        """
        self._check_open()
        self._requests.check_new(request_id, "admit")
        self._check_length(num_tokens, "admit")
        shared = self._shared_prefix(prefix, f"admit request {request_id!r}")
        self._slots.check_free(f"admitting request {request_id!r}")
        extents = self._prefixes.extents_for_new(shared, num_tokens, self._drain_host_io,
                                                 f"admit request {request_id!r}")
        prefix_tokens = shared.num_tokens if shared else 0
        record = RequestRecord(request_id, RequestState.PREFILLING, num_tokens, num_tokens,
                               extents, self._slots.take(),
                               PromptCoverage(self.num_layers, num_tokens, prefix_tokens),
                               prefix_tokens)
        self._requests.add(record)

    @_bookkeeping
    def reserve_host_slots(self, request_id: Hashable, num_tokens: int,
                           prefix: PrefixHandle | tuple[Hashable, int] | None = None,
                           ) -> HostReservation:
        """PD decode side: reserve host rows a transfer engine will write; no device slot yet.

        Write token `res.prefix_tokens + i` of layer `l` to `res.host_tensors[l][res.rows[i]]`
        (or at `res.layers[l].base_address + res.rows[i] * res.row_bytes`), then
        `complete_transfer`. `prefix` as for `admit`: those tokens are not transferred.
        """
        self._check_open()
        self._requests.check_new(request_id, "reserve host slots for")
        self._check_length(num_tokens, "reserve host slots for")
        action = f"reserve host slots for request {request_id!r}"
        shared = self._shared_prefix(prefix, action)
        self._prefixes.check_room(shared, num_tokens, action)
        # The transfer engine writes the rows once this returns: a backup or a swap-in of
        # their previous owner may still be touching them. Drained before anything is taken,
        # so that a drain that fails leaves no reservation behind.
        self._drain_host_io()
        extents = self._prefixes.extents_for_new(shared, num_tokens, self._drain_host_io, action)
        first = shared.num_tokens if shared else 0
        record = RequestRecord(request_id, RequestState.RESERVED, num_tokens, num_tokens, extents,
                               prefix_tokens=first)
        self._requests.add(record)
        E = self.extent_tokens
        return HostReservation(
            request_id=request_id,
            num_tokens=num_tokens,
            row_bytes=self.row_bytes,
            extents=[(row, n) for _, row, n in token_runs(extents, E, first, num_tokens)],
            rows=token_rows(extents, E, first, num_tokens),
            layers=[self._pool.region(layer) for layer in range(self.num_layers)],
            host_tensors=list(self._pool.layers),
            prefix_tokens=first,
        )

    @_bookkeeping
    def retain_prefix(self, source: Hashable | PrefixHandle, num_tokens: int) -> PrefixHandle:
        """Keep the host rows of the first `num_tokens` tokens of `source` (a running or
        preempted request's id, or a `PrefixHandle` to cut a shorter prefix from) for
        requests admitted later with `prefix=handle`, until `release_prefix(handle)`.

        Nothing is copied: the rows are shared by reference, and the request goes on
        decoding (its next token lands in an extent of its own). A prefix cache's node maps
        onto one handle (docs/integration.md). Needs `residency_map: position`.

        Raises:
            UnknownRequestError, RequestStateError: no such live request, or it is
                prefilling, reserved, or part of the open decode step.
            InvalidInputError: `num_tokens` not in 1..its length; another cache's handle.
        """
        self._check_open()
        return self._prefixes.retain(source, num_tokens, self._requests, self._in_step)

    @_bookkeeping
    def release_prefix(self, handle: PrefixHandle) -> None:
        """Give back a retained prefix. Requests admitted on it keep their rows (they hold
        them too); extents no request or other prefix holds are freed.

        Raises InvalidInputError for anything but a handle this cache retains (a second
        release raises RequestStateError); nothing changes then.
        """
        self._check_open()
        if self._prefixes.release(handle):
            self._rows_recycled = True  # a step in flight may still read the freed rows

    def _shared_prefix(self, prefix: object, action: str) -> PrefixRows | None:
        if prefix is None:
            return None
        return self._prefixes.resolve(prefix, self._requests, self._in_step, action)

    def _in_step(self, record: RequestRecord) -> bool:
        return self._step is not None and any(r is record for r in self._step_records)

    @_bookkeeping
    def write_prefill(
        self, request_id: Hashable, kv: torch.Tensor, layer: int | None = None, start: int = 0
    ) -> None:
        """Write prompt rows `start .. start+T-1` to the host: `kv` is `[T, W]` for one layer
        or `[L, T, W]` for all; any dtype whose last dimension is one row of `W` bytes."""
        self._check_open()
        record = self._requests.expect(
            request_id, "write prefill for", (RequestState.PREFILLING, RequestState.RESERVED)
        )
        if layer is not None:
            self._check_layer(layer)
        rows = as_rows("kv", kv, self.row_bytes, 2 if layer is not None else 3)
        if rows.device.type != "cpu" and not same_device(rows.device, self.device):
            raise InvalidInputError(
                f"kv is on {rows.device}; prefill rows come from the host (cpu) or the cache's "
                f"device {self.device}: move it to one of those first"
            )
        if layer is None and rows.shape[0] != self.num_layers:
            raise InvalidInputError(
                f"kv holds {rows.shape[0]} layers, the cache has {self.num_layers}; pass "
                "[L, T, W] for all layers, or [T, W] with layer=..."
            )
        count = rows.shape[-2]
        if not _is_count(start) or start < 0:
            raise InvalidInputError(
                f"start must be a plain int >= 0 (the position of kv's first row), got "
                f"{start!r}"
            )
        if start + count > record.admitted_tokens:
            raise InvalidInputError(
                f"prefill rows {start}..{start + count - 1} of request {request_id!r} fall "
                f"outside the {record.admitted_tokens} tokens it was admitted with; admit the "
                "full prompt length"
            )
        if start < record.prefix_tokens and count:
            # Those rows are shared with other holders, or copied from them: already written.
            raise InvalidInputError(
                f"prefill rows {start}..{start + count - 1} of request {request_id!r} start "
                f"inside its shared prefix of {record.prefix_tokens} tokens, which is on the "
                f"host already and never written; pass the rows from "
                f"start={record.prefix_tokens} (kv[..., {record.prefix_tokens}:, :] of a whole "
                "prompt's KV)"
            )
        self._drain_host_io()
        layers = [layer] if layer is not None else range(self.num_layers)
        runs = token_runs(record.extents, self.extent_tokens, start, start + count)
        for index, target in enumerate(layers):
            source = rows if layer is not None else rows[index]
            host = self._pool.layers[target]
            for token, row, length in runs:
                part = source[token - start : token - start + length]
                host[row : row + length].copy_(part, non_blocking=True)
            self._traffic.offloaded_tokens[target] += count
            if record.prompt_written is not None:
                record.prompt_written.add(target, start, start + count)
        if rows.device != self._pool.layers[0].device:
            self._host_io_pending = True  # device-to-host copies may still be landing

    @_bookkeeping
    def commit_prefill(self, request_id: Hashable) -> None:
        """Seed the hot buffer from the written prompt; the request can decode."""
        self._check_open()
        record = self._requests.expect(request_id, "commit prefill for",
                                       (RequestState.PREFILLING,))
        gap = record.prompt_written.first_gap() if record.prompt_written else None
        if gap is not None:
            layer, start, end = gap
            raise InvalidInputError(
                f"prompt rows {start}..{end - 1} of layer {layer} of request {request_id!r} "
                f"were never written; call write_prefill for all {record.admitted_tokens} "
                "prompt rows of every layer first (an unwritten row holds what its previous "
                "owner left there)"
            )
        self._seed(record)
        record.prompt_written = None

    @_bookkeeping
    def complete_transfer(self, request_id: Hashable) -> None:
        """PD: the reserved rows have been written; take a device slot, seed, decode.

        Raises PoolExhaustedError when no device slot is free (the request stays reserved).
        """
        self._check_open()
        record = self._requests.expect(request_id, "complete the transfer of",
                                       (RequestState.RESERVED,))
        self._seed_into_new_slot(record, f"completing the transfer of request {request_id!r}")

    # --- decode ---------------------------------------------------------------------------
    def begin_decode_step(self, request_ids: Sequence[Hashable]) -> DecodeStep:
        """Append one token to each request and set the batch buffers the step's kernels read.

        Raises:
            RequestStateError: a step is open, or a request is not running.
            InvalidInputError: empty, duplicated or over-capacity batch, or max_seq_len reached;
                or the calling thread's current device is not the cache's.
            PoolExhaustedError: a request needs a new extent and the pool has too few free.
        """
        # Checked once a step, not per layer: write_newest and swap_in launch on the current
        # device and stay cheap, so the thread that drives the step must have ours current.
        current = self.backend.current_device()
        if current is not None and current != self.device:
            raise InvalidInputError(
                f"this cache lives on {self.device} but the current device of the thread "
                f"driving the decode step is {current}; make {self.device} current first "
                f"(torch.{self.device.type}.set_device({self.device.index}), or run the step "
                f"under torch.{self.device.type}.device({self.device.index}))"
            )
        return self._begin_decode_step(request_ids)

    @_bookkeeping
    def _begin_decode_step(self, request_ids: Sequence[Hashable]) -> DecodeStep:
        self._check_open()
        self._check_decodable("begin a decode step")
        if self._step is not None:
            raise RequestStateError(
                "a decode step is already open; call end_decode_step() before the next one"
            )
        try:
            # A set or a mapping has no order to give the batch rows.
            unordered = isinstance(request_ids, str | bytes | AbstractSet | Mapping)
            ids = None if unordered else list(request_ids)
        except TypeError:
            ids = None
        if ids is None:
            raise InvalidInputError(
                f"request_ids must be a list or tuple of request ids, got "
                f"{type(request_ids).__name__} {request_ids!r}; wrap a single id in a list"
            )
        if not 1 <= len(ids) <= self.batch_capacity:
            raise InvalidInputError(
                f"a decode step takes 1..{self.batch_capacity} requests (max_batch), got "
                f"{len(ids)}; split the batch or raise max_batch"
            )
        records = [self._requests.expect(i, "decode", (RequestState.RUNNING,)) for i in ids]
        if len({id(r) for r in records}) != len(records):
            raise InvalidInputError(
                f"request ids repeat in the decode batch {ids!r}; list each request once"
            )
        grow = [r for r in records if r.num_tokens + 1 > len(r.extents) * self.extent_tokens]
        full = [r.request_id for r in records if r.num_tokens + 1 > self.max_seq_len]
        if full:
            raise InvalidInputError(
                f"requests {full!r} already hold max_seq_len={self.max_seq_len} tokens; "
                "finish them or raise max_seq_len"
            )
        # Requests whose new token would land in an extent a retained prefix holds too: each
        # moves to a private copy of that extent first (core/prefixes.py).
        unshare = self._prefixes.writers_in(records)
        self._pool.check_free(len(grow) + len(unshare))
        if unshare:
            self._drain_host_io()  # the copied rows' last backup may still be landing

        H, S, E = self.hot_slots, self.slots_per_request, self.extent_tokens
        # The records change only once the step's updates are on their way to the device: a
        # failed upload (a device out of memory) leaves the step unopened and retryable.
        grown: dict[int, list[int]] = {}  # id(record) -> its extents with a new last one
        try:
            page_updates: list[tuple[int, int, int]] = []
            for record in grow:
                extents = grown[id(record)] = record.extents + self._pool.allocate(
                    1, after=record.extents[-1])
                page_updates.append((record.slot, len(extents) - 1, extents[-1]))
            for record in unshare:
                extents = grown[id(record)] = [*record.extents[:-1],
                                               self._prefixes.private_copy(record)]
                page_updates.append((record.slot, len(extents) - 1, extents[-1]))
            short_updates: list[tuple[int, int, int]] = []  # (slot, hot slot, host row)
            newest_rows, host_rows, positions = [], [], []
            for record in records:
                position = record.num_tokens  # the new token's
                extents = grown.get(id(record), record.extents)
                row = extents[position // E] * E + position % E
                positions.append(position)
                host_rows.append(row)
                if position < H:  # short: the token's own slot, tracked for the switch
                    newest_rows.append(record.slot * S + position)
                    short_updates.append((record.slot, position, row))
                else:
                    newest_rows.append(record.slot * S + H)
            batch = len(records)
            pad = self.batch_capacity - batch
            slots = [r.slot for r in records]
            uploaded = self._upload(
                [slots + [0] * pad, [batch], newest_rows + [self._padding_row] * pad,
                 host_rows + [-1] * pad, slots, [p + 1 for p in positions],
                 *zip(*page_updates, strict=True), *zip(*short_updates, strict=True)]
            )
        except BaseException:
            for extents in grown.values():
                self._pool.release(extents[-1:])
            raise
        for record in grow:
            record.extents.append(grown[id(record)][-1])
        for record in unshare:  # kept by cancel_decode_step too: the same rows, now private
            self._prefixes.moved(record, grown[id(record)][-1])
        for record in records:
            record.num_tokens += 1
        self._step_grew = {id(record) for record in grow}
        t = self.tables
        # The previous step's backup (maybe still running on its side stream) reads the batch
        # buffers, and the new token's slot H still holds the token it is copying out.
        self.backend.wait_event(self._backup_done, self.device)
        # Seeding may have run on another thread's stream.
        self.backend.wait_event(self._tables_changed, self.device)
        self._req_slots.copy_(uploaded[0])
        self._num_real.copy_(uploaded[1])
        self._newest_rows.copy_(uploaded[2])
        self._newest_rows_long.copy_(uploaded[2])
        self._newest_host_rows.copy_(uploaded[3])
        t.seq_lens[uploaded[4].long()] = uploaded[5]
        rest = uploaded[6:]
        if page_updates:
            slot_index, page_index, extent = rest[:3]
            t.page_table[slot_index.long(), page_index.long()] = extent
            rest = rest[3:]
        if short_updates:
            slot_index, hot_slot, row = (x.long() for x in rest[:3])
            key = t.residency_keys(slot_index, hot_slot, row)  # short: hot slot = position
            t.slot_key[:, slot_index, hot_slot] = key.to(torch.int32)
            t.resident[:, key] = hot_slot.to(t.resident.dtype)
        self._step = DecodeStep(tuple(ids), tuple(positions), self._req_slots, self._num_real,
                                self._newest_rows)
        self._step_records = records
        self._anchored.clear()
        self._written_layers.clear()
        return self._step

    def write_newest(self, layer: int, kv: torch.Tensor) -> None:
        """Write the new token's row of `layer` for every request of the step: `kv [B, W]`,
        B between the step's request count and `max_batch` (padding rows are dropped)."""
        step = self._open_step("write_newest")
        self._check_layer(layer)
        rows = as_rows("kv", kv, self.row_bytes, 2)
        check_tensor("kv", kv, device=self.device)
        check_batch_rows("kv", rows.shape[0], step.batch_size, self.batch_capacity)
        self.tables.device_kv[layer].index_copy_(
            0, self._newest_rows_long[: rows.shape[0]], rows
        )
        self._written_layers.add(layer)

    def swap_in(self, layer: int, top_k: torch.Tensor) -> torch.Tensor:
        """Map each top-k position to the device row holding it, loading the misses.

        Args:
            layer: the KV layer attention is about to read.
            top_k: `[B, K]` int32 positions on the cache's device, -1 = none; B between the
                step's request count and `max_batch` (rows past the real count are padding).

        Returns:
            `[B, K]` int32 rows of `device_kv(layer)` (-1 for none, invalid and padding). The
            tensor is a view of a buffer reused by the group's next call; layers of one index
            group return the anchor's result.
        """
        step = self._open_step("swap_in")
        self._check_layer(layer)
        check_tensor("top_k", top_k, dtype=torch.int32, device=self.device, ndim=2)
        rows = top_k.shape[0]
        check_batch_rows("top_k", rows, step.batch_size, self.batch_capacity)
        if top_k.shape[1] != self.top_k:
            raise InvalidInputError(
                f"top_k has {top_k.shape[1]} columns, the cache was built for top_k="
                f"{self.top_k}; pad rows with -1 to {self.top_k} columns"
            )
        group = layer // self.index_group_size
        anchor = group * self.index_group_size
        if layer != anchor:
            return self._follow(layer, group, anchor, top_k)
        if self.config.validate:
            check_positions_against_lengths(
                top_k, [r.num_tokens for r in self._step_records], step.request_ids
            )
        records_plan = self._launcher.plans is not None
        if records_plan:
            self._flush_replays(group)
            # The side stream reads the plan.
            self.backend.wait_event(self._replay_done[group], self.device)
            counts_before = self.tables.counters[layer].clone()
        # The kernels run over the B rows the caller passed, not over `max_batch`: a caller
        # that captures one graph per batch size gets small grids (and the kernels' small-batch
        # paths) for small batches.
        try:  # (a try costs nothing until it catches; a context manager would, per layer)
            self._launcher.swap_in(layer, group, rows, top_k)
        except BaseException as exc:
            self._launch_failed(f"swap_in({layer})", exc)
            raise
        self._anchored[group] = rows
        self._anchor_top_k[group] = top_k
        if records_plan:
            torch.sub(self.tables.counters[layer], counts_before, out=self._anchor_delta[group])
            self._issue_replays(group)
        return self._out_view(group, rows)

    def _out_view(self, group: int, rows: int) -> torch.Tensor:
        view = self._out_rows.get((group, rows))
        if view is None:
            view = self._out_rows[(group, rows)] = self._out[group][:rows]
        return view

    @_bookkeeping
    def end_decode_step(self) -> None:
        """Back every layer's new row up to its host row (on a side stream where supported)."""
        step = self._open_step("end_decode_step")
        if self.config.validate and len(self._written_layers) != self.num_layers:
            missing = sorted(set(range(self.num_layers)) - self._written_layers)
            raise RequestStateError(
                f"end_decode_step: layers {missing} got no write_newest in this step, so their "
                "host backup would store a stale row; call write_newest(layer, kv) for every "
                "layer first"
            )
        for group in list(self._pending_replay):
            self._flush_replays(group)
        if self._backup_stream is not None:
            self.backend.record_event(self._step_written, self.device)
            with self.backend.stream_scope(self._backup_stream):
                self.backend.wait_event(self._step_written, self.device)
                self._launch_backup()
                self.backend.record_event(self._backup_done, self.device)
            self._host_io_pending = True
        else:
            self._launch_backup()
        self._traffic.backed_up_tokens += step.batch_size
        self._wait_for_skipped_replays()
        self._close_step()

    @_bookkeeping
    def cancel_decode_step(self) -> None:
        """Undo the open step's token append, for a forward pass that failed part way.

        Every request of the step is back at its length before `begin_decode_step`, with its
        KV as it was: the new token's host extent (if it took one) and short-regime slot are
        released, and the newest slot gets its previous token back from the host. Rows the
        step's `swap_in` calls brought into hot buffers stay, as do the counters: those are
        valid copies of older tokens. Nothing is backed up. The batch may then be decoded
        again, or its requests preempted, finished or aborted.
        """
        self._open_step("cancel_decode_step")
        H, E = self.hot_slots, self.extent_tokens
        # Followers must hold the rows their anchor's plan put in the group's tables.
        for group in list(self._pending_replay):
            self._flush_replays(group)
        self._wait_for_skipped_replays()
        records = self._step_records
        grew = [r for r in records if id(r) in self._step_grew]
        short = []  # (slot, hot slot, host row) of new tokens that took their own slot
        newest = []  # (device row, host row) of the token before, back into the newest slot
        for record in records:
            position = record.num_tokens - 1
            if position < H:
                row = int(token_rows(record.extents, E, position, position + 1)[0])
                short.append((record.slot, position, row))
            elif position > H:  # the previous token was the newest, in slot H
                row = int(token_rows(record.extents, E, position - 1, position)[0])
                newest.append((record.slot * self.slots_per_request + H, row))
        # The device first: a failure leaves the step open and the call retryable.
        if newest and self._written_layers:
            self._drain_host_io()  # that row's backup may still be landing from a side stream
            device_rows = torch.tensor([d for d, _ in newest], dtype=torch.long,
                                       device=self.device)
            host_rows = torch.tensor([h for _, h in newest], dtype=torch.long)
            for layer in sorted(self._written_layers):
                self.tables.device_kv[layer].index_copy_(
                    0, device_rows, self._pool.layers[layer][host_rows].to(self.device))
        uploaded = self._upload(
            [[r.slot for r in records], [r.num_tokens - 1 for r in records],
             [r.slot for r in grew], [len(r.extents) - 1 for r in grew],
             *zip(*short, strict=True)]
        )
        t = self.tables
        t.seq_lens[uploaded[0].long()] = uploaded[1]
        if grew:
            t.page_table[uploaded[2].long(), uploaded[3].long()] = -1
        if short:
            slot_index, hot_slot, row = (x.long() for x in uploaded[4:7])
            t.slot_key[:, slot_index, hot_slot] = -1
            t.resident[:, t.residency_keys(slot_index, hot_slot, row)] = -1
        for record in records:
            record.num_tokens -= 1
        for record in grew:
            self._pool.release(record.extents[-1:])
            record.extents.pop()
        # Kernels of the step may still run; the freed extent held only the new token's row,
        # which they never read, but its next writer waits for them all the same.
        self._rows_recycled = self._rows_recycled or bool(grew)
        self._close_step()

    def _close_step(self) -> None:
        """Mark where the open step's device work ends (`_step_done`: what slot release, reseeding
        and host-row writers wait for) and close it; `begin_decode_step` resets the rest."""
        self.backend.record_event(self._step_done, self.device)
        self._step = None
        self._step_records = []

    def device_kv(self, layer: int) -> torch.Tensor:
        """`[R*S, W]` uint8: the rows attention reads at the indices `swap_in` returned."""
        self._check_open()
        self._check_layer(layer)
        return self.tables.device_kv[layer, : self._padding_row]

    def host_tensors(self) -> list[torch.Tensor]:
        """Every layer's `[N, W]` uint8 host pool tensor (e.g. to register with NIXL)."""
        self._check_open()
        return list(self._pool.layers)

    # --- lifecycle ------------------------------------------------------------------------
    @_bookkeeping
    def preempt(self, request_id: Hashable) -> None:
        """Release the request's device slot; its host KV stays for `resume`."""
        self._check_open()
        record = self._requests.expect(request_id, "preempt", (RequestState.RUNNING,))
        self._check_not_in_step(record, "preempt")
        self._release_slot(record)
        record.state = RequestState.PREEMPTED

    @_bookkeeping
    def resume(self, request_id: Hashable) -> None:
        """Give a preempted request a device slot again and seed it from its host KV."""
        self._check_open()
        record = self._requests.expect(request_id, "resume", (RequestState.PREEMPTED,))
        self._seed_into_new_slot(record, f"resuming request {request_id!r}")

    @_bookkeeping
    def finish(self, request_id: Hashable) -> None:
        """Free a running or preempted request's host rows and device slot."""
        self._end(request_id, "finish", (RequestState.RUNNING, RequestState.PREEMPTED),
                  RequestState.FINISHED)

    @_bookkeeping
    def abort(self, request_id: Hashable) -> None:
        """Free a request in any live state (e.g. a PD transfer that failed)."""
        self._end(request_id, "abort", LIVE, RequestState.ABORTED)

    @_bookkeeping
    def request_state(self, request_id: Hashable) -> RequestState:
        return self._requests.get(request_id, "look up").state

    @_bookkeeping
    def seq_len(self, request_id: Hashable) -> int:
        return self._requests.get(request_id, "look up").num_tokens

    @_bookkeeping
    def request_slot(self, request_id: Hashable) -> int | None:
        """The device request slot `r` (rows `r*S .. r*S+H`), None while it holds none."""
        return self._requests.get(request_id, "look up").slot

    @_bookkeeping
    def host_rows(self, request_id: Hashable) -> np.ndarray:
        """Host row (int64) of each of the request's tokens, the same in every layer."""
        record = self._requests.get(request_id, "look up")
        return token_rows(record.extents, self.extent_tokens, 0, record.num_tokens)

    @_bookkeeping
    def stats(self) -> CacheStats:
        """Traffic per layer and occupancy. Reads the device counters (one host sync)."""
        self._check_open()
        usage = self._prefixes.usage(self._requests)  # shared rows counted once
        used_rows = usage.rows_used
        extents = self._pool.allocator
        by_state: dict[str, int] = {}
        for record in self._requests:
            by_state[str(record.state)] = by_state.get(str(record.state), 0) + 1
        occupancy = Occupancy(
            host_extents_used=extents.used_extents,
            host_extents_total=extents.num_extents,
            host_rows_used=used_rows,
            host_rows_total=self._pool.num_rows,
            internal_fragmentation_rows=extents.used_extents * self.extent_tokens - used_rows,
            request_slots_used=self.max_requests - self._slots.free_slots,
            request_slots_total=self.max_requests,
            requests_by_state=by_state,
            shared_extents=usage.shared_extents,
            shared_rows=usage.shared_rows,
            host_bytes_saved=(usage.extents_saved * self.extent_tokens * self.row_bytes
                              * self.num_layers),
            retained_prefixes=len(self._prefixes),
        )
        layers = self._traffic.layer_stats(self.tables.counters, self.row_bytes,
                                           misses_copied=not self.config.skip_io)
        return CacheStats(layers, occupancy, list(self.disabled_features))

    @_bookkeeping
    def close(self) -> None:
        """Wait for the device, then free the host pool and let go of every device table (the
        device memory returns to torch's allocator once no view the caller kept, such as a
        `device_kv(layer)` or a captured graph, still holds it). Later calls raise;
        idempotent."""
        if self._closed:
            return
        self.backend.synchronize(self.device)
        self._closed = True
        self._pool.close()
        # A framework that closes one cache to build another (a restart, a new config) needs
        # the device memory back, not only when the object happens to be collected. The
        # kernels' scratch buffers are keyed weakly on the tables and go with them.
        for name in _DEVICE_STATE:
            delattr(self, name)

    def __getattr__(self, name: str) -> Any:
        # Called only for attributes that are missing: after close(), the device state.
        if name in _DEVICE_STATE and self.__dict__.get("_closed", False):
            raise RequestStateError(
                f"this HiSparseCache is closed and its device memory freed ({name} is gone); "
                "create a new one"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> HiSparseCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------
    def _seed(self, record: RequestRecord) -> None:
        """Load the newest `H+1` tokens into the hot buffer (ARCHITECTURE.md "seeding")."""
        H, S, E = self.hot_slots, self.slots_per_request, self.extent_tokens
        n, r = record.num_tokens, record.slot
        assert r is not None
        # (first token, count, first device slot) of each piece of the hot buffer
        if n <= H:
            pieces, lru_tokens = [(0, n, 0)], (0, n)
        else:
            pieces, lru_tokens = [(n - 1 - H, H, 0), (n - 1, 1, H)], (n - 1 - H, n - 1)
        t = self.tables
        # The slot's last owner may still be backing up, or be read by the last step.
        self.backend.wait_event(self._backup_done, self.device)
        self.backend.wait_event(self._step_done, self.device)
        t.page_table[r].fill_(-1)
        t.page_table[r, : len(record.extents)] = torch.tensor(record.extents, dtype=torch.int32)
        t.seq_lens[r] = n
        lru_rows = torch.from_numpy(token_rows(record.extents, E, *lru_tokens)).to(self.device)
        lru_keys = t.residency_keys(r, torch.arange(*lru_tokens, device=self.device), lru_rows)
        t.slot_key[:, r].fill_(-1)
        t.slot_key[:, r, : lru_keys.numel()] = lru_keys.to(torch.int32)
        t.resident[:, lru_keys] = torch.arange(lru_keys.numel(), dtype=t.resident.dtype,
                                               device=self.device)
        # One stamp for all, below the clock: ties go by slot id, so the oldest token goes first.
        t.last_use[:, r].fill_(-1)
        t.lru_clock[:, r] = 0
        for first, count, slot in pieces:
            for token, row, length in token_runs(record.extents, E, first, first + count):
                device_row = r * S + slot + token - first
                for layer in range(self.num_layers):
                    t.device_kv[layer, device_row : device_row + length].copy_(
                        self._pool.layers[layer][row : row + length], non_blocking=True
                    )
        self.backend.record_event(self._tables_changed, self.device)
        self._traffic.seeded_tokens += min(n, H + 1)
        record.state = RequestState.RUNNING

    def _seed_into_new_slot(self, record: RequestRecord, action: str) -> None:
        """Take a free device slot and seed it; a seed that fails gives the slot back.

        Without the give-back a failed seed (a device out of memory, say) would keep the slot
        and its half-written tables, and the retry would take a second slot that `finish`
        never frees.
        """
        self._slots.check_free(action)
        record.slot = self._slots.take()
        try:
            self._seed(record)
        except BaseException:
            self._release_slot(record)
            raise

    def _release_slot(self, record: RequestRecord) -> None:
        r = record.slot
        if r is None:
            return
        t = self.tables
        # The last step's kernels read these tables.
        self.backend.wait_event(self._step_done, self.device)
        own_key = int(t.residency_keys(r, 0, record.extents[0] * self.extent_tokens))
        # Empty hot slots hold -1; point them at the key of the request's first token, cleared
        # anyway, so the scatter needs no host sync to filter them out.
        held = t.slot_key[:, r].long()
        t.resident.scatter_(1, torch.where(held >= 0, held, own_key), -1)
        t.slot_key[:, r].fill_(-1)
        t.last_use[:, r].fill_(-1)
        t.lru_clock[:, r] = 0
        t.seq_lens[r] = 0
        t.page_table[r].fill_(-1)
        self.backend.record_event(self._tables_changed, self.device)
        self._slots.release(r)
        record.slot = None

    def _end(self, request_id: Hashable, action: str, allowed: Sequence[RequestState],
             final: RequestState) -> None:
        self._check_open()
        record = self._requests.expect(request_id, action, allowed)
        self._check_not_in_step(record, action)
        self._release_slot(record)
        # Shared extents only lose a holder: other requests and retained prefixes keep them.
        self._pool.release(record.extents)
        self._prefixes.forget(record)
        record.extents = []
        self._requests.remove(record, final)
        self._rows_recycled = True

    def _follow(self, layer: int, group: int, anchor: int, top_k: torch.Tensor) -> torch.Tensor:
        if group not in self._anchored:
            raise RequestStateError(
                f"layer {layer} shares the top-k of its anchor layer {anchor}, which has not "
                f"swapped in during this step; call swap_in({anchor}, top_k) first"
            )
        rows = top_k.shape[0]
        if rows != self._anchored[group]:
            raise InvalidInputError(
                f"layer {layer}'s top_k has {rows} rows, its anchor layer {anchor} swapped in "
                f"{self._anchored[group]}; layers {anchor}..{anchor + self.index_group_size - 1} "
                "share one indexer, so pass the anchor's top-k tensor"
            )
        if self.config.validate and not torch.equal(top_k, self._anchor_top_k[group]):
            raise InvalidInputError(
                f"layer {layer} got a top-k that differs from its anchor layer {anchor}'s; "
                f"layers {anchor}..{anchor + self.index_group_size - 1} share one indexer, "
                "so pass the anchor's top-k (or set index_group_size=1)"
            )
        if self._prefetch_stream is not None:
            self.backend.wait_event(self._follower_ready[layer], self.device)
            self._unwaited_replays.get(group, set()).discard(layer)
        elif layer in self._pending_replay.get(group, ()):
            self._replay(group, layer)
            self._pending_replay[group].discard(layer)
        return self._out_view(group, rows)

    def _followers(self, group: int) -> range:
        anchor = group * self.index_group_size
        return range(anchor + 1, min(anchor + self.index_group_size, self.num_layers))

    def _issue_replays(self, group: int) -> None:
        if self._prefetch_stream is None:
            self._pending_replay[group] = set(self._followers(group))
            return
        self.backend.record_event(self._planned[group], self.device)
        self._unwaited_replays[group] = set(self._followers(group))
        with self.backend.stream_scope(self._prefetch_stream):
            self.backend.wait_event(self._planned[group], self.device)
            for follower in self._followers(group):
                self._replay(group, follower)
                self.backend.record_event(self._follower_ready[follower], self.device)
            self.backend.record_event(self._replay_done[group], self.device)

    def _wait_for_skipped_replays(self) -> None:
        """Make the compute stream wait for the side-stream replays no follower's swap_in
        waited for (a follower the caller skipped): the step is done only with them, or a slot
        freed next could be reseeded and then overwritten by one (its rows by a new prefill
        before it read them)."""
        for group, followers in self._unwaited_replays.items():
            if followers:
                self.backend.wait_event(self._replay_done[group], self.device)
        self._unwaited_replays.clear()

    def _flush_replays(self, group: int) -> None:
        for follower in sorted(self._pending_replay.pop(group, ())):
            self._replay(group, follower)

    def _replay(self, group: int, layer: int) -> None:
        if not self.config.skip_io:
            try:
                self._launcher.replay(layer, group, self._anchored[group])
            except BaseException as exc:
                self._launch_failed(f"the replay of layer {layer}", exc)
                raise
        self.tables.counters[layer] += self._anchor_delta[group]

    def _upload(self, columns: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One host-to-device copy for all of a step's small int32 updates."""
        lengths = [len(c) for c in columns]
        flat = torch.tensor([v for c in columns for v in c], dtype=torch.int32)
        on_device = flat.to(self.device, non_blocking=True)
        return list(torch.split(on_device, lengths))

    def _drain_host_io(self) -> None:
        """Before host rows are written from the CPU or a transfer engine: wait for the device
        work that may still read or write them (backups, and kernels of the last step reading
        rows a finish or abort just freed)."""
        if self._host_io_pending:
            self.backend.synchronize(self.device)
        elif self._rows_recycled:
            # Events of the GPU backends wait on the host; the CPU backend has none to wait for.
            wait = getattr(self._step_done, "synchronize", None)
            if wait is not None:
                wait()
        self._host_io_pending = self._rows_recycled = False

    def _launch_failed(self, what: str, exc: BaseException) -> None:
        """Our own errors are raised before any launch; anything else may have left a kernel
        of the call queued and the next one not: the device tables may no longer match the
        device rows (a plan installed, its rows never copied), and no later step can trust
        them."""
        if not isinstance(exc, HisparseError):
            self._failed_launch = f"{what} failed with {type(exc).__name__}: {exc}"

    def _launch_backup(self) -> None:
        try:
            self._backup(self.tables, self._newest_rows, self._newest_host_rows, self._num_real)
        except BaseException as exc:
            self._launch_failed("the newest-token backup", exc)
            raise

    def _check_decodable(self, action: str) -> None:
        if self._failed_launch is not None:
            raise RequestStateError(
                f"cannot {action}: {self._failed_launch}. This cache's device tables may no "
                "longer match its device rows, so it decodes no more; finish or abort its "
                "requests (their host KV is intact), close it and build a new cache"
            )

    def _open_step(self, action: str) -> DecodeStep:
        self._check_open()
        if action != "cancel_decode_step":
            self._check_decodable(action)
        if self._step is None:
            raise RequestStateError(
                f"{action} needs an open decode step; call begin_decode_step(request_ids) first"
            )
        return self._step

    def _check_not_in_step(self, record: RequestRecord, action: str) -> None:
        if self._step is not None and any(r is record for r in self._step_records):
            raise RequestStateError(
                f"cannot {action} request {record.request_id!r} during the decode step it is "
                "part of; call end_decode_step() first"
            )

    def _check_layer(self, layer: int) -> None:
        if not _is_count(layer) or not 0 <= layer < self.num_layers:
            raise InvalidInputError(
                f"layer must be an int in 0..{self.num_layers - 1}, got {layer!r}; pass the "
                "index of one of this cache's layers"
            )

    def _check_length(self, num_tokens: int, action: str) -> None:
        if not _is_count(num_tokens) or not 1 <= num_tokens <= self.max_seq_len:
            raise InvalidInputError(
                f"cannot {action} a request of {num_tokens!r} tokens: it must be an int in "
                f"1..{self.max_seq_len} (max_seq_len); pass the token count as an int, or raise "
                "max_seq_len for longer requests"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RequestStateError("this HiSparseCache is closed; create a new one")


# What close() releases: every attribute holding device tensors, streams or events.
_DEVICE_STATE = (
    "tables", "_req_slots", "_num_real", "_newest_rows", "_newest_rows_long",
    "_newest_host_rows", "_out", "_out_rows", "_launcher", "_anchor_delta", "_anchor_top_k",
    "_backup_stream", "_prefetch_stream", "_backup_done", "_step_written", "_planned",
    "_follower_ready", "_replay_done", "_step_done", "_tables_changed",
)


def _is_count(value: object) -> bool:
    """A plain int (bools are ints to Python, but `layer=True` is a bug, not layer 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _device_of(backend: Backend, device: str | torch.device | Backend | None) -> torch.device:
    """The device `device` names; an index the backend does not see is refused here, before
    anything is allocated (torch would fail later with a less helpful message)."""
    from hisparse.backends.registry import device_index

    return backend.device(device_index(backend, device))


def _concrete(device: torch.device) -> torch.device:
    """The indexed device that `device` allocates on (no index -> the current device's).

    The tables live on one device; an unindexed one would make the device checks
    (`same_device`) accept a tensor on any device of the type.
    """
    return torch.empty(0, device=device).device
