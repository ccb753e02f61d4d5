"""The fused zero-copy swap-in in Triton, beside its torch reference (docs/ARCHITECTURE.md).

One call is three launches over grids fixed by the batch rows and K, so a CUDA graph can
capture them and replay with another `num_real`:

1. `lookup.classify_kernel`: resolve every top-k entry (hit, miss, short regime, newest,
   invalid), stamp hits with the LRU clock, count misses per row;
2. `select.select_kernel`: per batch row, take the least recently used slots for the misses,
   install them and write the miss plan;
3. `copy.copy_kernel` / `copy.copy_prefetched_kernel`: copy the missing rows out of registered
   host memory (a 656 B row is 41 aligned 16-byte vectors).

`plan.plan_launch` makes every path choice for a shape once (`LaunchPlan`); `launch` binds
tables and buffers to the kernels (`SwapInLauncher` for an engine, `swap_in_triton` for a
standalone call); `reference` is the same contract in plain torch.

Importing the package needs no triton (the CPU backend runs `reference` without it): the
Triton names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "hisparse.kernels.swap_in.launch": (
        "Scratch", "SwapInLauncher", "copy_planned_triton", "default_traits", "scratch_for",
        "swap_in_triton"),
    "hisparse.kernels.swap_in.plan": (
        "CopyPlan", "DeviceTraits", "LaunchPlan", "Tuning", "current_tuning", "plan_launch",
        "replay_plan", "tuning"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
