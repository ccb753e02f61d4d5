"""`hisparse bench`: SW-1 and the copy-limit probes on this device, against DESIGN.md's limits."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from types import SimpleNamespace
from typing import Any

from hisparse.cli import _output as out
from hisparse.core.widths import RESIDENCY_MAPS

FULL = {"batches": [1, 16, 64, 128], "churns": [0.0, 0.05, 0.2, 1.0], "seq_len": 32768,
        "warmup": 8, "steps": 40, "gather_pool_mib": 1024, "gather_rows": [2048, 16384, 131072],
        "bulk_mib": 1024}
# On a CPU the torch reference runs SW-1 at about 10-100 ms a step: a few seconds in all.
QUICK = {"batches": [1, 4], "churns": [0.0, 0.2, 1.0], "seq_len": 16384, "warmup": 2,
         "steps": 5, "gather_pool_mib": 64, "gather_rows": [2048, 16384], "bulk_mib": 64}

# DESIGN.md section 8, measured on an NVIDIA H200 (PCIe Gen5 x16).
COPY_LIMITS = {
    ("bulk host-to-device", None): "52-55 GB/s",
    ("bulk device-to-host", None): "55 GB/s",
    ("gather", 2048): "35-56 us",
    ("gather", 16384): "41-47 GB/s",
    ("gather", 131072): "46-48 GB/s (local rows)",
}
# What makes a run SW-1 for the targets: --quick, --seq-len, --top-k or --hot-buffer change it.
SW1_SHAPE = ("seq_len", "top_k", "hot_slots", "row_bytes", "extent_tokens")
SGLANG_FULL_MISS_B1_SECONDS = 257e-6  # SGLang 0.5.23 fused swap-in, SW-1 scattered, B=1
SGLANG_B128_CHURN02_SECONDS = 1.36e-3  # same kernel, B=128, churn 0.2

EPILOG = """\
example:
  hisparse bench --device cuda --output benchmarks/results/bench-h200.json \\
      --plot bench-h200.png

