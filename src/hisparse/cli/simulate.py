"""`hisparse simulate`: decode steps on the real engine with a modelled top-k, measured."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from hisparse.cli import _output as out

# Sizes when the device is the CPU (the torch reference): a few seconds on a 2-core machine.
CPU_DEFAULTS = {"requests": 4, "layers": 2, "steps": 24, "warmup": 2, "context": 16384}
# Sizes on an accelerator: SW-1's context and warm-up, a host pool of about 11 GB.
DEVICE_DEFAULTS = {"requests": 32, "layers": 8, "steps": 128, "warmup": 8, "context": 32768}
# TraceModel's defaults, repeated so `hisparse --help` need not import numpy (a test keeps
# them equal).
TRACE_DEFAULTS = {"carryover": 0.6, "recency_bias": 0.3, "recent_window": 4096,
                  "heavy_hitters": None, "heavy_churn": 0.0}
CONFIG_FLAGS = {
    "kv_dtype": "--kv-dtype",
    "num_layers": "--layers",
    "top_k": "--top-k",
    "hot_slots": "--hot-slots",
    "index_group_size": "--index-group-size",
}

EPILOG = """\
example:
  hisparse simulate --preset deepseek-v3.2 --requests 4 --layers 2 --steps 24 \\
      --context 16384 --carryover 0.6 --seed 1 --json

Each step, every request's top-k (per index group) is drawn by the trace model:
  the newest token, --heavy-hitters persistent positions (each replaced with
  probability --heavy-churn per step), then positions carried over from the previous
  step's top-k until --carryover of it repeats, then fresh positions outside the
  previous top-k: a --recency-bias share of them from the newest --recent-window
  tokens, the rest uniform. The default carry-over 0.6 follows published traces
  (GVR, arXiv 2604.22312: about 60% of DeepSeek-V3.2's top-k kept from one step to
  the next; ShadowKV reports about 60% too).
