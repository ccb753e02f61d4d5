"""The interface every backend implements, and the shell that enforces its feature table.

A backend states device facts (how to find and describe the device, allocate host memory,
translate host addresses, make streams, events and graphs), binds its kernels (`kernels`, one
frozen record) and carries its feature table (`features`, frozen data). Policy (LRU, planning,
which path runs) lives in `hisparse.core`, which asks `backend.features.supports(Feature.X)`,
never for a name.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from hisparse.backends.features import Feature, FeatureTable
from hisparse.backends.kernel_set import (
    BackupFn,
    CopyPlannedFn,
    KernelSet,
    SwapInFn,
    reference_kernels,
)
from hisparse.errors import UnsupportedFeatureError
from hisparse.kernels.swap_in.plan import DeviceTraits

__all__ = ["FEATURE_ENTRY_POINTS", "Backend", "BackupFn", "CopyPlannedFn", "DeviceInfo",
           "KernelSet", "SwapInFn", "device_names"]


@dataclass(frozen=True)
class DeviceInfo:
    """What a backend states about one device."""

    name: str  # human-readable, e.g. "NVIDIA H200"
    compute_units: int = 1  # SMs, CUs or Xe cores, for sizing kernel grids
    warp_size: int = 32  # lanes per warp (wavefront on AMD, sub-group on Intel)
    # Beyond the feature table: whether this device and triton have programmatic dependent
    # launch (the launch plan uses it only where the table has the feature as well).
    pdl: bool = False


class Backend(abc.ABC):
    """One device type. Subclasses set the class attributes and implement the hooks."""

    name: str  # registry key: "cuda", "rocm", "xpu", "cpu", or an out-of-tree name
    torch_device_type: str  # what torch calls the device ("cuda" also on ROCm)
    features: FeatureTable
    # False until the backend's GPU paths have run on real hardware; the probe says so.
    verified_on_hardware: bool = True
    # Whether bound kernel launches may call triton's compiled launcher directly
    # (kernels.launching): possible where that launcher takes raw addresses (CUDA, ROCm).
    direct_kernel_launch: bool = False
    # Where REGISTER_HOST_MEMORY is supported: what registers host memory with the runtime
    # (a `_host_register.HostRegistry`, or anything with `register` and `unregister`).
    host_registry: Any = None

    # --- detection and description -------------------------------------------------------
    @abc.abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when this backend can run here, else one line saying why not."""

    def runtime_versions(self) -> dict[str, str | None]:
        """Driver and runtime versions the probe reports (e.g. {"cuda_runtime": "12.8"})."""
        return {}

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.torch_device_type, index)

    def device_count(self) -> int | None:
        """Devices of this type visible here; None where an index names nothing (the CPU)."""
        return None

    def describe(self, index: int | None = None) -> DeviceInfo:
        """Device `index` (None: the current one) as a frozen record."""
        return DeviceInfo(name=self.name)

    def kernel_traits(self, device: torch.device) -> DeviceTraits:
        """What the swap-in launch plan needs to know of `device`: its parallel units and
        whether its kernels may launch as programmatic dependents."""
        info = self.describe(device.index)
        return DeviceTraits(compute_units=info.compute_units,
                            pdl=self.features.supports(Feature.PROGRAMMATIC_DEPENDENT_LAUNCH)
                            and info.pdl,
                            interpreted=device.type == "cpu",
                            direct_launch=self.direct_kernel_launch,
                            warp_size=info.warp_size)

    def current_device(self) -> torch.device | None:
        """The device kernels launch on from this thread now (None where there is one: CPU)."""
        return None

    def device_scope(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Make `device` the current one for the block (streams, events and launches)."""
        return contextlib.nullcontext()

    # --- host memory -----------------------------------------------------------------------
    @abc.abstractmethod
    def alloc_host(self, num_bytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of exactly `num_bytes` that this backend's kernels can read.

        Raises HostAllocationError naming the size asked for and what was available.
        """

    @abc.abstractmethod
    def free_host(self, buffer: torch.Tensor) -> None:
        """Release a buffer from `alloc_host` (unregistering exactly what was registered)."""

    def register_host(self, buffer: torch.Tensor, *, shared: bool = False) -> None:
        """Make existing host memory (e.g. a transfer engine's buffer) device-readable; with
        `shared`, a shared-memory mapping (a shared host pool's segment), which needs nothing
        where the device reads host memory as it is (the CPU)."""
        self.require(Feature.SHARED_HOST_POOL if shared else Feature.REGISTER_HOST_MEMORY)
        if self.features.supports(Feature.REGISTER_HOST_MEMORY):
            self.host_registry.register(buffer)

    def unregister_host(self, buffer: torch.Tensor, *, shared: bool = False) -> None:
        """Undo `register_host(buffer, shared=shared)`."""
        self.require(Feature.SHARED_HOST_POOL if shared else Feature.REGISTER_HOST_MEMORY)
        if self.features.supports(Feature.REGISTER_HOST_MEMORY):
            self.host_registry.unregister(buffer)

    def device_address(self, buffer: torch.Tensor) -> int:
        """The address a kernel must use to read `buffer` (differs from the host one on ROCm)."""
        return int(buffer.data_ptr())

    # --- streams, events, graphs -----------------------------------------------------------
    def new_stream(self) -> Any | None:
        """A side stream, or None where work runs synchronously (CPU)."""
        return None

    def stream_scope(self, stream: Any | None) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for all work on `device` (None: the current device)."""

    def new_event(self) -> Any | None:
        return None

    def record_event(self, event: Any | None, device: torch.device | None = None) -> None:
        """Record `event` on the current stream of `device` (None: of the current device)."""

    def wait_event(self, event: Any | None, device: torch.device | None = None) -> None:
        """Make the current stream of `device` (None: of the current device) wait for `event`."""

    def event_done(self, event: Any | None) -> bool:
        """Whether the work recorded before `event` is done, without waiting (True where
        events are None, and for an event never recorded)."""
        return True

    def synchronize_event(self, event: Any | None) -> None:
        """Block the host until the work recorded before `event` is done (no-op where events
        are None: work on the CPU has run by the time the call returns)."""

    def graph_capture(self, stream: Any | None = None) -> contextlib.AbstractContextManager[Any]:
        """Capture the block's launches into a new graph, which the block gets
        (`with backend.graph_capture() as graph: ...`, then `graph.replay()`)."""
        self.require(Feature.GRAPH_CAPTURE)
        raise NotImplementedError  # pragma: no cover - supported backends override

    # --- kernels and features --------------------------------------------------------------
    @property
    def kernels(self) -> KernelSet:
        """Every kernel this backend runs (the torch references here; the GPU backends bind
        Triton's). Bound on each access, which only builds a small record."""
        return reference_kernels()

    def require(self, feature: Feature) -> None:
        """Raise UnsupportedFeatureError unless the feature table says `feature` works here."""
        entry = self.features[Feature(feature)]
        if not entry.usable:
            raise UnsupportedFeatureError(str(feature), self.name, entry.reason, entry.instead)

    def __repr__(self) -> str:
        return f"<hisparse backend {self.name}>"


def device_names(backend: Backend) -> list[str]:
    """The names of the devices `backend` sees, in index order (none for the CPU)."""
    return [backend.describe(index).name for index in range(backend.device_count() or 0)]


# The methods that are a feature's way in; each calls `require`, so a backend whose table does
# not support the feature raises there (a shared host pool's with `shared=True`). Features a
# config flag switches raise or warn in `config.resolve_features` instead, and the FACTS of
# `backends.features` have no way in. Tests walk this map to prove every stub raises.
FEATURE_ENTRY_POINTS: dict[Feature, tuple[str, ...]] = {
    Feature.REGISTER_HOST_MEMORY: ("register_host", "unregister_host"),
    Feature.GRAPH_CAPTURE: ("graph_capture",),
    Feature.SHARED_HOST_POOL: ("register_host", "unregister_host"),
}
