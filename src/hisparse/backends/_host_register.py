"""Host memory shared by the CUDA and ROCm backends: plain pages, registered with the runtime.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator, which rounds
every block up to a power of two (a 100 GB pool pins 128 GB). So pools are anonymous
mappings registered exactly, in page-aligned chunks, with cudaHostRegister (which torch's
cudart binding maps to hipHostRegister on ROCm builds). Every registration is unregistered by
its exact base pointer on free and, for anything still alive, at interpreter exit.
"""

from __future__ import annotations

import atexit
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hisparse.backends._host_memory import (
    ALREADY_REGISTERED_RETRIES,
    ERROR_ALREADY_REGISTERED,
    AlreadyRegistered,
    available_host_bytes,
    clear_runtime_error,
    format_bytes,
)
from hisparse.errors import HostAllocationError

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# One registration call per 16 GiB: the runtime pins page by page, and very large single
# calls have been seen to fail where the same bytes in chunks succeed.
CHUNK_BYTES = 16 << 30
# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every device context, and
# mapped so a kernel can read it directly (hipHostGetDevicePointer needs the mapped flag).
REGISTER_FLAGS = 1 | 2


def check_host_request(num_bytes: int, what: str) -> int | None:
    """Raise HostAllocationError unless `num_bytes` is a positive int the host can hold.

    Returns the available bytes (None where unknown) for the caller's later messages.
    """
    if not isinstance(num_bytes, int) or isinstance(num_bytes, bool) or num_bytes <= 0:
        raise HostAllocationError(
            f"{what}: asked for {num_bytes!r} bytes; pass a positive int number of bytes."
        )
    available = available_host_bytes()
    if available is not None and num_bytes > available:
        raise HostAllocationError(
            f"{what}: asked for {format_bytes(num_bytes)} of host memory but only "
            f"{format_bytes(available)} is available; lower host_pool_tokens or free memory."
        )
    return available


def allocate_plain(num_bytes: int, what: str) -> torch.Tensor:
    """A uint8 CPU tensor of `num_bytes`; HostAllocationError when the host cannot hold it."""
    available = check_host_request(num_bytes, what)
    try:
        return torch.empty(num_bytes, dtype=torch.uint8)
    except RuntimeError as exc:
        raise HostAllocationError(
            f"{what}: allocating {format_bytes(num_bytes)} failed ({exc}); "
            f"available: {format_bytes(available) if available is not None else 'unknown'}."
        ) from exc


@dataclass
class _Registration:
    start: int
    num_bytes: int
    chunks: list[tuple[int, int]]  # (base pointer, bytes) as passed to the runtime
    backing: torch.Tensor | None  # keeps our own allocation alive until it is unregistered
    owned: bool
    device_pointers: dict[int, int] = field(default_factory=dict)


