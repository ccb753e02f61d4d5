"""Per-kernel device time of a verify swap-in and of the single-token swap-in over the same
union rows, for Nsight Compute (the kernels of each cell's last step, between
cudaProfilerStart and Stop):

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        --csv python3 benchmarks/verify_kernels_probe.py 2,1,0.9 8,1,0.9 4,16,0.9

Each argument is S,B,overlap[,churn] (churn 0.05 by default; the SW-2 shapes of
benchmarks/verify_step.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verify_step as vs

K, L, W = 2048, 32768, 656


def profile_cell(S: int, B: int, overlap: float, churn: float = 0.05, steps: int = 6) -> None:
    hot = max(2, S) * K
    kv = torch.randint(0, 256, (1, L, W), dtype=torch.uint8)
    verify = vs.build("cuda", K, hot, S, B, L, W, 256, kv)
    single = vs.build("cuda", S * K, hot, 1, B, L, W, 256 * S, kv)
    rng = np.random.default_rng([S, B])
    previous = rng.integers(0, L, (B, K))
    drafts = torch.zeros(B, S, W, dtype=torch.uint8, device="cuda")
    newest = torch.zeros(B, W, dtype=torch.uint8, device="cuda")
    for step in range(steps):
        rows = vs.query_rows(rng, previous, L, hot, S, churn, overlap)
        previous = rows[:, 0]
        top_k = torch.from_numpy(rows.astype(np.int32)).cuda()
        union = torch.from_numpy(vs.union_rows(rows)).cuda()
        torch.cuda.synchronize()
        if step == steps - 1:
            torch.cuda.cudart().cudaProfilerStart()
        verify.begin_decode_step(list(range(B)), num_tokens=S)
        verify.write_newest(0, drafts)
        verify.swap_in(0, top_k)
        verify.end_decode_step(accepted=[S] * B)
        for extra in range(S):  # the baseline grows by as many tokens
            single.begin_decode_step(list(range(B)))
            single.write_newest(0, newest)
            if extra == 0:
                single.swap_in(0, union)
            single.end_decode_step()
        torch.cuda.synchronize()
        if step == steps - 1:
            torch.cuda.cudart().cudaProfilerStop()
    verify.close()
    single.close()


if __name__ == "__main__":
    for cell in sys.argv[1:]:
        S, B, overlap, *churn = cell.split(",")
        profile_cell(int(S), int(B), float(overlap), *(float(c) for c in churn))
