"""SW-2, speculative verify steps (DESIGN.md section 8), through the engine.

Per cell (S, overlap, churn, B): each request's first query row follows the previous step's
with churn c (c x K positions replaced by positions outside the hot buffer), and each next
query row keeps `overlap` of the row before it. A verify step of S tokens swaps in the
`[B, S, K]` top-k as one union; the baseline is a single-token step on a cache built with
top_k = S x K that is handed the same union rows (the single-token swap-in with the same
unique misses). Reported per cell: unique misses per step of both (read from the counters),
the mean swap-in time of each and their ratio (target: verify <= 1.25 x baseline).

Times are host wall-clock around `swap_in`, synchronized on accelerators: on the CPU backend
they time the torch reference, which says nothing about the GPU target.

    PYTHONPATH=src python benchmarks/verify_step.py --device cpu --quick
    PYTHONPATH=src python benchmarks/verify_step.py --device cuda --out results/sw2-cuda.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import hisparse


def build(device: str, top_k: int, hot: int, drafts: int, batch: int, seq_len: int,
          row_bytes: int) -> hisparse.HiSparseCache:
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=1, row_bytes=row_bytes, top_k=top_k, hot_slots=hot,
        index_group_size=1, max_requests=batch, max_batch=batch, extent_tokens=64,
        max_seq_len=seq_len + 1024, host_pool_tokens=batch * (seq_len + 1024),
        max_draft_tokens=drafts)
    cache = hisparse.HiSparseCache(config, device=device)
    kv = torch.randint(0, 256, (1, seq_len, row_bytes), dtype=torch.uint8)
    for b in range(batch):
        cache.admit(b, seq_len)
        cache.write_prefill(b, kv)
        cache.commit_prefill(b)
    return cache


def query_rows(rng: np.random.Generator, previous: np.ndarray, n0: int, hot: int, S: int,
               churn: float, overlap: float) -> np.ndarray:
    """`[S, K]` positions < n0: row 0 follows `previous` with churn, row s keeps `overlap`."""
    K = previous.shape[0]
    fresh = max(1, n0 - hot - 1)  # positions well before the hot buffer's recent tokens
    row = previous.copy()
    replace = rng.random(K) < churn
    row[replace] = rng.integers(0, fresh, int(replace.sum()))
    rows = [row]
    for _ in range(S - 1):
        nxt = rows[-1].copy()
        change = rng.random(K) >= overlap
        nxt[change] = rng.integers(0, n0, int(change.sum()))
        rows.append(nxt)
    return np.stack(rows)


def timed(cache: hisparse.HiSparseCache, top_k: torch.Tensor, sync) -> tuple[float, int]:
    misses = int(cache.tables.counters[0, 1])
    sync()
    start = time.perf_counter()
    cache.swap_in(0, top_k)
    sync()
    return time.perf_counter() - start, int(cache.tables.counters[0, 1]) - misses


def run_cell(args: argparse.Namespace, S: int, overlap: float, churn: float, B: int) -> dict:
    K, hot = args.top_k, max(2, S) * args.top_k
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    verify = build(device, K, hot, S, B, args.seq_len, args.row_bytes)
    single = build(device, S * K, hot, 1, B, args.seq_len, args.row_bytes)
    rng = np.random.default_rng(0)
    previous = [rng.integers(0, args.seq_len, K) for _ in range(B)]
    times = {"verify": [], "single": []}
    misses = {"verify": [], "single": []}
    W = args.row_bytes
    for step in range(args.warmup + args.steps):
        n0 = verify.seq_len(0)
        rows = [query_rows(rng, previous[b], n0, hot, S, churn, overlap) for b in range(B)]
        previous = [r[0] for r in rows]
        top_k = torch.from_numpy(np.stack(rows)).to(torch.int32).to(device)
        union = [sorted(set(r.reshape(-1).tolist())) for r in rows]
        flat = torch.full((B, S * K), -1, dtype=torch.int32)
        for b, u in enumerate(union):
            flat[b, : len(u)] = torch.tensor(u, dtype=torch.int32)
        verify.begin_decode_step(list(range(B)), num_tokens=S)
        verify.write_newest(0, torch.zeros(B, S, W, dtype=torch.uint8, device=device))
        v_time, v_miss = timed(verify, top_k, sync)
        verify.end_decode_step(accepted=[S] * B)
        single.begin_decode_step(list(range(B)))
        single.write_newest(0, torch.zeros(B, W, dtype=torch.uint8, device=device))
        s_time, s_miss = timed(single, flat.to(device), sync)
        single.end_decode_step()
        for _ in range(S - 1):  # keep both caches at the same length
            single.begin_decode_step(list(range(B)))
            single.write_newest(0, torch.zeros(B, W, dtype=torch.uint8, device=device))
            single.end_decode_step()
        if step >= args.warmup:
            times["verify"].append(v_time)
            times["single"].append(s_time)
            misses["verify"].append(v_miss)
            misses["single"].append(s_miss)
    verify.close()
    single.close()
    v, s = statistics.mean(times["verify"]), statistics.mean(times["single"])
    return {"S": S, "overlap": overlap, "churn": churn, "B": B,
            "unique_misses_per_step": statistics.mean(misses["verify"]),
            "baseline_misses_per_step": statistics.mean(misses["single"]),
            "verify_us": v * 1e6, "single_us": s * 1e6, "ratio": v / s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a few small CPU-sized cells")
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--row-bytes", type=int, default=656)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    batches, churns = [1, 16, 64, 128], [0.05, 0.2, 1.0]
    if args.quick:
        args.top_k, args.seq_len, args.steps, args.warmup = 64, 2048, 4, 1
        batches, churns = [1, 4], [0.2, 1.0]
    cells = [run_cell(args, S, overlap, churn, B) for S in (2, 4, 8) for overlap in (0.9, 0.5)
             for churn in churns for B in batches]
    for cell in cells:
        print(json.dumps(cell))
    result = {
        "benchmark": "SW-2 verify step (benchmarks/verify_step.py)",
        "command": "PYTHONPATH=src python benchmarks/verify_step.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k not in ("out", "quick")),
        "device": args.device, "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "triton": _triton_version(), "cells": cells,
    }
    if args.device == "cpu":
        result["note"] = ("CPU backend: times are the torch reference on a shared CPU, not the "
                          "GPU target's; only the unique-miss counts carry over")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


if __name__ == "__main__":
    main()
