"""`hisparse.metrics.HiSparseCollector`: a real registry's text exposition, scraped after real
decode steps, against `cache.stats()`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("prometheus_client",
                    reason="prometheus_client is not installed (pip install 'hisparse[metrics]')")

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import hisparse
from hisparse.backends.base import Backend
from hisparse.errors import InvalidInputError
from hisparse.metrics import HiSparseCollector

COUNTERS = {  # exported name -> CacheStats total
    "hisparse_cache_hits_total": "hits",
    "hisparse_cache_misses_total": "misses",
    "hisparse_invalid_entries_total": "invalid",
    "hisparse_host_to_device_bytes_total": "bytes_host_to_device",
    "hisparse_device_to_host_bytes_total": "bytes_device_to_host",
}


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the text exposition, keyed by (name, sorted labels)."""
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def decode_steps(cache: hisparse.HiSparseCache, request_ids: list[str], steps: int,
                 generator: torch.Generator, invalid: int = 0) -> None:
    """`steps` decode steps; each group's anchor draws a top-k and its followers pass it on.
    The first `invalid` entries of every row are out of range (counted, returned as -1)."""
    config = cache.config
    for _ in range(steps):
        step = cache.begin_decode_step(request_ids)
        top_k = None
        for layer in range(config.num_layers):
            cache.write_newest(layer, torch.randint(
                0, 256, (len(request_ids), config.row_bytes), dtype=torch.uint8,
                generator=generator).to(cache.device))
            if layer % config.index_group_size == 0:  # the anchor of its index group
                rows = [torch.randperm(position + 1, generator=generator)[:config.top_k]
                        for position in step.positions]
                top_k = torch.stack(rows).to(torch.int32)
                top_k[:, :invalid] = 10**6  # past every seq_len
                top_k = top_k.to(cache.device)
            cache.swap_in(layer, top_k)
        cache.end_decode_step()


@pytest.fixture
def cache(backend: Backend, rng: torch.Generator):
    config = hisparse.HiSparseConfig.from_preset("tiny")
    with hisparse.HiSparseCache(config, device=backend) as cache:
        for request_id, tokens in (("a", 300), ("b", 200), ("c", 100)):
            cache.admit(request_id, tokens)
            cache.write_prefill(request_id, torch.randint(
                0, 256, (config.num_layers, tokens, config.row_bytes), dtype=torch.uint8,
                generator=rng).to(cache.device))
            cache.commit_prefill(request_id)
        yield cache


def test_a_scrape_reports_what_stats_reports_after_real_decode_steps(
    cache: hisparse.HiSparseCache, rng: torch.Generator,
) -> None:
    registry = CollectorRegistry()
    registry.register(HiSparseCollector(cache))
    decode_steps(cache, ["a", "b", "c"], 3, rng, invalid=2)
    cache.preempt("b")
    cache.finish("c")
    cache.admit("d", 50)  # prefilling
    stats = cache.stats()
    samples = scrape(registry)
    assert stats.hits > 0 and stats.misses > 0 and stats.invalid == 3 * 3 * 4 * 2
    for name, total in COUNTERS.items():
        assert samples[(name, ())] == getattr(stats, total), name
    occupancy = stats.occupancy
    row_bytes = cache.config.num_layers * cache.config.row_bytes
    assert samples[("hisparse_host_pool_extents_used", ())] == occupancy.host_extents_used
    assert samples[("hisparse_host_pool_extents_capacity", ())] == occupancy.host_extents_total
    rows_used = samples[("hisparse_host_pool_rows_used", ())]
    assert rows_used == occupancy.host_rows_used == 303 + 203 + 50  # c's rows were freed
    assert samples[("hisparse_host_pool_fragmentation_rows", ())] == (
        occupancy.internal_fragmentation_rows)
    assert samples[("hisparse_host_pool_used_bytes", ())] == (
        occupancy.host_extents_used * cache.config.extent_tokens * row_bytes)
    assert samples[("hisparse_host_pool_capacity_bytes", ())] == cache.config.host_pool_bytes
    assert samples[("hisparse_hot_buffers_used", ())] == occupancy.request_slots_used == 2
    assert samples[("hisparse_hot_buffers_capacity", ())] == cache.config.max_requests
    by_state = {labels[0][1]: value for (name, labels), value in samples.items()
                if name == "hisparse_requests"}
    assert by_state == {"reserved": 0, "prefilling": 1, "running": 1, "preempted": 1,
                        "finished": 0, "aborted": 0}
    # Computed at scrape time: another step shows in the next scrape.
    decode_steps(cache, ["a"], 1, rng)
    later = scrape(registry)
    stats = cache.stats()
    assert later[("hisparse_cache_hits_total", ())] + later[
        ("hisparse_cache_misses_total", ())] == stats.hits + stats.misses > stats.invalid
    assert later[("hisparse_cache_hits_total", ())] == stats.hits
    assert later[("hisparse_host_pool_rows_used", ())] == 304 + 203 + 50


def test_by_index_group_labels_the_counters_with_one_series_per_group(
    cache: hisparse.HiSparseCache, rng: torch.Generator,
) -> None:
    registry = CollectorRegistry()
    registry.register(HiSparseCollector(cache, labels={"tp_rank": "3"}, by_index_group=True))
    decode_steps(cache, ["a", "b"], 2, rng)
    stats = cache.stats()
    samples = scrape(registry)
    size = cache.config.index_group_size
    for name, field in COUNTERS.items():
        series = {dict(labels)["index_group"]: value for (sample, labels), value in
                  samples.items() if sample == name}
        assert series == {
            str(group): sum(getattr(layer, field) for layer in stats.layers
                            if layer.layer // size == group)
            for group in range(cache.config.num_index_groups)
        }, name
    # Every sample carries the constant label; no label names a request.
    assert all(dict(labels).get("tp_rank") == "3" for _, labels in samples)
    names = {label for _, labels in samples for label, _ in labels}
    assert names == {"tp_rank", "index_group", "state"}


def test_a_second_collector_of_the_same_names_is_refused_and_a_closed_cache_reports_nothing(
    cache: hisparse.HiSparseCache,
) -> None:
    registry = CollectorRegistry()
    registry.register(HiSparseCollector(cache))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(HiSparseCollector(cache))
    with pytest.raises(InvalidInputError, match="'state' is one hisparse sets itself"):
        HiSparseCollector(cache, labels={"state": "x"})
    assert ("hisparse_cache_hits_total", ()) in scrape(registry)
    cache.close()
    assert not [key for key in scrape(registry) if key[0].startswith("hisparse_")]
