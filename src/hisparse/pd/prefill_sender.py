"""Prefill side of the NIXL transfer: WRITEs a request's rows from this node's registered
memory into the host rows a decode node's ticket names (see `nixl_adapter`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np
import torch

from hisparse.errors import InvalidInputError, TransferError
from hisparse.pd.nixl_adapter import (
    byte_range,
    done_notification,
    fail_notification,
    import_nixl,
    logger,
    memory_of,
    start_agent,
)
from hisparse.pd.ticket import TransferTicket, split_runs


class PrefillWrite:
    """One posted WRITE; `poll()` until True or `wait()`. Errors raise `TransferError`."""

    def __init__(self, sender: NixlPrefillSender, ticket: TransferTicket, handle: Any) -> None:
        self.ticket = ticket
        self._sender = sender
        self._handle = handle
        self._error: TransferError | None = None
        self.done = False

    def poll(self) -> bool:
        """True once every row landed on the decode node (its notification is then on its way)."""
        if self._error is not None:
            raise self._error
        if self.done:
            return True
        try:
            state = self._sender._agent.check_xfer_state(self._handle)
        except Exception as exc:
            self._fail(f"NIXL reported {exc!r}", exc)
        if state == "ERR":
            self._fail("NIXL reported the transfer state ERR", None)
        if state != "DONE":
            return False
        self.done = True
        self._sender._agent.release_xfer_handle(self._handle)
        return True

    def wait(self, timeout_s: float = 30.0) -> None:
        """Block until done; a timeout cancels the transfer and raises `TransferError`."""
        give_up = time.monotonic() + timeout_s
        while not self.poll():
            if time.monotonic() >= give_up:
                self._fail(f"not finished after {timeout_s:g} s", None)
            time.sleep(0.0005)

    def _fail(self, reason: str, cause: BaseException | None) -> NoReturn:
        try:  # releasing an active handle asks NIXL to cancel it
            self._sender._agent.release_xfer_handle(self._handle)
            cancelled = True
        except Exception:
            logger.warning("could not cancel NIXL transfer %s", self.ticket.transfer_id)
            cancelled = False
        if cancelled:
            self._sender._notify_failure(self.ticket, reason)
            release = "on the failure notice"
        else:
            # The WRITE may still be landing: a notice now would free the rows for another
            # request under it. The decode node's deadline releases them later instead.
            release = "at its deadline (NIXL could not cancel the write, so no notice was sent)"
        self._error = TransferError(
            f"KV transfer {self.ticket.transfer_id} of request {self.ticket.request_id} to "
            f"{self.ticket.agent_name!r} failed: {reason}. The decode node releases the rows "
            f"{release}; re-run prefill for this request."
        )
        raise self._error from cause


class NixlPrefillSender:
    """Prefill side: WRITEs a request's rows from its own registered memory to a decode ticket.

    Args:
        agent_name: this node's NIXL agent name, unique among the agents that talk to it.
        backends: NIXL backends to start.
    """

    def __init__(self, agent_name: str, *, backends: Sequence[str] = ("UCX",)) -> None:
        nixl = import_nixl()
        self.agent_name = agent_name
        self._agent = start_agent(nixl, agent_name, backends)
        self._registered: list[tuple[int, int, Any]] = []  # (start, end, registration)
        self._tensors: list[torch.Tensor] = []
        self._connected: set[str] = set()

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register the memory rows will be read from (once per buffer, e.g. the KV pool)."""
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise InvalidInputError(
                    f"cannot register a non-contiguous tensor of shape {tuple(tensor.shape)}; "
                    "register the contiguous buffer it is a view of."
                )
            start, end = byte_range(tensor)
            try:
                registration = self._agent.register_memory([tensor])
            except Exception as exc:
                raise TransferError(
                    f"NIXL agent {self.agent_name!r} could not register {end - start} bytes "
                    f"at {start:#x}: {exc}."
                ) from exc
            self._registered.append((start, end, registration))
            self._tensors.append(tensor)

    def connect(self, decode_metadata: bytes) -> str:
        """Load a decode node's `publish()` output; returns its agent name."""
        try:
            name = self._agent.add_remote_agent(decode_metadata)
        except Exception as exc:
            raise TransferError(
                f"could not load the decode node's NIXL metadata ({len(decode_metadata)} bytes): "
                f"{exc}; pass exactly what NixlDecodeEndpoint.publish() returned."
            ) from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._connected.add(name)
        return name

    def write(
        self,
        ticket: TransferTicket | bytes | dict[str, Any],
        layers: Sequence[torch.Tensor],
        source_rows: np.ndarray | Sequence[int] | None = None,
    ) -> PrefillWrite:
        """Post one WRITE of every layer's rows for the ticket, with a completion notification.

        Args:
            ticket: what the decode node's `prepare_request` returned (object, bytes or dict).
            layers: per layer a registered 2D tensor whose rows are `ticket.row_bytes` wide.
            source_rows: row of each token in those tensors (same in every layer);
                default `0 .. num_tokens-1`.

        Raises:
            InvalidInputError: the sources do not match the ticket (nothing was sent).
            TransferError: NIXL refused or failed the transfer (the decode node is told).
        """
        if not isinstance(ticket, TransferTicket):
            ticket = (
                TransferTicket.from_bytes(ticket)
                if isinstance(ticket, bytes)
                else TransferTicket.from_dict(ticket)
            )
        rows = self._check_sources(ticket, layers, source_rows)
        pieces = split_runs(ticket.runs, rows)  # [M, 4]: first_token, dst_row, src_row, n
        width = ticket.row_bytes
        lengths = (pieces[:, 3] * width).astype(np.uint64)
        remote = np.empty((ticket.num_layers, len(pieces), 3), dtype=np.uint64)
        local = np.empty_like(remote)
        for layer, tensor in enumerate(layers):
            remote[layer, :, 0] = ticket.layer_addresses[layer] + pieces[:, 1] * width
            local[layer, :, 0] = tensor.data_ptr() + pieces[:, 2] * width
        remote[:, :, 1] = local[:, :, 1] = lengths
        remote[:, :, 2] = ticket.device_id
        local_type, local_device = memory_of(layers[0])
        local[:, :, 2] = local_device
        agent = self._agent
        try:
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local.reshape(-1, 3), local_type),
                agent.get_xfer_descs(remote.reshape(-1, 3), ticket.mem_type),
                ticket.agent_name,
                done_notification(ticket.transfer_id),
            )
        except Exception as exc:
            reason = f"NIXL refused the descriptors ({exc!r})"
            self._notify_failure(ticket, reason)
            raise TransferError(
                f"KV transfer {ticket.transfer_id} of request {ticket.request_id} to "
                f"{ticket.agent_name!r} could not start: {reason}. The ticket does not match "
                "the decode node's registered pool (stale ticket or metadata?); re-run prefill."
            ) from exc
        write = PrefillWrite(self, ticket, handle)
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            write._fail(f"posting failed ({exc!r})", exc)
        if state == "ERR":
            write._fail("posting returned ERR", None)
        return write

    def close(self) -> None:
        """Deregister this sender's memory and forget connected decode agents."""
        for name in self._connected:
            self._agent.remove_remote_agent(name)
        self._connected.clear()
        for _, _, registration in self._registered:
            self._agent.deregister_memory(registration)
        self._registered.clear()
        self._tensors.clear()

    def _check_sources(
        self,
        ticket: TransferTicket,
        layers: Sequence[torch.Tensor],
        source_rows: np.ndarray | Sequence[int] | None,
    ) -> np.ndarray:
        if ticket.agent_name not in self._connected:
            raise InvalidInputError(
                f"decode agent {ticket.agent_name!r} is not connected to {self.agent_name!r}; "
                "call connect() with the metadata its NixlDecodeEndpoint.publish() returned."
            )
        if len(layers) != ticket.num_layers:
            raise InvalidInputError(
                f"ticket {ticket.transfer_id} has {ticket.num_layers} layers but "
                f"{len(layers)} source tensors were given; pass one per layer."
            )
        rows = (
            np.arange(ticket.num_tokens, dtype=np.int64)
            if source_rows is None
            else np.asarray(source_rows, dtype=np.int64).reshape(-1)
        )
        if rows.size != ticket.num_tokens:
            raise InvalidInputError(
                f"ticket {ticket.transfer_id} has {ticket.num_tokens} tokens but "
                f"{rows.size} source rows were given."
            )
        for layer, tensor in enumerate(layers):
            width = tensor.shape[-1] * tensor.element_size() if tensor.dim() == 2 else -1
            if width != ticket.row_bytes or not tensor.is_contiguous():
                raise InvalidInputError(
                    f"source layer {layer} has shape {tuple(tensor.shape)} and dtype "
                    f"{tensor.dtype} (contiguous={tensor.is_contiguous()}); the ticket needs "
                    f"contiguous [rows, W] tensors with {ticket.row_bytes}-byte rows."
                )
            if rows.size and (rows.min() < 0 or rows.max() >= tensor.shape[0]):
                raise InvalidInputError(
                    f"source rows span {rows.min()}..{rows.max()} but layer {layer} has "
                    f"{tensor.shape[0]} rows."
                )
            if tensor.device != layers[0].device:
                raise InvalidInputError(
                    f"source layer {layer} is on {tensor.device}, layer 0 on "
                    f"{layers[0].device}; keep all layers of one write on one device."
                )
            start, end = byte_range(tensor)
            if not any(s <= start and end <= e for s, e, _ in self._registered):
                raise InvalidInputError(
                    f"source layer {layer} ([{start:#x}, {end:#x})) is not in memory this "
                    "sender registered; call register() with its buffer first."
                )
        return rows

    def _notify_failure(self, ticket: TransferTicket, reason: str) -> None:
        """Tell the decode node to release the rows now rather than at its deadline."""
        message = fail_notification(ticket.transfer_id, reason)
        try:
            self._agent.send_notif(ticket.agent_name, message)
        except Exception as exc:  # the decode node may be gone; its deadline covers that
            logger.info("could not send the failure notice for %s: %r", ticket.transfer_id, exc)


__all__ = ["NixlPrefillSender", "PrefillWrite"]
