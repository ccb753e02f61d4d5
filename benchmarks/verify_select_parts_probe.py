"""Which part of the verify swap-in's union work costs what: one part replaced by a no-op
before the kernels compile, then SW-2's cell at B = 1, overlap 0.9, churn 0.05 for S = 2 and 8
(`verify_step.run_pair`). A probe, not a mode: without the part the rows are wrong (the cell's
`wrong_rows` says how many), so only the times mean anything. One part per process (Triton
keys its cache by the sources it compiled):

    python benchmarks/verify_select_parts_probe.py none|complete|first|claim[,...]

complete: the copy neither gives the repeats their first entry's slot nor empties the
presence table (copy.py, `_complete_union`); first: every miss the lookup counted takes a
victim in the selection (no table read, no repeat marks); claim: the lookup takes no table
entry (nothing is de-duplicated).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton
import triton.language as tl

from hisparse.kernels.swap_in import copy, lookup, select

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verify_step  # beside this file


@triton.jit
def _no_completion(entry, code, claimed, pos, out_ptr, presence_ptr, presence_stride, K,
                   CANDIDATES: tl.constexpr):
    return tl.load(out_ptr + entry, mask=(code >= 0) | (code <= -4), other=0)


@triton.jit
def _every_miss_first(b, k, K, code, top_k_ptr, presence_ptr, presence_stride, out_ptr,
                      CANDIDATES: tl.constexpr):
    return tl.where(code >= 0, code, -1)


@triton.jit
def _no_claim(b, k_offsets, pos, miss, row, code, presence_ptr, presence_stride,
              SEM: tl.constexpr):
    return code, (code == -3) | miss, tl.full(code.shape, 2**31 - 1, tl.int32)


PARTS = {"complete": (copy, "_complete_union", _no_completion),
         "first": (select, "_first_misses", _every_miss_first),
         "claim": (lookup, "_claim_positions", _no_claim)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", help="none, or parts to leave out, comma-separated: "
                        + ", ".join(PARTS))
    parts = parser.parse_args().parts
    dropped = [] if parts == "none" else parts.split(",")
    for part in dropped:
        module, name, stand_in = PARTS[part]
        setattr(module, name, stand_in)
    args = argparse.Namespace(top_k=2048, row_bytes=656, device="cuda", warmup=3, steps=20,
                              seq_len=32768)
    for tokens in (2, 8):
        for cell in verify_step.run_pair(args, tokens, 1, [(0.9, 0.05)], None):
            print("RESULT", dropped or "none", tokens, round(cell["verify_device_us"], 1),
                  round(cell["single_device_us"], 1), cell["wrong_rows"], flush=True)


if __name__ == "__main__":
    main()
