"""Where SW-1's miss-free step goes: the same cold step timed whole, in parts, and inside a graph.

For B in --batches, churn 0 (every step after the first is miss-free), both layouts, with the
caches flushed before every step as SW-1 does (`--flush`), each of these is captured as one
CUDA graph and timed like an SW-1 step (device events behind a GPU sleep):
  * empty: one tiny kernel (the floor of a timed graph replay);
  * top-k copy: the step's top-k copied in, as the indexer's last kernel writes it;
  * classify: the split lookup kernel alone (hit flags cleared after each step, untimed);
  * skip-IO: classify and plan, no copy kernel (the library's skip-IO probe);
  * swap-in: the whole swap-in, as SW-1 times it;
  * top-k copy + swap-in: the swap-in behind the copy in one graph. Its difference from the
    top-k copy alone is what the swap-in adds inside a larger graph (a serving step captures
    the whole decode step, so no graph launch precedes a layer's swap-in).
The swap-in graphs' rows are checked against the pool on the device after every step.

    PYTHONPATH=src python benchmarks/step_parts.py [--batches 1 128] [--flush write]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import triton

from hisparse.backends.registry import get_backend
from hisparse.kernels import swap_in as kernels
from hisparse.tools import benchmarking


@contextlib.contextmanager
def classify_only() -> Iterator[None]:
    """The swap-in launcher running its lookup launch alone (selection and copy left out)."""
    from hisparse.kernels.swap_in import launch

    saved = launch._run

    def lookup_only(launches: tuple[Callable[[], None], ...], scratch: object) -> None:
        launches[0]()

    launch._run = lookup_only
    try:
        yield
    finally:
        launch._run = saved


def time_parts(backend, pool: torch.Tensor, mirror: torch.Tensor, layout: str, batch: int,
               sizes: benchmarking.SW1Sizes, steps: int, flush: str, seed: int) -> list[dict]:
    device = backend.device()
    rng = np.random.default_rng([seed, batch, benchmarking.LAYOUTS.index(layout)])
    tables, host_rows = benchmarking.build_tables(backend, pool, layout, batch, sizes, rng,
                                                  mirror=mirror)
    trace = benchmarking.ChurnTrace(batch, sizes, 0.0, rng)
    req_slots = torch.arange(batch, dtype=torch.int32, device=device)
    num_real = torch.tensor([batch], dtype=torch.int32, device=device)
    source = torch.from_numpy(trace.step()).to(device)  # churn 0: the same top-k every step
    top_k = source.clone()
    out = torch.full_like(top_k, -1)
    rows_on_device = torch.from_numpy(host_rows).to(device)
    kernel, _ = benchmarking.swap_in_kernel(backend)

    def swap_in(**options: object) -> None:
        kernel(tables, 0, 0, req_slots, top_k, num_real, out, **options)

    swap_in()  # the first step misses its whole top-k: compiles, allocates, installs
    swap_in()  # miss-free from here on
    parts: dict[str, tuple[Callable[[], None], bool]] = {
        "empty": (lambda: num_real.add_(0), False),
        "top-k copy": (lambda: top_k.copy_(source), False),
        "classify": (swap_in, False),
        "skip-IO": (lambda: swap_in(skip_io=True), False),
        "swap-in": (swap_in, True),
        "top-k copy + swap-in": (lambda: (top_k.copy_(source), swap_in()), True),
    }
    flusher = benchmarking.CacheFlusher(device, flush)
    timer = benchmarking.StepTimer(backend, device, queued=True)
    records = []
    misses_before = int(tables.counters[0, 1])
    for name, (call, checked) in parts.items():
        with classify_only() if name == "classify" else contextlib.nullcontext():
            call()  # compiles what this part launches
            with backend.graph_capture() as graph:
                call()
        wrong = torch.zeros((), dtype=torch.int64, device=device)
        times = []
        for _ in range(steps):
            flusher.flush()
            times.append(timer.record(graph.replay))
            if checked:
                wrong += benchmarking.wrong_rows(tables, mirror, rows_on_device, top_k, out)
            backend.synchronize()
        seconds = sorted(elapsed() for elapsed in times)
        record = {"layout": layout, "B": batch, "part": name,
                  "median_us": round(statistics.median(seconds) * 1e6, 2),
                  "p90_us": round(seconds[int(0.9 * (len(seconds) - 1))] * 1e6, 2),
                  "correct": int(wrong) == 0 if checked else None}
        records.append(record)
        print(json.dumps(record), flush=True)
    if int(tables.counters[0, 1]) != misses_before:
        raise RuntimeError("a timed step missed: the parts did not all run miss-free")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--flush", choices=benchmarking.FLUSH_MODES, default="write")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--output", default="step-parts-cuda.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_parts: needs a CUDA GPU", file=sys.stderr)
        return 2
    backend = get_backend("cuda")
    sizes = benchmarking.SW1Sizes()
    records = []
    with benchmarking.sw1_pool(backend, max(args.batches), sizes) as pool:
        mirror = pool.to("cuda")
        for layout in benchmarking.LAYOUTS:
            for batch in args.batches:
                records += time_parts(backend, pool, mirror, layout, batch, sizes, args.steps,
                                      args.flush, args.seed)
    checked = [r["correct"] for r in records if r["correct"] is not None]
    results = {
        "card": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "command": "python " + " ".join(sys.argv),
        "workload": f"SW-1 churn 0, caches flushed ({args.flush}) before every step, each part "
                    "one CUDA graph timed with device events behind a GPU sleep",
        "tuning": dataclasses.asdict(kernels.current_tuning()),
        "all_correct": all(checked), "records": records,
    }
    out = Path(args.out_dir) / args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if results["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
