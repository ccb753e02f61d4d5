"""Decode side of the NIXL transfer: the cache's host pool as a write target, one ticket per
request, and the notifications and deadlines that end each transfer (see `nixl_adapter`)."""

from __future__ import annotations

import collections
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from hisparse.errors import (
    HisparseError,
    InvalidInputError,
    RequestStateError,
    TransferError,
    UnknownRequestError,
)
from hisparse.pd.nixl_adapter import (
    byte_range,
    import_nixl,
    logger,
    parse_notification,
    start_agent,
)
from hisparse.pd.ticket import TransferTicket, coalesce_rows

# Transfer ids of finished or aborted transfers kept to tell a late notification from a
# stray one in the log; old ones are forgotten first.
_RETIRED_MEMORY = 4096


class _ReservingCache(Protocol):
    """The part of `hisparse.HiSparseCache` the decode endpoint uses."""

    def reserve_host_slots(self, request_id: Any, num_tokens: int) -> Any: ...
    def complete_transfer(self, request_id: Any) -> None: ...
    def abort(self, request_id: Any) -> None: ...
    def host_tensors(self) -> list[torch.Tensor]: ...


@dataclass(frozen=True)
class TransferOutcome:
    """One request whose transfer ended, as `NixlDecodeEndpoint.poll` reports it.

    `error is None`: the rows landed and `complete_transfer` ran; the request can decode.
    A `TransferError`: the transfer failed or timed out and its rows were released.
    Any other `HisparseError`: the rows landed but `complete_transfer` refused (e.g. no free
    device slot); the rows stay reserved: call `cache.complete_transfer` again or `cache.abort`.
    """

    request_id: Hashable
    transfer_id: str
    error: HisparseError | None = None

    @property
    def ready(self) -> bool:
        return self.error is None


@dataclass
class _Pending:
    request_id: Hashable
    ticket: TransferTicket
    deadline: float
    timeout_s: float

