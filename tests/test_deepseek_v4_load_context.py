"""HiSparseV4Cache.load_context: a batch prefilled in transformers' own cache and handed over
decodes transformers' own greedy tokens.

A tiny random DeepSeek-V4 (sliding, CSA, HCA, CSA; window 8, HCA rate 16, top-k 4, a hot
buffer of 6 entries) prefills 37 tokens (not a multiple of 4: the compressors hold buffered
tokens) into transformers' cache; a deep copy decodes on as the reference, and the original
is loaded into hisparse. The control perturbs the entries hisparse is handed only: its tokens
must change. Bad sources are refused with nothing admitted.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install 'hisparse[transformers]'")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("needs transformers 5.17 or newer (DeepSeek-V4)", allow_module_level=True)

from hisparse.errors import InvalidInputError  # noqa: E402
from hisparse.integrations.deepseek_v4 import HiSparseV4Cache  # noqa: E402

CSA, HCA, SLIDING = ("compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention")
LAYERS = [SLIDING, CSA, HCA, CSA]
PROMPT, NEW_TOKENS = 37, 24
CACHE = dict(hot_slots=6, extent_tokens=4, max_requests=4, max_seq_len=32,
             host_pool_tokens=4 * 32)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    torch.manual_seed(4321)
    config = transformers.DeepseekV4Config(
        num_hidden_layers=len(LAYERS), layer_types=LAYERS, compress_rates={CSA: 4, HCA: 16},
        sliding_window=8, index_topk=4, vocab_size=128, hidden_size=64,
        moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
        partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return transformers.DeepseekV4ForCausalLM(config).eval()


def prefilled(model: torch.nn.Module, batch: int,
              rng: torch.Generator) -> tuple[transformers.DynamicCache, torch.Tensor]:
    """transformers' cache after a prefill of random prompts, and prompt + first token."""
    ids = torch.randint(1, 128, (batch, PROMPT), generator=rng)
    source = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=source, use_cache=True).logits
    return source, torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)


def generate(model: torch.nn.Module, ids: torch.Tensor, cache: object) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, past_key_values=cache)


@pytest.mark.parametrize("control", [False, True], ids=["loaded", "perturbed-entries"])
def test_a_loaded_context_decodes_transformers_tokens(model, rng, control) -> None:
    source, ids = prefilled(model, 3, rng)
    want = generate(model, ids, copy.deepcopy(source))
    if control:  # what hisparse is handed differs from the reference's entries
        for layer in (1, 3):
            held = source.layers[layer].compressed_kv
            held["compressor"] = held["compressor"] + torch.randn(
                held["compressor"].shape, generator=rng)
    with HiSparseV4Cache(model, **CACHE) as cache:
        cache.load_context(source)
        assert [cache.engine.seq_len(r) for r in cache.ids] == [PROMPT // 4] * 3
        got = generate(model, ids, cache)
        entries = (PROMPT + NEW_TOKENS) // 4
        assert [cache.engine.seq_len(r) for r in cache.ids] == [entries] * 3
        held = cache.layers[1].compressed_kv["compressor"]
        assert held.shape[1] == entries and held.stride() == (0, 0, 0)
        assert cache.layers[2].compressed_kv["compressor"].shape[1] == (
            PROMPT + NEW_TOKENS) // 16  # HCA entries stay with transformers
    assert torch.equal(got, want) != control


def test_a_bad_source_is_refused_and_nothing_admitted(model, rng) -> None:
    source, _ = prefilled(model, 2, rng)
    with HiSparseV4Cache(model, **CACHE) as cache:
        with pytest.raises(InvalidInputError, match="holds no context"):
            cache.load_context(transformers.DynamicCache(config=model.config))
        with pytest.raises(InvalidInputError, match="transformers' own cache of this model"):
            cache.load_context(HiSparseV4Cache(model, **CACHE))
        held = source.layers[3].compressed_kv
        entries = held["compressor"]
        held["compressor"] = entries.double()
        with pytest.raises(InvalidInputError, match=r"must be \[B, n, 32\] torch.float32"):
            cache.load_context(source)
        assert cache.ids is None and cache.engine.stats().requests == []
        assert not any(layer.is_initialized for layer in cache.layers)
        held["compressor"] = entries
        cache.load_context(source)
        with pytest.raises(InvalidInputError, match="holds a batch already"):
            cache.load_context(source)
