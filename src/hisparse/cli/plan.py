"""`hisparse plan`: how many concurrent requests fit on one GPU, with and without HiSparse."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hisparse.cli import _output as out
from hisparse.tools.planning import (
    DSA_INDEXER_KEY_BYTES,
    FORMULAS,
    GIB,
    ContextPlan,
    ModelShape,
    PlanSettings,
)

# The measured bulk pinned host-to-device rate of an H200 (52-55 GB/s measured).
H200_BULK_H2D_GBPS = 52.0
DEFAULT_CONTEXTS = (8192, 32768, 65536, 131072)
# Options that override a config key, so a rejected value is reported under its option.
CONFIG_FLAGS = {
    "kv_dtype": "--kv-dtype",
    "top_k": "--top-k",
    "hot_slots": "--hot-slots",
    "extent_tokens": "--extent-tokens",
    "index_group_size": "--index-group-size",
}

EPILOG = f"""\
example:
  hisparse plan --preset deepseek-v3.2 --gpu-mem-gib 140 --weights-gib 80 \\
      --context 32768 131072 --miss-rate 0.1 --plot plan.png

{FORMULAS}
The default miss rate (0.1) is a planning guess: published traces keep about 60% of
a step's top-k from the previous step, and a 2x LRU buffer catches more; measure
yours with `hisparse simulate`. Decimal GB/s for links, binary GiB for memory."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="concurrent requests per GPU with and without HiSparse, host pool and link traffic",
        description="Capacity plan for one GPU: how many concurrent requests fit with full\n"
        "device KV versus HiSparse hot buffers, the host memory the pool needs, and the\n"
        "host-to-device traffic of a decode step.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model")
    out.add_config_options(model, "the model's shape and the cache geometry")
    model.add_argument("--kv-dtype", choices=("fp8", "bf16"), default=None,
                       help="KV cache dtype; picks the row size (default: the config's, fp8 "
                       "in the shipped presets)")
    model.add_argument("--indexer-bytes", type=out.non_negative_int, default=None,
                       help="indexer key bytes per token per indexer, one per index group "
                       "(default: the config's, "
                       f"else {DSA_INDEXER_KEY_BYTES}, the DSA key of DeepSeek-V3.2 and GLM-5)")
    model.add_argument("--index-group-size", type=out.positive_int, default=None,
                       help="layers sharing one indexer (default: the config's)")

    budget = parser.add_argument_group("GPU and host budget")
    budget.add_argument("--gpu-mem-gib", type=out.positive_float, default=140.0,
                        help="memory of one GPU in GiB (default: %(default)s, one H200)")
    budget.add_argument("--weights-gib", type=out.non_negative_float, default=80.0,
                        help="model weights on this GPU in GiB (default: %(default)s, about "
                        "DeepSeek-V3.2 FP8 over 8 GPUs)")
    budget.add_argument("--reserve-gib", type=out.non_negative_float, default=10.0,
                        help="activations, graphs and allocator slack in GiB "
                        "(default: %(default)s)")
    budget.add_argument("--host-mem-gib", type=out.positive_float, default=None,
                        help="host memory the pool may use per GPU; caps the HiSparse "
                        "concurrency (default: unlimited)")
    budget.add_argument("--shared-prefix", type=out.non_negative_int, default=0,
                        metavar="TOKENS",
                        help="a prompt prefix (system prompt, chat history) that requests "
                        "share in the host pool: its whole extents are held once "
                        "(default: %(default)s, none)")
    budget.add_argument("--tp", type=out.positive_int, default=1, metavar="N",
                        help="tensor-parallel ranks per node holding the same requests: adds "
                        "host memory per node with a pool per rank and with one shared pool "
                        "(default: %(default)s)")
    budget.add_argument("--sharing-requests", type=out.positive_int, default=None,
                        metavar="N", help="how many of the requests share --shared-prefix "
                        "(default: all of them)")

    cache = parser.add_argument_group("cache geometry and traffic")
    cache.add_argument("--context", type=out.positive_int, nargs="+", default=None,
                       metavar="TOKENS", help="context lengths to plan for (default: "
                       f"{' '.join(map(str, DEFAULT_CONTEXTS))})")
    cache.add_argument("--requests", type=out.positive_int, default=None, metavar="N",
                       help="also ask: do N requests of each --context fit this GPU (and a "
                       "--config file's max_requests and host_pool_tokens)? prints the "
                       "max_requests, max_seq_len and host_pool_tokens a cache for them sets")
    cache.add_argument("--top-k", type=out.positive_int, default=None,
                       help="top-k entries per step (default: the config's)")
    cache.add_argument("--hot-slots", "--hot-buffer", dest="hot_slots",
                       type=out.positive_int, default=None, metavar="SLOTS",
                       help=out.HOT_BUFFER_HELP)
    cache.add_argument("--extent-tokens", type=out.positive_int, default=None,
                       help="host extent size in tokens (default: the config's)")
    cache.add_argument("--miss-rate", type=out.fraction, default=0.1,
                       help="fraction of top-k entries that miss per layer and step "
                       "(default: %(default)s)")
    cache.add_argument("--link-gbps", type=out.positive_float, default=H200_BULK_H2D_GBPS,
                       help="host-to-device bandwidth in GB/s (default: %(default)s, the "
                       "measured H200 bulk rate)")

    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print JSON instead of a table")
    output.add_argument("--plot", metavar="PNG", default=None,
                        help="write concurrency against context length to this PNG "
                        "(needs matplotlib)")
    parser.set_defaults(handler=run, parser=parser)


