"""`--config FILE` on plan, simulate, bench and probe, and one rule for a --top-k that does not
fit the config's hot buffer: plan and simulate agree, and CLI errors name options, not keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_checks import usage_error_line
from hisparse.cli.main import main

SIM_SMALL = ["--device", "cpu", "--no-progress", "--requests", "1", "--steps", "2",
             "--warmup", "0", "--context", "512"]
MINE = """\
model: mine
num_layers: 2
kv_dtype: bf16
row_bytes_by_dtype: {fp8: 96, bf16: 160}
top_k: 32
hot_slots: 72
index_group_size: 2
max_requests: 2
max_seq_len: 2048
host_pool_tokens: 4096
extent_tokens: 64
"""


@pytest.fixture
def mine(tmp_path: Path) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(MINE)
    return path


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def usage_error(capsys: pytest.CaptureFixture[str], command: str, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([command, *argv])
    assert exit_info.value.code == 2
    return usage_error_line(capsys.readouterr().err, command)


def test_plan_reads_a_config_file(capsys: pytest.CaptureFixture[str], mine: Path) -> None:
    doc = run_json(capsys, "plan", "--config", str(mine), "--context", "1024")
    model, settings = doc["model"], doc["settings"]
    assert model["config_file"] == str(mine) and model["preset"] is None
    assert (model["num_layers"], model["kv_dtype"], model["row_bytes"]) == (2, "bf16", 160)
    assert (model["index_group_size"], model["num_groups"]) == (2, 1)
    assert (settings["top_k"], settings["hot_slots"], settings["extent_tokens"]) == (32, 72, 64)
    # The file's kv_dtype stands unless --kv-dtype is given (plan's default used to force fp8).
    doc = run_json(capsys, "plan", "--config", str(mine), "--context", "1024", "--kv-dtype",
                   "fp8")
    assert doc["model"]["row_bytes"] == 96


def test_simulate_reads_a_config_file(capsys: pytest.CaptureFixture[str], mine: Path) -> None:
    doc = run_json(capsys, "simulate", "--config", str(mine), *SIM_SMALL)
    config = doc["config"]
    assert (config["model"], config["num_layers"], config["row_bytes"]) == ("mine", 2, 160)
    assert (config["top_k"], config["hot_slots"], config["index_group_size"]) == (
        32, 72, 2)
    # 2 steps x 2 layers x 32 entries looked up, every one a hit or a miss.
    summary = doc["summary"]
    assert summary["hits_per_step"] + summary["misses_per_step"] == 2 * 32


def test_probe_runs_its_round_trip_on_a_config_file(capsys: pytest.CaptureFixture[str],
                                                     mine: Path) -> None:
    report = run_json(capsys, "probe", "--device", "cpu", "--config", str(mine))
    assert report["ok"] is True
    (check,) = [c for c in report["checks"] if c["name"] == "swap_in_roundtrip"]
    assert check["status"] == "passed"
    assert check["detail"].startswith("config mine, 2 layers, 32 of 150 tokens swapped in")


@pytest.mark.parametrize("command", ["plan", "simulate", "bench", "probe"])
def test_a_config_file_that_is_missing_or_wrong_is_a_usage_error_naming_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str,
) -> None:
    missing = tmp_path / "nope.yaml"
    error = usage_error(capsys, command, "--config", str(missing))
    assert error == (f"hisparse {command}: error: argument --config: cannot read config file "
                     f"{missing}: No such file or directory")
    bad = tmp_path / "bad.yaml"
    bad.write_text("top_k: 64\nhot_buffer: 128\n")
    error = usage_error(capsys, command, "--config", str(bad))
    assert error.startswith(f"hisparse {command}: error: argument --config: unknown key(s) in "
                            f"{bad}: hot_buffer; valid keys: model, num_layers")


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_preset_and_config_are_one_or_the_other(capsys: pytest.CaptureFixture[str], mine: Path,
                                               command: str) -> None:
    error = usage_error(capsys, command, "--preset", "tiny", "--config", str(mine))
    assert error == f"hisparse {command}: error: argument --config: not allowed with argument " \
                    "--preset"


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_an_unknown_preset_points_at_config(capsys: pytest.CaptureFixture[str],
                                            command: str) -> None:
    error = usage_error(capsys, command, "--preset", "nope")
    assert error.startswith(f"hisparse {command}: error: argument --preset: unknown preset "
                            "'nope'; available presets: ")
    assert error.endswith("(or pass --config FILE)")


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_a_top_k_past_the_presets_hot_buffer_names_hot_buffer_in_both_commands(
    capsys: pytest.CaptureFixture[str], command: str,
) -> None:
    """simulate answered with a config key (`hot_slots: got 128, must be at least top_k
    (5000)`), while plan went on; now both refuse the same way and name the option to pass."""
    error = usage_error(capsys, command, "--preset", "tiny", "--top-k", "5000",
                        *(SIM_SMALL if command == "simulate" else []))
    assert error == (
        f"hisparse {command}: error: argument --top-k: 5000 entries do not fit the hot buffer "
        "of the tiny preset (128 slots); pass --hot-slots too (at least 5000; 10000 is the "
        "usual 2 x top-k) or use at most --top-k 128")
    assert "hot_slots" not in error


def test_plan_and_simulate_derive_the_same_hot_buffer(capsys: pytest.CaptureFixture[str],
                                                      mine: Path) -> None:
    """A preset that leaves the hot buffer unset (deepseek-v3.2) derives 2 x top-k in both; one
    that sets it (tiny) keeps it while top-k fits, and --hot-slots wins in both."""
    def plan_and_simulate(*argv: str) -> tuple[int, int]:
        planned = run_json(capsys, "plan", *argv, "--context", "8192")["settings"]["hot_slots"]
        simulated = run_json(capsys, "simulate", *argv, *SIM_SMALL)
        return planned, simulated["config"]["hot_slots"]

    assert plan_and_simulate("--preset", "deepseek-v3.2", "--top-k", "48") == (96, 96)
    assert plan_and_simulate("--preset", "tiny", "--top-k", "48") == (128, 128)
    assert plan_and_simulate("--preset", "tiny", "--top-k", "200", "--hot-slots", "300") == (
        300, 300)


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_option_values_the_config_refuses_are_named_by_their_option(
    capsys: pytest.CaptureFixture[str], command: str,
) -> None:
    extra = SIM_SMALL if command == "simulate" else []
    error = usage_error(capsys, command, "--preset", "tiny", "--top-k", "100",
                        "--hot-slots", "50", *extra)
    assert error == (f"hisparse {command}: error: argument --hot-slots: got 50, must be at "
                     "least --top-k (100)")
    error = usage_error(capsys, command, "--preset", "tiny", "--index-group-size", "8", *extra)
    assert error.startswith(f"hisparse {command}: error: argument --index-group-size: got 8, "
                            "larger than ")
    assert "index_group_size" not in error and "hot_slots" not in error
    if command == "simulate":  # --layers is simulate's: the value at fault is that option's
        error = usage_error(capsys, command, "--preset", "tiny", "--layers", "1", *extra)
        assert error == ("hisparse simulate: error: argument --layers: --index-group-size: got 2, "
                         "larger than --layers (1)")
