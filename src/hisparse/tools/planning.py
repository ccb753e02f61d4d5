"""Capacity arithmetic behind `hisparse plan`: how many requests fit, with and without HiSparse.

Pure integer arithmetic on sizes; no torch. Every formula is spelled out in `FORMULAS`, which
the CLI prints in its help, and each is checked against a hand calculation in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hisparse.errors import InvalidInputError
from hisparse.layout.index_schedule import IndexSchedule
from hisparse.layout.widths import resident_entry_bytes

GIB = 1 << 30
INT32_BYTES = 4
# The DSA indexer key of DeepSeek-V3.2 and GLM-5: 128 FP8 values + one fp32 scale, per token
# per indexer (vLLM's mla/indexer.py). It stays on the device with or without HiSparse. Layers
# that share an indexer's top-k (IndexShare, IndexCache) have no indexer, so no keys: one per
# index group.
DSA_INDEXER_KEY_BYTES = 132

FORMULAS = """\
Arithmetic (per request; W = row bytes, L = layers, G = ceil(L / index-group-size),
I = indexer-key bytes (one indexer per group), H = hot slots, E = extent tokens,
C = context tokens, C_E = C rounded up to whole extents, K = top-k, m = miss rate):
  available device bytes   = gpu-mem - weights - reserve
  without HiSparse         = C * (L * W + G * I)               (full KV + indexer keys)
  with HiSparse            = (H+1) * L * W                     (hot buffer + newest slot)
                           + C * G * I                         (indexer keys, full context)
                           + G * (2 * H + 1) * 4               (last_use + slot_key + LRU
                                                                clock, int32)
                           + ceil(C/E) * 4 + 4                 (page table + seq_len)
                           + G * C_E * 2 * a                   (resident map, 2 B per host row,
                                                                or per position when keyed
                                                                by position; 4 B when
                                                                H > 32767; a = 1 + the
                                                                alias key extents over the
                                                                pool's under host_row, else 1)
  concurrent requests      = floor(available / per-request bytes)   [then capped by --host-mem-gib,
                                                                and by a --config file's
                                                                max_requests and
                                                                host_pool_tokens]
  host pool                = requests * C_E * L * W
                           - (N - 1) * P_E * L * W             (N of the requests share a
                                                                P-token prefix: its whole
                                                                extents, P_E = floor(P/E)*E,
                                                                held once; the boundary
                                                                extent is copied per request)
  H2D bytes per step       = requests * L * m * K * W          (0 while C <= H: no copies)
  H2D time per step        = H2D bytes / link bandwidth
  D2H bytes per step       = requests * L * W                  (newest-token backup)"""


@dataclass(frozen=True)
class ModelShape:
    """The per-token sizes of a model that decide its memory footprint."""

    name: str
    num_layers: int
    row_bytes: int  # one token, one layer, in the KV dtype
    indexer_key_bytes: int = DSA_INDEXER_KEY_BYTES  # per token, for each group's indexer
    index_group_size: int | None = 1  # layers sharing one indexer top-k share one residency table
    index_anchors: tuple[int, ...] | None = None  # the layers that run an indexer, if given

    @property
    def schedule(self) -> IndexSchedule:
        """Which layers run an indexer: `index_anchors`, else every `index_group_size`-th."""
        if self.index_anchors is not None:
            return IndexSchedule(self.num_layers, tuple(self.index_anchors))
        return IndexSchedule.uniform(self.num_layers,
                                     min(self.index_group_size or 1, self.num_layers))

    @property
    def num_groups(self) -> int:
        return self.schedule.num_groups


@dataclass(frozen=True)
class PlanSettings:
    """The deployment being planned: one GPU's budget and the cache geometry."""

    gpu_mem_bytes: int
    weights_bytes: int
    reserve_bytes: int
    top_k: int
    hot_slots: int  # H
    extent_tokens: int  # E
    miss_rate: float  # fraction of a long request's top-k entries that miss, per layer
    link_bytes_per_s: float  # host-to-device bandwidth
    host_mem_bytes: int | None = None  # cap on the host pool; None = unlimited
    # D: slots per request besides the LRU's (the newest token, a verify step's drafts)
    reserved_slots: int = 1
    shared_prefix_tokens: int = 0  # P: a prefix that `sharing_requests` of the requests share
    sharing_requests: int | None = None  # N; None = every request the plan fits
    # Tensor-parallel ranks of one node that hold the same requests (MLA's latent KV is the
    # same on each): host memory per node is tp pools, or one shared pool (issue 23).
    tp_ranks: int = 1
    # Residency-map entries per context token: 1 keyed by position or by host row alone;
    # host_row with alias key extents (shared prefixes) adds alias_extents / the pool's
    # extents more (the default, as many aliases as extents: 2).
    resident_entries_per_token: float = 1.0
    # What a cache's config admits at most (None: not fixed, the plan says what to set):
    # its request slots, and its host pool's tokens per layer (rounded up to whole extents).
    max_requests: int | None = None
    host_pool_tokens: int | None = None

    @property
    def available_bytes(self) -> int:
        return self.gpu_mem_bytes - self.weights_bytes - self.reserve_bytes


@dataclass(frozen=True)
class HiSparseFootprint:
    """Device bytes one request holds under HiSparse, by what holds them."""

    hot_rows: int
    indexer_keys: int
    lru_tables: int
    page_table: int  # extent ids plus the seq_len entry
    resident_map: int

    @property
    def total(self) -> int:
        return (
            self.hot_rows + self.indexer_keys + self.lru_tables + self.page_table
            + self.resident_map
        )


@dataclass(frozen=True)
class ContextPlan:
    """The answer for one context length."""

    context_tokens: int
    baseline_request_bytes: int
    baseline_max_requests: int
    hisparse_request_bytes: int
    hisparse_footprint: HiSparseFootprint
    hisparse_max_requests: int
    limited_by: str  # "device" or "host": which memory caps the HiSparse concurrency
    host_request_bytes: int
    host_pool_bytes: int
    h2d_bytes_per_step: float
    h2d_seconds_per_step: float
    d2h_bytes_per_step: int
    sharing_requests: int = 0  # requests of the plan that share the prefix (N, at most all)
    host_bytes_saved: int = 0  # host pool bytes the shared prefix saves: (N - 1) * P_E * L * W
    tp_ranks: int = 1
    host_node_bytes_private: int = 0  # tp_ranks pools, one per rank (no shared pool)
    host_node_bytes_shared: int = 0  # one pool the ranks share, plus its metadata header
    host_pool_tokens: int = 0  # the pool's tokens per layer: what to set host_pool_tokens to

    @property
    def gain(self) -> float | None:
        """HiSparse concurrency over the baseline's; None when the baseline fits nothing."""
        if self.baseline_max_requests == 0:
            return None
        return self.hisparse_max_requests / self.baseline_max_requests

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["hisparse_footprint"] = {
            **asdict(self.hisparse_footprint), "total": self.hisparse_footprint.total
        }
        data["gain"] = self.gain
        return data


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def baseline_request_bytes(shape: ModelShape, context_tokens: int) -> int:
    return context_tokens * (
        shape.num_layers * shape.row_bytes + shape.num_groups * shape.indexer_key_bytes
    )


def hisparse_footprint(
    shape: ModelShape, settings: PlanSettings, context_tokens: int
) -> HiSparseFootprint:
    groups = shape.num_groups
    return HiSparseFootprint(
        hot_rows=(settings.hot_slots + settings.reserved_slots) * shape.num_layers
        * shape.row_bytes,
        indexer_keys=context_tokens * groups * shape.indexer_key_bytes,
        lru_tables=groups * (2 * settings.hot_slots + 1) * INT32_BYTES,
        page_table=(math.ceil(context_tokens / settings.extent_tokens) + 1) * INT32_BYTES,
        resident_map=math.ceil(groups * round_up(context_tokens, settings.extent_tokens)
                               * settings.resident_entries_per_token)
        * resident_entry_bytes(settings.hot_slots),
    )


def host_request_bytes(shape: ModelShape, settings: PlanSettings, context_tokens: int) -> int:
    """Host pool bytes one request owns: whole extents, every layer."""
    return round_up(context_tokens, settings.extent_tokens) * shape.num_layers * shape.row_bytes


def validate(shape: ModelShape, settings: PlanSettings, contexts: Sequence[int]) -> None:
    """Raise InvalidInputError listing every value that makes the plan meaningless."""
    problems = []
    for name in ("num_layers", "row_bytes", "index_group_size"):
        value = getattr(shape, name)
        if value is not None and value < 1:
            problems.append(f"{name} must be >= 1, got {value}")
    if shape.index_anchors is not None:
        problems.extend(IndexSchedule.problems(shape.num_layers, shape.index_anchors))
    if shape.indexer_key_bytes < 0:
        problems.append(f"indexer_key_bytes must be >= 0, got {shape.indexer_key_bytes}")
    if settings.top_k < 1:
        problems.append(f"top_k must be >= 1, got {settings.top_k}")
    if settings.hot_slots < settings.top_k:
        problems.append(
            f"hot buffer ({settings.hot_slots} slots) must hold at least top_k "
            f"({settings.top_k}); raise the hot buffer or lower top_k"
        )
    if settings.extent_tokens < 1:
        problems.append(f"extent_tokens must be >= 1, got {settings.extent_tokens}")
    if not 0.0 <= settings.miss_rate <= 1.0:
        problems.append(f"miss rate must be in [0, 1], got {settings.miss_rate}")
    if settings.link_bytes_per_s <= 0:
        problems.append(f"link bandwidth must be > 0, got {settings.link_bytes_per_s}")
    if settings.available_bytes <= 0:
        problems.append(
            f"weights + reserve ({(settings.weights_bytes + settings.reserve_bytes) / GIB:g} GiB)"
            f" leave no room in {settings.gpu_mem_bytes / GIB:g} GiB of GPU memory"
        )
    bad = [c for c in contexts if c < 1]
    if bad or not contexts:
        problems.append(f"context lengths must be >= 1 token, got {list(contexts)}")
    prefix = settings.shared_prefix_tokens
    if prefix < 0:
        problems.append(f"shared prefix must be >= 0 tokens, got {prefix}")
    shorter = [c for c in contexts if c < prefix]
    if shorter:
        problems.append(
            f"shared prefix ({prefix} tokens) is longer than context {shorter}; a request "
            "holds at least its prefix"
        )
    if settings.sharing_requests is not None and settings.sharing_requests < 1:
        problems.append(f"sharing requests must be >= 1, got {settings.sharing_requests}")
    if problems:
        raise InvalidInputError("; ".join(problems))


def plan_context(shape: ModelShape, settings: PlanSettings, context_tokens: int) -> ContextPlan:
    available = settings.available_bytes
    baseline_bytes = baseline_request_bytes(shape, context_tokens)
    footprint = hisparse_footprint(shape, settings, context_tokens)
    host_bytes = host_request_bytes(shape, settings, context_tokens)

    requests = available // footprint.total
    limited_by = "device"
    if settings.host_mem_bytes is not None and host_pool(
            shape, settings, context_tokens, requests) > settings.host_mem_bytes:
        requests = _most_requests_in(shape, settings, context_tokens, settings.host_mem_bytes,
                                     requests)
        limited_by = "host"
    requests, limited_by = _config_caps(shape, settings, context_tokens, requests, limited_by)
    pool_bytes = host_pool(shape, settings, context_tokens, requests)

    # A request no longer than its hot buffer is served from it without copies.
    long_regime = context_tokens > settings.hot_slots
    misses_per_layer = settings.miss_rate * settings.top_k if long_regime else 0.0
    h2d_bytes = requests * shape.num_layers * misses_per_layer * shape.row_bytes
    return ContextPlan(
        context_tokens=context_tokens,
        baseline_request_bytes=baseline_bytes,
        baseline_max_requests=available // baseline_bytes,
        hisparse_request_bytes=footprint.total,
        hisparse_footprint=footprint,
        hisparse_max_requests=requests,
        limited_by=limited_by,
        host_request_bytes=host_bytes,
        host_pool_bytes=pool_bytes,
        h2d_bytes_per_step=h2d_bytes,
        h2d_seconds_per_step=h2d_bytes / settings.link_bytes_per_s,
        d2h_bytes_per_step=requests * shape.num_layers * shape.row_bytes,
        sharing_requests=_sharing(settings, requests),
        host_bytes_saved=requests * host_bytes - pool_bytes,
        tp_ranks=settings.tp_ranks,
        host_node_bytes_private=settings.tp_ranks * pool_bytes,
        host_node_bytes_shared=pool_bytes + shared_pool_metadata_bytes(settings.tp_ranks),
        host_pool_tokens=host_pool_rows(settings, context_tokens, requests),
    )


def _config_caps(shape: ModelShape, settings: PlanSettings, context_tokens: int,
                 requests: int, limited_by: str) -> tuple[int, str]:
    """`requests` capped by what the config admits: its max_requests, then the requests
    whose extents its host_pool_tokens holds; and which limit capped them."""
    if settings.max_requests is not None and requests > settings.max_requests:
        requests, limited_by = settings.max_requests, "max_requests"
    if settings.host_pool_tokens is not None:
        rows = round_up(settings.host_pool_tokens, settings.extent_tokens)
        if host_pool_rows(settings, context_tokens, requests) > rows:
            pool_bytes = rows * shape.num_layers * shape.row_bytes
            requests = _most_requests_in(shape, settings, context_tokens, pool_bytes, requests)
            limited_by = "host_pool_tokens"
    return requests, limited_by


@dataclass(frozen=True)
class RequestsFit:
    """Whether `requests` requests of `context_tokens` fit, and what a cache for them sets."""

    requests: int
    context_tokens: int
    device_bytes: int  # the requests' HiSparse device bytes
    available_bytes: int
    host_pool_bytes: int
    host_pool_tokens: int  # what to set host_pool_tokens to (whole extents)
    problems: tuple[str, ...]  # why they do not fit (empty: they fit)

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "problems": list(self.problems), "fits": self.fits}


