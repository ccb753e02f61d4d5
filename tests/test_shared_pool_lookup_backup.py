"""The writer's newest-row backup inside its swap-in's lookup, on a shared host pool.

The hypothesis behind the wrong rows readers once read with this path on (and the experiment
that decides it): the lookup writes the new token's host row during the step, before the
step's end waits for readers of recycled rows (`SharedPoolSync.before_write`). A step that
takes a new extent gets one a finish just freed; a reader still inside its own earlier step
(a rank lags, its kernels queued) then reads the finished request's rows after the writer's
lookup overwrote them. The test makes that interleaving happen, deterministically: the two
ranks are threads of one process; the reader stops between two layers of a step that reads
request A's host rows until the writer has finished A and swapped in the next step of C,
whose new token lands in A's freed extent (or until the writer waits for the reader, which
the fix makes it do at that begin). Without the wait the reader reads C's new row where A's
token should be; with it, never.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from fakes.interpreted_triton import InterpretedTritonCpu
from hisparse import HiSparseCache, HiSparseConfig
from hisparse.core import plan as plan_module
from hisparse.core.shared_pool import SharedPoolSpec
from hisparse.tools.shared_pool_run import kv_at, prompt_rows

pytestmark = pytest.mark.interpreter
# 4 extents of 16 rows: A (20 tokens) and C (31) fill them; C's token 32 takes one A freed.
CONFIG = dict(num_layers=2, top_k=4, hot_slots=8, index_group_size=1, max_requests=2,
              max_seq_len=64, host_pool_tokens=64, extent_tokens=16)
PICKS = [0, 1, 16, 17]  # A's oldest rows: on the host only


def _prefill(cache: HiSparseCache, request: str, seed: int, length: int) -> None:
    cache.admit(request, length)
    cache.write_prefill(request, prompt_rows(seed, 0, length, cache.num_layers, cache.row_bytes))
    cache.commit_prefill(request)


def _kv(seeds: list[int], positions: list[int], layer: int, cache: HiSparseCache
        ) -> torch.Tensor:
    return torch.from_numpy(kv_at(np.array(seeds), np.array(positions), layer, cache.row_bytes))


def _writer(cache: HiSparseCache, reader_paused: threading.Event, moved_on: threading.Event,
            first_step: Any) -> None:
    reader_paused.wait()
    first_step()  # the step the reader is still in
    cache.finish("a")
    step = cache.begin_decode_step(["c"])  # C's token 32 takes an extent A freed
    top_k = torch.tensor([[31, -1, -1, -1]], dtype=torch.int32)
    for layer in range(cache.num_layers):
        step.swap_in(layer, top_k, newest_kv=_kv([3], [32], layer, cache))
    moved_on.set()
    step.end()


@pytest.mark.parametrize("wait_at_begin", [True, False], ids=["fixed", "without-the-wait"])
def test_a_reader_mid_step_never_reads_the_writers_lookup_backup_over_freed_rows(
        pool_name: str, wait_at_begin: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not wait_at_begin:  # the experiment's control: the plan without the writer's wait
        plan_step = plan_module.plan_step

        def unwaited(*args: Any, **kwargs: Any) -> plan_module.StepPlan:
            import dataclasses
            return dataclasses.replace(plan_step(*args, **kwargs),
                                       wait_for_readers_at_begin=False)

        monkeypatch.setattr(plan_module, "plan_step", unwaited)
    config = HiSparseConfig.from_preset("tiny", **CONFIG)
    writer = HiSparseCache(config, InterpretedTritonCpu(),
                           shared_pool=SharedPoolSpec(pool_name, 0, 2, wait_timeout_s=30))
    reader = HiSparseCache(config, "cpu",
                           shared_pool=SharedPoolSpec(pool_name, 1, 2, wait_timeout_s=30))
    plan = writer.step_plan(1)
    assert plan.backup_in_lookup and plan.wait_for_readers_at_begin == wait_at_begin, plan
    assert not reader.step_plan(1).backup_in_lookup
    for cache in (writer, reader):
        _prefill(cache, "a", 1, 20)
        _prefill(cache, "c", 3, 31)
    reader_paused, moved_on = threading.Event(), threading.Event()
    # The writer waiting for the reader (the fix) also lets the reader go on.
    sync_wait = writer._shared._wait

    def noting_wait(*args: Any) -> None:
        moved_on.set()
        sync_wait(*args)

    writer._shared._wait = noting_wait
    top_k = torch.tensor([PICKS, [31, 30, -1, -1]], dtype=torch.int32)

    def step_of_a_and_c(cache: HiSparseCache, pause: bool) -> int:
        """Tokens 20 of A and 31 of C; returns how many of A's rows were not A's bytes."""
        step = cache.begin_decode_step(["a", "c"])
        wrong = 0
        for layer in range(cache.num_layers):
            new = torch.stack([_kv([1], [20], layer, cache)[0], _kv([3], [31], layer, cache)[0]])
            step.write_newest(layer, new)
            if pause and layer == 1:
                reader_paused.set()
                moved_on.wait()
            rows = step.swap_in(layer, top_k)
            got = cache.device_kv(layer)[rows[0].long()].numpy()
            wrong += int((got != kv_at(np.full(4, 1), np.array(PICKS), layer,
                                       cache.row_bytes)).any(axis=1).sum())
        step.end()
        return wrong

    thread = threading.Thread(target=_writer, args=(
        writer, reader_paused, moved_on, lambda: step_of_a_and_c(writer, False)))
    thread.start()
    try:
        wrong = step_of_a_and_c(reader, pause=True)
        reader.finish("a")
        reader_step = reader.begin_decode_step(["c"])
        for layer in range(reader.num_layers):
            reader_step.swap_in(layer, torch.tensor([[31, -1, -1, -1]], dtype=torch.int32),
                                newest_kv=_kv([3], [32], layer, reader))
        reader_step.end()
    finally:
        moved_on.set()
        thread.join()
    reader.close()
    writer.close()
    assert (wrong == 0) if wait_at_begin else (wrong > 0), wrong
