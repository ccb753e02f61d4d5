"""SW-1, the swap-in kernel workload (benchmarks/README.md defines it), on one CUDA GPU.

One layer, 656 B rows, top_k 2048, hot buffer 4096 (+1 newest), every request at seq_len 32768
fully in the host pool; the tables, layouts and top-k trace are hisparse.tools.benchmarking's (the
same workload `hisparse bench` times eagerly). Each step keeps (1 - churn) of the previous
top-k and takes the rest from positions that are not in the hot buffer, so it misses exactly
churn x K rows. Before each step the L2 is flushed (the rest of a model runs between two
swap-ins of one layer) and the top-k written; steps run as CUDA graph replays queued behind a
GPU sleep, so the times are device times; every step's rows are checked byte for byte against
the host pool.

    PYTHONPATH=src python benchmarks/swap_in.py              # full SW-1 + extent sweep
    PYTHONPATH=src python benchmarks/swap_in.py --quick      # smoke run, a few cells
    PYTHONPATH=src python benchmarks/swap_in.py --ab selection  # a round of variants (AB_ROUNDS)
    PYTHONPATH=src python benchmarks/swap_in.py --padding  # small batches padded to capacities
    PYTHONPATH=src python benchmarks/swap_in.py --vs-sglang  # SGLang's kernel side by side
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hisparse.backends.registry import get_backend
from hisparse.cli._output import non_negative_int, positive_int
from hisparse.errors import InvalidInputError
from hisparse.layout.tables import CacheTables, MissPlan
from hisparse.tools import benchmarking

SIZES = benchmarking.SW1Sizes()  # SW-1's sizes; extent_tokens: HiSparseConfig's default

# Variant rounds for --ab ROUND (swap_in_triton.Tuning overrides on top of the shipped
# defaults, and "residency_map": what the tables' residency map is keyed by, default
# --residency-map; "chosen" is the defaults, run first and last as a noise control). The rounds of
# the ordered-list LRU (planning ... fine-extent-copy, benchmarks/NOTES.md passes 2-11) needed
# its plan kernels, which the stamp LRU replaced; they are in git history before commit
# "LRU kept as per-slot stamps", and so are their results (benchmarks/results/sw1-cuda-ab-*.json).
AB_ROUNDS: dict[str, dict[str, dict[str, object]]] = {
    # The victim selection (NOTES.md, thirteenth pass): rounds of oldest stamp values before
    # the bit search, and the width of its programs.
    "selection": {
        "chosen": {},
        "bit-search": {"select_fast_rounds": 0},
        "one-round": {"select_fast_rounds": 1},
        "four-rounds": {"select_fast_rounds": 4},
        "select-warps4": {"select_warps": 4},
        "select-warps16": {"select_warps": 16},
        "chosen-again": {},
    },
    # The copy's launch and in-flight window behind the new selection kernel.
    "copy-window": {
        "chosen": {},
        "large-batch-copy2": {"large_batch_copy_programs_per_unit": 2},
        "large-batch-copy4": {"large_batch_copy_programs_per_unit": 4},
        "pdl-copy-all": {"pdl": True, "pdl_copy_max_batch": None},
        "prefetch-b16": {"prefetch_copy_max_batch": 16},
        "chosen-again": {},
    },
    # The plan in host-address order (NOTES.md, fourteenth pass): from which batch capacity,
    # how many buckets, and the copy grid behind it on scattered rows.
    "address-order": {
        "chosen": {},
        "batch-row-order": {"address_order_min_batch": None},
        "from-b16": {"address_order_min_batch": 16},
        "buckets-64": {"address_buckets": 64},
        "buckets-1024": {"address_buckets": 1024},
        "scattered-copy-1": {"fine_extent_copy_programs_per_unit": None},
        "scattered-copy-8": {"fine_extent_copy_programs_per_unit": 8},
        "chosen-again": {},
    },
    # Its second round: claims per row instead of per miss, on scattered layouts only.
    "address-order-2": {
        "chosen": {},
        "batch-row-order": {"address_order_min_batch": None},
        "buckets-256": {"address_buckets": 256},
        "buckets-4096": {"address_buckets": 4096},
        "all-layouts": {"address_order_max_extent_tokens": None},
        "scattered-copy-1": {"fine_extent_copy_programs_per_unit": None},
        "chosen-again": {},
    },
    # The residency map keyed by (request, position) instead of host row (NOTES.md, fifteenth
    # pass): a hit then needs no page-table read.
    "position-keyed": {
        "chosen": {},
        "position-keyed": {"residency_map": "position"},
        "chosen-again": {},
    },
    # Programmatic dependent launch, off by default since the thirty-first pass (an unexplained
    # fault under GPU sharing): what turning it off costs. Predicted from round "launch": about
    # -2 us at B=1 with PDL, nothing from B=64. The prefetching copy (B <= 16) was chosen with
    # PDL, which let it fetch while the selection ran; without PDL the planned copy may match it.
    "pdl": {
        "chosen": {},
        "pdl-on": {"pdl": True},
        "planned-copy": {"prefetch_copy_max_batch": 0},
        "chosen-again": {},
    },
}
AB_GRIDS = {"selection": ([1, 16, 64, 128], [0.0, 0.05, 0.2, 1.0]),
            "position-keyed": ([1, 16, 64, 128], [0.0, 0.05, 0.2, 1.0]),
            "copy-window": ([1, 16, 64, 128], [0.05, 0.2, 1.0]),
            "address-order": ([16, 64, 128], [0.0, 0.05, 0.2, 1.0]),
            "address-order-2": ([64, 128], [0.0, 0.05, 0.2, 1.0]),
            "pdl": ([1, 16, 64, 128], [0.0, 0.05, 0.2, 1.0])}
# SGLang 0.5.23's fused swap-in on SW-1 scattered, H200 (issue 4; quoted, not re-measured here).
SGLANG_US = {
    (1, 0.05): 33, (1, 0.2): 70, (1, 1.0): 257,
    (16, 0.05): 63, (16, 0.2): 181, (16, 1.0): 808,
    (64, 0.05): 195, (64, 0.2): 714, (64, 1.0): 3122,
    (128, 0.05): 380, (128, 0.2): 1357, (128, 1.0): 6099,
}


@dataclass
class Pool:
    host: torch.Tensor  # [rows, row_bytes] uint8, registered host memory
    mirror: torch.Tensor  # the same bytes on the device: seeds hot buffers, checks every step


def random_pool_with_mirror(host: torch.Tensor, gen: torch.Generator) -> Pool:
    """Random bytes in the registered rows `host`, and their mirror on the device."""
    rows = host.shape[0]
    mirror = torch.empty(rows, SIZES.row_bytes, dtype=torch.uint8, device="cuda")
    chunk = 1 << 20
    for first in range(0, rows, chunk):
        block = mirror[first : first + chunk]
        block.random_(0, 256, generator=gen)
        host[first : first + chunk].copy_(block)
    return Pool(host, mirror)


@dataclass
class Cell:
    tables: CacheTables
    host_rows: torch.Tensor  # [B, seq_len] int64 on the device: host row of every position
    trace: benchmarking.ChurnTrace

    def next_top_k(self) -> torch.Tensor:
        return torch.from_numpy(self.trace.step()).to(self.host_rows.device)


def build_cell(pool: Pool, batch: int, churn: float, layout: str, extent: int,
               rng: np.random.Generator, residency_map: str = "host_row") -> Cell:
    """SW-1's tables and top-k trace (hisparse.tools.benchmarking), extents of `extent` tokens."""
    sizes = dataclasses.replace(SIZES, extent_tokens=extent)
    tables, host_rows = benchmarking.build_tables(
        get_backend("cuda"), pool.host, layout, batch, sizes, rng, mirror=pool.mirror,
        residency_map=residency_map)
    return Cell(tables, torch.from_numpy(host_rows).cuda(),
                benchmarking.ChurnTrace(batch, sizes, churn, rng))


