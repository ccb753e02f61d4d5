"""transformers' DeepSeek-V3.2 and GLM-5 model code decoding long contexts: hisparse against
transformers' own cache (issue 38's GPU target).

Per family, a random model with the real model's attention (hidden size, heads, MLA ranks,
indexer shape; a few layers, a small dense MLP and vocabulary) in bf16, and a synthetic
context of `--context` tokens per request loaded into both caches (the same latent rows: the
dense cache holds their expansion through each layer's `kv_b_proj`, as transformers caches
them). Then greedy decoding of `--new-tokens` tokens with each cache at `--batch`:

- tokens and logits of hisparse against the dense cache (where the dense cache fits);
- device bytes each cache holds, and the peak device memory of each run;
- the decode step time of each (median of the steps after the first);
- at `--oom-batch`, whether the dense cache runs out of device memory and hisparse decodes.

    python benchmarks/transformers_decode.py --output results.json          # GPU
    python benchmarks/transformers_decode.py --tiny --output tiny.json      # CPU, seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import hisparse
from hisparse.integrations.transformers import HiSparseDSACache, dense_cache_bytes

# The real models' attention; MLP, experts and vocabulary are small (they are not measured).
FAMILIES: dict[str, dict[str, Any]] = {
    "glm-5.2": dict(cls="GlmMoeDsa", hidden_size=6144, num_attention_heads=64,
                    num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
                    qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256,
                    index_topk=2048, index_head_dim=128, index_n_heads=32,
                    index_topk_freq=4, index_skip_topk_offset=3),
    "deepseek-v3.2": dict(cls="DeepseekV32", hidden_size=7168, num_attention_heads=128,
                          num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                          qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                          index_topk=2048, index_head_dim=128, index_n_heads=64),
}
SMALL = dict(vocab_size=1024, intermediate_size=1024, moe_intermediate_size=256,
             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             max_position_embeddings=262144, pad_token_id=0, eos_token_id=None)
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
            kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
            index_topk=16, index_head_dim=32, index_n_heads=2)


def build(family: str, layers: int, tiny: bool, device: torch.device,
          dtype: torch.dtype | None = None) -> torch.nn.Module:
    spec = dict(FAMILIES[family])
    kind = spec.pop("cls")
    if tiny:
        spec.update(TINY)
    config = getattr(transformers, f"{kind}Config")(
        num_hidden_layers=layers, first_k_dense_replace=layers, **SMALL, **spec)
    dtype = dtype or (torch.float32 if tiny else torch.bfloat16)
    model = getattr(transformers, f"{kind}ForCausalLM")(config).to(device=device, dtype=dtype)
    model.set_attn_implementation("eager")
    return model.eval()


def context(model: torch.nn.Module, batch: int, tokens: int,
            seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows `[L, B, T, V]` and indexer keys `[L, B, T, D]`, random, in the model's dtype."""
    c, p = model.config, next(model.parameters())
    generator = torch.Generator(device=p.device).manual_seed(seed)
    rows = torch.randn((c.num_hidden_layers, batch, tokens, c.kv_lora_rank + c.qk_rope_head_dim),
                       generator=generator, device=p.device, dtype=p.dtype)
    keys = torch.randn((c.num_hidden_layers, batch, tokens, c.index_head_dim),
                       generator=generator, device=p.device, dtype=p.dtype)
    return rows, keys


def dense_cache(model: torch.nn.Module, rows: torch.Tensor, keys: torch.Tensor,
                chunk: int = 4096) -> transformers.DynamicCache:
    """transformers' cache holding the expansion of `rows` (what its prefill would cache),
    expanded `chunk` tokens at a time into tensors of the full length: building it takes
    little more device memory than holding it (a float32 batch of 8 fits an H100)."""
    c = model.config
    cache = transformers.DynamicCache(config=c)
    tokens = rows.shape[2]
    for layer, attention in enumerate(a.self_attn for a in model.model.layers):
        latent, rope = rows[layer].split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        full: list[torch.Tensor] = []
        for start in range(0, tokens, chunk):
            span = slice(start, start + chunk)
            parts = attention.expand_kv(latent[:, None, span], rope[:, None, span])
            if not full:
                full = [p.new_empty((*p.shape[:2], tokens, p.shape[3])) for p in parts]
            for whole, part in zip(full, parts, strict=True):
                whole[:, :, span] = part
            del parts
        cache.update(*full, layer)
        cache.update_indexer(keys[layer], layer)
        del full
    return cache


def decode(model: torch.nn.Module, cache: Any, first: torch.Tensor, tokens: int,
           steps: int, forced: torch.Tensor | None = None) -> dict[str, Any]:
    """Greedy decode `steps` tokens after a context of `tokens`; per-step seconds. `forced`
    `[B, steps]`: feed those tokens instead of the argmax (teacher forcing), so that every
    step's logits compare with another run's at the same inputs."""
    device = first.device
    batch = first.shape[0]
    token, out, logits, times = first, [], [], []
    with torch.no_grad():
        for step in range(steps):
            mask = torch.ones((batch, tokens + step + 1), dtype=torch.long, device=device)
            position = torch.full((batch, 1), tokens + step, dtype=torch.long, device=device)
            _sync(device)
            start = time.perf_counter()
            result = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                           past_key_values=cache, use_cache=True)
            _sync(device)
            times.append(time.perf_counter() - start)
            step_logits = result.logits[:, -1].float()
            token = step_logits.argmax(-1)
            out.append(token)
            if forced is not None:
                token = forced[:, step]
            logits.append(step_logits)
    return {"tokens": torch.stack(out, 1), "logits": torch.stack(logits, 1),
            "step_seconds": times}


