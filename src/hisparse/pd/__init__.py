"""Prefill/decode disaggregation: transfer engines write a request's KV into reserved host rows.

Importing this package never needs NIXL; constructing a NIXL endpoint or sender does
(`pip install 'hisparse[pd]'`).
"""

from hisparse.pd.decode_endpoint import NixlDecodeEndpoint, TransferOutcome
from hisparse.pd.nixl_adapter import import_nixl
from hisparse.pd.prefill_sender import NixlPrefillSender, PrefillWrite
from hisparse.pd.ticket import TransferTicket, coalesce_rows, split_runs

__all__ = [
    "NixlDecodeEndpoint",
    "NixlPrefillSender",
    "PrefillWrite",
    "TransferOutcome",
    "TransferTicket",
    "coalesce_rows",
    "import_nixl",
    "split_runs",
]
