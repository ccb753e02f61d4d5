"""Altered transfer tickets: every field a sender turns into addresses must be refused with an
InvalidInputError, never coerced or wrapped into an address inside the decode node's pool."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hisparse.errors import InvalidInputError
from hisparse.pd import TransferTicket

GOOD = TransferTicket("t-1", "r", "agent", 5, 16, (4096,), ((0, 0, 3), (3, 9, 2)))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # int64 arithmetic would wrap 2**62 * 16 to 0: layer 0's base, rows of another request.
        ({"runs": [[0, 2**62, 3], [3, 9, 2]]}, "outside the byte range"),
        ({"row_bytes": 2**60}, "outside the byte range"),
        ({"layer_addresses": [-4096]}, "outside the byte range"),
        ({"layer_addresses": [2**64]}, "outside the byte range"),
        ({"device_id": -1}, "device_id"),
        # JSON from to_bytes() holds ints; anything else was altered and must not be truncated.
        ({"row_bytes": 16.7}, "malformed"),
        ({"num_tokens": "5"}, "malformed"),
        ({"runs": [[0, 0, 3.0], [3, 9, 2]]}, "malformed"),
        ({"row_bytes": float("inf")}, "malformed"),
        ({"device_id": True}, "malformed"),
        # Rows below the layer base, rows of no size, or no layers to write at all.
        ({"runs": [[0, -1, 3], [3, 9, 2]]}, "altered in transit"),
        ({"row_bytes": 0}, "row_bytes=0"),
        ({"row_bytes": -16}, "row_bytes=-16"),
        ({"layer_addresses": []}, "0 layers"),
    ],
)
def test_out_of_range_or_non_int_fields_are_refused(change: dict[str, Any], message: str) -> None:
    altered = {**GOOD.to_dict(), **change}
    with pytest.raises(InvalidInputError, match=message):
        TransferTicket.from_dict(altered)


@pytest.mark.parametrize("payload", [[1, 2], "ticket", None])
def test_a_ticket_that_is_not_a_dict_is_refused_clearly(payload: Any) -> None:
    with pytest.raises(InvalidInputError, match="not an object"):
        TransferTicket.from_dict(payload)


def test_good_tickets_still_round_trip() -> None:
    assert TransferTicket.from_dict(GOOD.to_dict()) == GOOD
    assert TransferTicket.from_bytes(GOOD.to_bytes()) == GOOD
    big = TransferTicket("t-2", "r", "a", 4, 656, (0x7F00_0000_0000, 0x7F10_0000_0000),
                         ((0, 10_000_000, 4),))
    assert TransferTicket.from_bytes(big.to_bytes()) == big
    assert big.destination_descriptors()[1].tolist() == [
        0x7F10_0000_0000 + 656 * 10_000_000, 4 * 656, 0
    ]
    numpy_ints = {**GOOD.to_dict(), "num_tokens": np.int64(5)}
    assert TransferTicket.from_dict(numpy_ints) == GOOD
