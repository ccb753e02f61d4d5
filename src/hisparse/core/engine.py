"""`HiSparseCache`: the hierarchical sparse KV cache a serving framework drives.

Full KV lives in the host pool; each running request owns a device request slot with `H` LRU
hot slots per index group plus slot `H` for its newest token (docs/ARCHITECTURE.md). This
module holds the request lifecycle (admission, prefill, seeding, preemption, release), the
tables and the statistics. A decode step is a `core.step.DecodeStep`; the cache's own decode
calls delegate to the open one.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence
from functools import partial
from typing import Any

import torch

from hisparse.backends.base import Backend
from hisparse.core.context import DecodeContext
from hisparse.core.host_pool import HostReservation
from hisparse.core.operations import bookkeeping as _bookkeeping
from hisparse.core.operations import operation as _operation
from hisparse.core.plan import StepPlan, StepPlanner
from hisparse.core.prefixes import PrefixRegistry
from hisparse.core.requests import (
    PromptCoverage,
    RequestQueries,
    RequestRecord,
    RequestState,
    RequestTable,
    SlotAllocator,
)
from hisparse.core.shared_pool import SharedPoolSpec, SharedPoolSync, build_host_pool
from hisparse.core.sharing import Prefix, PrefixSharing
from hisparse.core.slot_tables import SlotWriter, build_tables
from hisparse.core.stats import CacheStats, TrafficCounters, occupancy_of, request_stats
from hisparse.core.step import DecodeStep, wait_at_begin
from hisparse.core.validation import (
    as_appends,
    as_batch_ids,
    check_current_device,
    check_layer,
    check_prefill_rows,
    check_request_length,
)
from hisparse.core.verify import VerifyContext, check_num_tokens
from hisparse.errors import ConfigError, InvalidInputError, RequestStateError

LIVE = (RequestState.RESERVED, RequestState.PREFILLING, RequestState.RUNNING,
        RequestState.PREEMPTED)


class HiSparseCache(PrefixSharing, RequestQueries):
    """A hierarchical sparse KV cache on one device.

    Args:
        config: a `hisparse.HiSparseConfig`; feature flags are resolved against the backend
            (features it lacks are turned off with a `FeatureDisabledWarning`).
        device: None (the best backend here), a backend name or device string ("cuda:1"),
            a `torch.device`, or a `Backend`.
        shared_pool: a `SharedPoolSpec` to share one host pool with the other tensor-parallel
            ranks of this node (docs/integration.md, "One host pool per node").

    Raises:
        ConfigError, UnsupportedFeatureError: from resolving the config on this backend.
        HostAllocationError: the host pool could not be allocated (nothing is kept).
        SharedPoolError: the shared pool's name is taken, unknown, or of another layout.

    Example:
        >>> cache = HiSparseCache(HiSparseConfig.from_preset("tiny"), device="cpu")
        >>> cache.admit("r0", 100); cache.write_prefill("r0", kv); cache.commit_prefill("r0")
    """

    # Every table is a normal tensor even under torch.inference_mode() (which is per thread):
    # an inference tensor refuses in-place updates outside it, so a scheduler thread could not
    # drive a cache a model thread built; normal tensors may be updated inside it too.
    @torch.inference_mode(False)
    def __init__(self, config: Any, device: str | torch.device | Backend | None = None,
                 shared_pool: SharedPoolSpec | None = None) -> None:
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
        self.row_bytes = config.row_bytes
        self.top_k = config.top_k
        self.hot_slots = H = config.hot_slots
        self.max_draft_tokens = D = config.max_draft_tokens
        self.slots_per_request = H + D
        self.max_requests = config.max_requests
        self.batch_capacity = config.max_batch or config.max_requests
        self.extent_tokens = E = config.extent_tokens
        self.max_seq_len = config.max_seq_len
        self.index_group_size = config.index_group_size  # None: groups of several sizes
        self.num_groups = config.index_schedule.num_groups
        # Row R*S of every layer is the sink padded batch rows' newest-token writes go to.
        self._padding_row = config.max_requests * (H + D)

        # Streams and events belong to the device current at their creation: make it ours.
        with backend.device_scope(self.device):
            self._lock = threading.RLock()
            self._requests = RequestTable()
            self._slots = SlotAllocator(config.max_requests, -(-self.max_seq_len // E))
            self._traffic = TrafficCounters(L)
            self._last_step: DecodeStep | None = None  # the open step, or the last one
            self._closed = False
            self._shared: SharedPoolSync | None
            self._pool, self._shared = build_host_pool(backend, config, shared_pool)
            self._prefixes = PrefixRegistry(self._pool, config.residency_map, config.alias_extents)
            try:
                self._build_device_state()
            except BaseException:
                # Nothing half-built may keep host memory: free every buffer allocated so far.
                self._pool.close()
                raise

    def _build_device_state(self) -> None:
        """The tables and the decode path's buffers, kernels, streams and barriers."""
        self.tables = build_tables(self.config, self.backend, self._pool, self.device,
                                   self.num_groups, self.hot_slots)
        self._decode = DecodeContext.build(self.config, self.backend, self.device, self.tables,
                                           self._pool, self._traffic, self._lock, self._slots)
        self._order = self._decode.order
        self._slot_writer = SlotWriter(self.tables, self._pool, self.backend, self.device)
        self._decode.shared = self._order.host_rows.shared = self._shared
        self._verify = VerifyContext.build(self.config, self.backend, self._decode)
        self._planner = StepPlanner(self._shared, self._decode, self._verify)
        # What attention reads, made once: device_kv(layer) is called every layer of a step.
        self._attention_kv = [self.tables.device_kv[layer, : self._padding_row]
                              for layer in range(self.num_layers)]


    # --- admission and prefill ------------------------------------------------------------
    @_operation
    def admit(self, request_id: Hashable, num_tokens: int, prefix: Prefix = None) -> None:
        """Take host extents for a `num_tokens` prompt and a device request slot. `prefix` (a
        `PrefixHandle`, or `(request_id, n)` of a running or preempted request): its tokens
        are in the host pool already, their whole extents shared and the boundary rows copied;
        `write_prefill` writes the rest (docs/integration.md, "Shared prefixes").

        Raises:
            RequestStateError: the id is live. InvalidInputError: bad `num_tokens`/`prefix`.
            PoolExhaustedError: no slot, too few extents or alias key extents (nothing is
                taken).
        """
        self._check_open()
        self._requests.check_new(request_id, "admit")
        check_request_length(num_tokens, self.max_seq_len, "admit")
        action = f"admit request {request_id!r}"
        shared = self._shared_prefix(prefix, action)
        self._slots.check_free(f"admitting request {request_id!r}")
        extents, aliases = self._prefixes.extents_for_new(shared, num_tokens,
                                                          self._order.host_rows.drain, action)
        first = shared.num_tokens if shared else 0
        record = RequestRecord(request_id, RequestState.PREFILLING, num_tokens, num_tokens,
                               extents, PromptCoverage(self.num_layers, num_tokens, first), first,
                               aliases)
        self._slots.take(record)
        self._requests.add(record)

    @_operation
    def reserve_host_slots(self, request_id: Hashable, num_tokens: int,
                           prefix: Prefix = None) -> HostReservation:
        """PD decode side: reserve host rows a transfer engine will write; no device slot yet.

        Write token `res.prefix_tokens + i` of layer `l` to `res.host_tensors[l][res.rows[i]]`
        (or at `res.layers[l].base_address + res.rows[i] * res.row_bytes`), then
        `complete_transfer`. `prefix` as for `admit`: those tokens are not transferred.
        """
        self._check_open()
        self._requests.check_new(request_id, "reserve host slots for")
        check_request_length(num_tokens, self.max_seq_len, "reserve host slots for")
        action = f"reserve host slots for request {request_id!r}"
        shared = self._shared_prefix(prefix, action)
        self._prefixes.check_room(shared, num_tokens, action)
        # The transfer engine writes the rows once this returns: a backup or a swap-in of
        # their previous owner may still be touching them. Drained before anything is taken,
        # so that a drain that fails leaves no reservation behind.
        self._order.host_rows.drain()
        extents, aliases = self._prefixes.extents_for_new(shared, num_tokens,
                                                          self._order.host_rows.drain, action)
        first = shared.num_tokens if shared else 0
        record = RequestRecord(request_id, RequestState.RESERVED, num_tokens, num_tokens, extents,
                               prefix_tokens=first, aliases=aliases)
        self._requests.add(record)
        return self._pool.reservation(request_id, extents, num_tokens, first)

    @_operation
    def write_prefill(
        self, request_id: Hashable, kv: torch.Tensor, layer: int | None = None, start: int = 0
    ) -> None:
        """Write prompt rows `start .. start+T-1` to the host: `kv` is `[T, W]` for one layer
        or `[L, T, W]` for all; any dtype whose last dimension is one row of `W` bytes."""
        self._check_open()
        record = self._requests.expect(
            request_id, "write prefill for", (RequestState.PREFILLING, RequestState.RESERVED)
        )
        rows = check_prefill_rows(
            kv, layer, start, num_layers=self.num_layers, row_bytes=self.row_bytes,
            device=self.device, admitted_tokens=record.admitted_tokens, request_id=request_id,
            prefix_tokens=record.prefix_tokens)
        count = rows.shape[-2]
        layers = [layer] if layer is not None else range(self.num_layers)
        write = partial(self._pool.write_layers, layers, record.extents, start, rows)
        if rows.device != self._pool.layers[0].device and self._pool.writes_rows:
            self._order.host_rows.device_prefill(write)  # (no host wait)
            if self._shared is not None:
                self._shared.wrote()  # the readers' wait covers them
        else:
            self._order.host_rows.drain()
            write()
        for target in layers:
            self._traffic.offloaded_tokens[target] += count
            if record.prompt_written is not None:
                record.prompt_written.add(target, start, start + count)

    @_operation
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

    @_operation
    def complete_transfer(self, request_id: Hashable) -> None:
        """PD: the reserved rows have been written; take a device slot, seed, decode.

        Raises PoolExhaustedError when no device slot is free (the request stays reserved).
        """
        self._check_open()
        record = self._requests.expect(request_id, "complete the transfer of",
                                       (RequestState.RESERVED,))
        if self._shared is not None:  # the writer's transfer landed before its call
            self._slots.check_free(f"completing the transfer of request {request_id!r}")
            self._shared.before_read(current=True)
        self._seed_into_new_slot(record, f"completing the transfer of request {request_id!r}")

    # --- decode: the open step's verbs, through the cache --------------------------------
    def begin_decode_step(self, request_ids: Sequence[Hashable], num_tokens: int = 1, *,
                          dedupe: bool = False, appends: Any = None) -> DecodeStep:
        """Append `num_tokens` tokens to each request and open the step that decodes them.

        `num_tokens=S` in 2..max_draft_tokens opens a verify step (kv `[B, S, W]`, top-k
        `[B, S, K]` swapped in as one union per request, `end(accepted=...)`); `dedupe=True`
        with S = 1 takes the union path so that a position repeated in a row is loaded once;
        `appends` (0..S rows per request, no `dedupe`): one given 0 only looks up; every query
        of request b may select up to its last appended row, `end(accepted=)` keeps 0..a_b
        (docs/deepseek-v4.md). `step_plan` shows the path.
        Returns the open step (its verbs: the cache's own below delegate to it).

        Raises:
            RequestStateError: a step is open, or a request is not running.
            InvalidInputError: empty, duplicated or over-capacity batch, max_seq_len reached,
                num_tokens outside 1..max_draft_tokens, bad appends, or another device.
            PoolExhaustedError: a request needs a new extent and the pool has too few free.
        """
        check_current_device(self.backend.current_device(), self.device)  # once a step
        if appends is not None:  # (read once, before the step: a tuple every rank hashes)
            appends = as_appends(appends, len(as_batch_ids(request_ids)), num_tokens, dedupe)
        return self._begin_decode_step(request_ids, num_tokens, dedupe, appends)

    @_operation
    def _begin_decode_step(self, request_ids: Sequence[Hashable], num_tokens: int, dedupe: bool,
                           appends: tuple[int, ...] | None) -> DecodeStep:
        self._check_open()
        check_num_tokens(num_tokens, dedupe, self.max_draft_tokens)
        self._decode.kernels.check_usable("begin a decode step")
        if self._step is not None:
            raise RequestStateError(
                "a decode step is already open; call end_decode_step() before the next one"
            )
        ids = as_batch_ids(request_ids)
        records = _batch_records(self._requests, ids, self.batch_capacity, self.config.validate)
        self._unshare_writers(records, num_tokens, appends)
        plan = self._planner.plan(len(ids), num_tokens, dedupe, appends is not None)
        if self._shared is not None:
            wait_at_begin(plan, self._shared)
        self._last_step = DecodeStep.begin(self._decode, self._verify, plan, tuple(ids),
                                           records, appends)
        return self._last_step

    def step_plan(self, batch_size: int, num_tokens: int = 1, dedupe: bool = False,
                  appends: str = "every") -> StepPlan:
        """The path a decode step of `batch_size` requests and `num_tokens` tokens each takes
        (`appends="ragged"`: per-request appends): a frozen `core.plan.StepPlan`."""
        self._check_open()
        check_num_tokens(num_tokens, dedupe, self.max_draft_tokens)
        return self._planner.checked_plan(batch_size, num_tokens, dedupe, appends)

    def write_newest(self, layer: int, kv: torch.Tensor) -> None:
        """The open step's `write_newest`: the new token's row of `layer` for every request,
        `kv [B, W]` (a verify step: `[B, S, W]`), B between the step's request count and
        `max_batch`."""
        self._open_step("write_newest").write_newest(layer, kv)

    def swap_in(self, layer: int, top_k: torch.Tensor | None = None,
                newest_kv: torch.Tensor | None = None) -> torch.Tensor:
        """The open step's `swap_in` (`DecodeStep.swap_in`): `[B, K]` int32 device rows of
        `device_kv(layer)` for `top_k [B, K]` (a verify step: `[B, S, K]` for `[B, S, K]`);
        a follower layer of an index group may leave `top_k` out and
        gets its anchor's rows. `newest_kv`: the layer's new rows, written in the same call
        (`write_newest` folded in)."""
        return self._open_step("swap_in").swap_in(layer, top_k, newest_kv)

    @_bookkeeping
    def end_decode_step(self, accepted: Sequence[int] | torch.Tensor | None = None) -> None:
        """Back every layer's new row up to its host row (on a side stream where supported);
        a verify step keeps `accepted[b]` (1..S) tokens of request b (`DecodeStep.end`)."""
        self._open_step("end_decode_step").end(accepted)

    @_bookkeeping
    def cancel_decode_step(self) -> None:
        """Undo the open step's token append, for a forward pass that failed part way
        (`DecodeStep.cancel`): every request is back at its length and KV before the step."""
        self._open_step("cancel_decode_step").cancel()

    def device_kv(self, layer: int) -> torch.Tensor:
        """`[R*S, W]` uint8: the rows attention reads at the indices `swap_in` returned."""
        self._check_open()
        check_layer(layer, self.num_layers)
        return self._attention_kv[layer]

    def host_tensors(self) -> list[torch.Tensor]:
        """Every layer's `[N, W]` uint8 host pool tensor (e.g. to register with NIXL)."""
        self._check_open()
        return list(self._pool.layers)

    # --- lifecycle ------------------------------------------------------------------------
    @_operation
    def preempt(self, request_id: Hashable) -> None:
        """Release the request's device slot; its host KV stays for `resume`."""
        self._check_open()
        record = self._requests.expect(request_id, "preempt", (RequestState.RUNNING,))
        self._check_not_in_step(record, "preempt")
        self._release_slot(record)
        record.state = RequestState.PREEMPTED

    @_operation
    def resume(self, request_id: Hashable) -> None:
        """Give a preempted request a device slot again and seed it from its host KV."""
        self._check_open()
        record = self._requests.expect(request_id, "resume", (RequestState.PREEMPTED,))
        self._seed_into_new_slot(record, f"resuming request {request_id!r}")

    @_operation
    def finish(self, request_id: Hashable) -> None:
        """Free a running or preempted request's host rows and device slot."""
        self._end(request_id, "finish", (RequestState.RUNNING, RequestState.PREEMPTED),
                  RequestState.FINISHED)

    @_operation
    def abort(self, request_id: Hashable) -> None:
        """Free a request in any live state (e.g. a PD transfer that failed)."""
        self._end(request_id, "abort", LIVE, RequestState.ABORTED)

    @_bookkeeping
    def stats(self) -> CacheStats:
        """Traffic per layer and occupancy. Reads the device counters (one host sync)."""
        self._check_open()
        occupancy = occupancy_of(self._requests, self._pool, self._slots, self._prefixes)
        layers = self._traffic.layer_stats(self.tables.counters, self.row_bytes,
                                           misses_copied=not self.config.skip_io)
        return CacheStats(layers, occupancy, list(self.disabled_features),
                          request_stats(self._requests, self.tables.request_counters))

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
        if self._step is not None:
            self._step.abandon()
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
    @property
    def _step(self) -> DecodeStep | None:
        """The open decode step, if one is."""
        step = self._last_step
        return step if step is not None and step.is_open else None

    def _seed(self, record: RequestRecord) -> None:
        """Load the newest `H+1` tokens into the hot buffer (ARCHITECTURE.md "seeding")."""
        if self._shared is not None:
            self._shared.before_read()  # the writer's rows of this request are complete
        # The slot's last owner may still be backing up, or be read by the last step.
        self._order.backup.wait()
        self._order.step_end.wait()
        self._order.tables_changed.write(lambda: self._slot_writer.seed(record))
        self._traffic.seeded_tokens += min(record.num_tokens, self.hot_slots + 1)
        record.state = RequestState.RUNNING

    def _seed_into_new_slot(self, record: RequestRecord, action: str) -> None:
        """Take a free device slot and seed it; a seed that fails gives the slot back.

        Without the give-back a failed seed (a device out of memory, say) would keep the slot
        and its half-written tables, and the retry would take a second slot that `finish`
        never frees.
        """
        self._slots.check_free(action)
        self._slots.take(record)
        try:
            self._seed(record)
        except BaseException:
            self._release_slot(record)
            raise

    def _release_slot(self, record: RequestRecord) -> None:
        if record.slot is None:
            return
        self._order.step_end.wait()  # the last step's kernels read these tables
        self._order.tables_changed.write(lambda: self._slot_writer.clear(record))
        self._slots.release(record)

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
        self._order.host_rows.note_rows_recycled()

    def _open_step(self, action: str) -> DecodeStep:
        # Every verb of the step refuses on its own once a kernel failed (cancel excepted).
        step = self._last_step
        if not self._closed and step is not None and step.is_open:
            return step
        self._check_open()
        if action != "cancel_decode_step":
            self._decode.kernels.check_usable(action)
        step = self._step
        if step is None:
            raise RequestStateError(
                f"{action} needs an open decode step; call begin_decode_step(request_ids) first"
            )
        return step

    def _check_not_in_step(self, record: RequestRecord, action: str) -> None:
        step = self._step
        if step is not None and step.holds(record):
            raise RequestStateError(
                f"cannot {action} request {record.request_id!r} during the decode step it is "
                "part of; call end_decode_step() first"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise RequestStateError("this HiSparseCache is closed; create a new one")


# What close() releases: every attribute holding device tensors, streams or events.
_DEVICE_STATE = ("tables", "_decode", "_order", "_attention_kv", "_planner", "_slot_writer")


def _batch_records(requests: RequestTable, ids: list[Hashable], capacity: int,
                   validate: bool) -> list[RequestRecord]:
    """The records of a decode batch: 1..capacity running requests, each once. The usual step
    repeats the last one's ids with no request changed since: its records are remembered
    (validate mode looks them up all the same and checks that they are the same)."""
    remembered = requests.remembered_batch(ids)
    if remembered is not None and not validate:
        return remembered
    if not 1 <= len(ids) <= capacity:
        raise InvalidInputError(
            f"a decode step takes 1..{capacity} requests (max_batch), got {len(ids)}; split "
            "the batch or raise max_batch"
        )
    records = requests.expect_all(ids, "decode", RequestState.RUNNING)
    # Equal ids are one record, and one record is filed under one id: a repeated record is a
    # repeated id (a set of the ids is 2 us at B=128, of the records' id()s 12 us).
    if len(set(ids)) != len(records):
        raise InvalidInputError(
            f"request ids repeat in the decode batch {ids!r}; list each request once"
        )
    if remembered is not None:
        if remembered != records:
            raise AssertionError("the remembered decode batch is not its ids' records")
        return remembered
    requests.remember_batch(ids, records)
    return records


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

