"""Triton's interpreter with bounds checks: the CPU's stand-in for compute-sanitizer's memcheck.

Inside `bounds_checked()`, every active lane of an interpreted kernel's load, store or atomic
must address bytes inside one tensor argument of that launch (the view's own bytes), or a tensor
handed to `allow` (host rows that kernels receive as raw addresses). A lane outside them
raises `OutOfBounds` naming the kernel, the operation, the address and the nearest range, at
the access, where a GPU reports "an illegal memory access" at some later sync, or nothing at
all when the address happens to be mapped.

It patches the interpreter's builder and grid executor (triton 3.x names); on a Triton whose
interpreter lacks them, `unsupported_reason()` says so and the tests skip.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_PATCHED = ("create_masked_load", "create_masked_store", "create_atomic_rmw",
            "create_atomic_cas")


class OutOfBounds(AssertionError):
    """A kernel addressed bytes outside every tensor it was given."""


def unsupported_reason() -> str | None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return "triton is not installed (pip install 'hisparse[triton]')"
    missing = [name for name in _PATCHED if not hasattr(interpreter.InterpreterBuilder, name)]
    if not hasattr(interpreter.GridExecutor, "_init_args_hst"):
        missing.append("GridExecutor._init_args_hst")
    if missing:
        return f"this triton's interpreter lacks {', '.join(missing)}: no bounds checks"
    return None


class _Ranges:
    """The byte ranges the running launch may touch."""

    def __init__(self, numpy_dtype: Any) -> None:
        self.numpy_dtype = numpy_dtype  # the interpreter's element type -> numpy dtype
        self.kernel = ""
        self.arguments: list[tuple[int, int, str]] = []
        self.allowed: list[tuple[int, int, str]] = []
        self.checks = 0

    def check(self, pointers: Any, mask: Any, element_type: Any, operation: str) -> None:
        self.checks += 1
        lanes = np.asarray(pointers.data)
        addresses = lanes.astype(np.uint64).ravel()
        if mask is not None:
            addresses = addresses[np.broadcast_to(np.asarray(mask.data).astype(bool),
                                                  lanes.shape).ravel()]
        if addresses.size == 0:
            return
        size = np.uint64(np.dtype(self.numpy_dtype(element_type)).itemsize)
        inside = np.zeros(addresses.shape, dtype=bool)
        ranges = self.arguments + self.allowed
        for low, high, _ in ranges:
            inside |= (addresses >= np.uint64(low)) & (addresses + size <= np.uint64(high))
        if not inside.all():
            bad = int(addresses[~inside][0])
            low, high, name = min(ranges, key=lambda r: min(abs(bad - r[0]), abs(bad - r[1])))
            raise OutOfBounds(
                f"{self.kernel}: a {operation} of {int((~inside).sum())} lane(s) outside every "
                f"tensor it was given, e.g. address {bad:#x}, {bad - low:+d} bytes from the "
                f"start of `{name}` [{low:#x}, {high:#x})")


_active: _Ranges | None = None


def _range_of(tensor: torch.Tensor, name: str) -> tuple[int, int, str]:
    """The bytes of the view itself, not of its whole storage: a kernel handed one layer's
    rows must not reach the next layer's."""
    elements = 0 if tensor.numel() == 0 else 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(),
                                                         strict=True))
    return tensor.data_ptr(), tensor.data_ptr() + elements * tensor.element_size(), name


def allow(tensor: torch.Tensor, name: str) -> None:
    """Let kernels touch `tensor` although no launch passes it as a tensor."""
    if _active is None:
        raise RuntimeError("allow() is for use inside bounds_checked()")
    _active.allowed.append(_range_of(tensor, name))


def allow_host_pool(cache: Any) -> None:
    """Let kernels touch `cache`'s host rows, which the backup and the folded writer reach by
    raw address."""
    for layer, rows in enumerate(cache._decode.tables.host_kv):
        allow(rows, f"host_kv[{layer}]")


@contextlib.contextmanager
def bounds_checked() -> Iterator[_Ranges]:
    """Bounds checks on every interpreted launch inside the block (not thread-safe)."""
    global _active
    from triton.runtime import interpreter

    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    originals = {name: getattr(builder, name) for name in _PATCHED}
    init_args = executor._init_args_hst
    ranges = _Ranges(interpreter._get_np_dtype)

    def init(self: Any, args_dev: Any, kwargs: Any) -> Any:
        args, kwargs_host = init_args(self, args_dev, kwargs)
        names = list(inspect.signature(self.fn).parameters)
        ranges.kernel = getattr(self.fn, "__name__", "?")
        ranges.arguments = [_range_of(value, names[i] if i < len(names) else f"arg{i}")
                            for i, value in enumerate([*args, *kwargs_host.values()])
                            if isinstance(value, torch.Tensor)]
        return args, kwargs_host

    def load(self: Any, ptrs: Any, mask: Any, *rest: Any) -> Any:
        ranges.check(ptrs, mask, ptrs.get_element_ty(), "load")
        return originals["create_masked_load"](self, ptrs, mask, *rest)

    def store(self: Any, ptrs: Any, value: Any, mask: Any, *rest: Any) -> Any:
        ranges.check(ptrs, mask, ptrs.get_element_ty(), "store")
        return originals["create_masked_store"](self, ptrs, value, mask, *rest)

    def rmw(self: Any, op: Any, ptr: Any, value: Any, mask: Any, *rest: Any) -> Any:
        ranges.check(ptr, mask, ptr.get_element_ty(), "atomic")
        return originals["create_atomic_rmw"](self, op, ptr, value, mask, *rest)

    def cas(self: Any, ptr: Any, *rest: Any) -> Any:
        ranges.check(ptr, None, ptr.get_element_ty(), "atomic compare-and-swap")
        return originals["create_atomic_cas"](self, ptr, *rest)

    patches = {"create_masked_load": load, "create_masked_store": store,
               "create_atomic_rmw": rmw, "create_atomic_cas": cas}
    _active = ranges
    executor._init_args_hst = init
    for name, patch in patches.items():
        setattr(builder, name, patch)
    try:
        yield ranges
    finally:
        for name, original in originals.items():
            setattr(builder, name, original)
        executor._init_args_hst = init_args
        _active = None
