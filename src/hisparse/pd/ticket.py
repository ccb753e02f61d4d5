"""What the decode node tells a prefill node so it can write a request's KV into its host pool.

A ticket is plain data (no NIXL objects), so it travels through whatever side channel the
serving framework already has (ZMQ, HTTP, a KV store) as JSON bytes, and it serves any
transfer engine that writes (address, length) runs: NIXL here, Mooncake the same way.

Rows are described as *runs*: `(first_token, first_row, num_rows)` says that tokens
`first_token .. first_token + num_rows - 1` of the request live in host rows
`first_row .. first_row + num_rows - 1`, in every layer. Host extents make runs long
(`extent_tokens` rows each, adjacent extents merge), so a request needs about
`num_layers * num_tokens / extent_tokens` descriptors, not one per row.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hisparse.errors import InvalidInputError

TICKET_VERSION = 1
# Senders compute `address + row * row_bytes` in int64 (numpy): a larger value would wrap
# silently, possibly onto another request's rows in the decode node's registered pool.
_BYTE_LIMIT = 2**63


def _int(value: Any) -> int:
    """An integer field as to_dict() wrote it; a float, string or bool means it was altered."""
    if isinstance(value, bool):
        raise TypeError(f"{value!r} is a bool, not an int")
    return operator.index(value)


def coalesce_rows(rows: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """Split a token -> row map into runs of consecutive rows: `(first_token, first_row, n)`."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if rows.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [rows.size])))
    return tuple((int(t), int(rows[t]), int(n)) for t, n in zip(starts, lengths, strict=True))


def split_runs(runs: Sequence[tuple[int, int, int]], source_rows: np.ndarray) -> np.ndarray:
    """Cut destination runs where the source rows stop being consecutive too.

    Returns an int64 array `[M, 4]` of `(first_token, dst_row, src_row, num_rows)`: each
    entry is one contiguous copy on both sides.
    """
    source_rows = np.asarray(source_rows, dtype=np.int64).reshape(-1)
    pieces = []
    for first_token, first_row, count in runs:
        src = source_rows[first_token : first_token + count]
        for offset, src_row, n in coalesce_rows(src):
            pieces.append((first_token + offset, first_row + offset, src_row, n))
    return np.asarray(pieces, dtype=np.int64).reshape(-1, 4)


@dataclass(frozen=True)
class TransferTicket:
    """Where one request's rows go on the decode node, for every layer.

    `transfer_id` is unique per prepared transfer (a request id may come back after an
    abort); the prefill side echoes it in the completion notification.
    """

    transfer_id: str
    request_id: str  # str() of the engine's id; for log lines on the prefill side
    agent_name: str  # the decode node's NIXL agent
    num_tokens: int
    row_bytes: int
    layer_addresses: tuple[int, ...]  # base address of each layer's [N, W] host tensor
    runs: tuple[tuple[int, int, int], ...]  # (first_token, first_row, num_rows)
    mem_type: str = "DRAM"
    device_id: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_addresses)

    def rows(self) -> np.ndarray:
        """The host row of every token, int64 `[num_tokens]`."""
        out = np.empty(self.num_tokens, dtype=np.int64)
        for first_token, first_row, count in self.runs:
            out[first_token : first_token + count] = np.arange(first_row, first_row + count)
        return out

    def destination_descriptors(self) -> np.ndarray:
        """`(address, num_bytes, device_id)` per run and layer, layer-major, uint64 `[L*M, 3]`."""
        runs = np.asarray(self.runs, dtype=np.int64).reshape(-1, 3)
        bases = np.asarray(self.layer_addresses, dtype=np.uint64)[:, None]
        offsets = (runs[:, 1] * self.row_bytes).astype(np.uint64)[None, :]
        lengths = (runs[:, 2] * self.row_bytes).astype(np.uint64)
        out = np.empty((self.num_layers, len(runs), 3), dtype=np.uint64)
        out[:, :, 0] = bases + offsets
        out[:, :, 1] = lengths[None, :]
        out[:, :, 2] = self.device_id
        return out.reshape(-1, 3)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": TICKET_VERSION,
            "transfer_id": self.transfer_id,
            "request_id": self.request_id,
            "agent_name": self.agent_name,
            "num_tokens": self.num_tokens,
            "row_bytes": self.row_bytes,
            "layer_addresses": list(self.layer_addresses),
            "runs": [list(run) for run in self.runs],
            "mem_type": self.mem_type,
            "device_id": self.device_id,
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransferTicket:
        """Rebuild a ticket, checking that it is one this version wrote and is self-consistent."""
        if not isinstance(data, dict):
            raise InvalidInputError(
                f"transfer ticket is a {type(data).__name__}, not an object; pass the dict or "
                "bytes that TransferTicket.to_dict()/to_bytes() produced."
            )
        version = data.get("version")
        if version != TICKET_VERSION:
            raise InvalidInputError(
                f"transfer ticket version {version!r} is not supported (this hisparse reads "
                f"version {TICKET_VERSION}); run the same hisparse version on both nodes."
            )
        try:
            ticket = cls(
                transfer_id=str(data["transfer_id"]),
                request_id=str(data["request_id"]),
                agent_name=str(data["agent_name"]),
                num_tokens=_int(data["num_tokens"]),
                row_bytes=_int(data["row_bytes"]),
                layer_addresses=tuple(_int(a) for a in data["layer_addresses"]),
                runs=tuple((_int(t), _int(r), _int(n)) for t, r, n in data["runs"]),
                mem_type=str(data["mem_type"]),
                device_id=_int(data["device_id"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInputError(
                f"transfer ticket is malformed ({exc!r}); pass the dict or bytes that "
                "TransferTicket.to_dict()/to_bytes() produced, unmodified."
            ) from exc
        ticket._check_runs()
        return ticket

    @classmethod
    def from_bytes(cls, payload: bytes) -> TransferTicket:
        try:
            data = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidInputError(
                f"transfer ticket bytes are not JSON ({exc}); pass what to_bytes() returned."
            ) from exc
        return cls.from_dict(data)

    def _check_runs(self) -> None:
        covered = 0
        for first_token, first_row, count in self.runs:
            if first_token != covered or count <= 0 or first_row < 0:
                raise InvalidInputError(
                    f"transfer ticket {self.transfer_id}: run {(first_token, first_row, count)} "
                    f"does not continue at token {covered} with a positive length; the ticket "
                    "was altered in transit."
                )
            covered += count
        if covered != self.num_tokens or self.row_bytes <= 0 or not self.layer_addresses:
            raise InvalidInputError(
                f"transfer ticket {self.transfer_id}: runs cover {covered} tokens of "
                f"{self.num_tokens}, row_bytes={self.row_bytes}, "
                f"{len(self.layer_addresses)} layers; the ticket was altered in transit."
            )
        end_rows = max((first_row + count for _, first_row, count in self.runs), default=0)
        end_bytes = end_rows * self.row_bytes
        for address in self.layer_addresses:
            if not 0 <= address < _BYTE_LIMIT - end_bytes:
                raise InvalidInputError(
                    f"transfer ticket {self.transfer_id}: layer address {address:#x} plus "
                    f"{end_bytes} bytes of rows falls outside the byte range [0, 2**63); the "
                    "ticket was altered in transit."
                )
        if self.device_id < 0:
            raise InvalidInputError(
                f"transfer ticket {self.transfer_id}: device_id {self.device_id} is negative; "
                "the ticket was altered in transit."
            )
