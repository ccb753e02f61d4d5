"""One host pool for the tensor-parallel ranks of a node (issue 23): memory, step cost, fuzz.

For each group size in `--ranks`, one process per rank (hisparse.tools.shared_pool_run):

* memory: every rank builds a cache of `--pool-tokens` rows per layer; the writer fills the
  whole pool and every rank reads every row. Reported: the shared segment's allocated bytes,
  each rank's private (RssAnon), shared (RssShmem) and proportional (Pss) resident memory
  before and after, and the group's host memory (segment + private growth), against the
  same group with a private pool per rank (today).
* step cost: every rank decodes `--batch` long requests for `--steps` steps (begin, every
  layer's write_newest and swap_in of a random top-k, end), the ranks starting each step
  together as a TP group's collectives keep them; per-step host time (also without the time
  spent waiting for the writer inside the step) and, on a GPU, device time (events around
  the step). The ranks that do not write, against the ranks of a group of the same size
  with private pools (today: every rank backs its own tokens up), and a single rank alone.
  Again interleaved (`timing_interleaved`): the shared group, a private group and a single
  rank run at once and take turns within each step, so that each process's time holds no
  contention from the others and all of them see the machine at the same moments.
  Paired (`timing_paired`): the shared group alone, taking turns, each process also holding a
  private cache of the same config and timing one step on each in its turn (the same top-k,
  the order alternating, a device sync between them), so that the per-step ratio shared /
  private holds no difference between processes (their cores, their heaps), which moved the
  interleaved ratios by 0.88-1.15x; reported for the non-writers and the writer, as medians
  of the per-step ratios and of each cache's times. Twice: with a random top-k over the
  prompt (`host_rows`: most of it read from host rows every step) and with the same K
  positions every step (`miss_free`: no host row read), which tells the cost of reading a
  shared mapping from the per-step work of the protocol.
  One process (`timing_one_process`): the same pairs with every rank's caches in this one
  process, one core, no turns handed over.
* fuzz: `--fuzz-steps` decode steps per rank of random admit, PD, finish, abort, preempt,
  resume and cancel, every row read checked byte for byte against the rows the seeds give.

    PYTHONPATH=src python benchmarks/shared_pool.py --device cpu --ranks 2 4 \\
        --output benchmarks/results/shared-pool-cpu.json
    PYTHONPATH=src python benchmarks/shared_pool.py --device cuda --ranks 2 4 \\
        --output benchmarks/results/shared-pool-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from hisparse.cli._output import non_negative_int, positive_int
from hisparse.tools.benchmarking import run_environment
from hisparse.tools.combination_fuzz import fuzz_rank
from hisparse.tools.shared_pool_run import describe_failure, memory_rank, run_group
from hisparse.tools.shared_pool_timing import (
    one_process_ranks,
    paired_rank,
    paired_summary,
    timing_rank,
)


def group(target: Any, name: str | None, ranks: int, timeout_s: float = 580.0,
          **args: Any) -> list[dict[str, Any]]:
    return checked(target, [dict(name=name, rank=r, ranks=ranks, **args) for r in range(ranks)],
                   timeout_s)


def checked(target: Any, entries: list[dict[str, Any]], timeout_s: float = 580.0
            ) -> list[dict[str, Any]]:
    """`target` in one process per entry; their results, or exit on the first failure."""
    results = run_group(target, entries, timeout_s=timeout_s)
    failure = describe_failure(results)
    if failure or any("exitcode" in r for r in results):
        raise SystemExit(f"a rank failed: {failure or results}")
    return results


def memory(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    name = f"bench-{os.getpid()}-mem{ranks}"
    shared = group(memory_rank, name, ranks, pool_tokens=args.pool_tokens, device=args.device,
                   layers=args.layers)
    private = group(memory_rank, None, ranks, pool_tokens=args.pool_tokens, device=args.device,
                    layers=args.layers)
    pool = shared[0]["pool_bytes"]

    def summary(results: list[dict[str, Any]], shm: int) -> dict[str, Any]:
        grown = sum(max(0, r["private_delta"]) for r in results)
        return {"shared_memory_bytes": shm, "private_growth_bytes_per_rank":
                [r["private_delta"] for r in results],
                "rss_after": [r["after"] for r in results],
                "host_bytes_of_group": shm + grown, "pools": (shm + grown) / pool}

    return {"pool_bytes": pool, "shared": summary(shared, shared[0]["shm_bytes"]),
            "private": summary(private, 0)}


def stats_of(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "mean": statistics.fmean(ordered)}


def timing(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    common = dict(steps=args.steps, batch=args.batch, device=args.device)
    shared = group(timing_rank, f"bench-{os.getpid()}-time{ranks}", ranks, **common)
    private = group(timing_rank, None, ranks, **common)
    single = group(timing_rank, None, 1, **common)[0]
    return timing_summary(shared, private, single)


def timing_interleaved(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """The shared group (turns 0..n-1, the writer first), a private group (n..2n-1) and a
    single rank (2n) in one barrier, taking turns within each step."""
    name, turns = f"bench-{os.getpid()}-turns{ranks}", 2 * ranks + 1
    common = dict(steps=args.steps, batch=args.batch, device=args.device, turns=turns)
    entries = ([dict(name=name, rank=r, ranks=ranks, turn=r, **common) for r in range(ranks)]
               + [dict(name=None, rank=r, ranks=ranks, turn=ranks + r, **common)
                  for r in range(ranks)]
               + [dict(name=None, rank=0, ranks=1, turn=2 * ranks, **common)])
    results = checked(timing_rank, entries)
    return timing_summary(results[:ranks], results[ranks:-1], results[-1])


def timing_paired(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """The shared group alone, taking turns; each process also holds a private cache and
    times one step on each in its turn (`paired_rank`), so that its ratio holds no
    difference between processes."""
    summary = {}
    for reads, miss_free in (("host_rows", False), ("miss_free", True)):
        entries = [dict(name=f"bench-{os.getpid()}-paired{ranks}-{reads}", rank=r,
                        ranks=ranks, steps=args.steps, batch=args.batch, device=args.device,
                        miss_free=miss_free) for r in range(ranks)]
        summary[reads] = paired_summary(checked(paired_rank, entries))
    return summary


def timing_one_process(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    """`timing_paired` with every rank's caches in this one process (`one_process_ranks`)."""
    return {reads: paired_summary(one_process_ranks(
                f"bench-{os.getpid()}-one{ranks}-{reads}", ranks, args.steps, args.batch,
                args.device, miss_free=miss_free))
            for reads, miss_free in (("host_rows", False), ("miss_free", True))}


