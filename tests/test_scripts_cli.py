"""scripts/ and benchmarks/ as a user meets them on a machine without a GPU: bad arguments are
usage errors (exit 2, one line, no traceback) before any work runs, GPU-only entry points
refuse at once, and the JSON they write says what produced it (card, torch, triton, command)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from conftest import needs_module

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS, BENCHMARKS = ROOT / "scripts", ROOT / "benchmarks"
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}


def load_script(name: str) -> ModuleType:
    loader = importlib.machinery.SourceFileLoader(f"{name.replace('-', '_')}_script",
                                                  str(SCRIPTS / name))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    sys.modules[loader.name] = module  # where dataclasses look their module up
    loader.exec_module(module)
    return module


def run(argv: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**ENV, **env})


def assert_main_refuses(capsys: pytest.CaptureFixture[str], main: Callable[[list[str]], int],
                        argv: list[str], option: str) -> None:
    """A script's `main(argv)` exits with a usage error naming `option`."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert_usage_error(exit_info.value.code, capsys.readouterr().err, option)


def assert_usage_error(code: object, err: str, option: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1] if err.strip() else ""
    words = last.partition("error: ")[2].replace(":", " ").split()
    assert option in words[:2], err  # "error: argument --x: ..." or "error: --x must ..."


# --- scripts/soak ---------------------------------------------------------------------------
SOAK_SMALL = ["--device", "cpu", "--requests", "2", "--pool-tokens", "16384", "--min-prompt",
              "300", "--max-prompt", "600", "--min-life", "2", "--max-life", "4"]


@pytest.mark.parametrize(("args", "option"), [
    (["--device", "nope"], "--device"),
    (["--requests", "0"], "--requests"),
    (["--steps", "-1"], "--steps"),
    (["--verify-every", "0"], "--verify-every"),
    (["--min-prompt", "200"], "--min-prompt"),
    (["--min-prompt", "500", "--max-prompt", "400"], "--max-prompt"),
    (["--min-life", "10", "--max-life", "5"], "--max-life"),
    (["--pool-tokens", "100"], "--pool-tokens"),
])
def test_soak_usage_errors(capsys: pytest.CaptureFixture[str], args: list[str],
                           option: str) -> None:
    assert_main_refuses(capsys, load_script("soak").main,
                        [*SOAK_SMALL, "--steps", "2", *args], option)


@NO_CUDA
def test_soak_on_a_missing_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert_main_refuses(capsys, load_script("soak").main,
                        [*SOAK_SMALL, "--steps", "2", "--device", "cuda"], "--device")


def test_soak_refuses_an_unwritable_json_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    soak = load_script("soak")
    monkeypatch.setattr(soak.Soak, "run", lambda self: pytest.fail("ran"))
    assert_main_refuses(capsys, soak.main,
                        [*SOAK_SMALL, "--steps", "2", "--json", str(tmp_path)], "--json")


def test_soak_json_says_what_produced_it(tmp_path: Path, seed: int) -> None:
    out = tmp_path / "soak.json"
    argv = [*SOAK_SMALL, "--steps", "3", "--seed", str(seed), "--json", str(out)]
    assert load_script("soak").main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["command"] == " ".join(["scripts/soak", *argv])
    assert summary["torch"] == torch.__version__
    assert {"card", "triton", "python"} <= summary.keys()


# --- scripts/fuzz-long ----------------------------------------------------------------------
@pytest.mark.parametrize(("args", "option"), [
    (["--jobs", "0"], "--jobs"),
    (["--jobs", "-1"], "--jobs"),
    (["--steps", "-1"], "--steps"),
    (["--full-check-every", "0"], "--full-check-every"),
    (["--seed", "-1"], "--seed"),
    (["--backend", "nope"], "--backend"),
])
def test_fuzz_long_usage_errors(capsys: pytest.CaptureFixture[str], args: list[str],
                                option: str) -> None:
    assert_main_refuses(capsys, load_script("fuzz-long").main,
                        ["--backend", "cpu", "--steps", "1", "--jobs", "1", *args], option)


@NO_CUDA
def test_fuzz_long_on_a_missing_cuda_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert_main_refuses(capsys, load_script("fuzz-long").main,
                        ["--backend", "cuda", "--steps", "1", "--jobs", "1"], "--backend")


def test_fuzz_long_refuses_an_unwritable_json_before_running(
    capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    assert_main_refuses(capsys, load_script("fuzz-long").main,
                        ["--backend", "cpu", "--steps", "1", "--jobs", "1", "--json",
                         str(tmp_path)], "--json")


def test_fuzz_long_bad_steps_in_the_environment_is_a_usage_error() -> None:
    result = run([sys.executable, str(SCRIPTS / "fuzz-long"), "--backend", "cpu", "--jobs",
                  "1"], HISPARSE_FUZZ_STEPS="many")
    assert_usage_error(result.returncode, result.stderr, "--steps")
    assert "HISPARSE_FUZZ_STEPS" in result.stderr


def test_fuzz_long_json_says_what_produced_it(tmp_path: Path, seed: int) -> None:
    out = tmp_path / "fuzz.json"
    argv = ["--backend", "cpu", "--steps", "2", "--jobs", "1", "--seed", str(seed),
            "--json", str(out)]
    # In a process of its own: the jobs are spawned, and import the script's module by name.
    result = run([sys.executable, str(SCRIPTS / "fuzz-long"), *argv])
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())
    assert summary["command"] == " ".join(["scripts/fuzz-long", *argv])
    assert summary["torch"] == torch.__version__
    assert {"triton", "python"} <= summary.keys()
    assert "card" in summary["backends"]["cpu"]


