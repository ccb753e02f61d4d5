"""The capability probe: what this machine has, what each feature does here, and proof.

`probe()` returns a JSON-ready dict (schema below); `format_report()` renders it as a table.
The checks run real work: a host buffer allocated (and registered) through the backend and
read back from the device, and a swap-in round trip through `HiSparseCache` on the `tiny`
preset whose returned rows are compared byte for byte with what was written.

`kernel_targets` says, per GPU target the Triton kernels are built for (`kernels/targets.py`),
what is proven here: "ran on hardware here" (the swap-in check ran the Triton kernels on a
device of that target), "compiled here, not run" (built for it in a child process, no such
device here) or "not compiled", with the reason. By default the compile is quick: the launches
of the tiny preset the swap-in check uses (a few seconds, once per process; Triton caches the
builds on disk). `kernel_targets="all"` builds every variant the test suite checks (about a
minute), "off" none.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import platform
import subprocess
import sys
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

import hisparse
from hisparse.backends.base import Backend, device_names
from hisparse.backends.features import Feature
from hisparse.backends.registry import (
    available_backends,
    device_index,
    find_backend,
    get_backend,
)
from hisparse.errors import BackendUnavailableError
from hisparse.kernels.swap_in import reference as swap_in_reference

if TYPE_CHECKING:
    from hisparse.config import HiSparseConfig

# Bump when a key is removed or changes meaning; adding keys keeps the version.
SCHEMA_VERSION = 1
HOST_CHECK_BYTES = 1 << 20
IPEX_MODULE = "intel_extension_for_pytorch"
KERNEL_TARGET_SCOPES = ("quick", "all", "off")
RAN, COMPILED, NOT_COMPILED = "ran on hardware here", "compiled here, not run", "not compiled"
COMPILE_TIMEOUT_S = {"quick": 300, "all": 1800}


def probe(device: str | torch.device | Backend | None = None, run_checks: bool = True,
          config: HiSparseConfig | None = None, kernel_targets: str | None = None) -> dict:
    """Detect the backend (or take `device`), describe it, and prove it works.

    Args:
        device: None for the backend `get_backend()` picks, or a name / device string /
            `torch.device` / Backend to probe that one.
        run_checks: False skips the checks (fast; `checks` is then empty).
        config: the `HiSparseConfig` the swap-in round trip builds its cache with (its full
            host pool and device buffers); None: the `tiny` preset.
        kernel_targets: "quick", "all" or "off": which Triton builds to compile for the GPU
            targets (module docstring); default "quick" with the checks, "off" without.

    Returns:
        A dict with `schema_version`, `backend`, `usable`, `reason`, `devices`, `versions`,
        `features` (name -> {status, reason, instead}), `verified_on_hardware`, `notes`,
        `checks` (list of {name, status: passed|failed|skipped, detail, seconds}) and
        `kernel_targets` (list of {target, backend, hardware, triton, status, reason,
        builds}); `ok` is True when the backend is usable and no check failed (a target the
        kernels do not compile for is reported, not a failure of this machine).

    Example:
        >>> report = hisparse.probe()
        >>> report["backend"], report["ok"]
        ('cpu', True)
    """
    report = _empty_report(device)
    builds = kernel_targets or ("quick" if run_checks else "off")
    if builds not in KERNEL_TARGET_SCOPES:
        raise ValueError(f"kernel_targets must be one of {', '.join(KERNEL_TARGET_SCOPES)}, "
                         f"not {kernel_targets!r}")
    _start_compile(builds)
    try:
        backend = get_backend() if device is None else find_backend(device)
    except BackendUnavailableError as exc:
        report["reason"] = str(exc)
        report["kernel_targets"] = _kernel_targets(builds, None)
        return report
    index = _describe_backend(report, backend, device)
    if not report["usable"]:
        report["kernel_targets"] = _kernel_targets(builds, None)
        return report
    report["versions"] = _versions(backend)
    report["devices"] = [{"index": i, "name": n} for i, n in enumerate(device_names(backend))]
    if run_checks:
        report["checks"] = _run_checks(backend, index, config)
    report["kernel_targets"] = _kernel_targets(builds, _ran_here(backend, report["checks"]))
    failed = [c for c in report["checks"] if c["status"] == "failed"]
    report["ok"] = not failed
    if failed:  # the first failure's own words are the cause: they lead the report
        report["reason"] = f"check {failed[0]['name']}: {failed[0]['detail']}" + (
            f" (also failed: {', '.join(c['name'] for c in failed[1:])})"
            if len(failed) > 1 else "")
    return report


def _empty_report(device: str | torch.device | Backend | None) -> dict[str, Any]:
    """The report of a backend not (yet) found: every key, nothing usable."""
    return {
        "schema_version": SCHEMA_VERSION,
        "hisparse_version": hisparse.__version__,
        "requested": None if device is None else str(device),
        "backend": None,
        "usable": False,
        "reason": None,
        "available_backends": available_backends(),
        "devices": [],
        "versions": _versions(None),
        "features": {},
        "verified_on_hardware": None,
        "notes": [],
        "checks": [],
        "kernel_targets": [],
        "ok": False,
    }


def _describe_backend(report: dict[str, Any], backend: Backend,
                      device: str | torch.device | Backend | None) -> int | None:
    """Fill in the backend's name, features, notes, reason and `usable`; the device index
    the checks run on (None: the backend's default)."""
    report["backend"] = backend.name
    report["features"] = backend.features.to_dict()
    report["verified_on_hardware"] = backend.verified_on_hardware
    if not backend.verified_on_hardware:
        report["notes"].append(
            f"the {backend.name} backend has not yet been verified on hardware: its feature "
            "table and kernels follow the design but have not run on such a device"
        )
    report["reason"] = backend.unavailable_reason()
    index: int | None = None
    if report["reason"] is None:
        try:  # "cuda:5" on a 2-GPU host is not usable, and "cuda:1" must not check device 0
            index = device_index(backend, device)
        except BackendUnavailableError as exc:
            report["reason"] = str(exc)
    report["usable"] = report["reason"] is None
    return index


def _run_checks(backend: Backend, index: int | None,
                config: HiSparseConfig | None) -> list[dict[str, Any]]:
    """The checks, with the requested device current while they run on `backend.device()`."""
    scope = (contextlib.nullcontext() if index is None
             else backend.device_scope(backend.device(index)))
    checks = []
    with scope:
        for name, check in (
            ("host_buffer", _check_host_buffer),
            ("register_host", _check_register_host),
            ("shared_host_pool", _check_shared_host_pool),
            ("swap_in_roundtrip", lambda b: _check_swap_in(b, config)),
        ):
            checks.append(_run_check(name, check, backend))
    return checks


def format_report(report: dict) -> str:
    """The human-readable table `hisparse probe` prints."""
    state = ("NOT usable" if not report["usable"]
             else "check FAILED" if not report["ok"] and report["checks"] else "usable")
    backend = report["backend"] or "unresolved"  # an unknown name resolves to no backend
    lines = [f"hisparse {report['hisparse_version']} probe: backend {backend} ({state})"]
    if report["reason"]:
        lines.append(f"  reason: {report['reason']}")
    lines.append(f"  usable backends here: {', '.join(report['available_backends'])}")
    for entry in report["devices"]:
        lines.append(f"  device {entry['index']}: {entry['name']}")
    versions = ", ".join(
        f"{k} {v}" for k, v in report["versions"].items() if k != "ipex" and v is not None
    )
    lines.append(f"  versions: {versions}")
    ipex = report["versions"]["ipex"]
    lines.append(f"  ipex: {'loads' if ipex['loads'] else 'not used'} ({ipex['reason']})")
    lines.extend(f"  note: {note}" for note in report["notes"])
    if report["features"] and not report["usable"]:
        lines.append("  features: not shown; the backend is not usable here")
    elif report["features"]:
        width = max(len(name) for name in report["features"])
        lines.append("")
        lines.append(f"  {'feature':<{width}}  {'status':<11}  why / instead")
        for name, entry in report["features"].items():
            why = entry["reason"]
            if entry["instead"]:
                why += f"; instead: {entry['instead']}"
            lines.append(f"  {name:<{width}}  {entry['status']:<11}  {why}")
    if report["checks"]:
        width = max(len(check["name"]) for check in report["checks"])
        lines.append("")
        lines.append(f"  {'check':<{width}}  {'result':<7}  detail")
        for check in report["checks"]:
            lines.append(
                f"  {check['name']:<{width}}  {check['status']:<7}  {check['detail']} "
                f"({check['seconds']:.3f} s)"
            )
    if report.get("kernel_targets"):
        lines.append("")
        lines.append("  kernel targets (Triton builds of the kernels, per backend):")
        by_backend: dict[str, list[str]] = {}
        for entry in report["kernel_targets"]:
            status = entry["status"]
            if status == NOT_COMPILED:
                status += f": {entry['reason']}"
            elif status == COMPILED:
                status += f" ({entry['builds']} builds)"
            by_backend.setdefault(entry["backend"], []).append(f"{entry['target']} {status}")
        for name, parts in by_backend.items():
            lines.append(f"  {name}: {'; '.join(parts)}")
    return "\n".join(line.rstrip() for line in lines)


# --- kernel targets -------------------------------------------------------------------------
def _ran_here(backend: Backend, checks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The target whose device just ran the Triton kernels in the swap-in check, if any."""
    passed = any(c["name"] == "swap_in_roundtrip" and c["status"] == "passed" for c in checks)
    if not passed or backend.device().type == "cpu" or (
            backend.kernels.swap_in.__module__ == swap_in_reference.__name__):
        return None
    try:
        import triton

        from hisparse.kernels.targets import target_name

        current = triton.runtime.driver.active.get_current_target()
        device = backend.device()
        name = backend.describe(device.index or 0).name
    except Exception:  # a device the kernels ran on but triton cannot name: claim nothing
        return None
    return {"target": target_name(current.backend, current.arch), "backend": backend.name,
            "triton": triton.__version__, "device": f"{device} ({name})"}


_compile_jobs: dict[str, Any] = {}  # scope -> the running CompileJob, then its report


def _start_compile(scope: str) -> None:
    """Start the child process that compiles (once per process and scope), so that it runs
    while the checks do."""
    if scope == "off" or scope in _compile_jobs or _package_version("triton") is None:
        return
    from hisparse.kernels import targets

    try:
        _compile_jobs[scope] = targets.CompileJob(quick=scope == "quick")
    except OSError as exc:
        _compile_jobs[scope] = {"error": f"could not start the compile: {exc}", "targets": []}


def _compiled(scope: str) -> dict[str, Any]:
    _start_compile(scope)
    job = _compile_jobs[scope]
    if isinstance(job, dict):
        return job
    try:
        report = job.result(timeout=COMPILE_TIMEOUT_S[scope])
    except subprocess.TimeoutExpired:
        report = {"error": f"the compile did not finish in {COMPILE_TIMEOUT_S[scope]} s",
                  "targets": []}
    except Exception as exc:
        report = {"error": f"{type(exc).__name__}: {exc}", "targets": []}
    _compile_jobs[scope] = report
    return report


def _kernel_targets(scope: str, ran: dict[str, Any] | None) -> list[dict[str, Any]]:
    from hisparse.kernels.targets import TARGETS

    triton_version = _package_version("triton")
    report: dict[str, Any] = {"targets": []}
    if triton_version is None:
        report["error"] = "triton is not installed (pip install 'hisparse[triton]')"
    elif scope == "off":
        report["error"] = "not asked for (kernel_targets off, or --no-checks)"
    else:
        report = _compiled(scope)
    compiled = {entry["target"]: entry for entry in report["targets"]}
    names = [t.name for t in TARGETS]
    if ran is not None and ran["target"] not in names:
        names.append(ran["target"])
    entries = []
    for name in names:
        spec = next((t for t in TARGETS if t.name == name), None)
        entry: dict[str, Any] = {
            "target": name, "backend": spec.hisparse_backend if spec else ran["backend"],
            "hardware": spec.hardware if spec else ran["device"],
            "triton": report.get("triton", triton_version), "status": NOT_COMPILED,
            "reason": report.get("error"), "builds": 0,
        }
        built = compiled.get(name)
        if built is not None:
            entry["builds"] = len(built["variants"])
            if built["compiled"]:
                entry["status"], entry["reason"] = COMPILED, _build_summary(built, scope)
            else:
                entry["reason"] = built["reason"]
        if ran is not None and ran["target"] == name:
            entry.update(status=RAN, triton=ran["triton"], reason=(
                f"the swap_in_roundtrip check ran the Triton swap-in kernels on {ran['device']}"
                " and read its rows back byte-equal"))
        entries.append(entry)
    return entries


def _build_summary(built: dict[str, Any], scope: str) -> str:
    kernels = sorted({v["kernel"] for v in built["variants"]})
    what = "the tiny preset's launches" if scope == "quick" else "every checked variant"
    summary = f"{len(built['variants'])} builds ({what}: {', '.join(kernels)})"
    flagged = [v for v in built["variants"] if v["problems"]]
    if flagged:
        summary += "; over the target's limits: " + "; ".join(
            f"{v['kernel']} ({v['variant']}): {v['problems'][0]}" for v in flagged)
    return summary


# --- versions -------------------------------------------------------------------------------
def _versions(backend: Backend | None) -> dict[str, Any]:
    versions: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _package_version("triton"),
    }
    if backend is not None:
        versions.update(backend.runtime_versions())
    versions["ipex"] = _ipex_status()
    return versions


def _package_version(name: str) -> str | None:
    try:
        return importlib.import_module(name).__version__
    except Exception:  # missing or broken: either way it is not usable
        return None


def _ipex_status() -> dict[str, Any]:
    """Whether intel-extension-for-pytorch loads. It is retired and not a dependency: XPU runs
    on stock torch.xpu. It is imported in a child process because a mismatched IPEX can abort
    the interpreter that imports it."""
    if importlib.util.find_spec(IPEX_MODULE) is None:
        return {"loads": False, "version": None,
                "reason": "not installed (retired; not needed: XPU uses stock torch.xpu)"}
    code = f"import {IPEX_MODULE} as m; print(m.__version__)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"loads": False, "version": None, "reason": f"import did not finish: {exc}"}
    if done.returncode == 0:
        return {"loads": True, "version": done.stdout.strip(),
                "reason": "installed and importable; hisparse does not use it"}
    last = (done.stderr.strip().splitlines() or ["no error text"])[-1]
    return {"loads": False, "version": None, "reason": f"installed but fails to import: {last}"}


# --- checks ---------------------------------------------------------------------------------
class _Skip(Exception):
    """A check that does not apply here; the message says why."""


def _run_check(name: str, check: Callable[[Backend], str], backend: Backend) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        status, detail = "passed", check(backend)
    except _Skip as skip:
        status, detail = "skipped", str(skip)
    except Exception as exc:  # a probe reports every failure instead of dying on the first
        status, detail = "failed", f"{type(exc).__name__}: {exc}"
    return {"name": name, "status": status, "detail": detail,
            "seconds": round(time.perf_counter() - start, 6)}


def _random_bytes(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


def _read_back(backend: Backend, host: torch.Tensor) -> torch.Tensor:
    """Copy `host` to the device and back, so the bytes really crossed the link."""
    on_device = host.to(backend.device(), non_blocking=True)
    backend.synchronize()
    return on_device.cpu()


def _check_host_buffer(backend: Backend) -> str:
    expected = _random_bytes((HOST_CHECK_BYTES,), _generator())
    buffer = backend.alloc_host(HOST_CHECK_BYTES)
    try:
        buffer.copy_(expected)
        if not torch.equal(_read_back(backend, buffer), expected):
            raise AssertionError("bytes read from the device differ from those written")
        pinned = ""
        if backend.features.supports(Feature.REGISTER_HOST_MEMORY):
            pinned = f", is_pinned={buffer.is_pinned()}"
            if not buffer.is_pinned():
                raise AssertionError("alloc_host returned memory the runtime sees as unpinned")
    finally:
        backend.free_host(buffer)
    return (f"alloc_host({HOST_CHECK_BYTES}) -> read back from {backend.device()} "
            f"byte-equal{pinned}; freed")


def _check_register_host(backend: Backend) -> str:
    support = backend.features[Feature.REGISTER_HOST_MEMORY]
    if not support.usable:
        raise _Skip(f"register_host_memory is {support.status} here: {support.reason}")
    expected = _random_bytes((HOST_CHECK_BYTES,), _generator())
    buffer = expected.clone()
    backend.register_host(buffer)
    try:
        if not buffer.is_pinned():
            raise AssertionError("register_host left the memory unpinned")
        if not torch.equal(_read_back(backend, buffer), expected):
            raise AssertionError("bytes read from the device differ from those written")
    finally:
        backend.unregister_host(buffer)
    return f"register_host of {HOST_CHECK_BYTES} bytes, read back byte-equal; unregistered"


def _check_shared_host_pool(backend: Backend) -> str:
    """Two mappings of one shared segment, as a writer rank and a reader rank hold them: each
    registered for the device; bytes written through the first, read back on the device
    through the second."""
    from hisparse.core.shared_segment import SegmentLayout, SharedSegment, segment_path

    support = backend.features[Feature.SHARED_HOST_POOL]
    if not support.usable:
        raise _Skip(f"shared_host_pool is {support.status} here: {support.reason}")
    name = f"probe-{os.getpid()}-{int.from_bytes(os.urandom(4), 'little')}"
    layout = SegmentLayout(1, HOST_CHECK_BYTES // 64, 64, 16, 2, 0)
    writer = SharedSegment.create(name, layout, 0)
    reader = None
    try:
        reader = SharedSegment.attach(name, layout, 1, timeout_s=5.0)
        for segment in (writer, reader):
            backend.register_host(segment.mapping, shared=True)
        try:
            expected = _random_bytes((layout.num_rows, 64), _generator())
            writer.layers[0].copy_(expected)
            if (backend.features.supports(Feature.REGISTER_HOST_MEMORY)
                    and not reader.layers[0].is_pinned()):
                raise AssertionError("the second mapping is not registered (is_pinned False)")
            if not torch.equal(_read_back(backend, reader.layers[0]), expected):
                raise AssertionError("bytes read through the second mapping differ")
        finally:
            for segment in (writer, reader):
                backend.unregister_host(segment.mapping, shared=True)
    finally:
        for segment in (reader, writer):
            if segment is not None:
                segment.close()
    if os.path.exists(segment_path(name)):
        raise AssertionError(f"{segment_path(name)} was left behind after both closed")
    return (f"two mappings of one {layout.total_bytes}-byte /dev/shm segment registered; "
            "bytes written through one read back on the device through the other; unlinked")


def _check_swap_in(backend: Backend, config: HiSparseConfig | None = None) -> str:
    try:
        from hisparse.config import HiSparseConfig
        from hisparse.core.engine import HiSparseCache
    except ImportError as exc:
        raise _Skip(f"the cache engine does not import here ({exc})") from exc
    name = "tiny preset" if config is None else f"config {config.model}"
    config = HiSparseConfig.from_preset("tiny") if config is None else config
    generator = _generator()
    num_layers, row_bytes, top_k = config.num_layers, config.row_bytes, config.top_k
    # Past the hot buffer (the long regime, with misses), as far as max_seq_len allows.
    prompt = min(2 * config.hot_slots + 5, config.max_seq_len - 1)
    prefill = _random_bytes((num_layers, prompt, row_bytes), generator)
    newest = _random_bytes((num_layers, 1, row_bytes), generator)
    every_row = torch.cat([prefill, newest], dim=1)
    positions = torch.randperm(prompt + 1, generator=generator)[:top_k]
    with contextlib.ExitStack() as stack:
        cache = HiSparseCache(config, device=backend)
        stack.callback(cache.close)
        device = cache.device
        cache.admit("probe", prompt)
        cache.write_prefill("probe", prefill.to(device))
        cache.commit_prefill("probe")
        cache.begin_decode_step(["probe"])
        for layer in range(num_layers):
            cache.write_newest(layer, newest[layer].to(device))
        top = positions.to(device=device, dtype=torch.int32)[None]
        for layer in range(num_layers):
            rows = cache.swap_in(layer, top)[0].long()
            got = cache.device_kv(layer)[rows].cpu()
            if not torch.equal(got, every_row[layer, positions]):
                raise AssertionError(f"layer {layer}: swapped-in rows differ from the prefill")
        cache.end_decode_step()
        stats = cache.stats()
        cache.finish("probe")
    return (f"{name}, {num_layers} layers, {top_k} of {prompt + 1} tokens swapped in and "
            f"byte-equal on every layer (kernel {_kernel_name(backend)}; {_stats_line(stats)})")


def _kernel_name(backend: Backend) -> str:
    kernel = backend.kernels.swap_in
    return f"{kernel.__module__.rsplit('.', 1)[-1]}.{kernel.__name__}"


def _stats_line(stats: Any) -> str:
    hits, misses = getattr(stats, "hits", None), getattr(stats, "misses", None)
    if hits is None or misses is None:
        return "stats unavailable"
    return f"hits {int(hits)}, misses {int(misses)}"


class _CallableModule(types.ModuleType):
    """Lets `hisparse.tools.probe(...)` call the function although `hisparse.tools.probe` is
    this module (importing a submodule always rebinds the package attribute of the same
    name)."""

    def __call__(self, device: str | torch.device | Backend | None = None,
                 run_checks: bool = True, config: HiSparseConfig | None = None,
                 kernel_targets: str | None = None) -> dict:
        return probe(device, run_checks=run_checks, config=config,
                     kernel_targets=kernel_targets)


sys.modules[__name__].__class__ = _CallableModule
