"""Backend registry, detection, host allocators and kernel binding.

Hardware this machine lacks (ROCm, XPU, CUDA on CI) is faked with tests/fakes/environment.py;
the `backend` fixture runs the real-device cases wherever a device is present.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hisparse
from conftest import needs_module, random_bytes
from fakes.environment import CUDA_ERROR_MEMORY_ALLOCATION, HIP_DEVICE_OFFSET
from hisparse.backends import _accelerator, _host_register, registry
from hisparse.backends.base import Backend, DeviceInfo, KernelSet, device_names
from hisparse.backends.cpu import CpuBackend
from hisparse.errors import BackendUnavailableError, HostAllocationError
from hisparse.kernels import backup_reference
from hisparse.kernels.swap_in import reference as swap_in_reference

SRC = Path(hisparse.__file__).resolve().parent
PAGE = _host_register.PAGE_BYTES
REGISTER_FLAGS = 3  # portable | mapped


# --- import and registry ------------------------------------------------------------------
def test_import_touches_no_device_and_loads_no_backend() -> None:
    code = (
        "import sys, hisparse\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('torch', 'hisparse.backends.')))\n"
        "print(loaded)\n"
        "hisparse.HiSparseConfig; hisparse.Feature; hisparse.UnsupportedFeatureError\n"
        "import torch\n"
        "print(torch.cuda.is_initialized(), 'hisparse.backends.cuda' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, env={"PYTHONPATH": str(SRC.parent)})
    loaded, after = done.stdout.strip().splitlines()
    assert loaded == "[]", f"import hisparse loaded {loaded}"
    assert after == "False False"


def test_every_public_name_resolves() -> None:
    for name in hisparse.__all__:
        assert getattr(hisparse, name) is not None, name
    assert callable(hisparse.probe) and hisparse.probe.__module__ == "hisparse.tools.probe"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = hisparse.nope


@pytest.mark.parametrize(
    ("kind", "expected"), [("rocm", "rocm"), ("cuda", "cuda"), ("xpu", "xpu"), ("none", "cpu")]
)
def test_detection_picks_the_device_that_is_there(fake_env, kind: str, expected: str) -> None:
    fake_env(kind)
    assert hisparse.get_backend().name == expected
    assert hisparse.available_backends()[0] == expected
    assert hisparse.available_backends()[-1] == "cpu"


def test_detection_falls_back_to_cpu_when_the_build_has_no_visible_gpu(fake_env) -> None:
    fake_env("cuda", gpus=0)
    assert hisparse.get_backend().name == "cpu"
    with pytest.raises(BackendUnavailableError, match="no CUDA GPU is visible"):
        hisparse.get_backend("cuda")


def test_cuda_names_select_rocm_on_a_rocm_build(fake_env) -> None:
    fake_env("rocm")
    assert hisparse.get_backend("cuda").name == "rocm"
    assert hisparse.get_backend("cuda:1").name == "rocm"
    assert hisparse.get_backend(torch.device("cuda", 0)).name == "rocm"
    assert hisparse.get_backend("hip").name == "rocm"
    reason = registry.find_backend("xpu").unavailable_reason()
    assert "no Intel GPU" in reason


def test_explicit_choices(fake_env) -> None:
    fake_env("cuda")
    assert hisparse.get_backend("cuda:1").name == "cuda"
    assert hisparse.get_backend(torch.device("cpu")).name == "cpu"
    cpu = hisparse.get_backend("CPU")
    assert hisparse.get_backend(cpu) is cpu
    with pytest.raises(BackendUnavailableError, match="ROCm") as caught:
        hisparse.get_backend("rocm")
    assert "Usable here: cuda, cpu" in str(caught.value)


def test_unknown_backend_lists_the_registered_ones_and_how_to_add_one() -> None:
    with pytest.raises(BackendUnavailableError) as caught:
        hisparse.get_backend("npu:0")
    message = str(caught.value)
    assert "Unknown backend 'npu'" in message
    assert "Registered: cpu, cuda, rocm, xpu" in message
    assert "hisparse.register_backend()" in message
    with pytest.raises(BackendUnavailableError, match="got int"):
        hisparse.get_backend(3)


class NpuBackend(CpuBackend):
    """An out-of-tree device: the CPU backend under another name."""

    name = "npu"


def test_register_an_out_of_tree_backend(isolated_registry) -> None:
    hisparse.register_backend("npu", NpuBackend)
    assert isinstance(hisparse.get_backend("npu:0"), NpuBackend)
    assert "npu" in hisparse.available_backends()
    assert registry.registered_backends()[:4] == ["rocm", "cuda", "xpu", "cpu"]
    with pytest.raises(ValueError, match="already registered"):
        hisparse.register_backend("npu", NpuBackend)
    hisparse.register_backend("npu", lambda: NpuBackend(), replace=True)
    with pytest.raises(ValueError, match="lower-case"):
        hisparse.register_backend("NPU", NpuBackend)
    hisparse.register_backend("broken", lambda: object())
    with pytest.raises(BackendUnavailableError, match="returned object, not a hisparse Backend"):
        hisparse.get_backend("broken")


def test_isolated_registry_forgets_test_backends() -> None:
    assert "npu" not in registry.registered_backends()


# --- host memory: CUDA and ROCm registration ------------------------------------------------
@pytest.mark.parametrize("kind", ["cuda", "rocm"])
def test_pool_is_registered_exactly_and_unregistered_on_free(fake_env, rng, kind) -> None:
    env = fake_env(kind)
    backend = hisparse.get_backend()
    num_bytes = int(torch.randint(1, 5 * PAGE, (1,), generator=rng))
    buffer = backend.alloc_host(num_bytes)
    assert buffer.dtype == torch.uint8 and buffer.numel() == num_bytes
    assert buffer.data_ptr() % PAGE == 0
    # torch's is_pinned() (checked by the kernels) asks about the storage base, not the view.
    assert buffer.untyped_storage().data_ptr() == buffer.data_ptr()
    span = -(-num_bytes // PAGE) * PAGE
    assert env.cudart.registered == {buffer.data_ptr(): (span, REGISTER_FLAGS)}
    data = random_bytes((num_bytes,), rng)
    buffer.copy_(data)
    assert torch.equal(buffer, data)
    backend.free_host(buffer)
    assert env.cudart.registered == {}
    assert env.cudart.unregister_calls == [buffer.data_ptr()]
    with pytest.raises(HostAllocationError, match="each is released once"):
        backend.free_host(buffer)
    assert env.cudart.unregister_calls == [buffer.data_ptr()]


def test_large_pools_are_registered_in_chunks(fake_env, monkeypatch, rng) -> None:
    env = fake_env("cuda")
    monkeypatch.setattr(_host_register, "CHUNK_BYTES", 3 * PAGE)
    backend = hisparse.get_backend()
    num_bytes = 10 * PAGE + int(torch.randint(1, PAGE, (1,), generator=rng))
    buffer = backend.alloc_host(num_bytes)
    start = buffer.data_ptr()
    expected = {start + i * 3 * PAGE: (3 * PAGE, REGISTER_FLAGS) for i in range(3)}
    expected[start + 9 * PAGE] = (2 * PAGE, REGISTER_FLAGS)  # 11 pages in all
    assert env.cudart.registered == expected
    backend.free_host(buffer)
    assert sorted(env.cudart.unregister_calls) == sorted(expected)
    assert env.cudart.registered == {}


def test_a_failed_registration_undoes_the_chunks_before_it(fake_env, monkeypatch) -> None:
    env = fake_env("cuda")
    monkeypatch.setattr(_host_register, "CHUNK_BYTES", PAGE)
    monkeypatch.setattr(_host_register, "available_host_bytes", lambda: 7 << 30)
    env.cudart.fail_on_register_call = 3
    with pytest.raises(HostAllocationError) as caught:
        hisparse.get_backend().alloc_host(5 * PAGE)
    message = str(caught.value)
    assert f"error {CUDA_ERROR_MEMORY_ALLOCATION} (out of memory)" in message
    assert f"{5 * PAGE} B" in message and "7.00 GiB" in message
    assert env.cudart.registered == {}
    assert len(env.cudart.unregister_calls) == 2


def test_everything_still_registered_is_released_at_exit(fake_env) -> None:
    env = fake_env("cuda")
    backend = hisparse.get_backend()
    buffers = [backend.alloc_host(PAGE + 1) for _ in range(3)]
    existing = torch.empty(100, dtype=torch.uint8)
    backend.register_host(existing)
    assert len(env.cudart.registered) == 4
    backend.host_registry.release_all()  # what atexit runs
    assert env.cudart.registered == {}
    assert sorted(env.cudart.unregister_calls) == sorted(
        [b.data_ptr() for b in buffers] + [existing.data_ptr()]
    )


def test_existing_memory_is_registered_as_it_is(fake_env, rng) -> None:
    env = fake_env("cuda")
    backend = hisparse.get_backend()
    tensor = torch.empty(int(torch.randint(1, 4096, (1,), generator=rng)), dtype=torch.float32)
    backend.register_host(tensor)
    assert env.cudart.registered == {tensor.data_ptr(): (tensor.numel() * 4, REGISTER_FLAGS)}
    with pytest.raises(HostAllocationError, match="already registered"):
        backend.register_host(tensor)
    with pytest.raises(HostAllocationError, match="from alloc_host"):
        backend.free_host(tensor)  # registered, not allocated: the wrong release
    backend.unregister_host(tensor)
    assert env.cudart.registered == {}
    with pytest.raises(HostAllocationError, match="non-contiguous"):
        backend.register_host(torch.empty(8, 8).t())


def test_rocm_device_addresses_come_from_hip(fake_env, monkeypatch, rng) -> None:
    env = fake_env("rocm")
    monkeypatch.setattr(_host_register, "CHUNK_BYTES", 2 * PAGE)
    backend = hisparse.get_backend()
    buffer = backend.alloc_host(5 * PAGE)
    offset = 2 * PAGE + int(torch.randint(0, 2 * PAGE, (1,), generator=rng))
    view = buffer[offset:]
    assert backend.device_address(view) == view.data_ptr() + HIP_DEVICE_OFFSET
    assert env.hip.calls == [buffer.data_ptr() + 2 * PAGE]  # asked for the chunk's base
    backend.device_address(view)
    assert len(env.hip.calls) == 1  # cached per chunk
    with pytest.raises(HostAllocationError, match="not in any buffer"):
        backend.device_address(torch.empty(10, dtype=torch.uint8))
    backend.free_host(buffer)


def test_cuda_device_address_is_the_host_address(fake_env) -> None:
    fake_env("cuda")
    backend = hisparse.get_backend()
    buffer = backend.alloc_host(PAGE)
    assert backend.device_address(buffer) == buffer.data_ptr()  # UVA
    backend.free_host(buffer)


def test_the_host_waits_for_an_event_through_the_backend(fake_env) -> None:
    """The engine's one host-side wait (before the CPU rewrites host rows a step's kernels may
    still read) is the backend's: an accelerator synchronizes the event; on the CPU, whose
    events are None, there is nothing to wait for."""

    class Event:
        waits = 0

        def synchronize(self) -> None:
            self.waits += 1

    event = Event()
    fake_env("cuda")
    hisparse.get_backend().synchronize_event(event)
    assert event.waits == 1
    hisparse.get_backend("cpu").synchronize_event(None)


# --- host memory: XPU and CPU ---------------------------------------------------------------
def test_xpu_pools_are_usm_host_memory(fake_env, rng) -> None:
    env = fake_env("xpu")
    backend = hisparse.get_backend()
    num_bytes = int(torch.randint(1, 1 << 16, (1,), generator=rng))
    buffer = backend.alloc_host(num_bytes)
    assert env.pinned_allocations == [num_bytes]
    assert env.cudart.register_calls == 0
    backend.free_host(buffer)
    with pytest.raises(HostAllocationError, match="freed once"):
        backend.free_host(buffer)


def test_xpu_null_pointer_is_a_clear_error(fake_env) -> None:
    env = fake_env("xpu")
    env.usm_returns_null = True
    with pytest.raises(HostAllocationError, match=r"null pointer for 12345 B"):
        hisparse.get_backend().alloc_host(12345)


@pytest.mark.parametrize("kind", ["none", "cuda", "xpu"])
def test_asking_for_more_than_the_host_has_names_both_sizes(fake_env, monkeypatch, kind) -> None:
    env = fake_env(kind)
    monkeypatch.setattr(_host_register, "available_host_bytes", lambda: 3 << 20)
    with pytest.raises(HostAllocationError) as caught:
        hisparse.get_backend().alloc_host(5 << 20)
    assert "5242880 B" in str(caught.value) and "3145728 B" in str(caught.value)
    assert env.cudart.registered == {} and env.pinned_allocations == []


@pytest.mark.parametrize("size", [0, -1, 2.5, True, "8"])
def test_nonsense_sizes_are_refused(size) -> None:
    with pytest.raises(HostAllocationError, match="positive int"):
        CpuBackend().alloc_host(size)


def test_available_host_bytes_reads_the_machine() -> None:
    available = _host_register.available_host_bytes()
    assert available is None or available > 0


def test_every_backend_allocates_memory_its_device_reads(backend: Backend, rng) -> None:
    num_bytes = int(torch.randint(1, 1 << 16, (1,), generator=rng))
    data = random_bytes((num_bytes,), rng)
    buffer = backend.alloc_host(num_bytes)
    buffer.copy_(data)
    on_device = buffer.to(backend.device())
    backend.synchronize()
    assert torch.equal(on_device.cpu(), data)
    backend.free_host(buffer)


# --- kernels --------------------------------------------------------------------------------
def test_cpu_binds_the_torch_reference() -> None:
    kernels = CpuBackend().kernels
    assert kernels.swap_in is swap_in_reference.swap_in_reference
    assert kernels.copy_planned is swap_in_reference.copy_planned_reference
    assert kernels.backup_launcher() is backup_reference.backup_newest_reference


@needs_module("triton", "triton")
def test_gpu_backends_bind_the_triton_kernels(fake_env) -> None:
    from hisparse.kernels import backup_triton as backup_kernels
    from hisparse.kernels.swap_in import launch as triton_kernels

    fake_env("cuda")
    kernels = hisparse.get_backend().kernels
    assert kernels.swap_in is triton_kernels.swap_in_triton
    assert kernels.copy_planned is triton_kernels.copy_planned_triton
    assert isinstance(kernels.backup_launcher(), backup_kernels.BackupLauncher)


@needs_module("triton", "triton")
def test_the_newest_writer_is_triton_only_with_direct_launches(fake_env, monkeypatch) -> None:
    """Through triton's dispatch a launch costs more than the `index_copy_` it replaces."""
    from hisparse.kernels.newest_reference import NewestWriterReference
    from hisparse.kernels.newest_triton import NewestWriterTriton

    fake_env("cuda")
    backend = hisparse.get_backend()
    device_kv = torch.zeros(2, 9, 16, dtype=torch.uint8)
    rows = torch.zeros(4, dtype=torch.int32)
    assert isinstance(backend.kernels.newest_writer(device_kv, rows, rows.long()),
                      NewestWriterTriton)
    monkeypatch.setenv("HISPARSE_DIRECT_LAUNCH", "0")
    assert isinstance(backend.kernels.newest_writer(device_kv, rows, rows.long()),
                      NewestWriterReference)
    assert isinstance(CpuBackend().kernels.newest_writer(device_kv, rows, rows.long()),
                      NewestWriterReference)