class NixlDecodeEndpoint:
    """Decode side: the cache's host pool as a NIXL write target, one ticket per request.

    Args:
        cache: a `hisparse.HiSparseCache` (anything with `reserve_host_slots`,
            `complete_transfer`, `abort` and `host_tensors`).
        agent_name: this node's NIXL agent name, unique among the agents that talk to it.
        host_tensors: the cache's per-layer `[N, W]` host tensors. Default: the cache's own.
        timeout_s: default time from `prepare_request` to the completion notification, after
            which the rows are released and the request reported failed.
        backends: NIXL backends to start ("UCX" works on every host, CPU-only included).
        clock: monotonic seconds; injectable for tests.

    Raises:
        ImportError: NIXL is not installed (the message names `pip install 'hisparse[pd]'`).
        TransferError: the agent could not start or the pool could not be registered.
    """

    def __init__(
        self,
        cache: _ReservingCache,
        agent_name: str,
        *,
        host_tensors: Sequence[torch.Tensor] | None = None,
        timeout_s: float = 60.0,
        backends: Sequence[str] = ("UCX",),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not timeout_s > 0:  # also refuses NaN, which no clock reading would ever reach
            raise InvalidInputError(f"timeout_s must be > 0 seconds, got {timeout_s}.")
        nixl = import_nixl()
        pool = list(host_tensors if host_tensors is not None else cache.host_tensors())
        for layer, tensor in enumerate(pool):
            if tensor.dim() != 2 or not tensor.is_contiguous():
                raise InvalidInputError(
                    f"host tensor of layer {layer} has shape {tuple(tensor.shape)} "
                    f"(contiguous={tensor.is_contiguous()}); the pool must be contiguous [N, W]."
                )
        self.cache = cache
        self.agent_name = agent_name
        self.timeout_s = float(timeout_s)
        self._clock = clock
        self._agent = start_agent(nixl, agent_name, backends)
        self._pool_ranges = [byte_range(t) for t in pool]
        try:
            self._registration = self._agent.register_memory(pool)
        except Exception as exc:
            raise TransferError(
                f"NIXL agent {agent_name!r} could not register the host pool "
                f"({len(pool)} layers, {sum(e - s for s, e in self._pool_ranges)} bytes): {exc}."
            ) from exc
        self._pool = pool  # keeps the registered memory alive as long as the endpoint
        # A fresh nonce per endpoint keeps ids unique across restarts under the same name.
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()
        self._pending: dict[str, _Pending] = {}
        self._transfer_of: dict[Hashable, str] = {}
        self._retired: OrderedDict[str, str] = OrderedDict()
        self._undelivered: list[TransferOutcome] = []
        self._closed = False
        self._unread: collections.deque[tuple[str, bytes]] = collections.deque()

    def publish(self) -> bytes:
        """This agent's NIXL metadata; every prefill node passes it to `connect` once."""
        return self._agent.get_agent_metadata()

    @property
    def pending(self) -> list[Hashable]:
        """Requests whose transfer was prepared and has not ended yet."""
        return [p.request_id for p in self._pending.values()]

    def prepare_request(
        self, request_id: Hashable, num_tokens: int, *, timeout_s: float | None = None,
        prefix: Any = None,
    ) -> TransferTicket:
        """Reserve host rows for a request in all layers and describe them for the prefill node.

        `prefix` (a `PrefixHandle` or `(request_id, num_tokens)`, as for `cache.admit`): the
        first tokens are already in this node's host pool and are not transferred; the ticket
        then covers tokens `prefix_tokens ..` only, numbered from 0, so the prefill node
        passes the source rows of those tokens alone.

        Raises what `cache.reserve_host_slots` raises (nothing reserved then), or
        `InvalidInputError` for a request already waiting for a transfer or a prefix that
        leaves nothing to transfer, `RequestStateError` after `close()`.
        """
        if self._closed:  # the pool is deregistered: no prefill node could write the rows
            raise RequestStateError(
                f"cannot prepare request {request_id!r}: this NixlDecodeEndpoint is closed; "
                "create a new one"
            )
        if request_id in self._transfer_of:
            raise InvalidInputError(
                f"request {request_id!r} already waits for transfer "
                f"{self._transfer_of[request_id]}; cancel() it before preparing it again."
            )
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:  # also refuses NaN: the rows would stay reserved forever
            raise InvalidInputError(f"timeout_s must be > 0 seconds, got {timeout_s}.")
        if prefix is None:
            reservation = self.cache.reserve_host_slots(request_id, num_tokens)
        else:
            reservation = self.cache.reserve_host_slots(request_id, num_tokens, prefix=prefix)
        try:
            if not len(reservation.rows):
                raise InvalidInputError(
                    f"request {request_id!r}'s prefix covers all its {num_tokens} tokens, so "
                    "there is nothing to transfer; admit it with cache.admit(..., prefix=...) "
                    "and commit_prefill instead"
                )
            ticket = self._ticket(request_id, reservation)
        except BaseException:
            self.cache.abort(request_id)
            raise
        self._pending[ticket.transfer_id] = _Pending(
            request_id, ticket, self._clock() + timeout, timeout
        )
        self._transfer_of[request_id] = ticket.transfer_id
        return ticket

    def poll(self) -> list[TransferOutcome]:
        """Handle arrived notifications and expired deadlines; report every transfer that ended.

        Never raises for one request's failure: the failure is in its outcome's `error`.
        """
        outcomes, self._undelivered = self._undelivered, []
        try:
            for sender, messages in self._agent.get_new_notifs().items():
                self._unread.extend((sender, message) for message in messages)
            # One at a time off the queue: if handling one raises, the rest (transfers whose
            # rows landed) are handled by the next poll() rather than lost to their deadline.
            while self._unread:
                sender, message = self._unread.popleft()
                outcome = self._on_notification(sender, message)
                if outcome is not None:
                    outcomes.append(outcome)
            now = self._clock()
            for transfer_id, pending in list(self._pending.items()):
                if now >= pending.deadline:
                    error = TransferError(
                        f"KV transfer {transfer_id} for request {pending.request_id!r} timed "
                        f"out: no completion notification within {pending.timeout_s:g} s; its "
                        f"{pending.ticket.num_tokens} host rows were released. Check that the "
                        f"prefill node connected to agent {self.agent_name!r} and wrote the "
                        "ticket, or raise timeout_s."
                    )
                    outcomes.append(self._fail(transfer_id, error, why="timed out"))
        except BaseException:
            # These requests already changed state in the cache (running, or released): the
            # scheduler must still hear of them, so the next poll() reports them.
            self._undelivered = outcomes + self._undelivered
            raise
        return outcomes

    def wait(self, request_id: Hashable, timeout_s: float | None = None) -> None:
        """Poll until this request's transfer ends; raise its error if it failed.

        Outcomes of other requests seen meanwhile are kept for the next `poll()`.
        """
        transfer_id = self._transfer_of.get(request_id)
        if transfer_id is None:
            raise InvalidInputError(
                f"request {request_id!r} has no pending transfer; call prepare_request first."
            )
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            outcomes = self.poll()
            mine = [o for o in outcomes if o.transfer_id == transfer_id]
            self._undelivered.extend(o for o in outcomes if o.transfer_id != transfer_id)
            if mine:
                if mine[0].error is not None:
                    raise mine[0].error
                return
            if give_up is not None and time.monotonic() >= give_up:
                raise TimeoutError(
                    f"transfer {transfer_id} for request {request_id!r} still pending after "
                    f"{timeout_s:g} s of wait(); it stays pending until its deadline."
                )
            time.sleep(0.0005)

    def cancel(self, request_id: Hashable) -> None:
        """Give up on a request's transfer and release its rows (`cache.abort`)."""
        transfer_id = self._transfer_of.get(request_id)
        if transfer_id is None:
            raise InvalidInputError(f"request {request_id!r} has no pending transfer to cancel.")
        self._retire(transfer_id, "cancelled")
        self._release(request_id)

    def close(self) -> None:
        """Cancel every pending transfer and deregister the pool. The endpoint is unusable after."""
        for request_id in self.pending:
            self.cancel(request_id)
        if self._registration is not None:
            self._agent.deregister_memory(self._registration)
            self._registration = None
        self._closed = True

    # --- internals ---------------------------------------------------------------------------
    def _ticket(self, request_id: Hashable, reservation: Any) -> TransferTicket:
        row_bytes = int(reservation.row_bytes)
        rows = np.asarray(reservation.rows, dtype=np.int64)
        addresses = []
        if len(reservation.layers) > len(self._pool_ranges):
            raise TransferError(
                f"the cache reserved rows of request {request_id!r} in "
                f"{len(reservation.layers)} layers but this endpoint registered "
                f"{len(self._pool_ranges)} layers; pass every layer's host tensor "
                "(or leave host_tensors out to use the cache's own)."
            )
        for layer in reservation.layers:
            start, end = int(layer.base_address), int(layer.base_address) + int(layer.num_bytes)
            reg_start, reg_end = self._pool_ranges[layer.layer]
            if not reg_start <= start < end <= reg_end:
                raise TransferError(
                    f"layer {layer.layer} of request {request_id!r} is at "
                    f"[{start:#x}, {end:#x}) but the registered pool is at "
                    f"[{reg_start:#x}, {reg_end:#x}); the cache reallocated its host pool, "
                    "so create a new NixlDecodeEndpoint and publish() again."
                )
            if rows.size and (rows.min() < 0 or (rows.max() + 1) * row_bytes > end - start):
                raise TransferError(
                    f"reserved rows of request {request_id!r} span {rows.min()}..{rows.max()}, "
                    f"outside layer {layer.layer}'s {(end - start) // row_bytes} rows."
                )
            addresses.append(start)
        return TransferTicket(
            transfer_id=f"{self._id_prefix}-{next(self._ids)}",
            request_id=str(request_id),
            agent_name=self.agent_name,
            num_tokens=int(rows.size),
            row_bytes=row_bytes,
            layer_addresses=tuple(addresses),
            runs=coalesce_rows(rows),
        )

    def _on_notification(self, sender: str, message: bytes) -> TransferOutcome | None:
        parsed = parse_notification(message)
        if parsed is None:
            logger.debug("ignoring a non-hisparse NIXL notification from %s: %r", sender, message)
            return None
        kind, transfer_id, reason = parsed
        pending = self._pending.get(transfer_id)
        if pending is None:
            # Typical after a timeout or cancel: the prefill node finished late. The rows were
            # already released, so nothing here may touch the cache.
            logger.warning(
                "ignoring a late %r notification from %s for transfer %s (%s)",
                kind,
                sender,
                transfer_id,
                self._retired.get(transfer_id, "unknown to this endpoint"),
            )
            return None
        if kind == "fail":
            error = TransferError(
                f"prefill node {sender!r} could not write KV transfer {transfer_id} for request "
                f"{pending.request_id!r}: {reason or 'no reason given'}; its "
                f"{pending.ticket.num_tokens} host rows were released. Re-run prefill."
            )
            return self._fail(transfer_id, error, why=f"failed on {sender}")
        if kind != "done":
            logger.warning("ignoring NIXL notification of unknown kind %r from %s", kind, sender)
            return None
        try:
            self.cache.complete_transfer(pending.request_id)
        except HisparseError as exc:
            self._retire(transfer_id, "completed")
            return TransferOutcome(pending.request_id, transfer_id, exc)
        # Retired only now: after any other exception the request stays pending, so its
        # deadline still releases the rows instead of the endpoint forgetting them.
        self._retire(transfer_id, "completed")
        return TransferOutcome(pending.request_id, transfer_id)

    def _fail(self, transfer_id: str, error: TransferError, why: str) -> TransferOutcome:
        pending = self._retire(transfer_id, why)
        self._release(pending.request_id)
        logger.warning("%s", error)
        return TransferOutcome(pending.request_id, transfer_id, error)

    def _release(self, request_id: Hashable) -> None:
        try:
            self.cache.abort(request_id)
        except (UnknownRequestError, RequestStateError):
            # Someone called cache.abort directly (endpoint.cancel is the way); nothing is held.
            logger.warning("request %r was already released from the cache", request_id)

    def _retire(self, transfer_id: str, why: str) -> _Pending:
        pending = self._pending.pop(transfer_id)
        del self._transfer_of[pending.request_id]
        self._retired[transfer_id] = f"request {pending.request_id!r}, {why}"
        while len(self._retired) > _RETIRED_MEMORY:
            self._retired.popitem(last=False)
        return pending


__all__ = ["NixlDecodeEndpoint", "TransferOutcome"]
