"""What the GPU backends share: streams, events and graphs through a torch device module
(`torch.cuda` on CUDA and ROCm, `torch.xpu` on XPU), and the Triton kernel binding."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
from types import ModuleType
from typing import Any

import torch

from hisparse.backends.base import Backend, DeviceInfo
from hisparse.backends.kernel_set import KernelSet, reference_kernels
from hisparse.kernels import backup_reference
from hisparse.kernels.swap_in import reference as swap_in_reference

logger = logging.getLogger("hisparse.backends")

TRITON_KERNELS = "hisparse.kernels.swap_in.launch"
# Triton kernel -> (its module, the torch reference that replaces it without triton).
_KERNELS = {
    "swap_in_triton": (TRITON_KERNELS, swap_in_reference.swap_in_reference),
    "copy_planned_triton": (TRITON_KERNELS, swap_in_reference.copy_planned_reference),
    "backup_newest_triton": ("hisparse.kernels.backup_triton",
                             backup_reference.backup_newest_reference),
    "SwapInLauncher": (TRITON_KERNELS, None),
    "BackupLauncher": ("hisparse.kernels.backup_triton", None),
    "NewestWriterTriton": ("hisparse.kernels.newest_triton", None),
    "AdvanceTriton": ("hisparse.kernels.advance_triton", None),
}
_warned_no_triton = False


def _import_triton_kernels(module_name: str = TRITON_KERNELS) -> ModuleType:
    return importlib.import_module(module_name)


def bind_triton_kernel(name: str) -> Any:
    """`name` from the Triton kernels, or its torch reference when triton is not installed."""
    global _warned_no_triton
    module_name, reference = _KERNELS[name]
    try:
        module = _import_triton_kernels(module_name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "triton":
            raise  # our own kernels module is missing: a broken install, not a fallback case
        if not _warned_no_triton:
            _warned_no_triton = True
            logger.warning(
                "triton is not installed, so swap-in runs the torch reference (it syncs with "
                "the host every step). Install it with: pip install 'hisparse[triton]'"
            )
        return reference
    return getattr(module, name)


# torch.accelerator's stream calls (torch 2.6 on) go straight to C++.
_ACCELERATOR_STREAMS = all(hasattr(getattr(torch, "accelerator", None), name) for name in (
    "current_stream", "set_stream", "current_device_index", "set_device_index"))


_DEVICES: dict[tuple[str, int], torch.device] = {}


@functools.cache
def _accelerator_type() -> str | None:
    """The device type torch.accelerator drives in this process (None: none)."""
    accelerator = torch.accelerator.current_accelerator()
    return None if accelerator is None else accelerator.type


class _StreamScope:
    """`stream` is its device's current stream inside the block, as under the device module's
    `stream()` (which also makes that device current), at a fraction of its host time."""

    __slots__ = ("_device_before", "_stream", "_stream_before")

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __enter__(self) -> Any:
        self._device_before = torch.accelerator.current_device_index()
        self._stream_before = torch.accelerator.current_stream(self._stream.device_index)
        torch.accelerator.set_stream(self._stream)
        return self._stream

    def __exit__(self, *exc_info: object) -> None:
        torch.accelerator.set_stream(self._stream_before)
        if self._device_before != self._stream_before.device_index:
            torch.accelerator.set_device_index(self._device_before)


class AcceleratorBackend(Backend):
    """A backend whose device is driven through a torch device module."""

    @property
    def module(self) -> ModuleType:
        return getattr(torch, self.torch_device_type)

    def device_count(self) -> int | None:
        return int(self.module.device_count())

    def describe(self, index: int | None = None) -> DeviceInfo:
        module = self.module
        properties = module.get_device_properties(
            module.current_device() if index is None else index)
        # SMs on CUDA, compute units on ROCm, Xe cores (subslices) on XPU.
        units = next((int(value) for value in (
            getattr(properties, attribute, None) for attribute in (
                "multi_processor_count", "gpu_subslice_count", "max_compute_units"))
            if value), 1)
        # torch reports the warp size on CUDA and ROCm builds (64 on CDNA's wavefronts).
        return DeviceInfo(name=str(properties.name), compute_units=units,
                          warp_size=int(getattr(properties, "warp_size", 32) or 32))

    def current_device(self) -> torch.device | None:
        # Once a decode step: torch.accelerator's index is a C++ call, the device module's
        # `current_device()` runs its lazy-init checks in Python first.
        if _ACCELERATOR_STREAMS and _accelerator_type() == self.torch_device_type:
            index = torch.accelerator.current_device_index()
        else:
            index = self.module.current_device()
        device = _DEVICES.get((self.torch_device_type, index))
        if device is None:
            device = _DEVICES[self.torch_device_type, index] = torch.device(
                self.torch_device_type, index)
        return device

    def device_scope(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return self.module.device(device)

    # --- streams, events, graphs ---------------------------------------------------------
    def new_stream(self) -> Any:
        return self.module.Stream()

    def stream_scope(self, stream: Any | None) -> contextlib.AbstractContextManager[Any]:
        if stream is None:
            return contextlib.nullcontext()
        return _StreamScope(stream) if _ACCELERATOR_STREAMS else self.module.stream(stream)

    def new_event(self) -> Any:
        # torch.Event's record and wait are C++ calls given a stream; the device module's
        # events look the current stream up in Python on every call (see benchmarks/NOTES.md).
        return torch.Event(device=torch.device(self.torch_device_type))

    def record_event(self, event: Any | None, device: torch.device | None = None) -> None:
        if event is not None:  # without a stream: the current one, looked up in C++
            event.record() if self._is_current(device) else event.record(
                self._current_stream(device))

    def wait_event(self, event: Any | None, device: torch.device | None = None) -> None:
        if event is not None:
            event.wait() if self._is_current(device) else event.wait(
                self._current_stream(device))

    def _is_current(self, device: torch.device | None) -> bool:
        """Whether `device` is current (an event's record() and wait() use its stream)."""
        return (_ACCELERATOR_STREAMS and _accelerator_type() == self.torch_device_type
                and (device is None or device.index is None
                     or device.index == torch.accelerator.current_device_index()))

    def _current_stream(self, device: torch.device | None) -> Any:
        index = None if device is None else device.index
        if _ACCELERATOR_STREAMS:
            return torch.accelerator.current_stream(index)
        return self.module.current_stream(index)

    def synchronize(self, device: torch.device | None = None) -> None:
        self.module.synchronize(device)

    def event_done(self, event: Any | None) -> bool:
        return event is None or bool(event.query())

    def synchronize_event(self, event: Any | None) -> None:
        if event is not None:
            event.synchronize()

    # --- kernels -------------------------------------------------------------------------
    @property
    def kernels(self) -> KernelSet:
        swap_in = bind_triton_kernel("swap_in_triton")
        copy_planned = bind_triton_kernel("copy_planned_triton")
        reference = reference_kernels(swap_in, copy_planned)
        launcher = bind_triton_kernel("SwapInLauncher")
        if launcher is None:  # no triton: the reference, as for every kernel
            return reference
        direct = self.direct_kernel_launch

        def swap_in_launcher(tables: Any, *args: Any, **options: Any) -> Any:
            return launcher(tables, *args, traits=self.kernel_traits(tables.last_use.device),
                            **options)

        # The newest writer and the batch advance are Triton only where their bound launches
        # go straight to the driver (about 5 us): through triton's dispatch (15-30 us) they
        # would cost more than the torch ops they replace.
        return dataclasses.replace(
            reference, swap_in_launcher=swap_in_launcher,
            backup_launcher=functools.partial(bind_triton_kernel("BackupLauncher"),
                                              direct=direct),
            newest_writer=functools.partial(bind_triton_kernel("NewestWriterTriton"),
                                            direct=direct) if direct else reference.newest_writer,
            batch_advance=functools.partial(bind_triton_kernel("AdvanceTriton"),
                                            direct=direct) if direct else reference.batch_advance,
            implementation=("triton, direct launches" if direct else
                            "triton through its dispatch; newest writer and advance in torch"))
