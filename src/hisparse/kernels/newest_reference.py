"""The newest-token write in plain torch: the CPU backend's, and the reference of
`kernels/newest_triton.py` (the same call)."""

from __future__ import annotations

import torch


class NewestWriterReference:
    """Write each batch row's new token into its device row of one layer: `rows [B, W]` uint8
    into `device_kv[layer]` at `newest_rows_long[:B]` (padding rows go to the sink row), one
    `index_copy_`. The views of the first B rows are made once per B."""

    def __init__(self, device_kv: torch.Tensor, newest_rows: torch.Tensor,
                 newest_rows_long: torch.Tensor) -> None:
        self._layers = [device_kv[layer] for layer in range(device_kv.shape[0])]
        self._newest_rows_long = newest_rows_long
        self._index: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, rows: torch.Tensor) -> None:
        count = rows.shape[0]
        index = self._index.get(count)
        if index is None:
            index = self._index[count] = self._newest_rows_long[:count]
        self._layers[layer].index_copy_(0, index, rows)
