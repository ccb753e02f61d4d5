"""commit_prefill refuses a prompt with rows never written: such a row holds what its previous
owner (another request) left in the host pool, and would be seeded and served as this one's KV.
`PromptCoverage` against a per-row model, and the engine's refusal end to end."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hisparse
from hisparse.core.requests import PromptCoverage
from hisparse.errors import InvalidInputError
from test_engine_trace import assert_unchanged, snapshot


@st.composite
def writes(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int, int]]]:
    layers, tokens = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    chunks = draw(st.lists(
        st.tuples(st.integers(0, layers - 1), st.integers(0, tokens - 1), st.integers(1, 12)),
        max_size=12))
    return layers, tokens, [(layer, s, min(tokens, s + n)) for layer, s, n in chunks]


@settings(max_examples=300, deadline=None)
@given(writes())
def test_the_first_gap_is_the_first_row_never_written(
    case: tuple[int, int, list[tuple[int, int, int]]],
) -> None:
    layers, tokens, chunks = case
    coverage, written = PromptCoverage(layers, tokens), np.zeros((layers, tokens), dtype=bool)
    for layer, start, end in chunks:
        coverage.add(layer, start, end)
        written[layer, start:end] = True
    expected = None
    for layer in range(layers):
        missing = np.flatnonzero(~written[layer])
        if missing.size:
            start = int(missing[0])
            end = start + int(np.argmax(written[layer, start:])) if written[layer, start:].any() \
                else tokens
            expected = (layer, start, end)
            break
    assert coverage.first_gap() == expected


@pytest.mark.parametrize("backend_name", hisparse.available_backends())
def test_a_prompt_with_unwritten_rows_is_not_committed(
    backend_name: str, rng: torch.Generator
) -> None:
    """Request a fills the pool's rows and finishes; b gets the same rows. Until b has written
    every row of every layer, its commit is refused and changes nothing; then its hot buffer
    holds b's bytes, not a's."""
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", max_requests=1, host_pool_tokens=64, extent_tokens=16, max_seq_len=64)
    with hisparse.HiSparseCache(config, device=backend_name) as cache:
        L, W, T = cache.num_layers, cache.row_bytes, 40
        old = torch.randint(0, 256, (L, T, W), dtype=torch.uint8, generator=rng)
        cache.admit("a", T)
        cache.write_prefill("a", old)
        cache.commit_prefill("a")
        cache.finish("a")
        new = torch.randint(0, 256, (L, T, W), dtype=torch.uint8, generator=rng)
        cache.admit("b", T)
        cache.write_prefill("b", new[:, :25])  # all layers, rows 0..24
        cache.write_prefill("b", new[0, 25:], layer=0, start=25)  # layer 0 complete
        before = snapshot(cache)
        gap = re.escape("rows 25..39 of layer 1 of request 'b'")
        with pytest.raises(InvalidInputError, match=gap):
            cache.commit_prefill("b")
        assert_unchanged(before, cache)
        for layer in range(1, L):
            cache.write_prefill("b", new[layer, 25:], layer=layer, start=25)
        cache.commit_prefill("b")
        cache.backend.synchronize()
        base = cache.request_slot("b") * cache.slots_per_request
        H = cache.hot_slots
        first = max(0, T - 1 - H)
        for layer in range(L):
            held = cache.device_kv(layer)[base : base + min(T, H)].cpu()
            assert torch.equal(held, new[layer, first : first + min(T, H)])
