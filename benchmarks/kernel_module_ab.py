"""A/B of two versions of the Triton swap-in module on SW-1 cells, on one machine in one process.

`--base PATH` is another copy of `src/hisparse/kernels/swap_in_triton.py` (e.g. an earlier
commit's: `git show REV:src/hisparse/kernels/swap_in_triton.py > /tmp/base.py`); the working
tree's module is "current". Both run through `benchmarks/swap_in.py`'s cells (same pool, tables,
top-k trace, cache flush and per-step byte check), alternating which goes first in each round,
so a change that should cost nothing can be shown to cost nothing.

    python benchmarks/kernel_module_ab.py --base /tmp/base.py --out results.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from hisparse import benchmarking

# (layout, B, churn): the copy-bound cells, a large miss-free step and a small-batch step.
DEFAULT_CELLS = [("extents", 128, 0.2), ("extents", 128, 1.0), ("scattered", 128, 0.2),
                 ("scattered", 64, 0.05), ("extents", 128, 0.0), ("scattered", 1, 0.2)]


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("hisparse.kernels._ab_base", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--base {path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def cell_arg(text: str) -> tuple[str, int, float]:
    layout, batch, churn = text.split(":")
    if layout not in (*benchmarking.LAYOUTS, benchmarking.SWEEP_LAYOUT):
        raise ValueError(f"layout {layout!r}")
    return layout, int(batch), float(churn)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the other swap_in_triton.py")
    parser.add_argument("--cells", type=cell_arg, nargs="+", default=DEFAULT_CELLS,
                        metavar="LAYOUT:B:CHURN")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--flush", choices=benchmarking.FLUSH_MODES, default="write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not args.base.is_file():
        parser.error(f"argument --base: {args.base} is not a file")
    if not torch.cuda.is_available():
        print("kernel_module_ab.py: needs a CUDA device; none is visible", file=sys.stderr)
        return 2
    import triton

    import swap_in
    from copy_limits import alloc_registered
    from hisparse.kernels import swap_in_triton as current

    base = load_module(args.base)
    kernels = {"base": base.swap_in_triton, "current": current.swap_in_triton}
    rows = max(batch for _, batch, _ in args.cells) * swap_in.SIZES.seq_len
    host = alloc_registered(rows * swap_in.SIZES.row_bytes).view(rows, swap_in.SIZES.row_bytes)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    pool = swap_in.random_pool_with_mirror(host, gen)
    records = []
    began = time.perf_counter()
    for round_index in range(args.rounds):
        for layout, batch, churn in args.cells:
            order = ["base", "current"] if round_index % 2 == 0 else ["current", "base"]
            for name in order:
                kernel = kernels[name]
                record = swap_in.run_cell(
                    pool, batch, churn, layout, swap_in.SIZES.extent_tokens, args, args.seed,
                    peer=(name, lambda tables, host_rows, kernel=kernel: kernel))
                records.append({"round": round_index, **record})
    summary = {}
    for layout, batch, churn in args.cells:
        for name in kernels:
            times = [r["median_us"] for r in records if r["kernel"] == name and
                     (r["layout"], r["B"], r["churn"]) == (layout, batch, churn)]
            summary[f"{layout} B={batch} c={churn} {name}"] = [min(times), max(times)]
    document = {
        "card": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "command": " ".join(["python", *sys.argv]),
        "base": str(args.base), "seconds": round(time.perf_counter() - began, 1),
        "all_correct": all(r["correct"] for r in records),
        "median_us_range": summary, "records": records,
    }
    text = json.dumps(document, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(json.dumps({"all_correct": document["all_correct"], **summary}, indent=1))
    return 0 if document["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
