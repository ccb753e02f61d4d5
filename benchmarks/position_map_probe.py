"""What a per-request position -> hot slot map would save on SW-1's miss-free step, and what
the width of the library's own `resident` entries costs.

The library resolves a top-k position through the page table to a host row, then reads the
persistent `resident` map (host row -> hot slot): two dependent random reads per entry. A map
indexed by (request, position) answers with one, and the page table is then read for misses
alone. Changing the library's tables for that touches the engine, the reference, PD and every
kernel (benchmarks/NOTES.md, sixth pass), so this probe measures the gain first: it swaps the
classify kernel for a prototype that reads such a map, built from `resident` once the first
step's plan has run, and times SW-1's churn-0 cells (no misses after the first step, so the map
never needs updating), byte checks included, against the library as it is. The library also
runs with `resident` in int32 (`library-int32-resident`) against the engine's choice (int16
while slot ids fit), at `--churns` as well.

    PYTHONPATH=src python benchmarks/position_map_probe.py --out-dir DIR [--churns 0 0.2 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton
import triton.language as tl

from hisparse import benchmarking
from hisparse.backends.registry import get_backend
from hisparse.kernels import swap_in_triton as kernels
from hisparse.kernels.swap_in_triton import (
    _add_code_counts,
    _entry_codes,
    _entry_regime,
    _row_context,
    gdc_launch_dependents,
)


@triton.jit
def _classify_by_position_kernel(
    position_map_ptr,  # [R, max_positions] int16 / int32: hot slot per position, -1 = none
    max_positions,
    num_real_ptr, req_slots_ptr, seq_lens_ptr, top_k_ptr, out_ptr, page_table_ptr,
    resident_ptr, hit_flag_ptr, miss_row_ptr, counters_ptr,
    R, S, K, H, E, P, N,
    EARLY_LOADS: tl.constexpr,
    USE_PDL: tl.constexpr,
    COUNTER_SEM: tl.constexpr,
    COUNTS_IN_PLAN: tl.constexpr,
    CHUNK_K: tl.constexpr,
):
    """Same outputs as the library's classify kernel; the slot comes from the position map."""
    if USE_PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    real, r, n, base = _row_context(b, num_real_ptr, req_slots_ptr, seq_lens_ptr, R, S,
                                    EARLY_LOADS)
    k_offsets = tl.program_id(1) * CHUNK_K + tl.arange(0, CHUNK_K)
    in_k = k_offsets < K
    pos = tl.load(top_k_ptr + b * K + k_offsets, mask=in_k, other=-1)
    pos = tl.where(real, pos, -1)
    valid, invalid, result, candidate = _entry_regime(pos, n, base, H)
    slot = tl.load(position_map_ptr + r.to(tl.int64) * max_positions + pos,
                   mask=candidate & (pos < max_positions), other=-1).to(tl.int32)
    hit = candidate & (slot >= 0) & (slot < H)
    miss = candidate & (slot < 0)
    page_index = pos // E
    page = tl.load(page_table_ptr + r.to(tl.int64) * P + page_index,
                   mask=miss & (page_index < P), other=-1)
    row = page * E + pos % E
    lost = miss & ((page < 0) | (row >= N))
    miss = miss & ~lost
    result = tl.where(hit, base + slot, result)
    tl.store(out_ptr + b * K + k_offsets, result, mask=in_k)
    tl.store(hit_flag_ptr + b * H + slot, tl.full(slot.shape, 1, tl.int8), mask=hit)
    code = _entry_codes(miss, row, valid & ~miss & ~lost, invalid | lost)
    tl.store(miss_row_ptr + b * K + k_offsets, code, mask=in_k)
    if not COUNTS_IN_PLAN:
        _add_code_counts(counters_ptr, code, COUNTER_SEM)


