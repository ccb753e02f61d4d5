"""hisparse beside the newest peers' kernels, one table per process: SW-1 (single-step swap-in)
against SGLang 0.5.23's `load_cache_to_device_buffer_mla` and vLLM 0.34's
`hisparse_resolve_residency` + `hisparse_gather_compact`; SW-2 (speculative verify) against
SGLang 0.5.23's `load_cache_to_device_buffer_spec_mla` and the same two vLLM ops over the verify
rows (benchmarks/peers_sw2.py).

The peers are the user's copies, never this repository's: `--sglang-root` (HISPARSE_SGLANG_ROOT)
is a directory holding the `sglang` package of the 0.5.23 wheel (benchmarks/sglang_ops.py says
which files), `--vllm-source` (HISPARSE_VLLM_SOURCE) the unpacked vllm-0.34.0 source
distribution (benchmarks/vllm_peer.py). Each peer is called as its framework calls it:
  * SGLang single step: `page_size=1`, `block_size=960` (its coordinator's default
    `swap_in_block_size`), the persistent `num_real_reqs`, int32 top-k [B, K], no miss plan;
  * SGLang speculative: top-k [B, S, K], S 2-4, per-step `seq_lens` [B x S], the
    `HiSparseSpecState` its HiSparseSpecSwapManager allocates and resets, an extra page of 64
    slots (newest token, then the S verify tokens), no miss plan;
  * vLLM: the arguments of `HiSparseRuntime._resolve_residency` / `_swap_rows` (64-row hot
    pages, `max_union_rows` = S x K, `region_stride` = hot size, request-relative top-k through
    the source block table, `num_valid_rows`, the uint64 stats), on the current stream.
Semantics that differ: hisparse, SGLang's single step and vLLM keep an exact LRU (the same
misses on SW-1's trace); SGLang's speculative kernel keeps CLOCK with sampled victims, so its
misses per step are counted apart (hot slots whose token changed) and may differ.

SW-1: B x churn cells on one registered host pool (scattered rows and 512-token extents), each
kernel on the same tables, pool and top-k trace (`hisparse.tools.benchmarking`), every step's
returned rows checked byte for byte against the pool on the device. Per kernel: `device_us`,
the median of CUDA-graph replays timed by events queued behind a device-side sleep;
`eager_host_us`, the median host wall-clock of an eager call (launch only, no synchronize;
hisparse's through the bound launcher its engine calls, `sw1_steps.LauncherSwapIn`);
`eager_device_us` of those eager calls; misses per step and their GB/s. `link` is a bulk
host-to-device copy's rate on the same card; each B = 128 cell reports miss GB/s over it.

    PYTHONPATH=src python benchmarks/peers.py --build-only
    PYTHONPATH=src python benchmarks/peers.py --table sw1 --out results/peers-sw1.json
    PYTHONPATH=src python benchmarks/peers.py --table sw2 --out results/peers-sw2.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import peers_v4
import sglang_ops
import vllm_peer
from hisparse.errors import InvalidInputError
from hisparse.tools import benchmarking
from hisparse.tools.sw1_steps import CellSteps, LauncherSwapIn

SIZES = benchmarking.SW1Sizes()
SW1_GRID = {"batches": (1, 16, 64, 128), "churns": (0.0, 0.05, 0.2, 1.0)}
SW1_QUICK = {"batches": (1, 4), "churns": (0.0, 0.2)}
PEERS = ("sglang", "vllm")
DEFAULT_BUILD_DIR = "/tmp/hisparse-peers"


@dataclasses.dataclass
class Peers:
    """The loaded peers: SGLang's ops module and vLLM's ops namespace (None: not run)."""

    sglang: Any = None
    vllm: Any = None
    records: dict[str, Any] = dataclasses.field(default_factory=dict)


def load_peers(args: argparse.Namespace) -> Peers:
    """Load (building where needed) the peers named in --peers."""
    peers = Peers()
    build = Path(args.build_dir)
    if "sglang" in args.peers:
        root = sglang_ops.find_root(args.sglang_root)
        peers.sglang = sglang_ops.load(root, build / "sglang")
        peers.records["sglang"] = sglang_ops.describe(root, args.sglang_block_size)
    if "vllm" in args.peers:
        root = vllm_peer.find_source(args.vllm_source)
        peers.vllm = vllm_peer.build(root, build / "vllm")
        peers.records["vllm"] = vllm_peer.describe(root)
    return peers


def prebuild(args: argparse.Namespace) -> dict[str, float]:
    """Every peer build the tables need, in parallel: SGLang's single-step module for SW-1's
    sizes, its speculative module for each S of SW-2 and its V4 module for each hot size of
    sw1-v4 (the instantiations its entry points would compile on first call), and vLLM's
    extension. Seconds per build."""
    peers = load_peers(args)
    jobs: dict[str, Callable[[], object]] = {}
    ops, row_bytes = peers.sglang, SIZES.row_bytes
    if ops is not None:
        jobs["sglang-single"] = lambda: ops._jit_sparse_module(
            row_bytes, args.sglang_block_size, SIZES.top_k, SIZES.hot_slots, is_mla=True)
        for S in (2, 3, 4):
            jobs[f"sglang-spec-S{S}"] = lambda S=S: ops._jit_spec_module(
                row_bytes, 64, SIZES.top_k, max(2, S) * SIZES.top_k, S, False)
        for hot in peers_v4.GRID["hots"]:
            jobs[f"sglang-v4-H{hot}"] = lambda hot=hot: ops._jit_sparse_module(
                peers_v4.ENTRY_BYTES, args.sglang_block_size, 512, hot, is_mla=True,
                is_dsv4_layout=True)
    seconds: dict[str, float] = {}

    def timed(name: str) -> None:
        began = time.perf_counter()
        jobs[name]()
        seconds[name] = round(time.perf_counter() - began, 1)

    with concurrent.futures.ThreadPoolExecutor(max(1, len(jobs))) as pool:
        for future in [pool.submit(timed, name) for name in jobs]:
            future.result()
    return seconds


def environment(args: argparse.Namespace, peers: Peers) -> dict[str, Any]:
    """Command, card, driver, torch, triton, peer versions."""
    info = benchmarking.run_environment("cuda")
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["driver"] = None
    return {"command": "PYTHONPATH=src python benchmarks/peers.py " + " ".join(sys.argv[1:]),
            **info, "peers": peers.records}


# --- SW-1 ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Pool:
    """SW-1's host pool, with vLLM's null page in front: `rows` is what hisparse's and
    SGLang's tables address, `with_null_page` what vLLM's host rows index."""

    with_null_page: torch.Tensor
    rows: torch.Tensor
    mirror: torch.Tensor  # `rows` on the device, for the per-step byte check


def sw1_pool(max_batch: int, sizes: benchmarking.SW1Sizes, seed: int) -> Pool:
    from hisparse.backends.registry import get_backend

    rows = max_batch * sizes.seq_len
    extra = vllm_peer.NULL_PAGE_ROWS
    raw = get_backend("cuda").alloc_host((rows + extra) * sizes.row_bytes)
    full = raw.view(rows + extra, sizes.row_bytes)
    mirror = torch.empty(rows, sizes.row_bytes, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    chunk = 1 << 20
    for first in range(0, rows, chunk):
        block = mirror[first: first + chunk]
        block.random_(0, 256, generator=gen)
        full[extra + first: extra + first + chunk].copy_(block)
    return Pool(full, full[extra:], mirror)


def kernels_for(args: argparse.Namespace, peers: Peers, pool: Pool, layout: str
                ) -> dict[str, Callable[..., tuple[Any, Callable[[], int | None]]]]:
    """name -> kernel_for(tables, host_rows) giving (kernel, misses-so-far reader)."""
    from hisparse.backends.registry import get_backend

    backend = get_backend("cuda")
    kinds: dict[str, Callable[..., tuple[Any, Callable[[], int | None]]]] = {
        "hisparse": lambda tables, host_rows: (
            LauncherSwapIn(backend), lambda: int(tables.counters[0, 1]))}
    if peers.sglang is not None:
        kinds["sglang"] = lambda tables, host_rows: (
            sglang_ops.SglangSwapIn(peers.sglang, tables, host_rows,
                                    block_size=args.sglang_block_size), lambda: None)
    if peers.vllm is not None:
        block = 1 if layout == "scattered" else args.vllm_block_size

        def vllm_for(tables: Any, host_rows: np.ndarray) -> tuple[Any, Callable[[], int]]:
            state = vllm_peer.vllm_tables(tables, host_rows, block)
            kernel = vllm_peer.VllmSwapIn(peers.vllm, pool.with_null_page, state)
            return kernel, kernel.misses

        kinds["vllm"] = vllm_for
    return kinds


def sw1_cell(pool: Pool, layout: str, batch: int, churn: float, args: argparse.Namespace,
             kernel_for: Callable[..., tuple[Any, Callable[[], int | None]]],
             backend: Any = None, sizes: benchmarking.SW1Sizes = SIZES) -> dict[str, Any]:
    """One kernel on one SW-1 cell: the tables, trace and seed of `benchmarking.sw1_cell`, an
    untimed first step, warm-up and timed graph replays (eager launches on a backend without
    graphs), then eager calls; every step's rows byte-checked against the pool's mirror."""
    from hisparse.backends.features import Feature
    from hisparse.backends.registry import get_backend

    backend = backend or get_backend("cuda")
    rng = np.random.default_rng([args.seed, batch, round(churn * 1000),
                                 benchmarking.LAYOUTS.index(layout)])
    tables, host_rows = benchmarking.build_tables(backend, pool.rows, layout, batch, sizes, rng,
                                                  mirror=pool.mirror)
    kernel, misses = kernel_for(tables, host_rows)
    trace = benchmarking.ChurnTrace(batch, sizes, churn, rng)
    timer = benchmarking.StepTimer(backend, backend.device(), queued=True)
    steps = 1 + args.warmup + args.steps + args.eager_steps
    cell = CellSteps(backend, tables, host_rows, trace, batch, batch, sizes.top_k, pool.mirror,
                     backend.features.supports(Feature.GRAPH_CAPTURE), timer,
                     benchmarking.CacheFlusher(backend.device()), steps,
                     device_rows=getattr(kernel, "device_rows", None))  # a peer's own layout
    cell.next_top_k(0)
    cell.call(kernel)  # compiles, allocates, and leaves the seeded state
    cell.check()
    replay = cell.step_for(kernel)
    graph, eager, host = [], [], []
    counted = None
    for step in range(1, steps):
        if step == 1 + args.warmup:
            backend.synchronize()
            counted = misses()
        cell.next_top_k(step)
        if step < 1 + args.warmup + args.steps:
            elapsed = timer.record(replay)
        else:
            elapsed = timer.record(lambda: host.append(_host_seconds(cell, kernel)))
        cell.check()
        backend.synchronize()
        (graph if step < 1 + args.warmup + args.steps else eager).append(elapsed())
        if step == args.warmup + args.steps:
            after = misses()
    graph = graph[args.warmup:]
    per_step = (trace.fresh_per_step * batch if counted is None
                else (after - counted) / args.steps)
    median = statistics.median(graph)
    return {"B": batch, "churn": churn, "layout": layout,
            "device_us": round(median * 1e6, 1),
            "p90_us": round(sorted(graph)[int(0.9 * (len(graph) - 1))] * 1e6, 1),
            "eager_device_us": round(statistics.median(eager) * 1e6, 1) if eager else None,
            "eager_host_us": round(statistics.median(host) * 1e6, 1) if host else None,
            "misses_per_step": per_step,
            "misses_counted_by": "trace" if counted is None else "kernel counters",
            "miss_GBps": round(per_step * sizes.row_bytes / median / 1e9, 2),
            "correct": cell.rows_verified(host_rows, steps - 1)}


def _host_seconds(cell: CellSteps, kernel: Any) -> float:
    began = time.perf_counter()
    cell.call(kernel)
    return time.perf_counter() - began


def run_sw1(args: argparse.Namespace, peers: Peers, result: dict[str, Any]) -> None:
    grid = SW1_QUICK if args.quick else SW1_GRID
    batches, churns = args.batches or grid["batches"], args.churns or grid["churns"]
    pool = sw1_pool(max(batches), SIZES, args.seed)
    from hisparse.backends.registry import get_backend

    link = max(c.bytes_per_second for c in benchmarking.bulk_copies(get_backend("cuda"), 1 << 28)
               if c.name == "bulk host-to-device")
    result["link_GBps"] = round(link / 1e9, 2)
    result["cells"] = []
    for layout in args.layouts:
        kinds = kernels_for(args, peers, pool, layout)
        for batch in batches:
            for churn in churns:
                row: dict[str, Any] = {"B": batch, "churn": churn, "layout": layout}
                names = list(kinds) if len(result["cells"]) % 2 == 0 else list(kinds)[::-1]
                for name in names:  # the order alternates from cell to cell
                    try:
                        row[name] = sw1_cell(pool, layout, batch, churn, args, kinds[name])
                        row[name]["link_ratio"] = round(row[name]["miss_GBps"] * 1e9 / link, 3)
                    except Exception as exc:  # a peer refusing a cell must not cost the rest
                        row[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                    torch.cuda.synchronize()
                for name in kinds:
                    if name != "hisparse" and "device_us" in row.get(name, {}) and \
                            "device_us" in row["hisparse"]:
                        row[f"hisparse_vs_{name}"] = round(
                            row["hisparse"]["device_us"] / row[name]["device_us"], 3)
                print(json.dumps(row), flush=True)
                result["cells"].append(row)
                _save(args, result)


def _save(args: argparse.Namespace, result: dict[str, Any]) -> None:
    result["all_correct"] = all(map(cell_correct, result.get("cells", [])))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


def cell_correct(cell: dict[str, Any]) -> bool:
    """No kernel of the cell returned a wrong row (SW-2 cells count them in `wrong_rows`,
    SW-1 cells hold one record per kernel)."""
    if "wrong_rows" in cell:
        return not any(cell["wrong_rows"].values())
    return all(record["correct"] for record in cell.values()
               if isinstance(record, dict) and "correct" in record)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=("sw1", "sw2", "sw1-v4"),
                        help="the table this process runs (sw1-v4: DeepSeek-V4's entries "
                        "against SGLang's V4 kernel, benchmarks/peers_v4.py)")
    parser.add_argument("--build-only", action="store_true",
                        help="build every peer the tables need (in parallel) and exit")
    parser.add_argument("--peers", type=lambda text: tuple(text.split(",")), default=PEERS,
                        help="comma-separated peers to run beside hisparse (default: "
                        "sglang,vllm; empty string: none)")
    parser.add_argument("--sglang-root", help=f"directory holding SGLang's sglang package "
                        f"(default ${sglang_ops.ENV_VAR}, else the installed one)")
    parser.add_argument("--vllm-source", help=f"unpacked vLLM source distribution (default "
                        f"${vllm_peer.ENV_VAR})")
    parser.add_argument("--sglang-block-size", type=int,
                        default=sglang_ops.COORDINATOR_BLOCK_SIZE,
                        help="threads per request of SGLang's single-step kernel (its "
                        "coordinator's default swap_in_block_size)")
    parser.add_argument("--vllm-block-size", type=int, default=vllm_peer.HOT_PAGE_ROWS,
                        help="vLLM's KV page, in tokens, on the paged layouts (the scattered "
                        "layout needs 1)")
    parser.add_argument("--build-dir", default=DEFAULT_BUILD_DIR)
    parser.add_argument("--layouts", type=lambda text: tuple(text.split(",")),
                        default=benchmarking.LAYOUTS, help="SW-1 host layouts")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--churns", type=float, nargs="+")
    parser.add_argument("--tokens", type=int, nargs="+", help="SW-2's S values")
    parser.add_argument("--overlaps", type=float, nargs="+", help="SW-2's row overlaps")
    parser.add_argument("--hots", type=int, nargs="+", help="sw1-v4's hot buffer sizes")
    parser.add_argument("--padded-entries", action="store_true",
                        help="sw1-v4: also time hisparse over 592-byte rows (each entry padded "
                        "to a 16-byte multiple) beside its 584-byte ones")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eager-steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a few small cells (smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.peers = tuple(p for p in args.peers if p)
    unknown = sorted(set(args.peers) - set(PEERS))
    bad_layouts = sorted(set(args.layouts) - set(benchmarking.LAYOUTS))
    if unknown or bad_layouts:
        parser.error(f"unknown peers {unknown} or layouts {bad_layouts}; peers are "
                     f"{', '.join(PEERS)}, layouts {', '.join(benchmarking.LAYOUTS)}")
    if not args.build_only and args.table is None:
        parser.error("pass --table sw1, sw2 or sw1-v4 (one table per process), or --build-only")
    if args.padded_entries and args.table != "sw1-v4":
        parser.error("--padded-entries is for --table sw1-v4 (DeepSeek-V4's 584-byte entries)")
    if min(args.warmup, args.eager_steps) < 0 or args.steps < 1:
        parser.error("--steps must be >= 1, --warmup and --eager-steps >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("peers.py needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    try:
        if args.build_only:
            print(json.dumps({"build_seconds": prebuild(args)}), flush=True)
            return 0
        peers = load_peers(args)
    except InvalidInputError as exc:
        print(f"peers.py: {exc}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    result = environment(args, peers)
    result["table"] = args.table
    result["timing"] = {"device_us": "median CUDA-graph replay, events behind a device sleep",
                        "eager_host_us": "median host wall-clock of one eager call, no sync",
                        "eager_device_us": "median device time of those eager calls"}
    if args.table == "sw1":
        run_sw1(args, peers, result)
    elif args.table == "sw1-v4":
        peers_v4.run_sw1_v4(args, peers, result, _save)
    else:
        import peers_sw2

        peers_sw2.run_sw2(args, peers, result, _save)
    result["wall_s"] = round(time.perf_counter() - began, 1)
    _save(args, result)
    print(f"all rows correct: {result['all_correct']}; {result['wall_s']} s", flush=True)
    return 0 if result["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
