"""The CPU proxy of the eager host path: its pieces timed in tight loops, best of 7 repeats.

The CPU backend runs the engine's Python and numpy as the GPU backends do, so the pieces below
compare two versions of the library on one machine (point PYTHONPATH at each) far more stably
than whole calls, whose CPU kernels (the reference swap-in and backup) dwarf the host work:
  * plan: `BatchPlan` over the batch's records, its columns and table updates;
  * upload: `BatchBuffers.upload` of those (one host-to-device copy on a GPU);
  * records: the batch's records looked up and checked (`_batch_records`);
  * begin_end: `begin_decode_step` + one `write_newest` + `end_decode_step` on a 1-layer cache
    (the CPU backup included: compare versions, not absolute figures);
  * write_newest: one call, B rows.

    PYTHONPATH=src python benchmarks/host_pieces.py [--batches 1 16 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import host_overhead
from hisparse.core import engine
from hisparse.core.batch import BatchPlan


def best_us(call: callable, number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e6


def pieces(batch: int, number: int) -> dict[str, float]:
    seq_len = 4600  # inside an extent: no step of the loop grows one
    cache = host_overhead.make_cache("cpu", batch, seq_len, 8 * number + 64, 1)
    ids = host_overhead.admit_all(cache, batch, seq_len)
    records = engine._batch_records(cache._requests, ids, batch, False)
    c = cache._decode
    plan = BatchPlan(records, c.tables, c.max_seq_len)
    columns, updates = plan.columns(), plan.updates()
    kv = torch.randint(0, 256, (batch, cache.row_bytes), dtype=torch.uint8)

    def step() -> None:
        cache.begin_decode_step(ids)
        cache.write_newest(0, kv)
        cache.end_decode_step()

    result = {
        "plan": best_us(lambda: (lambda p: (p.columns(), p.updates()))(
            BatchPlan(records, c.tables, c.max_seq_len)), number),
        "upload": best_us(lambda: c.buffers.upload(columns, updates), number),
        "records": best_us(lambda: engine._batch_records(cache._requests, ids, batch, False),
                           number),
        "begin_end": best_us(step, max(1, number // 8)),
    }
    cache.begin_decode_step(ids)
    result["write_newest"] = best_us(lambda: cache.write_newest(0, kv), number)
    cache.end_decode_step()
    cache.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--number", type=int, default=400, help="calls per repeat")
    args = parser.parse_args(argv)
    for batch in args.batches:
        print(json.dumps({"batch": batch} | {k: round(v, 2) for k, v in
                                             pieces(batch, args.number).items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