def test_without_triton_gpu_backends_fall_back_and_say_so_once(
    fake_env, monkeypatch, caplog
) -> None:
    fake_env("cuda")

    def no_triton(module_name: str) -> None:
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(_accelerator, "_import_triton_kernels", no_triton)
    monkeypatch.setattr(_accelerator, "_warned_no_triton", False)
    backend = hisparse.get_backend()
    with caplog.at_level(logging.WARNING, logger="hisparse.backends"):
        kernels = backend.kernels
        assert kernels.swap_in is swap_in_reference.swap_in_reference
        assert kernels.copy_planned is swap_in_reference.copy_planned_reference
        assert kernels.backup_launcher() is backup_reference.backup_newest_reference
    assert [r.message.count("pip install 'hisparse[triton]'") for r in caplog.records] == [1]


def test_a_missing_kernels_module_is_not_mistaken_for_missing_triton(
    fake_env, monkeypatch
) -> None:
    fake_env("cuda")

    def broken(module_name: str) -> None:
        name = _accelerator.TRITON_KERNELS
        raise ModuleNotFoundError(f"No module named '{name}'", name=name)

    monkeypatch.setattr(_accelerator, "_import_triton_kernels", broken)
    with pytest.raises(ModuleNotFoundError, match=r"swap_in\.launch"):
        _ = hisparse.get_backend().kernels


