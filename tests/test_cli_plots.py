"""The figures `--plot` writes are readable whatever the device: a CPU's rates (0.02-0.2 GB/s)
next to the H200's 44 GB/s target used to lie on the zero line of a linear axis, and the
simulate figure's grey warm-up band had no legend."""

from __future__ import annotations

import math
import random

import pytest

import hisparse
from hisparse.cli import bench as bench_cli
from hisparse.cli import simulate as simulate_cli
from hisparse.tools import benchmarking
from test_cli_timing_spread import fabricated_result

pyplot = pytest.importorskip("matplotlib.pyplot", reason="matplotlib is not installed "
                             "(pip install 'hisparse[tools]')")


def bench_document(low: float, high: float) -> dict:
    """SW-1 cells and copy limits whose rates span [low, high] bytes/s."""
    rates = iter([low, high, *(random.uniform(low, high) for _ in range(4))])
    cells = [benchmarking.SW1Cell(
        layout=layout, batch=batch, churn=0.2, step_seconds=1e-3, p90_seconds=1e-3,
        misses_per_step=100.0, miss_bytes_per_second=next(rates), verified=True,
        timing="eager", extent_tokens=512, p10_seconds=1e-3)
        for layout in ("scattered", "extents") for batch in (1, 4, 64)]
    copies = [benchmarking.CopyResult(name, 2048 * 656 if rows else 1 << 26, rows, 1e-3,
                                      random.uniform(low, high))
              for name, rows in (("bulk host-to-device", None), ("gather", 2048))]
    return bench_cli.to_document(hisparse.get_backend("cpu"), True, "reference",
                                 benchmarking.SW1Sizes(), cells, copies)


def visible_share(low: float, high: float, limits: tuple[float, float], log: bool) -> float:
    """The share of the axis the data [low, high] spans."""
    scale = math.log10 if log else (lambda v: v)
    return (scale(high) - scale(low)) / (scale(limits[1]) - scale(max(limits[0], 1e-12)))


def test_cpu_rates_are_readable_beside_the_h200_target() -> None:
    document = bench_document(0.02e9, 0.2e9)
    figure = bench_cli.draw(pyplot, document)
    try:
        sw1_axes, copy_axes = figure.axes
        rates = [c["miss_bytes_per_second"] / 1e9 for c in document["sw1"]["cells"]]
        log = sw1_axes.get_yscale() == "log"
        assert log and visible_share(min(rates), max(rates), sw1_axes.get_ylim(), log) > 0.2
        assert sw1_axes.get_ylim()[0] <= min(rates) and sw1_axes.get_ylim()[1] >= 44
        bars = [r["bytes_per_second"] / 1e9 for r in document["copy_limits"]]
        assert copy_axes.get_xscale() == "log" and copy_axes.get_xlim()[0] <= min(bars)
    finally:
        pyplot.close(figure)


def test_rates_near_the_target_keep_a_linear_axis() -> None:
    figure = bench_cli.draw(pyplot, bench_document(30e9, 50e9))
    try:
        sw1_axes, copy_axes = figure.axes
        assert sw1_axes.get_yscale() == "linear" and copy_axes.get_xscale() == "linear"
    finally:
        pyplot.close(figure)


def test_the_simulate_figure_names_its_warm_up_band() -> None:
    result = fabricated_result([1e-3] * 6)
    result.workload = type(result.workload)(**{**result.workload.__dict__, "warmup_steps": 2})
    figure = simulate_cli.draw(pyplot, result)
    try:
        labels = [text.get_text() for axes in figure.axes if axes.get_legend()
                  for text in axes.get_legend().get_texts()]
        assert any("warm-up" in label for label in labels), labels
    finally:
        pyplot.close(figure)
