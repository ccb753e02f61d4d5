"""The kernel variants the launch code would launch on a target, as Triton would specialise them.

`compile_variants()` runs the real launch functions on CPU tables with the kernels swapped for
recorders, so each launch's constexprs, argument types, launch options (num_warps,
launch_pdl) and the specialisation Triton's JIT derives from the arguments (an int equal to
1 becomes a constant, a pointer or int divisible by 16 gets the divisibility hint, AMD's
buffer-op hint) are exactly those of a launch on a device, for the scenarios listed there.
Compiling them and checking the builds is `kernels/targets.py`'s job. Importing this module
imports neither torch nor triton.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hisparse.kernels.targets import Target


@dataclass
class Variant:
    """One compilation: a kernel with the constexprs, types and options of a launch."""

    kernel: str
    label: str  # the first scenario that launches it
    fn: Any  # the triton.jit function
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]  # num_warps, launch_pdl
    scenarios: list[str] = field(default_factory=list)  # every scenario that launches it

    @property
    def uses_pdl(self) -> bool:
        return bool(self.options.get("launch_pdl")) or bool(self._constexpr("USE_PDL"))

    def _constexpr(self, name: str) -> Any:
        names = self.fn.arg_names
        return self.constexprs.get((names.index(name),)) if name in names else None

    def described_constexprs(self) -> dict[str, Any]:
        names = self.fn.arg_names
        return {names[path[0]]: value for path, value in sorted(self.constexprs.items())}


@dataclass(frozen=True)
class _Scenario:
    label: str
    batch: int  # Bcap
    top_k: int = 2048
    hot_slots: int = 4096  # H
    row_bytes: int = 656  # the 656-byte FP8 MLA row
    extent: int = 512  # E
    # "key_row": host_row with key extents (the default config's, alias_extents > 0);
    # "host_row": without them (alias_extents 0); "position"
    residency: str = "key_row"
    tuning: dict[str, Any] = field(default_factory=dict)
    swap_in: bool = True
    replay: bool = False  # copy_planned (a shared-index follower layer)
    quick: bool = False  # in the probe's default, quick compile
    newest: bool = False  # the lookup also writes the layer's new rows (swap_in's newest_kv)
    backup: bool = True  # ... and backs them up to their host rows (a private host pool)
    tokens: int = 1  # S > 1: a verify step's [B, S * K] rows, de-duplicated in the swap-in


# ==== compile_variants: everything that knows the kernel modules ===========================
def compile_variants(target: Target, quick: bool = False) -> list[Variant]:
    """The kernel variants the launch code chooses on `target`, deduplicated.

    THE ONE PLACE that knows the kernel modules: which launch functions exist, which module
    globals hold their kernels, and the launch rule for programmatic dependent launch. It
    runs the launch functions on CPU tables with each kernel replaced by a recorder, so the
    argument lists, constexprs and num_warps come from the launch code itself, with the
    device traits the target's backend would state (`_target_traits`).

    Coverage (the full product of the switches is hundreds of builds per target): every
    value each launch-time switch can take, with the switches that share code paths
    crossed. Shapes: the shipped presets (SW-1 / DeepSeek-V3.2 and GLM-5: K=2048, H=4096,
    656 B FP8 and 1152 B BF16 rows; tiny: K=64, H=128, 64 B rows), plus the hot-buffer sizes
    where the selection changes code (BLOCK_H 16384: its packed scan at its limit and 32
    warps; H=32768: two scans, int32 residency). Batch capacities 1 and 16 (prefetching copy,
    small-batch classify chunk, PDL copy), 64 and 128 (address-ordered plan, wide batches).
    Residency by key row (host_row with key extents, the default), by host row without them
    and by position; Tuning's boolean switches flipped (early_loads with each residency
    key, relaxed_counters, pdl), its numbers as shipped; verify rows of S = 2, 4 and 8
    de-duplicated in the swap-in (the widths where the selection changes warps).
    The rest of the decode path (`_decode_path_launches`): the newest-token writer and the
    quiet step's advance at each warp count.
    """
    from hisparse.kernels import advance_triton, backup_triton, newest_triton
    from hisparse.kernels.swap_in import launch as swap_in_launch
    from hisparse.kernels.swap_in import plan as swap_in_plan

    kernels = {  # the name a report uses -> (module, global the launch code calls)
        "classify": (swap_in_launch, "classify_kernel"),
        "select": (swap_in_launch, "select_kernel"),
        "copy": (swap_in_launch, "copy_kernel"),
        "copy_prefetched": (swap_in_launch, "copy_prefetched_kernel"),
        "complete_union": (swap_in_launch, "complete_union_kernel"),
        "backup": (backup_triton, "_backup_kernel"),
        "newest": (newest_triton, "_write_newest_kernel"),
        "advance": (advance_triton, "_advance_kernel"),
    }
    scenarios = _swap_in_scenarios()
    traits = _target_traits(target)

    def run(scenario: _Scenario, launches: _Launches) -> None:
        import torch

        tables, args = _scenario_tables(scenario, torch)
        with swap_in_plan.tuning(**scenario.tuning):
            launches.scenario = scenario.label
            if scenario.swap_in:
                newest = args["newest"] if scenario.backup else args["newest_unsaved"]
                swap_in_launch.swap_in_triton(tables, 0, 0, *args["swap_in"], traits=traits,
                                              newest=newest if scenario.newest else None,
                                              union=args["union"])
            if scenario.replay:
                launches.scenario = f"{scenario.label}, replay"
                swap_in_launch.copy_planned_triton(tables, 0, args["plan"], traits=traits)
            launches.scenario = f"{scenario.label}, backup"
            backup_triton.backup_newest_triton(tables, *args["backup"])

    with _recording(kernels) as launches:
        for scenario in scenarios:
            if scenario.quick or not quick:
                run(scenario, launches)
        _decode_path_launches(launches, quick)
    return _dedupe(launches.specialized(target))


def _swap_in_scenarios() -> list[_Scenario]:
    """The swap-in shapes and switches `compile_variants` launches (its docstring says why)."""
    no_early = {"early_loads": False}
    return [
        _Scenario("B=1 fp8 extents", 1),
        _Scenario("B=16 fp8 extents", 16),
        _Scenario("B=1 fp8 extents, PDL", 1, tuning={"pdl": True}),
        _Scenario("B=16 fp8 extents, planned copy behind PDL", 16,
                  tuning={"pdl": True, "prefetch_copy_max_batch": 1}),
        _Scenario("B=64 bf16 token pages", 64, row_bytes=1152, extent=16),
        _Scenario("B=128 fp8 token pages by position", 128, extent=16, residency="position"),
        _Scenario("B=4 no early loads, acq_rel counters", 4,
                  tuning={**no_early, "relaxed_counters": False}),
        _Scenario("B=4 no early loads, by position", 4, extent=16, residency="position",
                  tuning=no_early),
        _Scenario("B=16 fp8 extents, no key extents", 16, residency="host_row"),
        _Scenario("B=64 bf16 token pages, no key extents", 64, row_bytes=1152, extent=16,
                  residency="host_row"),
        _Scenario("B=4 no early loads, no key extents", 4, residency="host_row",
                  tuning=no_early),
        _Scenario("B=1 fp8 extents, new rows in the lookup", 1, newest=True),
        _Scenario("B=64 bf16 token pages, new rows in the lookup", 64, row_bytes=1152,
                  extent=16, newest=True),
        _Scenario("B=16 fp8 extents, new rows in the lookup, not backed up (a shared "
                  "host pool)", 16, newest=True, backup=False),
        _Scenario("B=16 shared-index replay", 16, swap_in=False, replay=True),
        _Scenario("B=1 H=16384", 1, hot_slots=16384),
        _Scenario("B=1 H=32768 int32 residency", 1, hot_slots=32768),
        _Scenario("tiny preset B=8 (the probe's)", 8, top_k=64, hot_slots=128, row_bytes=64,
                  extent=64, replay=True, quick=True),
        _Scenario("B=1 verify S=2, union in the swap-in", 1, tokens=2, quick=True),
        _Scenario("B=16 verify S=4, union in the swap-in, by position", 16, tokens=4,
                  hot_slots=8192, extent=16, residency="position"),
        _Scenario("B=128 verify S=8, union in the swap-in", 128, tokens=8, hot_slots=16384),
        _Scenario("B=1 verify S=8, first entries by the table alone", 1, tokens=8,
                  hot_slots=16384, tuning={"verify_first_candidates": False}),
    ]


def _decode_path_launches(launches: _Launches, quick: bool) -> None:
    """The newest writer and the quiet step's advance through their own launchers, on CPU
    tensors (never touched): (row bytes) and (batch capacity) as the shipped presets and the
    launch code's width switches have them."""
    import torch

    from hisparse.kernels import advance_triton, newest_triton

    i32, i64 = torch.int32, torch.int64
    for row_bytes in [64] if quick else [64, 656, 1152]:
        launches.scenario = f"newest rows {row_bytes} B"
        device_kv = torch.empty(1, 17, row_bytes, dtype=torch.uint8)
        newest = torch.empty(16, dtype=i32)
        writer = newest_triton.NewestWriterTriton(device_kv, newest, newest.long(), direct=False)
        writer(0, torch.empty(16, row_bytes, dtype=torch.uint8))
    for capacity in [8] if quick else [8, 128, 256]:
        launches.scenario = f"quiet-step advance Bcap={capacity}"
        advance = advance_triton.AdvanceTriton(
            torch.empty(capacity, dtype=i64), torch.empty(1, dtype=i32),
            torch.empty(capacity, dtype=i32), torch.empty(capacity, dtype=i32),
            torch.empty(16, dtype=i32), direct=False)
        advance(capacity)


