"""The newest-token backup in plain torch ops: the CPU backend's, and the reference of
`backup_triton`."""

from __future__ import annotations

import torch

from hisparse.layout.tables import CacheTables


def backup_newest_reference(
    tables: CacheTables,
    newest_rows: torch.Tensor,  # [Bcap] int32 device row of each batch row's newest token
    host_rows: torch.Tensor,  # [Bcap] int32 host row the newest token belongs to
    num_real: torch.Tensor,  # [1] int32: rows >= num_real are padding
) -> None:
    """Copy every layer's newest rows back to their host rows (the decode backup path).

    Reads the real count back to the host: fine on the CPU, a sync on accelerators, which
    bind a kernel that writes host memory directly instead.
    """
    # Rows b < num_real are real, as in the Triton backup: a negative count is none (as a
    # slice bound it would count from the end).
    count = max(0, int(num_real.reshape(-1)[0]))
    if count == 0:
        return
    device_rows = newest_rows[:count].long()
    targets = host_rows[:count].long()
    # Out-of-range rows would be an engine bug; skipped, as the Triton backup skips them,
    # rather than wrapped around (-1 is the last row) or raised on halfway through the layers.
    num_host_rows = min((host.shape[0] for host in tables.host_kv), default=0)
    keep = (device_rows >= 0) & (device_rows < tables.device_kv.shape[1]) & (targets >= 0)
    keep &= targets < num_host_rows
    device_rows, targets = device_rows[keep], targets[keep]
    rows = tables.device_kv[:, device_rows]  # [L, B, W]
    for layer, host in enumerate(tables.host_kv):
        host[targets.to(host.device)] = rows[layer].to(host.device)
