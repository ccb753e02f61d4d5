"""`hisparse.probe()` and `hisparse probe`: a truthful report, a stable JSON schema, exit codes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import hisparse
from hisparse.backends import registry
from hisparse.backends.base import Backend, DeviceInfo
from hisparse.cli.main import main
from hisparse.kernels.targets import NEEDS_INTEL_BACKEND, TARGETS
from hisparse.tools import probe as probe_module
from hisparse.tools.probe import COMPILED, NOT_COMPILED, RAN, SCHEMA_VERSION, format_report, probe

TOP_LEVEL_KEYS = {
    "schema_version", "hisparse_version", "requested", "backend", "usable", "reason",
    "available_backends", "devices", "versions", "features", "verified_on_hardware", "notes",
    "checks", "kernel_targets", "ok",
}
CHECKS = ["host_buffer", "register_host", "shared_host_pool", "swap_in_roundtrip"]


def test_the_report_describes_the_backend_and_proves_it(backend: Backend) -> None:
    report = probe(backend.name)
    assert set(report) == TOP_LEVEL_KEYS
    assert report["schema_version"] == SCHEMA_VERSION == 1
    assert report["backend"] == backend.name and report["usable"] is True
    assert report["features"] == backend.features.to_dict()
    assert report["verified_on_hardware"] is backend.verified_on_hardware
    assert bool(report["notes"]) is not backend.verified_on_hardware
    assert {"python", "torch", "triton", "ipex"} <= set(report["versions"])
    assert [c["name"] for c in report["checks"]] == CHECKS
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["host_buffer"] == "passed", report["checks"]
    expected_register = "passed" if backend.features.supports("register_host_memory") else "skipped"
    assert statuses["register_host"] == expected_register, report["checks"]
    expected_shared = "passed" if backend.features.supports("shared_host_pool") else "skipped"
    assert statuses["shared_host_pool"] == expected_shared, report["checks"]
    # The engine imports on every backend: a skipped round trip would prove nothing.
    assert statuses["swap_in_roundtrip"] == "passed", report["checks"]
    assert report["ok"] is True and report["reason"] is None
    json.dumps(report)  # everything in it serializes


def test_the_swap_in_check_runs_once_the_engine_exists() -> None:
    pytest.importorskip("hisparse.core.engine")
    check = {c["name"]: c for c in probe("cpu")["checks"]}["swap_in_roundtrip"]
    assert check["status"] == "passed", check
    assert "byte-equal on every layer" in check["detail"]


def test_hisparse_probe_is_callable_as_a_function() -> None:
    report = hisparse.probe(run_checks=False)
    assert report["backend"] == registry.get_backend().name
    assert report["checks"] == [] and report["ok"] is True


def test_cli_json_is_the_same_document(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == TOP_LEVEL_KEYS and report["backend"] == "cpu"
    assert all(c["status"] != "failed" for c in report["checks"])


def test_cli_table_shows_every_feature_and_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for name, entry in registry.find_backend("cpu").features.to_dict().items():
        assert any(name in line and entry["status"] in line for line in out.splitlines()), name
    for check in CHECKS:
        assert check in out


def test_an_unusable_backend_exits_1_with_a_one_line_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    absent = [n for n in registry.registered_backends() if n not in registry.available_backends()]
    if not absent:
        pytest.skip("every registered backend is usable on this machine")
    name = absent[0]
    assert main(["probe", "--device", name]) == 1
    captured = capsys.readouterr()
    reason = registry.find_backend(name).unavailable_reason()
    assert captured.err.strip().splitlines() == [
        f"hisparse probe: backend {name} is not usable: {reason}"
    ]
    assert "NOT usable" in captured.out
    report = probe(name)
    assert (report["usable"], report["ok"], report["checks"]) == (False, False, [])
    assert report["features"]  # the table is data: shown even without the device


def test_an_unknown_device_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "--json", "--device", "tpu"]) == 1
    captured = capsys.readouterr()
    assert "Unknown backend 'tpu'" in captured.err
    assert json.loads(captured.out)["backend"] is None


def test_a_failing_check_makes_the_probe_fail(monkeypatch, capsys) -> None:
    def refuse(self, num_bytes: int):
        raise hisparse.HostAllocationError("host pool: no memory in this test")

    monkeypatch.setattr(type(registry.find_backend("cpu")), "alloc_host", refuse)
    report = probe("cpu")
    assert report["checks"][0]["status"] == "failed"
    assert "no memory in this test" in report["checks"][0]["detail"]
    assert report["ok"] is False and "host_buffer" in report["reason"]
    assert main(["probe", "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    cause = "check host_buffer: HostAllocationError: host pool: no memory in this test"
    [error] = captured.err.strip().splitlines()
    assert error.startswith(f"hisparse probe: backend cpu failed {cause}"), error
    headline, reason = captured.out.splitlines()[:2]
    assert headline.endswith("backend cpu (check FAILED)") and "usable" not in headline
    assert reason.startswith(f"  reason: {cause}"), reason


def test_a_config_whose_pool_does_not_fit_leads_with_the_cause(
    capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`probe --config empty.yaml`: the default host pool (39 GiB) does not fit a 24 GiB
    machine. The report used to say "(usable)" first and bury the cause in a detail line."""
    monkeypatch.setattr("hisparse.core.host_pool.available_host_bytes", lambda: 1 << 30)
    config = tmp_path / "empty.yaml"
    config.write_text("")
    assert main(["probe", "--config", str(config), "--kernel-targets", "off"]) == 1
    captured = capsys.readouterr()
    [error] = captured.err.strip().splitlines()
    assert error.startswith("hisparse probe: backend cpu failed check swap_in_roundtrip: "
                            "HostAllocationError: the host pool needs"), error
    assert "1073741824 B" in error and "(usable)" not in captured.out
    assert "the host pool needs" in captured.out.splitlines()[1]


