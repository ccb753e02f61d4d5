"""AMD GPUs: the CUDA backend through torch's HIP build, plus device pointers for host memory.

torch's cudart binding calls hipHostRegister on ROCm builds, so allocation and registration
are shared with CUDA. What differs: registered host memory has a device address of its own
on HIP, which `device_address` looks up with hipHostGetDevicePointer for any kernel that
receives a raw address (tensor arguments are translated by Triton's AMD launcher itself).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from hisparse.backends._host_register import HostRegistry
from hisparse.backends.cuda import CUDA_FEATURES, CudaBackend
from hisparse.backends.features import Feature, FeatureTable, unsupported
from hisparse.errors import BackendUnavailableError, HostAllocationError

HIP_LIBRARY_NAMES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")

# The same feature table as CUDA, but AMD has no programmatic dependent launch.
ROCM_FEATURES = FeatureTable({
    **CUDA_FEATURES,
    Feature.PROGRAMMATIC_DEPENDENT_LAUNCH: unsupported(
        "AMD GPUs have no programmatic dependent launch (griddepcontrol is NVIDIA's)",
        "nothing to do: the swap-in kernels launch in stream order"),
})

_registry = HostRegistry(lambda: torch.cuda.cudart(), "hipHostRegister")


@functools.cache
def hip_library() -> ctypes.CDLL:
    """The libamdhip64 torch already loaded (found by name, then next to torch's own libs)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    candidates = [*HIP_LIBRARY_NAMES, *(str(torch_lib / name) for name in HIP_LIBRARY_NAMES)]
    for candidate in candidates:
        try:
            return ctypes.CDLL(candidate, mode=os.RTLD_NOLOAD | ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    raise BackendUnavailableError(
        f"could not find the HIP runtime (tried {', '.join(HIP_LIBRARY_NAMES)} and {torch_lib}); "
        "make sure torch's ROCm build is imported and ROCm's lib directory is on LD_LIBRARY_PATH."
    )


class RocmBackend(CudaBackend):
    name = "rocm"
    torch_device_type = "cuda"  # torch calls HIP devices "cuda"
    features = ROCM_FEATURES
    verified_on_hardware = False
    host_registry = _registry

    def unavailable_reason(self) -> str | None:
        if torch.version.hip is None:
            return f"torch {torch.__version__} was built without ROCm (torch.version.hip is None)"
        if not torch.cuda.is_available():
            return (
                "no ROCm GPU is visible (torch.cuda.is_available() is False); "
                "check the amdgpu driver and HIP_VISIBLE_DEVICES"
            )
        return None

    def runtime_versions(self) -> dict[str, str | None]:
        return {"hip_runtime": torch.version.hip}

    def device_address(self, buffer: torch.Tensor) -> int:
        address = int(buffer.data_ptr())
        found = self.host_registry.chunk_containing(address)
        if found is None:
            raise HostAllocationError(
                f"hipHostGetDevicePointer: host address {address:#x} is not in any buffer from "
                "alloc_host or register_host; allocate or register it through the backend first."
            )
        registration, chunk_base = found
        device_base = registration.device_pointers.get(chunk_base)
        if device_base is None:
            device_base = _device_pointer(chunk_base)
            registration.device_pointers[chunk_base] = device_base
        return device_base + (address - chunk_base)


def _device_pointer(host_address: int) -> int:
    device = ctypes.c_void_p()
    status = hip_library().hipHostGetDevicePointer(
        ctypes.byref(device), ctypes.c_void_p(host_address), ctypes.c_uint(0)
    )
    if status != 0 or device.value is None:
        raise HostAllocationError(
            f"hipHostGetDevicePointer({host_address:#x}) failed with hipError {status}; "
            "the memory must be registered with the mapped flag (alloc_host does this)."
        )
    return int(device.value)
