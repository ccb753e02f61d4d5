"""Quiet decode steps (core.batch.QuietRun): a batch whose next step is its last one moved on
by a token skips the plan and the upload, and the device moves its buffers on instead.

A cache that takes that path must end every call in exactly the state of one that plans
every step: the batch buffers, every device table, the host rows and the rows each swap-in
returns. Two caches make the same random lifecycle calls with the same random data, one with
quiet steps turned off, and are compared after each call.
"""

from __future__ import annotations

import random

import pytest
import torch

import hisparse
from hisparse.core.batch import QuietRun
from hisparse.core.host_pool import token_rows
from hisparse.errors import HisparseError
from test_slot_state import L, W, _cache, _lifecycle_call


def _state(cache: hisparse.HiSparseCache) -> list[torch.Tensor]:
    """The batch buffers, every device table and each live request's host rows (the rest of
    the host pool was never written)."""
    t = cache.tables
    host = cache.host_tensors()
    rows = [torch.from_numpy(token_rows(r.extents, cache.extent_tokens, 0, r.num_tokens))
            for r in sorted(cache._requests, key=lambda r: str(r.request_id))]
    return [*cache._decode.buffers.state(), t.device_kv, t.page_table, t.seq_lens, t.slot_key,
            t.last_use, t.lru_clock, t.resident, t.counters,
            *(layer[r.long()] for layer in host for r in rows)]


def _advances(cache: hisparse.HiSparseCache) -> list[int]:
    """Count the cache's quiet steps (the advance launches)."""
    kernels, calls = cache._decode.kernels, []
    advance = kernels._advance

    def counted(rows: int) -> None:
        calls.append(rows)
        advance(rows)

    kernels._advance = counted
    return calls


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_quiet_steps_leave_every_table_and_row_as_planned_steps_do(
        monkeypatch: pytest.MonkeyPatch, group: int, seed: int) -> None:
    quiet, planned = _cache(False, group), _cache(False, group)
    for cache in (quiet, planned):  # PD-transferred rows are never written: alike in both
        for layer in cache.host_tensors():
            layer.zero_()
    advances = _advances(quiet)
    names: dict[int, list[str]] = {id(quiet): [], id(planned): []}
    handles: dict[int, list[object]] = {id(quiet): [], id(planned): []}
    for call in range(150):
        outcomes = []
        for cache in (quiet, planned):
            with monkeypatch.context() as patch:
                if cache is planned:
                    patch.setattr(QuietRun, "after", classmethod(lambda cls, *args: None))
                torch.manual_seed(seed * 1000 + call)  # the same rows for both
                try:
                    _lifecycle_call(cache, random.Random(seed * 1000 + call), names[id(cache)],
                                    handles[id(cache)])
                    outcomes.append(None)
                except HisparseError as exc:
                    outcomes.append(type(exc))
                    if cache._step is not None:
                        cache._step.cancel()
        assert outcomes[0] == outcomes[1], call
        for a, b in zip(_state(quiet), _state(planned), strict=True):
            assert torch.equal(a, b), call
    assert len(advances) >= 3  # the lifecycles took quiet steps
    quiet.close()
    planned.close()


def _long_requests(cache: hisparse.HiSparseCache, count: int, tokens: int) -> list[str]:
    ids = [f"r{i}" for i in range(count)]
    for request_id in ids:
        cache.admit(request_id, tokens)
        cache.write_prefill(request_id, torch.randint(0, 256, (L, tokens, W), dtype=torch.uint8))
        cache.commit_prefill(request_id)
    return ids


def _decode(cache: hisparse.HiSparseCache, ids: list[str]) -> hisparse.core.step.DecodeStep:
    step = cache.begin_decode_step(ids)
    for layer in range(L):
        step.write_newest(layer, torch.zeros(len(ids), W, dtype=torch.uint8))
    return step


def test_a_batch_moves_on_until_a_token_starts_an_extent_and_a_cancel_ends_the_run() -> None:
    cache = _cache(False, 1)  # 4-token extents, 8 hot slots
    ids = _long_requests(cache, 2, 13)  # new tokens at 13, 14, ... (offsets 1, 2, 3, 0, ...)
    advances = _advances(cache)
    for _ in range(3):
        _decode(cache, ids).end()
    # 13 planned (quiet for 14, 15), 16 starts an extent: planned again.
    assert advances == [2, 2]
    _decode(cache, ids).end()  # 16: planned, then 17, 18, 19 may move on
    _decode(cache, ids).end()
    assert advances == [2, 2, 2]
    _decode(cache, ids).cancel()  # 18, moved on and cancelled
    _decode(cache, ids).end()  # 18 again: after a cancel it is planned
    assert advances == [2, 2, 2, 2]
    assert [cache.seq_len(i) for i in ids] == [19, 19]
    cache.close()


def test_validate_mode_catches_a_batch_that_did_not_move_on() -> None:
    cache = _cache(True, 1)
    ids = _long_requests(cache, 2, 13)
    _decode(cache, ids).end()
    cache._decode.kernels._advance = lambda rows: None  # a broken advance
    with pytest.raises(AssertionError, match="quiet step's moved-on batch"):
        cache.begin_decode_step(ids)
