"""One SW-1 step, marked for a profiler: the steps before it warm the state, not the caches.

Builds the SW-1 cell (benchmarks/swap_in.py) for one batch size, churn and layout, runs
`--steps` graph-free swap-in steps each behind a fresh top-k (as SW-1 does, so the L2 holds
the top-k generator's data, not the tables), and wraps the last one in the NVTX range
"step", which Nsight Compute can select:

    ncu --clock-control none --nvtx --nvtx-include "step/" \\
        python benchmarks/profile_step.py --batch 128 --churn 0 --layout extents
    python benchmarks/profile_step.py --tuning '{"lookup_in_plan": false}' ...  # a variant
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

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
    from hisparse.core.tables import MissPlan
    from hisparse.kernels import swap_in_triton as kernels

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = args.batch * sw1.SEQ_LEN
    pool = sw1.fill_pool(alloc_registered(rows * sw1.ROW_BYTES).view(rows, sw1.ROW_BYTES), gen)
    extent = sw1.LIBRARY_EXTENT if args.layout == "extents" else 1
    cell = sw1.build_cell(pool, args.batch, args.layout, extent, gen)
    tables = cell.tables
    req_slots = torch.arange(args.batch, dtype=torch.int32, device="cuda")
    num_real = torch.tensor([args.batch], dtype=torch.int32, device="cuda")
    out = torch.empty(args.batch, sw1.TOP_K, dtype=torch.int32, device="cuda")
    plan = MissPlan.empty(args.batch, sw1.TOP_K, torch.device("cuda"))
    wrong = 0
    with kernels.tuning(**args.tuning):
        for step in range(args.steps):
            top_k = sw1.next_top_k(cell, args.churn, gen)
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
