"""A verify step's end values for a batch of long requests (numpy over the slots,
`core.verify._long_end_values`) are those of the loop over its records (`_end_values`), for
random lengths, accept counts and extent boundaries; cancelled too (nothing kept). The batch
is over the 8 requests below which the engine takes the loop, and after each end the slot
arrays and tables agree with the records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hisparse
from hisparse.core.verify import _end_values, _long_end_values
from test_slot_state import check_slot_arrays


@pytest.mark.parametrize("tokens", [2, 3, 4])
def test_long_end_values_are_the_loops(tokens: int, rng: torch.Generator) -> None:
    E, H = 4, 8
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=1, index_group_size=1, row_bytes=16, top_k=2, hot_slots=H,
        extent_tokens=E, max_requests=10, host_pool_tokens=200 * E, max_seq_len=40 * E,
        max_draft_tokens=4, residency_map="position")
    cache = hisparse.HiSparseCache(config, device="cpu")
    ids = [f"r{i}" for i in range(10)]
    for request_id in ids:  # long (> H), ending anywhere in an extent
        length = H + 1 + int(torch.randint(0, 3 * E, (1,), generator=rng))
        cache.admit(request_id, length)
        cache.write_prefill(request_id, torch.zeros(1, length, 16, dtype=torch.uint8))
        cache.commit_prefill(request_id)
    for _ in range(8):
        step = cache.begin_decode_step(ids, num_tokens=tokens)
        c = cache._decode
        first = np.asarray(step._first, dtype=np.int64)
        for kept in ([0] * len(ids),
                     torch.randint(1, tokens + 1, (len(ids),), generator=rng).tolist()):
            want, want_released = _end_values(c, step._records, step._first,
                                              step._extents_before, kept)
            got, got_released = _long_end_values(
                c, step._records, c.slots.slots_of(step._records), first,
                np.asarray(kept, dtype=np.int64), step._extents_before)
            assert got_released == want_released
            assert {k: np.asarray(v).tolist() for k, v in got.items()} == {
                k: np.asarray(v).tolist() for k, v in want.items()}
        step.write_newest(0, torch.zeros(len(ids), tokens, 16, dtype=torch.uint8))
        step.end(accepted=kept)
        check_slot_arrays(cache)
    cache.close()
