"""transformers' DeepSeek-V4 model code decoding a long context: hisparse's `HiSparseV4Cache`
against transformers' own cache (issue 40's GPU target).

A random `DeepseekV4ForCausalLM` with V4-Flash's attention (transformers' `DeepseekV4Config`
defaults: hidden 4096, 64 heads of head_dim 512, q_lora_rank 1024, 8 output groups of rank
1024, an indexer of 64 heads of 128 and top-k 512, window 128, CSA rate 4, HCA rate 128) but
four layers (sliding, CSA, HCA, CSA) and a small MoE and vocabulary, eager attention. Each
request's context of `--context` tokens is synthetic, not prefilled: every state transformers'
V4 cache layers hold after such a prefill (the raw windows; per CSA layer its compressed
entries, indexer keys, the compressors' buffered tokens and overlap state; the HCA entries and
buffer) is drawn at random in the model's dtype, the same values for both caches. The dense
cache is that state; hisparse gets it through `HiSparseV4Cache.load_context` (its CSA entries,
drawn on the host, go straight to hisparse's host pool). Then greedy decoding of
`--new-tokens` tokens with each cache at `--batch`:

- tokens and logits of hisparse against the dense cache (where the dense cache fits);
- device bytes each cache holds, by part (the CSA entries against hisparse's hot buffers),
  and the peak device memory of each run (the model's weights included);
- the decode step time of each (median of the steps after the first);
- at `--oom-batch`, whether the dense run runs out of device memory and hisparse decodes.
  The dense run's memory is mostly not its cache: transformers' eager attention expands the
  window and every CSA entry to all heads (`repeat_kv`, keys and values), a query's bias
  hiding the unselected entries, while hisparse's glue hands attention the top-k entries:
  per CSA layer about 2 x batch x heads x (window + entries) x head_dim values at once,
  2.2 GB a request in bf16 at 64k tokens (16,384 entries), against 85 MB through hisparse.

    python benchmarks/transformers_decode_v4.py --output results.json          # GPU
    python benchmarks/transformers_decode_v4.py --tiny --output tiny.json      # CPU, seconds
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache

import hisparse
from hisparse.footprint import device_bytes
from hisparse.integrations.deepseek_v4 import HiSparseV4Cache, framework_bytes
from transformers_decode import _triton_version, decode, measured

CSA, HCA, SLIDING = ("compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention")
LAYERS = [SLIDING, CSA, HCA, CSA]
# V4-Flash's attention: transformers' DeepseekV4Config defaults, spelled out.
FLASH: dict[str, Any] = dict(
    hidden_size=4096, num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8,
    o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
    compress_rates={CSA: 4, HCA: 128}, hc_mult=4)
SMALL: dict[str, Any] = dict(vocab_size=1024, moe_intermediate_size=256, n_routed_experts=4,
                             num_experts_per_tok=2, pad_token_id=0, bos_token_id=None,
                             eos_token_id=None)
TINY: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, head_dim=32, q_lora_rank=32, o_groups=2,
    o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=16, sliding_window=16,
    compress_rates={CSA: 4, HCA: 16}, hc_mult=2, hc_sinkhorn_iters=3,
    partial_rotary_factor=0.25)
Build = Callable[[torch.device], transformers.DynamicCache]


def build(tiny: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The random model, its weights made on `device` in `dtype` (as a checkpoint loads: the
    rotary frequencies stay float32)."""
    config = transformers.DeepseekV4Config(num_hidden_layers=len(LAYERS), layer_types=LAYERS,
                                           **SMALL, **(TINY if tiny else FLASH))
    with torch.device(device):
        model = transformers.DeepseekV4ForCausalLM._from_config(config, dtype=dtype)
    model.set_attn_implementation("eager")
    return model.eval()


