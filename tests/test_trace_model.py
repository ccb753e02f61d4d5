"""The top-k trace model of `hisparse simulate`: every knob does what its docstring says."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.errors import InvalidInputError
from hisparse.tools.simulation import TopKTrace, TraceModel, make_traces


def run_trace(model: TraceModel, seed: int, start: int, steps: int) -> list[np.ndarray]:
    trace = TopKTrace(model, np.random.default_rng(seed))
    return [trace.step(start + t) for t in range(steps)]


def fresh_seed() -> int:
    return int(np.random.default_rng().integers(2**31))


@settings(max_examples=40, deadline=None)
@given(
    top_k=st.integers(1, 96),
    start=st.integers(1, 400),
    carryover=st.floats(0, 1),
    heavy_fraction=st.floats(0, 1),
    heavy_churn=st.floats(0, 1),
    recency_bias=st.floats(0, 1),
    recent_window=st.integers(1, 300),
    seed=st.integers(0, 2**31),
)
def test_every_step_is_a_valid_top_k(
    top_k: int, start: int, carryover: float, heavy_fraction: float, heavy_churn: float,
    recency_bias: float, recent_window: int, seed: int,
) -> None:
    model = TraceModel(
        top_k=top_k, carryover=carryover, heavy_hitters=int(heavy_fraction * top_k),
        heavy_churn=heavy_churn, recency_bias=recency_bias, recent_window=recent_window,
    )
    for offset, positions in enumerate(run_trace(model, seed, start, 6)):
        seq_len = start + offset
        assert positions.size == min(top_k, seq_len)
        assert np.unique(positions).size == positions.size, "duplicate positions"
        assert positions.min() >= 0 and positions.max() < seq_len
        assert seq_len - 1 in positions, "the newest token must always be selected"


@pytest.mark.parametrize("carryover", [0.0, 0.25, 0.6, 0.95, 1.0])
def test_overlap_with_previous_step_equals_carryover(carryover: float) -> None:
    model = TraceModel(top_k=256, carryover=carryover, heavy_hitters=16)
    steps = run_trace(model, fresh_seed(), start=20_000, steps=12)
    # The 16 heavy hitters repeat whatever the carry-over; the newest token is always new.
    expected = min(max(round(carryover * 256), 16), 255)
    for previous, current in itertools.pairwise(steps):
        assert np.intersect1d(previous, current).size == expected


def test_heavy_hitters_persist_without_churn_and_drift_with_it() -> None:
    seed = fresh_seed()
    steady = run_trace(TraceModel(top_k=128, carryover=0.0, heavy_hitters=32), seed, 50_000, 10)
    common = steady[0]
    for positions in steady[1:]:
        common = np.intersect1d(common, positions)
    # With carry-over 0 only the heavy hitters can repeat; all 32 must be in every step.
    assert common.size == 32

    drifting = run_trace(
        TraceModel(top_k=128, carryover=0.0, heavy_hitters=32, heavy_churn=1.0), seed, 50_000, 3
    )
    # Fresh picks may coincide by chance (about 128 * 128 / 50_000 = 0.3 expected); kept heavy
    # hitters would add 32. Well under that shows they all moved.
    assert np.intersect1d(drifting[1], drifting[2]).size < 8


def test_recency_bias_concentrates_fresh_picks_in_the_window() -> None:
    seq_len, window = 100_000, 1000
    for bias in (0.0, 0.5, 1.0):
        model = TraceModel(top_k=512, carryover=0.0, heavy_hitters=0, recency_bias=bias,
                           recent_window=window)
        positions = np.concatenate(run_trace(model, fresh_seed(), seq_len, 4)[1:])
        in_window = np.mean(positions >= seq_len - window)
        # A uniform pick lands in the window with probability window / seq_len = 1%.
        expected = bias + (1 - bias) * window / seq_len
        assert abs(in_window - expected) < 0.05, (bias, in_window)


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    model = TraceModel(top_k=64, heavy_hitters=8, heavy_churn=0.1)
    seed = fresh_seed()
    first = make_traces(model, num_requests=2, num_groups=3, seed=seed)
    again = make_traces(model, num_requests=2, num_groups=3, seed=seed)
    other = make_traces(model, num_requests=2, num_groups=3, seed=seed + 1)
    a = [first[1][2].step(5000 + t) for t in range(4)]
    b = [again[1][2].step(5000 + t) for t in range(4)]
    c = [other[1][2].step(5000 + t) for t in range(4)]
    d = [first[0][0].step(5000 + t) for t in range(4)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0], d[0]), "streams of different (request, group) must differ"


@pytest.mark.parametrize(
    ("knobs", "named"),
    [
        ({"carryover": 1.5}, "carryover"),
        ({"recency_bias": -0.1}, "recency_bias"),
        ({"heavy_hitters": 3000}, "heavy_hitters"),
        ({"recent_window": 0}, "recent_window"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_bad_knobs_are_rejected_by_name(knobs: dict[str, float], named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        TraceModel(**knobs)
