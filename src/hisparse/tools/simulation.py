"""Decode simulation behind `hisparse simulate`: a top-k trace model and the loop that drives
the real engine with it.

The trace model stands in for a DSA indexer. Each step's top-k is built from four parts:
  * the newest token (the indexer always sees it; the engine keeps it in its own slot);
  * persistent heavy hitters: a fixed set of positions chosen in every step (attention sinks,
    key tokens), each replaced by a fresh position with probability `heavy_churn` per step;
  * carry-over: positions kept from the previous step's top-k, so that exactly
    `round(carryover * k)` of the step's `k` entries were also in the previous step's (at most
    k-1: the newest token is always new; heavy hitters drawn anew this step come first);
  * fresh picks for the rest, never from the previous step's top-k: with probability
    `recency_bias` from the newest `recent_window` tokens, else uniform over the context.
The default carry-over of 0.6 follows the published evidence that about 60% of a step's
top-k is kept from the previous step (GVR, arXiv 2604.22312, for DeepSeek-V3.2's indexer;
ShadowKV reports about 60% too); use 0.95 for the upper figure some IndexCache work claims.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hisparse.errors import InvalidInputError

# Fresh picks are drawn by rejection: oversampling by this factor makes one round the common case.
_OVERSAMPLE = 2


@dataclass(frozen=True)
class TraceModel:
    """Knobs of the top-k trace; see the module docstring for what each one does."""

    top_k: int = 2048
    carryover: float = 0.6
    heavy_hitters: int | None = None  # None: top_k // 32, i.e. 64 of DeepSeek's 2048
    heavy_churn: float = 0.0
    recency_bias: float = 0.3
    recent_window: int = 4096

    def __post_init__(self) -> None:
        if self.heavy_hitters is None:
            object.__setattr__(self, "heavy_hitters", self.top_k // 32)
        problems = []
        if self.top_k < 1:
            problems.append(f"top_k must be >= 1, got {self.top_k}")
        for name in ("carryover", "heavy_churn", "recency_bias"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                problems.append(f"{name} must be a fraction in [0, 1], got {value}")
        if not 0 <= self.heavy_hitters <= self.top_k:  # type: ignore[operator]
            problems.append(
                f"heavy_hitters must be in [0, top_k={self.top_k}], got {self.heavy_hitters}"
            )
        if self.recent_window < 1:
            problems.append(f"recent_window must be >= 1, got {self.recent_window}")
        if problems:
            raise InvalidInputError("invalid trace model: " + "; ".join(problems))

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


class TopKTrace:
    """The top-k positions of one (request, index group) over successive decode steps."""

    def __init__(self, model: TraceModel, rng: np.random.Generator) -> None:
        self.model = model
        self.rng = rng
        self.previous = np.empty(0, dtype=np.int64)
        self.heavy = np.empty(0, dtype=np.int64)
        # Fraction of the last step's top-k not in the one before (None on the first step).
        self.last_churn: float | None = None

    def step(self, seq_len: int) -> np.ndarray:
        """Distinct positions in [0, seq_len) for a request of `seq_len` tokens, in top-k order.

        Returns min(top_k, seq_len) int64 positions, the newest (seq_len - 1) among them.
        """
        if seq_len < 1:
            raise InvalidInputError(f"seq_len must be >= 1 to draw a top-k, got {seq_len}")
        model, rng, n = self.model, self.rng, seq_len
        k = min(model.top_k, n)
        previous = self.previous[self.previous < n]
        taken = np.zeros(n, dtype=bool)
        in_previous = np.zeros(n, dtype=bool)
        in_previous[previous] = True

        taken[n - 1] = True
        self._refresh_heavy_hitters(n)
        heavy = self.heavy[: max(k - 1, 0)]
        taken[heavy] = True

        carried_target = round(model.carryover * k)
        carried_already = int(np.count_nonzero(taken & in_previous))
        carry_pool = previous[~taken[previous]]
        carry_count = min(max(carried_target - carried_already, 0), carry_pool.size,
                          k - int(taken.sum()))
        taken[rng.choice(carry_pool, size=carry_count, replace=False)] = True

        need = k - int(taken.sum())
        fresh = self._draw_fresh(n, need, excluded=taken | in_previous)
        taken[fresh] = True
        # Too few positions outside the previous top-k: top up from it (short contexts only).
        need = k - int(taken.sum())
        if need > 0:
            leftover = np.flatnonzero(~taken)
            taken[rng.choice(leftover, size=need, replace=False)] = True

        selected = np.flatnonzero(taken)
        self.last_churn = (
            1.0 - np.count_nonzero(in_previous[selected]) / k if self.previous.size else None
        )
        rng.shuffle(selected)  # an indexer's top-k comes in score order, not position order
        self.previous = selected
        return selected

    def _refresh_heavy_hitters(self, n: int) -> None:
        model, rng = self.model, self.rng
        wanted = min(int(model.heavy_hitters or 0), max(n - 1, 0))
        if self.heavy.size < wanted:
            # First step, or a context that was too short for all of them so far.
            existing = np.zeros(n - 1, dtype=bool)
            existing[self.heavy] = True
            added = self._draw_uniform_excluding(wanted - self.heavy.size, existing)
            self.heavy = np.concatenate([self.heavy, added])
            return
        if model.heavy_churn == 0 or self.heavy.size == 0:
            return
        replace = rng.random(self.heavy.size) < model.heavy_churn
        if replace.any():
            keep = np.zeros(n, dtype=bool)
            keep[self.heavy[~replace]] = True
            replacements = self._draw_uniform_excluding(int(replace.sum()), keep[: n - 1])
            self.heavy = np.concatenate([self.heavy[~replace], replacements])

    def _draw_uniform_excluding(self, count: int, excluded: np.ndarray) -> np.ndarray:
        free = np.flatnonzero(~excluded)
        return self.rng.choice(free, size=min(count, free.size), replace=False)

    def _draw_fresh(self, n: int, need: int, excluded: np.ndarray) -> np.ndarray:
        model, rng = self.model, self.rng
        excluded = excluded.copy()
        need = min(need, n - int(excluded.sum()))
        # Decide each pick's source first, so the window gets `recency_bias` of the picks even
        # when the previous top-k already covers much of it.
        window_start = max(0, n - model.recent_window)
        window_free = window_start + np.flatnonzero(~excluded[window_start:])
        recent_count = min(int(rng.binomial(need, model.recency_bias)), window_free.size)
        recent = rng.choice(window_free, size=recent_count, replace=False)
        excluded[recent] = True
        picks = [recent]
        need -= recent_count
        for _ in range(4):  # rejection rounds: a uniform draw over a long context rarely repeats
            if need == 0:
                break
            candidates = rng.integers(0, n, _OVERSAMPLE * need + 16)
            candidates = candidates[~excluded[candidates]]
            _, first = np.unique(candidates, return_index=True)
            candidates = candidates[np.sort(first)][:need]
            excluded[candidates] = True
            picks.append(candidates)
            need -= candidates.size
        if need > 0:  # a short or crowded context: draw the rest exactly
            picks.append(self._draw_uniform_excluding(need, excluded))
        return np.concatenate(picks)


def make_traces(
    model: TraceModel, num_requests: int, num_groups: int, seed: int
) -> list[list[TopKTrace]]:
    """traces[request][group], each with its own generator derived from `seed`."""
    return [
        [TopKTrace(model, np.random.default_rng([seed, request, group]))
         for group in range(num_groups)]
        for request in range(num_requests)
    ]


# --- the simulator loop ---------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What to run: `requests` requests with `context_tokens`-token prompts decode `steps` steps."""

    requests: int
    context_tokens: int
    steps: int
    warmup_steps: int
    trace: TraceModel
    seed: int = 0

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = asdict(self)
        data["trace"] = self.trace.to_dict()
        return data


