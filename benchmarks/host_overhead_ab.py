"""Before/after of benchmarks/host_overhead.py: runs of a baseline tree and of a change, taken
alternately on one machine (`scripts/gpu-run host-overhead-ab` writes them), compared per cell
and part as the median over runs of each run's normalized median (every sample scaled by that
run's host reference speed, so a machine that slows down between runs does not read as a
regression).

    python benchmarks/host_overhead_ab.py --baseline base-1.json base-2.json \
        --change change-1.json change-2.json [--output table.txt]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

PARTS = ("swap_in", "write_newest", "begin_plus_end", "step")


def medians(runs: list[dict[str, Any]]) -> dict[tuple[int, float, str, str], float]:
    """(batch, churn, newest, part) -> median over runs of the normalized median, in us."""
    per_key: dict[tuple[int, float, str, str], list[float]] = {}
    for run in runs:
        for cell in run["cells"]:
            measured = cell.get("normalized", cell)
            for part in PARTS:
                if part in measured:
                    key = (cell["batch"], cell["churn"], cell.get("newest", "separate"), part)
                    per_key.setdefault(key, []).append(measured[part]["median_us"])
    return {key: statistics.median(values) for key, values in per_key.items()}


def reference(run: dict[str, Any]) -> float | None:
    found = run.get("reference") or {}
    return found.get("median_us") if isinstance(found, dict) else None


def compare(baseline: list[dict[str, Any]], change: list[dict[str, Any]]) -> list[str]:
    before, after = medians(baseline), medians(change)
    lines = ["host reference (median us of a fixed workload, per run): baseline "
             f"{[reference(r) for r in baseline]} change {[reference(r) for r in change]}"]
    ratios: dict[str, list[float]] = {}
    for key in sorted(before.keys() & after.keys()):
        batch, churn, newest, part = key
        ratio = after[key] / before[key]
        ratios.setdefault(part, []).append(ratio)
        lines.append(f"B={batch:>4} churn={churn:<4} {newest:<8} {part:<15} baseline "
                     f"{before[key]:9.1f} us  change {after[key]:9.1f} us  ratio {ratio:.3f}")
    lines.append("per part, the median ratio over cells (change / baseline): " + ", ".join(
        f"{part} {statistics.median(values):.3f}" for part, values in sorted(ratios.items())))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", nargs="+", type=Path, required=True)
    parser.add_argument("--change", nargs="+", type=Path, required=True)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    load = [json.loads(path.read_text()) for path in args.baseline]
    new = [json.loads(path.read_text()) for path in args.change]
    text = "\n".join(compare(load, new)) + "\n"
    if args.output:
        args.output.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
