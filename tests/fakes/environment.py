"""A fake torch device environment: CUDA, ROCm or XPU GPUs that are not there.

`fake_environment(monkeypatch, kind)` patches what the backends read (torch.version.cuda/hip,
torch.cuda.is_available, torch.xpu.is_available, device names, torch.cuda.cudart, the HIP
library, pinned allocation) and returns a `FakeEnvironment` recording what they did with it.
The memory is real host memory; only the runtime's bookkeeping is simulated, exactly enough
to catch a wrong base pointer, a wrong size, an overlap or a double unregister.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hisparse.backends import registry

CUDA_SUCCESS = 0
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_ALREADY_REGISTERED = 712
CUDA_ERROR_NOT_REGISTERED = 713
HIP_DEVICE_OFFSET = 0x7F00_0000_0000  # fake device addresses = host address + this


class FakeCudart:
    """cudaHostRegister / cudaHostUnregister with the runtime's rules on overlaps and bases."""

    def __init__(self) -> None:
        self.registered: dict[int, tuple[int, int]] = {}  # base -> (size, flags)
        self.register_calls = 0
        self.unregister_calls: list[int] = []
        self.fail_on_register_call: int | None = None  # 1-based call number that fails

    def cudaHostRegister(self, base: int, size: int, flags: int) -> int:
        self.register_calls += 1
        if self.register_calls == self.fail_on_register_call:
            return CUDA_ERROR_MEMORY_ALLOCATION
        for other, (other_size, _) in self.registered.items():
            if base < other + other_size and other < base + size:
                return CUDA_ERROR_ALREADY_REGISTERED
        self.registered[base] = (size, flags)
        return CUDA_SUCCESS

    def cudaHostUnregister(self, base: int) -> int:
        self.unregister_calls.append(base)
        if self.registered.pop(base, None) is None:
            return CUDA_ERROR_NOT_REGISTERED
        return CUDA_SUCCESS

    def cudaGetErrorString(self, status: int) -> str:
        return {CUDA_ERROR_MEMORY_ALLOCATION: "out of memory",
                CUDA_ERROR_ALREADY_REGISTERED: "already registered",
                CUDA_ERROR_NOT_REGISTERED: "not registered"}.get(status, "unknown")


class FakeHip:
    """hipHostGetDevicePointer over the fake cudart's registrations."""

    def __init__(self, cudart: FakeCudart) -> None:
        self.cudart = cudart
        self.calls: list[int] = []

    def hipHostGetDevicePointer(self, device_out: Any, host: ctypes.c_void_p, flags: Any) -> int:
        address = host.value or 0
        self.calls.append(address)
        inside = any(b <= address < b + s for b, (s, _) in self.cudart.registered.items())
        if not inside:
            return 1  # hipErrorInvalidValue
        device_out._obj.value = address + HIP_DEVICE_OFFSET
        return 0


class NullPointerTensor:
    """What a failed USM host allocation looks like: a tensor whose data pointer is 0."""

    def __init__(self, num_bytes: int) -> None:
        self.shape = (num_bytes,)

    def data_ptr(self) -> int:
        return 0


def fake_properties(name: str, warp_size: int | None) -> SimpleNamespace:
    """What `get_device_properties` reports of a fake device (XPU's have no warp size)."""
    if warp_size is None:
        return SimpleNamespace(name=name, gpu_subslice_count=20)
    return SimpleNamespace(name=name, multi_processor_count=132, warp_size=warp_size, major=9,
                           minor=0)


@dataclass
class FakeEnvironment:
    kind: str
    cudart: FakeCudart = field(default_factory=FakeCudart)
    hip: FakeHip | None = None
    pinned_allocations: list[int] = field(default_factory=list)
    usm_returns_null: bool = False


def fake_environment(
    monkeypatch: pytest.MonkeyPatch, kind: str, gpus: int = 1
) -> FakeEnvironment:
    """Make torch look like a machine with `gpus` devices of `kind` ("cuda", "rocm", "xpu")
    or none ("none"). Backend caches are reset so detection runs again."""
    if kind not in ("cuda", "rocm", "xpu", "none"):
        raise ValueError(f"unknown fake environment {kind!r}")
    env = FakeEnvironment(kind)
    cuda_like = kind in ("cuda", "rocm")
    monkeypatch.setattr(torch.version, "cuda", "12.8" if kind == "cuda" else None)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482" if kind == "rocm" else None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_like and gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus if cuda_like else 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: f"Fake {kind} GPU {i}")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: fake_properties(f"Fake {kind} GPU {i}", 64 if kind == "rocm"
                                                    else 32))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: env.cudart)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: kind == "xpu" and gpus > 0)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: gpus if kind == "xpu" else 0)
    monkeypatch.setattr(torch.xpu, "get_device_name", lambda i=0: f"Fake xpu GPU {i}")
    monkeypatch.setattr(torch.xpu, "get_device_properties",
                        lambda i=0: fake_properties(f"Fake xpu GPU {i}", None))

    env.hip = FakeHip(env.cudart)
    from hisparse.backends import cuda, rocm
    from hisparse.backends._host_register import HostRegistry

    # Registries of their own: the real ones may hold real registrations (on a GPU machine),
    # and releasing those through the fake runtime would leave them registered for real
    # while their memory is unmapped.
    monkeypatch.setattr(cuda.CudaBackend, "host_registry",
                        HostRegistry(lambda: env.cudart, "cudaHostRegister"))
    monkeypatch.setattr(rocm.RocmBackend, "host_registry",
                        HostRegistry(lambda: env.cudart, "hipHostRegister"))

    rocm.hip_library.cache_clear()
    monkeypatch.setattr(rocm, "hip_library", lambda: env.hip)

    real_empty = torch.empty

    def empty(*size: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        if not pin_memory:
            return real_empty(*size, **kwargs)
        num_bytes = int(torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int)
                                   else size).numel())
        env.pinned_allocations.append(num_bytes)
        if env.usm_returns_null:
            return NullPointerTensor(num_bytes)
        return real_empty(*size, **kwargs)  # host memory standing in for USM host memory

    monkeypatch.setattr(torch, "empty", empty)
    registry._reset_for_tests()
    return env


def release_fake_registrations() -> None:
    """Unregister whatever a test left registered, while the fake runtime is still patched in."""
    from hisparse.backends import cuda, rocm

    cuda.CudaBackend.host_registry.release_all()
    rocm.RocmBackend.host_registry.release_all()
