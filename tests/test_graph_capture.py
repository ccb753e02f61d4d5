"""A padded batch's swap-in captured once in a CUDA graph, replayed with changing real counts
and inputs, gives exactly what the eager torch reference gives on a twin of the state."""

from __future__ import annotations

import functools

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("graph capture needs a CUDA or ROCm GPU; none is visible", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'hisparse[triton]')")

from hisparse.kernels.swap_in import copy_planned_triton, swap_in_triton, tuning
from hisparse.kernels.swap_in.reference import copy_planned_reference, swap_in_reference
from hisparse.layout.tables import MissPlan
from test_swap_in_triton import (
    DEVICE,
    POISON,
    SIZES,
    VARIANTS,
    assert_plan_matches,
    assert_rows_match_host,
    assert_same_state,
    clone_tables,
    make_tables,
    next_top_k,
    plans_in_address_order,
)

pytestmark = pytest.mark.gpu


# Every launch variant that could become the default, captured and replayed.
GRAPH_VARIANTS = ["default", "no-pdl", "bit-search", "prefetched-copy", "no-prefetched-copy",
                  "pdl-copy-wide", "address-order", "batch-row-order"]


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"K{s.top_k}-H{s.hot}-W{s.row_bytes}")
@pytest.mark.parametrize(("variant", "residency_map"), [
    *(pytest.param(v, "host_row", id=v) for v in GRAPH_VARIANTS),
    *(pytest.param(v, "position", id=f"position-keyed-{v}")
      for v in ("default", "prefetched-copy", "address-order")),
])
def test_graph_replay_matches_eager_reference(sizes, variant: str, residency_map: str,
                                              rng: torch.Generator) -> None:
    with tuning(**VARIANTS[variant]) as tune:
        _replay_matches_eager(sizes, rng, residency_map, functools.partial(
            assert_plan_matches, address_order=plans_in_address_order(tune, sizes),
            buckets=tune.address_buckets,
            poisoned=False))


def _replay_matches_eager(sizes, rng: torch.Generator, residency_map: str, check_plan) -> None:
    gen = rng
    want = make_tables(sizes, gen, residency_map)
    got = clone_tables(want)
    previous: dict[int, list[int]] = {}
    req_slots, top_k, num_real = next_top_k(want, sizes, previous, gen)
    out = torch.full_like(top_k, POISON)
    plan = MissPlan.empty(sizes.batch_cap, sizes.top_k, DEVICE)

    def step() -> None:
        swap_in_triton(got, 0, 0, req_slots, top_k, num_real, out, plan)
        copy_planned_triton(got, 1, plan)  # follower layer of group 0

    def reference_step(out_want: torch.Tensor) -> MissPlan:
        plan_want = MissPlan.empty(sizes.batch_cap, sizes.top_k, DEVICE)
        swap_in_reference(want, 0, 0, req_slots, top_k, num_real, out_want, plan_want)
        copy_planned_reference(want, 1, plan_want)
        return plan_want

    # The eager call compiles the kernels and allocates their scratch outside the graph.
    out_want = torch.full_like(top_k, POISON)
    plan_want = reference_step(out_want)
    step()
    assert torch.equal(out, out_want)
    check_plan(plan, plan_want, num_host_rows=got.num_host_rows)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    real_counts = []
    for _ in range(5):
        new_slots, new_top_k, new_real = next_top_k(want, sizes, previous, gen)
        req_slots.copy_(new_slots)
        top_k.copy_(new_top_k)
        num_real.copy_(new_real)
        real_counts.append(int(new_real))
        out.fill_(POISON)
        graph.replay()
        out_want = torch.full_like(top_k, POISON)
        plan_want = reference_step(out_want)
        assert torch.equal(out, out_want)
        check_plan(plan, plan_want, num_host_rows=got.num_host_rows)
        assert_same_state(got, want)
        for layer in (0, 1):
            assert_rows_match_host(got, layer, req_slots, top_k, out)
    assert len(set(real_counts)) > 1 or sizes.batch_cap == 1, "replays never changed num_real"
