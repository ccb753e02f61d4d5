"""Shared prefixes in the host tier: what admitting on a retained prefix saves.

N requests with the same P-token prefix (a system prompt) and `--own-tokens` tokens each of
their own, admitted one after another, in two modes on caches of one shape:

* unshared: each request is admitted, writes its whole prompt (P + own rows per layer, the
  prefill offload) and commits;
* shared: a first request writes the prefix, `retain_prefix` keeps it and the request
  finishes (a radix cache inserting it); each request is then admitted with
  `prefix=handle`, writes only its own rows (`start=P`) and commits. The boundary extent's
  rows are copied host to host by `admit`.

Each mode runs `--rounds` times on a fresh cache, the modes alternating. Per request the
clock runs from `admit` to the end of its first decode step (write_newest and
swap_in on every layer with the K newest positions, end_decode_step, device synchronised):
the admit-to-first-decode time a scheduler sees, with the part up to `commit_prefill`
(offload and seeding landed) apart. Reported per mode: those times (median and each), the
bytes the prefill offload wrote per request (stats' device-to-host bytes less the
first token's backup), the host extents held once all N are admitted against the formula
P_E + N x own (whole extents), and `stats()`'s `host_bytes_saved`. Both modes use
`--residency-map` (default host_row, the config's, which shares through alias key extents;
the results recorded before 2026-12-02 used position), and every shared request's host rows
are checked against the prompt's bytes.

    PYTHONPATH=src python benchmarks/prefix_sharing.py --device cpu \\
        --output benchmarks/results/prefix-sharing-cpu.json
    PYTHONPATH=src python benchmarks/prefix_sharing.py --device cuda --prefix-tokens 32768 \\
        --output benchmarks/results/prefix-sharing-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import hisparse
from hisparse.cli._output import non_negative_int, positive_int
from hisparse.tools.benchmarking import run_environment


def make_cache(args: argparse.Namespace) -> hisparse.HiSparseCache:
    overrides: dict[str, Any] = {"residency_map": args.residency_map,
                                 "max_requests": args.requests + 2}
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    probe = hisparse.HiSparseConfig.from_preset(args.preset, **overrides)
    E = probe.extent_tokens
    prompt = args.prefix_tokens + args.own_tokens
    overrides["max_seq_len"] = -(-(prompt + 2) // E) * E
    # Every request unshared and the prefix's holder, in whole extents, plus one to spare.
    overrides["host_pool_tokens"] = (args.requests + 2) * overrides["max_seq_len"]
    cache = hisparse.HiSparseCache(
        hisparse.HiSparseConfig.from_preset(args.preset, **overrides), device=args.device)
    # Every page touched before the clock runs, as those of a registered (pinned) pool are:
    # otherwise the first writes into fresh CPU memory pay page faults, more of them unshared.
    for host in cache.host_tensors():
        host.zero_()
    return cache


def first_decode(cache: hisparse.HiSparseCache, request_id: str, newest: torch.Tensor) -> None:
    """One decode step of the request alone, every layer, the K newest positions."""
    step = cache.begin_decode_step([request_id])
    n = step.positions[0] + 1
    top_k = torch.arange(max(0, n - cache.top_k), n, dtype=torch.int32, device=cache.device)
    top_k = torch.nn.functional.pad(top_k, (0, cache.top_k - top_k.numel()), value=-1)[None]
    for layer in range(cache.num_layers):
        cache.write_newest(layer, newest[layer])
        cache.swap_in(layer, top_k)
    cache.end_decode_step()
    cache.backend.synchronize(cache.device)


def run_mode(args: argparse.Namespace, shared: bool, prompt_kv: torch.Tensor,
             newest: torch.Tensor) -> dict[str, Any]:
    cache = make_cache(args)
    P, prompt = args.prefix_tokens, args.prefix_tokens + args.own_tokens
    kv = prompt_kv.to(cache.device)  # a prefill's output lives on the device
    handle = None
    if shared:
        cache.admit("prefix", P)
        cache.write_prefill("prefix", kv[:, :P])
        cache.commit_prefill("prefix")
        handle = cache.retain_prefix("prefix", P)
        cache.finish("prefix")  # the handle keeps the rows
    first = P if shared else 0

    def admit(request_id: str) -> tuple[float, float, float, int]:
        before = cache.stats().bytes_device_to_host
        start, start_cpu = time.perf_counter(), time.process_time()
        cache.admit(request_id, prompt, prefix=handle)
        cache.write_prefill(request_id, kv[:, first:], start=first)
        cache.commit_prefill(request_id)
        cache.backend.synchronize(cache.device)  # the offload and the seeding landed
        committed = time.perf_counter()
        first_decode(cache, request_id, newest)
        done, done_cpu = time.perf_counter(), time.process_time()
        backup = cache.num_layers * cache.row_bytes  # the first decoded token's rows
        return (committed - start, done - start, done_cpu - start_cpu,
                cache.stats().bytes_device_to_host - before - backup)

    for warmup in range(args.warmup):  # allocations and first-call costs, then freed
        admit(f"warmup-{warmup}")
        cache.finish(f"warmup-{warmup}")
    to_commit, times, cpu_times, offloaded = [], [], [], []
    for index in range(args.requests):
        commit_s, seconds, cpu_seconds, written = admit(f"r{index}")
        to_commit.append(commit_s)
        times.append(seconds)
        cpu_times.append(cpu_seconds)
        offloaded.append(written)
    cache.backend.synchronize(cache.device)
    occupancy = cache.stats().occupancy
    E, L, W = cache.extent_tokens, cache.num_layers, cache.row_bytes
    # P + N x own, rounded to extents: the prefix's whole extents once (and the boundary
    # extent the handle keeps), each request's tokens from the prefix's last whole extent.
    whole = P // E if shared else 0
    own_extents = -(-(prompt + 1 - whole * E) // E)  # +1: the decoded token
    expected = args.requests * own_extents + (-(-P // E) if shared else 0)
    for index in range(args.requests):  # the rows each request reads are the prompt's
        rows = torch.from_numpy(cache.host_rows(f"r{index}")[:prompt])
        for layer in (0, L - 1):
            assert torch.equal(cache.host_tensors()[layer][rows], prompt_kv[layer]), index
    result = {
        "mode": "shared" if shared else "unshared",
        "admit_to_first_decode_s": {"median": statistics.median(times),
                                    "mean": statistics.fmean(times), "each": times},
        # admit + write_prefill + commit_prefill (seeding included), synchronised
        "admit_to_commit_s": {"median": statistics.median(to_commit),
                              "mean": statistics.fmean(to_commit), "each": to_commit},
        # This process's CPU time (all threads) from admit to the first decode's end: on the
        # CPU backend the whole work, and less disturbed than the wall clock by other jobs.
        "admit_to_first_decode_cpu_s": {"median": statistics.median(cpu_times),
                                        "mean": statistics.fmean(cpu_times),
                                        "each": cpu_times},
        "prefill_bytes_offloaded_per_request": statistics.median(offloaded),
        "host_extents_used": occupancy.host_extents_used,
        "host_extents_expected": expected,
        "host_bytes_used": occupancy.host_extents_used * E * L * W,
        "host_bytes_saved": occupancy.host_bytes_saved,
        "shared_extents": occupancy.shared_extents,
    }
    assert occupancy.host_extents_used == expected, result
    if handle is not None:
        cache.release_prefix(handle)
    cache.close()
    return result


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's rounds as one: the times of every round together, the rest from the first
    (the bytes and extents are the same in every round: run_mode asserts the extents)."""
    merged = dict(rounds[0])
    for key in ("admit_to_first_decode_s", "admit_to_commit_s", "admit_to_first_decode_cpu_s"):
        each = [t for r in rounds for t in r[key]["each"]]
        merged[key] = {"median": statistics.median(each), "mean": statistics.fmean(each),
                       "each": each}
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="backend or device (default: cpu)")
    parser.add_argument("--preset", default="deepseek-v3.2")
    parser.add_argument("--residency-map", choices=("host_row", "position"), default="host_row",
                        help="what the residency map is keyed by (default: host_row)")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="override the preset's layer count (host memory)")
    parser.add_argument("--prefix-tokens", type=positive_int, default=8192)
    parser.add_argument("--own-tokens", type=non_negative_int, default=600,
                        help="tokens of each request after the prefix")
    parser.add_argument("--requests", type=positive_int, default=8)
    parser.add_argument("--warmup", type=non_negative_int, default=1)
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="fresh caches per mode, the modes alternating (default: 3)")
    parser.add_argument("--cpu-threads", type=positive_int, default=1,
                        help="torch CPU threads (default: 1; more threads on a busy machine "
                        "spin and time each other)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.cpu_threads)
    config = hisparse.HiSparseConfig.from_preset(
        args.preset, **({"num_layers": args.layers} if args.layers else {}))
    L, W = config.num_layers, config.row_bytes
    generator = torch.Generator().manual_seed(args.seed)
    prompt = args.prefix_tokens + args.own_tokens
    prompt_kv = torch.randint(0, 256, (L, prompt, W), dtype=torch.uint8, generator=generator)
    newest = torch.randint(0, 256, (L, 1, W), dtype=torch.uint8, generator=generator)
    # Rounds alternate the modes, so that a machine busy with other work slows both alike.
    rounds = [[run_mode(args, shared, prompt_kv, newest.to(args.device))
               for shared in (False, True)] for _ in range(args.rounds)]
    modes = [merge_rounds([r[index] for r in rounds]) for index in range(2)]
    unshared, shared = modes
    result = {
        "command": "python benchmarks/prefix_sharing.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        **run_environment(args.device),
        "device": args.device,
        "preset": args.preset, "num_layers": L, "row_bytes": W,
        "extent_tokens": config.extent_tokens, "hot_slots": config.hot_slots
        or 2 * config.top_k, "top_k": config.top_k,
        "residency_map": args.residency_map, "prefix_tokens": args.prefix_tokens,
        "own_tokens": args.own_tokens,
        "requests": args.requests, "rounds": args.rounds, "cpu_threads": args.cpu_threads,
        "modes": modes,
        "offload_ratio": (shared["prefill_bytes_offloaded_per_request"]
                          / unshared["prefill_bytes_offloaded_per_request"]),
        "host_bytes_ratio": shared["host_bytes_used"] / unshared["host_bytes_used"],
        "admit_to_first_decode_speedup": (unshared["admit_to_first_decode_s"]["median"]
                                          / shared["admit_to_first_decode_s"]["median"]),
        "admit_to_commit_speedup": (unshared["admit_to_commit_s"]["median"]
                                    / shared["admit_to_commit_s"]["median"]),
        "admit_to_first_decode_cpu_time_ratio": (
            shared["admit_to_first_decode_cpu_s"]["median"]
            / unshared["admit_to_first_decode_cpu_s"]["median"]),
    }
    # Other work on the machine shows in the times (the bytes and extents do not change).
    result["load_average_1_5_15_min_at_end"] = list(os.getloadavg())
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}, indent=1))
    for mode in modes:
        median_ms = 1e3 * mode["admit_to_first_decode_s"]["median"]
        commit_ms = 1e3 * mode["admit_to_commit_s"]["median"]
        cpu_ms = 1e3 * mode["admit_to_first_decode_cpu_s"]["median"]
        print(f"{mode['mode']:>8}: admit to first decode {median_ms:.1f} ms median "
              f"(to commit {commit_ms:.1f} ms; {cpu_ms:.1f} ms CPU time), "
              f"{mode['prefill_bytes_offloaded_per_request'] / 2**20:.1f} MiB offloaded per "
              f"request, host {mode['host_bytes_used'] / 2**30:.2f} GiB "
              f"({mode['host_bytes_saved'] / 2**30:.2f} GiB saved)")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
