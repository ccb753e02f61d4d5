"""Every median time the CLI prints comes with its spread (p10 and p90), and a spread wider
than `NOISE_RATIO` says the machine was too noisy to trust the numbers (CPU timings swing
about 100x with load)."""

from __future__ import annotations

import json
import random
import statistics

import numpy as np
import pytest

from hisparse.cli import _output as out
from hisparse.cli import bench as bench_cli
from hisparse.cli import simulate as simulate_cli
from hisparse.cli.main import main
from hisparse.tools import benchmarking
from hisparse.tools.simulation import SimulationResult, StepRecord, TraceModel, Workload


def test_the_spread_is_the_10th_and_90th_percentile() -> None:
    samples = [random.uniform(1e-4, 1e-2) for _ in range(random.randrange(2, 40))]
    p10, p90 = benchmarking.spread(samples)
    assert p10 == pytest.approx(np.percentile(samples, 10))
    assert p90 == pytest.approx(np.percentile(samples, 90))
    assert benchmarking.spread([3.0]) == (3.0, 3.0)


def test_simulate_reports_the_spread_of_its_step_times(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--device", "cpu", "--preset", "tiny", "--layers", "2", "--no-progress",
            "--requests", "2", "--steps", "6", "--warmup", "1", "--context", "300"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    timed = [s["swap_in_seconds"] for s in doc["steps"] if not s["warmup"]]
    summary = doc["summary"]
    assert summary["swap_in_seconds_p10"] == pytest.approx(np.percentile(timed, 10))
    assert summary["swap_in_seconds_p90"] == pytest.approx(np.percentile(timed, 90))
    assert summary["swap_in_seconds_per_step"] == pytest.approx(statistics.median(timed))
    assert main(argv) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("swap-in time per step"))
    assert "p10" in row and "p90" in row


def fabricated_result(seconds: list[float]) -> SimulationResult:
    steps = [StepRecord(step=i, warmup=False, hits=1, misses=1, bytes_host_to_device=64,
                        swap_in_seconds=s, planning_seconds=None, churn=None)
             for i, s in enumerate(seconds)]
    workload = Workload(requests=1, context_tokens=100, steps=len(seconds), warmup_steps=0,
                        trace=TraceModel(top_k=8))
    config = {"model": "tiny", "hot_slots": 16, "num_layers": 1, "top_k": 8, "row_bytes": 64}
    return SimulationResult("cpu", "cpu", config, workload, steps, "not measured", 0, None, None)


def test_a_wide_spread_warns_that_the_timings_cannot_be_trusted() -> None:
    noisy = simulate_cli.render(fabricated_result([1e-3] * 3 + [5e-3] * 3))
    assert "too noisy" in noisy and f"{out.NOISE_RATIO:g}x" in noisy
    quiet = simulate_cli.render(fabricated_result([1e-3, 1.1e-3, 1.05e-3, 1.02e-3]))
    assert "too noisy" not in quiet


def test_bench_tables_show_the_spread_and_warn_when_it_is_wide() -> None:
    cell = benchmarking.SW1Cell(
        layout="scattered", batch=1, churn=0.2, step_seconds=2e-3, p90_seconds=9e-3,
        misses_per_step=10.0, miss_bytes_per_second=1e6, verified=True, timing="eager",
        extent_tokens=1, p10_seconds=1e-3)
    copy = benchmarking.CopyResult("bulk host-to-device", 1 << 20, None, 1e-3, 1e9,
                                   p10_seconds=0.9e-3, p90_seconds=1.1e-3)
    backend = __import__("hisparse").get_backend("cpu")
    document = bench_cli.to_document(backend, True, "reference", benchmarking.SW1Sizes(),
                                     [cell], [copy])
    text = bench_cli.render(document)
    assert "2.00 ms (p10 1.00 ms, p90 9.00 ms)" in text
    assert "1.00 ms (p10 900.0 us, p90 1.10 ms)" in text
    assert "too noisy" in text
