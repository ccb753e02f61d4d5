"""What the GPU backends share: streams, events and graphs through a torch device module
(`torch.cuda` on CUDA and ROCm, `torch.xpu` on XPU), and the Triton kernel binding."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from types import ModuleType
from typing import Any

import torch

from hisparse.backends.base import Backend, BackupFn, CopyPlannedFn, SwapInFn
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

    def device_names(self) -> list[str]:
        module = self.module
        return [module.get_device_name(i) for i in range(module.device_count())]

    def device_count(self) -> int | None:
        return int(self.module.device_count())

    def compute_units(self, index: int | None = None) -> int:
        module = self.module
        properties = module.get_device_properties(
            module.current_device() if index is None else index
        )
        # SMs on CUDA, compute units on ROCm, Xe cores (subslices) on XPU.
        for attribute in ("multi_processor_count", "gpu_subslice_count", "max_compute_units"):
            value = getattr(properties, attribute, None)
            if value:
                return int(value)
        return 1

    def warp_size(self, index: int | None = None) -> int:
        module = self.module
        properties = module.get_device_properties(
            module.current_device() if index is None else index)
        # torch reports it on CUDA and ROCm builds (64 on CDNA's wavefronts); 32 elsewhere.
        return int(getattr(properties, "warp_size", 32) or 32)

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
    def swap_in_kernel(self) -> SwapInFn:
        return bind_triton_kernel("swap_in_triton")

    def copy_planned_kernel(self) -> CopyPlannedFn:
        return bind_triton_kernel("copy_planned_triton")

    def backup_kernel(self) -> BackupFn:
        # A launcher per call (per cache): it binds its launch to that cache's buffers once.
        launcher = bind_triton_kernel("BackupLauncher")
        if launcher is None:  # no triton: the reference, as for every kernel
            return backup_reference.backup_newest_reference
        return launcher(direct=self.direct_kernel_launch)

    def newest_writer(self, device_kv: torch.Tensor, newest_rows: torch.Tensor,
                      newest_rows_long: torch.Tensor) -> Any:
        # The Triton writer only where its bound launches go straight to the driver (about
        # 5 us): through triton's dispatch (15-30 us) it would cost more than the index_copy_.
        writer = bind_triton_kernel("NewestWriterTriton") if self.direct_kernel_launch else None
        if writer is None:  # no triton, or no direct launches: the reference's index_copy_
            return super().newest_writer(device_kv, newest_rows, newest_rows_long)
        return writer(device_kv, newest_rows, newest_rows_long,
                      direct=self.direct_kernel_launch)

    def batch_advance(self, batch_slots: torch.Tensor, num_real: torch.Tensor,
                      newest_host_rows: torch.Tensor, new_seq_lens: torch.Tensor,
                      seq_lens: torch.Tensor) -> Any:
        # As the newest writer: one bound launch where it goes straight to the driver.
        advance = bind_triton_kernel("AdvanceTriton") if self.direct_kernel_launch else None
        if advance is None:
            return super().batch_advance(batch_slots, num_real, newest_host_rows,
                                         new_seq_lens, seq_lens)
        return advance(batch_slots, num_real, newest_host_rows, new_seq_lens, seq_lens,
                       direct=self.direct_kernel_launch)

    def swap_in_launcher(self, tables: Any, req_slots: torch.Tensor, num_real: torch.Tensor,
                         out: torch.Tensor, *, plans: Any = None, skip_io: bool = False,
                         newest_rows: torch.Tensor | None = None,
                         newest_host_rows: torch.Tensor | None = None, union: Any = None) -> Any:
        launcher = bind_triton_kernel("SwapInLauncher")
        if launcher is None:  # no triton: the reference, as for every kernel
            return super().swap_in_launcher(tables, req_slots, num_real, out,
                                            plans=plans, skip_io=skip_io)
        return launcher(tables, req_slots, num_real, out, traits=self.kernel_traits(
            tables.last_use.device), plans=plans, skip_io=skip_io, newest_rows=newest_rows,
            newest_host_rows=newest_host_rows, union=union)

