"""The host as its own device: plain memory, the torch reference swap-in, no streams.

Always available, so it is the fallback of detection and the backend CI tests everything on.
"""

from __future__ import annotations

import torch

from hisparse.backends._host_memory import LiveBuffers
from hisparse.backends._host_register import allocate_plain
from hisparse.backends.base import Backend
from hisparse.backends.features import Feature, FeatureTable, supported, unsupported

CPU_FEATURES = FeatureTable({
    Feature.PROGRAMMATIC_DEPENDENT_LAUNCH: unsupported(
        "the CPU runs the torch reference, which has no kernel launches to overlap",
        "nothing to do"),
    Feature.REGISTER_HOST_MEMORY: unsupported(
        "host memory is already the device's memory, so there is nothing to register",
        "pass the tensor as it is, or allocate it with backend.alloc_host()",
    ),
    Feature.ZERO_COPY_SWAP_IN: unsupported(
        "there is no fused zero-copy kernel for the host",
        "swap-in runs the torch reference (backend.kernels.swap_in), which copies with torch ops",
    ),
    Feature.GRAPH_CAPTURE: unsupported(
        "the CPU has no graphs to capture",
        "run the decode step eagerly",
    ),
    Feature.ASYNC_BACKUP: unsupported(
        "the CPU backend has no side streams",
        "newest-token backups run synchronously at end_decode_step",
    ),
    Feature.SHARED_INDEX_PREFETCH: supported("replayed synchronously, no side stream"),
    Feature.SKIP_IO_PROBE: supported(),
    Feature.SHARED_HOST_POOL: supported("a shared mapping of /dev/shm; nothing to register"),
})


class CpuBackend(Backend):
    name = "cpu"
    torch_device_type = "cpu"
    features = CPU_FEATURES

    def __init__(self) -> None:
        self._live = LiveBuffers("host pool")

    def unavailable_reason(self) -> str | None:
        return None

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")  # one host, whatever index was asked for

    def alloc_host(self, num_bytes: int) -> torch.Tensor:
        return self._live.add(allocate_plain(num_bytes, "host pool"))

    def free_host(self, buffer: torch.Tensor) -> None:
        self._live.remove(buffer)
