"""NVIDIA GPUs: host pools registered with cudaHostRegister, Triton kernels, CUDA graphs."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

from hisparse.backends._accelerator import AcceleratorBackend
from hisparse.backends._host_register import HostRegistry
from hisparse.backends.base import DeviceInfo
from hisparse.backends.features import Feature, FeatureTable, supported

CUDA_FEATURES = FeatureTable({
    Feature.REGISTER_HOST_MEMORY: supported("cudaHostRegister, exact size, chunked"),
    Feature.ZERO_COPY_SWAP_IN: supported("Triton reads registered host rows directly"),
    Feature.GRAPH_CAPTURE: supported("torch.cuda.CUDAGraph"),
    Feature.ASYNC_BACKUP: supported("side stream"),
    Feature.SHARED_INDEX_PREFETCH: supported("replay on a side stream"),
    Feature.SKIP_IO_PROBE: supported(),
    Feature.PROGRAMMATIC_DEPENDENT_LAUNCH: supported(
        "griddepcontrol between the swap-in kernels, on sm_90 and newer with triton >= 3.3"),
    Feature.SHARED_HOST_POOL: supported("cudaHostRegister of a shared /dev/shm mapping"),
})

# One registry per process for everything registered through torch's cudart binding.
_registry = HostRegistry(lambda: torch.cuda.cudart(), "cudaHostRegister")


class CudaBackend(AcceleratorBackend):
    name = "cuda"
    torch_device_type = "cuda"
    features = CUDA_FEATURES
    host_registry = _registry

    @property
    def direct_kernel_launch(self) -> bool:  # type: ignore[override]
        # On since the H200 ran the GPU suite and compute-sanitizer through it (benchmarks/
        # NOTES.md, seventeenth pass); HISPARSE_DIRECT_LAUNCH=0 keeps triton's dispatch.
        return os.environ.get("HISPARSE_DIRECT_LAUNCH", "1") != "0"

    def unavailable_reason(self) -> str | None:
        if torch.version.hip is not None:
            return (
                f"this torch is a ROCm build (torch.version.hip={torch.version.hip}); "
                "use the rocm backend"
            )
        if torch.version.cuda is None:
            return f"torch {torch.__version__} was built without CUDA"
        if not torch.cuda.is_available():
            return (
                "no CUDA GPU is visible (torch.cuda.is_available() is False); "
                "check the driver and CUDA_VISIBLE_DEVICES"
            )
        return None

    def describe(self, index: int | None = None) -> DeviceInfo:
        from hisparse.kernels.swap_in.pdl import triton_launches_dependents

        info = super().describe(index)
        pdl = (self.features.supports(Feature.PROGRAMMATIC_DEPENDENT_LAUNCH)
               and torch.cuda.get_device_capability(index) >= (9, 0)
               and triton_launches_dependents())
        return dataclasses.replace(info, pdl=pdl)

    def runtime_versions(self) -> dict[str, str | None]:
        return {"cuda_runtime": torch.version.cuda, "cuda_driver": _cuda_driver_version()}

    # --- host memory ---------------------------------------------------------------------
    def alloc_host(self, num_bytes: int) -> torch.Tensor:
        return self.host_registry.allocate(num_bytes)

    def free_host(self, buffer: torch.Tensor) -> None:
        self.host_registry.free(buffer)

    # --- graphs --------------------------------------------------------------------------
    def graph_capture(self, stream: Any | None = None) -> contextlib.AbstractContextManager[Any]:
        self.require(Feature.GRAPH_CAPTURE)
        return _capture(stream)


@contextlib.contextmanager
def _capture(stream: Any | None) -> Iterator[Any]:
    """A new CUDA graph holding the block's launches (on `stream`, else a side stream)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        yield graph


def _cuda_driver_version() -> str | None:
    """The installed driver's CUDA version, e.g. "12.8" (None where libcuda cannot be read)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"