@pytest.mark.parametrize(("kind", "warp", "pdl"), [("cuda", 32, True), ("rocm", 64, False),
                                                 ("xpu", 32, False)])
def test_devices_are_described_as_the_runtime_reports_them(fake_env, monkeypatch, kind, warp,
                                                           pdl) -> None:
    """`describe` reads the device's properties once; PDL only where the table has it (the
    fake reports sm_90 on CUDA and ROCm alike); the names list every visible device."""
    from hisparse.kernels.swap_in import pdl as pdl_module

    monkeypatch.setattr(pdl_module, "triton_launches_dependents", lambda: True)
    fake_env(kind, gpus=2)
    backend = hisparse.get_backend()
    units = 20 if kind == "xpu" else 132
    assert backend.describe(1) == DeviceInfo(f"Fake {kind} GPU 1", units, warp, pdl)
    assert device_names(backend) == [f"Fake {kind} GPU 0", f"Fake {kind} GPU 1"]
    traits = backend.kernel_traits(torch.device(backend.torch_device_type, 1))
    assert (traits.compute_units, traits.warp_size, traits.pdl) == (units, warp, pdl)
    assert device_names(CpuBackend()) == []


def test_shared_mappings_are_registered_only_where_the_device_needs_it(fake_env) -> None:
    env = fake_env("cuda")
    mapping = torch.empty(PAGE, dtype=torch.uint8)
    backend = hisparse.get_backend()
    backend.register_host(mapping, shared=True)
    assert env.cudart.registered == {mapping.data_ptr(): (PAGE, REGISTER_FLAGS)}
    backend.unregister_host(mapping, shared=True)
    assert env.cudart.registered == {}
    cpu = CpuBackend()  # the CPU reads host memory as it is: nothing to do, nothing raised
    cpu.register_host(mapping, shared=True)
    cpu.unregister_host(mapping, shared=True)