class ClassifyByPosition:
    """Stands in for `kernels._classify_kernel` (`kernel[grid](*args, **options)`).

    SW-1's first step misses all of its top-k (the trace draws from positions older than the
    seeded hot buffer), so the first, uncaptured call classifies with the library kernel, and
    the map is built from `resident` once that call's plan has installed the misses (the copy
    launchers are wrapped to say when). On churn-0 cells nothing changes after that."""

    def __init__(self, dtype: torch.dtype, library: object) -> None:
        self.dtype = dtype
        self.library = library
        self.first_call: tuple[object, ...] | None = None
        self.position_map: torch.Tensor | None = None

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **options: object) -> None:
            if self.position_map is None:
                if self.first_call is not None:
                    raise RuntimeError("the position map was not built after the first plan")
                self.first_call = args
                self.library[grid](*args, **options)
                return
            _classify_by_position_kernel[grid](self.position_map, self.position_map.shape[1],
                                               *args, **options)

        return launch

    def after_plan(self) -> None:
        if self.first_call is None or self.position_map is not None:
            return
        args = self.first_call
        page_table, resident = args[5], args[6]
        extent, pages, host_rows = args[14], args[15], args[16]
        positions = torch.arange(pages * extent, device=page_table.device)
        page = page_table[:, positions // extent].long()
        row = page * extent + positions % extent
        known = (page >= 0) & (row < host_rows)
        slot = resident[row.clamp(0, host_rows - 1)]
        self.position_map = torch.where(known, slot, -1).to(self.dtype).contiguous()


@contextlib.contextmanager
def classify_by_position(dtype: torch.dtype) -> Iterator[None]:
    library = kernels._classify_kernel
    stand_in = ClassifyByPosition(dtype, library)
    launchers = {name: getattr(kernels, name)
                 for name in ("_launch_copy", "_launch_prefetched_copy")}

    def after_plan(launcher: Callable[..., None]) -> Callable[..., None]:
        def call(*args: object, **options: object) -> None:
            stand_in.after_plan()
            launcher(*args, **options)

        return call

    kernels._classify_kernel = stand_in
    for name, launcher in launchers.items():
        setattr(kernels, name, after_plan(launcher))
    try:
        yield
    finally:
        kernels._classify_kernel = library
        for name, launcher in launchers.items():
            setattr(kernels, name, launcher)


@contextlib.contextmanager
def resident_dtype(dtype: torch.dtype) -> Iterator[None]:
    """SW-1's tables with `resident` in `dtype` instead of the engine's choice."""
    chosen = benchmarking.residency_dtype
    benchmarking.residency_dtype = lambda hot_slots: dtype
    try:
        yield
    finally:
        benchmarking.residency_dtype = chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--churns", type=float, nargs="+", default=[0.0],
                        help="churns for the library variants (the maps run churn 0 only)")
    parser.add_argument("--rounds", type=int, default=2, help="each variant this many times")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--output", default="position-map-probe-cuda.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("position_map_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    backend = get_backend("cuda")
    sizes = benchmarking.SW1Sizes()
    variants: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
        "library": contextlib.nullcontext,  # `resident` as the engine allocates it (int16)
        "library-int32-resident": lambda: resident_dtype(torch.int32),
        "position-map-int16": lambda: classify_by_position(torch.int16),
        "position-map-int32": lambda: classify_by_position(torch.int32),
    }
    records = []
    with benchmarking.sw1_pool(backend, max(args.batches), sizes) as pool:
        mirror = pool.to("cuda")
        for round_index in range(args.rounds):
            for name, variant in variants.items():
                # The position maps are built once: valid only while no step misses.
                churns = args.churns if name.startswith("library") else [0.0]
                for layout in benchmarking.LAYOUTS:
                    for batch in args.batches:
                        for churn in churns:
                            with variant():
                                cell = benchmarking.sw1_cell(backend, pool, layout, batch, churn,
                                                             sizes, mirror=mirror)
                            record = {"variant": name, "round": round_index, **cell.to_dict()}
                            records.append(record)
                            print(json.dumps(record), flush=True)
    results = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": "python " + " ".join(sys.argv),
        "workload": "SW-1 churn 0 (benchmarking.sw1_cell), classify kernel swapped per variant",
        "all_correct": all(r["verified"] for r in records),
        "records": records,
    }
    out = Path(args.out_dir) / args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    table: dict[tuple[str, str, int], list[float]] = {}
    for r in records:
        table.setdefault((r["variant"], r["layout"], r["batch"], r["churn"]), []).append(
            (round(r["step_seconds"] * 1e6, 1), r["misses_per_step"]))
    for key, values in sorted(table.items()):
        print(key, values)
    return 0 if results["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
