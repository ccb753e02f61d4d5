"""The reference attention hides nothing: only a row with nothing to attend to is zeroed (a NaN
or infinity in the selected keys must show in the output), and an index that is neither -1 nor
a row is refused rather than read as masked."""

from __future__ import annotations

import math

import pytest
import torch

from hisparse.attention import sparse_mla_decode_reference
from hisparse.errors import InvalidInputError

WIDTH = 576  # 512 latent + 64 rope, bf16
HEADS = 2


def naive(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """Per batch row and head with plain loops: the independent model."""
    out = torch.zeros(q.shape[0], q.shape[1], 512)
    for b in range(q.shape[0]):
        keys = kv[[i for i in indices[b].tolist() if i >= 0]].float()
        if keys.shape[0] == 0:
            continue
        for h in range(q.shape[1]):
            weights = torch.softmax((keys @ q[b, h].float()) * scale, dim=0)
            out[b, h] = weights @ keys[:, :512]
    return out


def test_non_finite_keys_are_not_turned_into_zeros(rng: torch.Generator) -> None:
    kv = torch.randn(32, WIDTH, generator=rng).to(torch.bfloat16)
    bad_nan, bad_inf = torch.randperm(32, generator=rng)[:2].tolist()
    kv[bad_nan, int(torch.randint(0, WIDTH, (1,), generator=rng))] = float("nan")
    kv[bad_inf, int(torch.randint(0, 512, (1,), generator=rng))] = float("inf")
    others = [i for i in range(32) if i not in (bad_nan, bad_inf)]
    indices = torch.tensor(
        [[bad_nan, others[0], -1, others[1]],  # a NaN key: the output is NaN
         [others[2], bad_inf, others[3], -1],  # an infinite key: not finite either
         [-1, -1, -1, -1],  # nothing to attend to: zeros, as documented
         [others[4], others[5], -1, others[6]]],  # finite: unchanged
        dtype=torch.int32)
    q = torch.randn(4, HEADS, WIDTH, generator=rng).to(torch.bfloat16)
    scale = 1 / math.sqrt(WIDTH)
    got = sparse_mla_decode_reference(q, kv.view(torch.uint8), indices, scale)
    expected = naive(q, kv, indices, scale).to(q.dtype)
    assert not torch.isfinite(got[0]).any() and not torch.isfinite(expected[0]).any()
    assert not torch.isfinite(got[1]).all()
    assert (got[2] == 0).all()
    torch.testing.assert_close(got[3], expected[3], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bad", [-2, 32, 1 << 20])
def test_an_index_outside_the_rows_is_refused_not_masked(bad: int, rng: torch.Generator) -> None:
    kv = torch.randn(32, WIDTH, generator=rng).to(torch.bfloat16)
    indices = torch.randint(0, 32, (3, 4), generator=rng, dtype=torch.int32)
    indices[int(torch.randint(0, 3, (1,), generator=rng)), 2] = bad
    q = torch.randn(3, HEADS, WIDTH, generator=rng).to(torch.bfloat16)
    with pytest.raises(InvalidInputError, match=f"indices hold {bad}"):
        sparse_mla_decode_reference(q, kv.view(torch.uint8), indices, 0.1)


def test_a_non_finite_row_zero_does_not_reach_masked_entries(rng: torch.Generator) -> None:
    """Masked entries (-1) must contribute nothing, whatever row 0 of kv_rows holds."""
    kv = torch.randn(16, WIDTH, generator=rng).to(torch.bfloat16)
    kv[0, int(torch.randint(0, 512, (1,), generator=rng))] = float("nan")
    indices = torch.randint(1, 16, (3, 5), generator=rng, dtype=torch.int32)
    indices[0, 1] = indices[1, 3] = -1
    indices[2] = -1
    q = torch.randn(3, HEADS, WIDTH, generator=rng).to(torch.bfloat16)
    scale = 1 / math.sqrt(WIDTH)
    got = sparse_mla_decode_reference(q, kv.view(torch.uint8), indices, scale)
    expected = naive(q, kv, indices, scale).to(q.dtype)
    assert torch.isfinite(got).all()
    assert (got[2] == 0).all()
    torch.testing.assert_close(got[:2], expected[:2], rtol=1e-2, atol=1e-2)