def test_a_cpu_device_index_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """The CPU backend has one device: `--device cpu:3` was accepted and probed the CPU."""
    report = probe("cpu:3", run_checks=False)
    assert report["usable"] is False and "'cpu:3'" in report["reason"]
    assert "write 'cpu'" in report["reason"]
    assert main(["probe", "--device", "cpu:3", "--no-checks"]) == 1
    assert "'cpu:3'" in capsys.readouterr().err
    assert probe("cpu:0", run_checks=False)["usable"] is True  # torch's own name for it
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--device", "cpu:3", "--preset", "tiny"])
    assert exit_info.value.code == 2
    assert "argument --device" in capsys.readouterr().err


def test_an_unusable_backend_shows_no_feature_table_of_supported_features(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`probe --device cuda` on a CPU-only torch printed the CUDA feature table, every feature
    "supported", before saying the backend was unusable."""
    absent = [n for n in registry.registered_backends() if n not in registry.available_backends()]
    if not absent:
        pytest.skip("every registered backend is usable on this machine")
    assert main(["probe", "--device", absent[0], "--no-checks"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "NOT usable" in lines[0] and lines[1].startswith("  reason: ")
    assert not any(line.lstrip().startswith("feature ") for line in lines)
    assert not any("  supported  " in line for line in lines)


def test_unverified_backends_say_so(fake_env) -> None:
    fake_env("xpu")
    report = probe(run_checks=False)
    assert report["backend"] == "xpu" and report["verified_on_hardware"] is False
    assert any("not yet been verified on hardware" in note for note in report["notes"])
    assert report["features"]["graph_capture"]["status"] == "disabled"
    assert report["devices"] == [{"index": 0, "name": "Fake xpu GPU 0"}]
    assert "not yet been verified on hardware" in format_report(report)


def test_help_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    out = capsys.readouterr().out
    assert "hisparse probe --json" in out and "exit status" in out


# --- kernel targets ---------------------------------------------------------------------------
def test_kernel_targets_say_what_was_proven_here(backend: Backend) -> None:
    report = probe(backend.name)
    entries = {e["target"]: e for e in report["kernel_targets"]}
    assert list(entries)[:len(TARGETS)] == [t.name for t in TARGETS]
    triton = report["versions"]["triton"]
    for target in TARGETS:
        entry = entries[target.name]
        assert entry["backend"] == target.hisparse_backend and entry["triton"] == triton
        assert entry["status"] in (RAN, COMPILED, NOT_COMPILED), entry
        if entry["status"] == RAN:  # only a target whose device ran the kernels here
            assert backend.name == target.hisparse_backend, entry
        if entry["status"] == COMPILED:
            assert entry["builds"] > 0 and "builds" in entry["reason"], entry
        if entry["status"] == NOT_COMPILED:
            assert entry["reason"], entry
    if backend.name == "cpu":
        assert RAN not in {e["status"] for e in entries.values()}
    if triton is None:
        assert {e["status"] for e in entries.values()} == {NOT_COMPILED}
        return
    from triton.backends import backends as triton_backends

    for target in TARGETS:
        if target.triton_backend not in triton_backends:
            assert entries[target.name]["status"] == NOT_COMPILED
            if target.backend == "xpu":
                assert entries[target.name]["reason"] == NEEDS_INTEL_BACKEND
        elif entries[target.name]["status"] != RAN:
            assert entries[target.name]["status"] == COMPILED, entries[target.name]


def test_the_table_has_a_kernel_target_line_per_backend(capsys) -> None:
    assert main(["probe", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("kernel targets"):].splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["cuda", "rocm", "xpu"]
    for target in TARGETS:
        assert sum(target.name in line for line in lines) == 1, target.name


def test_a_target_that_ran_here_says_so_and_no_other_does() -> None:
    ran = {"target": "cuda:sm_90", "backend": "cuda", "triton": "3.6.0",
           "device": "cuda:0 (NVIDIA H200)"}
    entries = {e["target"]: e for e in probe_module._kernel_targets("off", ran)}
    assert entries["cuda:sm_90"]["status"] == RAN
    assert "cuda:0 (NVIDIA H200)" in entries["cuda:sm_90"]["reason"]
    assert [e["status"] for name, e in entries.items() if name != "cuda:sm_90"] == [
        NOT_COMPILED] * (len(TARGETS) - 1)
    # A device of a target the build list lacks is listed too, as the one that ran.
    ran = {**ran, "target": "cuda:sm_80", "device": "cuda:0 (NVIDIA A100)"}
    entries = probe_module._kernel_targets("off", ran)
    assert entries[-1]["target"] == "cuda:sm_80" and entries[-1]["status"] == RAN
    assert entries[-1]["hardware"] == "cuda:0 (NVIDIA A100)"


def test_without_checks_nothing_is_compiled_and_the_reason_says_why() -> None:
    report = probe("cpu", run_checks=False)
    assert {e["status"] for e in report["kernel_targets"]} == {NOT_COMPILED}
    assert all("not asked for" in e["reason"] or "not installed" in e["reason"]
               for e in report["kernel_targets"])
    with pytest.raises(ValueError, match="kernel_targets must be one of"):
        probe("cpu", kernel_targets="some")


def test_ran_on_hardware_needs_the_triton_kernels_to_pass_on_that_device(monkeypatch) -> None:
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from hisparse.kernels.swap_in import reference as swap_in_reference

    class Gpu:
        name = "cuda"
        kernel = staticmethod(lambda: None)

        def device(self) -> torch.device:
            return torch.device("cuda", 0)

        def describe(self, index: int | None = None) -> DeviceInfo:
            return DeviceInfo("NVIDIA H200")

        @property
        def kernels(self) -> SimpleNamespace:
            return SimpleNamespace(swap_in=self.kernel)

    Gpu.kernel.__module__ = "hisparse.kernels.swap_in.launch"
    class FakeDriver:  # what _ran_here asks of triton's active driver
        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    monkeypatch.setattr(triton.runtime.driver, "_active", FakeDriver())
    passed = [{"name": "swap_in_roundtrip", "status": "passed"}]
    ran = probe_module._ran_here(Gpu(), passed)
    assert ran == {"target": "cuda:sm_90", "backend": "cuda", "triton": triton.__version__,
                   "device": "cuda:0 (NVIDIA H200)"}
    assert probe_module._ran_here(Gpu(), [{**passed[0], "status": "failed"}]) is None
    reference = Gpu()
    reference.kernel = swap_in_reference.swap_in_reference  # the torch fallback ran instead
    assert probe_module._ran_here(reference, passed) is None
