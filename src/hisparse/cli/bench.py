"""`hisparse bench`: SW-1 and the copy-limit probes on this device, against the limits and
targets measured on an NVIDIA H200."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from types import SimpleNamespace
from typing import Any

from hisparse.cli import _output as out
from hisparse.layout.widths import RESIDENCY_MAPS

FULL = {"batches": [1, 16, 64, 128], "churns": [0.0, 0.05, 0.2, 1.0], "seq_len": 32768,
        "warmup": 8, "steps": 40, "gather_pool_mib": 1024, "gather_rows": [2048, 16384, 131072],
        "bulk_mib": 1024}
# On a CPU the torch reference runs SW-1 at about 10-100 ms a step: a few seconds in all.
QUICK = {"batches": [1, 4], "churns": [0.0, 0.2, 1.0], "seq_len": 16384, "warmup": 2,
         "steps": 5, "gather_pool_mib": 64, "gather_rows": [2048, 16384], "bulk_mib": 64}


def defaults(key: str) -> str:
    """The help text's defaults of a size option, from QUICK and FULL."""
    def text(value: object) -> str:
        return " ".join(f"{v:g}" for v in value) if isinstance(value, list) else str(value)

    return f" (--quick: {text(QUICK[key])}; --full: {text(FULL[key])})"


@dataclasses.dataclass(frozen=True)
class Reference:
    """A copy limit measured on an NVIDIA H200 (PCIe Gen5 x16)."""

    quoted: str  # as it was measured (one of them a time)
    low_bytes_per_second: float  # the same as a rate range, the unit of the "rate" column
    high_bytes_per_second: float
    note: str = ""


# The 2048-row gather was measured as a time: 35-56 us for 2048 rows of 656 B.
GATHER_2048_BYTES = 2048 * 656
COPY_LIMITS = {
    ("bulk host-to-device", None): Reference("52-55 GB/s", 52e9, 55e9),
    ("bulk device-to-host", None): Reference("55 GB/s", 55e9, 55e9),
    ("gather", 2048): Reference("35-56 us", GATHER_2048_BYTES / 56e-6,
                                GATHER_2048_BYTES / 35e-6, note="measured as 35-56 us"),
    ("gather", 16384): Reference("41-47 GB/s", 41e9, 47e9),
    ("gather", 131072): Reference("46-48 GB/s (local rows)", 46e9, 48e9, note="local rows"),
}
REFERENCE_ROW_BYTES = 656  # the gathers were measured with 656 B rows; other rows: no reference
# What makes a run SW-1 for the targets: --quick, --seq-len, --top-k or --hot-slots change it.
SW1_SHAPE = ("seq_len", "top_k", "hot_slots", "row_bytes", "extent_tokens")
SGLANG_FULL_MISS_B1_SECONDS = 257e-6  # SGLang 0.5.23 fused swap-in, SW-1 scattered, B=1
SGLANG_B128_CHURN02_SECONDS = 1.36e-3  # same kernel, B=128, churn 0.2

