"""Where a verify step's host time goes: one SW-2 cache (benchmarks/verify_step.py), eager
steps under torch.profiler, each phase of the step (begin, the new rows' write, the swap-in,
end) marked; per phase the host wall-clock, the runtime calls it made (kernel launches,
copies, synchronizations) and the torch ops with the most host time.

    python benchmarks/profile_verify.py --device cuda --batch 1 --tokens 2 \\
        --output benchmarks/results/profile-verify-h100.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from hisparse.tools.benchmarking import run_environment

sys.path.insert(0, str(Path(__file__).resolve().parent))
import verify_step  # a sibling script, not a package

PHASES = ("begin", "write", "swap", "end")
# Runtime API calls counted per phase (CUDA's names; others are listed under "other").
RUNTIME_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                 "cudaMemcpyAsync", "cudaMemsetAsync", "cudaStreamSynchronize",
                 "cudaDeviceSynchronize", "cudaEventRecord", "cudaStreamWaitEvent",
                 "cudaEventSynchronize")


def step(cache: Any, top_k: torch.Tensor, zeros: torch.Tensor,
         accepted: list[int]) -> dict[str, float]:
    """One verify step, each phase inside a profiler range; its host seconds per phase."""
    B = top_k.shape[0]
    marks = [time.perf_counter()]
    with record_function("begin"):
        cache.begin_decode_step(list(range(B)), num_tokens=top_k.shape[1])
    marks.append(time.perf_counter())
    with record_function("write"):
        cache.write_newest(0, zeros)
    marks.append(time.perf_counter())
    with record_function("swap"):
        cache.swap_in(0, top_k)
    marks.append(time.perf_counter())
    with record_function("end"):
        cache.end_decode_step(accepted=accepted)
    marks.append(time.perf_counter())
    return {phase: marks[i + 1] - marks[i] for i, phase in enumerate(PHASES)}


def inside(event: Any, outer: Any) -> bool:
    return (event.time_range.start >= outer.time_range.start
            and event.time_range.end <= outer.time_range.end)


def phase_report(events: list[Any], phase: str, steps: int) -> dict[str, Any]:
    """Runtime calls and the torch ops with the most self host time under `phase`'s ranges,
    per step."""
    ranges = [e for e in events if e.name == phase]
    calls: collections.Counter[str] = collections.Counter()
    ops: collections.Counter[str] = collections.Counter()
    op_us: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.name in PHASES or not any(inside(event, r) for r in ranges):
            continue
        if event.name in RUNTIME_CALLS or event.name.startswith("cu"):
            calls[event.name] += 1
        elif event.name.startswith("aten::"):
            ops[event.name] += 1
            op_us[event.name] += event.self_cpu_time_total
    return {"runtime_calls_per_step": {k: v / steps for k, v in calls.most_common()},
            "top_ops_self_us_per_step": {k: round(v / steps, 1)
                                         for k, v in op_us.most_common(12)},
            "op_counts_per_step": {k: v / steps for k, v in ops.most_common(12)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2, help="S, tokens verified a step")
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--churn", type=float, default=0.05)
    parser.add_argument("--overlap", type=float, default=0.9)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20, help="steps timed, then profiled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noop-kernels", action="store_true",
                        help="the CPU with kernels that do nothing "
                        "(tests/fakes/noop_kernels.py): the engine's own Python per phase")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    device: Any = args.device
    if args.noop_kernels:
        # The fake lives with the tests' other fakes; the repository root makes it importable.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from fakes.noop_kernels import NoopKernelCpu

        device = NoopKernelCpu()
    B, S, K, seq_len, W = args.batch, args.tokens, args.top_k, args.seq_len, 656
    hot = max(2, S) * K
    steps = args.warmup + 2 * args.steps
    growth = -(-(steps * S + 2) // 64) * 64
    kv = torch.randint(0, 256, (1, seq_len, W), dtype=torch.uint8)
    cache = verify_step.build(device, K, hot, S, B, seq_len, W, growth, kv)
    zeros = torch.zeros(B, S, W, dtype=torch.uint8, device=cache.device)
    rng = np.random.default_rng(args.seed)
    previous = rng.integers(0, seq_len, (B, K))

    def draw() -> tuple[torch.Tensor, list[int]]:
        nonlocal previous
        rows = verify_step.query_rows(rng, previous, seq_len, hot, S, args.churn, args.overlap)
        previous = rows[:, 0]
        top_k = torch.from_numpy(rows.astype(np.int32)).to(cache.device)
        return top_k, rng.integers(1, S + 1, B).tolist()

    for _ in range(args.warmup):
        top_k, accepted = draw()
        step(cache, top_k, zeros, accepted)
    cache.backend.synchronize()
    timed = []
    for _ in range(args.steps):  # outside the profiler: its own cost is not in these
        top_k, accepted = draw()
        timed.append(step(cache, top_k, zeros, accepted))
        cache.backend.synchronize()
    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            top_k, accepted = draw()
            step(cache, top_k, zeros, accepted)
            cache.backend.synchronize()
    events = list(prof.events())
    result = {
        "command": "python benchmarks/profile_verify.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "environment": run_environment(str(cache.device)),
        "batch": B, "tokens": S, "top_k": K, "churn": args.churn, "overlap": args.overlap,
        "host_us_median": {p: round(statistics.median(t[p] for t in timed) * 1e6, 1)
                           for p in PHASES},
        "phases": {p: phase_report(events, p, args.steps) for p in PHASES},
    }
    cache.close()
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
