"""Intel GPUs through stock `torch.xpu` (no IPEX): USM host pools, Triton kernels.

Not yet run on hardware: graph capture and the shared-index replay stay off until they are.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from hisparse.backends._accelerator import AcceleratorBackend
from hisparse.backends._host_memory import LiveBuffers
from hisparse.backends._host_register import check_host_request, format_bytes
from hisparse.backends.features import Feature, FeatureTable, disabled, supported, unsupported
from hisparse.errors import HostAllocationError

logger = logging.getLogger("hisparse.backends")

XPU_FEATURES = FeatureTable({
    Feature.PROGRAMMATIC_DEPENDENT_LAUNCH: unsupported(
        "Intel GPUs have no programmatic dependent launch",
        "nothing to do: the swap-in kernels launch in stream order"),
    Feature.REGISTER_HOST_MEMORY: unsupported(
        "torch XPU cannot pin existing memory in place (no register_host_memory in torch yet)",
        "allocate the buffer with backend.alloc_host(), which returns USM host memory",
    ),
    Feature.ZERO_COPY_SWAP_IN: supported("USM host memory is device-readable; unverified"),
    Feature.GRAPH_CAPTURE: disabled(
        "XPU graph capture of swap-in has not been verified on hardware",
        "run the decode step eagerly (backend.graph_capture raises here)",
    ),
    Feature.ASYNC_BACKUP: supported("side stream"),
    Feature.SHARED_INDEX_PREFETCH: disabled(
        "the miss-plan replay kernel has not been verified on XPU",
        "follower layers load their misses themselves; set shared_index_prefetch: false",
    ),
    Feature.SKIP_IO_PROBE: unsupported(
        "the skip-IO timing probe has not been ported to XPU",
        "time swap-in with the copy included, or run the probe on a CUDA or CPU backend",
    ),
    Feature.SHARED_HOST_POOL: unsupported(
        "torch XPU cannot make an existing shared mapping device-readable (pin_memory "
        "allocates memory of its own)",
        "each rank keeps a private host pool (shared_pool is ignored with a warning)",
    ),
})

# Torch XPU pinned buffers have been reported to crash on access above about 16 GiB.
LARGE_PINNED_BYTES = 16 << 30


class XpuBackend(AcceleratorBackend):
    name = "xpu"
    torch_device_type = "xpu"
    features = XPU_FEATURES
    verified_on_hardware = False

    def __init__(self) -> None:
        self._live = LiveBuffers("USM host pool")

    def unavailable_reason(self) -> str | None:
        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return f"torch {torch.__version__} has no torch.xpu module"
        if not xpu.is_available():
            return (
                "no Intel GPU is visible (torch.xpu.is_available() is False); "
                "check the driver, the torch XPU build and ZE_AFFINITY_MASK"
            )
        return None

    def runtime_versions(self) -> dict[str, str | None]:
        driver = None
        with contextlib.suppress(AttributeError, RuntimeError, AssertionError):
            driver = str(torch.xpu.get_device_properties(0).driver_version)
        return {"xpu_runtime": getattr(torch.version, "xpu", None), "xpu_driver": driver}

    def alloc_host(self, num_bytes: int) -> torch.Tensor:
        available = check_host_request(num_bytes, "USM host pool")
        if num_bytes > LARGE_PINNED_BYTES:
            logger.warning(
                "USM host buffer of %s: torch XPU pinned buffers above 16 GiB have been "
                "reported to crash on access; split the pool if you see that.",
                format_bytes(num_bytes),
            )
        try:
            buffer = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            raise HostAllocationError(
                f"USM host pool: pinned allocation of {format_bytes(num_bytes)} failed ({exc})."
            ) from exc
        # A failed USM host allocation comes back as a null pointer instead of an exception.
        if buffer.data_ptr() == 0:
            raise HostAllocationError(
                f"USM host pool: sycl::malloc_host returned a null pointer for "
                f"{format_bytes(num_bytes)} (available host memory: "
                f"{format_bytes(available) if available is not None else 'unknown'}); "
                "the device caps single host allocations at max_mem_alloc_size, so lower "
                "host_pool_tokens."
            )
        return self._live.add(buffer)

    def free_host(self, buffer: torch.Tensor) -> None:
        self._live.remove(buffer)
        # The caching host allocator takes the block back once the last reference is gone.