def count_wrong_rows(pool: Pool, cell: Cell, top_k: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """Device scalar: entries whose returned row differs from the host row (or is missing)."""
    return benchmarking.wrong_rows(cell.tables, pool.mirror, cell.host_rows, top_k, out)


def run_cell(pool: Pool, batch: int, churn: float, layout: str, extent: int, args,
             seed: int, batch_capacity: int | None = None,
             peer: tuple[str, Callable[..., object]] | None = None,
             residency_map: str | None = None) -> dict[str, object]:
    """hisparse.tools.benchmarking's SW-1 cell (graph replays, every step checked against the
    mirror, then the skip-IO probe) as one JSON record; `batch_capacity`: padded to it.
    `peer` (name, kernel_for): time that kernel on the cell instead, without the probe.
    `residency_map`: hisparse's (None: --residency-map)."""
    sizes = dataclasses.replace(SIZES, extent_tokens=extent, warmup_steps=args.warmup,
                                timed_steps=args.steps)
    residency_map = residency_map or args.residency_map
    cell = benchmarking.sw1_cell(get_backend("cuda"), pool.host, layout, batch, churn, sizes,
                                 seed, mirror=pool.mirror, skip_io=peer is None,
                                 batch_capacity=batch_capacity, flush=args.flush,
                                 kernel_for=None if peer is None else peer[1],
                                 residency_map=residency_map)
    median = cell.step_seconds * 1e6
    record: dict[str, object] = {
        "kernel": "hisparse" if peer is None else peer[0],
        "B": batch, "churn": churn, "layout": layout, "extent_tokens": cell.extent_tokens,
        **({"residency_map": residency_map} if peer is None else {}),
        **({"batch_capacity": batch_capacity} if batch_capacity is not None else {}),
        "median_us": round(median, 1),
        "p90_us": round(cell.p90_seconds * 1e6, 1),
        "misses_per_step": cell.misses_per_step,
        "miss_GBps": round(cell.misses_per_step * SIZES.row_bytes / median / 1e3, 2),
        "skip_io_median_us": round((cell.skip_io_step_seconds or 0.0) * 1e6, 1),
        "correct": cell.verified,
    }
    if peer is not None:
        del record["skip_io_median_us"]
        record["misses_counted_by"] = cell.misses_counted_by
    quoted = layout == "scattered" and peer is None
    reference = SGLANG_US.get((batch, churn)) if quoted else None
    if reference is not None:
        record["sglang_0_5_23_us"] = reference
        record["speedup_vs_sglang"] = round(reference / median, 2)
    print(json.dumps(record), flush=True)
    return record


def miss_free_warm(pool: Pool, rng: np.random.Generator, args,
                   residency_map: str | None = None) -> dict[str, float]:
    """B=128, churn 0, the same top-k replayed back to back (a warm L2, unlike SW-1's cells):
    graph replay, eager device time and eager wall time."""
    from hisparse.kernels.swap_in import swap_in_triton

    batch = min(128, pool.host.shape[0] // SIZES.seq_len)  # --quick sizes the pool smaller
    cell = build_cell(pool, batch, 0.0, "extents", SIZES.extent_tokens, rng,
                      residency_map or args.residency_map)
    t = cell.tables
    dev = t.last_use.device
    req_slots = torch.arange(batch, dtype=torch.int32, device=dev)
    num_real = torch.tensor([batch], dtype=torch.int32, device=dev)
    top_k = cell.next_top_k()
    out = torch.empty(batch, SIZES.top_k, dtype=torch.int32, device=dev)
    plan = MissPlan.empty(batch, SIZES.top_k, dev)

    def call() -> None:
        swap_in_triton(t, 0, 0, req_slots, top_k, num_real, out, plan)

    for _ in range(3):  # after the first step every entry hits and the state stops changing
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()

    timer = benchmarking.StepTimer(get_backend("cuda"), dev, queued=True)

    def device_us(fn: Callable[[], None]) -> float:
        return round(statistics.median(timer.time(fn) for _ in range(args.steps)) * 1e6, 1)

    torch.cuda.synchronize()
    misses_before = int(t.counters[0, 1])
    begin = time.perf_counter()
    for _ in range(args.steps):
        call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - begin) / args.steps * 1e6
    result = {
        "B": batch, "graph_us": device_us(graph.replay), "eager_device_us": device_us(call),
        "eager_wall_us": round(wall, 1),
        "misses_while_timed": int(t.counters[0, 1]) - misses_before,
        "wrong_rows": int(count_wrong_rows(pool, cell, top_k, out)),
    }
    print("miss-free (warm)", json.dumps(result), flush=True)
    return result


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for layout, style in (("scattered", "--"), ("extents", "-")):
        for batch in sorted({r["B"] for r in results["records"]}):
            cells = [r for r in results["records"] if r["layout"] == layout and r["B"] == batch
                     and r["churn"] > 0]
            if cells:
                left.plot([r["churn"] for r in cells], [r["miss_GBps"] for r in cells], style,
                          marker="o", label=f"{layout} B={batch}")
    limits = results.get("limits", {})
    for key, label in (("bulk_h2d_GBps", "bulk pinned H2D"),):
        if key in limits:
            left.axhline(limits[key], color="k", lw=0.8, ls=":")
            left.text(0.05, limits[key] + 0.5, label, fontsize=8)
    left.axhline(44, color="r", lw=0.8, ls=":")
    left.text(0.05, 44.5, "target 44 GB/s (extents, B>=64, c>=0.2)", fontsize=8, color="r")
    left.set_xscale("log")
    left.set_xlabel("churn")
    left.set_ylabel("miss bandwidth (GB/s)")
    left.set_title(f"SW-1 swap-in on {results['card']}")
    left.legend(fontsize=7)
    sweep = results.get("extent_sweep", [])
    if sweep:
        right.plot([r["extent_tokens"] for r in sweep], [r["miss_GBps"] for r in sweep],
                   marker="o")
        right.set_xscale("log", base=2)
        right.set_xlabel("extent size (tokens), extents in random order")
        right.set_ylabel("miss bandwidth (GB/s)")
        right.set_title("B=128, churn 1.0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def sglang_peer_kernel(args, results: dict) -> tuple[str, Callable[..., object]]:
    """(name, kernel_for) of SGLang's kernel (sglang_peer), built for SW-1's sizes; what it
    is goes into `results["peer"]`."""
    import sglang_peer

    source = sglang_peer.find_source(args.vs_sglang or None)
    library = sglang_peer.load_library(sglang_peer.compile_library(
        source, SIZES.top_k, SIZES.hot_slots, Path(args.peer_build_dir),
        block_size=args.peer_block_size))
    backend = get_backend("cuda")
    results["peer"] = sglang_peer.describe(source, args.peer_block_size)
    name = results["peer"]["kernel"]

    def kernel_for(tables: CacheTables, host_rows: np.ndarray) -> sglang_peer.PeerSwapIn:
        return sglang_peer.PeerSwapIn(library, backend, tables, host_rows)

    return name, kernel_for


def run_vs_sglang(pool: Pool, batches: list[int], churns: list[float], args,
                  results: dict, save: Callable[[], None], path: Path) -> int:
    """hisparse's kernel and SGLang's (sglang_peer) on every cell, one after the other on the
    same pool, tables and trace; which goes first alternates from cell to cell."""
    name, kernel_for = sglang_peer_kernel(args, results)
    order = 0
    for layout in ("scattered", "extents"):
        extent = 1 if layout == "scattered" else SIZES.extent_tokens
        for batch in batches:
            for churn in churns:
                runs = [None, (name, kernel_for)]
                pair = {}
                for peer in (runs if order % 2 == 0 else runs[::-1]):
                    record = run_cell(pool, batch, churn, layout, extent, args, args.seed,
                                      peer=peer)
                    pair[record["kernel"]] = record
                order += 1
                ours = pair["hisparse"]
                ours[f"{name}_measured_us"] = pair[name]["median_us"]
                ours[f"speedup_vs_{name}"] = round(
                    pair[name]["median_us"] / ours["median_us"], 2)
                results["records"] += [ours, pair[name]]
                save()
    print(f"\nmedian us, hisparse / {name} (speedup); flush: {args.flush}")
    for record in results["records"]:
        if record["kernel"] == "hisparse":
            print(f"{record['layout']:>9} B={record['B']:<3} churn={record['churn']:<4} "
                  f"{record['median_us']:>8} / {record[f'{name}_measured_us']:>8} "
                  f"({record[f'speedup_vs_{name}']}x)"
                  + ("" if record["correct"] else " WRONG ROWS"))
    save()
    print(f"wrote {path}")
    return 0 if results["all_correct"] else 1


def run_ab(pool: Pool, batches: list[int], churns: list[float], args, rng: np.random.Generator,
           results: dict, save: Callable[[], None], path: Path) -> int:
    """Every variant of the round on the same reduced grid, in one process (same pool, same
    GPU state), then one median-us table per layout on stdout."""
    from hisparse.kernels import swap_in as kernels

    variants: dict[str, dict[str, object] | None] = dict(AB_ROUNDS[args.ab])
    results["ab_round"] = args.ab
    results["ab_variants"] = dict(variants)
    results["miss_free_by_variant"] = {}
    peer = None
    if args.vs_sglang is not None:  # SGLang's kernel first and last, around the variants
        peer = sglang_peer_kernel(args, results)
        variants = {peer[0]: None, **variants, f"{peer[0]}-again": None}
    for name, overrides in variants.items():
        tune = dict(overrides or {})
        residency_map = str(tune.pop("residency_map", args.residency_map))
        try:
            with kernels.tuning(**tune):
                for layout in ("scattered", "extents"):
                    extent = 1 if layout == "scattered" else SIZES.extent_tokens
                    for batch in batches:
                        for churn in churns:
                            record = run_cell(pool, batch, churn, layout, extent, args,
                                              args.seed, peer=peer if overrides is None else None,
                                              residency_map=residency_map)
                            record.setdefault("skip_io_median_us", "-")
                            results["records"].append({"variant": name, **record})
                            save()
                if overrides is not None:
                    results["miss_free_by_variant"][name] = miss_free_warm(pool, rng, args,
                                                                           residency_map)
                save()
        except Exception as exc:  # one broken variant must not cost the others' numbers
            print(f"variant {name} failed: {type(exc).__name__}: {exc}", flush=True)
            results.setdefault("failed_variants", {})[name] = f"{type(exc).__name__}: {exc}"
            save()
    for layout in ("scattered", "extents"):
        print(f"\nmedian us (skip-IO us), {layout}; miss-free = B=128 warm graph")
        cells = [(b, c) for b in batches for c in churns]
        print("variant".ljust(14) + "".join(f"B{b}c{c}".rjust(15) for b, c in cells)
              + "miss-free".rjust(11))
        for name in variants:
            row = {(r["B"], r["churn"]): r for r in results["records"]
                   if r["variant"] == name and r["layout"] == layout}
            text = "".join(
                (f"{row[c]['median_us']}({row[c]['skip_io_median_us']})"
                 + ("" if row[c]["correct"] else "!")).rjust(15) if c in row else "-".rjust(15)
                for c in cells)
            free = results["miss_free_by_variant"].get(name, {}).get("graph_us", "-")
            print(name.ljust(14) + text + str(free).rjust(11))
    save()
    print(f"wrote {path}")
    return 0 if results["all_correct"] and not results.get("failed_variants") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SW-1 swap-in benchmark (benchmarks/README.md)")
    parser.add_argument("--quick", action="store_true", help="a few cells, few steps (smoke)")
    parser.add_argument("--extent-sweep", action="store_true",
                        help="only the extent-size sweep at B=128, churn 1.0")
    parser.add_argument("--variants", action="store_true",
                        help="also time launch-parameter variants on a few cells")
    parser.add_argument("--ab", choices=sorted(AB_ROUNDS),
                        help="only the variants of this round (AB_ROUNDS) on its reduced grid "
                        "(AB_GRIDS), both layouts, plus the miss-free step per variant")
    parser.add_argument("--padding", action="store_true",
                        help="only B=1 and 16 (extents) padded to larger batch capacities: what "
                        "a graph captured at max_batch costs a small batch")
    parser.add_argument("--tune-copy", action="store_true",
                        help="run with the copy launch parameters the limits sweep liked best")
    parser.add_argument("--flush", choices=benchmarking.FLUSH_MODES, default="write",
                        help="how the caches are evicted before each step: written over (every "
                        "line dirty, SW-1's default), read over (clean lines) or not at all "
                        "(SW-1's tables then stay warm at churn 0)")
    parser.add_argument("--vs-sglang", nargs="?", const="", metavar="HISPARSE_CUH",
                        help="time SGLang's fused swap-in kernel side by side with hisparse's "
                        "on every cell (benchmarks/sglang_peer.py): from the installed sglang "
                        "package, or from this path of its jit_kernel/csrc/hisparse.cuh")
    parser.add_argument("--peer-block-size", type=int, default=1024,
                        help="threads per request for SGLang's kernel (its coordinator's)")
    parser.add_argument("--peer-build-dir", default="/tmp/hisparse-sglang-peer",
                        help="where the SGLang kernel's library is built")
    parser.add_argument("--residency-map", choices=("host_row", "position"),
                        default="host_row",
                        help="what hisparse's residency map is keyed by (CacheTables."
                             "residency_map; config residency_map)")
    parser.add_argument("--warmup", type=non_negative_int, default=8)
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.vs_sglang is not None:  # now, not after the pool is built and filled
        import sglang_peer

        try:
            source = sglang_peer.find_source(args.vs_sglang or None)
            sglang_peer.device_code(source.read_text())  # refuses a signature it cannot launch
            if shutil.which("nvcc") is None:
                raise InvalidInputError("nvcc is not on PATH; the SGLang kernel is CUDA source "
                                        "and needs the CUDA toolkit's compiler")
        except InvalidInputError as exc:
            parser.error(f"argument --vs-sglang: {exc}")
    if not torch.cuda.is_available():
        print("swap_in.py needs a CUDA GPU (the Triton kernels read registered host memory); "
              "none is visible", file=sys.stderr)
        return 2
    import triton

    from copy_limits import alloc_registered, measure

    batches, churns = [1, 16, 64, 128], [0.0, 0.05, 0.2, 1.0]
    sweep_extents = [1, 16, 64, 128, 256, 512, 1024, 2048]
    if args.quick:
        batches, churns, sweep_extents = [1, 16], [0.0, 1.0], [1, 512]
        args.warmup, args.steps = 2, 5
    if args.ab:
        batches, churns = AB_GRIDS[args.ab]
    if args.padding:
        batches, churns = [1, 16], [0.0, 0.2, 1.0]
    if args.vs_sglang is not None and args.quick:
        batches, churns = [1, 16], [0.0, 0.2, 1.0]
    max_batch = 128 if (not args.quick or args.extent_sweep) else max(batches)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)  # the pool's bytes
    rng = np.random.default_rng(args.seed)  # layouts and top-k traces
    rows = max_batch * SIZES.seq_len
    began = time.perf_counter()
    host = alloc_registered(rows * SIZES.row_bytes).view(rows, SIZES.row_bytes)
    peer_run = args.vs_sglang is not None
    limits = measure(host) if not (args.quick or args.ab or args.padding or peer_run) else {}
    from hisparse.kernels import swap_in as kernels

    chosen = limits.get("copy_tuning_choice", {}) if args.tune_copy else {}
    tuning_scope = kernels.tuning(**chosen)
    tuning_scope.__enter__()  # held for the whole run; the process exits after it
    pool = random_pool_with_mirror(host, gen)
    print(f"pool of {rows} rows ready in {time.perf_counter() - began:.1f} s", flush=True)

    card = torch.cuda.get_device_name()
    results: dict[str, object] = {
        "card": card, "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join(["python", *sys.argv]),
        "workload": {"seq_len": SIZES.seq_len, "top_k": SIZES.top_k, "hot": SIZES.hot_slots,
                     "row_bytes": SIZES.row_bytes, "warmup": args.warmup, "steps": args.steps,
                     "host_row_tables": "key extents, as the engine's default config builds "
                                        "them (alias_extents = the pool's extents, none "
                                        "taken): a miss reads its host row through "
                                        "key_host_extent",
                     "timing": "CUDA graph replay queued behind a GPU sleep: device time",
                     "caches": f"flushed before every step (2 x L2 {args.flush} over), then "
                               "the top-k copied in: tables cold, top-k warm, as between two "
                               "layers",
                     "new_positions": "hisparse.tools.benchmarking.ChurnTrace: positions "
                                      "older than the seeded hot buffer, not selected "
                                      "recently",
                     "layouts": {"scattered": "every token at a random row of a pool of B*32768",
                                 "extents": "hisparse.core.host_pool.ExtentAllocator, "
                                            f"{SIZES.extent_tokens}-token extents, fresh pool",
                                 "shuffled-extents": "extents of E rows in random order"}},
        "limits": limits, "records": [],
        "tuning": dataclasses.asdict(kernels.current_tuning()),
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = ("-vs-sglang" if peer_run else "") + (
        "-quick" if args.quick else f"-ab-{args.ab}" if args.ab
        else "-padding" if args.padding else "")
    if args.flush != "write":
        suffix += f"-{args.flush}-flush"
    if args.residency_map != "host_row":
        suffix += f"-{args.residency_map}-keyed"
    path = out_dir / f"sw1-cuda{suffix}.json"

    def save() -> None:  # after every cell, so a run cut short still leaves its numbers
        checked = results["records"] + results.get("extent_sweep", []) + results.get(
            "variants", [])
        results["all_correct"] = all(r["correct"] for r in checked)
        results["seconds"] = round(time.perf_counter() - began, 1)
        path.write_text(json.dumps(results, indent=1) + "\n")

    if args.ab:
        return run_ab(pool, batches, churns, args, rng, results, save, path)
    if peer_run:
        return run_vs_sglang(pool, batches, churns, args, results, save, path)
    if args.padding:
        for batch in batches:
            for capacity in sorted({batch, 16, 64, 128} - set(range(batch))):
                for churn in churns:
                    results["records"].append(
                        run_cell(pool, batch, churn, "extents", SIZES.extent_tokens, args,
                                 args.seed, batch_capacity=capacity))
                    save()
        save()
        print(f"wrote {path}")
        return 0 if results["all_correct"] else 1
    if not args.extent_sweep:
        for layout in ("scattered", "extents"):
            extent = 1 if layout == "scattered" else SIZES.extent_tokens
            for batch in batches:
                for churn in churns:
                    results["records"].append(
                        run_cell(pool, batch, churn, layout, extent, args, args.seed))
                    save()
        results["miss_free_warm"] = miss_free_warm(pool, rng, args)
    if not args.quick or args.extent_sweep:
        results["extent_sweep"] = []
        for extent in sweep_extents:
            results["extent_sweep"].append(
                run_cell(pool, max_batch, 1.0, benchmarking.SWEEP_LAYOUT, extent, args,
                         args.seed))
            save()
    if args.variants:
        variants = {"bit-search": AB_ROUNDS["selection"]["bit-search"],
                    "pdl": {"pdl": True},
                    "copy-32-per-sm": {"copy_programs_per_unit": 32}}
        results["variants"] = []
        for name, overrides in variants.items():
            with kernels.tuning(**overrides):
                for batch, churn in ((1, 0.2), (16, 0.2), (64, 0.2), (128, 0.0), (128, 1.0)):
                    record = run_cell(pool, batch, churn, "extents", SIZES.extent_tokens,
                                      args, args.seed)
                    results["variants"].append({"variant": name, **record})
                    save()
    save()
    print(f"wrote {path}")
    plot(results, path.with_suffix(".png"))
    return 0 if results["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
