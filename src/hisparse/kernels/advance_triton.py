"""`AdvanceReference` in one bound Triton launch (one program over the batch capacity), in
place of its three torch ops: on the H200 each torch op costs 6-9 us of host time and a bound
launch about 5 (benchmarks/NOTES.md, twentieth pass)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.kernels.launching import BoundLaunch


@triton.jit
def _advance_kernel(
    batch_slots_ptr,  # [Bcap] int64 request slot per row
    num_real_ptr,  # [1] int32: rows past it are padding and stay as they are
    host_rows_ptr,  # [Bcap] int32 host row of each row's new token
    lengths_ptr,  # [Bcap] int32 new length of each row's request
    seq_lens_ptr,  # [R] int32 the tables' lengths per request slot
    BLOCK: tl.constexpr,
):
    b = tl.arange(0, BLOCK)
    real = b < tl.load(num_real_ptr)
    host_rows = tl.load(host_rows_ptr + b, mask=real)
    lengths = tl.load(lengths_ptr + b, mask=real) + 1
    tl.store(host_rows_ptr + b, host_rows + 1, mask=real)
    tl.store(lengths_ptr + b, lengths, mask=real)
    slots = tl.load(batch_slots_ptr + b, mask=real, other=0)
    tl.store(seq_lens_ptr + slots, lengths, mask=real)


class AdvanceTriton:
    """`AdvanceReference`'s call as one launch, bound at the first call (its buffers never
    move); the row count comes from `num_real` on the device, which the batch's last upload
    set to the same `rows`."""

    def __init__(self, batch_slots: torch.Tensor, num_real: torch.Tensor,
                 newest_host_rows: torch.Tensor, new_seq_lens: torch.Tensor,
                 seq_lens: torch.Tensor, *, direct: bool = True) -> None:
        capacity = batch_slots.shape[0]
        self._launch = BoundLaunch(
            _advance_kernel, (1,),
            (batch_slots, num_real, newest_host_rows, new_seq_lens, seq_lens),
            {"BLOCK": triton.next_power_of_2(capacity),
             "num_warps": 1 if capacity <= 128 else 4},
            device=batch_slots.device, direct=direct)

    def __call__(self, rows: int) -> None:
        self._launch()
