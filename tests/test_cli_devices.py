"""A device index (`cuda:1`) named on the command line or to the probe."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import pytest
import torch

import hisparse
from cli_checks import usage_error_line
from hisparse.backends import registry
from hisparse.cli import _output as out
from hisparse.cli import plan as plan_cli
from hisparse.cli.main import main
from hisparse.errors import BackendUnavailableError


def test_device_index_is_checked_against_the_visible_devices(fake_env) -> None:
    fake_env("cuda", gpus=2)
    cuda = hisparse.get_backend("cuda")
    assert registry.device_index(cuda, "cuda") is None
    assert registry.device_index(cuda, "cuda:1") == 1
    assert registry.device_index(cuda, torch.device("cuda", 0)) == 0
    for bad in ("cuda:2", torch.device("cuda", 7)):
        with pytest.raises(BackendUnavailableError, match="sees 2 device"):
            registry.device_index(cuda, bad)
    with pytest.raises(BackendUnavailableError, match="not a device index"):
        registry.device_index(cuda, "cuda:one")
    assert registry.device_index(hisparse.get_backend("cpu"), "cpu:0") is None  # one host
    with pytest.raises(BackendUnavailableError, match="write 'cpu'"):
        registry.device_index(hisparse.get_backend("cpu"), "cpu:3")


def test_probe_of_a_device_that_is_not_there_is_not_usable(fake_env) -> None:
    # It used to say "usable" and exit 0 for cuda:5 on a 2-GPU host, and ran the checks of
    # cuda:1 on device 0.
    fake_env("cuda", gpus=2)
    report = hisparse.probe("cuda:5", run_checks=False)
    assert report["usable"] is False and report["ok"] is False
    assert "sees 2 device" in report["reason"]
    assert hisparse.probe("cuda:1", run_checks=False)["usable"] is True


def test_probe_runs_its_checks_on_the_requested_device(
    fake_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hisparse.tools import probe as probe_module

    fake_env("cuda", gpus=2)
    entered: list[torch.device] = []

    class Scope:
        def __init__(self, device: torch.device) -> None:
            entered.append(device)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(torch.cuda, "device", Scope)
    monkeypatch.setattr(probe_module, "_run_check", lambda name, check, backend: {
        "name": name, "status": "passed", "detail": "", "seconds": 0.0})
    assert hisparse.probe("cuda:1")["ok"] is True
    assert entered == [torch.device("cuda", 1)]


@pytest.mark.parametrize("command", [
    ["simulate", "--preset", "tiny", "--no-progress"],
    ["bench", "--no-progress", "--only", "copy"],
])
def test_cli_refuses_a_device_index_that_is_not_there(
    fake_env, capsys: pytest.CaptureFixture[str], command: Sequence[str]
) -> None:
    fake_env("cuda", gpus=1)
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--device", "cuda:1"])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, command[0])
    assert error.startswith(f"hisparse {command[0]}: error: argument --device")
    assert "sees 1 device" in error


def test_cli_makes_the_requested_device_current(
    fake_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bench measured device 0 for `--device cuda:1`, and simulate failed in Triton, whose
    # kernels launch on the current device.
    fake_env("cuda", gpus=2)
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    parser = argparse.ArgumentParser(prog="hisparse test")
    assert out.backend_for_device_argument(parser, "cuda:1").name == "cuda"
    assert out.backend_for_device_argument(parser, "cuda").name == "cuda"
    assert chosen == [1]


def test_plan_refuses_an_unwritable_plot_before_plotting(
    capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(out, "import_pyplot", lambda option="--plot": object())
    monkeypatch.setattr(plan_cli, "plot", lambda *args: pytest.fail("plotted"))
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--plot", str(tmp_path)])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, "plan")
    assert error.startswith("hisparse plan: error: argument --plot")
