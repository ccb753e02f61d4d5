"""`hisparse.probe()` and `hisparse probe`: a truthful report, a stable JSON schema, exit codes."""

from __future__ import annotations

import json

import pytest

import hisparse
from hisparse.backends import registry
from hisparse.backends.base import Backend
from hisparse.cli.main import main
from hisparse.probe import SCHEMA_VERSION, format_report, probe

TOP_LEVEL_KEYS = {
    "schema_version", "hisparse_version", "requested", "backend", "usable", "reason",
    "available_backends", "devices", "versions", "features", "verified_on_hardware", "notes",
    "checks", "ok",
}
CHECKS = ["host_buffer", "register_host", "swap_in_roundtrip"]


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
    expected_register = "passed" if backend.supports("register_host_memory") else "skipped"
    assert statuses["register_host"] == expected_register, report["checks"]
    # The engine imports on every backend: a skipped round trip would prove nothing.
    assert statuses["swap_in_roundtrip"] == "passed", report["checks"]
    assert report["ok"] is True and report["reason"] is None
    json.dumps(report)  # everything in it serializes


def test_the_swap_in_check_runs_once_the_engine_exists() -> None:
    pytest.importorskip("hisparse.core.engine")
    check = probe("cpu")["checks"][2]
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
    assert "check(s) failed: host_buffer" in capsys.readouterr().err


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