def _scenario_tables(s: _Scenario, torch: Any) -> tuple[Any, dict[str, Any]]:
    """CPU tables shaped like a deployment's (torch.empty: never touched, so the host pool
    and device rows cost address space only). Sizes keep production's divisibility by 16,
    which Triton specialises on: R=16 requests, 128 Ki tokens per request."""
    from hisparse.layout.tables import (
        CacheTables,
        DraftUnion,
        MissPlan,
        NewestRows,
        residency_dtype,
    )

    i32, requests, positions = torch.int32, 16, 131072
    pages = positions // s.extent
    host_rows = 65536
    key_extents = 2 * host_rows // s.extent  # the pool's extents and as many aliases
    keys = {"position": requests * positions, "host_row": host_rows}.get(
        s.residency, key_extents * s.extent)
    tables = CacheTables(
        device_kv=torch.empty(1, requests * (s.hot_slots + 1), s.row_bytes, dtype=torch.uint8),
        host_kv=[torch.empty(host_rows, s.row_bytes, dtype=torch.uint8)],
        page_table=torch.empty(requests, pages, dtype=i32),
        seq_lens=torch.empty(requests, dtype=i32),
        slot_key=torch.empty(1, requests, s.hot_slots, dtype=i32),
        last_use=torch.empty(1, requests, s.hot_slots, dtype=i32),
        lru_clock=torch.empty(1, requests, dtype=i32),
        resident=torch.empty(1, keys, dtype=residency_dtype(s.hot_slots)),
        counters=torch.empty(1, 3, dtype=torch.int64),
        hot_slots=s.hot_slots, extent_tokens=s.extent,
        residency_map="position" if s.residency == "position" else "host_row",
        key_host_extent=(torch.empty(key_extents, dtype=i32) if s.residency == "key_row"
                         else None),
    )
    b, k = s.batch, s.top_k * s.tokens
    num_real = torch.empty(1, dtype=i32)
    table = torch.empty(b, positions + 16, dtype=i32)  # max_seq_len + D
    union = (DraftUnion(s.tokens, s.top_k, torch.empty(b, dtype=torch.int64),
                        torch.empty(b, dtype=torch.int64), lambda: table)
             if s.tokens > 1 else None)
    args = {
        "swap_in": (torch.empty(b, dtype=i32), torch.empty(b, k, dtype=i32), num_real,
                    torch.empty(b, k, dtype=i32)),
        "plan": MissPlan.empty(b, k, torch.device("cpu")),
        "backup": (torch.empty(b, dtype=i32), torch.empty(b, dtype=i32), num_real),
        "newest": NewestRows(torch.empty(b, s.row_bytes, dtype=torch.uint8),
                             torch.empty(b, dtype=i32), torch.empty(b, dtype=i32)),
        "newest_unsaved": NewestRows(torch.empty(b, s.row_bytes, dtype=torch.uint8),
                                     torch.empty(b, dtype=i32)),
        "union": union,
    }
    return tables, args


