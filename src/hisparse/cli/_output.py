"""Output helpers shared by `plan`, `simulate` and `bench`: tables, JSON, progress, plots.

Only the standard library at import time: `hisparse --help` imports every subcommand module.
matplotlib and tqdm are optional and imported when asked for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn, TextIO

# Bumped when a field is renamed or removed; adding fields keeps the version.
JSON_SCHEMA_VERSION = 1


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors lead with the one line that matters.

    argparse prints the whole usage (10-13 lines for `simulate`) before the error; here the
    error comes first, then one line pointing at `--help`. Subparsers made through
    `add_subparsers` are of this class too (argparse uses the parent's class).
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"`{self.prog} --help` lists the options\n")


def fail(command: str, message: str) -> int:
    """Print a one-line error the way argparse does and return the exit code for a failed run."""
    print(f"hisparse {command}: error: {message}", file=sys.stderr)
    return 1


def format_bytes(num_bytes: float | None) -> str:
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_rate(bytes_per_s: float | None) -> str:
    """Bandwidth in decimal GB/s, the unit link speeds use."""
    if bytes_per_s is None or not math.isfinite(bytes_per_s):
        return "-"
    if bytes_per_s < 1e9:
        return f"{bytes_per_s / 1e6:.2f} MB/s"
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


# A p90 more than this many times the p10 of the same timings: the machine was too busy (or
# its clock too unsteady) for the median to mean anything; CPU timings swing ~100x with load.
NOISE_RATIO = 2.0


def format_spread(median: float | None, p10: float | None, p90: float | None) -> str:
    """A median time with its spread: "1.20 ms (p10 1.10 ms, p90 1.50 ms)"."""
    if median is None or p10 is None or p90 is None:
        return format_seconds(median)
    return (f"{format_seconds(median)} (p10 {format_seconds(p10)}, "
            f"p90 {format_seconds(p90)})")


def noise_warning(spreads: Iterable[tuple[float | None, float | None]]) -> str | None:
    """The warning to print when any (p10, p90) spread is wider than NOISE_RATIO, else None."""
    ratios = [p90 / p10 for p10, p90 in spreads if p10 and p90]
    if not ratios or max(ratios) <= NOISE_RATIO:
        return None
    return (f"warning: timings spread up to {max(ratios):.1f}x from p10 to p90 (more than "
            f"{NOISE_RATIO:g}x): the machine was too noisy to trust them; rerun it idle")


def render_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [row[0].ljust(widths[0])]
        parts += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _to_jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def dumps(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, default=_to_jsonable, allow_nan=False)


def emit_json(document: dict[str, Any], stream: TextIO | None = None) -> None:
    print(dumps(document), file=stream or sys.stdout)


def write_json(path: str | Path, document: dict[str, Any]) -> Path:
    path = Path(path)
    path.write_text(dumps(document) + "\n")
    return path


def backend_for_device_argument(parser: argparse.ArgumentParser, device: str | None) -> Any:
    """The backend `--device` names (None: the best here); an unusable one is a usage error."""
    import torch

    from hisparse.backends.registry import device_index, get_backend
    from hisparse.errors import BackendUnavailableError

    try:
        backend = get_backend(device)
        index = device_index(backend, device)
    except BackendUnavailableError as exc:
        parser.error(f"argument --device: {exc}")
    if index is not None:
        # The measurements and the engine's kernels run on the current device: make it the
        # one asked for (else `--device cuda:1` measured device 0, or failed in Triton).
        getattr(torch, backend.torch_device_type).set_device(index)
    return backend


def check_writable(parser: argparse.ArgumentParser, option: str, path: str | Path) -> None:
    """A usage error now, before a run of minutes, if `path` cannot be written as a file.
    Missing folders are not created: a typo in a path should not make a tree of them."""
    target = Path(path)
    parent = target.parent
    problem = None
    if target.is_dir():
        problem = "is a directory; name a file"
    elif not parent.exists():
        problem = f"the folder {parent} does not exist; create it first"
    elif not parent.is_dir():
        problem = f"{parent} is not a directory"
    elif not os.access(parent, os.W_OK | os.X_OK):
        problem = f"{parent} is not writable"
    elif target.exists() and not os.access(target, os.W_OK):
        problem = "is not writable"
    if problem is not None:
        parser.error(f"argument {option}: cannot write {str(path)!r}: {problem}")


def check_plot_path(parser: argparse.ArgumentParser, path: str | Path,
                    option: str = "--plot") -> None:
    """`check_writable`, and a usage error if matplotlib has no writer for the file's
    extension (the extension picks the format)."""
    check_writable(parser, option, path)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return  # import_pyplot says how to install it
    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = Path(path).suffix.lower()
    if suffix[1:] not in formats:
        known = ", ".join(f".{name}" for name in sorted(formats))
        what = f"the extension {suffix!r} is" if suffix else "a name without an extension is"
        parser.error(f"argument {option}: cannot plot to {str(path)!r}: {what} not a format "
                     f"matplotlib writes; end the name in one of {known}")


def check_utf8(parser: argparse.ArgumentParser, option: str, path: str | Path) -> None:
    """A usage error if the text file `path` is not UTF-8 (an unreadable one is left to the
    reader, which names the OS's reason)."""
    try:
        Path(path).read_bytes().decode("utf-8")
    except OSError:
        return
    except UnicodeDecodeError as exc:
        parser.error(f"argument {option}: {path} is not UTF-8 text (byte "
                     f"{exc.object[exc.start]:#04x} at offset {exc.start}); save it as UTF-8")


def import_pyplot(option: str = "--plot") -> ModuleType | str:
    """matplotlib.pyplot with a file-only backend, or the message to fail with."""
    try:
        import matplotlib
    except ImportError:
        return f"{option} needs matplotlib, which is not installed; run `pip install matplotlib`"
    matplotlib.use("Agg")  # files only: never open a window or need a display
    import matplotlib.pyplot as plt

    return plt


class Progress:
    """A progress bar on stderr: tqdm when installed, else a plain counter. Never on stdout."""

    def __init__(self, total: int, description: str, enabled: bool = True) -> None:
        self.total = total
        self.description = description
        self.enabled = enabled
        self.done = 0
        self._bar: Any = None
        self._last_percent = -1
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, desc=description, file=sys.stderr, leave=False)

    def update(self, count: int = 1) -> None:
        self.done += count
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(count)
            return
        # Plain counter: at most one line per 10% so logs stay short when stderr is a file.
        percent = 100 * self.done // max(self.total, 1)
        if percent // 10 != self._last_percent // 10 or self.done == self.total:
            self._last_percent = percent
            print(f"{self.description}: {self.done}/{self.total}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def iterate(self, items: Sequence[Any]) -> Iterator[Any]:
        for item in items:
            yield item
            self.update()


# --- argparse value types: their messages become "argument --x: <message>" ---------------------
def _whole_number_at_least(minimum: int, text: str) -> int:
    try:
        value: int | None = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _whole_number_at_least(1, text)


def non_negative_int(text: str) -> int:
    return _whole_number_at_least(0, text)


# numpy's seed sequences refuse negative seeds and torch's generators take at most 64 bits.
SEED_LIMIT = 2**63 - 1


def seed(text: str) -> int:
    try:
        value: int | None = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= SEED_LIMIT:
        raise argparse.ArgumentTypeError(
            f"expected a whole number in [0, 2**63 - 1], got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


DEFAULT_PRESET = "deepseek-v3.2"
# plan, simulate and bench --config share the rule: the config's hot buffer where it sets one
# (tiny: 128), else 2 x top-k (deepseek-v3.2 and glm-5 leave it null); a --top-k larger than
# a set hot buffer is a usage error that names --hot-slots.
HOT_BUFFER_HELP = ("LRU hot slots per request and index group (default: the config's where it "
                   "sets one, else 2 x top-k; it must hold --top-k)")


def add_config_options(container: Any, what: str) -> None:
    """`--preset NAME` or `--config FILE` (one of them): where the cache's config comes from.

    `what` says what the command takes from it, for the help text.
    """
    choice = container.add_mutually_exclusive_group()
    choice.add_argument("--preset", default=None, metavar="NAME",
                        help=f"a shipped preset (configs/*.yaml) for {what} (default: "
                        f"{DEFAULT_PRESET})")
    choice.add_argument("--config", default=None, metavar="FILE",
                        help="a YAML config file instead of a preset: HiSparseConfig keys, as "
                        "in configs/default.yaml; unset keys keep their defaults")


def config_source(args: argparse.Namespace) -> str:
    """How an error names where the config came from: the file, or the preset."""
    if getattr(args, "config", None):
        return f"config file {args.config}"
    return f"the {getattr(args, 'preset', None) or DEFAULT_PRESET} preset"


def load_config(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    flags: dict[str, str] | None = None,
    **overrides: Any,
) -> Any:
    """The config `--config FILE` or `--preset NAME` names, with `overrides` (None: not given)
    applied; every problem is a usage error naming the option to change.

    `flags` maps config keys to the options that set them. Keys the user set through an option
    are named by that option in the error, never by the config key.
    """
    try:
        from hisparse.config import HiSparseConfig
    except ImportError as exc:
        parser.exit(1, f"{parser.prog}: error: configs need hisparse.config, which failed to "
                       f"import ({exc})\n")
    from hisparse.errors import ConfigError

    flags = flags or {}
    overrides = {key: value for key, value in overrides.items() if value is not None}
    config_file = getattr(args, "config", None)
    if config_file:
        check_utf8(parser, "--config", config_file)

    def load(**values: Any) -> Any:
        if config_file:
            return HiSparseConfig.from_yaml(config_file, **values)
        return HiSparseConfig.from_preset(getattr(args, "preset", None) or DEFAULT_PRESET,
                                          **values)

    try:
        return load(**overrides)
    except ConfigError as exc:
        problems = list(exc.problems)
    source_option = "--config" if config_file else "--preset"
    try:
        base = load()  # is the file or preset itself at fault, or an option's value?
    except ConfigError as exc:
        text = "; ".join(exc.problems).replace(
            "(or load your own file with HiSparseConfig.from_yaml(path))",
            "(or pass --config FILE)")
        parser.error(f"argument {source_option}: {text}")
    top_k = overrides.get("top_k")
    if (top_k is not None and "hot_slots" not in overrides
            and base.hot_slots < top_k and "top_k" in flags
            and "hot_slots" in flags):
        # The source fixes its hot buffer (tiny: 128 slots): a larger top-k needs a larger one.
        # Where it leaves the buffer unset (null), it is derived as 2 x top-k and never gets here.
        parser.error(
            f"argument {flags['top_k']}: {top_k} entries do not fit the hot buffer of "
            f"{config_source(args)} ({base.hot_slots} slots); pass "
            f"{flags['hot_slots']} too (at least {top_k}; {2 * top_k} is the usual "
            f"2 x top-k) or use at most {flags['top_k']} {base.hot_slots}")
    parser.error(options_in_config_problems(problems, flags, overrides, source_option))


def options_in_config_problems(problems: list[str], flags: dict[str, str],
                               overrides: dict[str, Any], source_option: str) -> str:
    """ConfigError problems ("key: got ...") as an argparse message naming the options: every
    key an option set is replaced by that option; the blamed argument is the option whose
    value is at fault, else where the config came from (`--preset`/`--config`)."""
    given = {key: flag for key, flag in flags.items() if key in overrides}
    blamed: list[str] = []
    texts = []
    for problem in problems:
        key, sep, rest = problem.partition(": ")
        if sep and key in given:
            blamed.append(given[key])
            problem = rest
        else:  # another key's problem caused by an option: `--layers 1` with groups of 2
            blamed += [flag for other, flag in given.items()
                       if re.search(rf"\b{re.escape(other)}\b", problem)]
        for other, flag in flags.items():
            problem = re.sub(rf"\b{re.escape(other)}\b", flag, problem)
        texts.append(problem)
    culprits = "/".join(dict.fromkeys(blamed)) or source_option
    return f"argument {culprits}: {'; '.join(texts)}"