Timing: all layers' swap_in calls of a step, between two device synchronisations.
Where the backend has the skip-IO probe, the same trace is replayed without moving
bytes to split that time into planning and copy (--no-split skips the replay).
Defaults differ by device: on the CPU {cpu}; elsewhere {device}.""".format(
    cpu=", ".join(f"--{k} {v}" for k, v in CPU_DEFAULTS.items()),
    device=", ".join(f"--{k} {v}" for k, v in DEVICE_DEFAULTS.items()),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="decode steps on the real engine with a modelled top-k: hit rate, traffic, time",
        description="Run N requests x L layers x T decode steps through HiSparseCache on a\n"
        "device, with top-k positions from a trace model; report hit rate, misses and bytes\n"
        "per step, time per step, and peak host and device memory.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_argument_group("device and cache")
    where.add_argument("--device", default=None,
                       help="backend or device, e.g. cpu, cuda, cuda:1 (default: the best here)")
    out.add_config_options(where, "row size, top-k, hot buffer and index groups")
    where.add_argument("--kv-dtype", choices=("fp8", "bf16"), default=None,
                       help="KV dtype (default: the config's)")
    where.add_argument("--top-k", type=out.positive_int, default=None,
                       help="top-k entries per step (default: the config's)")
    where.add_argument("--hot-slots", "--hot-buffer", dest="hot_slots",
                       type=out.positive_int, default=None, metavar="SLOTS",
                       help=out.HOT_BUFFER_HELP)
    where.add_argument("--index-group-size", type=out.positive_int, default=None,
                       help="layers sharing one top-k (default: the config's)")

    size = parser.add_argument_group("workload (defaults depend on the device, see below)")
    size.add_argument("--requests", type=out.positive_int, default=None,
                      help="concurrent requests, all in every step")
    size.add_argument("--layers", type=out.positive_int, default=None,
                      help="KV layers to simulate (default: the config's, at most 2 on a CPU "
                      "and 8 elsewhere, or one index group if that is more)")
    size.add_argument("--steps", type=out.positive_int, default=None, help="decode steps")
    size.add_argument("--warmup", type=out.non_negative_int, default=None,
                      help="first steps left out of the summary (compilation, cold LRU)")
    size.add_argument("--context", type=out.positive_int, default=None, metavar="TOKENS",
                      help="prompt length of every request")

    trace = parser.add_argument_group("top-k trace model")
    trace.add_argument("--carryover", type=out.fraction, default=TRACE_DEFAULTS["carryover"],
                       help="share of a step's top-k repeated from the previous step "
                       "(default: %(default)s)")
    trace.add_argument("--recency-bias", type=out.fraction,
                       default=TRACE_DEFAULTS["recency_bias"],
                       help="share of fresh picks from the recent window (default: %(default)s)")
    trace.add_argument("--recent-window", type=out.positive_int,
                       default=TRACE_DEFAULTS["recent_window"], metavar="TOKENS",
                       help="the recent window (default: %(default)s)")
    trace.add_argument("--heavy-hitters", type=out.non_negative_int,
                       default=TRACE_DEFAULTS["heavy_hitters"],
                       help="positions chosen in every step (default: top-k / 32)")
    trace.add_argument("--heavy-churn", type=out.fraction, default=TRACE_DEFAULTS["heavy_churn"],
                       help="chance per step that a heavy hitter is replaced "
                       "(default: %(default)s)")
    trace.add_argument("--seed", type=out.seed, default=0, help="trace and KV seed (default: 0)")

    output = parser.add_argument_group("output")
    output.add_argument("--no-split", action="store_true",
                        help="skip the skip-IO replay (planning/copy split)")
    output.add_argument("--json", action="store_true", help="print JSON instead of a table")
    output.add_argument("--output", metavar="JSON", default=None,
                        help="also write the JSON document to this file")
    output.add_argument("--plot", metavar="PNG", default=None,
                        help="write hit rate and traffic per step to this PNG (needs matplotlib)")
    output.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(handler=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    from hisparse.errors import ConfigError, HisparseError
    from hisparse.tools.simulation import TraceModel, Workload, simulate

    parser: argparse.ArgumentParser = args.parser
    if args.plot:
        pyplot = out.import_pyplot()
        if isinstance(pyplot, str):
            return out.fail("simulate", pyplot)
    if args.output:
        out.check_writable(parser, "--output", args.output)
    if args.plot:
        out.check_plot_path(parser, args.plot)
    backend = out.backend_for_device_argument(parser, args.device)
    defaults = CPU_DEFAULTS if backend.torch_device_type == "cpu" else DEVICE_DEFAULTS
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else value
             for key, value in defaults.items()}
    config = out.load_config(
        parser, args, CONFIG_FLAGS, kv_dtype=args.kv_dtype,
        top_k=args.top_k, hot_slots=args.hot_slots,
        index_group_size=args.index_group_size,
    )
    # --layers takes the model's first layers (its index schedule with them); the default
    # caps them, but ends on a whole index group (GLM-5.2 shares a top-k over 4 layers): a
    # group cut short is no longer the preset's model.
    cap = config.index_schedule.whole_groups(sizes["layers"])
    if args.layers is not None:
        try:
            config = config.with_num_layers(args.layers)
        except ConfigError as exc:
            parser.error(out.options_in_config_problems(
                exc.problems, {**CONFIG_FLAGS}, {"num_layers": args.layers}, "--layers"))
    elif config.num_layers > cap:
        config = config.with_num_layers(cap)
    if args.heavy_hitters is not None and args.heavy_hitters > config.top_k:
        parser.error(f"argument --heavy-hitters: {args.heavy_hitters} is more than top-k "
                     f"{config.top_k}; use at most top-k")
    if sizes["warmup"] >= sizes["steps"]:
        parser.error(f"argument --warmup: {sizes['warmup']} leaves none of --steps "
                     f"{sizes['steps']} to measure; use fewer than --steps")
    workload = Workload(
        requests=sizes["requests"],
        context_tokens=sizes["context"],
        steps=sizes["steps"],
        warmup_steps=sizes["warmup"],
        trace=TraceModel(
            top_k=config.top_k, carryover=args.carryover, heavy_hitters=args.heavy_hitters,
            heavy_churn=args.heavy_churn, recency_bias=args.recency_bias,
            recent_window=args.recent_window,
        ),
        seed=args.seed,
    )
    check_workload_fits(parser, config, workload)
    # One count per pass, each to --steps: the summary's steps are the first pass's; the
    # skip-IO replay (the planning/copy split) decodes the same steps again without copying.
    progress = PassProgress(workload.steps, enabled=not args.no_progress)
    try:
        with progress:
            result = simulate(config, workload, device=args.device or backend,
                              measure_planning=not args.no_split, on_step=progress.update,
                              on_pass=progress.start)
    except HisparseError as exc:
        return out.fail("simulate", in_option_terms(str(exc).replace("\n", " ")))

    document = {"schema_version": out.JSON_SCHEMA_VERSION, "command": "simulate",
                **result.to_dict()}
    if args.output:
        out.write_json(args.output, document)
    if args.json:
        out.emit_json(document)
    else:
        print(render(result))
    if args.plot:
        print(f"wrote {plot(pyplot, result, args.plot)}", file=sys.stderr)
    return 0


def check_workload_fits(parser: argparse.ArgumentParser, config: Any, workload: Any) -> None:
    """A usage error naming --context and --requests if the cache sized for the workload
    (`sim_config`) is beyond what a cache can address."""
    from hisparse.errors import ConfigError
    from hisparse.tools.simulation import sim_config

    try:
        sim_config(config, workload)
    except ConfigError as exc:
        key, _, problem = exc.problems[0].partition(": ")
        problem = problem.split("; ")[0]
        parser.error(
            f"argument --context/--requests: {workload.requests} requests of "
            f"{workload.context_tokens} tokens (+ {workload.steps} decode steps) make a cache "
            f"beyond its limits ({key.replace('_', ' ')}: {problem}); lower --context or "
            "--requests")


# What the engine's messages call the values simulate derives from its options.
ENGINE_ADVICE = {
    "lower host_pool_tokens (rows per layer)": "lower --layers, --requests or --context",
    "host_pool_tokens": "--requests x (--context + --steps)",
    "max_requests": "--requests",
    "num_layers": "--layers",
    "hot_slots": "--hot-slots",
    "max_seq_len": "--context + --steps",
    "max_draft_tokens": "the config's max_draft_tokens",
}


def in_option_terms(message: str) -> str:
    """An engine error's message with the config keys simulate sets from its options named
    by those options."""
    for phrase, options in ENGINE_ADVICE.items():
        message = re.sub(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", options, message)
    return message


class PassProgress:
    """A progress count of `steps` per pass of `simulate` ("simulate: decode steps 24/24",
    then "simulate: skip-IO replay 24/24"), never one count over both passes."""

    def __init__(self, steps: int, enabled: bool) -> None:
        self.steps = steps
        self.enabled = enabled
        self._current: out.Progress | None = None

    def start(self, name: str) -> None:
        self.close()
        self._current = out.Progress(self.steps, f"simulate: {name}", enabled=self.enabled)

    def update(self) -> None:
        if self._current is not None:
            self._current.update()

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None

    def __enter__(self) -> PassProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def render(result: Any) -> str:
    summary = result.summary()
    workload = result.workload
    config = result.config
    hot_slots = config["hot_slots"]
    header = (
        f"{config['model']} on {result.device} ({result.backend} backend): "
        f"{workload.requests} requests x {config['num_layers']} layers x {workload.steps} steps "
        f"({workload.warmup_steps} warm-up), context {workload.context_tokens}, top-k "
        f"{config['top_k']}, hot buffer {hot_slots}+1, "
        f"{config['row_bytes']} B rows\n"
        f"trace: carry-over {workload.trace.carryover:g}, {workload.trace.heavy_hitters} heavy "
        f"hitters, recency bias {workload.trace.recency_bias:g} over "
        f"{workload.trace.recent_window} tokens, seed {workload.seed}"
    )
    if result.backend == "cpu":
        header += ("\nCPU numbers: the torch reference swap-in, not a GPU kernel; the "
                   "device tensors live in host memory.")
    rate = summary["host_to_device_bytes_per_second"]
    rows = [
        ("hit rate", f"{summary['hit_rate']:.4f}"),
        ("measured churn", "-" if summary["measured_churn"] is None
         else f"{summary['measured_churn']:.3f}"),
        ("misses per step", f"{summary['misses_per_step']:.1f}"),
        ("H2D bytes per step", out.format_bytes(summary["bytes_host_to_device_per_step"])),
        *((label, out.format_spread(summary[f"{name}_seconds_per_step"],
                                    summary[f"{name}_seconds_p10"],
                                    summary[f"{name}_seconds_p90"]))
          for label, name in (("swap-in time per step (median)", "swap_in"),
                              ("  planning", "planning"), ("  copy", "copy"))),
        ("H2D rate during swap-in", out.format_rate(rate)),
        ("host pool", out.format_bytes(summary["host_pool_bytes"])),
        ("peak host RSS", out.format_bytes(summary["peak_host_rss_bytes"])),
        ("peak device memory", out.format_bytes(summary["peak_device_bytes"])),
    ]
    table = out.render_table(("metric", "value"), rows)
    warning = out.noise_warning([(summary["swap_in_seconds_p10"],
                                  summary["swap_in_seconds_p90"])])
    return (f"{header}\n\n{table}\nplanning/copy split: {result.split_note}"
            + (f"\n{warning}" if warning else ""))


def plot(pyplot: Any, result: Any, path: str) -> str:
    figure = draw(pyplot, result)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path


def draw(pyplot: Any, result: Any) -> Any:
    """The figure `--plot` saves: hit rate and traffic per step, the warm-up steps shaded."""
    steps = [s.step for s in result.steps]
    figure, (hit_axes, traffic_axes) = pyplot.subplots(2, 1, figsize=(6.4, 5.6), sharex=True)
    hit_axes.plot(steps, [s.hit_rate for s in result.steps])
    hit_axes.set_ylabel("hit rate")
    hit_axes.set_ylim(0, 1.02)
    hit_axes.grid(True, alpha=0.3)
    traffic_axes.plot(steps, [s.bytes_host_to_device / 2**20 for s in result.steps])
    traffic_axes.set_ylabel("host-to-device MiB per step")
    traffic_axes.set_xlabel("decode step")
    traffic_axes.grid(True, alpha=0.3)
    warmup = result.workload.warmup_steps
    for axes in (hit_axes, traffic_axes):
        if warmup:
            axes.axvspan(-0.5, warmup - 0.5, color="grey", alpha=0.15,
                         label=f"warm-up ({warmup} steps, left out of the summary)")
    if warmup:
        hit_axes.legend(fontsize=7, loc="lower right")
    hit_axes.set_title(f"{result.config['model']} on {result.device}: "
                       f"carry-over {result.workload.trace.carryover:g}")
    figure.tight_layout()
    return figure