# --- scripts/kernel-stress ------------------------------------------------------------------
@pytest.mark.parametrize(("args", "option"), [
    (["--processes", "0"], "--processes"),
    (["--pdl", "maybe"], "--pdl"),
    (["--seconds", "-1"], "--seconds"),
    (["--sync", "-2"], "--sync"),
])
def test_kernel_stress_usage_errors(capsys: pytest.CaptureFixture[str], args: list[str],
                                    option: str) -> None:
    assert_main_refuses(capsys, load_script("kernel-stress").main, args, option)


@needs_module("triton", "triton")  # the script refuses to run without it
def test_kernel_stress_json_says_what_produced_it(tmp_path: Path, seed: int) -> None:
    out = tmp_path / "stress.json"
    argv = ["--seconds", "2", "--processes", "1", "--steps", "2", "--seed", str(seed),
            "--json", str(out)]
    result = run([sys.executable, str(SCRIPTS / "kernel-stress"), *argv], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["command"] == " ".join(["scripts/kernel-stress", *argv])
    assert summary["torch"] == torch.__version__
    assert {"triton", "python", "card", "commit"} <= summary.keys()
    # Every case ran its steps: two swap-in calls each, and no fault or wrong row.
    assert summary["cases"] >= 1 and summary["swap_in_calls"] >= 2 * 2 * summary["cases"]
    assert summary["faults"] == [] and summary["wrong_rows"] == []
    assert summary["hung_processes"] == 0


@needs_module("triton", "triton")  # the script refuses to run without it
def test_kernel_stress_kills_and_reports_a_process_still_running_after_the_grace(
        tmp_path: Path) -> None:
    """A hung kernel, or a process that died without reporting, must not hang the run: a case
    far longer than the run's time stands in for one."""
    out = tmp_path / "stress.json"
    argv = ["--seconds", "1", "--grace", "2", "--processes", "1", "--steps", "1000000",
            "--json", str(out)]
    result = run([sys.executable, str(SCRIPTS / "kernel-stress"), *argv], timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["hung_processes"] == 1 and summary["seconds"] < 60
    assert "1 hung processes" in result.stdout


def _stress_job(seconds: float) -> object:
    stress = load_script("kernel-stress")
    return stress, stress.Job(deadline=time.time() + seconds, pdl="default", sync_every=1,
                              steps=2, seed=7)


def test_kernel_stress_reports_a_fault_with_its_replay_and_stops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA fault poisons the process's context: the process reports the case and the seed
    that replays it, and ends instead of failing every later call."""
    from interpreted_kernels import swap_in_triton as kernels

    def fault(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    monkeypatch.setattr(kernels, "swap_in_triton", fault)
    stress, job = _stress_job(seconds=60)
    began = time.time()
    report = stress.run_process(job)
    assert time.time() - began < 30, "the process went on after the fault"
    assert report["calls"] == 0 and report["cases"] == 0 and report["wrong_rows"] == []
    (only,) = report["faults"]
    assert only["error"] == "CUDA error: an illegal memory access was encountered"
    assert only["step"] == 0 and isinstance(only["seed"], int)
    assert {"variant", "residency_map", "sizes"} <= only.keys()


def test_kernel_stress_counts_wrong_rows_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import test_swap_in_triton

    def wrong(*args: object) -> None:
        raise AssertionError("rows differ")

    monkeypatch.setattr(test_swap_in_triton, "assert_rows_match_host", wrong)
    stress, job = _stress_job(seconds=1)
    report = stress.run_process(job)
    assert report["faults"] == [] and report["cases"] >= 1
    assert len(report["wrong_rows"]) == report["cases"]
    assert report["wrong_rows"][0]["error"] == "rows differ"
    assert report["wrong_rows"][0]["step"] == job.steps - 1


# --- scripts/test, scripts/quickstart -------------------------------------------------------
def test_scripts_test_names_the_missing_test_dependencies(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
                   check=True)
    result = run([str(SCRIPTS / "test"), "-x"], PYTHON=str(tmp_path / "bare" / "bin" / "python"))
    assert result.returncode == 1
    assert "pip install -e '.[dev]'" in result.stderr, result.stderr


@NO_CUDA
@pytest.mark.parametrize("name", ["cuda", "no-such-backend"])
def test_scripts_test_for_a_backend_that_is_not_here_stops_at_once(name: str) -> None:
    """`./scripts/test --backend cuda` on a machine without CUDA ran the whole suite, failing
    case by case; now it stops before collecting anything, with one line that says why."""
    started = time.monotonic()
    result = run([str(SCRIPTS / "test"), "--backend", name], timeout=60,
                 PYTHON=sys.executable)
    assert result.returncode == 4, result.stdout + result.stderr  # pytest's usage error
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ERROR: --backend {name} was asked for but is not usable here: ")
    assert time.monotonic() - started < 30


STUB_PYTHON = """#!/bin/sh
# `python -m venv ... DIR`: a venv whose pip and hisparse log their arguments.
echo "python $*" >> "$LOG"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    for last; do :; done
    mkdir -p "$last/bin"
    for tool in pip hisparse; do
        printf '#!/bin/sh\\necho "%s $*" >> "$LOG"\\n' "$tool" > "$last/bin/$tool"
        chmod +x "$last/bin/$tool"
    done
    printf '#!/bin/sh\\nexit 0\\n' > "$last/bin/python"
    chmod +x "$last/bin/python"
fi
"""


def quickstart_in(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of scripts/quickstart in `tmp_path` and the environment that runs it with a
    stub python (no installs): returns the copy and that environment."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "quickstart"
    script.write_text((SCRIPTS / "quickstart").read_text())
    script.chmod(0o755)
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())  # its extras
    stub = tmp_path / "python-stub"
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    return script, {**ENV, "PYTHON": str(stub), "LOG": str(tmp_path / "log")}


def pyproject_extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"])


def editable_install(log: str) -> set[str]:
    """The extras of the last `pip install -e .[...]` the stub logged."""
    installs = [line for line in log.splitlines()
                if line.startswith("pip install") and "-e" in line]
    assert installs, log
    return set(installs[-1].split("[", 1)[1].split("]", 1)[0].split(","))


def test_quickstart_installs_what_ci_installs_in_an_isolated_venv(tmp_path: Path) -> None:
    """Every extra of pyproject.toml, as .ci/run installs them (so the docs' examples and the
    suite run after it as in CI), into a venv that does not see the system site-packages."""
    script, env = quickstart_in(tmp_path)
    result = subprocess.run([str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "log").read_text()
    assert editable_install(log) == pyproject_extras(), log
    (venv,) = [line for line in log.splitlines() if line.startswith("python -m venv")]
    assert "--system-site-packages" not in venv and venv.endswith(" .venv"), venv


def test_quickstart_uses_the_system_torch_only_when_asked_and_the_venv_it_is_given(
        tmp_path: Path) -> None:
    script, env = quickstart_in(tmp_path)
    env = {**env, "HISPARSE_TORCH": "system", "HISPARSE_VENV": str(tmp_path / "qs-venv")}
    result = subprocess.run([str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "log").read_text()
    (venv,) = [line for line in log.splitlines() if line.startswith("python -m venv")]
    assert venv == f"python -m venv --system-site-packages {tmp_path / 'qs-venv'}", venv
    assert "hisparse probe" in log and not (tmp_path / ".venv").exists()
    # A value it does not know is refused before anything is made.
    bad = subprocess.run([str(script)], capture_output=True, text=True, timeout=60,
                         env={**env, "HISPARSE_TORCH": "cuda",
                              "HISPARSE_VENV": str(tmp_path / "x")})
    assert bad.returncode == 2 and "HISPARSE_TORCH=cuda" in bad.stderr, bad.stderr
    assert not (tmp_path / "x").exists()


def test_ci_installs_every_extra_the_suite_tests() -> None:
    """CI's venv has each optional dependency, so no test of one is skipped there; pyproject
    declares the metrics extra with the client hisparse.metrics imports."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["metrics"] == ["prometheus_client>=0.17"]
    assert set(extras["tools"]) == {"matplotlib>=3.7", "tqdm>=4.66"}
    (install,) = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                  if "pip install" in line and " -e " in line]
    installed = set(install.split("[", 1)[1].split("]", 1)[0].split(","))
    assert installed == set(extras), install


def test_quickstart_repairs_a_venv_left_without_pip(tmp_path: Path) -> None:
    # Debian without python3-venv: `python3 -m venv` fails after making .venv/bin/python.
    script, env = quickstart_in(tmp_path)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
    result = subprocess.run([str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "python -m venv" in (tmp_path / "log").read_text()


# --- GPU-only entry points without a GPU ----------------------------------------------------
@NO_CUDA
def test_the_gpu_runner_refuses_at_once_without_cuda(tmp_path: Path) -> None:
    # Before, the GPU runner ran its stages anyway (a 200 s CPU fuzz among them) and failed after.
    process = subprocess.Popen(
        [str(SCRIPTS / "gpu-run"), "default"], cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        env={**ENV, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")})
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail("gpu-run kept running without CUDA")
    assert process.returncode == 2, out + err
    assert "CUDA" in err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


GPU_STUBS = {
    # A python that "sees" a GPU and logs what it is asked to run; the tools beside it too.
    # Asked to collect tests, it lists one per path given (the sanitizers shard them).
    "python": ('#!/bin/sh\necho "python $*" >> "$LOG"\ncase " $* " in *" --collect-only "*)\n'
               '  for a in "$@"; do case $a in tests/*) echo "$a::stub";; esac; done;;\nesac\n'
               'exit 0\n'),
    "nvidia-smi": '#!/bin/sh\necho "NVIDIA H200, 580"\n',
    "compute-sanitizer": '#!/bin/sh\necho "compute-sanitizer $*" >> "$LOG"\nexit 0\n',
}


def gpu_run_with_stubs(tmp_path: Path, *stages: str, **env_vars: str
                       ) -> tuple[subprocess.CompletedProcess[str], str]:
    for name, text in GPU_STUBS.items():
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {**ENV, "PYTHON": str(tmp_path / "python"), "LOG": str(tmp_path / "log"),
           "OUT": str(tmp_path / "out"), "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
           **env_vars}
    result = subprocess.run([str(SCRIPTS / "gpu-run"), *stages], capture_output=True,
                            text=True, env=env, timeout=60)
    return result, (tmp_path / "log").read_text() if (tmp_path / "log").exists() else ""


def test_the_gpu_runner_runs_the_stages_named_each_once_and_sums_them_up(
        tmp_path: Path) -> None:
    result, log = gpu_run_with_stubs(tmp_path, "probe", "memcheck", "sw2", "probe", "kernels")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.split("== gpu-run summary", 1)[1]
    ran = [line.split(":")[0] for line in summary.splitlines() if ": exit " in line]
    # The group `kernels` adds kernel-tests, racecheck and sw1; memcheck and probe run once.
    assert ran == ["probe", "memcheck", "sw2", "kernel-tests", "racecheck", "sw1"], summary
    assert log.count("hisparse.cli.main probe --json") == 1, log
    # The sanitizer runs the swap-in's variants, then the decode path's kernels, each set
    # shared by processes (4 at most) that together run every collected test once.
    memchecks = [line for line in log.splitlines()
                 if line.startswith("compute-sanitizer --tool memcheck")]
    groups = [[word for line in part for word in line.split() if "::" in word]
              for part in (memchecks[:2], memchecks[2:])]
    assert len(memchecks) == 2 + 4, memchecks
    assert [len(ids) for ids in groups] == [len(set(ids)) for ids in groups] == [2, 6], groups
    assert "tests/test_swap_in_union.py::stub" in groups[1], groups
    assert any("benchmarks/verify_step.py --device cuda --grid full" in line
               for line in log.splitlines()), log
    assert (tmp_path / "out" / "results.tar.gz").exists()


def test_the_sanitizers_shard_logs_stay_in_sanitize_log_dir(tmp_path: Path) -> None:
    """A stage cut short by its cap loses the logs it had not printed; SANITIZE_LOG_DIR keeps
    every shard's log (each test named) for that case."""
    kept = tmp_path / "kept"
    kept.mkdir()
    result, _ = gpu_run_with_stubs(tmp_path, "racecheck", SANITIZE_LOG_DIR=str(kept))
    assert result.returncode == 0, result.stdout + result.stderr
    logs = sorted(path.name for path in kept.iterdir())
    assert len(logs) == 2 + 4 and all(name.startswith("racecheck-shard-") for name in logs), logs


def test_the_fault_hunt_shares_the_gpu_and_alternates_pdl_then_baseline_then_blocking(
        tmp_path: Path) -> None:
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    result, log = gpu_run_with_stubs(tmp_path, "fault-hunt", HUNT_RUNS="2", HUNT_SHARERS="3",
                                     BASELINE=str(baseline))
    assert result.returncode == 0, result.stdout + result.stderr
    assert log.splitlines().count("python -c import sys, torch") == 3, log  # the sharers
    runs = [line for line in log.splitlines() if "benchmarks/host_overhead.py" in line]
    outputs = [line.split("--output ")[1].split("/hunt-")[1] for line in runs]
    assert outputs == ["pdl-1.json", "pdl-off-1.json", "pdl-2.json", "pdl-off-2.json",
                       "baseline.json", "launch-blocking.json"], runs
    assert all(("--pdl off" in line) == ("pdl-off" in line) for line in runs), runs
    # PDL is off by default: the runs that hunt it turn it on (the parent's tree had it on).
    assert [("--pdl on" in line) for line in runs] == [True, False, True, False, False, True]
    exits = (tmp_path / "out" / "fault-hunt.log").read_text()
    assert "pdl-1: exit 0" in exits and "launch-blocking: exit 0" in exits, exits


def test_the_pdl_hunt_runs_the_reduced_chains_and_both_newest_modes_beside_sharers(
        tmp_path: Path) -> None:
    result, log = gpu_run_with_stubs(tmp_path, "pdl-hunt", HUNT_SHARERS="2", HUNT_OFF_RUNS="1",
                                     HUNT_NEWEST_RUNS="2", PDL_STRESS_SECONDS="5",
                                     HUNT_LAYERS="12")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = log.splitlines()
    assert lines.count("python -c import sys, torch") == 2, log  # the sharers
    chains = sorted(line.split("--chain ")[1] for line in lines if "scripts/pdl-stress" in line)
    assert chains == ["simple --trigger start --pdl on", "swap-in --trigger end --pdl on",
                      "swap-in --trigger start --host-writes --pdl on",
                      "swap-in --trigger start --pdl on"], chains
    runs = [line for line in lines if "benchmarks/host_overhead.py" in line]
    assert all("--layers 12" in run for run in runs), runs
    modes = sorted((run.split("--pdl ")[1].split()[0],
                    run.split("--newest ")[1].split()[0] if "--newest" in run else "both")
                   for run in runs)
    assert modes == [("off", "both"), ("on", "folded"), ("on", "folded"), ("on", "separate"),
                     ("on", "separate")], runs
    exits = (tmp_path / "out" / "pdl-hunt.log").read_text()
    for name in ("pdl-stress swap-in end", "pdl-stress swap-in start host-writes", "pdl-off-1",
                 "pdl-folded-2", "pdl-separate-2"):
        assert f"{name}: exit 0" in exits, exits


def test_the_pdl_hunt_runs_each_slot_again_while_the_chains_run(tmp_path: Path) -> None:
    result, log = gpu_run_with_stubs(tmp_path, "pdl-hunt", HUNT_SHARERS="1", HUNT_OFF_RUNS="0",
                                     HUNT_NEWEST_RUNS="1", HUNT_ROUNDS="3",
                                     PDL_STRESS_SECONDS="30")
    assert result.returncode == 0, result.stdout + result.stderr
    runs = [line for line in log.splitlines() if "benchmarks/host_overhead.py" in line]
    seeds = sorted(int(run.split("--seed ")[1].split()[0]) for run in runs)
    assert seeds == [101, 101, 102, 102, 103, 103], runs  # 3 rounds of each mode's slot
    exits = (tmp_path / "out" / "pdl-hunt.log").read_text()
    assert "pdl-folded-1-3: exit 0" in exits and "pdl-separate-1-2: exit 0" in exits, exits


def test_the_pdl_hunt_runs_memcheck_slots_on_the_pdl_on_decode_path(tmp_path: Path) -> None:
    result, log = gpu_run_with_stubs(tmp_path, "pdl-hunt", HUNT_SHARERS="1", HUNT_OFF_RUNS="0",
                                     HUNT_NEWEST_RUNS="0", HUNT_MEMCHECK_SLOTS="2",
                                     PDL_STRESS_SECONDS="5")
    assert result.returncode == 0, result.stdout + result.stderr
    sanitized = [line for line in log.splitlines()
                 if line.startswith("compute-sanitizer --tool memcheck")]
    assert len(sanitized) == 2, log
    assert all("benchmarks/host_overhead.py" in line and "--pdl on" in line
               and "--newest separate" in line for line in sanitized), sanitized
    seeds = sorted(int(line.split("--seed ")[1].split()[0]) for line in sanitized)
    assert seeds == [1001, 2001], sanitized
    exits = (tmp_path / "out" / "pdl-hunt.log").read_text()
    assert "memcheck-1-1: exit 0" in exits and "memcheck-2-1: exit 0" in exits, exits


def test_the_gpu_runner_refuses_a_stage_it_does_not_know(tmp_path: Path) -> None:
    result, log = gpu_run_with_stubs(tmp_path, "probe", "sw3")
    assert result.returncode == 2 and "'sw3'" in result.stderr, result.stderr
    assert log == ""  # nothing ran
    listed = run([str(SCRIPTS / "gpu-run"), "--list"])
    assert listed.returncode == 0 and "sw2" in listed.stdout and "group default" in listed.stdout


@NO_CUDA
def test_device_overhead_refuses_without_cuda_and_has_help() -> None:
    script = str(BENCHMARKS / "device_overhead.py")
    result = run([sys.executable, script])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "CUDA" in result.stderr
    helped = run([sys.executable, script, "--help"])
    assert helped.returncode == 0 and helped.stdout.startswith("usage:"), helped.stderr


@pytest.mark.parametrize(("args", "option"), [
    (["--vs-sglang", "/nonexistent/hisparse.cuh"], "--vs-sglang"),
    (["--steps", "0"], "--steps"),
])
def test_swap_in_usage_errors_come_before_the_gpu(args: list[str], option: str) -> None:
    result = run([sys.executable, str(BENCHMARKS / "swap_in.py"), *args])
    assert_usage_error(result.returncode, result.stderr, option)


@needs_module("triton", "triton")
def test_copy_limits_json_says_what_produced_it(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import copy_limits

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Stub GPU")
    monkeypatch.setattr(copy_limits, "alloc_registered",
                        lambda size: torch.zeros(size, dtype=torch.uint8))
    monkeypatch.setattr(copy_limits, "measure", lambda pool: {"bulk_h2d_GBps": 1.0})
    out = tmp_path / "limits.json"
    assert copy_limits.main(["--pool-gib", "0.0001", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["card"] == "Stub GPU" and document["torch"] == torch.__version__
    assert document["command"].startswith("python ") and "triton" in document
    assert document["bulk_h2d_GBps"] == 1.0


def test_prefix_sharing_benchmark_writes_less_and_holds_p_plus_n_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import prefix_sharing

    out = tmp_path / "sharing.json"
    argv = ["--preset", "tiny", "--prefix-tokens", "300", "--own-tokens", "40",
            "--requests", "3", "--rounds", "1", "--output", str(out)]
    assert prefix_sharing.main(argv) == 0
    document = json.loads(out.read_text())
    assert document["command"] == "python benchmarks/prefix_sharing.py " + " ".join(argv)
    assert document["torch"] == torch.__version__ and "triton" in document
    unshared, shared = document["modes"]
    W, L = document["row_bytes"], document["num_layers"]
    assert unshared["prefill_bytes_offloaded_per_request"] == 340 * L * W
    assert shared["prefill_bytes_offloaded_per_request"] == 40 * L * W
    # tiny: 64-token extents. Unshared 3 x ceil(341/64); shared: the 300-token prefix's 5
    # extents once (4 whole, the handle's boundary one), each request ceil((341-256)/64).
    assert unshared["host_extents_used"] == 3 * 6
    assert shared["host_extents_used"] == 5 + 3 * 2


def test_shared_pool_benchmark_reports_memory_step_cost_and_a_clean_fuzz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import shared_pool

    out = tmp_path / "shared-pool.json"
    argv = ["--ranks", "2", "--pool-tokens", "16384", "--steps", "4", "--batch", "2",
            "--fuzz-steps", "20", "--output", str(out)]
    assert shared_pool.main(argv) == 0
    document = json.loads(out.read_text())
    assert document["command"] == "python benchmarks/shared_pool.py " + " ".join(argv)
    assert document["torch"] == torch.__version__ and "triton" in document
    group = document["groups"]["2"]
    memory = group["memory"]
    assert memory["pool_bytes"] == 4 * 16384 * 64  # 4 layers of tiny's 64 B rows
    assert memory["pool_bytes"] <= memory["shared"]["shared_memory_bytes"]
    assert len(group["timing"]["non_writer_host_us"]) == 3  # median, p90, mean
    interleaved = group["timing_interleaved"]
    assert interleaved["non_writer_host_busy_us"]["median"] > 0
    assert interleaved["private_rank_host_us"]["median"] > 0
    assert interleaved["single_rank_alone_host_us"]["median"] > 0
    for part in ("timing_paired", "timing_one_process"):  # each rank's process, or one
        for reads in ("host_rows", "miss_free"):  # random top-k, then the same K positions
            paired = group[part][reads]
            assert paired["non_writer"]["steps"] == 4
            assert paired["non_writer"]["host"]["ratio_median"] > 0
            assert [r["shared_pool_attached"] for r in paired["ranks"]] == [True, True]
            assert [r["prompt_rows_from_writer"] for r in paired["ranks"]] == [True, True]
    assert group["fuzz_mismatches"] == 0 and group["fuzz_steps_total"] == 40


def test_shared_pool_benchmark_usage_errors(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import shared_pool

    assert_main_refuses(capsys, shared_pool.main, ["--ranks", "0"], "--ranks")
    assert_main_refuses(capsys, shared_pool.main, ["--fuzz-steps", "-1"], "--fuzz-steps")


HOST_OVERHEAD_SMALL = ["--top-k", "16", "--row-bytes", "64", "--seq-len", "256", "--layers", "2",
                       "--batches", "1", "3", "--churns", "0", "0.2", "--warmup", "1"]


def test_host_overhead_ab_compares_normalized_medians_over_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The before/after table: per cell and part the median over runs of each run's
    normalized median; the ratio is change / baseline."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import host_overhead_ab

    rng = __import__("random").Random()

    def run(scale: float) -> dict[str, object]:
        parts = {p: {"median_us": scale * rng.uniform(9, 11)} for p in host_overhead_ab.PARTS}
        raw = {p: {"median_us": 1e6} for p in host_overhead_ab.PARTS}  # not what is compared
        return {"reference": {"median_us": 10.0}, "cells": [
            {"batch": 16, "churn": 0.2, "newest": "folded", **raw, "normalized": parts}]}

    scale = rng.choice([0.5, 2.0])
    paths = {}
    for side, factor in (("base", 1.0), ("change", scale)):
        paths[side] = []
        for index in range(3):
            path = tmp_path / f"{side}-{index}.json"
            path.write_text(json.dumps(run(factor)))
            paths[side].append(str(path))
    out = tmp_path / "ab.txt"
    assert host_overhead_ab.main(["--baseline", *paths["base"], "--change", *paths["change"],
                                  "--output", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 2 + len(host_overhead_ab.PARTS)
    for line in lines[1:-1]:
        ratio = float(line.rsplit("ratio ", 1)[1])
        assert scale * 0.8 < ratio < scale * 1.25, line


@pytest.mark.parametrize("extra", [[], pytest.param(
    ["--ragged", "--profile", "--breakdown", "--disjoint-requests"],
    marks=needs_module("triton", "triton"))])  # --breakdown times the Triton launches
def test_host_overhead_benchmark_times_every_call_of_every_cell(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str]) -> None:
    """The eager host-time benchmark, on the CPU backend whose kernels do nothing (small
    tables): every call of every cell timed, in rounds that interleave the cells, each sample
    with the host-speed reference of its slot; the targets and the length mode recorded."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import host_overhead

    out = tmp_path / "host-overhead.json"
    argv = ["--noop-kernels", *HOST_OVERHEAD_SMALL, "--steps", "5", "--output", str(out), *extra]
    assert host_overhead.main(argv) == 0
    document = json.loads(out.read_text())
    assert document["lengths"] == ("ragged" if "--ragged" in extra else "equal")
    assert document["targets_us"] == host_overhead.TARGETS_US
    interleave = document["interleave"]
    assert interleave["rounds"] == 3 and interleave["steps_per_round"] == [2, 2, 1]
    assert interleave["requests"] == ("disjoint" if "--disjoint-requests" in extra else "shared")
    reference = document["reference"]
    assert 0 < reference["min_us"] <= reference["fastest_decile_us"] <= reference["median_us"]
    assert reference["median_us"] <= reference["max_us"]
    assert reference["max_over_min"] == pytest.approx(reference["max_us"] / reference["min_us"])
    assert len(reference["per_round_median_us"]) == 3
    assert [(c["batch"], c["churn"], c["newest"]) for c in document["cells"]] == [
        (b, c, n) for b in (1, 3) for c in (0.0, 0.2) for n in ("separate", "folded")]
    for cell in document["cells"]:
        folded = cell["newest"] == "folded"
        assert cell["begin_decode_step"]["calls"] == cell["end_decode_step"]["calls"] == 5
        assert cell["swap_in"]["calls"] == 5 * 2
        # A folded cell hands the new rows to swap_in: no write_newest call to time.
        assert ("write_newest" in cell) is not folded
        assert folded or cell["write_newest"]["calls"] == 5 * 2
        assert 0 < cell["begin_plus_end"]["median_us"] < cell["step"]["median_us"]
        assert len(cell["reference_us"]) == 3 and min(cell["reference_us"]) > 0
        for name in (*host_overhead.CALLS, "begin_plus_end", "step"):
            if folded and name == "write_newest":
                continue
            normalized = cell["normalized"][name]
            assert 0 < normalized["p10_us"] <= normalized["median_us"]
        assert cell["normalized"]["swap_in"]["calls"] == 5 * 2
        assert cell["restore_steps"] >= 1 and cell["timed_misses"] == 0  # no kernels run
        assert ("profile_top20" in cell) == ("triton_launches" in cell) == bool(extra)


@pytest.mark.parametrize("disjoint", [False, True])
def test_host_overhead_cells_keep_their_trace_when_interleaved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disjoint: bool) -> None:
    """On the plain CPU backend (the kernels count hits and misses), cells that share requests
    and run interleaved keep their own traces: a churn-0 cell misses nothing once warm, a
    churn-0.2 cell misses 0.2 * K = 3 rows a request, layer and step."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import host_overhead

    out = tmp_path / "host-overhead.json"
    argv = ["--device", "cpu", *HOST_OVERHEAD_SMALL, "--steps", "6", "--output", str(out),
            *(["--disjoint-requests"] if disjoint else [])]
    assert host_overhead.main(argv) == 0
    for cell in json.loads(out.read_text())["cells"]:
        expected = cell["batch"] * 2 * round(cell["churn"] * 16)
        if disjoint:  # a fresh request's hot buffer starts seeded: fewer misses at first
            assert (cell["misses_per_step"] == 0) == (expected == 0)
            assert cell["misses_per_step"] <= expected
        else:
            assert cell["misses_per_step"] == expected


def test_host_overhead_pauses_after_every_device_synchronisation_when_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--pause-ms 1.5`: a 1.5 ms sleep after every synchronisation (two a timed step, the
    one before its begin among them), said in the file's mode; the cells are still timed."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import host_overhead

    sleeps: list[float] = []
    monkeypatch.setattr(host_overhead.time, "sleep", sleeps.append)
    out = tmp_path / "host-overhead.json"
    argv = ["--device", "cpu", *HOST_OVERHEAD_SMALL, "--steps", "2", "--pause-ms", "1.5",
            "--output", str(out)]
    assert host_overhead.main(argv) == 0
    document = json.loads(out.read_text())
    assert document["mode"].endswith("then 1.5 ms of sleep")
    timed_steps = sum(c["step"]["steps"] for c in document["cells"])
    assert len(sleeps) >= 2 * timed_steps and set(sleeps) == {0.0015}
    for cell in document["cells"]:  # the wait before each timed step, wall and CPU time
        waits = [cell[name] for name in host_overhead.WAITS]
        assert [w["calls"] for w in waits] == [cell["step"]["steps"]] * 2
        assert all(w["median_us"] >= 0 for w in waits)


def test_host_overhead_refuses_empty_rounds(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import host_overhead

    for option in ("--rounds", "--steps-per-round", "--steps"):
        assert_main_refuses(capsys, host_overhead.main, [option, "0"], option)


def test_host_overhead_warm_pass_times_the_calls_back_to_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--warm`: per cell, the calls back to back (no sync, no other call between), layer 0's
    call repeated within one step, and the reference right after a sync against back to back,
    each with the in-step median over it; the timed statistics keep their own steps only."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import host_overhead

    out = tmp_path / "host-overhead.json"
    argv = ["--noop-kernels", *HOST_OVERHEAD_SMALL, "--steps", "3", "--warm", "--warm-calls",
            "6", "--output", str(out)]
    assert host_overhead.main(argv) == 0
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 8
    for cell in cells:
        warm, folded = cell["warm"], cell["newest"] == "folded"
        assert cell["begin_decode_step"]["calls"] == cell["swap_in"]["calls"] // 2 == 3
        names = ["begin", "end", "swap_in"] + ([] if folded else ["write_newest"])
        assert ("write_newest_back_to_back" in warm) is not folded
        assert warm["calls"] == 6
        for name in names:
            for key in (f"{name}_back_to_back", f"{name}_first_of_back_to_back",
                        f"{name}_in_step_over_back_to_back"):
                assert math.isfinite(warm[key]) and warm[key] > 0, key
        assert warm["reference_after_sync"] > 0 and warm["reference_warm"] > 0
        assert warm["reference_after_sync_over_warm"] == pytest.approx(
            warm["reference_after_sync"] / warm["reference_warm"])
        assert warm["begin_in_step_over_back_to_back"] == pytest.approx(
            cell["begin_decode_step"]["median_us"] / warm["begin_back_to_back"])


@pytest.mark.parametrize("mode", ["default", "on", "off", "no-early-copy"])
def test_host_overhead_runs_its_cells_under_the_pdl_mode_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """`--pdl` chooses the swap-in's launch order for the whole run (fault-hunt splits the
    early selection from the early copy with it): the cells are measured under that tuning,
    and the run's document says which mode it was."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import host_overhead
    from hisparse.kernels.swap_in.plan import Tuning, current_tuning

    seen: list[Tuning] = []
    measure = host_overhead.measure

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(current_tuning())
        return measure(*args, **kwargs)

    monkeypatch.setattr(host_overhead, "measure", spy)
    out = tmp_path / "host-overhead.json"
    argv = ["--noop-kernels", *HOST_OVERHEAD_SMALL, "--steps", "2", "--pdl", mode,
            "--output", str(out)]
    assert host_overhead.main(argv) == 0
    default = Tuning()
    expected = {"default": (default.pdl, default.pdl_copy_max_batch),
                "on": (True, default.pdl_copy_max_batch),
                "off": (False, default.pdl_copy_max_batch),
                "no-early-copy": (True, 0)}[mode]
    assert [(t.pdl, t.pdl_copy_max_batch) for t in seen] == [expected]
    assert json.loads(out.read_text())["pdl"] == mode
    assert current_tuning() == default  # the run's tuning ends with it


def test_the_gpu_runner_fits_its_stages_into_budget(tmp_path: Path) -> None:
    """BUDGET (a device call's limit): each stage's cap shrinks to what is left, and a stage
    with too little left is reported as not run, with its own exit, instead of being cut."""
    result, _ = gpu_run_with_stubs(tmp_path, "probe", "sw2", BUDGET="100")
    caps = [line for line in result.stdout.splitlines() if line.startswith("== ")]
    # sw2's own cap is 240 s: with a 100 s budget it gets what is left, about 100 s.
    assert any(line.startswith("== sw2 (cap ") and int(line.split("cap ")[1].split("s")[0])
               <= 100 for line in caps), caps
    result, _ = gpu_run_with_stubs(tmp_path, "probe", "sw2", BUDGET="15")
    assert result.returncode == 1, result.stdout
    summary = result.stdout.split("== gpu-run summary", 1)[1]
    assert "probe: exit 125" in summary and "sw2: exit 125" in summary, summary


@needs_module("triton", "triton")
@pytest.mark.parametrize("chain", ["simple", "swap-in", "swap-in --host-writes"])
def test_the_pdl_stress_finds_no_wrong_value_and_its_self_check_finds_them(chain: str) -> None:
    """scripts/pdl-stress in the interpreter (PDL off there): a clean run exits 0; with every
    expected value off by one it must report wrong values and exit 1."""
    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(SCRIPTS / "pdl-stress"), "--seconds", "0",
                               "--chain", *chain.split(), *extra], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    clean, broken = run(), run("--self-check")
    assert clean.returncode == 0 and "0 wrong values" in clean.stdout, clean.stdout + clean.stderr
    assert broken.returncode == 1 and "wrong values by step" in broken.stdout, (
        broken.stdout + broken.stderr)


@needs_module("triton", "triton")
def test_the_pdl_stress_host_rows_hold_the_last_step_and_a_stale_row_is_counted() -> None:
    """The host-writes chain's own check (apart from the second kernel's): after step s every
    host row holds step s's words, and the check counts each word of a row left stale. In a
    process of its own: the interpreter must be on before triton is imported."""
    code = f"""
import importlib.machinery, importlib.util
loader = importlib.machinery.SourceFileLoader("stress", {str(SCRIPTS / "pdl-stress")!r})
spec = importlib.util.spec_from_loader("stress", loader)
stress = importlib.util.module_from_spec(spec)
loader.exec_module(stress)
step, err, host_wrong = stress._swap_in_chain("cpu", False, 0, False, True)
step(5)
print(int(err.item()), host_wrong(5), host_wrong(6), stress.HOST_ROW_WORDS)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "TRITON_INTERPRET": "1",
                                              "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    wrong, fresh, stale, words = map(int, result.stdout.split())
    assert (wrong, fresh) == (0, 0)
    assert stale == 4 * words  # every word of the chain's 4 rows is one step behind
