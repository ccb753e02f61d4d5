"""HiSparseV4Cache (hisparse.integrations.deepseek_v4): a tiny random DeepSeek-V4 whose CSA
entries live in hisparse generates transformers' own greedy tokens.

The model has every layer kind (sliding, CSA, HCA, CSA, CSA: three cache layers, so none is a
special case), window 8, indexer top-k 4, and a hot buffer of 8 entries, well below the 22
entries a request reaches: most lookups miss and read the host pool. Left-padded ragged
prompts decode 48 tokens (12 windows close during decode, so 36 steps append nothing). The
controls (the glue hands swap_in the top-k shifted by one entry; it reads another CSA layer's
rows; it appends each entry one step late) must change the tokens. The presets' layer counts
and top-k are checked against transformers' DeepseekV4Config.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install 'hisparse[transformers]'")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("needs transformers 5.17 or newer (DeepSeek-V4)", allow_module_level=True)

import hisparse.integrations.deepseek_v4 as v4  # noqa: E402
from hisparse import HiSparseConfig  # noqa: E402
from hisparse.errors import ConfigError, InvalidInputError  # noqa: E402

CSA, HCA, SLIDING = ("compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention")
LAYERS = [SLIDING, CSA, HCA, CSA, CSA]
RATE, HCA_RATE, WINDOW, TOP_K, NEW_TOKENS = 4, 16, 8, 4, 48
CACHE = dict(hot_slots=6, extent_tokens=4, max_requests=4, max_seq_len=32,
             host_pool_tokens=4 * 32)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    config = transformers.DeepseekV4Config(
        num_hidden_layers=len(LAYERS), layer_types=LAYERS,
        compress_rates={CSA: RATE, HCA: HCA_RATE}, sliding_window=WINDOW, index_topk=TOP_K,
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
        head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return transformers.DeepseekV4ForCausalLM(config).eval()


def prompts(lengths: tuple[int, ...], rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts of `lengths` tokens."""
    width = max(lengths)
    ids = torch.randint(1, 128, (len(lengths), width), generator=rng)
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        mask[row, : width - length] = 0
    ids[mask == 0] = 0
    return ids, mask


def generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, cache: object,
             new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                              do_sample=False, past_key_values=cache)


@pytest.mark.parametrize("lengths", [(37, 30, 41), (40,)], ids=["ragged", "one-request"])
def test_greedy_tokens_equal_transformers_own_cache(model, rng, lengths) -> None:
    ids, mask = prompts(lengths, rng)
    want = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    with v4.HiSparseV4Cache(model, **CACHE) as cache:
        got = generate(model, ids, mask, cache)
        stats = cache.engine.stats()
        entries = (ids.shape[1] + NEW_TOKENS - 1) // RATE  # the last token is not fed back
        assert [cache.engine.seq_len(r) for r in cache.ids] == [entries] * len(lengths)
        assert stats.misses > 0.3 * (stats.hits + stats.misses), stats
        # No CSA entry beyond the hot buffers is on the device: the layers hold placeholders.
        for layer in cache.csa_layers:
            held = cache.layers[layer].compressed_kv["compressor"]
            assert held.shape[1] == entries and held.stride() == (0, 0, 0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("control", ["shifted-top-k", "other-layer", "late-append"])
def test_a_broken_glue_changes_the_tokens(model, rng, control, monkeypatch) -> None:
    ids, mask = prompts((37, 30, 41), rng)
    want = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    with v4.HiSparseV4Cache(model, **CACHE) as cache:
        if control == "shifted-top-k":
            pad = v4.pad_top_k

            def shifted(top_k: torch.Tensor, width: int) -> torch.Tensor:
                held = cache.engine.seq_len(cache.ids[0])
                return pad(torch.where(top_k >= 0, (top_k + 1) % held, top_k), width)
            monkeypatch.setattr(v4, "pad_top_k", shifted)
        elif control == "other-layer":
            rows_of = cache.engine.device_kv
            monkeypatch.setattr(cache.engine, "device_kv", lambda layer: rows_of((layer + 1) % 3))
        else:  # each entry appended one step after its window closed (and zeros then)
            begin, owed = cache.engine.begin_decode_step, [0]

            def late(ids: list, appends: list) -> object:
                appends, owed[0] = [owed[0]] * len(ids), appends[0]
                return begin(ids, appends=appends)
            monkeypatch.setattr(cache.engine, "begin_decode_step", late)
        got = generate(model, ids, mask, cache)
    assert not torch.equal(got, want)


def test_a_pass_that_raises_changes_nothing(model, rng) -> None:
    """A decode pass that fails half way (after the first CSA layer's swap-in) is cancelled
    and every layer's state put back: generating on gives transformers' tokens."""
    ids, mask = prompts((37, 30, 41), rng)
    want = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    with v4.HiSparseV4Cache(model, **CACHE) as cache:
        first = generate(model, ids, mask, cache, new_tokens=21)
        lengths = [cache.engine.seq_len(r) for r in cache.ids]
        more = torch.cat([mask, torch.ones_like(first[:, ids.shape[1]:])], dim=1)

        def fail(module, args, output):
            raise RuntimeError("a failing layer")
        hook = model.model.layers[3].register_forward_hook(fail)
        with pytest.raises(RuntimeError, match="a failing layer"):
            generate(model, first, more, cache, new_tokens=1)
        hook.remove()
        assert [cache.engine.seq_len(r) for r in cache.ids] == lengths
        got = generate(model, first, more, cache, new_tokens=NEW_TOKENS - 21)
    assert torch.equal(got, want)


def test_the_config_must_fit_the_model(model) -> None:
    config = v4.hisparse_v4_config_for(model, **CACHE)
    assert (config.num_layers, config.top_k, config.row_bytes) == (3, TOP_K, 32 * 4)
    assert (config.managed_layers, config.compress_rate) == ((1, 3, 4), RATE)
    assert config.cache_layer(3) == 1
    with pytest.raises(ConfigError, match=r"the model's CSA layers are \[1, 3, 4\]"):
        v4.HiSparseV4Cache(model, config.replace(managed_layers=[0, 1, 3]))
    with pytest.raises(ConfigError, match="either a config or overrides"):
        v4.HiSparseV4Cache(model, config, hot_slots=16)
    with pytest.raises(InvalidInputError, match="model_type 'deepseek_v4'"):
        v4.hisparse_v4_config_for(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(("preset", "layers", "top_k"), [("deepseek-v4-flash", 43, 512),
                                                         ("deepseek-v4-pro", 61, 1024)])
def test_the_presets_hold_the_csa_layers_of_transformers_layout(preset, layers, top_k) -> None:
    model = transformers.DeepseekV4Config(num_hidden_layers=layers)
    csa = [i for i, kind in enumerate(model.layer_types) if kind == CSA]
    config = HiSparseConfig.from_preset(preset)
    assert config.managed_layers == tuple(csa)
    assert config.compress_rate == model.compress_rates[CSA] == 4
    assert (config.num_layers, config.top_k, config.num_index_groups) == (
        len(csa), top_k, len(csa))
    assert config.row_bytes == 448 + 64 * 2 + 8  # fp8 values, bf16 rope, scales
    assert HiSparseConfig.from_preset(preset, kv_dtype="bf16").row_bytes == 512 * 2
