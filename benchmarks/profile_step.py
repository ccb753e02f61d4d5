"""One SW-1 step, marked for a profiler: the steps before it warm the state, not the caches.

Builds the SW-1 cell (benchmarks/swap_in.py) for one batch size, churn and layout, runs
`--steps` eager swap-in steps, each after an L2 flush and a fresh top-k as in SW-1, and wraps
the last one in the NVTX range "step", which Nsight Compute can select:

    ncu --clock-control none --nvtx --nvtx-include "step/" \\
        python benchmarks/profile_step.py --batch 128 --churn 0 --layout extents
    python benchmarks/profile_step.py --tuning '{"select_fast_rounds": 0}' ...  # a variant
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from hisparse.tools import benchmarking

sys.path.insert(0, str(Path(__file__).resolve().parent))
import swap_in as sw1  # a sibling script, not a package
from copy_limits import alloc_registered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--churn", type=float, default=0.0)
    parser.add_argument("--layout", choices=("extents", "scattered"), default="extents")
    parser.add_argument("--steps", type=int, default=6, help="steps in all, the last profiled")
    parser.add_argument("--tuning", type=json.loads, default={},
                        help="swap_in_triton.Tuning overrides as a JSON object")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    from hisparse.kernels import swap_in as kernels
    from hisparse.layout.tables import MissPlan

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    sizes = sw1.SIZES
    rows = args.batch * sizes.seq_len
    host = alloc_registered(rows * sizes.row_bytes).view(rows, sizes.row_bytes)
    pool = sw1.random_pool_with_mirror(host, gen)
    extent = sizes.extent_tokens if args.layout == "extents" else 1
    cell = sw1.build_cell(pool, args.batch, args.churn, args.layout, extent,
                          np.random.default_rng(args.seed))
    flusher = benchmarking.CacheFlusher(torch.device("cuda"))
    tables = cell.tables
    req_slots = torch.arange(args.batch, dtype=torch.int32, device="cuda")
    num_real = torch.tensor([args.batch], dtype=torch.int32, device="cuda")
    out = torch.empty(args.batch, sizes.top_k, dtype=torch.int32, device="cuda")
    plan = MissPlan.empty(args.batch, sizes.top_k, torch.device("cuda"))
    wrong = 0
    with kernels.tuning(**args.tuning):
        for step in range(args.steps):
            positions = cell.next_top_k()
            flusher.flush()
            top_k = positions.clone()  # written after the flush, as the indexer would
            torch.cuda.synchronize()
            last = step == args.steps - 1
            if last:
                torch.cuda.nvtx.range_push("step")
            kernels.swap_in_triton(tables, 0, 0, req_slots, top_k, num_real, out, plan)
            if last:
                torch.cuda.nvtx.range_pop()
            wrong += int(sw1.count_wrong_rows(pool, cell, top_k, out))
    print(json.dumps({"batch": args.batch, "churn": args.churn, "layout": args.layout,
                      "tuning": args.tuning, "wrong_rows": wrong}))
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
