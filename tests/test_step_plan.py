"""The step plan: every choice of a step's path, made once, frozen and printable.

Each field is checked against what the path must be for the pool's role and the bound
launcher's capabilities (written out here, independently of `plan_step`), and the steps the
cache opens carry exactly the plan `step_plan` shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fakes.noop_kernels import NoopKernelCpu
from hisparse import HiSparseCache, HiSparseConfig
from hisparse.core.plan import PoolRole, StepPlan
from hisparse.core.shared_pool import SharedPoolSpec

CONFIG = dict(num_layers=3, top_k=4, hot_slots=12, index_group_size=1, max_requests=4,
              max_seq_len=64, host_pool_tokens=256, extent_tokens=16, max_draft_tokens=3)


def _expected(role: PoolRole, tokens: int, dedupe: bool, folds: bool) -> dict[str, object]:
    """What the path must be: written from the rules, not from the plan function."""
    union = tokens > 1 or dedupe
    reader = role is PoolRole.READER
    lookup_backup = folds and not union and not reader
    return dict(union=union, quiet_advance=not union, wait_for_writer=reader,
                wait_for_readers_at_begin=lookup_backup and role is PoolRole.WRITER,
                writes_host_rows=not reader, fold_newest=folds and not union,
                backup_in_lookup=lookup_backup, backup="none" if reader else "compute stream")


@pytest.mark.parametrize("kernels", ["cpu", "noop"])
@pytest.mark.parametrize(("tokens", "dedupe"), [(1, False), (1, True), (2, False), (3, False)])
def test_a_private_caches_plan_follows_its_launcher_and_the_step_kind(
        kernels: str, tokens: int, dedupe: bool) -> None:
    config = HiSparseConfig.from_preset("tiny", **CONFIG)
    cache = HiSparseCache(config, NoopKernelCpu() if kernels == "noop" else "cpu")
    plan = cache.step_plan(2, tokens, dedupe)
    got = {name: getattr(plan, name) for name in _expected(PoolRole.PRIVATE, 1, False, False)}
    assert got == _expected(PoolRole.PRIVATE, tokens, dedupe, folds=kernels == "noop"), plan
    assert (plan.batch_size, plan.num_tokens, plan.dedupe) == (2, tokens, dedupe)
    assert plan.pool_role is PoolRole.PRIVATE and plan.follower_replay == "none"
    assert plan.kernels == "torch reference"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.union = not plan.union  # type: ignore[misc]
    text = str(plan)
    assert all(name in text for name in StepPlan.__dataclass_fields__), text
    cache.close()


@pytest.mark.parametrize(("tokens", "dedupe"), [(1, False), (1, True), (2, False)])
def test_a_shared_pools_ranks_wait_where_their_role_needs_it(
        pool_name: str, tokens: int, dedupe: bool) -> None:
    config = HiSparseConfig.from_preset("tiny", **CONFIG)
    writer = HiSparseCache(config, NoopKernelCpu(), shared_pool=SharedPoolSpec(pool_name, 0, 2))
    reader = HiSparseCache(config, NoopKernelCpu(), shared_pool=SharedPoolSpec(pool_name, 1, 2))
    for cache, role in ((writer, PoolRole.WRITER), (reader, PoolRole.READER)):
        plan = cache.step_plan(1, tokens, dedupe)
        got = {name: getattr(plan, name) for name in _expected(role, 1, False, False)}
        assert plan.pool_role is role
        assert got == _expected(role, tokens, dedupe, folds=True), plan
    reader.close()
    writer.close()


def test_a_step_carries_the_plan_step_plan_shows() -> None:
    config = HiSparseConfig.from_preset("tiny", **{**CONFIG, "index_group_size": 3})
    cache = HiSparseCache(config, "cpu")
    cache.admit("a", 20)
    cache.write_prefill("a", torch.zeros(3, 20, cache.row_bytes, dtype=torch.uint8))
    cache.commit_prefill("a")
    for tokens, dedupe in ((1, False), (2, False), (1, True)):
        step = cache.begin_decode_step(["a"], num_tokens=tokens, dedupe=dedupe)
        assert step.plan is cache.step_plan(1, tokens, dedupe)
        assert step.plan.follower_replay == "inline"
        step.cancel()
    cache.close()
