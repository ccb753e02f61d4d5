"""Prometheus metrics of one `HiSparseCache`, computed from `cache.stats()` at scrape time.

Needs the optional `prometheus_client` (`pip install 'hisparse[metrics]'`). A serving
framework registers the collector in its own registry, next to its own metrics::

    from prometheus_client import CollectorRegistry
    from hisparse.metrics import HiSparseCollector

    registry = CollectorRegistry()
    registry.register(HiSparseCollector(cache))

Nothing is counted twice and nothing runs on the decode path: every scrape calls
`cache.stats()` once (one host sync that reads the kernels' device counters) and turns it
into metric families. Label cardinality is bounded: no labels by default, `index_group` (one
value per index group, at most `num_layers`) with `by_index_group=True`, `state` (the six
request states) on the request gauge, plus the constant `labels` the framework passes. Never a
request id. docs/metrics.md lists every metric and what is not exported (swap-in time: the
cache does not measure it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from hisparse.errors import InvalidInputError, MissingDependencyError, RequestStateError

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised in a venv without the extra
    raise MissingDependencyError(
        "hisparse.metrics needs prometheus_client, which is not installed; install the "
        "metrics extra: pip install 'hisparse[metrics]'"
    ) from exc

from hisparse.core.requests import RequestState

if TYPE_CHECKING:
    from hisparse.core.engine import HiSparseCache
    from hisparse.core.stats import CacheStats, LayerStats

logger = logging.getLogger(__name__)

PREFIX = "hisparse"

# Counters summed over layers: (name without _total, help, LayerStats field).
_COUNTERS = (
    ("cache_hits", "Top-k entries found in a hot buffer, summed over layers "
     "(every layer of an index group looks its top-k up).", "hits"),
    ("cache_misses", "Top-k entries copied from the host pool into a hot buffer, summed over "
     "layers.", "misses"),
    ("invalid_entries", "Top-k entries outside [-1, seq_len): ignored and returned as -1.",
     "invalid"),
    ("host_to_device_bytes", "Bytes copied from the host pool to the device: misses and "
     "hot-buffer seeding (none under the skip-IO probe).", "bytes_host_to_device"),
    ("device_to_host_bytes", "Bytes copied to the host pool: newest-token backups and prefill "
     "offload.", "bytes_device_to_host"),
)


class HiSparseCollector(Collector):
    """A Prometheus collector for one cache; register it in the framework's registry.

    Args:
        cache: the `HiSparseCache` to report. Its `stats()` is called once per scrape, from
            the scraping thread (allowed while the model thread decodes: docs/reliability.md,
            "Threads"); a scrape during a decode step may see part of that step's counts.
        labels: constant labels added to every sample, e.g. `{"tp_rank": "0"}` where one
            process holds several caches, each in its own collector and registry or told apart
            by the framework's target labels.
        by_index_group: label the counters by `index_group` (one series per group, at most
            `num_layers`) instead of reporting totals only.

    After `cache.close()` a scrape reports nothing for this cache.
    """

    def __init__(
        self,
        cache: HiSparseCache,
        labels: Mapping[str, str] | None = None,
        by_index_group: bool = False,
    ) -> None:
        self._cache = cache
        self._labels = dict(labels or {})
        for name in self._labels:
            if name in ("index_group", "state"):
                raise InvalidInputError(
                    f"label {name!r} is one hisparse sets itself; pick another name")
        self._by_group = by_index_group

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples, so a registry refuses a second collector that
        would export the same names (without reading the cache)."""
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._cache.stats()
        except RequestStateError:  # closed: the cache no longer exists to report on
            logger.debug("hisparse cache is closed; no metrics this scrape")
            return
        yield from self._families(stats)

    # --- building ------------------------------------------------------------------------
    def _families(self, stats: CacheStats | None) -> Iterator[Metric]:
        const = list(self._labels)
        group_labels = [*const, "index_group"] if self._by_group else const
        for name, documentation, field in _COUNTERS:
            family = CounterMetricFamily(f"{PREFIX}_{name}", documentation, labels=group_labels)
            if stats is not None:
                for group, value in self._grouped(stats.layers, field):
                    family.add_metric(self._values(group), value)
            yield family

        gauges = self._occupancy(stats)
        for name, documentation, value in gauges:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=const)
            if stats is not None:
                family.add_metric(self._values(None), value)
            yield family

        requests = GaugeMetricFamily(f"{PREFIX}_requests", "Requests the cache holds, by state.",
                                     labels=[*const, "state"])
        if stats is not None:
            by_state = stats.occupancy.requests_by_state
            for state in RequestState:
                requests.add_metric([*self._values(None), state.value],
                                    by_state.get(state.value, 0))
        yield requests

    def _grouped(self, layers: Sequence[LayerStats], field: str) -> list[tuple[int | None, int]]:
        if not self._by_group:
            return [(None, sum(getattr(layer, field) for layer in layers))]
        schedule = self._cache.config.index_schedule
        totals: dict[int, int] = {}
        for layer in layers:
            group = schedule.group_of(layer.layer)
            totals[group] = totals.get(group, 0) + getattr(layer, field)
        return sorted(totals.items())

    def _values(self, group: int | None) -> list[str]:
        values = list(self._labels.values())
        return values if group is None else [*values, str(group)]

    def _occupancy(self, stats: CacheStats | None) -> list[tuple[str, str, float]]:
        config = self._cache.config
        occupancy = stats.occupancy if stats is not None else None

        def read(field: str) -> int:
            return 0 if occupancy is None else getattr(occupancy, field)

        layer_row_bytes = config.num_layers * config.row_bytes  # one token, every layer
        return [
            ("host_pool_extents_used", "Host pool extents owned by requests.",
             read("host_extents_used")),
            ("host_pool_extents_capacity", "Host pool extents in all.",
             read("host_extents_total")),
            ("host_pool_rows_used", "Host pool rows holding a token (per layer).",
             read("host_rows_used")),
            ("host_pool_fragmentation_rows", "Rows of owned extents that hold no token yet "
             "(per layer).", read("internal_fragmentation_rows")),
            ("host_pool_used_bytes", "Host pool bytes owned by requests (whole extents, every "
             "layer).", read("host_extents_used") * config.extent_tokens * layer_row_bytes),
            ("host_pool_capacity_bytes", "Host pool bytes in all.",
             read("host_rows_total") * layer_row_bytes),
            ("hot_buffers_used", "Device request slots holding a request's hot buffers (one "
             "per index group and layer); filled hot rows are not counted.",
             read("request_slots_used")),
            ("hot_buffers_capacity", "Device request slots (max_requests).",
             read("request_slots_total")),
        ]
