"""Kernel launches with their arguments bound once, replayed at the driver's own cost.

`kernel[grid](*args)` costs 15-35 us of host time per call on an H200 (triton 3.6): binding the
arguments, computing the specialization key, looking the compiled kernel up. A decode step makes
three such launches per layer, 61 layers a step, eagerly wherever a framework does not capture
graphs. A `BoundLaunch` pays that once: its first call goes through triton as usual and keeps
the compiled kernel; later calls hand the same arguments, as addresses and integers, straight
to the compiled kernel's launcher (about 5 us). Measured: benchmarks/NOTES.md, "Host path".

The direct call is triton's own launch sequence (`JITFunction.run` in triton 3.3 and newer) with
the specialization fixed by the first call. It is used only where that holds: triton >= 3.3,
no launch hooks (a profiler's) installed, a compiled kernel (not the interpreter), and a backend
whose traits allow it (`DeviceTraits.direct_launch`). Elsewhere every call goes through triton.

One level further down, where the compiled kernel's launcher is the one whose C function this
module knows how to call (`_c_launch`: triton's per-kernel CUDA launcher whose Python
`__call__` only allocates scratch, for a kernel that needs none), the call goes to that C
function itself, skipping the Python frame and its two scratch allocations (about 1.5 us a
launch on the H200's host; benchmarks/NOTES.md, "Host path").
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import triton

# (major, minor) from which JITFunction.run passes every bound argument, constexprs included,
# to CompiledKernel.run after (grid, stream, function, packed metadata, launch metadata, hooks).
_DIRECT_FROM = (3, 3)


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _knobs() -> Any | None:
    try:
        from triton import knobs
    except ImportError:  # triton < 3.4 keeps the hooks on CompiledKernel
        return None
    return knobs.runtime


DIRECT_LAUNCH_AVAILABLE = _triton_version() >= _DIRECT_FROM
_RUNTIME_KNOBS = _knobs()
# Triton 3.5+ keeps a `HookChain` (its `calls` list) in the knobs; older ones None.
_EMPTY_CHAIN_TYPE = (type(_RUNTIME_KNOBS.launch_enter_hook)
                     if _RUNTIME_KNOBS is not None
                     and hasattr(_RUNTIME_KNOBS.launch_enter_hook, "calls") else None)


def _hook_set(hook: Any) -> bool:
    """Whether a launch hook does anything: triton 3.5+ keeps an empty `HookChain` there by
    default (its `calls` list), older ones None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _hooks_installed() -> bool:
    """Read on every launch (a profiler may install a hook at any time); the usual answer,
    two empty chains, costs two attribute reads."""
    if _RUNTIME_KNOBS is None:
        from triton.compiler.compiler import CompiledKernel

        return _hook_set(getattr(CompiledKernel, "launch_enter_hook", None))
    enter, leave = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    if (type(enter) is _EMPTY_CHAIN_TYPE and type(leave) is _EMPTY_CHAIN_TYPE
            and not enter.calls and not leave.calls):
        return False
    return _hook_set(enter) or _hook_set(leave)


def _current_stream(device_index: int) -> int:
    return triton.runtime.driver.active.get_current_stream(device_index)


# The launcher `__call__` whose C call `_c_launch` repeats (triton 3.6's CUDA launcher; another
# version's is recognized by its source, not its number), whitespace removed: it passes its
# arguments through unchanged and adds only the scratch it allocates.
_KNOWN_LAUNCH_CALL = ("self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,"
                      "self.launch_pdl,global_scratch,profile_scratch,*args)")
_KNOWN_PARAMETERS = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
_launcher_layouts: dict[type, bool] = {}


def _known_layout(launcher_type: type) -> bool:
    """Whether `launcher_type.__call__` is the known one (read once per launcher class)."""
    known = _launcher_layouts.get(launcher_type)
    if known is None:
        try:
            call = launcher_type.__call__
            source = "".join(inspect.getsource(call).split())
            known = (list(inspect.signature(call).parameters) == _KNOWN_PARAMETERS
                     and _KNOWN_LAUNCH_CALL in source)
        except (AttributeError, OSError, TypeError, ValueError):
            known = False
        _launcher_layouts[launcher_type] = known
    return known


