"""The combination fuzz (hisparse.tools.combination_fuzz): every capability drawn together,
every returned row checked byte for byte against the plain-Python model, on every rank.

A step draws S from 1 to `max_draft_tokens` (verify steps with random accept counts),
`dedupe`, ragged appends (0..S rows a request, 0..a_b kept), folded or two-call newest rows
and a cancel after a random layer; between steps come admits (whole or chunked prefill), PD
reservations, preempt/resume, finish/abort in any order, and, where the residency map
allows, retained, shared and released prefixes.
Hypothesis draws the config (index groups, residency map, alias key extents) and the seed.
On a shared pool the ranks are real processes and the writer's backups land late at random,
only once the readers have read past them or wait for them (tests/fakes/gated_writer.py): a
missing wait anywhere is a mismatch on a reader, on every run.

Long mode (a GPU, where CUDA's asynchrony is what exposes ordering holes):
`benchmarks/shared_pool.py --device cuda --ranks 2 4 --fuzz-steps 50000 --fuzz-folded 1.0`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shared_pool_workers as workers
from hisparse.tools.combination_fuzz import FUZZ_CONFIG, FuzzRank
from hisparse.tools.shared_pool_run import _cache, describe_failure, run_group

# (index groups, residency map, alias key extents): the shapes the fuzz draws from.
SHAPES = st.sampled_from([
    dict(index_group_size=1, residency_map="position"),
    dict(index_group_size=2, residency_map="position"),
    dict(index_group_size=1, residency_map="host_row"),
    dict(index_group_size=3, residency_map="host_row", alias_extents=16),
])


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(shape=SHAPES, seed=st.integers(0, 2**31 - 1), folded=st.sampled_from([0.0, 0.5, 1.0]))
def test_every_step_of_every_kind_is_byte_exact_on_a_private_pool(
        shape: dict[str, object], seed: int, folded: float) -> None:
    cache = _cache(None, 0, 1, "cpu", {**FUZZ_CONFIG, **shape})
    try:
        fuzz = FuzzRank(cache, seed, writer=True, folded=folded)
        counts = fuzz.run(150)
    finally:
        cache.close()
    assert counts["mismatches"] == 0, (shape, seed, fuzz.mismatch_details)
    assert counts["verify_steps"] and counts["cancels"] and counts["rejected_drafts"], counts
    assert counts["ragged_steps"] and counts["ragged_verify_steps"], counts
    assert counts.get("leaked_extents", 0) == 0, counts


@pytest.mark.parametrize(("ranks", "shape"), [
    (2, dict(index_group_size=2, residency_map="position")),
    (3, dict(index_group_size=1, residency_map="host_row", alias_extents=16)),
])
def test_every_step_of_every_kind_is_byte_exact_on_every_rank_of_a_shared_pool(
        pool_name: str, ranks: int, shape: dict[str, object]) -> None:
    seed = int(torch.randint(0, 2**31, (1,)))
    results = run_group(workers.gated_fuzz_rank, [
        dict(name=pool_name, rank=rank, ranks=ranks, seed=seed, steps=150, overrides=shape,
             gate_share=0.5) for rank in range(ranks)], timeout_s=300)
    assert not describe_failure(results), describe_failure(results)
    counts = [{k: v for k, v in r.items() if k not in ("rank", "checked_rows")}
              for r in results]
    assert all(c == counts[0] for c in counts), (seed, counts)  # the same calls, alike
    assert counts[0]["mismatches"] == 0 and results[1]["checked_rows"] > 10000, (seed, results)
    assert counts[0]["verify_steps"] and counts[0]["dedupe_steps"], counts[0]
    assert counts[0]["ragged_verify_steps"], counts[0]
    assert counts[0]["shared_admits"] and counts[0]["cancels"], counts[0]