def synthetic_cache(model: torch.nn.Module, batch: int, tokens: int, seed: int,
                    entries_device: torch.device) -> transformers.DynamicCache:
    """transformers' own cache as a prefill of `tokens` tokens a row leaves it, drawn at random
    in the model's dtype: the same values on every call with `seed`. The CSA layers' compressed
    entries are drawn on the host (their own generator) and placed on `entries_device`."""
    c, p = model.config, next(model.parameters())
    on_device = torch.Generator(device=p.device).manual_seed(seed)
    on_host = torch.Generator().manual_seed(seed + 1)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=on_device, device=p.device, dtype=p.dtype)

    cache = transformers.DynamicCache(config=c)
    for layer, block in zip(cache.layers, model.model.layers, strict=True):
        window = draw(batch, 1, min(tokens, c.sliding_window - 1), c.head_dim)
        layer.update(window, window)  # as transformers' prefill leaves its window
        layer.cumulative_length = tokens
        compressor = block.self_attn.compressor
        if compressor is None:
            continue
        csa = isinstance(layer, DeepseekV4CSACache)
        rate, modules = layer.compress_rate, {"compressor": compressor}
        if csa:
            modules["indexer"] = compressor.indexer
        entries, buffered = divmod(tokens, rate)
        for name, module in modules.items():
            layer.buffer_kv[name] = draw(batch, buffered, module.kv_proj.out_features)
            layer.buffer_gate[name] = draw(batch, buffered, module.gate_proj.out_features)
            layer.entry_count[name] = entries
            if csa and name == "compressor":
                layer.compressed_kv[name] = torch.randn(
                    (batch, entries, module.head_dim), generator=on_host,
                    dtype=p.dtype).to(entries_device)
            else:
                layer.compressed_kv[name] = draw(batch, entries, module.head_dim)
            if csa and entries:  # the last closed window's first series (Ca)
                layer.overlap_kv[name] = draw(batch, rate, module.head_dim)
                layer.overlap_gate[name] = draw(batch, rate, module.head_dim)
    return cache


def held_bytes(cache: transformers.DynamicCache) -> dict[str, int]:
    """Bytes of the tensors transformers' layers of `cache` hold, by part (each storage once,
    a zero-stride placeholder counting its one element)."""
    parts: dict[str, int] = {}
    seen: set[int] = set()
    for layer in cache.layers:
        csa = isinstance(layer, DeepseekV4CSACache)
        for attribute, value in vars(layer).items():
            named = value.items() if isinstance(value, dict) else [(None, value)]
            for name, tensor in named:
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                if storage.data_ptr() in seen:
                    continue
                if storage.nbytes():
                    seen.add(storage.data_ptr())
                part = _part(attribute, name, csa)
                parts[part] = parts.get(part, 0) + storage.nbytes()
    return parts


def _part(attribute: str, name: str | None, csa: bool) -> str:
    if attribute == "compressed_kv":
        return "indexer_keys" if name == "indexer" else (
            "csa_entries" if csa else "hca_entries")
    if attribute in ("buffer_kv", "buffer_gate", "overlap_kv", "overlap_gate"):
        return "compressor_state"
    return "windows"


