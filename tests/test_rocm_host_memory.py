"""The ROCm host-memory path against a fake HIP runtime built from C (tests/fakes/hip_runtime.c).

The backend finds the fake by its library name and calls it through ctypes as it would call
libamdhip64 on an AMD machine, and the fake keeps HIP's rules (its header's flag values and
error codes, exact bases for unregistering, device pointers only for memory registered as
mapped, a last-error slot). So a misspelt HIP symbol, a wrong registration flag, a host
address passed as a bare int, or an error path that forgets the runtime's last error fails
here. The registration calls go through torch's cudart binding, which on a ROCm build calls
hipHostRegister / hipHostUnregister; the fake stands behind that binding too.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

import hisparse
from fakes.hip_runtime import (
    DEVICE_OFFSET,
    HIP_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    HIP_ERROR_INVALID_VALUE,
    HIP_ERROR_OUT_OF_MEMORY,
    HIP_HOST_REGISTER_MAPPED,
    HIP_HOST_REGISTER_PORTABLE,
    LIBRARY_NAME,
    FakeHipRuntime,
    HipCudart,
    build_fake_hip,
    compiler,
)
from hisparse.backends import _host_register, rocm
from hisparse.errors import HostAllocationError

PAGE = _host_register.PAGE_BYTES
FIND_HIP = rocm.hip_library  # the real lookup (fake_env replaces it with a Python fake)


def _real_hip_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("libamdhip64" in line for line in maps)
    except OSError:
        return False


@pytest.fixture(scope="module")
def fake_hip(tmp_path_factory: pytest.TempPathFactory) -> FakeHipRuntime:
    if torch.version.hip is not None or _real_hip_loaded():
        pytest.skip("a real HIP runtime is loaded here; the fake must not shadow it")
    if compiler() is None:
        pytest.skip("no C compiler (cc, gcc, clang) to build the fake HIP runtime")
    return build_fake_hip(tmp_path_factory.mktemp("hip"))


@pytest.fixture
def hip(fake_env, monkeypatch, fake_hip: FakeHipRuntime) -> FakeHipRuntime:
    """A ROCm machine whose HIP runtime is the fake."""
    env = fake_env("rocm")
    env.cudart = HipCudart(fake_hip)  # the backend's registry asks for env.cudart
    FIND_HIP.cache_clear()
    monkeypatch.setattr(rocm, "hip_library", FIND_HIP)
    fake_hip.reset()
    yield fake_hip
    hisparse.get_backend().host_registry.release_all()
    FIND_HIP.cache_clear()


def test_the_backend_finds_the_runtime_by_name(hip: FakeHipRuntime) -> None:
    found = rocm.hip_library()
    assert os.path.basename(found._name) == LIBRARY_NAME
    assert ctypes.cast(found.hipGetLastError, ctypes.c_void_p).value == ctypes.cast(
        hip.library.hipGetLastError, ctypes.c_void_p).value


def test_pools_are_registered_portable_and_mapped_with_device_pointers(
        hip: FakeHipRuntime, monkeypatch) -> None:
    monkeypatch.setattr(_host_register, "CHUNK_BYTES", 2 * PAGE)
    backend = hisparse.get_backend()
    assert backend.name == "rocm"
    buffer = backend.alloc_host(5 * PAGE)
    start = buffer.data_ptr()
    flags = HIP_HOST_REGISTER_PORTABLE | HIP_HOST_REGISTER_MAPPED  # hip_runtime_api.h
    assert hip.registered() == {start: (2 * PAGE, flags), start + 2 * PAGE: (2 * PAGE, flags),
                                start + 4 * PAGE: (PAGE, flags)}
    view = buffer[3 * PAGE + 100:]
    assert backend.device_address(view) == view.data_ptr() + DEVICE_OFFSET
    assert backend.device_address(buffer) == start + DEVICE_OFFSET
    assert hip.counter("device_pointer_calls") == 2  # one per chunk asked, then cached
    backend.free_host(buffer)
    assert hip.registered() == {} and hip.counter("unregister_calls") == 3


def test_existing_memory_is_registered_in_place(hip: FakeHipRuntime) -> None:
    backend = hisparse.get_backend()
    tensor = torch.zeros(3000, dtype=torch.float32)
    backend.register_host(tensor)
    assert hip.registered() == {
        tensor.data_ptr(): (12000, HIP_HOST_REGISTER_PORTABLE | HIP_HOST_REGISTER_MAPPED)}
    assert backend.device_address(tensor[10:]) == tensor.data_ptr() + 40 + DEVICE_OFFSET
    backend.unregister_host(tensor)
    assert hip.registered() == {}


def test_a_failed_registration_names_hips_error_and_clears_its_last_error(
        hip: FakeHipRuntime) -> None:
    hip.fail_next_register(HIP_ERROR_OUT_OF_MEMORY)
    with pytest.raises(HostAllocationError) as caught:
        hisparse.get_backend().alloc_host(3 * PAGE)
    assert "hipHostRegister of" in str(caught.value)
    assert f"error {HIP_ERROR_OUT_OF_MEMORY} (hipErrorOutOfMemory)" in str(caught.value)
    # Left set, the runtime's last error would be raised by torch's next, unrelated launch.
    assert hip.counter("get_last_error_calls") == 1
    assert hip.library.hipGetLastError() == 0
    assert hip.registered() == {}


def test_memory_registered_behind_the_backend_is_refused_with_hips_code(
        hip: FakeHipRuntime) -> None:
    tensor = torch.zeros(PAGE, dtype=torch.uint8)
    assert hip.library.hipHostRegister(tensor.data_ptr(), PAGE, 0) == 0  # someone else's
    with pytest.raises(HostAllocationError, match="still registered") as caught:
        hisparse.get_backend().register_host(tensor)
    assert isinstance(caught.value, _host_register.AlreadyRegistered)
    assert hip.counter("get_last_error_calls") == 1
    assert hip.library.hipHostUnregister(tensor.data_ptr()) == 0
    assert HIP_ERROR_HOST_MEMORY_ALREADY_REGISTERED == _host_register.ERROR_ALREADY_REGISTERED


def test_a_refused_device_pointer_and_unregister_are_errors(hip: FakeHipRuntime) -> None:
    backend = hisparse.get_backend()
    buffer = backend.alloc_host(PAGE)
    assert hip.library.hipHostUnregister(buffer.data_ptr()) == 0  # gone behind our back
    with pytest.raises(HostAllocationError,
                       match=rf"hipHostGetDevicePointer\(0x[0-9a-f]+\) failed with hipError "
                             rf"{HIP_ERROR_INVALID_VALUE}"):
        backend.device_address(buffer)
    with pytest.raises(HostAllocationError, match="hipHostUnregister failed for 0x"):
        backend.free_host(buffer)