EPILOG = """\
example:
  hisparse bench --device cuda --output benchmarks/results/bench-h200.json \\
      --plot bench-h200.png

SW-1, the swap-in workload: one layer, 656 B rows, top-k 2048, hot buffer 4096+1,
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
        "table against the limits and targets measured on an H200; --output writes JSON,\n"
        "--plot a PNG.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default=None,
                        help="backend or device, e.g. cpu, cuda:0 (default: the best here)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="quick", action="store_true", default=None,
                      help="reduced sizes (the default on a CPU)")
    size.add_argument("--full", dest="quick", action="store_false", default=None,
                      help="SW-1's full sizes, those of the H200 targets (the default on an "
                      "accelerator)")
    parser.add_argument("--only", choices=("sw1", "copy"), default=None,
                        help="run one part only (default: both)")
    sw1 = parser.add_argument_group("SW-1 (defaults from --quick/--full)")
    sw1.add_argument("--batches", type=out.positive_int, nargs="+", default=None,
                     metavar="B", help="requests per step, one cell each" + defaults("batches"))
    sw1.add_argument("--churns", type=out.fraction, nargs="+", default=None, metavar="C",
                     help="share of a step's top-k that is new, one cell each" + defaults("churns"))
    sw1.add_argument("--layouts", choices=("scattered", "extents"), nargs="+",
                     default=["scattered", "extents"],
                     help="host layout of the requests' rows: scattered rows, or the "
                     "library's extents (default: both)")
    sw1.add_argument("--config", metavar="FILE", default=None,
                     help="take top-k, hot buffer, row bytes, extent tokens and residency map "
                     "from this YAML config instead of SW-1's (a workload other than SW-1: "
                     "the targets are shown, not judged)")
    sw1.add_argument("--seq-len", type=out.positive_int, default=None, metavar="TOKENS",
                     help="tokens of every request in the host pool" + defaults("seq_len"))
    sw1.add_argument("--top-k", type=out.positive_int, default=None,
                     help="top-k entries per step (default: --config's, else SW-1's 2048)")
    sw1.add_argument("--hot-slots", "--hot-buffer", dest="hot_slots",
                     type=out.positive_int, default=None, metavar="SLOTS",
                     help="LRU hot slots per request (default: --config's where it sets "
                     "one, else 2 x top-k)")
    sw1.add_argument("--warmup", type=out.non_negative_int, default=None,
                     help="untimed steps before the timed ones" + defaults("warmup"))
    sw1.add_argument("--steps", type=out.positive_int, default=None,
                     help="timed steps per cell; the median is reported" + defaults("steps"))
    sw1.add_argument("--seed", type=out.seed, default=0,
                     help="seed of the top-k traces and the KV bytes (default: 0)")
    sw1.add_argument("--residency-map", choices=RESIDENCY_MAPS, default=None,
                     help="what the hot-slot map is keyed by (config residency_map; default: "
                          "--config's, else host_row)")
    copy = parser.add_argument_group("copy limits")
    copy.add_argument("--bulk-mib", type=out.positive_int, default=None, metavar="MIB",
                      help="size of the bulk copy each way" + defaults("bulk_mib"))
    copy.add_argument("--gather-pool-mib", type=out.positive_int, default=None,
                      metavar="MIB", help="host pool the gather reads random rows from"
                      + defaults("gather_pool_mib"))
    copy.add_argument("--gather-rows", type=out.positive_int, nargs="+", default=None,
                      metavar="ROWS", help="rows per gather, one measurement each"
                      + defaults("gather_rows"))
    output = parser.add_argument_group("output")
    output.add_argument("--output", metavar="JSON", default=None,
                        help="write the JSON document to this file (default: none written)")
    output.add_argument("--plot", metavar="PNG", default=None,
                        help="draw SW-1's miss bandwidth and the copy limits, with the H200's "
                        "reference values, to this PNG (needs matplotlib; default: none)")
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
    from hisparse.errors import HisparseError
    from hisparse.tools import benchmarking

    backend = out.backend_for_device_argument(parser, args.device)
    on_cpu = backend.torch_device_type == "cpu"
    quick = on_cpu if args.quick is None else args.quick
    preset = QUICK if quick else FULL
    pick = {key: getattr(args, key) if getattr(args, key, None) is not None else value
            for key, value in preset.items()}
    shape, residency_map = sw1_shape(parser, args)
    sizes = benchmarking.SW1Sizes(
        seq_len=pick["seq_len"], warmup_steps=pick["warmup"], timed_steps=pick["steps"], **shape,
    )
    try:
        sizes.check()
    except HisparseError as exc:
        given = "--config/" if args.config else ""
        parser.error(f"argument {given}--seq-len/--top-k/--hot-slots: {exc}")
    pool_rows = (pick["gather_pool_mib"] << 20) // sizes.row_bytes
    if args.only != "sw1" and max(pick["gather_rows"]) > pool_rows:
        parser.error(f"argument --gather-rows: {max(pick['gather_rows'])} rows do not fit a "
                     f"{pick['gather_pool_mib']} MiB pool ({pool_rows} rows of "
                     f"{sizes.row_bytes} B); gather fewer rows or raise --gather-pool-mib")
    if args.only != "sw1":
        check_copy_buffers(parser, pick, on_cpu)
    if args.output:
        out.check_writable(parser, "--output", args.output)
    if args.plot:
        out.check_plot_path(parser, args.plot)
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
                    on_cell=lambda _cell: progress.update(), residency_map=residency_map,
                )
            if args.only != "sw1":
                copies = benchmarking.bulk_copies(backend, pick["bulk_mib"] << 20)
                progress.update()
                copies += benchmarking.scattered_gather(
                    backend, pick["gather_pool_mib"] << 20, pick["gather_rows"],
                    row_bytes=sizes.row_bytes, seed=args.seed)
                progress.update()
    except HisparseError as exc:  # the host pools here are sized by SW-1's options
        return out.fail("bench", str(exc).replace("\n", " ").replace(
            "lower host_pool_tokens", "lower --batches or --seq-len"))

    document = to_document(backend, quick, kernel_name, sizes, cells, copies)
    # Files only where asked for: a run writes nothing into the current directory unasked.
    if args.output:
        print(f"wrote {out.write_json(args.output, document)}", file=sys.stderr)
    if args.json:
        out.emit_json(document)
    else:
        print(render(document))
    if args.plot:
        print(f"wrote {plot(pyplot, document, args.plot)}", file=sys.stderr)
    return 0


def check_copy_buffers(parser: argparse.ArgumentParser, pick: dict[str, Any],
                       on_cpu: bool) -> None:
    """A usage error naming the option if a copy-limit buffer needs more host memory than
    is available (on a CPU its device side is host memory too)."""
    from hisparse.backends import _host_memory

    available = _host_memory.available_host_bytes()
    for option, key in (("--bulk-mib", "bulk_mib"), ("--gather-pool-mib", "gather_pool_mib")):
        needs = (pick[key] << 20) * (2 if on_cpu and key == "bulk_mib" else 1)
        if available is not None and needs > available:
            side = " (a host buffer and, on a CPU, its device copy)" if key == "bulk_mib" else ""
            parser.error(f"argument {option}: {pick[key]} MiB needs {out.format_bytes(needs)} "
                         f"of host memory{side}, but {out.format_bytes(available)} is "
                         f"available; lower {option}")


# The --config keys bench takes, and the options that set the same values.
CONFIG_FLAGS = {"top_k": "--top-k", "hot_slots": "--hot-slots",
                "residency_map": "--residency-map"}


def sw1_shape(parser: argparse.ArgumentParser,
              args: argparse.Namespace) -> tuple[dict[str, int], str]:
    """SW1Sizes' shape fields and the residency map: SW-1's, or `--config`'s, with the
    options on top (the same hot-buffer rule as plan and simulate)."""
    if args.config is None:
        top_k = args.top_k or 2048
        return ({"top_k": top_k, "hot_slots": args.hot_slots or 2 * top_k},
                args.residency_map or "host_row")
    config = out.load_config(parser, args, CONFIG_FLAGS, top_k=args.top_k,
                             hot_slots=args.hot_slots,
                             residency_map=args.residency_map)
    return ({"top_k": config.top_k, "hot_slots": config.hot_slots,
             "row_bytes": config.row_bytes, "extent_tokens": config.extent_tokens},
            config.residency_map)


def sw1_target(cell: Any, on_cpu: bool, sizes: Any) -> tuple[str, bool | None]:
    """The H200 target for this cell, and whether it was met (None on a CPU, untargeted, or
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
    from hisparse.tools.benchmarking import SW1Sizes

    sw1 = SW1Sizes()
    return all(getattr(sizes, name) == getattr(sw1, name) for name in SW1_SHAPE)


def to_document(backend: Any, quick: bool, kernel: str, sizes: Any, cells: list[Any],
                copies: list[Any]) -> dict[str, Any]:
    import torch

    from hisparse.backends.base import device_names

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
        reference = COPY_LIMITS.get((result.name, result.rows))
        if result.rows is not None and result.num_bytes != result.rows * REFERENCE_ROW_BYTES:
            reference = None
        limits.append({**result.to_dict(), **(
            {"h200_measured_limit": None, "h200_limit_bytes_per_second": None,
             "h200_limit_note": None} if reference is None else
            {"h200_measured_limit": reference.quoted,
             "h200_limit_bytes_per_second": [reference.low_bytes_per_second,
                                             reference.high_bytes_per_second],
             "h200_limit_note": reference.note or None})})
    return {
        "schema_version": out.JSON_SCHEMA_VERSION,
        "command": "bench",
        "backend": backend.name,
        "device": str(backend.device()),
        "device_names": device_names(backend),
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
                         out.format_spread(c["step_seconds"], c["p10_seconds"],
                                           c["p90_seconds"]), f"{c['misses_per_step']:.0f}",
                         out.format_rate(c["miss_bytes_per_second"]),
                         "yes" if c["verified"] else "NO", c["target"] or "", met))
        lines += ["", "SW-1", out.render_table(
            ("layout", "batch", "churn", "step (median)", "misses/step", "miss bandwidth",
             "bytes ok", "target (H200)", "met"), rows)]
    if document["copy_limits"]:
        rows = [(r["name"], "" if r["rows"] is None else r["rows"],
                 out.format_bytes(r["num_bytes"]),
                 out.format_spread(r["seconds"], r["p10_seconds"], r["p90_seconds"]),
                 out.format_rate(r["bytes_per_second"]), reference_rate(r))
                for r in document["copy_limits"]]
        lines += ["", "Copy limits", out.render_table(
            ("copy", "rows", "bytes", "time (median)", "rate", "H200 measured rate"), rows)]
    warning = out.noise_warning(
        [(c["p10_seconds"], c["p90_seconds"]) for c in cells]
        + [(r["p10_seconds"], r["p90_seconds"]) for r in document["copy_limits"]])
    return "\n".join([*lines, *([warning] if warning else [])])