# ==== recording launches ===================================================================
@dataclass
class _Launch:
    kernel: str
    scenario: str
    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Launches(list):
    scenario = ""

    def specialized(self, target: Target) -> list[Variant]:
        backend = _backend_class(target)
        return [_specialize(launch, backend) for launch in self]


@contextlib.contextmanager
def _recording(kernels: dict[str, tuple[Any, str]]) -> Iterator[_Launches]:
    """Replace each kernel global by a recorder."""
    launches = _Launches()
    saved = [(module, attribute, getattr(module, attribute))
             for module, attribute in kernels.values()]
    try:
        for name, (module, attribute) in kernels.items():
            setattr(module, attribute, _Recorder(name, getattr(module, attribute), launches))
        yield launches
    finally:
        for module, attribute, value in saved:
            setattr(module, attribute, value)


class _Recorder:
    def __init__(self, name: str, fn: Any, launches: _Launches) -> None:
        self.name, self.fn, self.launches = name, fn, launches
        self.arg_names = fn.arg_names  # what a BoundLaunch binds the arguments by
        self.__name__ = name

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append(_Launch(self.name, self.launches.scenario, self.fn, args,
                                         kwargs))

        return launch


def _target_traits(target: Target) -> Any:
    """The `DeviceTraits` the target's backend would state on such a device: PDL from its
    feature table and, on NVIDIA, from the compute capability (as `CudaBackend.describe`
    reads it) and triton; the warp width from the target."""
    from hisparse.backends.features import Feature
    from hisparse.kernels.swap_in.pdl import triton_launches_dependents
    from hisparse.kernels.swap_in.plan import DeviceTraits

    table = target.features()
    pdl = table[Feature.PROGRAMMATIC_DEPENDENT_LAUNCH].usable and (
        isinstance(target.arch, int) and target.arch >= 90 and triton_launches_dependents())
    return DeviceTraits(compute_units=132, pdl=pdl, interpreted=False,
                        warp_size=target.warp_size)


