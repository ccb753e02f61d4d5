"""The facts about transformers' DeepSeek-V4 model code that docs/deepseek-v4.md builds on.

A tiny random `DeepseekV4ForCausalLM` (a sliding-window, a compressed sparse-attention (CSA),
a heavily compressed (HCA) and a second CSA layer; CSA rate 4, HCA rate 16, window 8, indexer
top-k 4) decoded with transformers' own cache pins down what a hisparse cache of CSA entries
relies on: how many entries T tokens make, which decode step appends one, that an entry never
changes once emitted, what the indexer returns, that attention reads only the selected
entries (plus the raw window), so that the others may live in host memory, and that the
integration's hooks (entries held aside, the compressor's output replaced by the gathered
selected entries) generate transformers' own tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install 'hisparse[transformers]'")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("needs transformers 5.17 or newer (DeepSeek-V4)", allow_module_level=True)

CSA, HCA, SLIDING = ("compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention")
LAYERS = [SLIDING, CSA, HCA, CSA]
RATE, HCA_RATE, WINDOW, TOP_K = 4, 16, 8, 4


@pytest.fixture
def model(seed: int) -> torch.nn.Module:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(
        num_hidden_layers=len(LAYERS), layer_types=LAYERS,
        compress_rates={CSA: RATE, HCA: HCA_RATE}, sliding_window=WINDOW, index_topk=TOP_K,
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
        head_dim=32, partial_rotary_factor=0.25, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return transformers.DeepseekV4ForCausalLM(config).eval()


def csa_layers(model: torch.nn.Module) -> list[int]:
    return [i for i, kind in enumerate(model.config.layer_types) if kind == CSA]


def entries(cache: transformers.DynamicCache, layer: int, name: str = "compressor") -> int:
    kv = cache.layers[layer].compressed_kv[name]
    return 0 if kv is None else int(kv.shape[1])


def step(model: torch.nn.Module, cache: transformers.DynamicCache, ids: torch.Tensor
         ) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, past_key_values=cache, use_cache=True).logits[:, -1]


def test_entries_after_t_tokens_and_the_step_that_appends(model, rng) -> None:
    """A CSA layer holds T // 4 compressed entries (and as many indexer keys) after T tokens,
    an HCA layer T // 16; a decode step appends one entry to every CSA layer exactly when its
    token is the 4th of a window (the new length is a multiple of 4), and no emitted entry
    changes afterwards (bit for bit)."""
    prompt = int(torch.randint(5, 20, (1,), generator=rng))
    ids = torch.randint(1, 128, (2, prompt + 24), generator=rng)
    cache = transformers.DynamicCache(config=model.config)
    logits = step(model, cache, ids[:, :prompt])
    seen = {layer: cache.layers[layer].compressed_kv["compressor"].clone()
            for layer in csa_layers(model)}
    appended_at = []
    for length in range(prompt + 1, prompt + 25):
        before = entries(cache, csa_layers(model)[0])
        logits = step(model, cache, ids[:, length - 1 : length])
        assert logits.isfinite().all()
        for layer in csa_layers(model):
            assert entries(cache, layer) == entries(cache, layer, "indexer") == length // RATE
            kv = cache.layers[layer].compressed_kv["compressor"]
            assert kv.shape == (2, length // RATE, model.config.head_dim)
            assert torch.equal(kv[:, : seen[layer].shape[1]], seen[layer])  # never rewritten
            seen[layer] = kv.clone()
        assert entries(cache, LAYERS.index(HCA)) == length // HCA_RATE
        if entries(cache, csa_layers(model)[0]) > before:
            appended_at.append(length)
    assert appended_at == [n for n in range(prompt + 1, prompt + 25) if n % RATE == 0]


def test_prefill_and_decode_make_the_same_entries(model, rng) -> None:
    """Entries do not depend on where the prefill stopped: the overlapping windows (entry w
    pools tokens 4w-4 .. 4w+3) carry the previous window's half across forward passes, so a
    prompt prefilled whole and one prefilled in part and decoded give the same entries. (The
    first CSA layer's: a later layer's input also depends on the indexer's top-k, whose ties
    among equal scores torch breaks by the length of the scored row.)"""
    total = 29
    cut = int(torch.randint(2, 27, (1,), generator=rng))
    ids = torch.randint(1, 128, (1, total), generator=rng)
    whole = transformers.DynamicCache(config=model.config)
    step(model, whole, ids)
    split = transformers.DynamicCache(config=model.config)
    step(model, split, ids[:, :cut])
    for position in range(cut, total):
        step(model, split, ids[:, position : position + 1])
    for layer in csa_layers(model)[:1]:
        for name in ("compressor", "indexer"):
            torch.testing.assert_close(split.layers[layer].compressed_kv[name],
                                       whole.layers[layer].compressed_kv[name])


def test_indexer_top_k_over_entries(model, rng) -> None:
    """Each CSA layer's indexer returns min(index_topk, entries) entry indices per query, each
    below the query's causal bound (position + 1) // 4 or -1, the non-negative ones distinct."""
    outputs: list[tuple[torch.Tensor, int]] = []
    hooks = [model.model.layers[layer].self_attn.compressor.indexer.register_forward_hook(
        lambda module, args, out: outputs.append((out, args[2]))) for layer in csa_layers(model)]
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(1, 128, (2, 40), generator=rng)
    step(model, cache, ids[:, :6])
    for position in range(6, 40):
        outputs.clear()
        step(model, cache, ids[:, position : position + 1])
        assert len(outputs) == len(csa_layers(model))
        for top_k, position_ids in outputs:
            assert top_k.shape == (2, 1, min(TOP_K, (position + 1) // RATE))
            bound = (position_ids + 1) // RATE
            assert ((top_k == -1) | ((top_k >= 0) & (top_k < bound[..., None]))).all()
            for row in top_k.reshape(-1, top_k.shape[-1]).tolist():
                picked = [i for i in row if i >= 0]
                assert len(picked) == len(set(picked))
    for hook in hooks:
        hook.remove()


def test_attention_reads_only_the_selected_entries(model, rng) -> None:
    """Replacing every CSA entry that a decode step's indexer did not select (for that row and
    layer) with noise leaves the step's logits bit for bit the same; replacing one selected
    entry changes them. So the unselected entries may live anywhere (host memory)."""
    selected: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[layer].self_attn.compressor.indexer.register_forward_hook(
        lambda module, args, out, layer=layer: selected.__setitem__(layer, out))
        for layer in csa_layers(model)]
    ids = torch.randint(1, 128, (2, 42), generator=rng)
    cache = transformers.DynamicCache(config=model.config)
    step(model, cache, ids[:, :41])
    assert entries(cache, csa_layers(model)[0]) == 10 > TOP_K
    token = ids[:, 41:42]  # 42 % 4 != 0: this step appends no entry
    before = copy.deepcopy(cache)
    want = step(model, cache, token)
    unselected = copy.deepcopy(before)
    for layer, top_k in selected.items():
        kv = unselected.layers[layer].compressed_kv["compressor"]
        keep = torch.zeros(kv.shape[:2], dtype=torch.bool)
        for row in range(kv.shape[0]):
            keep[row, top_k[row, 0][top_k[row, 0] >= 0]] = True
        assert not keep.all()
        noise = torch.randn(kv.shape, generator=rng)
        unselected.layers[layer].compressed_kv["compressor"] = torch.where(keep[..., None], kv,
                                                                           noise)
    assert torch.equal(step(model, unselected, token), want)
    layer = csa_layers(model)[0]
    picked = copy.deepcopy(before)
    kv = picked.layers[layer].compressed_kv["compressor"].clone()
    kv[0, selected[layer][0, 0, 0]] += 1.0
    picked.layers[layer].compressed_kv["compressor"] = kv
    assert not torch.equal(step(model, picked, token), want)
    for hook in hooks:
        hook.remove()


def test_left_padding_shares_the_window_phase(model) -> None:
    """In a left-padded batch every row holds the padded length's entries: windows close on
    the padded length for all rows at once, and a row's first entries may pool padding."""
    ids = torch.randint(1, 128, (3, 23))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[2, :4] = 0
    ids[mask == 0] = 0
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                       past_key_values=cache)
    for layer in csa_layers(model):
        assert entries(cache, layer) == (23 + 5) // RATE  # the last new token is not fed back
        assert cache.layers[layer].compressed_kv["compressor"].shape[0] == 3