def run_hisparse(model: torch.nn.Module, rows: torch.Tensor, keys: torch.Tensor,
                 first: torch.Tensor, args: argparse.Namespace,
                 forced: torch.Tensor | None = None) -> dict[str, Any]:
    batch, tokens = rows.shape[1], rows.shape[2]
    room = tokens + args.new_tokens + 64
    with HiSparseDSACache(model, hot_slots=args.hot_slots, max_requests=batch,
                          max_seq_len=room, host_pool_tokens=batch * room,
                          extent_tokens=64) as cache:
        cache.load_context(rows, keys)
        result = decode(model, cache, first, tokens, args.new_tokens, forced)
        stats = cache.engine.stats()
        result["device_bytes"] = cache.device_bytes()
        result["hit_rate"] = stats.hits / max(stats.hits + stats.misses, 1)
        result["host_pool_bytes"] = cache.engine.config.host_pool_bytes
    return result


def run_dense(model: torch.nn.Module, rows: torch.Tensor, keys: torch.Tensor,
              first: torch.Tensor, args: argparse.Namespace,
              forced: torch.Tensor | None = None) -> dict[str, Any]:
    cache = dense_cache(model, rows, keys)
    result = decode(model, cache, first, rows.shape[2], args.new_tokens, forced)
    result["device_bytes"] = dense_cache_bytes(cache)
    del cache
    return result


def measured(run: Any, *inputs: Any, device: torch.device) -> dict[str, Any]:
    """`run(*inputs)` with its peak memory on `device`; an out-of-memory error is a result."""
    _reset_peak(device)
    error = None
    try:
        result = run(*inputs)
    except torch.OutOfMemoryError as exc:
        error = str(exc).splitlines()[0]
    if error is not None:  # the error's frames (and their tensors) are gone by now
        _empty(device)
        return {"out_of_memory": True, "error": error}
    result["out_of_memory"] = False
    result["peak_device_bytes"] = _peak(device)
    result["step_ms_median"] = 1e3 * statistics.median(result["step_seconds"][1:] or
                                                       result["step_seconds"])
    _empty(device)
    return result


def against_float32(model: torch.nn.Module, rows: torch.Tensor, keys: torch.Tensor,
                    first: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """How far each low-precision cache is from a float32 run of the same weights and context
    (hisparse in float32, whose tokens equal the dense cache's there): both caches are fed the
    reference's tokens (teacher forcing), so each step compares logits at equal inputs. The
    same distance for both says the caches differ by rounding, not by the rows they read."""
    exact = copy.deepcopy(model).float()
    reference = run_hisparse(exact, rows.float(), keys.float(), first, args)
    del exact
    forced = reference["tokens"]
    report: dict[str, Any] = {"reference": "hisparse, float32 copy of the weights"}
    for name, run in (("hisparse", run_hisparse), ("dense", run_dense)):
        result = measured(run, model, rows, keys, first, args, forced, device=first.device)
        if result["out_of_memory"]:
            report[name] = {"out_of_memory": True}
            continue
        error = (result["logits"] - reference["logits"]).abs()
        report[name] = {"argmax_agreement": float((result["tokens"] == forced).float().mean()),
                        "max_logit_error": float(error.max()),
                        "mean_logit_error": float(error.mean())}
    return report


def family_run(family: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    model = build(family, args.layers, args.tiny, device,
                  getattr(torch, args.dtype) if args.dtype else None)
    report: dict[str, Any] = {"layers": args.layers, "context": args.context,
                              "hot_slots": args.hot_slots,
                              "index_topk": model.config.index_topk, "runs": []}
    for batch in (args.batch, *args.oom_batch):
        rows, keys = context(model, batch, args.context, args.seed)
        first = torch.randint(1, SMALL["vocab_size"], (batch,), device=device)
        hs = measured(run_hisparse, model, rows, keys, first, args, device=device)
        dense = measured(run_dense, model, rows, keys, first, args, device=device)
        entry: dict[str, Any] = {"batch": batch}
        for name, result in (("hisparse", hs), ("dense", dense)):
            entry[name] = {k: v for k, v in result.items()
                           if k not in ("tokens", "logits", "step_seconds")}
        if not hs["out_of_memory"] and not dense["out_of_memory"]:
            same = (hs["tokens"] == dense["tokens"])
            entry["tokens_identical"] = bool(same.all())
            entry["token_match_fraction"] = float(same.float().mean())
            first_step = hs["logits"][:, 0] - dense["logits"][:, 0]
            entry["first_step_max_logit_diff"] = float(first_step.abs().max())
            if args.reference and model.dtype != torch.float32:
                entry["against_float32"] = against_float32(model, rows, keys, first, args)
        del rows, keys
        report["runs"].append(entry)
        print(json.dumps({family: entry}), flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, type=Path, help="JSON file to write")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (runs on a CPU)")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=None, help="tokens per request")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--oom-batch", type=int, nargs="*", default=None,
                        help="batches to try where the dense cache should not fit")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--hot-slots", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="the model's dtype (default: bfloat16, float32 with --tiny); "
                             "float32 checks token identity without bf16 rounding, where the "
                             "two caches' attention sums in another order")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the teacher-forced comparison of a bfloat16 run with a "
                             "float32 one (against_float32)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    defaults = ({"context": 256, "batch": 2, "oom_batch": [], "new_tokens": 6,
                 "hot_slots": 32} if args.tiny else
                {"context": 32768, "batch": 8, "oom_batch": [48], "new_tokens": 16,
                 "hot_slots": 4096})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    started = time.perf_counter()
    document = {
        "command": "python benchmarks/transformers_decode.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "output"),
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "hisparse": hisparse.__version__, "triton": _triton_version()},
        "families": {family: family_run(family, args, device) for family in args.families},
    }
    document["seconds"] = time.perf_counter() - started
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.output}")


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _empty(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
