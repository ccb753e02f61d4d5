"""`hisparse simulate`, `bench` and `plan` as a user meets them: usage errors caught before any
work runs, presets whose index groups a CPU run must keep whole, and SW-1 targets judged only at
SW-1's own sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_checks import usage_error_line
from hisparse.cli import bench as bench_cli
from hisparse.cli.main import main
from hisparse.tools import benchmarking

SIM_SMALL = ["--device", "cpu", "--no-progress", "--requests", "1", "--steps", "2",
             "--warmup", "0", "--context", "512"]
BENCH_COPY = ["--device", "cpu", "--no-progress", "--only", "copy", "--bulk-mib", "1",
              "--gather-pool-mib", "1", "--gather-rows", "100"]


def test_simulate_glm5_on_a_cpu_keeps_whole_index_groups(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The CPU default caps the preset's layers at 2, but never cuts an index group short: with
    # one top-k per 4 layers it keeps the anchor and its three followers; GLM-5.2's own
    # schedule (indexers at 0, 1, 2, 6, ...) ends a group after layer 1.
    for extra, layers, anchors in ((["--index-group-size", "4"], 4, [0]),
                                   ([], 2, [0, 1])):
        code = main(["simulate", "--preset", "glm-5.2", "--top-k", "64", "--hot-slots", "128",
                     "--json", *extra, *SIM_SMALL])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        config = json.loads(captured.out)["config"]
        assert (config["num_layers"], config["index_anchors"]) == (layers, anchors)


@pytest.mark.parametrize("command", ["simulate", "bench"])
@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_a_seed_out_of_range_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    command: str, seed: str,
) -> None:
    argv = [*SIM_SMALL, "--preset", "tiny"] if command == "simulate" else BENCH_COPY
    with pytest.raises(SystemExit) as exit_info:
        main([command, *argv, "--seed", seed])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, command)
    assert error.startswith(f"hisparse {command}: error: argument --seed")


def unwritable_targets(tmp_path: Path) -> list[Path]:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return [tmp_path, blocker / "out.json"]  # a directory; a path under a regular file


@pytest.mark.parametrize("which", [0, 1])
def test_simulate_refuses_an_unwritable_output_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    which: int,
) -> None:
    target = unwritable_targets(tmp_path)[which]
    monkeypatch.setattr("hisparse.tools.simulation.simulate", _must_not_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--preset", "tiny", *SIM_SMALL, "--output", str(target)])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, "simulate")
    assert error.startswith("hisparse simulate: error: argument --output") and str(target) in error


@pytest.mark.parametrize("which", [0, 1])
def test_bench_refuses_an_unwritable_output_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    which: int,
) -> None:
    target = unwritable_targets(tmp_path)[which]
    monkeypatch.setattr(benchmarking, "bulk_copies", _must_not_run)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *BENCH_COPY, "--output", str(target)])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, "bench")
    assert error.startswith("hisparse bench: error: argument --output") and str(target) in error


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the run started although its output cannot be written")


def _cell(layout: str, batch: int, churn: float, seconds: float,
          rate: float | None) -> benchmarking.SW1Cell:
    return benchmarking.SW1Cell(
        layout=layout, batch=batch, churn=churn, step_seconds=seconds, p90_seconds=seconds,
        misses_per_step=0.0, miss_bytes_per_second=rate, verified=True, timing="graph replay",
        extent_tokens=512 if layout == "extents" else 1)


TARGET_CELLS = [
    _cell("scattered", 128, 0.0, 10e-6, None),
    _cell("scattered", 1, 1.0, 50e-6, 40e9),
    _cell("scattered", 128, 0.2, 1e-3, 40e9),
    _cell("extents", 64, 0.2, 1e-3, 50e9),
]


def test_targets_are_judged_at_sw1_sizes_on_an_accelerator() -> None:
    for cell in TARGET_CELLS:
        target, met = bench_cli.sw1_target(cell, False, benchmarking.SW1Sizes())
        assert target and met is True


@pytest.mark.parametrize("change", [
    {"seq_len": 16384},  # --quick on a GPU, or --seq-len
    {"top_k": 512, "hot_slots": 1024},  # --top-k
    {"hot_slots": 8192},  # --hot-slots
])
def test_targets_are_not_judged_for_another_workload(change: dict[str, int]) -> None:
    # The H200 targets (and SGLang's times they quote) are for SW-1's sizes; a smaller
    # top-k or context moves fewer or more local bytes and used to be marked "met".
    sizes = benchmarking.SW1Sizes(**change)
    for cell in TARGET_CELLS:
        target, met = bench_cli.sw1_target(cell, False, sizes)
        assert target and met is None


def test_python_dash_m_hisparse_is_the_console_script() -> None:
    """`python -m hisparse` works where the console script is not on PATH (a venv not
    activated): same commands, same exit codes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-m", "hisparse", "probe", "--device", "cpu"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "cpu" in done.stdout
    refused = subprocess.run([sys.executable, "-m", "hisparse", "simulate", "--seed", "-1"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 2 and "--seed" in refused.stderr


@pytest.mark.parametrize("command", [["plan"], ["simulate", *SIM_SMALL, "--preset", "tiny"]])
def test_a_reader_that_stops_reading_ends_the_run_without_a_traceback(command: list[str]) -> None:
    """`hisparse plan | head -2`: the pipe's read end closes before (or while) the table is
    written. The run exits as a process ended by SIGPIPE does (141), with nothing on stderr;
    it used to end in a BrokenPipeError traceback."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: deterministic
    try:
        done = subprocess.run([sys.executable, "-m", "hisparse", *command], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


@pytest.mark.parametrize("command", ["plan", "simulate", "bench", "probe"])
def test_an_unknown_option_is_reported_by_its_subcommand_first(
    capsys: pytest.CaptureFixture[str], command: str,
) -> None:
    """`hisparse plan --frobnicate` printed the top-level usage; now plan's error line comes
    first, then a pointer to plan's --help (not 10-13 lines of usage before it)."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--frobnicate"])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, command)
    assert error == f"hisparse {command}: error: unrecognized arguments: --frobnicate"


def test_a_bad_value_leads_with_its_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--top-k", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err
    assert usage_error_line(err, "simulate").startswith(
        "hisparse simulate: error: argument --top-k: expected a whole number >= 1")
