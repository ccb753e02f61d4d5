"""Verify steps and shared prefixes through the Triton kernels the GPU backends bind, run under
TRITON_INTERPRET=1 on CPU tensors (`fakes.interpreted_triton.InterpretedTritonCpu`).

The CPU suite otherwise runs the engine on the torch reference, so the paths only a GPU takes
(a `SwapInLauncher` per union width U = S x K, widths that are no power of two, miss plans
and follower replays of width U, the Triton backup of accepted drafts, sharing requests
decoded through the fused kernels) would first run on the GPU. Here they run at small sizes
against the same oracles as the reference. On a GPU the CUDA backend runs the same tests
natively (`./scripts/test --backend cuda tests/test_verify_step.py ...`), so this skips.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

import test_prefix_sharing as sharing
import test_verify_step as verify
from fakes.interpreted_triton import InterpretedTritonCpu
from interpreted_kernels import KERNEL_MARK, ON_GPU, swap_in_triton
from test_reliability_fuzz import SHARING_WEIGHTS, LockstepRun

pytestmark = [KERNEL_MARK, pytest.mark.skipif(
    ON_GPU, reason="a GPU is visible: the cuda backend runs these tests natively")]

EXAMPLES = int(os.environ.get("HISPARSE_INTERPRETED_FUZZ_EXAMPLES", "6"))
# (hot slots H, top_k K, extent tokens E, index group size, max_draft_tokens D), H >= D x K:
# unions of 16..64 entries (U = 48 is no power of two), index groups replaying U-wide plans.
SHAPES = [(64, 16, 8, 2, 4), (48, 16, 4, 1, 3), (64, 32, 16, 2, 2)]


@pytest.fixture(scope="module")
def interpreted() -> InterpretedTritonCpu:
    return InterpretedTritonCpu()


class WideVerifyTrace(verify.VerifyTrace):
    """The verify fuzz at top-k 16-32: the long request outgrows the hot buffer."""

    @initialize(shape=st.sampled_from(SHAPES), validate=st.booleans(),
                residency_map=st.sampled_from(["host_row", "position"]),
                seed=st.integers(0, 2**31 - 1),
                prompts=st.lists(st.integers(1, 90), min_size=1, max_size=2))
    def build(self, shape: tuple[int, ...], validate: bool, residency_map: str, seed: int,
              prompts: list[int]) -> None:
        super().build(shape, validate, residency_map, seed, prompts)


def test_verify_steps_through_the_triton_launcher_match_the_oracle(
        interpreted: InterpretedTritonCpu) -> None:
    run_state_machine_as_test(lambda: WideVerifyTrace(interpreted), settings=settings(
        max_examples=EXAMPLES, stateful_step_count=10, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def test_a_wide_union_runs_through_the_triton_launcher_and_returns_every_row(
        interpreted: InterpretedTritonCpu, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    # The fuzz above draws its first (simplest) examples with single-token steps, so a run of
    # a few examples may never build a union: this one always does (S = 4, K = 16: U = 64).
    widths: set[int] = set()
    real = swap_in_triton.SwapInLauncher.swap_in

    def recording(self: Any, layer: int, group: int, rows: int, top_k: torch.Tensor) -> None:
        widths.add(int(top_k.shape[1]))
        real(self, layer, group, rows, top_k)

    monkeypatch.setattr(swap_in_triton.SwapInLauncher, "swap_in", recording)
    cache = verify.build_cache(64, 16, 8, 1, 4, True, "position", num_layers=1,
                               device=interpreted)
    gen = torch.Generator().manual_seed(seed)
    T, S, W = 90, 4, cache.row_bytes
    prompt = torch.randint(0, 256, (1, T, W), dtype=torch.uint8, generator=gen)
    cache.admit("r", T)
    cache.write_prefill("r", prompt)
    cache.commit_prefill("r")
    drafts = torch.randint(0, 256, (1, S, W), dtype=torch.uint8, generator=gen)
    step = cache.begin_decode_step(["r"], num_tokens=S)
    cache.write_newest(0, drafts)
    own = torch.tensor(step.positions[0])[:, None]  # [S, 1]: token s selects up to its own
    top_k = (torch.rand(S, 16, generator=gen) * (own + 1)).long().to(torch.int32)[None]
    rows = cache.swap_in(0, top_k)
    every = torch.cat([prompt[0], drafts[0]])
    assert torch.equal(cache.device_kv(0)[rows[0].long()], every[top_k[0].long()])
    step.end()
    cache.close()
    assert max(widths) == S * 16, widths


def test_attention_over_verify_rows_through_the_triton_launcher(
        interpreted: InterpretedTritonCpu, seed: int) -> None:
    verify.test_sparse_attention_over_verify_rows_equals_attention_over_the_full_kv(
        interpreted, torch.device("cpu"), seed)


@pytest.mark.parametrize("dedupe", [False, True])
def test_repeated_misses_through_the_triton_launcher(interpreted: InterpretedTritonCpu,
                                                     dedupe: bool) -> None:
    verify.test_a_repeated_missing_position_takes_one_slot_only_when_deduplicated(
        dedupe, interpreted, torch.device("cpu"))


@pytest.mark.parametrize("residency_map", sharing.MAPS)
def test_sharing_requests_decode_through_the_triton_kernels(
        interpreted: InterpretedTritonCpu, residency_map: str) -> None:
    # Index groups of 2: followers replay the anchor's plan through the Triton copy. Under
    # host_row the lookups go through alias key extents (the KEY_EXTENTS kernels).
    sharing.test_index_groups_decode_sharing_requests_side_by_side(2, interpreted,
                                                                   residency_map)
    sharing.test_ending_or_parking_one_holder_never_changes_another_holders_rows(
        interpreted, residency_map)
    sharing.test_a_shared_row_resident_in_two_buffers_serves_each_request_its_own_slot(
        residency_map, interpreted)
    # Verify steps over them: the union's swap-in (width U = 8) through the same kernels.
    sharing.test_verify_steps_decode_sharing_requests_side_by_side(2, interpreted,
                                                                   residency_map)


@pytest.mark.parametrize("residency_map", sharing.MAPS)
def test_a_moved_extent_keeps_its_keys_through_the_triton_kernels(
        interpreted: InterpretedTritonCpu, residency_map: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    sharing.test_the_moved_extent_keeps_its_hot_slots_under_the_new_key(
        residency_map, monkeypatch, interpreted)


@pytest.mark.parametrize("residency_map", sharing.MAPS)
def test_sharing_lifecycles_through_the_triton_kernels(interpreted: InterpretedTritonCpu,
                                                       seed: int, residency_map: str) -> None:
    from test_reliability_fuzz import SHAPES as FUZZ_SHAPES

    counts = LockstepRun(interpreted, FUZZ_SHAPES[seed % len(FUZZ_SHAPES)], bool(seed % 2), 24,
                         seed, SHARING_WEIGHTS, residency_map=residency_map).run(
                             decode_steps=12, max_operations=150)
    # (60 operations drew no plain admit or reserve, so nothing to share, for 1 seed in ~70:
    # (27/29)^60; at 150 it is 1 in ~45,000, and the run still stops at 12 decode steps.)
    assert counts.mismatches == 0, counts.failures
    assert counts.shared_admits > 0, counts


@pytest.mark.parametrize("residency_map", ["host_row", "position"])
def test_ragged_verify_steps_through_the_triton_kernels(
        interpreted: InterpretedTritonCpu, residency_map: str, seed: int) -> None:
    """Ragged appends in verify steps (each request appends 0..S rows and keeps 0..a_b):
    the lookup's bound for a ragged row is its last appended row, whichever query selects."""
    import test_ragged_verify as ragged

    ragged.test_ragged_verify_steps_keep_exactly_the_accepted_rows(
        interpreted, seed % 2 == 1, residency_map, seed)
    ragged.test_every_accept_case_of_one_request_and_single_token_steps_after(
        interpreted, seed)
    ragged.test_an_unvalidated_step_serves_every_appended_row_to_every_query_and_no_more(
        interpreted)