def requests_fit(shape: ModelShape, settings: PlanSettings, context_tokens: int,
                 requests: int) -> RequestsFit:
    """Do `requests` requests of `context_tokens` fit the device, the host cap and the
    config's limits (`settings.max_requests`, `settings.host_pool_tokens`)?"""
    device = requests * hisparse_footprint(shape, settings, context_tokens).total
    pool = host_pool(shape, settings, context_tokens, requests)
    rows = host_pool_rows(settings, context_tokens, requests)
    problems = []  # each names the limit they exceed
    if device > settings.available_bytes:
        problems.append("the device budget")
    if settings.host_mem_bytes is not None and pool > settings.host_mem_bytes:
        problems.append(f"the host memory cap of {settings.host_mem_bytes} B")
    if settings.max_requests is not None and requests > settings.max_requests:
        problems.append(f"the config's max_requests {settings.max_requests}")
    if settings.host_pool_tokens is not None and (
            rows > round_up(settings.host_pool_tokens, settings.extent_tokens)):
        problems.append(f"the config's host_pool_tokens {settings.host_pool_tokens}")
    return RequestsFit(requests, context_tokens, device, settings.available_bytes, pool, rows,
                       tuple(problems))


def shared_pool_metadata_bytes(tp_ranks: int) -> int:
    """The header of a shared pool's segment (core/shared_segment.py): layout, rank slots
    and decision-hash rings; 0 for one rank, which keeps a private pool."""
    if tp_ranks <= 1:
        return 0
    from hisparse.core.shared_segment import SegmentLayout

    return SegmentLayout(1, 1, 1, 1, tp_ranks, 0).header_bytes


