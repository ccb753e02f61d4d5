"""Prefill/decode disaggregation over NIXL: the prefill node WRITEs a request's KV rows
straight into the decode node's host pool, then a notification makes the request decodable.

Decode node::

    endpoint = NixlDecodeEndpoint(cache, "decode-0")
    metadata = endpoint.publish()                      # once, to every prefill node
    ticket = endpoint.prepare_request(rid, num_tokens) # reserves host rows in all layers
    send(ticket.to_bytes())                            # framework side channel
    for outcome in endpoint.poll():                    # every scheduler tick
        if outcome.error is None: schedule_decode(outcome.request_id)

Prefill node::

    sender = NixlPrefillSender("prefill-0")
    sender.register(kv_layers)                         # once: its own KV memory
    sender.connect(metadata)                           # once per decode node
    sender.write(TransferTicket.from_bytes(payload), kv_layers, source_rows).wait()

Neither class is thread-safe: call each from one thread (the scheduler's).

The decode side is `decode_endpoint.py`, the prefill side `prefill_sender.py`. This module is
what both share: importing NIXL, starting an agent, describing memory to it, and the wire
format of the notifications the prefill node sends the decode node. Both log to this
module's logger, `hisparse.pd.nixl_adapter`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch

from hisparse.errors import MissingDependencyError, TransferError

logger = logging.getLogger(__name__)

_NOTIF_PREFIX = b"hisparse/1 "


def import_nixl() -> ModuleType:
    """The NIXL Python module, or a MissingDependencyError that says how to install it."""
    try:
        import nixl_cu12 as nixl
    except ImportError as exc:
        try:
            import nixl  # wheels built for other CUDA versions use the plain name
        except ImportError:
            raise MissingDependencyError(
                f"hisparse.pd needs NIXL, which cannot be imported here ({exc}). "
                "Install it with: pip install 'hisparse[pd]'"
            ) from exc
    return nixl


def start_agent(nixl: ModuleType, name: str, backends: Sequence[str]) -> Any:
    config = nixl.nixl_agent_config(backends=list(backends))
    try:
        return nixl.nixl_agent(name, config)
    except Exception as exc:  # NIXL raises plain RuntimeError / binding errors
        raise TransferError(
            f"could not start NIXL agent {name!r} with backends {list(backends)} ({exc}); "
            "check that the UCX plugin loads (NIXL_LOG_LEVEL=DEBUG shows why)."
        ) from exc


def memory_of(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor."""
    if tensor.device.type == "cpu":
        return "DRAM", 0
    return "VRAM", int(tensor.device.index or 0)


def byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    start = int(tensor.data_ptr())
    return start, start + tensor.numel() * tensor.element_size()



# ---- the notifications: "hisparse/1 done <transfer_id>" or "hisparse/1 fail <id> <reason>" --
def done_notification(transfer_id: str) -> bytes:
    """What the WRITE carries: its arrival on the decode node means every row landed."""
    return _NOTIF_PREFIX + b"done " + transfer_id.encode()


def fail_notification(transfer_id: str, reason: str) -> bytes:
    """Tells the decode node to release the rows now rather than at its deadline."""
    return _NOTIF_PREFIX + f"fail {transfer_id} {reason}".encode()


def parse_notification(message: bytes) -> tuple[str, str, str] | None:
    """(kind, transfer_id, reason) of a hisparse notification; None for any other message."""
    if not message.startswith(_NOTIF_PREFIX):
        return None
    kind, _, rest = message[len(_NOTIF_PREFIX) :].decode(errors="replace").partition(" ")
    transfer_id, _, reason = rest.partition(" ")
    return kind, transfer_id, reason


_MOVED = {  # the classes that lived here, still importable from here
    "NixlDecodeEndpoint": "hisparse.pd.decode_endpoint",
    "TransferOutcome": "hisparse.pd.decode_endpoint",
    "NixlPrefillSender": "hisparse.pd.prefill_sender",
    "PrefillWrite": "hisparse.pd.prefill_sender",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