@dataclass(frozen=True)
class StepRecord:
    step: int
    warmup: bool
    hits: int  # over all layers and requests
    misses: int
    bytes_host_to_device: int  # as counted by the engine
    swap_in_seconds: float  # every layer's swap_in, between two device synchronisations
    planning_seconds: float | None  # the same step with skip-IO: LRU and plan, no bytes moved
    churn: float | None  # mean fraction of a top-k not in the previous step's (None: first)

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 1.0


def sim_config(config: Any, workload: Workload) -> Any:
    """`config` resized so the pool and the request slots hold exactly this workload."""
    extent = config.extent_tokens
    final_len = workload.context_tokens + workload.steps
    extents_per_request = -(-final_len // extent) + 1  # +1: growth may open one more
    return config.replace(
        max_requests=workload.requests,
        max_batch=workload.requests,
        max_seq_len=final_len,
        host_pool_tokens=workload.requests * extents_per_request * extent,
    )


def prefill(cache: Any, workload: Workload, generator: Any) -> list[str]:
    """Admit every request with random prompt KV and seed its hot buffer."""
    import torch

    ids = [f"sim-{i}" for i in range(workload.requests)]
    for request_id in ids:
        cache.admit(request_id, workload.context_tokens)
        # One layer at a time keeps the staging tensor small at GPU sizes.
        for layer in range(cache.num_layers):
            kv = torch.randint(0, 256, (workload.context_tokens, cache.row_bytes),
                               dtype=torch.uint8, generator=generator)
            cache.write_prefill(request_id, kv, layer=layer)
        cache.commit_prefill(request_id)
    return ids


def run_pass(
    cache: Any,
    workload: Workload,
    on_step: Any = None,
) -> list[tuple[int, int, int, float, float | None]]:
    """Decode the workload once; per step: (hits, misses, bytes H2D, swap-in seconds, churn).

    Every pass regenerates the same traces from `workload.seed`, so a second pass on a fresh
    cache (e.g. with skip-IO) sees exactly the same top-k sequence and LRU decisions.
    """
    import time

    import numpy as np
    import torch

    backend = cache.backend
    groups = cache.num_groups
    group_of = cache.config.index_schedule.group_of
    top_k = cache.top_k
    traces = make_traces(workload.trace, workload.requests, groups, workload.seed)
    generator = torch.Generator().manual_seed(workload.seed)
    ids = prefill(cache, workload, generator)
    newest_kv = torch.randint(0, 256, (workload.requests, cache.row_bytes), dtype=torch.uint8,
                              generator=generator).to(cache.device)
    host_top_k = np.full((workload.requests, top_k), -1, dtype=np.int32)
    before = cache.stats()
    records = []
    for _ in range(workload.steps):
        step = cache.begin_decode_step(ids)
        churn = []
        group_top_k = []
        for group in range(groups):
            host_top_k.fill(-1)
            for row, position in enumerate(step.positions):
                chosen = traces[row][group].step(position + 1)
                host_top_k[row, : chosen.size] = chosen
                if traces[row][group].last_churn is not None:
                    churn.append(traces[row][group].last_churn)
            group_top_k.append(torch.from_numpy(host_top_k.copy()).to(cache.device))
        for layer in range(cache.num_layers):
            cache.write_newest(layer, newest_kv)
        backend.synchronize()
        start = time.perf_counter()
        for layer in range(cache.num_layers):
            cache.swap_in(layer, group_top_k[group_of(layer)])
        backend.synchronize()
        elapsed = time.perf_counter() - start
        cache.end_decode_step()
        after = cache.stats()
        records.append((
            after.hits - before.hits,
            after.misses - before.misses,
            after.bytes_host_to_device - before.bytes_host_to_device,
            elapsed,
            float(np.mean(churn)) if churn else None,
        ))
        before = after
        if on_step is not None:
            on_step()
    return records


@dataclass
class SimulationResult:
    backend: str
    device: str
    config: dict[str, Any]
    workload: Workload
    steps: list[StepRecord]
    split_note: str  # why planning/copy times are or are not reported
    host_pool_bytes: int
    peak_host_rss_bytes: int | None
    peak_device_bytes: int | None  # None where device tensors live in host memory
    disabled_features: list[str] = field(default_factory=list)

    def timed_steps(self) -> list[StepRecord]:
        timed = [s for s in self.steps if not s.warmup]
        return timed or self.steps

    def summary(self) -> dict[str, Any]:
        steps = self.timed_steps()
        hits = sum(s.hits for s in steps)
        misses = sum(s.misses for s in steps)
        moved = sum(s.bytes_host_to_device for s in steps)
        swap_in = [s.swap_in_seconds for s in steps]
        churn = [s.churn for s in steps if s.churn is not None]
        planning = [s.planning_seconds for s in steps if s.planning_seconds is not None]
        measured_split = len(planning) == len(steps)
        copy = [s.swap_in_seconds - s.planning_seconds for s in steps] if measured_split else []
        return {
            "timed_steps": len(steps),
            "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "hits_per_step": hits / len(steps),
            "misses_per_step": misses / len(steps),
            "bytes_host_to_device_per_step": moved / len(steps),
            "swap_in_seconds_per_step": float(np.median(swap_in)),
            "planning_seconds_per_step": float(np.median(planning)) if measured_split else None,
            "copy_seconds_per_step": float(np.median(copy)) if measured_split else None,
            **_spread_fields("swap_in", swap_in),
            **_spread_fields("planning", planning if measured_split else []),
            **_spread_fields("copy", copy),
            "host_to_device_bytes_per_second": moved / sum(swap_in) if sum(swap_in) else None,
            "measured_churn": float(np.mean(churn)) if churn else None,
            "host_pool_bytes": self.host_pool_bytes,
            "peak_host_rss_bytes": self.peak_host_rss_bytes,
            "peak_device_bytes": self.peak_device_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "config": self.config,
            "workload": self.workload.to_dict(),
            "summary": self.summary(),
            "split_note": self.split_note,
            "disabled_features": self.disabled_features,
            "steps": [{**asdict(s), "hit_rate": s.hit_rate} for s in self.steps],
        }


def _spread_fields(name: str, seconds: list[float]) -> dict[str, float | None]:
    """`{name}_seconds_p10` and `_p90` of per-step times (None without any)."""
    from hisparse.tools.benchmarking import spread

    p10, p90 = spread(seconds) if seconds else (None, None)
    return {f"{name}_seconds_p10": p10, f"{name}_seconds_p90": p90}


def peak_host_rss_bytes() -> int | None:
    """Peak resident memory of this process (the pool, torch and everything else)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    import sys

    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # Linux reports KiB


def _measure_planning(
    backend: Any,
    config: Any,
    target: Any,
    workload: Workload,
    main: list[Any],
    measure_planning: bool,
    on_pass: Any,
    on_step: Any,
) -> tuple[list[float | None], str]:
    """Each step's planning seconds from a skip-IO replay of the workload (None where not
    measured), and the note that says whether and how they were measured."""
    from hisparse.backends.features import Feature
    from hisparse.core.engine import HiSparseCache

    planning: list[float | None] = [None] * len(main)
    if not measure_planning:
        note = "not measured (--no-split)"
    elif not backend.features.supports(Feature.SKIP_IO_PROBE):
        support = backend.features[Feature.SKIP_IO_PROBE]
        note = f"not measured: the {backend.name} backend has no skip-IO probe ({support.reason})"
    else:
        with HiSparseCache(config.replace(skip_io=True), device=target) as probe_cache:
            if on_pass is not None:
                on_pass("skip-IO replay")
            probe = run_pass(probe_cache, workload, on_step)
        if [p[:2] for p in probe] == [m[:2] for m in main]:
            planning = [p[3] for p in probe]
            note = ("measured: the same trace replayed with skip-IO (planning and LRU, no "
                    "bytes moved); copy = swap-in - planning, per step")
        else:
            note = "not reported: the skip-IO replay saw different hits/misses than the run"
    return planning, note


def simulate(
    config: Any,
    workload: Workload,
    device: Any = None,
    measure_planning: bool = True,
    on_step: Any = None,
    on_pass: Any = None,
) -> SimulationResult:
    """Run `workload` on the real engine; with skip-IO where the backend has it, run it again
    without moving bytes to split each step's swap-in time into planning and copy.

    `on_pass(name)` is called before each pass over the workload's steps: "decode steps", then
    "skip-IO replay" where that runs; `on_step()` after every step of either pass."""
    import torch

    from hisparse.backends.registry import get_backend
    from hisparse.core.engine import HiSparseCache

    backend = get_backend(device)
    config = sim_config(config, workload)
    target = device if device is not None else backend
    measure_device = backend.torch_device_type != "cpu"  # else device tensors are host memory
    with HiSparseCache(config, device=target) as cache:
        if measure_device:  # the peak restarts at what is allocated now, the cache included
            torch.accelerator.reset_peak_memory_stats(cache.device)
        if on_pass is not None:
            on_pass("decode steps")
        main = run_pass(cache, workload, on_step)
        final = cache.stats()
        device_name = str(cache.device)
        effective_config = cache.config.to_dict()
        disabled = list(cache.disabled_features)
        host_pool = final.occupancy.host_rows_total * cache.num_layers * cache.row_bytes
        peak_device = (
            int(torch.accelerator.max_memory_allocated(cache.device)) if measure_device else None
        )

    planning, note = _measure_planning(backend, config, target, workload, main,
                                       measure_planning, on_pass, on_step)

    records = [
        StepRecord(
            step=index,
            warmup=index < workload.warmup_steps,
            hits=hits,
            misses=misses,
            bytes_host_to_device=moved,
            swap_in_seconds=seconds,
            planning_seconds=planned,
            churn=churn,
        )
        for index, ((hits, misses, moved, seconds, churn), planned)
        in enumerate(zip(main, planning, strict=True))
    ]
    return SimulationResult(
        backend=backend.name,
        device=device_name,
        config=effective_config,
        workload=workload,
        steps=records,
        split_note=note,
        host_pool_bytes=host_pool,
        peak_host_rss_bytes=peak_host_rss_bytes(),
        peak_device_bytes=peak_device,
        disabled_features=disabled,
    )
