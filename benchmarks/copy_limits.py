"""Physical limits the swap-in is judged against (bulk copies, a zero-copy row gather), on one GPU.

Measures bulk pinned host-to-device and device-to-host copies, and a plain zero-copy gather of
random rows from registered host memory (one Triton program per row) for several pool sizes,
next to the library's planned copy on the same rows.

    PYTHONPATH=src python benchmarks/copy_limits.py [--pool-gib 2.75] [--out limits.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from hisparse.kernels import swap_in as kernels
from hisparse.layout.tables import CacheTables, MissPlan
from hisparse.tools import benchmarking

ROW_BYTES = 656  # DeepSeek-V3.2 fp8 row
GIB = 1 << 30
SEQ_ROWS = 32768  # one SW-1 request's context


@triton.jit
def _gather_rows_kernel(
    rows_ptr,  # [M] int64 host row per program
    host_ptr,  # [N, ROW_WORDS] int32 registered host memory
    out_ptr,  # [M, ROW_WORDS] int32 device
    ROW_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    words = tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i)
    data = tl.load(host_ptr + row * ROW_WORDS + words, mask=words < ROW_WORDS)
    tl.store(out_ptr + i.to(tl.int64) * ROW_WORDS + words, data, mask=words < ROW_WORDS)


def time_us(fn, repeats: int = 10, warmup: bool = True) -> float:
    """Median device time of `fn` in microseconds (each call queued behind a GPU sleep).
    `warmup`: call it once untimed first (compiles; also warms caches and translations)."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Keeps the GPU busy while the call is queued: ~0.5 ms covers the Python launch cost
        # of the library's wrapper (100k cycles did not, and inflated its small-copy times).
        torch.cuda._sleep(1_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def alloc_registered(num_bytes: int) -> torch.Tensor:
    """Registered host memory through the library's CUDA backend (exact size, chunked)."""
    from hisparse.backends.registry import get_backend

    return get_backend("cuda").alloc_host(num_bytes)


def copy_fixture(host_pool: torch.Tensor, count: int, batch: int, device: torch.device
                 ) -> tuple[CacheTables, MissPlan]:
    """Tables and a plan for the planned copy of `count` rows of `host_pool` as `batch` plan
    rows of count/batch misses, into device rows 0..count-1 in plan order; the caller fills
    `plan.src[:, :count // batch]`. The copy walks the plan row by row, so that order is the
    order the grid reads the rows in."""
    per_row = count // batch
    assert per_row * batch == count and per_row <= 2048, "rows must split evenly, <= 2048 each"
    tables = benchmarking.copy_only_tables(host_pool, count, device)
    plan = MissPlan.empty(batch, 2048, device)
    plan.dst[:, :per_row] = torch.arange(count, device=device).view(batch, per_row)
    plan.count.fill_(per_row)
    return tables, plan


def planned_copy_us(host_pool: torch.Tensor, rows: torch.Tensor, batch: int | None = None,
                    **tuning: object) -> float:
    """The library's planned copy of `rows` (as `batch` plan rows; default 2048 misses each),
    checked, in us."""
    batch = batch or rows.numel() // 2048
    tables, plan = copy_fixture(host_pool, rows.numel(), batch, rows.device)
    plan.src[:, : rows.numel() // batch] = rows.view(batch, -1)
    with kernels.tuning(**tuning):
        elapsed = time_us(lambda: kernels.copy_planned_triton(tables, 0, plan))
    assert torch.equal(tables.device_kv[0].cpu(), host_pool[rows.cpu()]), "copy is wrong"
    return elapsed


# (rows per program-iteration, warps, programs per SM) tried by the copy tuning sweep.
COPY_CONFIGS = [(1, 4, 16), (2, 4, 16), (4, 4, 16), (4, 4, 32), (8, 4, 8), (8, 4, 16),
                (16, 4, 8), (4, 8, 16), (2, 2, 32), (1, 2, 32)]


def measure(host_pool: torch.Tensor) -> dict[str, object]:
    """All limits, using `host_pool` ([N, ROW_BYTES] uint8, registered) for the gathers."""
    device = torch.device("cuda")
    results: dict[str, object] = {}
    bulk_bytes = min(GIB, host_pool.numel())
    host_flat = host_pool.view(-1)[:bulk_bytes]
    on_device = torch.empty(bulk_bytes, dtype=torch.uint8, device=device)
    h2d = time_us(lambda: on_device.copy_(host_flat, non_blocking=True), 5)
    d2h = time_us(lambda: host_flat.copy_(on_device, non_blocking=True), 5)
    results["bulk_h2d_GBps"] = round(bulk_bytes / h2d / 1e3, 1)
    results["bulk_d2h_GBps"] = round(bulk_bytes / d2h / 1e3, 1)

    words = ROW_BYTES // 4
    host_words = host_pool.view(torch.int32)
    total_rows = host_pool.shape[0]
    gathers = []
    for pool_gib in (0.021, 0.7, 2.75):  # one request's context, B=32 and B=128 pools
        pool_rows = min(total_rows, int(pool_gib * GIB) // ROW_BYTES)
        for count in (2048, 16384, 131072):
            rows = torch.randint(0, pool_rows, (count,), device=device)
            out = torch.empty(count, words, dtype=torch.int32, device=device)
            plain = time_us(lambda rows=rows, out=out, count=count: _gather_rows_kernel[(count,)](
                rows, host_words, out, ROW_WORDS=words, BLOCK=triton.next_power_of_2(words)))
            assert torch.equal(out.cpu(), host_words[rows.cpu()]), "plain gather is wrong"
            planned = planned_copy_us(host_pool, rows)
            gathers.append({
                "pool_GiB": round(pool_rows * ROW_BYTES / GIB, 2), "rows": count,
                "plain_us": round(plain, 1),
                "plain_GBps": round(count * ROW_BYTES / plain / 1e3, 1),
                "planned_us": round(planned, 1),
                "planned_GBps": round(count * ROW_BYTES / planned / 1e3, 1),
            })
            print(f"gather {gathers[-1]}", flush=True)
    results["zero_copy_gather"] = gathers

    # Copy launch parameters: B=1 at full churn (2048 rows) and B=128 (262144 rows), local
    # and scattered; each config scored by its time relative to the best per case.
    cases = {
        "2048-local": torch.randint(0, SEQ_ROWS, (2048,), device=device),
        "2048-scattered": torch.randint(0, total_rows, (2048,), device=device),
        "262144-local": (torch.randint(0, SEQ_ROWS, (128, 2048), device=device)
                         + torch.arange(128, device=device)[:, None] * SEQ_ROWS).view(-1),
        "262144-scattered": torch.randint(0, total_rows, (262144,), device=device),
    }
    sweep = []
    for rows_per, warps, per_unit in COPY_CONFIGS:
        config = {"copy_rows": rows_per, "copy_warps": warps, "copy_programs_per_unit": per_unit}
        times = {name: round(planned_copy_us(host_pool, rows, **config), 1)
                 for name, rows in cases.items() if rows.max() < total_rows}
        sweep.append({**config, **times})
        print(f"copy config {sweep[-1]}", flush=True)
    best = {name: min(entry[name] for entry in sweep) for name in cases if name in sweep[0]}
    for entry in sweep:
        entry["score"] = round(sum(entry[name] / best[name] for name in best), 3)
    chosen = min(sweep, key=lambda entry: entry["score"])
    results["copy_tuning_sweep"] = sweep
    results["copy_tuning_choice"] = {key: chosen[key] for key in
                                     ("copy_rows", "copy_warps", "copy_programs_per_unit")}
    # Leave the pool full of noise again: the device-to-host test wrote over its start.
    host_flat.copy_(torch.randint(0, 256, (bulk_bytes,), dtype=torch.uint8, device=device))
    return results


def bucketed(rows: torch.Tensor, num_buckets: int, total_rows: int) -> torch.Tensor:
    """`rows` grouped by address bucket (ascending), their drawn order kept inside a bucket:
    what one partition pass over the misses could give a copy."""
    bucket = rows * num_buckets // total_rows
    return rows[torch.sort(bucket, stable=True).indices]


def fresh_copy_us(host_pool: torch.Tensor, count: int, order: str, repeats: int = 6
                  ) -> float:
    """Median us of the planned copy of `count` distinct random rows (128 plan rows), drawn
    afresh for every call as SW-1's churn draws never-selected positions (so no translation
    of an earlier call is reused), in `order`; every call's bytes checked."""
    total_rows, batch = host_pool.shape[0], 128
    device = torch.device("cuda")
    tables, plan = copy_fixture(host_pool, count, batch, device)
    times = []
    for _ in range(repeats + 1):  # the first call compiles
        drawn = torch.randperm(total_rows, device=device)[:count]
        rows = {"drawn": drawn, "sorted": torch.sort(drawn).values,
                "buckets-256": bucketed(drawn, 256, total_rows),
                "buckets-4096": bucketed(drawn, 4096, total_rows)}[order]
        plan.src[:, : count // batch] = rows.view(batch, -1).to(torch.int32)
        tables.device_kv.fill_(0)
        # No untimed call first: it would bring these rows' translations in.
        times.append(time_us(lambda: kernels.copy_planned_triton(tables, 0, plan), 1,
                             warmup=False))
        assert torch.equal(tables.device_kv[0].cpu(), host_pool[rows.cpu()]), "copy is wrong"
    return statistics.median(times[1:])


def miss_order(host_pool: torch.Tensor) -> dict[str, object]:
    """NOTES.md, fourteenth pass: the planned copy of SW-1's scattered B=128 miss counts, as
    drawn, sorted and bucketed by host row, the same rows copied again and again (warm
    translations) and fresh rows every call; and what a sort of one step's plan costs."""
    device = torch.device("cuda")
    total_rows = host_pool.shape[0]
    records = []
    orders = ("drawn", "sorted", "buckets-256", "buckets-4096")
    for count in (13056, 52480, 262144):  # SW-1 B=128 churn 0.05 / 0.2 / 1.0
        for name in orders:
            us = fresh_copy_us(host_pool, count, name)
            records.append({"misses": count, "rows": "fresh", "order": name, "us": round(us, 1),
                            "GBps": round(count * ROW_BYTES / us / 1e3, 1)})
            print(f"miss order {records[-1]}", flush=True)
        drawn = torch.randperm(total_rows, device=device)[:count]
        for name, rows in (("drawn", drawn), ("sorted", torch.sort(drawn).values)):
            us = planned_copy_us(host_pool, rows, batch=128)
            records.append({"misses": count, "rows": "repeated", "order": name,
                            "us": round(us, 1), "GBps": round(count * ROW_BYTES / us / 1e3, 1)})
            print(f"miss order {records[-1]}", flush=True)
    keys = torch.randint(0, total_rows, (128 * 2048,), device=device, dtype=torch.int32)
    values = torch.arange(keys.numel(), device=device, dtype=torch.int32)
    sort_us = time_us(lambda: values[torch.sort(keys).indices], 20)
    return {"pool_rows": total_rows, "pool_GiB": round(total_rows * ROW_BYTES / GIB, 2),
            "miss_order": records, "sort_262144_pairs_us": round(sort_us, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=2.75, help="registered pool size")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--miss-order", action="store_true",
                        help="only the miss-order probe (NOTES.md, fourteenth pass)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_limits needs a CUDA GPU; none is visible", file=sys.stderr)
        return 2
    rows = int(args.pool_gib * GIB) // ROW_BYTES
    pool = alloc_registered(rows * ROW_BYTES).view(rows, ROW_BYTES)
    results = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "command": " ".join(["python", *sys.argv]),
               **(miss_order(pool) if args.miss_order else measure(pool))}
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
