"""`device_bytes(cache)`: the device memory a `HiSparseCache` holds, in bytes.

Counted: every tensor on the cache's device reachable from its tables (hot rows, page table,
LRU and residency maps, counters), its decode and verify buffers, miss plans and kernel
scratch, each storage once. Not counted: the host pool (host memory, even on a CPU backend
where the "device" is host memory too), and torch's allocator caching around them.
"""

from __future__ import annotations

from typing import Any

import torch

# How deep to follow attributes from the cache's device state (tables -> buffers -> plans).
_DEPTH = 5


def device_bytes(cache: Any) -> int:
    """Bytes of the device storages `cache` holds (see the module's docstring).

    Raises:
        RequestStateError: the cache is closed (its device memory is freed already).
    """
    roots = [cache.tables, cache._decode.buffers, cache._decode.replays,
             cache._decode.kernels, cache._verify]
    host = {layer.untyped_storage().data_ptr() for layer in cache.host_tensors()}
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    for root in roots:
        _collect(root, cache.device, host, seen_objects, storages, _DEPTH)
    return sum(storages.values())


def _collect(value: Any, device: torch.device, host: set[int], seen: set[int],
             storages: dict[int, int], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        pointer = storage.data_ptr()
        if value.device == device and pointer not in host and pointer != 0:
            storages[pointer] = storage.nbytes()
        return
    if depth == 0 or id(value) in seen or isinstance(value, (str, bytes, int, float, type)):
        return
    seen.add(id(value))
    if isinstance(value, dict):
        children = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        children = list(value)
    else:
        attributes = getattr(value, "__dict__", None)
        if attributes is None:
            slots = getattr(type(value), "__slots__", ())
            attributes = {name: getattr(value, name, None) for name in slots}
        # The host pool and the backend hold host memory and streams, not device state.
        children = [v for name, v in attributes.items() if name not in ("pool", "_pool",
                                                                         "backend", "_backend")]
    for child in children:
        _collect(child, device, host, seen, storages, depth - 1)