class HostRegistry:
    """The live registrations of one runtime (CUDA or ROCm), keyed by start address."""

    def __init__(self, runtime: Callable[[], Any], api: str) -> None:
        self._runtime = runtime  # called lazily: returns the object with cudaHostRegister
        self._api = api  # "cudaHostRegister" or "hipHostRegister", for messages
        self._live: dict[int, _Registration] = {}
        self._quarantine: list[torch.Tensor] = []  # mappings at addresses someone left registered
        self._lock = threading.Lock()
        atexit.register(self.release_all)

    # --- allocation ----------------------------------------------------------------------
    def allocate(self, num_bytes: int) -> torch.Tensor:
        """Exactly `num_bytes`, registered, in a mapping of whole pages of its own.

        An anonymous mapping starts on a page, so no registered page is shared with other
        memory, and the tensor's storage starts where the registration does: torch's
        `is_pinned()` (which kernels check) looks at the storage base, not the view.
        """
        available = check_host_request(num_bytes, "host pool")
        span = -(-num_bytes // PAGE_BYTES) * PAGE_BYTES
        for attempt in range(ALREADY_REGISTERED_RETRIES + 1):
            try:
                mapping = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except OSError as exc:
                raise HostAllocationError(
                    f"host pool: mapping {format_bytes(span)} failed ({exc}); available: "
                    f"{format_bytes(available) if available is not None else 'unknown'}."
                ) from exc
            backing = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
            buffer = backing[:num_bytes]
            try:
                self._register_range(buffer.data_ptr(), span, backing, owned=True)
                return buffer
            except AlreadyRegistered as exc:
                # Another component freed memory it had registered (a transfer engine's
                # registration cache can do that), and the kernel handed us the same
                # addresses. Those pages must not be reused: keep this mapping out of
                # circulation for the life of the process and map elsewhere.
                self._quarantine.append(backing)
                if attempt == ALREADY_REGISTERED_RETRIES:
                    raise HostAllocationError(str(exc)) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def free(self, buffer: torch.Tensor) -> None:
        registration = self._pop(buffer, owned=True)
        self._unregister_chunks(registration)

    # --- existing memory -----------------------------------------------------------------
    def register(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise HostAllocationError(
                f"{self._api}: got a {'non-contiguous ' if not buffer.is_contiguous() else ''}"
                f"tensor on {buffer.device}; pass a contiguous CPU tensor."
            )
        num_bytes = buffer.numel() * buffer.element_size()
        # Holding the tensor keeps its memory from being freed while registered: freed pages
        # that stay registered make the next mapping at that address unregistrable (error 712).
        self._register_range(buffer.data_ptr(), num_bytes, buffer, owned=False)

    def unregister(self, buffer: torch.Tensor) -> None:
        self._unregister_chunks(self._pop(buffer, owned=False))

    # --- lookups -------------------------------------------------------------------------
    def chunk_containing(self, address: int) -> tuple[_Registration, int] | None:
        """The registration and chunk base that hold `address`, if any."""
        with self._lock:
            for registration in self._live.values():
                for base, size in registration.chunks:
                    if base <= address < base + size:
                        return registration, base
        return None

    def live_ranges(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(r.start, r.num_bytes) for r in self._live.values()]

    def release_all(self) -> None:
        """Unregister everything still registered (at exit, or by a test)."""
        with self._lock:
            registrations = list(self._live.values())
            self._live.clear()
        for registration in registrations:
            self._unregister_chunks(registration, raise_errors=False)

    # --- internals -----------------------------------------------------------------------
    def _register_range(
        self, start: int, num_bytes: int, backing: torch.Tensor | None, owned: bool
    ) -> None:
        with self._lock:
            if start in self._live:
                raise HostAllocationError(
                    f"{self._api}: memory at {start:#x} is already registered; "
                    "unregister it first or register it once."
                )
        runtime = self._runtime()
        chunks: list[tuple[int, int]] = []
        for offset in range(0, num_bytes, CHUNK_BYTES):
            base, size = start + offset, min(CHUNK_BYTES, num_bytes - offset)
            status = int(runtime.cudaHostRegister(base, size, REGISTER_FLAGS))
            if status != 0:
                clear_runtime_error(self._api)
                self._unregister_chunks(_Registration(start, num_bytes, chunks, None, owned))
                if status == ERROR_ALREADY_REGISTERED:
                    raise AlreadyRegistered(
                        f"{self._api} of {format_bytes(size)} at {base:#x} failed: part of the "
                        "range is still registered (memory freed without being unregistered, "
                        "by this process or a library in it); unregister memory before freeing "
                        "it"
                    )
                available = available_host_bytes()
                raise HostAllocationError(
                    f"{self._api} of {format_bytes(size)} at offset {offset} of a "
                    f"{format_bytes(num_bytes)} buffer failed with error {status}"
                    f"{_error_name(runtime, status)}; available host memory: "
                    f"{format_bytes(available) if available is not None else 'unknown'}. "
                    "Lower host_pool_tokens, or raise the locked-memory limit (ulimit -l)."
                )
            chunks.append((base, size))
        with self._lock:
            self._live[start] = _Registration(start, num_bytes, chunks, backing, owned)

    def _pop(self, buffer: torch.Tensor, owned: bool) -> _Registration:
        start = buffer.data_ptr()
        with self._lock:
            registration = self._live.get(start)
            if registration is None or registration.owned is not owned:
                how = "alloc_host" if owned else "register_host"
                raise HostAllocationError(
                    f"{self._api}: no buffer from {how} starts at {start:#x}; pass the exact "
                    f"tensor {how} returned or registered (each is released once)."
                )
            del self._live[start]
        return registration

    def _unregister_chunks(self, registration: _Registration, raise_errors: bool = True) -> None:
        if not registration.chunks:
            return
        runtime = self._runtime()
        failures = []
        for base, _ in registration.chunks:
            status = int(runtime.cudaHostUnregister(base))
            if status != 0:
                failures.append(f"{base:#x}: error {status}{_error_name(runtime, status)}")
        registration.chunks = []
        registration.backing = None
        if failures and raise_errors:
            raise HostAllocationError(
                f"{self._api.replace('Register', 'Unregister')} failed for " + ", ".join(failures)
            )


def _error_name(runtime: Any, status: int) -> str:
    describe = getattr(runtime, "cudaGetErrorString", None)
    if describe is None:
        return ""
    try:
        return f" ({describe(status)})"
    except Exception:  # the enum binding rejects unknown codes; the number alone will do
        return ""