def run_hisparse(model: torch.nn.Module, context: Build, first: torch.Tensor,
                 args: argparse.Namespace) -> dict[str, Any]:
    """Decode with the CSA entries in hisparse (admitted from the host)."""
    rate = model.config.compress_rates[CSA]
    extent = args.extent_tokens
    room = -(-(args.context // rate + args.new_tokens // rate + 1) // extent) * extent
    batch = first.shape[0]
    with HiSparseV4Cache(model, hot_slots=args.hot_slots, max_requests=batch,
                         max_seq_len=room, host_pool_tokens=batch * room,
                         extent_tokens=extent) as cache:
        cache.load_context(context(torch.device("cpu")))
        result = decode(model, cache, first, args.context, args.new_tokens)
        engine = device_bytes(cache.engine)
        hot = sum(cache.engine.device_kv(layer).nbytes
                  for layer in range(cache.engine.num_layers))
        result["device_bytes"] = cache.device_bytes()
        result["device_bytes_parts"] = {"hisparse_hot_buffers": hot,
                                        "hisparse_tables": engine - hot, **held_bytes(cache)}
        result["hit_rate"] = cache.hit_rate()
        result["host_pool_bytes"] = cache.engine.config.host_pool_bytes
        result["entries_per_request"] = [cache.engine.seq_len(r) for r in cache.ids]
    return result


def run_dense(model: torch.nn.Module, context: Build, first: torch.Tensor,
              args: argparse.Namespace) -> dict[str, Any]:
    """Decode with transformers' own cache holding every entry on the device."""
    cache = context(first.device)
    result = decode(model, cache, first, args.context, args.new_tokens)
    result["device_bytes"] = framework_bytes(cache)
    result["device_bytes_parts"] = held_bytes(cache)
    del cache
    return result


def compared(hs: dict[str, Any], dense: dict[str, Any]) -> dict[str, Any]:
    """Tokens and first-step logits of hisparse against the dense cache."""
    same = hs["tokens"] == dense["tokens"]
    first_step = hs["logits"][:, 0] - dense["logits"][:, 0]
    return {"tokens_identical": bool(same.all()),
            "token_match_fraction": float(same.float().mean()),
            "first_step_max_logit_diff": float(first_step.abs().max())}


def batch_run(model: torch.nn.Module, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    device = next(model.parameters()).device
    context = functools.partial(synthetic_cache, model, batch, args.context, args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed + 2)
    first = torch.randint(1, SMALL["vocab_size"], (batch,), generator=generator, device=device)
    hs = measured(run_hisparse, model, context, first, args, device=first.device)
    dense = measured(run_dense, model, context, first, args, device=first.device)
    entry: dict[str, Any] = {"batch": batch}
    for name, result in (("hisparse", hs), ("dense", dense)):
        entry[name] = {k: v for k, v in result.items()
                       if k not in ("tokens", "logits", "step_seconds")}
    if not hs["out_of_memory"] and not dense["out_of_memory"]:
        entry.update(compared(hs, dense))
    print(json.dumps(entry), flush=True)
    return entry


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, type=Path, help="JSON file to write")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (runs on a CPU)")
    parser.add_argument("--context", type=int, default=None,
                        help="tokens per request (default 65536: 16384 CSA entries)")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--oom-batch", type=int, nargs="*", default=[],
                        help="batches to try where the dense run should not fit")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--hot-slots", type=int, default=None,
                        help="hisparse's hot entries a request (default: twice the top-k)")
    parser.add_argument("--extent-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="the model's dtype (default: bfloat16, float32 with --tiny); "
                             "float32 checks token identity without bf16 rounding, where the "
                             "two caches' attention sums over other entries in another order")
    args = parser.parse_args(argv)
    defaults = ({"context": 250, "batch": 2, "new_tokens": 10, "hot_slots": 24,
                 "extent_tokens": 8, "dtype": "float32"} if args.tiny else
                {"context": 65536, "batch": 4, "new_tokens": 16, "extent_tokens": 512,
                 "dtype": "bfloat16"})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    rate = (TINY if args.tiny else FLASH)["compress_rates"][CSA]
    if args.context < rate or args.new_tokens < 2 or args.batch < 1:
        parser.error(f"--context must hold one CSA window ({rate} tokens) or more, "
                     f"--new-tokens be 2 or more and --batch 1 or more; got {args.context}, "
                     f"{args.new_tokens} and {args.batch}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = arguments(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    model = build(args.tiny, device, getattr(torch, args.dtype))
    c = model.config
    document: dict[str, Any] = {
        "command": _command(args),
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "hisparse": hisparse.__version__, "triton": _triton_version()},
        "model": {"layer_types": c.layer_types, "dtype": args.dtype,
                  "weights_bytes": sum(p.nbytes for p in model.parameters()),
                  **{k: getattr(c, k) for k in (*TINY, "vocab_size", "n_routed_experts")}},
        "context": args.context, "entries": args.context // c.compress_rates[CSA],
        "hot_slots": args.hot_slots or 2 * c.index_topk, "extent_tokens": args.extent_tokens,
        "new_tokens": args.new_tokens,
        "runs": [batch_run(model, batch, args) for batch in (args.batch, *args.oom_batch)],
    }
    document["seconds"] = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.output}")
    return document


def _command(args: argparse.Namespace) -> str:
    """The command line of `args`, every option spelled out."""
    words = ["python", "benchmarks/transformers_decode_v4.py"]
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            words += [flag, *map(str, value)] if value else []
        elif value is not None and value is not False:
            words += [flag, str(value)]
    return " ".join(words)


if __name__ == "__main__":
    main()
