"""The interface every backend implements, and the shell that enforces its feature table.

A backend states device facts (how to find the device, allocate host memory, translate host
addresses, make streams, events and graphs) and binds kernels. Policy (LRU, planning, which
path runs) lives in `hisparse.core`, which asks `backend.supports(Feature.X)`, never for a name.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hisparse.backends.features import Feature, FeatureTable, Support
from hisparse.backends.reference_kernels import (
    BackupFn,
    CopyPlannedFn,
    ReferenceKernelBindings,
    SwapInFn,
)
from hisparse.errors import UnsupportedFeatureError
from hisparse.kernels.swap_in.plan import DeviceTraits

__all__ = ["FEATURE_ENTRY_POINTS", "Backend", "BackupFn", "CopyPlannedFn", "SwapInFn"]


class Backend(ReferenceKernelBindings, abc.ABC):
    """One device type. Subclasses set the class attributes and implement the hooks."""

    name: str  # registry key: "cuda", "rocm", "xpu", "cpu", or an out-of-tree name
    torch_device_type: str  # what torch calls the device ("cuda" also on ROCm)
    features: FeatureTable
    # False until the backend's GPU paths have run on real hardware; the probe says so.
    verified_on_hardware: bool = True
    # Whether bound kernel launches may call triton's compiled launcher directly
    # (kernels.launching): possible where that launcher takes raw addresses (CUDA, ROCm).
    direct_kernel_launch: bool = False

    # --- detection -------------------------------------------------------------------------
    @abc.abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when this backend can run here, else one line saying why not."""

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.torch_device_type, index)

    def device_names(self) -> list[str]:
        """Human-readable names of the visible devices (empty for CPU)."""
        return []

    def device_count(self) -> int | None:
        """Devices of this type visible here; None where an index names nothing (the CPU)."""
        return None

    def compute_units(self, index: int | None = None) -> int:
        """Parallel units of the device (SMs, CUs, Xe cores), for sizing kernel grids."""
        return 1

    def kernel_traits(self, device: torch.device) -> DeviceTraits:
        """What the swap-in launch plan needs to know of `device`: its parallel units and
        whether its kernels may launch as programmatic dependents."""
        return DeviceTraits(compute_units=self.compute_units(device.index),
                            pdl=self.supports(Feature.PROGRAMMATIC_DEPENDENT_LAUNCH)
                            and self.device_has_pdl(device),
                            interpreted=device.type == "cpu",
                            direct_launch=self.direct_kernel_launch,
                            warp_size=self.warp_size(device.index))

    def warp_size(self, index: int | None = None) -> int:
        """Lanes per warp (wavefront on AMD, sub-group on Intel) of the device's kernels."""
        return 32

    def device_has_pdl(self, device: torch.device) -> bool:
        """Beyond the feature table: whether this device and triton have PDL."""
        return False

    def runtime_versions(self) -> dict[str, str | None]:
        """Driver and runtime versions the probe reports (e.g. {"cuda_runtime": "12.8"})."""
        return {}

    # --- host memory -----------------------------------------------------------------------
    @abc.abstractmethod
    def alloc_host(self, num_bytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of exactly `num_bytes` that this backend's kernels can read.

        Raises HostAllocationError naming the size asked for and what was available.
        """

    @abc.abstractmethod
    def free_host(self, buffer: torch.Tensor) -> None:
        """Release a buffer from `alloc_host` (unregistering exactly what was registered)."""

    def register_host(self, buffer: torch.Tensor) -> None:
        """Make existing host memory (e.g. a transfer engine's buffer) device-readable."""
        self.require(Feature.REGISTER_HOST_MEMORY)
        raise NotImplementedError  # pragma: no cover - supported backends override

    def unregister_host(self, buffer: torch.Tensor) -> None:
        self.require(Feature.REGISTER_HOST_MEMORY)
        raise NotImplementedError  # pragma: no cover

    def register_shared_host(self, buffer: torch.Tensor) -> None:
        """Make a shared-memory mapping (a shared host pool's segment) device-readable."""
        self.require(Feature.SHARED_HOST_POOL)
        if self.supports(Feature.REGISTER_HOST_MEMORY):
            self.register_host(buffer)

    def unregister_shared_host(self, buffer: torch.Tensor) -> None:
        self.require(Feature.SHARED_HOST_POOL)
        if self.supports(Feature.REGISTER_HOST_MEMORY):
            self.unregister_host(buffer)

    def device_address(self, buffer: torch.Tensor) -> int:
        """The address a kernel must use to read `buffer` (differs from the host one on ROCm)."""
        return int(buffer.data_ptr())

    def current_device(self) -> torch.device | None:
        """The device kernels launch on from this thread now (None where there is one: CPU)."""
        return None

    def device_scope(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Make `device` the current one for the block (streams, events and launches)."""
        return contextlib.nullcontext()

    # --- streams, events, graphs -----------------------------------------------------------
    def new_stream(self) -> Any | None:
        """A side stream, or None where work runs synchronously (CPU)."""
        return None

    def stream_scope(self, stream: Any | None) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def new_event(self) -> Any | None:
        return None

    def record_event(self, event: Any | None, device: torch.device | None = None) -> None:
        """Record `event` on the current stream of `device` (None: of the current device)."""

    def wait_event(self, event: Any | None, device: torch.device | None = None) -> None:
        """Make the current stream of `device` (None: of the current device) wait for `event`."""

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for all work on `device` (None: the current device)."""

    def event_done(self, event: Any | None) -> bool:
        """Whether the work recorded before `event` is done, without waiting (True where
        events are None, and for an event never recorded)."""
        return True

    def synchronize_event(self, event: Any | None) -> None:
        """Block the host until the work recorded before `event` is done (no-op where events
        are None: work on the CPU has run by the time the call returns)."""

    def new_graph(self) -> Any:
        self.require(Feature.GRAPH_CAPTURE)
        raise NotImplementedError  # pragma: no cover

    def graph_capture(
        self, graph: Any, stream: Any | None = None
    ) -> contextlib.AbstractContextManager[Any]:
        self.require(Feature.GRAPH_CAPTURE)
        raise NotImplementedError  # pragma: no cover

    def backup_stream(self) -> Any | None:
        """The side stream that backs the newest tokens up to the host while decode goes on."""
        self.require(Feature.ASYNC_BACKUP)
        return self.new_stream()

    def prefetch_stream(self) -> Any | None:
        """Where follower layers replay the anchor's miss plan (None: inline, synchronously)."""
        self.require(Feature.SHARED_INDEX_PREFETCH)
        return self.new_stream()

    # --- kernels ---------------------------------------------------------------------------
    def zero_copy_swap_in_kernel(self) -> SwapInFn:
        """The fused swap-in that reads missing rows straight out of host memory."""
        self.require(Feature.ZERO_COPY_SWAP_IN)
        return self.swap_in_kernel()

    def skip_io_swap_in_kernel(self) -> SwapInFn:
        """The swap-in to call with `skip_io=True` (plans and updates the LRU, moves no bytes)."""
        self.require(Feature.SKIP_IO_PROBE)
        return self.swap_in_kernel()

    @abc.abstractmethod
    def swap_in_kernel(self) -> SwapInFn:
        """The swap-in implementation this backend runs (Triton or the torch reference)."""

    @abc.abstractmethod
    def copy_planned_kernel(self) -> CopyPlannedFn:
        """The copy-only replay of a miss plan."""

    # --- the shell -------------------------------------------------------------------------
    def supports(self, feature: Feature) -> bool:
        return self.features[Feature(feature)].usable

    def support(self, feature: Feature) -> Support:
        return self.features[Feature(feature)]

    def require(self, feature: Feature) -> None:
        """Raise UnsupportedFeatureError unless the feature table says `feature` works here."""
        entry = self.features[Feature(feature)]
        if not entry.usable:
            raise UnsupportedFeatureError(str(feature), self.name, entry.reason, entry.instead)

    def describe_features(self) -> Iterator[tuple[Feature, Support]]:
        yield from self.features.items()

    def __repr__(self) -> str:
        return f"<hisparse backend {self.name}>"


# The methods that are a feature's way in; each calls `require`, so a backend whose table does
# not support the feature raises there. Tests walk this map to prove every stub raises.
FEATURE_ENTRY_POINTS: dict[Feature, tuple[str, ...]] = {
    Feature.REGISTER_HOST_MEMORY: ("register_host", "unregister_host"),
    Feature.ZERO_COPY_SWAP_IN: ("zero_copy_swap_in_kernel",),
    Feature.GRAPH_CAPTURE: ("new_graph", "graph_capture"),
    Feature.ASYNC_BACKUP: ("backup_stream",),
    Feature.SHARED_INDEX_PREFETCH: ("prefetch_stream",),
    Feature.SKIP_IO_PROBE: ("skip_io_swap_in_kernel",),
    Feature.SHARED_HOST_POOL: ("register_shared_host", "unregister_shared_host"),
}