class _SideEntries(transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4CSACache):
    """A CSA cache layer that keeps its compressed entries aside (where hisparse will) and,
    in a one-token pass, hands the compressor a zero-stride placeholder of their shape."""

    _layer_type = None  # not transformers' default CSA layer (subclasses register themselves)

    def update(self, key_states: torch.Tensor, *args, **kwargs):
        self.pass_tokens = key_states.shape[-2]
        return super().update(key_states, *args, **kwargs)

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        if name != "compressor":
            return super().update_compressor_states(name, compressed)
        held = getattr(self, "entries", None)
        self.entries = compressed if held is None else torch.cat([held, compressed], dim=1)
        self.entry_count[name] += compressed.shape[1]
        # What the layer holds (hisparse's rows stand aside): a placeholder of their shape.
        self.compressed_kv[name] = self.entries.new_zeros(()).expand(self.entries.shape)
        return self.entries if self.pass_tokens != 1 else self.compressed_kv[name]


@pytest.mark.parametrize("shift", [0, 1], ids=["selected", "control-shifted"])
def test_attention_over_the_gathered_entries_gives_the_same_tokens(model, rng, shift) -> None:
    """The integration's mechanics: CSA layers whose entries live aside, and hooks that replace
    the compressor's output by the indexer's selected entries (gathered, [B, 1, K, D]) with a
    0 / -inf bias, generate transformers' own greedy tokens over 48 steps from ragged
    left-padded prompts; gathering the entry after each selected one (the control) does not."""
    ids = torch.randint(1, 128, (3, 41), generator=rng)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[1, :11] = 0, 0
    ids[mask == 0] = 0
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False,
                              past_key_values=transformers.DynamicCache(config=model.config))
    cache = transformers.DynamicCache(config=model.config)
    top_k: dict[int, torch.Tensor] = {}
    hooks = []
    for layer in csa_layers(model):
        cache.layers[layer] = _SideEntries(model.config)
        compressor = model.model.layers[layer].self_attn.compressor

        def replace(module, args, out, layer=layer):
            if args[0].shape[1] != 1:
                return out  # a prefill attends densely over the pass's entries
            entries, picked = cache.layers[layer].entries, top_k[layer][:, 0]
            assert out[0].stride() == (0, 0, 0, 0)  # the placeholder: no entry on the side
            if shift:
                picked = torch.where(picked >= 0, (picked + 1) % entries.shape[1], picked)
            valid = picked >= 0
            rows = entries.gather(1, picked.clamp(min=0)[..., None].expand(
                -1, -1, entries.shape[-1])) * valid[..., None]
            bias = torch.zeros(valid.shape).masked_fill(~valid, float("-inf"))
            return rows[:, None], bias[:, None, None, :]

        hooks.append(compressor.indexer.register_forward_hook(
            lambda module, args, out, layer=layer: top_k.__setitem__(layer, out)))
        hooks.append(compressor.register_forward_hook(replace))
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=48, do_sample=False,
                             past_key_values=cache)
    for hook in hooks:
        hook.remove()
    assert torch.equal(got, want) != bool(shift)
