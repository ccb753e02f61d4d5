"""Prefill/decode disaggregation: transfer engines write a request's KV into reserved host rows.

Importing this package never needs NIXL; constructing a NIXL endpoint or sender does
(`pip install 'hisparse[pd]'`).
"""

from hisparse.pd.nixl_adapter import (
    NixlDecodeEndpoint,
    NixlPrefillSender,
    PrefillWrite,
    TransferOutcome,
    import_nixl,
)
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
