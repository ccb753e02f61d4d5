"""Grid dependency control (programmatic dependent launch) for the swap-in kernels.

Where triton has it (NVIDIA, triton >= 3.3) these are its `griddepcontrol` intrinsics; elsewhere
no-ops. The kernels call them only under their `USE_PDL` constexpr, which the launch plan sets
only where the backend's feature table says the device has PDL.
"""

from __future__ import annotations

import functools

import triton

try:  # grid dependency control (programmatic dependent launch): NVIDIA sm_90+, triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # the kernels only call these under USE_PDL, which is then never set
    HAVE_GDC = False

    @triton.jit
    def gdc_wait() -> None:
        pass

    @triton.jit
    def gdc_launch_dependents() -> None:
        pass



@functools.cache
def triton_launches_dependents() -> bool:
    """Whether this triton has the intrinsics and the `launch_pdl` launch option."""
    if not HAVE_GDC:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # a triton without its NVIDIA backend
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__
