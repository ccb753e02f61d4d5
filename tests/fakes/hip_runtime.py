"""A fake HIP runtime in C (hip_runtime.c), loaded as libamdhip64.so, and torch's binding to it.

`build_fake_hip(directory)` compiles the fake (needs a C compiler) and loads it; the ROCm
backend then finds it by name, as it finds the real runtime, and calls it through ctypes:
a misspelt symbol, a Python int where a pointer goes, or a flag the runtime does not know
fails there as it would on an AMD machine. `HipCudart` is what `torch.cuda.cudart()` is on a
ROCm build (torch's cuda* bindings call the hip* functions).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("hip_runtime.c")
LIBRARY_NAME = "libamdhip64.so"  # what rocm.HIP_LIBRARY_NAMES looks for first

# hip_runtime_api.h
HIP_SUCCESS = 0
HIP_ERROR_INVALID_VALUE = 1
HIP_ERROR_OUT_OF_MEMORY = 2
HIP_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
HIP_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
HIP_HOST_REGISTER_PORTABLE = 0x1
HIP_HOST_REGISTER_MAPPED = 0x2
DEVICE_OFFSET = 0x7F0000000000  # the fake's device address = host address + this


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def build_fake_hip(directory: Path) -> FakeHipRuntime:
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc, clang) to build the fake HIP runtime")
    path = directory / LIBRARY_NAME
    subprocess.run([cc, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{LIBRARY_NAME}",
                    "-o", str(path), str(SOURCE)], check=True, capture_output=True)
    return FakeHipRuntime(ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL), path)


class FakeHipRuntime:
    """The loaded fake: its state, read through the helpers hip_runtime.c exports."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.library, self.path = library, path
        for name in ("fake_registration_base", "fake_registration_size"):
            getattr(library, name).restype = ctypes.c_size_t
        library.fake_registration_flags.restype = ctypes.c_uint
        library.hipHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        library.hipHostUnregister.argtypes = [ctypes.c_void_p]
        library.hipGetErrorString.restype = ctypes.c_char_p

    def counter(self, name: str) -> int:
        return ctypes.c_int.in_dll(self.library, f"fake_{name}").value

    def fail_next_register(self, error: int) -> None:
        ctypes.c_int.in_dll(self.library, "fake_fail_next_register").value = error

    def reset(self) -> None:
        self.library.fake_reset()

    def registered(self) -> dict[int, tuple[int, int]]:
        """base -> (bytes, flags) of every live registration."""
        lib = self.library
        return {lib.fake_registration_base(i): (lib.fake_registration_size(i),
                                                lib.fake_registration_flags(i))
                for i in range(self.counter("registrations"))}


class HipCudart:
    """`torch.cuda.cudart()` of a ROCm build: cudaHostRegister and friends call HIP."""

    def __init__(self, runtime: FakeHipRuntime) -> None:
        self._lib = runtime.library

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return self._lib.hipHostRegister(ptr, size, flags)

    def cudaHostUnregister(self, ptr: int) -> int:
        return self._lib.hipHostUnregister(ptr)

    def cudaGetErrorString(self, status: int) -> str:
        return self._lib.hipGetErrorString(status).decode()