def _c_launch(compiled: Any) -> tuple[Callable[..., None], tuple[Any, ...]] | None:
    """The C launch function of `compiled`'s launcher and the arguments that follow the stream
    in its call (function, cooperative and PDL flags, no scratch, metadata, no hooks), or None
    where the launcher is not the known one or the kernel needs scratch memory."""
    launcher = getattr(compiled, "run", None)
    launch = getattr(launcher, "launch", None)
    if launch is None or not _known_layout(type(launcher)):
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    return launch, (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                    None, None, compiled.packed_metadata, None, None, None)


class BoundLaunch:
    """One launch of `kernel` over `grid` with `args` (tensors and ints, positional) and
    `constants` (the constexpr and launch options, by name) fixed.

    `addresses` gives, by position in `args`, the address the kernel must receive for a tensor
    whose data pointer is not it (host memory on ROCm: backend.device_address); triton's own
    path translates those tensors itself. `direct=False` keeps every call on triton's path.
    """

    __slots__ = ("_args", "_c_call", "_compiled", "_constants", "_device_index", "_direct",
                 "_flat", "_grid", "_kernel", "_pointer_slots")

    def __init__(self, kernel: Any, grid: Sequence[int], args: Sequence[Any],
                 constants: Mapping[str, Any], *, device: torch.device,
                 addresses: Mapping[int, int] | None = None, direct: bool = True) -> None:
        self._kernel = kernel
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._args = list(args)  # lists: `rebind` replaces one entry in place
        self._constants = dict(constants)
        self._device_index = device.index if device.index is not None else 0
        self._direct = direct and DIRECT_LAUNCH_AVAILABLE
        self._compiled: Any | None = None
        self._c_call: tuple[Callable[..., None], tuple[Any, ...]] | None = None
        names = list(kernel.arg_names)
        missing = [n for n in names[len(self._args):] if n not in self._constants]
        if missing:
            raise TypeError(f"{kernel.__name__}: no value bound for {missing}")
        values = [*self._args, *(self._constants[n] for n in names[len(self._args):])]
        addresses = addresses or {}
        self._flat = [addresses.get(i, v.data_ptr()) if isinstance(v, torch.Tensor) else v
                      for i, v in enumerate(values)]
        self._pointer_slots = {i for i, v in enumerate(values) if isinstance(v, torch.Tensor)}

    @property
    def kernel(self) -> Any:
        return self._kernel

    @property
    def direct(self) -> bool:
        """Whether calls after the first skip triton's dispatch."""
        return self._compiled is not None

    def __call__(self, stream: int | None = None) -> None:
        """Launch; `stream`: the current stream's handle when the caller has it already (a
        call of several launches reads it once)."""
        compiled = self._compiled
        if compiled is None or _hooks_installed():
            self._launch_through_triton()
            return
        c_call = self._c_call
        if c_call is not None:
            c_call[0](*self._grid, _current_stream(self._device_index) if stream is None
                      else stream, *c_call[1], *self._flat)
            return
        compiled.run(*self._grid,
                     _current_stream(self._device_index) if stream is None else stream,
                     compiled.function, compiled.packed_metadata, None, None, None, *self._flat)

    def current_stream(self) -> int:
        """The handle of the stream a launch now goes to (triton's view of the current one)."""
        return _current_stream(self._device_index)

    def address(self, index: int) -> int:
        """The address (or value) positional argument `index` is launched with."""
        return self._flat[index]

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        """Replace positional argument `index` by `tensor` (same dtype), in place: per call
        when a caller's top-k tensor moves, so two list stores and nothing else. The
        compiled kernel stays where the address's 16-byte alignment, the only property of a
        pointer triton specializes on, is unchanged."""
        address = tensor.data_ptr()
        if (self._flat[index] % 16 == 0) != (address % 16 == 0):
            self._compiled = self._c_call = None
        self._args[index] = tensor
        self._flat[index] = address

    def _launch_through_triton(self) -> None:
        kernel = self._kernel[self._grid](*self._args, **self._constants)
        if (self._direct and self._compiled is None and kernel is not None
                and hasattr(kernel, "packed_metadata") and hasattr(kernel, "function")):
            self._compiled = kernel
            self._c_call = _c_launch(kernel)