def timing_summary(shared: list[dict[str, Any]], private: list[dict[str, Any]],
                   single: dict[str, Any]) -> dict[str, Any]:
    readers_host = [v for r in shared[1:] for v in r["host_us"]]
    readers_busy = [v for r in shared[1:] for v in r["busy_us"]]
    readers_device = [v for r in shared[1:] for v in r["device_ms"]]
    private_host = [v for r in private for v in r["host_us"]]
    private_device = [v for r in private for v in r["device_ms"]]
    out = {"non_writer_host_us": stats_of(readers_host),
           "non_writer_host_busy_us": stats_of(readers_busy),
           "writer_host_us": stats_of(shared[0]["host_us"]),
           "private_rank_host_us": stats_of(private_host),
           "single_rank_alone_host_us": stats_of(single["host_us"]),
           "single_rank_alone_device_ms": stats_of(single["device_ms"]),
           "non_writer_device_ms": stats_of(readers_device),
           "writer_device_ms": stats_of(shared[0]["device_ms"]),
           "private_rank_device_ms": stats_of(private_device)}
    out["non_writer_over_private_host"] = (out["non_writer_host_us"]["median"]
                                           / out["private_rank_host_us"]["median"])
    out["non_writer_busy_over_private_host"] = (out["non_writer_host_busy_us"]["median"]
                                                / out["private_rank_host_us"]["median"])
    if readers_device:
        out["non_writer_over_private_device"] = (out["non_writer_device_ms"]["median"]
                                                 / out["private_rank_device_ms"]["median"])
    return out


