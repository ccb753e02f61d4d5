"""Backend registry: a dict of factories, resolved on first use (never at import)."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

import torch

from hisparse.backends.base import Backend
from hisparse.errors import BackendUnavailableError

BackendFactory = Callable[[], Backend]

# Built-in backends, imported only when first asked for. Detection tries them in this order:
# a ROCm build of torch also answers torch.cuda.is_available(), so ROCm goes before CUDA.
BUILTIN_BACKENDS: dict[str, str] = {
    "rocm": "hisparse.backends.rocm:RocmBackend",
    "cuda": "hisparse.backends.cuda:CudaBackend",
    "xpu": "hisparse.backends.xpu:XpuBackend",
    "cpu": "hisparse.backends.cpu:CpuBackend",
}
# Other spellings of a built-in; "cuda" on a ROCm build of torch is handled in _canonical_name.
ALIASES = {"hip": "rocm"}

_factories: dict[str, BackendFactory] = {}
_instances: dict[str, Backend] = {}
_default: Backend | None = None
_lock = threading.RLock()


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Admit an out-of-tree device type.

    Args:
        name: the registry key (lower case), e.g. "npu".
        factory: a callable with no arguments returning a `hisparse.backends.base.Backend`
            (the class itself works). It is called once, on first use.
        replace: allow replacing a backend registered under the same name.

    Raises:
        ValueError: `name` is empty or taken (and `replace` is False).

    Example:
        >>> hisparse.register_backend("npu", NpuBackend)
        >>> hisparse.get_backend("npu")
    """
    if not isinstance(name, str) or not name or name != name.lower():
        raise ValueError(f"backend name must be a non-empty lower-case str, got {name!r}")
    with _lock:
        _load_builtins()
        if name in _factories and not replace:
            raise ValueError(
                f"a backend named {name!r} is already registered; pass replace=True to override it"
            )
        _factories[name] = factory
        _instances.pop(name, None)
        _reset_default()


def registered_backends() -> list[str]:
    """Every registered name, built-ins first in detection order."""
    with _lock:
        _load_builtins()
        return list(_factories)


def available_backends() -> list[str]:
    """The registered backends that can run on this machine, in detection order."""
    return [name for name in registered_backends() if _instance(name).unavailable_reason() is None]


def get_backend(device: str | torch.device | Backend | None = None) -> Backend:
    """The backend for `device`, or the best one on this machine when `device` is None.

    Args:
        device: None (detect: ROCm, then CUDA, then XPU, then CPU), a registered name
            ("cuda", "rocm", "xpu", "cpu", or an out-of-tree one), a device string such as
            "cuda:1", a `torch.device`, or a Backend (returned as it is).

    Raises:
        BackendUnavailableError: the name is not registered, or that device is not usable here.

    Example:
        >>> hisparse.get_backend().name
        'cuda'
    """
    global _default
    if isinstance(device, Backend):
        return device
    if device is None:
        with _lock:
            if _default is None:
                _default = _detect()
            return _default
    name = _canonical_name(device)
    backend = _instance(name)
    reason = backend.unavailable_reason()
    if reason is not None:
        usable = ", ".join(available_backends())
        raise BackendUnavailableError(
            f"backend {name!r} is not usable here: {reason}. Usable here: {usable}; "
            "run `hisparse probe` for details."
        )
    return backend


def find_backend(device: str | torch.device | Backend) -> Backend:
    """The registered backend for `device`, whether or not it is usable here (for reports).

    Raises:
        BackendUnavailableError: no backend is registered under that name.
    """
    if isinstance(device, Backend):
        return device
    return _instance(_canonical_name(device))


def device_index(backend: Backend, device: str | torch.device | Backend | None) -> int | None:
    """The device index `device` names ("cuda:1" -> 1; None when it names none), checked
    against the devices `backend` sees. `get_backend` resolves names only, so callers that act
    on one device (the probe, the CLI) check here rather than run on device 0 instead.

    Raises:
        BackendUnavailableError: the index is not a number, or no such device is visible.
    """
    if device is None or isinstance(device, Backend):
        return None
    if isinstance(device, torch.device):
        index = device.index
    else:
        text = device.split(":", 1)[1].strip() if ":" in device else ""
        if not text:
            return None
        if not text.isdigit():
            raise BackendUnavailableError(
                f"device {device!r}: {text!r} is not a device index; write e.g. "
                f"'{backend.name}:0' or just '{backend.name}'"
            )
        index = int(text)
    count = backend.device_count()
    if index is None:
        return None
    if count is None:  # the CPU: one host, which torch calls cpu:0 at most
        if index != 0:
            raise BackendUnavailableError(
                f"device {str(device)!r}: the {backend.name} backend has one device and no "
                f"device index; write '{backend.name}'")
        return None
    if index >= count:
        raise BackendUnavailableError(
            f"device {str(device)!r}: the {backend.name} backend sees {count} device(s) "
            f"(indices 0 to {count - 1}); pick one of those or check the visible-devices "
            "variable (CUDA_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES, ZE_AFFINITY_MASK)"
        )
    return index


def _canonical_name(device: str | torch.device) -> str:
    if isinstance(device, torch.device):
        name = device.type
    elif isinstance(device, str):
        name = device.split(":", 1)[0].strip().lower()
    else:
        raise BackendUnavailableError(
            f"device must be None, a str, a torch.device or a Backend, got {type(device).__name__}"
        )
    name = ALIASES.get(name, name)
    if name == "cuda" and torch.version.hip is not None:
        name = "rocm"  # torch calls HIP devices "cuda"
    with _lock:
        _load_builtins()
        if name not in _factories:
            raise BackendUnavailableError(
                f"Unknown backend {name!r} (from {device!r}). Registered: "
                f"{', '.join(sorted(_factories))}. Register one with hisparse.register_backend()."
            )
    return name


def _detect() -> Backend:
    for name in registered_backends():
        backend = _instance(name)
        if backend.unavailable_reason() is None:
            return backend
    raise BackendUnavailableError(  # pragma: no cover - the CPU backend is always usable
        "no registered backend is usable here; run `hisparse probe` to see why."
    )


def _instance(name: str) -> Backend:
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            backend = _factories[name]()
            if not isinstance(backend, Backend):
                raise BackendUnavailableError(
                    f"the factory registered for {name!r} returned {type(backend).__name__}, "
                    "not a hisparse Backend; register a Backend subclass or a function "
                    "returning one."
                )
            _instances[name] = backend
        return backend


def _load_builtins() -> None:
    if _factories:
        return
    for name, target in BUILTIN_BACKENDS.items():
        _factories[name] = _lazy_class(target)


def _lazy_class(target: str) -> BackendFactory:
    module_name, class_name = target.split(":")

    def factory() -> Backend:
        return getattr(importlib.import_module(module_name), class_name)()

    return factory


def _reset_default() -> None:
    global _default
    _default = None


def _reset_for_tests() -> None:
    """Forget cached instances and the detected default (tests that fake the environment)."""
    with _lock:
        _instances.clear()
        _reset_default()