def model_shape(config: Any, args: argparse.Namespace) -> ModelShape:
    indexer = args.indexer_bytes
    if indexer is None:
        indexer = getattr(config, "indexer_key_bytes", DSA_INDEXER_KEY_BYTES)
    return ModelShape(
        name=config.model,
        num_layers=config.num_layers,
        row_bytes=config.row_bytes,
        indexer_key_bytes=int(indexer),
        index_group_size=config.index_group_size,
        index_anchors=config.index_anchors,
    )


def run(args: argparse.Namespace) -> int:
    from hisparse.errors import InvalidInputError
    from hisparse.tools import planning

    parser: argparse.ArgumentParser = args.parser
    if args.plot:
        pyplot = out.import_pyplot()
        if isinstance(pyplot, str):
            return out.fail("plan", pyplot)
        out.check_plot_path(parser, args.plot)
    config = load_config(parser, args)
    contexts = args.context or list(DEFAULT_CONTEXTS)
    check_values(parser, args, contexts)
    shape = model_shape(config, args)
    limits = config_limits(args, config)
    settings = PlanSettings(
        gpu_mem_bytes=round(args.gpu_mem_gib * GIB),
        weights_bytes=round(args.weights_gib * GIB),
        reserve_bytes=round(args.reserve_gib * GIB),
        top_k=config.top_k,
        hot_slots=config.hot_slots,
        extent_tokens=config.extent_tokens,
        miss_rate=args.miss_rate,
        link_bytes_per_s=args.link_gbps * 1e9,
        host_mem_bytes=None if args.host_mem_gib is None else round(args.host_mem_gib * GIB),
        reserved_slots=config.max_draft_tokens,
        shared_prefix_tokens=args.shared_prefix,
        sharing_requests=args.sharing_requests,
        tp_ranks=args.tp,
        resident_entries_per_token=(1 + config.alias_extents / config.num_extents
                                    if config.residency_map == "host_row" else 1.0),
        **limits,
    )
    # A row is `compress_rate` tokens (DeepSeek-V4's compressed entries): plan in rows.
    rows = [config.rows_for_tokens(c) for c in contexts]
    try:
        plans = planning.plan(shape, settings, rows)
    except InvalidInputError as exc:
        parser.error(str(exc))
    fits = [planning.requests_fit(shape, settings, c, args.requests)
            for c in (rows if args.requests else [])]
    warnings = [f"--context {c} is {r} rows, more than max_seq_len {config.max_seq_len} of "
                f"{out.config_source(args)}; a cache for it needs max_seq_len >= {r}"
                for c, r in zip(contexts, rows, strict=True) if r > config.max_seq_len]
    for warning in warnings:
        print(f"hisparse plan: warning: {warning}", file=sys.stderr)

    document = to_document(shape, config, settings, args, plans)
    document.update(requests=[fit.to_dict() for fit in fits], warnings=warnings,
                    compress_rate=config.compress_rate)
    for entry, tokens in zip(document["contexts"], contexts, strict=True):
        entry["context_rows"], entry["context_tokens"] = entry["context_tokens"], tokens
    if args.json:
        out.emit_json(document)
    else:
        print(render(shape, config, settings, plans, limits_line(args, limits), fits))
    if args.plot:
        path = plot(pyplot, shape, plans, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    return 0


# Upper bounds past which a value plans nothing real: (limit, what it is).
UPPER_BOUNDS = {
    "gpu_mem_gib": (16384.0, "16 TiB, more than any one GPU"),
    "host_mem_gib": (1048576.0, "1 PiB, more than any one host"),
    "link_gbps": (10000.0, "10 TB/s, more than any host-to-device link"),
    "tp": (1024, "1024 ranks, more than any one node"),
}
MAX_CONTEXT = 2**31 - 1  # token positions are int32


def check_values(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 contexts: list[int]) -> None:
    """Usage errors for values no deployment has, naming the option the user typed."""
    for name, (limit, what) in UPPER_BOUNDS.items():
        value = getattr(args, name)
        if value is not None and value > limit:
            parser.error(f"argument --{name.replace('_', '-')}: {value:g} is beyond {what}; "
                         f"use at most {limit:g}")
    for name in ("weights_gib", "reserve_gib"):
        if getattr(args, name) > args.gpu_mem_gib:
            parser.error(f"argument --{name.replace('_', '-')}: {getattr(args, name):g} GiB is "
                         f"more than --gpu-mem-gib {args.gpu_mem_gib:g}; use at most that")
    if args.weights_gib + args.reserve_gib >= args.gpu_mem_gib:
        parser.error(
            f"argument --weights-gib/--reserve-gib: weights {args.weights_gib:g} GiB + reserve "
            f"{args.reserve_gib:g} GiB leave nothing of --gpu-mem-gib {args.gpu_mem_gib:g}; "
            "lower them or raise --gpu-mem-gib")
    given = "--context" if args.context else (
        f"the default --context ({' '.join(map(str, DEFAULT_CONTEXTS))})")
    if max(contexts) > MAX_CONTEXT:
        parser.error(f"argument --context: {max(contexts)} tokens is more than the "
                     f"{MAX_CONTEXT} a request can hold (int32 positions); use shorter contexts")
    if args.top_k is not None and args.top_k > min(contexts):
        parser.error(f"argument --top-k: {args.top_k} entries is more than the "
                     f"{min(contexts)} tokens of {given} they are picked from; use at most "
                     f"{min(contexts)}, or longer contexts")
    shorter = [c for c in contexts if c < args.shared_prefix]
    if shorter:
        parser.error(f"argument --shared-prefix: {args.shared_prefix} tokens is longer than "
                     f"context {shorter} of {given}; a request holds at least its prefix: "
                     f"pass --context lengths of at least {args.shared_prefix} tokens or a "
                     "shorter --shared-prefix")
    if args.sharing_requests is not None and not args.shared_prefix:
        parser.error("argument --sharing-requests: needs --shared-prefix TOKENS, the prefix "
                     "the requests share")


# The keys of a --config file that limit the requests a cache admits (presets leave them at
# the library's defaults, which say nothing about a deployment: the plan says what to set).
LIMIT_KEYS = ("max_requests", "host_pool_tokens")


def config_limits(args: argparse.Namespace, config: Any) -> dict[str, int]:
    """The LIMIT_KEYS a --config file sets, with the values the config took."""
    if not args.config:
        return {}
    import yaml

    loaded = yaml.safe_load(Path(args.config).read_text()) or {}
    return {key: getattr(config, key) for key in LIMIT_KEYS if key in loaded}


def limits_line(args: argparse.Namespace, limits: dict[str, int]) -> str:
    if not limits:
        return ""
    given = " and ".join(f"{key} {value}" for key, value in limits.items())
    return f"config file {args.config}: {given} cap the HiSparse column"


def load_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    return out.load_config(
        parser,
        args,
        CONFIG_FLAGS,
        kv_dtype=args.kv_dtype,
        top_k=args.top_k,
        hot_slots=args.hot_slots,
        extent_tokens=args.extent_tokens,
        index_group_size=args.index_group_size,
    )


def to_document(
    shape: ModelShape,
    config: Any,
    settings: PlanSettings,
    args: argparse.Namespace,
    plans: list[ContextPlan],
) -> dict[str, Any]:
    return {
        "schema_version": out.JSON_SCHEMA_VERSION,
        "command": "plan",
        "model": {
            "preset": None if args.config else args.preset or out.DEFAULT_PRESET,
            "config_file": args.config,
            "kv_dtype": config.kv_dtype,
            "num_layers": shape.num_layers,
            "row_bytes": shape.row_bytes,
            "indexer_key_bytes": shape.indexer_key_bytes,
            "index_group_size": shape.index_group_size,
            "index_anchors": list(shape.schedule.anchors),
            "num_groups": shape.num_groups,
        },
        "settings": {
            "gpu_mem_bytes": settings.gpu_mem_bytes,
            "weights_bytes": settings.weights_bytes,
            "reserve_bytes": settings.reserve_bytes,
            "available_bytes": settings.available_bytes,
            "host_mem_bytes": settings.host_mem_bytes,
            "top_k": settings.top_k,
            "hot_slots": settings.hot_slots,
            "extent_tokens": settings.extent_tokens,
            "miss_rate": settings.miss_rate,
            "link_bytes_per_s": settings.link_bytes_per_s,
            "shared_prefix_tokens": settings.shared_prefix_tokens,
            "sharing_requests": settings.sharing_requests,
            "tp_ranks": settings.tp_ranks,
        },
        "contexts": [p.to_dict() for p in plans],
    }


def render(
    shape: ModelShape, config: Any, settings: PlanSettings, plans: list[ContextPlan],
    limits: str = "", fits: Sequence[Any] = (),
) -> str:
    # Layers that share a top-k have no indexer, so no indexer keys: one per index group.
    indexers = "layer" if shape.num_groups == shape.num_layers else (
        f"index group ({shape.num_groups} indexers)")
    header = (
        f"{shape.name} {config.kv_dtype}: {shape.num_layers} layers, {shape.row_bytes} B rows "
        f"+ {shape.indexer_key_bytes} B indexer key per token per {indexers}; top-k "
        f"{settings.top_k}, hot buffer {settings.hot_slots}+1 slots\n"
        f"device budget {out.format_bytes(settings.available_bytes)} for KV; miss rate "
        f"{settings.miss_rate:g}; link {out.format_rate(settings.link_bytes_per_s)}"
    )
    if config.compress_rate > 1:
        header += (f"\na row is one compressed entry of {config.compress_rate} tokens: "
                   "contexts below are in rows (--context tokens / compress_rate)")
    sharing = settings.shared_prefix_tokens > 0
    if sharing:
        who = ("every request" if settings.sharing_requests is None
               else f"{settings.sharing_requests} requests")
        header += (f"\nshared prefix: {settings.shared_prefix_tokens} tokens, held once by "
                   f"{who} (whole {settings.extent_tokens}-token extents shared, the boundary "
                   "extent copied)")
    if limits:
        header += f"\n{limits}"
    tp = settings.tp_ranks
    if tp > 1:
        header += (f"\ntensor parallel: {tp} ranks per node hold the same requests; host/node "
                   f"is {tp} pools without sharing, one pool + metadata with a shared pool "
                   "(SharedPoolSpec, docs/integration.md)")
    rows = []
    for p in plans:
        gain = "-" if p.gain is None else f"{p.gain:.1f}x"
        hisparse = str(p.hisparse_max_requests) + (
            "" if p.limited_by == "device" else f" ({p.limited_by})")
        rows.append((
            p.context_tokens,
            p.baseline_max_requests,
            hisparse,
            gain,
            out.format_bytes(p.baseline_request_bytes),
            out.format_bytes(p.hisparse_request_bytes),
            out.format_bytes(p.host_pool_bytes),
            p.host_pool_tokens,
            *([out.format_bytes(p.host_bytes_saved)] if sharing else []),
            *([out.format_bytes(p.host_node_bytes_private),
               out.format_bytes(p.host_node_bytes_shared)] if tp > 1 else []),
            out.format_bytes(p.h2d_bytes_per_step),
            out.format_seconds(p.h2d_seconds_per_step),
        ))
    table = out.render_table(
        ("context", "requests", "HiSparse", "gain", "device/req", "HiSparse/req",
         "host pool", "host_pool_tokens", *(["host saved"] if sharing else []),
         *([f"host/node x{tp}", "host/node shared"] if tp > 1 else []),
         "H2D/step", "H2D time/step"),
        rows,
    )
    return "\n".join([header, "", table, *render_fits(fits)])


def render_fits(fits: Sequence[Any]) -> list[str]:
    """`--requests N`: per context, whether N requests fit and what a cache for them sets."""
    lines = [""] if fits else []
    for fit in fits:
        verdict = "fit" if fit.fits else "do NOT fit: over " + " and ".join(fit.problems)
        lines.append(
            f"{fit.requests} requests of {fit.context_tokens} tokens: {verdict}; device "
            f"{out.format_bytes(fit.device_bytes)} of {out.format_bytes(fit.available_bytes)}, "
            f"host pool {out.format_bytes(fit.host_pool_bytes)}\n  a cache for them sets "
            f"max_requests: {fit.requests}, max_seq_len: {fit.context_tokens} (plus the "
            f"tokens they decode), host_pool_tokens: {fit.host_pool_tokens}")
    return lines


def plot(pyplot: Any, shape: ModelShape, plans: list[ContextPlan], path: str) -> str:
    contexts = [p.context_tokens for p in plans]
    figure, axes = pyplot.subplots(figsize=(6.4, 4.0))
    axes.plot(contexts, [p.baseline_max_requests for p in plans], marker="o",
              label="full KV on device")
    axes.plot(contexts, [p.hisparse_max_requests for p in plans], marker="o", label="HiSparse")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("concurrent requests per GPU")
    axes.set_title(f"{shape.name}: requests that fit")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path