def _backend_class(target: Target) -> Any:
    from triton.backends import backends

    return backends[target.triton_backend].compiler


def _specialize(launch: _Launch, backend: Any) -> Variant:
    """The signature, constants and attributes Triton's JIT derives from these arguments."""
    fn = launch.fn
    bound = dict(zip(fn.arg_names, launch.args, strict=False))
    options = {}
    for key, value in launch.kwargs.items():
        if key in fn.arg_names:
            bound[key] = value
        else:
            options[key] = value
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[(index,)] = "constexpr", value
            continue
        kind, key = _specialization(backend, param, value)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = key
        elif key:
            attrs[(index,)] = backend.parse_attr(key)
    return Variant(launch.kernel, launch.scenario, fn, signature, constexprs, attrs, options,
                   [launch.scenario])


def _specialization(backend: Any, param: Any, value: Any) -> tuple[str, Any]:
    try:
        from triton.runtime.jit import native_specialize_impl
    except ImportError:  # another triton: plain types, no hints (still a valid build)
        native_specialize_impl = None
    if native_specialize_impl is not None:
        return native_specialize_impl(
            backend, value, getattr(param, "is_const", False),
            not getattr(param, "do_not_specialize", False),
            not getattr(param, "do_not_specialize_on_alignment", False))
    if hasattr(value, "dtype"):
        return "*" + {"int16": "i16", "int64": "i64", "uint8": "u8"}.get(
            str(value.dtype).removeprefix("torch."), "i32"), None
    return ("i32" if -(2**31) <= value < 2**31 else "i64"), None


def _dedupe(variants: list[Variant]) -> list[Variant]:
    unique: dict[str, Variant] = {}
    for variant in variants:
        key = repr((variant.kernel, sorted(variant.signature.items()),
                    sorted(variant.constexprs.items()), sorted(variant.attrs.items()),
                    sorted(variant.options.items())))
        if key in unique:
            if variant.label not in unique[key].scenarios:
                unique[key].scenarios.append(variant.label)
        else:
            unique[key] = variant
    return list(unique.values())


__all__ = ["Variant", "compile_variants"]
