"""SW-2, speculative verify steps (benchmarks/README.md defines it), through the engine.

Per cell (S, overlap, churn, B): each request's first query row follows the previous step's
with churn c (c x K positions replaced by positions outside the hot buffer), and each next
query row keeps `overlap` of the row before it. A verify step of S tokens swaps in the
`[B, S, K]` top-k as one union; the baseline is a single-token step on a cache built with
top_k = S x K that is handed the same union rows (the single-token swap-in with the same
unique misses). Reported per cell: unique misses per step of both (read from the counters)
and two times of each, with their ratios (target: verify <= 1.25 x baseline):

* `device_us`: device events around the call, queued behind a device-side sleep so that the
  GPU reaches them after the host has enqueued every launch of the call: the GPU's time for
  the call's kernels, host launch gaps hidden (`tools.benchmarking.StepTimer(queued=True)`);
* `host_us`: the eager host wall-clock of the call (launch and bookkeeping, no synchronize
  inside), what a serving loop without graph capture pays on its CPU.

On the CPU backend both are the host wall-clock of the torch reference, which says nothing
about the GPU target. The caches of one (S, B) serve all its (overlap, churn) cells, so a
cell starts from the LRU state the previous one left. `--peer sglang` also times SGLang's
single-step kernel (benchmarks/sglang_peer.py, built with nvcc from the installed sglang
0.5.10.post1, which has no speculative kernel) on the same union rows, on a third cache.

    PYTHONPATH=src python benchmarks/verify_step.py --device cpu --grid quick
    PYTHONPATH=src python benchmarks/verify_step.py --device cuda \\
        --out benchmarks/results/sw2-h200.json [--grid reduced] [--peer sglang]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hisparse
from hisparse.kernels.swap_in.plan import tuning
from hisparse.tools.benchmarking import StepTimer, run_environment

# A verify swap-in enqueues five launches on the GPU backends since the eighteenth pass (union
# plan, three swap-in kernels, scatter), ~30 before (the union's torch ops) and still on the
# CPU: ~1 ms more device sleep first keeps the old runs comparable.
EXTRA_SLEEP_CYCLES = 2_000_000

# (S values, overlaps, churns, batches) of each grid.
GRIDS = {
    "full": ((2, 4, 8), (0.9, 0.5), (0.05, 0.2, 1.0), (1, 16, 64, 128)),
    "reduced": ((2, 4, 8), (0.9, 0.5), (0.05, 1.0), (1, 128)),
    "quick": ((2, 4), (0.9,), (0.2, 1.0), (1, 4)),
}


def build(device: str, top_k: int, hot: int, drafts: int, batch: int, seq_len: int,
          row_bytes: int, growth: int, kv: torch.Tensor) -> hisparse.HiSparseCache:
    # validate off: its checks read the top-k back to the host (a sync inside the call).
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=1, row_bytes=row_bytes, top_k=top_k, hot_slots=hot,
        index_group_size=1, max_requests=batch, max_batch=batch, extent_tokens=64,
        max_seq_len=seq_len + growth, host_pool_tokens=batch * (seq_len + growth),
        max_draft_tokens=drafts, validate=False)
    cache = hisparse.HiSparseCache(config, device=device)
    for b in range(batch):
        cache.admit(b, seq_len)
        cache.write_prefill(b, kv)
        cache.commit_prefill(b)
    cache.backend.synchronize()
    return cache


def query_rows(rng: np.random.Generator, previous: np.ndarray, bound: int, hot: int, S: int,
               churn: float, overlap: float) -> np.ndarray:
    """`[B, S, K]` positions < bound: row 0 follows `previous [B, K]` with churn, row s keeps
    `overlap` of row s - 1. Positions stay below the prompt's length, so every cache (and
    the peer, whose length never grows) can serve them."""
    B, K = previous.shape
    fresh = max(1, bound - hot - 1)  # positions well before the hot buffer's recent tokens
    row = previous.copy()
    replace = rng.random((B, K)) < churn
    row[replace] = rng.integers(0, fresh, int(replace.sum()))
    rows = [row]
    for _ in range(S - 1):
        nxt = rows[-1].copy()
        change = rng.random((B, K)) >= overlap
        nxt[change] = rng.integers(0, bound, int(change.sum()))
        rows.append(nxt)
    return np.stack(rows, axis=1)


def union_rows(rows: np.ndarray) -> np.ndarray:
    """`[B, S*K]` each request's distinct positions in first-occurrence order (s-major, then
    k: the union kernels' order, so both caches' swap-ins see identical rows), then -1."""
    B = rows.shape[0]
    flat = rows.reshape(B, -1)
    order = np.argsort(flat, axis=1, kind="stable")
    ordered = np.take_along_axis(flat, order, axis=1)
    distinct = np.ones_like(ordered, dtype=bool)
    distinct[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    # Stable: a run's first sorted element is its first entry; those entries, ascending.
    missing = np.iinfo(np.int64).max
    entries = np.sort(np.where(distinct, order, missing), axis=1)
    taken = np.take_along_axis(flat, np.where(entries == missing, 0, entries), axis=1)
    return np.where(entries == missing, -1, taken).astype(np.int32)


class Timing:
    """Device and host seconds of every timed call of one kernel, and its misses."""

    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer
        self.device: list[Any] = []
        self.host: list[float] = []
        self.misses: list[int] = []

    def call(self, cache: hisparse.HiSparseCache | None, run: Any, timed: bool) -> None:
        before = int(cache.tables.counters[0, 1]) if cache is not None else 0
        backend = self.timer.backend
        backend.synchronize()
        host = [0.0]

        def call() -> None:
            start = time.perf_counter()
            run()
            host[0] = time.perf_counter() - start

        if self.timer.queued:
            torch.cuda._sleep(EXTRA_SLEEP_CYCLES)
        elapsed = self.timer.record(call)
        backend.synchronize()
        if timed:
            self.device.append(elapsed())
            self.host.append(host[0])
            if cache is not None:
                self.misses.append(int(cache.tables.counters[0, 1]) - before)

    def summary(self) -> dict[str, float]:
        return {"device_us": statistics.median(self.device) * 1e6,
                "host_us": statistics.median(self.host) * 1e6,
                **({"misses_per_step": statistics.mean(self.misses)} if self.misses else {})}


def wrong_rows(cache: hisparse.HiSparseCache, rows: torch.Tensor, positions: torch.Tensor,
               truth: torch.Tensor) -> int:
    """How many selected positions' device rows differ from the position's own row (the check
    of a cell's last step, outside the timing)."""
    selected = positions >= 0
    kv = cache.device_kv(0)[rows.clamp(min=0).long()]
    want = truth[positions.clamp(min=0).long()]
    return int((selected & ~(kv == want).all(-1)).sum())


def union_path(cache: hisparse.HiSparseCache, S: int) -> str:
    """How the cache's verify steps of S de-duplicate (core.union): a private detail of the
    engine, read here so that every cell says which path it timed."""
    width = cache._verify.widths.get(S)
    if width is None:
        return "none yet"
    return "in the swap-in" if width.kernels.fuses_union else "union plan and scatter"


def run_pair(args: argparse.Namespace, S: int, B: int, cells: list[tuple[float, float]],
             peer: Any) -> list[dict[str, Any]]:
    """Every (overlap, churn) cell of one (S, B) on one verify and one baseline cache."""
    K, hot, W, device = args.top_k, max(2, S) * args.top_k, args.row_bytes, args.device
    steps = args.warmup + args.steps
    growth = -(-(len(cells) * steps * S + 2) // 64) * 64
    kv = torch.randint(0, 256, (1, args.seq_len, W), dtype=torch.uint8)
    verify = build(device, K, hot, S, B, args.seq_len, W, growth, kv)
    single = build(device, S * K, hot, 1, B, args.seq_len, W, growth, kv)
    timer = StepTimer(verify.backend, verify.device, queued=True)
    peer_cache, peer_run, peer_pad, peer_error = None, None, None, None
    if peer is not None:
        peer_cache = build(device, S * K, hot, 1, B, args.seq_len, W, growth, kv)
        try:  # e.g. a union wider than the kernel's shared memory holds: say so, go on
            peer_run, peer_pad = peer(peer_cache, B, S * K)
        except Exception as exc:
            peer_error = f"{type(exc).__name__}: {exc}"
    dev = verify.device
    zeros_v = torch.zeros(B, S, W, dtype=torch.uint8, device=dev)
    zeros_s = torch.zeros(B, W, dtype=torch.uint8, device=dev)
    rng = np.random.default_rng([S, B])
    previous = rng.integers(0, args.seq_len, (B, K))
    results = []
    truth = kv[0].to(dev)  # every position's row: all the timed positions are the prompt's
    got: dict[str, torch.Tensor] = {}
    for overlap, churn in cells:
        wrong = {"verify": 0, "single": 0, "sglang": 0}
        kinds = {"verify": Timing(timer), "single": Timing(timer), "sglang": Timing(timer)}
        for step in range(steps):
            rows = query_rows(rng, previous, args.seq_len, hot, S, churn, overlap)
            previous = rows[:, 0]
            top_k = torch.from_numpy(rows.astype(np.int32)).to(dev)
            union = union_rows(rows)
            flat = torch.from_numpy(union).to(dev)
            timed = step >= args.warmup
            verify.begin_decode_step(list(range(B)), num_tokens=S)
            verify.write_newest(0, zeros_v)
            kinds["verify"].call(verify, lambda t=top_k: got.update(verify=verify.swap_in(0, t)),
                                 timed)
            if step == steps - 1:
                wrong["verify"] += wrong_rows(verify, got["verify"], top_k, truth)
            verify.end_decode_step(accepted=[S] * B)
            for extra in range(S):  # the baseline grows by as many tokens
                single.begin_decode_step(list(range(B)))
                single.write_newest(0, zeros_s)
                if extra == 0:
                    kinds["single"].call(
                        single, lambda f=flat: got.update(single=single.swap_in(0, f)), timed)
                    if step == steps - 1:
                        wrong["single"] += wrong_rows(single, got["single"], flat, truth)
                single.end_decode_step()
            if peer_run is not None:
                try:
                    peer_flat = peer_pad(union)
                    kinds["sglang"].call(
                        None, lambda f=peer_flat, p=peer_run: got.update(sglang=p(f)), timed)
                    if step == steps - 1:
                        wrong["sglang"] += wrong_rows(peer_cache, got["sglang"], peer_flat,
                                                      truth)
                except Exception as exc:  # a launch refused at this width, a row unfilled
                    peer_run, peer_error = None, f"{type(exc).__name__}: {exc}"
        cell: dict[str, Any] = {"S": S, "overlap": overlap, "churn": churn, "B": B,
                                "wrong_rows": dict(wrong), "union": union_path(verify, S)}
        v, s = kinds["verify"].summary(), kinds["single"].summary()
        cell.update({"unique_misses_per_step": v["misses_per_step"],
                     "baseline_misses_per_step": s["misses_per_step"],
                     "verify_device_us": v["device_us"], "single_device_us": s["device_us"],
                     "ratio_device": v["device_us"] / s["device_us"],
                     "verify_host_us": v["host_us"], "single_host_us": s["host_us"],
                     "ratio_host": v["host_us"] / s["host_us"]})
        if peer_error is not None:
            cell["sglang_error"] = peer_error[:300]
        elif peer_run is not None:
            p = kinds["sglang"].summary()
            cell.update({"sglang_union_device_us": p["device_us"],
                         "sglang_union_host_us": p["host_us"],
                         "verify_vs_sglang_device": v["device_us"] / p["device_us"]})
        print(json.dumps(cell), flush=True)
        results.append(cell)
    for cache in (verify, single, peer_cache):
        if cache is not None:
            cache.close()
    return results


def sglang_peer(args: argparse.Namespace, record: dict[str, Any]) -> Any:
    """A factory: (cache, B, U) -> a call that runs SGLang's single-step kernel over `[B, U]`
    union rows on that cache's tables (it keeps its own LRU and slot tables, sglang_peer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sglang_peer as peer_module

    source = peer_module.find_source(args.sglang_source)
    record["peer"] = {**peer_module.describe(source, peer_module.DEFAULT_BLOCK_SIZE),
                      "what": "SGLang's single-step kernel on the union of the S rows (the "
                              "installed 0.5.10.post1 predates its speculative kernel)"}

    def make(cache: hisparse.HiSparseCache, B: int, U: int) -> Any:
        library = peer_module.load_library(peer_module.compile_library(
            source, U, cache.hot_slots, Path(args.peer_build_dir)))
        slots = [cache.request_slot(b) for b in range(B)]
        assert slots == list(range(B)), slots  # PeerTables index rows by request slot
        host_rows = np.stack([cache.host_rows(b)[: args.seq_len] for b in range(B)])
        kernel = peer_module.PeerSwapIn(library, cache.backend, cache.tables, host_rows)
        dev = cache.device
        req_slots = torch.tensor(slots, dtype=torch.int32, device=dev)
        num_real = torch.tensor([B], dtype=torch.int32, device=dev)
        out = torch.full((B, U), -1, dtype=torch.int32, device=dev)

        def run(flat: torch.Tensor) -> torch.Tensor:
            kernel(cache.tables, 0, 0, req_slots, flat, num_real, out)
            return out

        def pad(union: np.ndarray) -> torch.Tensor:
            # SGLang's kernel takes exactly U distinct positions: it counts U - hits misses
            # and copies that many (a -1 or a repeat runs it past its misses, reading garbage
            # host locations: an H200 run faulted that way). Each union row's
            # padding is filled with positions its own hot buffer holds and the row lacks,
            # which it serves as hits: lookups, no copies, the same misses as the union's.
            held = kernel.peer.buffer_tokens[:, : cache.hot_slots].cpu().numpy()
            rows = union.copy()
            for b in range(B):
                n = int((rows[b] >= 0).sum())
                spare = np.setdiff1d(held[b][held[b] >= 0], rows[b, :n])
                if len(spare) < U - n:
                    raise ValueError(f"row {b}: {len(spare)} resident positions to pad "
                                     f"{U - n} entries")
                rows[b, n:] = spare[: U - n]
            return torch.from_numpy(rows).to(dev)

        return run, pad

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="full",
                        help="full: issue 22's 72 cells; reduced: 24 (B 1 and 128, churn "
                        "0.05 and 1.0); quick: 8 small CPU-sized ones (default: full)")
    parser.add_argument("--quick", action="store_true", help="same as --grid quick")
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--row-bytes", type=int, default=656)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peer", choices=["sglang"], default=None,
                        help="also time SGLang's single-step kernel on the union rows (CUDA, "
                        "nvcc and an installed sglang needed)")
    parser.add_argument("--sglang-source", default=None,
                        help="path to SGLang's hisparse.cuh (default: the installed sglang)")
    parser.add_argument("--peer-build-dir", default="/tmp/hisparse-sglang-peer")
    parser.add_argument("--tokens", type=int, nargs="+", help="S values (default: the grid's)")
    parser.add_argument("--batches", type=int, nargs="+", help="B values (default: the grid's)")
    parser.add_argument("--tuning", type=json.loads, default={},
                        help='launch-plan overrides as JSON, e.g. \'{"verify_first_candidates": '
                        'true}\' (kernels.swap_in.plan.Tuning; an A/B of a switch)')
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.grid = "quick"
    if args.grid == "quick":
        args.top_k, args.seq_len, args.steps, args.warmup = 64, 2048, 4, 1
    tokens, overlaps, churns, batches = GRIDS[args.grid]
    tokens, batches = args.tokens or tokens, args.batches or batches
    result: dict[str, Any] = {
        "benchmark": "SW-2 verify step (benchmarks/verify_step.py)",
        "command": "PYTHONPATH=src python benchmarks/verify_step.py " + " ".join(sys.argv[1:]),
        "device": args.device, "machine": platform.processor() or platform.machine(),
        **run_environment(args.device), "grid": args.grid,
        "top_k": args.top_k, "seq_len": args.seq_len, "row_bytes": args.row_bytes,
        "steps": args.steps, "warmup": args.warmup, "tuning": args.tuning,
        "timing": {"device_us": "median of device events queued behind a device-side sleep "
                                "(kernel time, host launch gaps hidden)",
                   "host_us": "median eager host wall-clock of the call, no sync inside"},
    }
    peer = sglang_peer(args, result) if args.peer == "sglang" else None
    cells = [(overlap, churn) for overlap in overlaps for churn in churns]
    started = time.perf_counter()
    with tuning(**args.tuning):
        result["cells"] = [cell for S in tokens for B in batches
                           for cell in run_pair(args, S, B, cells, peer)]
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.device == "cpu":
        result["note"] = ("CPU backend: times are the torch reference on a shared CPU, not the "
                          "GPU target's; only the unique-miss counts carry over")
    result["all_correct"] = all(not any(c["wrong_rows"].values()) for c in result["cells"])
    worst = max(c["ratio_device"] for c in result["cells"])
    versus = [c["verify_vs_sglang_device"] for c in result["cells"]
              if "verify_vs_sglang_device" in c]
    if versus:
        result["worst_vs_sglang_device"] = max(versus)
        print(f"worst verify/SGLang-on-the-union device-time ratio {max(versus):.2f} over "
              f"{len(versus)} cells (target < 1)", flush=True)
    print(f"worst verify/single device-time ratio {worst:.2f} (target <= 1.25); "
          f"all rows correct: {result['all_correct']}; "
          f"{result['wall_s']} s", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
