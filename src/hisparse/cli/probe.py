"""`hisparse probe`: show what this machine supports, prove it, exit 0 when usable."""

from __future__ import annotations

import argparse
import json
import sys

EPILOG = """\
examples:
  hisparse probe                 detect the device, print the feature table and check results
  hisparse probe --json          the same as a stable JSON document (schema_version 1)
  hisparse probe --device cuda   probe one backend; exit 1 with the reason if it is not usable
  hisparse probe --config my.yaml  the swap-in round trip on your config instead of tiny
  hisparse probe --kernel-targets all
                                 compile every kernel variant for every GPU target (~1 min)

kernel targets: per GPU target (cuda:sm_90, hip:gfx942, ...) whether the Triton kernels ran
on it here, were compiled for it here but not run, or were not compiled (and why). The
default compiles the tiny preset's launches (a few seconds; Triton caches builds on disk).

exit status: 0 when the backend is usable and every check passed (skipped checks are fine),
1 otherwise, with a one-line reason on stderr.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="detect devices, show the feature table, run a tiny swap-in",
        description="Detect the device, report versions and the feature table of the chosen "
        "backend, and prove it works: allocate and register a host buffer, read it from the "
        "device, and run a tiny swap-in round trip.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print a JSON document")
    parser.add_argument(
        "--device", "--backend", dest="device", default=None,
        help="backend or device to probe (cuda, rocm, xpu, cpu, cuda:1, ...); default: detect",
    )
    parser.add_argument(
        "--config", metavar="FILE", default=None,
        help="run the swap-in round trip on this YAML config (its full host pool and device "
        "buffers) instead of the tiny preset: does my config work on this machine?",
    )
    parser.add_argument(
        "--no-checks", dest="run_checks", action="store_false",
        help="only report; skip the allocation and swap-in checks (and the kernel builds)",
    )
    parser.add_argument(
        "--kernel-targets", choices=("quick", "all", "off"), default=None,
        help="Triton builds for the GPU targets: the tiny preset's (quick, the default with "
        "the checks), every variant (all), or none (off)",
    )
    parser.set_defaults(handler=run, parser=parser)


def run(args: argparse.Namespace) -> int:
    from hisparse.tools.probe import format_report, probe

    config = None
    if args.config is not None:
        from hisparse.cli import _output as out

        config = out.load_config(args.parser, args)
    report = probe(args.device, run_checks=args.run_checks, config=config,
                   kernel_targets=args.kernel_targets)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    if not report["ok"]:  # also False whenever the backend is not usable
        name = report["backend"] or args.device
        if report["usable"]:  # a check failed: the reason names it, then its cause
            print(f"hisparse probe: backend {name} failed {report['reason']}", file=sys.stderr)
        else:
            print(f"hisparse probe: backend {name} is not usable: "
                  f"{report['reason'] or 'unknown reason'}", file=sys.stderr)
        return 1
    return 0
