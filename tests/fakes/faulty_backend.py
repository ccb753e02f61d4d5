"""The CPU backend with faults injected on chosen calls, for the engine's failure paths.

`FaultyBackend(fail={"alloc_host": 3})` raises on the third `alloc_host` call, as a host that
ran out of memory would; `"register_host"` fails the registration step that follows a
successful allocation on CUDA and ROCm (the backend frees what it got before raising, as the
real ones do); `"new_event"` and `"kernels"` fail construction after the pool exists.
Every live host buffer is tracked, so a test can assert that nothing leaked:
`backend.live_buffers == 0`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from hisparse.backends.base import KernelSet
from hisparse.backends.cpu import CpuBackend
from hisparse.errors import HostAllocationError

# The hooks a test can make fail, and what their real counterparts raise.
FAILURES: dict[str, type[Exception]] = {
    "alloc_host": HostAllocationError,
    "register_host": HostAllocationError,
    "new_event": RuntimeError,  # torch raises RuntimeError when the driver refuses an event
    "kernels": RuntimeError,  # e.g. a Triton compile error at bind time
}


class InjectedFault(Exception):
    """Marks an exception as injected, so a test never mistakes a real bug for its fault."""


class FaultyBackend(CpuBackend):
    """CpuBackend whose hooks fail on the n-th call (1-based) given in `fail`."""

    name = "cpu-faulty"

    def __init__(self, fail: Mapping[str, int] | None = None) -> None:
        super().__init__()
        unknown = set(fail or {}) - set(FAILURES)
        if unknown:
            raise ValueError(f"no fault hook {sorted(unknown)}; known: {sorted(FAILURES)}")
        self.fail_on = dict(fail or {})
        self.calls: Counter[str] = Counter()
        self.allocated_bytes: list[int] = []  # size of every buffer handed out, in order
        self.freed = 0

    @property
    def live_buffers(self) -> int:
        return len(self.allocated_bytes) - self.freed

    def _count(self, hook: str) -> None:
        """Count a call of `hook` and raise the injected failure when it is the chosen one."""
        self.calls[hook] += 1
        if self.calls[hook] == self.fail_on.get(hook):
            error = FAILURES[hook]
            raise type(f"Injected{error.__name__}", (error, InjectedFault), {})(
                f"injected failure of {hook} call {self.calls[hook]}"
            )

    def alloc_host(self, num_bytes: int) -> torch.Tensor:
        self._count("alloc_host")
        buffer = super().alloc_host(num_bytes)
        try:
            self._count("register_host")
        except HostAllocationError:
            super().free_host(buffer)  # a backend whose registration fails keeps nothing
            raise
        self.allocated_bytes.append(num_bytes)
        return buffer

    def free_host(self, buffer: torch.Tensor) -> None:
        super().free_host(buffer)
        self.freed += 1

    def new_event(self) -> Any | None:
        self._count("new_event")
        return super().new_event()

    @property
    def kernels(self) -> KernelSet:
        self._count("kernels")
        return super().kernels
