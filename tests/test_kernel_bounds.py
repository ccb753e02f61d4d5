"""The decode path's Triton kernels never address bytes outside the tensors they are given:
interpreted on the CPU with bounds checks (`fakes.bounds_checked_interpreter`), the CPU's
stand-in for compute-sanitizer's memcheck, through the whole engine.

Two workloads. The combination fuzz (hisparse.tools.combination_fuzz) draws every kind of step
(verify, dedupe, ragged, cancels, prefixes, PD, preemption) against its plain-Python model.
The other is benchmarks/host_overhead.py's at a small shape: cells of several batch sizes
sharing their requests, each cell's steps interleaved with the others' and replayed after
them (the pattern whose 61-layer run once hit an illegal address on an H100,
benchmarks/NOTES.md, twenty-ninth pass), with and without churn, the new rows written
separately or folded into the swap-in, quiet steps and planned ones, equal and ragged lengths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fakes import bounds_checked_interpreter as bounds
from fakes.interpreted_triton import InterpretedTritonCpu
from hisparse.tools.combination_fuzz import FUZZ_CONFIG, FuzzRank
from hisparse.tools.shared_pool_run import _cache
from interpreted_kernels import KERNEL_MARK, ON_GPU

pytestmark = [KERNEL_MARK, pytest.mark.skipif(
    ON_GPU, reason="a GPU is visible: its kernels are compiled, not interpreted"),
    pytest.mark.skipif(bounds.unsupported_reason() is not None,
                       reason=str(bounds.unsupported_reason()))]

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _toy_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def read_at(src, dst, offset, n, BLOCK: tl.constexpr):
        lanes = tl.arange(0, BLOCK)
        tl.store(dst + lanes, tl.load(src + offset + lanes, mask=lanes < n), mask=lanes < n)

    return read_at


@pytest.mark.parametrize(("offset", "n", "fails"), [(0, 8, False), (4, 4, False),
                                                    (4, 5, True), (-1, 1, True),
                                                    (100, 0, False)])
def test_the_checks_catch_a_lane_past_a_tensor_and_only_active_lanes(
        offset: int, n: int, fails: bool) -> None:
    """The control: one lane past the end (or before the start) raises, naming the kernel;
    masked-off lanes may point anywhere."""
    kernel = _toy_kernel()
    src, dst = torch.arange(8, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
    with bounds.bounds_checked() as ranges:
        if fails:
            with pytest.raises(Exception, match=r"read_at: a load of 1 lane\(s\) outside"):
                kernel[(1,)](src, dst, offset, n, BLOCK=16)
        else:
            kernel[(1,)](src, dst, offset, n, BLOCK=16)
            assert dst[:n].tolist() == list(range(offset, offset + n))
    assert ranges.checks == (1 if fails else 2)  # the load, then (in bounds) the store


@pytest.mark.parametrize("shape", [
    {},
    {"residency_map": "position"},
    {"extent_tokens": 32, "hot_slots": 48},
], ids=["host-row map", "position map", "long extents"])
def test_the_host_overhead_workload_stays_in_bounds(
        shape: dict[str, Any], seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import host_overhead

    made: list[Any] = []
    original = host_overhead.make_cache

    def make_cache(*args: Any, **kwargs: Any) -> Any:
        cache = original(*args, **kwargs)
        bounds.allow_host_pool(cache)
        made.append(cache)
        return cache

    monkeypatch.setattr(host_overhead, "make_cache", make_cache)
    seed %= 2**16
    config = {"top_k": 8, "row_bytes": 32, "hot_slots": 24, "extent_tokens": 8,
              "index_group_size": 1, **shape}
    with bounds.bounds_checked() as ranges:
        result = host_overhead.measure(
            InterpretedTritonCpu(), [1, 3], [0.0, 0.5], 64, 1, 4, 2, False, False, seed,
            config, seed % 2 == 1, None, 2, False, ("separate", "folded"), 0.0, "sleep", 0)
    cells = result["cells"]
    assert len(cells) == 2 * 2 * 2 and ranges.checks > 1000, (len(cells), ranges.checks)
    # The churned cells did miss: the kernels moved rows, not only looked them up.
    assert all(cell["misses_per_step"] > 0 for cell in cells if cell["churn"] > 0), cells
    assert len(made) == 1


@pytest.mark.parametrize("shape", [
    {"index_group_size": 1, "residency_map": "position"},
    {"index_group_size": 2, "residency_map": "host_row"},
    {"index_group_size": 3, "residency_map": "host_row", "alias_extents": 16},
], ids=["position map", "host-row map, groups of 2", "alias extents, groups of 3"])
def test_the_combination_fuzz_through_the_triton_kernels_is_exact_and_in_bounds(
        shape: dict[str, Any], seed: int) -> None:
    cache = _cache(None, 0, 1, InterpretedTritonCpu(), {**FUZZ_CONFIG, **shape})
    try:
        with bounds.bounds_checked() as ranges:
            bounds.allow_host_pool(cache)
            fuzz = FuzzRank(cache, seed, writer=True, folded=0.5)
            counts = fuzz.run(50)
            # A cancel comes in one decode step in ten, so 50 steps draw none about once in
            # 200 seeds: run on, 50 steps at a time, until every kind has been drawn.
            while not (counts["verify_steps"] and counts["ragged_steps"] and counts["cancels"]
                       ) and counts["steps"] < 400:
                counts = fuzz.run(counts["steps"] + 50)
    finally:
        cache.close()
    assert counts["mismatches"] == 0, (shape, seed, fuzz.mismatch_details)
    assert counts["verify_steps"] and counts["ragged_steps"] and counts["cancels"], counts
    assert ranges.checks > 10000, ranges.checks
