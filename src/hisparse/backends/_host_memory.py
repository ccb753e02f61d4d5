"""Host-memory facts the allocators share: what is available, and runtime error hygiene."""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from hisparse.errors import HostAllocationError

# cudaErrorHostMemoryAlreadyRegistered; HIP uses the same number.
ERROR_ALREADY_REGISTERED = 712
ALREADY_REGISTERED_RETRIES = 3


class AlreadyRegistered(HostAllocationError):
    pass


def clear_runtime_error(api: str) -> None:
    """Reset the runtime's last-error slot after a failed registration.

    The runtime keeps the failure as its "last error", and torch's next launch check would
    raise it from an unrelated call; torch's cudart binding has no cudaGetLastError, so call
    the one in the runtime library this process already loaded (best effort).
    """
    library, function = ("libamdhip64", "hipGetLastError") if api.startswith("hip") else (
        "libcudart", "cudaGetLastError")
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if library in line}
        for path in sorted(paths):
            getattr(ctypes.CDLL(path), function)()
    except (OSError, AttributeError):
        pass


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, else free physical pages; None when neither exists."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def format_bytes(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes} B ({num_bytes / (1 << 30):.2f} GiB)"
    return f"{num_bytes} B ({num_bytes / (1 << 20):.2f} MiB)"


class LiveBuffers:
    """The buffers `alloc_host` handed out, so `free_host` accepts each exactly once."""

    def __init__(self, pool_name: str) -> None:
        self._pool_name = pool_name  # "host pool", "USM host pool": for messages
        self._buffers: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def add(self, buffer: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._buffers[buffer.data_ptr()] = buffer
        return buffer

    def remove(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if self._buffers.pop(buffer.data_ptr(), None) is None:
                raise HostAllocationError(
                    f"{self._pool_name}: no buffer from alloc_host starts at "
                    f"{buffer.data_ptr():#x}; pass the exact tensor alloc_host returned "
                    "(each is freed once)."
                )

    def __len__(self) -> int:
        return len(self._buffers)
