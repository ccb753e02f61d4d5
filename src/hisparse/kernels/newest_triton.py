"""The newest-token write in Triton: one bound launch per (layer, batch rows) in place of an
`index_copy_` (9.2 us of host time on the H200; a bound launch replays in about 5 us).

Same call as `kernels.newest_reference.NewestWriterReference`. Rows move as 4-byte words, so
the kernel takes rows whose width is a multiple of 4 bytes, packed one after another from a
4-byte aligned address: the layout of a `[B, W]` slice of a framework's KV output. Any other
layout (a strided view, an odd width) takes the reference's `index_copy_`, chosen per call
here, the one place that knows both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.kernels.launching import BoundLaunch
from hisparse.kernels.newest_reference import NewestWriterReference


@triton.jit
def write_newest_row(
    b,  # the batch row
    rows_ptr,  # [B, ROW_WORDS] words of the new tokens' rows (any pointer type: cast here)
    newest_rows_ptr,  # [Bcap] int32 device row of each batch row's new token
    layer_ptr,  # [D, ROW_WORDS] int32: the layer's device rows
    num_device_rows,  # D (the sink row included)
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    """Batch row b's new token into its device row; also run by the swap-in's lookup kernel
    when a call hands it the layer's new rows (`swap_in(..., newest_kv=)`). Returns the
    row's words and whether they were written (the lookup may back them up to host)."""
    row = tl.load(newest_rows_ptr + b)
    words = tl.arange(0, BLOCK_WORDS)
    # An out-of-range row would be an engine bug; skipping it keeps every access in bounds.
    move = (row >= 0) & (row < num_device_rows)
    mask = tl.where(move, words < ROW_WORDS, False)
    source = rows_ptr.to(tl.pointer_type(tl.int32)) + b.to(tl.int64) * ROW_WORDS
    data = tl.load(source + words, mask=mask)
    tl.store(layer_ptr + row.to(tl.int64) * ROW_WORDS + words, data, mask=mask)
    return data, move


@triton.jit
def _write_newest_kernel(rows_ptr, newest_rows_ptr, layer_ptr, num_device_rows,
                         ROW_WORDS: tl.constexpr, BLOCK_WORDS: tl.constexpr):
    write_newest_row(tl.program_id(0), rows_ptr, newest_rows_ptr, layer_ptr, num_device_rows,
                     ROW_WORDS, BLOCK_WORDS)


class NewestWriterTriton:
    """`NewestWriterReference`'s call through one bound launch per (layer, rows), rebound in
    place when the caller's rows move (they do every step: a fresh activation)."""

    def __init__(self, device_kv: torch.Tensor, newest_rows: torch.Tensor,
                 newest_rows_long: torch.Tensor, *, direct: bool = True) -> None:
        self._reference = NewestWriterReference(device_kv, newest_rows, newest_rows_long)
        num_layers, self._num_device_rows, row_bytes = device_kv.shape
        self._words = row_bytes // 4 if row_bytes % 4 == 0 and device_kv.is_contiguous() else 0
        self._layers = ([device_kv[layer].view(torch.int32) for layer in range(num_layers)]
                        if self._words else [])
        self._newest_rows = newest_rows
        self._direct = direct
        self._launches: dict[tuple[int, int], BoundLaunch] = {}

    def __call__(self, layer: int, rows: torch.Tensor) -> None:
        address = rows.data_ptr()  # read once: a method call per read
        if not self._words or address % 4 or not rows.is_contiguous():
            self._reference(layer, rows)
            return
        key = (layer, rows.shape[0])
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = BoundLaunch(
                _write_newest_kernel, (rows.shape[0],),
                (rows, self._newest_rows, self._layers[layer], self._num_device_rows),
                {"ROW_WORDS": self._words, "BLOCK_WORDS": triton.next_power_of_2(self._words),
                 "num_warps": 2 if self._words > 128 else 1},
                device=rows.device, direct=self._direct)
        elif launch.address(0) != address:
            launch.rebind(0, rows)
        launch()