SW-1 (DESIGN.md section 8): one layer, 656 B rows, top-k 2048, hot buffer 4096+1,
every request at 32768 tokens in the host pool; batch x churn x host layout
(scattered rows, or the library's extents); warm-up 8 steps, 40 timed steps (device
events), median step, misses per step, miss bandwidth = misses x 656 B / time; the
last step's rows are checked byte for byte. Copy limits: one bulk copy each way, and
a gather of random 656 B rows from a 1 GiB host pool with the planned-copy kernel.
--quick (the default on a CPU) shrinks everything so the torch reference finishes in
seconds; its numbers are CPU numbers, not comparable with the GPU limits.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="SW-1 swap-in benchmark and copy-limit probes, against the measured limits",
        description="Run SW-1 and the copy-limit micro-benchmarks on this device; print a\n"
        "table against DESIGN.md's measured limits and targets; write JSON and a PNG.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default=None,
                        help="backend or device, e.g. cpu, cuda:0 (default: the best here)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="quick", action="store_true", default=None,
                      help="reduced sizes (the default on a CPU)")
    size.add_argument("--full", dest="quick", action="store_false", default=None,
                      help="DESIGN.md's sizes (the default on an accelerator)")
    parser.add_argument("--only", choices=("sw1", "copy"), default=None,
                        help="run one part only (default: both)")
    sw1 = parser.add_argument_group("SW-1 (defaults from --quick/--full)")
    sw1.add_argument("--batches", type=out.positive_int, nargs="+", default=None)
    sw1.add_argument("--churns", type=out.fraction, nargs="+", default=None)
    sw1.add_argument("--layouts", choices=("scattered", "extents"), nargs="+",
                     default=["scattered", "extents"])
    sw1.add_argument("--seq-len", type=out.positive_int, default=None, metavar="TOKENS")
    sw1.add_argument("--top-k", type=out.positive_int, default=2048)
    sw1.add_argument("--hot-buffer", type=out.positive_int, default=None, metavar="SLOTS",
                     help="(default: 2 x top-k)")
    sw1.add_argument("--warmup", type=out.non_negative_int, default=None)
    sw1.add_argument("--steps", type=out.positive_int, default=None)
    sw1.add_argument("--seed", type=out.seed, default=0)
    sw1.add_argument("--residency-map", choices=RESIDENCY_MAPS, default="host_row",
                     help="what the hot-slot map is keyed by (config residency_map; default: "
                          "%(default)s)")
    copy = parser.add_argument_group("copy limits")
    copy.add_argument("--bulk-mib", type=out.positive_int, default=None)
    copy.add_argument("--gather-pool-mib", type=out.positive_int, default=None)
    copy.add_argument("--gather-rows", type=out.positive_int, nargs="+", default=None)
    output = parser.add_argument_group("output")
    output.add_argument("--output", metavar="JSON", default=None,
                        help="where to write the JSON (default: hisparse-bench-<backend>.json)")
    output.add_argument("--plot", metavar="PNG", default=None,
                        help="where to write the PNG (default: hisparse-bench-<backend>.png "
                        "when matplotlib is installed)")
    output.add_argument("--json", action="store_true", help="print JSON instead of tables")
    output.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    parser.set_defaults(handler=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.parser
    pyplot: Any = None
    if args.plot:
        pyplot = out.import_pyplot()
        if isinstance(pyplot, str):
            return out.fail("bench", pyplot)
    from hisparse import benchmarking
    from hisparse.errors import HisparseError

    backend = out.backend_for_device_argument(parser, args.device)
    on_cpu = backend.torch_device_type == "cpu"
    quick = on_cpu if args.quick is None else args.quick
    preset = QUICK if quick else FULL
    pick = {key: getattr(args, key) if getattr(args, key, None) is not None else value
            for key, value in preset.items()}
    sizes = benchmarking.SW1Sizes(
        seq_len=pick["seq_len"], top_k=args.top_k, hot_slots=args.hot_buffer or 2 * args.top_k,
        warmup_steps=pick["warmup"], timed_steps=pick["steps"],
    )
    try:
        sizes.check()
    except HisparseError as exc:
        parser.error(f"argument --seq-len/--top-k/--hot-buffer: {exc}")
    pool_rows = (pick["gather_pool_mib"] << 20) // sizes.row_bytes
    if args.only != "sw1" and max(pick["gather_rows"]) > pool_rows:
        parser.error(f"argument --gather-rows: {max(pick['gather_rows'])} rows do not fit a "
                     f"{pick['gather_pool_mib']} MiB pool ({pool_rows} rows of "
                     f"{sizes.row_bytes} B); gather fewer rows or raise --gather-pool-mib")
    json_path = args.output or f"hisparse-bench-{backend.name}.json"
    for option, path in (("--output", json_path), ("--plot", args.plot)):
        if path:
            out.check_writable(parser, option, path)
    _, kernel_name = benchmarking.swap_in_kernel(backend)

    cells_total = 0 if args.only == "copy" else (
        len(pick["batches"]) * len(pick["churns"]) * len(args.layouts))
    progress = out.Progress(cells_total + (0 if args.only == "sw1" else 2), "bench",
                            enabled=not args.no_progress)
    cells: list[Any] = []
    copies: list[Any] = []
    try:
        with progress:
            if args.only != "copy":
                cells = benchmarking.run_sw1(
                    backend, pick["batches"], pick["churns"], args.layouts, sizes, args.seed,
                    on_cell=lambda _cell: progress.update(), residency_map=args.residency_map,
                )
            if args.only != "sw1":
                copies = benchmarking.bulk_copies(backend, pick["bulk_mib"] << 20)
                progress.update()
                copies += benchmarking.scattered_gather(
                    backend, pick["gather_pool_mib"] << 20, pick["gather_rows"], seed=args.seed)
                progress.update()
    except HisparseError as exc:
        return out.fail("bench", str(exc).replace("\n", " "))

    document = to_document(backend, quick, kernel_name, sizes, cells, copies)
    out.write_json(json_path, document)
    if args.json:
        out.emit_json(document)
    else:
        print(render(document))
    plot_path = args.plot
    if plot_path is None:
        pyplot = out.import_pyplot()
        plot_path = None if isinstance(pyplot, str) else f"hisparse-bench-{backend.name}.png"
    print(f"wrote {json_path}", file=sys.stderr)
    if plot_path is not None:
        plot(pyplot, document, plot_path)
        print(f"wrote {plot_path}", file=sys.stderr)
    else:
        print("no PNG: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return 0


def sw1_target(cell: Any, on_cpu: bool, sizes: Any) -> tuple[str, bool | None]:
    """DESIGN.md's target for this cell, and whether it was met (None on a CPU, untargeted, or
    at other sizes than SW-1's: the targets and SGLang's times hold for that workload only)."""
    target, met = "", None
    if cell.churn == 0 and cell.batch == 128:
        target, met = "< 15 us (miss-free)", cell.step_seconds < 15e-6
    elif cell.layout == "scattered" and cell.batch == 1 and cell.churn == 1.0:
        target = "<= 85.7 us (3x SGLang's 257 us)"
        met = cell.step_seconds <= SGLANG_FULL_MISS_B1_SECONDS / 3
    elif cell.layout == "scattered" and cell.batch == 128 and cell.churn == 0.2:
        target, met = "< 1.36 ms (SGLang)", cell.step_seconds < SGLANG_B128_CHURN02_SECONDS
    elif cell.layout == "extents" and cell.batch >= 64 and cell.churn >= 0.2:
        rate = cell.miss_bytes_per_second or 0.0
        target, met = ">= 44 GB/s", rate >= 44e9
    return target, (None if on_cpu or not target or not is_sw1_workload(sizes) else met)


def is_sw1_workload(sizes: Any) -> bool:
    """Whether `sizes` is SW-1's workload (step counts aside: they only sharpen the median)."""
    from hisparse.benchmarking import SW1Sizes

    sw1 = SW1Sizes()
    return all(getattr(sizes, name) == getattr(sw1, name) for name in SW1_SHAPE)


def to_document(backend: Any, quick: bool, kernel: str, sizes: Any, cells: list[Any],
                copies: list[Any]) -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    on_cpu = backend.torch_device_type == "cpu"
    sw1 = []
    for cell in cells:
        target, met = sw1_target(cell, on_cpu, sizes)
        sw1.append({**cell.to_dict(), "target": target or None, "target_met": met})
    limits = []
    for result in copies:
        measured = COPY_LIMITS.get((result.name, result.rows))
        limits.append({**result.to_dict(), "h200_measured_limit": measured})
    return {
        "schema_version": out.JSON_SCHEMA_VERSION,
        "command": "bench",
        "backend": backend.name,
        "device": str(backend.device()),
        "device_names": backend.device_names(),
        "versions": {"torch": torch.__version__, "triton": triton_version},
        "quick": quick,
        "cpu_numbers": on_cpu,
        "swap_in_kernel": kernel,
        "command_line": " ".join(["hisparse", *sys.argv[1:]]),
        "timing": "; ".join(sorted({TIMING_NOTES[cell.timing] for cell in cells}))
                  or None,
        "sw1": {"sizes": dataclasses.asdict(sizes), "cells": sw1},
        "copy_limits": limits,
    }


# Where the backend captures graphs (CUDA, ROCm) each step is a graph replay queued behind a
# device sleep: device time, what a graph-replaying serving loop sees and what the targets
# compare (benchmarks/swap_in.py runs the same cells). Elsewhere each step is launched eagerly,
# so the numbers include launch latency and the Python checks of the call.
TIMING_NOTES = {
    "graph replay": "each step a graph replay timed with device events from when the device "
                    "reaches it, after a flush of the device caches",
    "eager": "each step launched eagerly and timed alone (device events on an accelerator, "
             "wall time on a CPU): includes launch latency",
}


def render(document: dict[str, Any]) -> str:
    lines = [f"hisparse bench on {document['device']} ({document['backend']} backend"
             + (f": {', '.join(document['device_names'])}" if document["device_names"] else "")
             + f"); swap-in kernel {document['swap_in_kernel']}"]
    if document["timing"]:
        lines.append(f"timing: {document['timing']}")
    if document["cpu_numbers"]:
        lines.append("CPU numbers: the torch reference on the host. The limits and targets are "
                     "an H200's; they are shown for reference, not compared.")
    elif document["sw1"]["cells"] and not is_sw1_workload(
            SimpleNamespace(**document["sw1"]["sizes"])):
        lines.append("Not SW-1's sizes (" + ", ".join(SW1_SHAPE) + "): the H200 targets are "
                     "shown for reference, not judged.")
    if document["quick"]:
        lines.append("--quick sizes: " + ", ".join(
            f"{k}={v}" for k, v in document["sw1"]["sizes"].items()))
    cells = document["sw1"]["cells"]
    if cells:
        rows = []
        for c in cells:
            met = {True: "yes", False: "NO", None: "-"}[c["target_met"]]
            rows.append((c["layout"], c["batch"], f"{c['churn']:g}",
                         out.format_seconds(c["step_seconds"]), f"{c['misses_per_step']:.0f}",
                         out.format_rate(c["miss_bytes_per_second"]),
                         "yes" if c["verified"] else "NO", c["target"] or "", met))
        lines += ["", "SW-1", out.render_table(
            ("layout", "batch", "churn", "step (median)", "misses/step", "miss bandwidth",
             "bytes ok", "target (H200)", "met"), rows)]
    if document["copy_limits"]:
        rows = [(r["name"], "" if r["rows"] is None else r["rows"],
                 out.format_bytes(r["num_bytes"]), out.format_seconds(r["seconds"]),
                 out.format_rate(r["bytes_per_second"]), r["h200_measured_limit"] or "")
                for r in document["copy_limits"]]
        lines += ["", "Copy limits", out.render_table(
            ("copy", "rows", "bytes", "time (median)", "rate", "H200 measured"), rows)]
    return "\n".join(lines)


def plot(pyplot: Any, document: dict[str, Any], path: str) -> str:
    figure, (sw1_axes, copy_axes) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[str, float], list[tuple[int, float]]] = {}
    for c in document["sw1"]["cells"]:
        if c["miss_bytes_per_second"]:
            series.setdefault((c["layout"], c["churn"]), []).append(
                (c["batch"], c["miss_bytes_per_second"] / 1e9))
    for (layout, churn), points in sorted(series.items()):
        batches, rates = zip(*sorted(points), strict=True)
        sw1_axes.plot(batches, rates, marker="o",
                      linestyle="-" if layout == "extents" else "--",
                      label=f"{layout}, churn {churn:g}")
    if not document["cpu_numbers"]:
        sw1_axes.axhline(44, color="grey", linewidth=0.8, label="target 44 GB/s (extents)")
    sw1_axes.set_xscale("log", base=2)
    sw1_axes.set_xlabel("batch")
    sw1_axes.set_ylabel("miss bandwidth (GB/s)")
    sw1_axes.set_title("SW-1 swap-in")
    sw1_axes.grid(True, alpha=0.3)
    if series:
        sw1_axes.legend(fontsize=7)
    names = [r["name"] + ("" if r["rows"] is None else f" {r['rows']}")
             for r in document["copy_limits"]]
    copy_axes.barh(names, [r["bytes_per_second"] / 1e9 for r in document["copy_limits"]])
    copy_axes.set_xlabel("GB/s")
    copy_axes.set_title("copy limits")
    suffix = " (CPU numbers)" if document["cpu_numbers"] else ""
    figure.suptitle(f"hisparse bench on {document['device']}{suffix}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path