def reference_rate(row: dict[str, Any]) -> str:
    """The H200's measured range for a copy-limit row, always as a rate ("" without one)."""
    if not row.get("h200_limit_bytes_per_second"):
        return ""
    low, high = (value / 1e9 for value in row["h200_limit_bytes_per_second"])
    text = f"{low:.1f} GB/s" if low == high else f"{low:.1f}-{high:.1f} GB/s"
    return f"{text} ({row['h200_limit_note']})" if row.get("h200_limit_note") else text


# SW-1's one bandwidth target; the others are step times.
# Values spread over more than this factor are drawn on a log axis.
LOG_SPAN = 10
EXTENTS_TARGET_GBPS = 44


def plot(pyplot: Any, document: dict[str, Any], path: str) -> str:
    figure = draw(pyplot, document)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path


def draw(pyplot: Any, document: dict[str, Any]) -> Any:
    """The figure `--plot` saves: SW-1's miss bandwidth and the copy limits, each with the
    H200 reference values the tables show (the extents target, the measured copy limits)."""
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
    if document["sw1"]["cells"]:
        sw1_axes.axhline(EXTENTS_TARGET_GBPS, color="grey", linewidth=0.8,
                         label=f"H200 target {EXTENTS_TARGET_GBPS} GB/s (extents, B >= 64, "
                               "churn >= 0.2)")
        rates = [rate for points in series.values() for _, rate in points]
        if rates and LOG_SPAN * max(rates) < EXTENTS_TARGET_GBPS:
            # A CPU's rates are 1000x below the target: a log axis shows both.
            sw1_axes.set_yscale("log")
            sw1_axes.set_ylim(min(rates) / 2, EXTENTS_TARGET_GBPS * 2)
    sw1_axes.set_xscale("log", base=2)
    sw1_axes.set_xlabel("batch")
    sw1_axes.set_ylabel("miss bandwidth (GB/s)")
    sw1_axes.set_title("SW-1 swap-in")
    sw1_axes.grid(True, alpha=0.3)
    if document["sw1"]["cells"]:
        sw1_axes.legend(fontsize=7)
    else:
        sw1_axes.text(0.5, 0.5, "not run (--only copy)", ha="center", va="center",
                      transform=sw1_axes.transAxes)
    limits = document["copy_limits"]
    names = [r["name"] + ("" if r["rows"] is None else f" {r['rows']}") for r in limits]
    positions = list(range(len(limits)))
    copy_axes.barh(positions, [r["bytes_per_second"] / 1e9 for r in limits],
                   label="measured here")
    copy_axes.set_yticks(positions, names)
    referenced = [(y, r["h200_limit_bytes_per_second"]) for y, r in zip(positions, limits,
                                                                        strict=True)
                  if r.get("h200_limit_bytes_per_second")]
    if referenced:
        lows = [low / 1e9 for _, (low, _high) in referenced]
        highs = [high / 1e9 for _, (_low, high) in referenced]
        copy_axes.errorbar([(lo + hi) / 2 for lo, hi in zip(lows, highs, strict=True)],
                           [y for y, _ in referenced],
                           xerr=[[(hi - lo) / 2 for lo, hi in zip(lows, highs, strict=True)]] * 2,
                           fmt="none", ecolor="black", capsize=4, linewidth=1.5,
                           label="H200 measured")
    shown = [r["bytes_per_second"] / 1e9 for r in limits] + [
        value / 1e9 for _, pair in referenced for value in pair]
    if shown and max(shown) > LOG_SPAN * min(shown):
        copy_axes.set_xscale("log")
        copy_axes.set_xlim(min(shown) / 2, max(shown) * 2)
    if limits:
        copy_axes.legend(fontsize=7)
    copy_axes.set_xlabel("GB/s")
    copy_axes.set_title("copy limits")
    suffix = " (CPU numbers)" if document["cpu_numbers"] else ""
    figure.suptitle(f"hisparse bench on {document['device']}{suffix}")
    figure.tight_layout()
    return figure
