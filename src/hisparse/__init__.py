"""hisparse: a hierarchical sparse KV cache for sparse-MLA decode.

Full KV lives in host memory; each request keeps a small LRU hot buffer on the device, and a
fused kernel copies the missing top-k rows straight from host memory at every decode step.

Importing this package is cheap and touches no device: the backend is detected on the first
`get_backend()` call, and every name below is loaded when first used.

    >>> import hisparse
    >>> backend = hisparse.get_backend()                 # ROCm, CUDA, XPU, else CPU
    >>> config = hisparse.HiSparseConfig.from_preset("tiny")
    >>> cache = hisparse.HiSparseCache(config, device=backend)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hisparse.errors import (
    BackendUnavailableError,
    ConfigError,
    FeatureDisabledWarning,
    HisparseError,
    HostAllocationError,
    InvalidInputError,
    MissingDependencyError,
    PoolExhaustedError,
    RequestStateError,
    SharedPoolError,
    TransferError,
    UnknownRequestError,
    UnsupportedFeatureError,
)

__version__ = "0.1.0"

# Public name -> module that defines it; resolved by __getattr__ on first access.
_LAZY: dict[str, str] = {
    "get_backend": "hisparse.backends.registry",
    "register_backend": "hisparse.backends.registry",
    "available_backends": "hisparse.backends.registry",
    "Backend": "hisparse.backends.base",
    "Feature": "hisparse.backends.features",
    "HiSparseConfig": "hisparse.config",
    "resolve_features": "hisparse.config",
    "HiSparseCache": "hisparse.core.engine",
    "SharedPoolSpec": "hisparse.core.shared_pool",
    "probe": "hisparse.tools.probe",
    "pad_top_k": "hisparse.attention",
    "gather_rows": "hisparse.attention",
    "device_bytes": "hisparse.footprint",
}

__all__ = [
    "BackendUnavailableError",
    "ConfigError",
    "FeatureDisabledWarning",
    "HisparseError",
    "HostAllocationError",
    "InvalidInputError",
    "MissingDependencyError",
    "PoolExhaustedError",
    "RequestStateError",
    "SharedPoolError",
    "TransferError",
    "UnknownRequestError",
    "UnsupportedFeatureError",
    "__version__",
    *_LAZY,
]

if TYPE_CHECKING:  # the names __getattr__ provides, for type checkers and IDEs
    from hisparse.attention import gather_rows as gather_rows
    from hisparse.attention import pad_top_k as pad_top_k
    from hisparse.backends.base import Backend as Backend
    from hisparse.backends.features import Feature as Feature
    from hisparse.backends.registry import available_backends as available_backends
    from hisparse.backends.registry import get_backend as get_backend
    from hisparse.backends.registry import register_backend as register_backend
    from hisparse.config import HiSparseConfig as HiSparseConfig
    from hisparse.config import resolve_features as resolve_features
    from hisparse.core.engine import HiSparseCache as HiSparseCache
    from hisparse.core.shared_pool import SharedPoolSpec as SharedPoolSpec
    from hisparse.footprint import device_bytes as device_bytes
    from hisparse.tools.probe import probe as probe


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'hisparse' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