def summary_line(entry: dict[str, Any]) -> str:
    said = []
    if "memory" in entry:
        m = entry["memory"]
        said.append(f"host memory {m['shared']['pools']:.2f} pools shared vs "
                    f"{m['private']['pools']:.2f} private")
    for part, how in (("timing", "in lockstep"), ("timing_interleaved", "interleaved")):
        if part in entry:
            t = entry[part]
            said.append(f"non-writer step {how} {t['non_writer_host_busy_us']['median']:.0f} us "
                        f"host without waits vs {t['private_rank_host_us']['median']:.0f} us "
                        "on a private pool")
    for part, where in (("timing_paired", "in its process"), ("timing_one_process",
                                                                 "all ranks in one process")):
        for reads, how in (("host_rows", "reading host rows"), ("miss_free", "miss-free")):
            paired = entry.get(part, {}).get(reads, {}).get("non_writer")
            if paired:
                device = (f", {paired['device']['ratio_median']:.2f}x device"
                          if "device" in paired else "")
                said.append(f"non-writer step ({how}, {where}) against a private cache: "
                            f"{paired['host']['ratio_median']:.2f}x host "
                            f"({paired['host_busy']['ratio_median']:.2f}x without waits)"
                            f"{device}")
    if "fuzz" in entry:
        said.append(f"fuzz {entry['fuzz_steps_total']} steps, {entry['fuzz_mismatches']} "
                    "mismatches")
    return "; ".join(said)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (every rank on it)")
    parser.add_argument("--ranks", type=positive_int, nargs="+", default=[2, 4],
                        help="group sizes to run (default: 2 4)")
    parser.add_argument("--pool-tokens", type=positive_int, default=1 << 18,
                        help="host rows per layer of the memory run (default: 262144)")
    parser.add_argument("--layers", type=positive_int, default=4,
                        help="layers of the memory run (default: 4)")
    parser.add_argument("--steps", type=positive_int, default=200,
                        help="timed decode steps per rank (default: 200)")
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--fuzz-steps", type=non_negative_int, default=10000,
                        help="fuzz decode steps per rank (default: 10000; 0: no fuzz)")
    parser.add_argument("--fuzz-folded", type=float, default=0.5,
                        help="the share of fuzz steps that hand the new rows to swap_in "
                             "(newest_kv=) instead of write_newest (default: 0.5)")
    parts = {"memory": memory, "timing": timing, "timing_interleaved": timing_interleaved,
             "timing_paired": timing_paired, "timing_one_process": timing_one_process}
    parser.add_argument("--parts", nargs="+", default=list(parts), choices=list(parts),
                        help="what to measure besides the fuzz (default: all five)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "command": "python benchmarks/shared_pool.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        **run_environment(args.device), "device": args.device, "groups": {}}
    for ranks in args.ranks:
        entry: dict[str, Any] = {part: parts[part](args, ranks) for part in args.parts}
        if args.fuzz_steps:
            fuzz = group(fuzz_rank, f"bench-{os.getpid()}-fuzz{ranks}", ranks, timeout_s=3600,
                         seed=args.seed + ranks, steps=args.fuzz_steps, device=args.device,
                         folded=args.fuzz_folded)
            entry["fuzz"] = fuzz
            entry["fuzz_mismatches"] = sum(r["mismatches"] for r in fuzz)
            entry["fuzz_steps_total"] = sum(r["steps"] for r in fuzz)
        result["groups"][str(ranks)] = entry
        print(f"{ranks} ranks: {summary_line(entry)}", flush=True)
    result["load_average_1_5_15_min_at_end"] = list(os.getloadavg())
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(g.get("fuzz_mismatches", 0) == 0 for g in result["groups"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
