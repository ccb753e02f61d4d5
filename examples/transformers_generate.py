"""Generate with transformers' DeepSeek-V3.2 and GLM-5.2 model code, with and without hisparse.

Builds a small random model of each family (no download), generates greedily for a batch of
left-padded prompts with transformers' own cache and with `HiSparseDSACache`, and prints the
tokens, the hot buffer's hit rate and the device memory each cache holds. Runs on a CPU in
well under a minute:

    pip install "hisparse[transformers]"
    python examples/transformers_generate.py
"""

from __future__ import annotations

import argparse

import torch
import transformers

from hisparse.integrations.transformers import HiSparseDSACache, dense_cache_bytes

SHAPE = dict(
    vocab_size=256, hidden_size=128, intermediate_size=128, moe_intermediate_size=64,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=64,
    qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
    num_experts_per_tok=2, n_group=1, topk_group=1, index_topk=32, index_head_dim=32,
    index_n_heads=2, max_position_embeddings=1024, first_k_dense_replace=1, pad_token_id=0,
    bos_token_id=1, eos_token_id=None)


def models() -> dict[str, torch.nn.Module]:
    """One random model per family; GLM with GLM-5.2's indexer pattern (indexers at layers 0,
    1, 2, then every 4th) over 8 layers."""
    glm = transformers.GlmMoeDsaConfig(num_hidden_layers=8, index_topk_freq=4,
                                       index_skip_topk_offset=3, **SHAPE)
    deepseek = transformers.DeepseekV32Config(num_hidden_layers=4, **SHAPE)
    return {"GLM-5.2 pattern": transformers.GlmMoeDsaForCausalLM(glm).eval(),
            "DeepSeek-V3.2": transformers.DeepseekV32ForCausalLM(deepseek).eval()}


def left_padded(lengths: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(lengths)
    ids = torch.randint(2, vocab, (len(lengths), width))
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(lengths):
        mask[row, width - tokens :] = 1
        ids[row, : width - tokens] = SHAPE["pad_token_id"]
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hot-slots", type=int, default=32, help="hot buffer per request")
    args = parser.parse_args()
    torch.manual_seed(0)
    ids, mask = left_padded([120, 80, 100], SHAPE["vocab_size"])
    options = dict(max_new_tokens=args.new_tokens, do_sample=False, attention_mask=mask)
    for name, model in models().items():
        model.set_attn_implementation("eager")
        dense = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            want = model.generate(ids, past_key_values=dense, **options)
            with HiSparseDSACache(model, hot_slots=args.hot_slots, max_requests=4,
                                  max_seq_len=512, host_pool_tokens=2048) as cache:
                got = model.generate(ids, past_key_values=cache, **options)
                hit_rate, held = cache.hit_rate(), cache.device_bytes()
        new = slice(ids.shape[1], None)
        print(f"{name}: {model.config.num_hidden_layers} layers, top-k "
              f"{model.config.index_topk}, hot buffer {args.hot_slots} slots per request")
        for row in range(ids.shape[0]):
            print(f"  prompt {row} ({int(mask[row].sum())} tokens) -> "
                  f"{got[row, new].tolist()[:12]} ...")
        print(f"  same tokens as transformers' cache: {torch.equal(got, want)}")
        print(f"  hit rate {hit_rate:.1%}; device bytes held: hisparse {held:,} "
              f"(hot rows, tables, indexer keys), transformers {dense_cache_bytes(dense):,}")


if __name__ == "__main__":
    main()
