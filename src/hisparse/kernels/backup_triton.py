"""Newest-token backup in Triton: every layer's new row, device to host, in one launch.

Same signature and semantics as `kernels/swap_in_reference.backup_newest_reference`, but the
real count stays on the device: grid (Bcap, L), and programs of padding rows
(`b >= num_real[0]`) move nothing. So the call never waits for the host and a CUDA graph can
capture it and replay it with another `num_real`.

Rows are written straight into the registered host pool (zero-copy writes over the link). The
per-layer host tensors are separate buffers, so the kernel reads each layer's base address
from a `[L]` int64 device table: `tables.host_kv_addresses` when the engine filled it from
`backend.device_address` (on ROCm the device-side address of registered memory differs from
the host one), else one built here once per `CacheTables` from `data_ptr()`, which is what a
kernel uses on CUDA with unified addressing and on the CPU under TRITON_INTERPRET=1.

`BackupLauncher` is what the GPU backends hand the engine: the same call, checked and bound
once per set of arguments (the engine passes the same persistent buffers every step), then
replayed as a `BoundLaunch` (about 5 us instead of the checks' per-layer loop and triton's
dispatch, 150-300 us on the H200 for 61 layers).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from hisparse.errors import InvalidInputError
from hisparse.kernels.launching import BoundLaunch
from hisparse.layout.tables import CacheTables


@triton.jit
def _backup_kernel(
    num_real_ptr,  # [1] int32: batch rows >= num_real are padding
    newest_rows_ptr,  # [Bcap] int32 device row of each batch row's newest token
    host_rows_ptr,  # [Bcap] int32 host row of that token (-1 on padding rows)
    host_addresses_ptr,  # [L] int64 kernel-usable base address of each layer's host rows
    device_ptr,  # [L, D, ROW_WORDS] int32: every layer's device rows
    num_device_rows,  # D (rows per layer, the sink row included)
    num_host_rows,  # N (rows per layer in the host pool)
    ROW_WORDS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    b = tl.program_id(0)
    layer = tl.program_id(1)
    # The four loads are independent, so they are in flight together.
    num_real = tl.load(num_real_ptr)
    src = tl.load(newest_rows_ptr + b)
    dst = tl.load(host_rows_ptr + b)
    host_base = tl.load(host_addresses_ptr + layer).to(tl.pointer_type(tl.int32))
    # Out-of-range rows would be an engine bug; skipping them keeps every access in bounds.
    move = (b < num_real) & (src >= 0) & (src < num_device_rows) & (dst >= 0)
    move = move & (dst < num_host_rows)
    words = tl.arange(0, BLOCK_WORDS)
    # A scalar condition enters a vector mask through tl.where (see swap_in_triton).
    mask = tl.where(move, words < ROW_WORDS, False)
    device_row = device_ptr + (layer.to(tl.int64) * num_device_rows + src) * ROW_WORDS
    data = tl.load(device_row + words, mask=mask)
    tl.store(host_base + dst.to(tl.int64) * ROW_WORDS + words, data, mask=mask)


_address_tables: weakref.WeakKeyDictionary[CacheTables, torch.Tensor] = (
    weakref.WeakKeyDictionary()
)


def _fail(what: str, seen: object, fix: str) -> InvalidInputError:
    return InvalidInputError(f"{what} (got {seen}); {fix}.")


def _check_vector(name: str, tensor: torch.Tensor, length: int | None, device: torch.device,
                  dtype: torch.dtype = torch.int32) -> None:
    if tensor.dtype != dtype:
        raise _fail(f"{name} must be {dtype}", tensor.dtype, f"pass {name}.to({dtype})")
    if tensor.device != device:
        raise _fail(f"{name} must be on the cache device {device}", tensor.device,
                    f"move {name} to {device}")
    if tensor.dim() != 1 or (length is not None and tensor.shape[0] != length):
        want = "[Bcap]" if length is None else f"[{length}]"
        raise _fail(f"{name} must have shape {want}", list(tensor.shape),
                    "pass one entry per batch row (padded to the batch capacity)")
    if not tensor.is_contiguous():
        raise _fail(f"{name} must be contiguous", tuple(tensor.stride()),
                    f"pass {name}.contiguous()")


def _host_addresses(tables: CacheTables) -> torch.Tensor:
    """The `[L]` int64 device table of host base addresses the kernel writes through."""
    device = tables.device_kv.device
    num_layers = tables.device_kv.shape[0]
    given = tables.host_kv_addresses
    if given is not None:
        _check_vector("tables.host_kv_addresses", given, num_layers, device, torch.int64)
        return given
    addresses = _address_tables.get(tables)
    if addresses is None:
        if device.type != "cpu":
            for layer, host in enumerate(tables.host_kv):
                if host.device.type == "cpu" and not host.is_pinned():
                    raise _fail(f"host_kv[{layer}] must be registered (pinned) host memory for "
                                "the device to write it", "pageable memory",
                                "allocate the pool with backend.alloc_host() or register it")
        # Built once, outside any graph capture (the engine passes its own table instead).
        addresses = torch.tensor([host.data_ptr() for host in tables.host_kv],
                                 dtype=torch.int64, device=device)
        _address_tables[tables] = addresses
    return addresses


def backup_newest_triton(
    tables: CacheTables,
    newest_rows: torch.Tensor,  # [Bcap] int32 device row of each batch row's newest token
    host_rows: torch.Tensor,  # [Bcap] int32 host row the newest token belongs to
    num_real: torch.Tensor,  # [1] int32 device scalar: rows >= num_real are padding
) -> None:
    """Copy every layer's newest rows back to their host rows, without a host sync.

    Raises InvalidInputError, before the launch, for inputs it cannot use.
    """
    launch = _bind_backup(tables, newest_rows, host_rows, num_real, direct=False)
    if launch is not None:
        launch()


class BackupLauncher:
    """`backup_newest_triton` bound once: a call with the very tensors of the last one (the
    engine's persistent batch buffers, every step) replays its launch without checking them
    again; any other call checks and binds anew. Holds the last call's tensors (the engine
    builds one per cache)."""

    def __init__(self, direct: bool = True) -> None:
        self._direct = direct
        self._last: tuple[object, ...] = ()
        self._launch: BoundLaunch | None = None

    def __call__(self, tables: CacheTables, newest_rows: torch.Tensor,
                 host_rows: torch.Tensor, num_real: torch.Tensor) -> None:
        last = self._last
        if (last and last[0] is tables and last[1] is newest_rows and last[2] is host_rows
                and last[3] is num_real):
            if self._launch is not None:
                self._launch()
            return
        self._last, self._launch = (), None  # a bind that raises leaves nothing bound
        self._launch = _bind_backup(tables, newest_rows, host_rows, num_real, self._direct)
        self._last = (tables, newest_rows, host_rows, num_real)
        if self._launch is not None:
            self._launch()


def _bind_backup(tables: CacheTables, newest_rows: torch.Tensor, host_rows: torch.Tensor,
                 num_real: torch.Tensor, direct: bool) -> BoundLaunch | None:
    """The checked launch of one backup (None: nothing to copy, an empty batch or no layer)."""
    device_kv = tables.device_kv
    device = device_kv.device
    _check_vector("newest_rows", newest_rows, None, device)
    batch_cap = newest_rows.shape[0]
    _check_vector("host_rows", host_rows, batch_cap, device)
    _check_vector("num_real", num_real, 1, device)
    num_layers, num_device_rows, row_bytes = device_kv.shape
    if row_bytes % 4:
        raise _fail("the Triton backup moves rows as 4-byte words; row_bytes must be a multiple "
                    "of 4", row_bytes, "pad rows to a multiple of 4 bytes or use "
                    "backup_newest_reference")
    if not device_kv.is_contiguous():
        raise _fail("tables.device_kv must be contiguous", tuple(device_kv.stride()),
                    "allocate it as one [L, rows, W] tensor")
    if len(tables.host_kv) != num_layers:
        raise _fail(f"tables.host_kv must hold one tensor per layer ({num_layers})",
                    len(tables.host_kv), "pass the pool's per-layer tensors")
    num_host_rows = tables.host_kv[0].shape[0]
    for layer, host in enumerate(tables.host_kv):
        if (host.dtype != torch.uint8 or tuple(host.shape) != (num_host_rows, row_bytes)
                or not host.is_contiguous()):
            raise _fail(f"host_kv[{layer}] must be a contiguous uint8 [{num_host_rows}, "
                        f"{row_bytes}] tensor like layer 0",
                        f"{host.dtype} {list(host.shape)} stride {host.stride()}",
                        "allocate the pool through the backend")
    addresses = _host_addresses(tables)
    if batch_cap == 0 or num_layers == 0:
        return None
    row_words = row_bytes // 4
    return BoundLaunch(
        _backup_kernel, (batch_cap, num_layers),
        (num_real, newest_rows, host_rows, addresses, device_kv.view(torch.int32),
         num_device_rows, num_host_rows),
        {"ROW_WORDS": row_words, "BLOCK_WORDS": triton.next_power_of_2(row_words),
         "num_warps": 2 if row_words > 128 else 1}, device=device, direct=direct)
