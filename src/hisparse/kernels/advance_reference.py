"""A quiet decode step's batch, moved on by one token on the device (the torch reference).

A step whose batch and tables are the last step's, every request long and every new token
inside the extent of the token before it (core.batch.QuietRun decides), needs no plan and no
upload: each real row's new token sits one host row after the last one's, its new length is
one more, and its slot's `seq_len` becomes that length. `newest_rows` stays (a long request's
newest token always goes to slot `H`). `kernels/advance_triton.py` does the same in one
launch.
"""

from __future__ import annotations

import torch


class AdvanceReference:
    """`advance(rows)`: the first `rows` batch rows moved on by a token: three torch ops."""

    def __init__(self, batch_slots: torch.Tensor, num_real: torch.Tensor,
                 newest_host_rows: torch.Tensor, new_seq_lens: torch.Tensor,
                 seq_lens: torch.Tensor) -> None:
        self._slots = batch_slots  # [Bcap] int64 request slot per row
        self._host_rows = newest_host_rows  # [Bcap] int32
        self._lengths = new_seq_lens  # [Bcap] int32
        self._seq_lens = seq_lens  # [R] int32, the tables'
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}  # by row count: no slicing

    def __call__(self, rows: int) -> None:
        views = self._views.get(rows)
        if views is None:
            views = self._views[rows] = (self._host_rows[:rows], self._lengths[:rows],
                                         self._slots[:rows])
        host_rows, lengths, slots = views
        host_rows += 1
        lengths += 1
        self._seq_lens.index_copy_(0, slots, lengths)