def _sharing(settings: PlanSettings, requests: int) -> int:
    """How many of `requests` share the prefix: N, at most all of them; 0 without one."""
    if not settings.shared_prefix_tokens:
        return 0
    wanted = settings.sharing_requests
    return requests if wanted is None else min(wanted, requests)


def host_pool_rows(settings: PlanSettings, context_tokens: int, requests: int) -> int:
    """Host pool rows per layer for `requests` requests of `context_tokens`: whole extents
    each, less the whole extents of the shared prefix that all but one of its sharers hold by
    reference (core/prefixes.py: the boundary extent is each request's own copy)."""
    whole_prefix = settings.shared_prefix_tokens // settings.extent_tokens * settings.extent_tokens
    sharers = _sharing(settings, requests)
    rows = requests * round_up(context_tokens, settings.extent_tokens)
    return rows - max(0, sharers - 1) * whole_prefix


def host_pool(shape: ModelShape, settings: PlanSettings, context_tokens: int,
              requests: int) -> int:
    """Host pool bytes for `requests` requests of `context_tokens`: `host_pool_rows` of
    every layer."""
    return host_pool_rows(settings, context_tokens, requests) * shape.num_layers * shape.row_bytes


def _most_requests_in(shape: ModelShape, settings: PlanSettings, context_tokens: int,
                      host_mem_bytes: int, too_many: int) -> int:
    """The most requests, below `too_many` (whose pool does not fit), whose host pool fits
    `host_mem_bytes`. The pool never shrinks with one more request: it grows by the request's
    own extents, or by whole extents past the N sharers of the prefix, so a bisection finds it.
    """
    fits = 0
    while too_many - fits > 1:  # host_pool(fits) <= host_mem_bytes < host_pool(too_many)
        middle = (fits + too_many) // 2
        if host_pool(shape, settings, context_tokens, middle) <= host_mem_bytes:
            fits = middle
        else:
            too_many = middle
    return fits


def plan(
    shape: ModelShape, settings: PlanSettings, contexts: Sequence[int]
) -> list[ContextPlan]:
    """One ContextPlan per context length; raises InvalidInputError on meaningless inputs."""
    validate(shape, settings, contexts)
    return [plan_context(shape, settings, c) for c in contexts]
