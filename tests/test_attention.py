"""Sparse MLA attention over the cache's hot rows equals attention over the full KV, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

import hisparse
from hisparse.attention import sparse_mla_decode_reference
from hisparse.errors import InvalidInputError

BACKENDS = hisparse.available_backends()
WIDTH = 576  # 512 latent + 64 rope, bf16
HEADS = 4


def naive_attention(q, keys, scale):
    """Per batch row, per head, with explicit loops over the selected keys: an independent
    reference for the vectorised one."""
    out = torch.zeros(q.shape[0], q.shape[1], 512)
    for b in range(q.shape[0]):
        k = keys[b].float()
        if k.shape[0] == 0:
            continue
        for h in range(q.shape[1]):
            scores = (k @ q[b, h].float()) * scale
            weights = torch.softmax(scores, dim=0)
            out[b, h] = weights @ k[:, :512]
    return out


def test_reference_matches_naive_loops(rng: torch.Generator) -> None:
    g = rng
    kv = torch.randn(40, WIDTH, generator=g).to(torch.bfloat16)
    q = torch.randn(3, HEADS, WIDTH, generator=g)
    indices = torch.tensor([[3, -1, 7, 39], [-1, -1, -1, -1], [0, 1, 2, 5]], dtype=torch.int32)
    got = sparse_mla_decode_reference(q, kv.view(torch.uint8), indices, 0.1)
    keys = [kv[[i for i in row if i >= 0]] for row in indices.tolist()]
    torch.testing.assert_close(got, naive_attention(q, keys, 0.1), rtol=1e-5, atol=1e-5)
    assert (got[1] == 0).all()
    with pytest.raises(InvalidInputError, match="1152 bytes"):
        sparse_mla_decode_reference(q, kv.view(torch.uint8)[:, :100].contiguous(), indices, 0.1)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_attention_over_hot_rows_equals_full_kv(backend_name: str, rng: torch.Generator) -> None:
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=2, index_group_size=2, row_bytes=2 * WIDTH, top_k=8,
        hot_slots=12, extent_tokens=4, max_requests=3, max_batch=3,
        host_pool_tokens=256, max_seq_len=128,
    )
    g = rng
    cache = hisparse.HiSparseCache(config, device=backend_name)
    device = cache.device
    prompts = {"a": 30, "b": 9, "c": 17}  # long, short, long
    full = {}  # request -> [L, T, WIDTH] bf16: the whole KV, kept outside the cache
    for request_id, length in prompts.items():
        full[request_id] = torch.randn(2, length, WIDTH, generator=g).to(torch.bfloat16)
        cache.admit(request_id, length)
        cache.write_prefill(request_id, full[request_id].to(device))
        cache.commit_prefill(request_id)
    scale = 1 / math.sqrt(WIDTH)
    ids = list(prompts)
    for _ in range(6):
        cache.begin_decode_step(ids)
        new = torch.randn(2, len(ids), WIDTH, generator=g).to(torch.bfloat16)
        for request_id, b in zip(ids, range(len(ids)), strict=True):
            full[request_id] = torch.cat([full[request_id], new[:, b : b + 1]], dim=1)
        top_k = torch.full((len(ids), 8), -1, dtype=torch.int32)
        for b, request_id in enumerate(ids):
            n = full[request_id].shape[1]
            chosen = [*torch.randperm(n - 1, generator=g)[: min(8, n) - 1].tolist(), n - 1]
            top_k[b, : len(chosen)] = torch.tensor(chosen)
        q = torch.randn(len(ids), HEADS, WIDTH, generator=g).to(torch.bfloat16)
        device_top_k = top_k.to(device)  # one tensor: layer 1 follows layer 0's top-k
        for layer in range(2):
            cache.write_newest(layer, new[layer].to(device))
            rows = cache.swap_in(layer, device_top_k)
            hot = sparse_mla_decode_reference(q.to(device), cache.device_kv(layer), rows, scale)
            # The full KV of the batch as one table; positions offset per request.
            offsets, tables = [], []
            for request_id in ids:
                offsets.append(sum(t.shape[0] for t in tables))
                tables.append(full[request_id][layer])
            flat = torch.cat(tables).view(torch.uint8)
            shifted = torch.where(top_k >= 0, top_k + torch.tensor(offsets)[:, None], -1)
            # Same device for both: bit equality is only promised for the same kernel.
            reference = sparse_mla_decode_reference(
                q.to(device), flat.to(device), shifted.to(torch.int32).to(device), scale
            )
            assert torch.equal(hot, reference)
        cache.end_decode_step()
    assert cache.stats().misses > 0  # the long requests really swapped rows in
    cache.close()