# --- structure ------------------------------------------------------------------------------
# Issue 37's target for the contract: a backend is a small surface (tinygrad's allocator has
# about 8 methods, PyTorch's device interface 19); its kernels are one record, its features data.
MAX_BACKEND_MEMBERS = 24


def test_the_backend_contract_stays_narrow() -> None:
    members = [name for name, value in inspect.getmembers(Backend)
               if not name.startswith("__")
               and (inspect.isfunction(value) or isinstance(value, property))]
    assert len(members) <= MAX_BACKEND_MEMBERS, sorted(members)
    assert {f.name for f in dataclasses.fields(KernelSet)} == {
        "swap_in", "copy_planned", "backup_launcher", "swap_in_launcher", "union_launcher",
        "newest_writer", "batch_advance", "implementation"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        CpuBackend().kernels.swap_in = None  # type: ignore[misc]


@pytest.mark.parametrize("path", sorted((SRC / "backends").glob("*.py")), ids=lambda p: p.name)
def test_backend_modules_stay_small(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 250


# What core and kernel code must not ask: which GPU it runs on. It asks for features instead.
# (Whether a tensor sits in host memory, `.device.type == "cpu"`, is a fact, not a device policy.)
DEVICE_NAME_CHECKS = re.compile(
    r"is_cuda|is_xpu|torch\.cuda\.|torch\.xpu\.|torch\.version\.(hip|cuda|xpu)"
    r"|[\"'](cuda|rocm|hip|xpu)[\"']|\.name\s*==\s*[\"']"
)
# The table of GPU targets the kernels are compiled for (CI, the probe): naming vendors is
# its whole job, and no launch code reads it.
NAMES_DEVICES_BY_DESIGN = {"kernels/targets.py"}


@pytest.mark.parametrize(
    "package",
    [
        "core",
        "kernels",
    ],
)
def test_core_and_kernels_ask_for_capabilities_not_device_names(package: str) -> None:
    offenders = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted((SRC / package).rglob("*.py"))
        if str(path.relative_to(SRC)) not in NAMES_DEVICES_BY_DESIGN
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if DEVICE_NAME_CHECKS.search(line.split("#", 1)[0])
    ]
    assert offenders == [], ("ask backend.features.supports(Feature.X) instead:\n"
                             + "\n".join(offenders))


def test_an_address_someone_left_registered_is_skipped_not_reused(fake_env) -> None:
    env = fake_env("cuda")
    backend = hisparse.get_backend()
    real_register = env.cudart.cudaHostRegister
    refused: list[int] = []

    def left_registered_once(base: int, size: int, flags: int) -> int:
        if not refused:  # the first mapping lands where a foreign registration lingers
            refused.append(base)
            return 712
        return real_register(base, size, flags)

    env.cudart.cudaHostRegister = left_registered_once
    buffer = backend.alloc_host(PAGE + 1)
    assert buffer.data_ptr() != refused[0]  # the refused mapping stays out of circulation
    assert list(env.cudart.registered) == [buffer.data_ptr()]
    backend.free_host(buffer)

    env.cudart.cudaHostRegister = lambda base, size, flags: 712
    with pytest.raises(HostAllocationError, match="still registered"):
        backend.alloc_host(PAGE)
    assert env.cudart.registered == {}


def test_fake_environments_never_touch_the_real_registries(fake_env) -> None:
    from hisparse.backends import cuda, rocm

    fake_env("cuda")
    # On a GPU machine the real registries hold real registrations of other tests; a fake
    # runtime releasing them would leave them registered while their memory goes away.
    assert cuda.CudaBackend.host_registry is not cuda._registry
    assert rocm.RocmBackend.host_registry is not rocm._registry


class _FakeAccelerator:
    """torch.accelerator's stream calls over two devices, with streams as (device, name)."""

    def __init__(self) -> None:
        self.device = 0
        self.current = {0: _FakeStream(0, "default"), 1: _FakeStream(1, "default")}

    def current_device_index(self) -> int:
        return self.device

    def set_device_index(self, index: int) -> None:
        self.device = index

    def current_stream(self, index: int | None = None) -> _FakeStream:
        return self.current[self.device if index is None else index]

    def set_stream(self, stream: _FakeStream) -> None:  # torch's: the stream's device too
        self.device = stream.device_index
        self.current[stream.device_index] = stream


@dataclasses.dataclass(frozen=True)
class _FakeStream:
    device_index: int
    name: str


class _FakeEvent:
    """torch.Event's record and wait: without a stream, the current device's current one."""

    def __init__(self, accelerator: _FakeAccelerator) -> None:
        self.accelerator = accelerator
        self.calls: list[tuple[str, _FakeStream]] = []

    def record(self, stream: _FakeStream | None = None) -> None:
        self.calls.append(("record", stream or self.accelerator.current_stream()))

    def wait(self, stream: _FakeStream | None = None) -> None:
        self.calls.append(("wait", stream or self.accelerator.current_stream()))


@pytest.mark.parametrize("raises", [False, True])
def test_a_stream_scope_restores_the_stream_and_the_device_it_found(
        monkeypatch: pytest.MonkeyPatch, raises: bool) -> None:
    """Inside the scope the side stream is its device's current one (and that device the
    current device, as under torch.cuda.stream); after it, even after an error, both
    devices' streams and the current device are what they were."""
    fake = _FakeAccelerator()
    for name in ("current_device_index", "set_device_index", "current_stream", "set_stream"):
        monkeypatch.setattr(torch.accelerator, name, getattr(fake, name))
    # torch.accelerator drives cuda here: events on the current device are recorded without a
    # stream (torch looks it up), on another device with that device's current stream.
    monkeypatch.setattr(_accelerator, "_accelerator_type", lambda: "cuda")
    backend = registry.find_backend("cuda")
    side = _FakeStream(1, "side")
    before = dict(fake.current)
    with contextlib.suppress(RuntimeError), backend.stream_scope(side):
        assert fake.current_stream(1) is side and fake.device == 1
        event = _FakeEvent(fake)
        backend.record_event(event, torch.device("cuda", 1))
        backend.wait_event(event)  # no device: the current one's stream
        assert event.calls == [("record", side), ("wait", side)]
        if raises:
            raise RuntimeError("a launch failed inside the scope")
    assert fake.current == before and fake.device == 0
    event = _FakeEvent(fake)
    backend.record_event(event, torch.device("cuda", 1))  # not the current device
    backend.record_event(event, torch.device("cuda", 0))
    assert event.calls == [("record", before[1]), ("record", before[0])]


def test_the_current_device_is_read_from_torch_accelerator_where_it_drives_that_type(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`begin_decode_step` checks the current device once a step: the backend reads its index
    from torch.accelerator (a C++ call) when that drives the backend's device type, and the
    device module otherwise; either way the index is the current one, not a cached one."""
    fake = _FakeAccelerator()
    monkeypatch.setattr(torch.accelerator, "current_device_index", fake.current_device_index)
    monkeypatch.setattr(_accelerator, "_accelerator_type", lambda: "cuda")
    backend = registry.find_backend("cuda")
    assert backend.current_device() == torch.device("cuda", 0)
    fake.set_device_index(1)
    assert backend.current_device() == torch.device("cuda", 1)
    assert backend.current_device() is backend.current_device()
    monkeypatch.setattr(_accelerator, "_accelerator_type", lambda: "xpu")  # not the backend's
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert backend.current_device() == torch.device("cuda", 3)
