"""What the CLI does with the files and values a user names: a path it cannot write, a plot
format matplotlib has no writer for, a config file that is not UTF-8. Each is one usage error
that names the option, before any work runs, and nothing is created on the way."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_checks import usage_error_line
from hisparse.cli import plan as plan_cli
from hisparse.cli.main import main
from hisparse.tools import benchmarking

SIM_SMALL = ["--device", "cpu", "--no-progress", "--requests", "1", "--steps", "2",
             "--warmup", "0", "--context", "512", "--preset", "tiny"]
BENCH_COPY = ["--device", "cpu", "--no-progress", "--only", "copy", "--bulk-mib", "1",
              "--gather-pool-mib", "1", "--gather-rows", "100"]
COMMANDS = {"simulate": SIM_SMALL, "bench": BENCH_COPY, "plan": [], "probe": ["--no-checks"]}


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the run started although its arguments are unusable")


@pytest.fixture(autouse=True)
def no_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job a command could start fails the test: the refusal must come first."""
    monkeypatch.setattr("hisparse.tools.simulation.simulate", _must_not_run)
    monkeypatch.setattr(benchmarking, "bulk_copies", _must_not_run)
    monkeypatch.setattr(benchmarking, "run_sw1", _must_not_run)
    monkeypatch.setattr(plan_cli, "plot", _must_not_run)


def refused(command: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([command, *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return usage_error_line(captured.err, command)


@pytest.mark.parametrize(("command", "option", "name"), [
    ("simulate", "--plot", "x.png"), ("simulate", "--output", "x.json"),
    ("bench", "--plot", "x.png"), ("bench", "--output", "x.json"), ("plan", "--plot", "x.png"),
])
def test_a_file_in_a_missing_folder_is_refused_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, option: str, name: str,
) -> None:
    """It used to run the whole job, then end in matplotlib's FileNotFoundError (--plot), or
    create the missing folders silently (--output)."""
    pytest.importorskip("matplotlib")
    missing = tmp_path / "nodir" / "deeper"
    target = missing / name
    error = refused(command, [*COMMANDS[command], option, str(target)], capsys)
    assert error.startswith(f"hisparse {command}: error: argument {option}: "), error
    assert str(target) in error and f"{missing} does not exist" in error, error
    assert not (tmp_path / "nodir").exists()


@pytest.mark.parametrize("command", ["simulate", "bench", "plan"])
@pytest.mark.parametrize("name", ["notpng.txt", "noextension"])
def test_a_plot_format_matplotlib_cannot_write_is_refused_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str, name: str,
) -> None:
    matplotlib_agg = pytest.importorskip("matplotlib.backends.backend_agg")
    formats = matplotlib_agg.FigureCanvasAgg.get_supported_filetypes()
    target = tmp_path / name
    error = refused(command, [*COMMANDS[command], "--plot", str(target)], capsys)
    assert error.startswith(f"hisparse {command}: error: argument --plot: "), error
    assert str(target) in error and ".png" in error and ".svg" in error, error
    assert "txt" not in formats and ("'.txt'" in error) == (name == "notpng.txt"), error
    assert not target.exists()


@pytest.mark.parametrize("command", ["simulate", "bench", "plan", "probe"])
def test_a_config_file_that_is_not_utf8_is_one_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str,
) -> None:
    """It used to end in a UnicodeDecodeError traceback in every subcommand."""
    config = tmp_path / "latin1.yaml"
    config.write_bytes("model: caf\u00e9\ntop_k: 64\n".encode("latin-1"))
    error = refused(command, [*[a for a in COMMANDS[command] if a not in ("--preset", "tiny")],
                              "--config", str(config)], capsys)
    assert error.startswith(f"hisparse {command}: error: argument --config: "), error
    assert str(config) in error and "UTF-8" in error and "0xe9" in error, error


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    import hisparse

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"hisparse {hisparse.__version__}"


@pytest.mark.parametrize("command", ["probe", "plan", "simulate", "bench"])
def test_every_option_has_help_and_the_help_cites_no_missing_file(
    capsys: pytest.CaptureFixture[str], command: str,
) -> None:
    """`bench --help` had 10 options without help text and relied on "DESIGN.md section 8",
    a file the repository does not contain."""
    from hisparse.cli.main import build_parser

    parser = build_parser()
    [subparsers] = [a for a in parser._actions if a.dest == "command"]
    sub = subparsers.choices[command]
    bare = [a.option_strings[0] for a in sub._actions
            if a.option_strings and a.dest != "help" and not (a.help or "").strip()]
    assert bare == [], f"{command} options without help: {bare}"
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "DESIGN" not in text and "research/" not in text


CONFIG_KEYS = ("host_pool_tokens", "alias_extents", "max_requests", "num_layers", "max_seq_len")


def test_a_context_no_cache_can_address_names_context(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`simulate --context 1000000000` was refused in terms of host_pool_tokens and
    alias_extents, config keys the user never typed."""
    error = refused("simulate", ["--device", "cpu", "--no-progress", "--requests", "4",
                                 "--steps", "2", "--warmup", "0", "--context", "1000000000"],
                    capsys)
    assert error.startswith("hisparse simulate: error: argument --context/--requests: "), error
    assert "1000000000" in error and "lower --context or --requests" in error, error
    assert not any(key in error for key in CONFIG_KEYS), error


def test_a_host_pool_that_does_not_fit_names_the_simulate_options(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`simulate --layers 1000` ended in "lower host_pool_tokens (rows per layer)"."""
    monkeypatch.undo()  # the real simulate runs, up to the host pool's refusal
    monkeypatch.setattr("hisparse.core.host_pool.available_host_bytes", lambda: 64 << 20)
    assert main(["simulate", *SIM_SMALL[:-2], "--layers", "1000"]) == 1
    [error] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert error.startswith("hisparse simulate: error: the host pool needs"), error
    assert "lower --layers, --requests or --context" in error, error
    assert not any(key in error for key in CONFIG_KEYS), error


@pytest.mark.parametrize("option", ["--bulk-mib", "--gather-pool-mib"])
def test_a_copy_buffer_larger_than_the_host_memory_names_its_option(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, option: str,
) -> None:
    """`bench --only copy --bulk-mib 100000` said "lower host_pool_tokens" after starting."""
    monkeypatch.setattr("hisparse.backends._host_memory.available_host_bytes",
                        lambda: 512 << 20)
    argv = list(BENCH_COPY)
    argv[argv.index(option) + 1] = "1024"
    error = refused("bench", argv, capsys)
    assert error.startswith(f"hisparse bench: error: argument {option}: 1024 MiB"), error
    assert f"lower {option}" in error and "512.00 MiB" in error, error
    assert not any(key in error for key in CONFIG_KEYS), error
