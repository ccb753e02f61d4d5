"""The device tables' memory pre-check: their bytes computed from the config alone (checked
against the tables a cache really builds), and a config whose tables do not fit the free
device memory refused with a ConfigError before anything is allocated."""

from __future__ import annotations

import random

import pytest
import torch

import hisparse
from hisparse.core import device_memory
from hisparse.errors import ConfigError


def random_config(rng: random.Random) -> hisparse.HiSparseConfig:
    top_k = rng.choice([4, 8, 16])
    drafts = rng.choice([1, 2, 4])
    extent = rng.choice([4, 8, 16])
    max_seq_len = rng.randrange(8, 200)
    return hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=rng.randrange(1, 5), row_bytes=rng.choice([16, 32, 48]),
        top_k=top_k, hot_slots=top_k * (drafts + rng.choice([0, 1])), extent_tokens=extent,
        max_requests=rng.randrange(1, 6), max_seq_len=max_seq_len,
        host_pool_tokens=max_seq_len + extent * rng.randrange(0, 20),
        residency_map=rng.choice(["host_row", "position"]), index_group_size=1,
        max_draft_tokens=drafts,
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_estimate_is_the_bytes_of_the_tables_a_cache_builds(seed: int) -> None:
    config = random_config(random.Random(seed))
    with hisparse.HiSparseCache(config, device="cpu") as cache:
        tensors = [value for value in vars(cache.tables).values()
                   if isinstance(value, torch.Tensor)]
        built = sum(t.numel() * t.element_size() for t in tensors)
        estimate = device_memory.device_table_bytes(
            config, cache._pool.num_extents, cache.num_groups, cache.hot_slots)
        device_kv = cache.tables.device_kv.numel()
    assert sum(estimate.values()) == built, estimate
    assert estimate["device_kv"] == device_kv


def test_deepseek_at_128_requests_needs_the_bytes_the_allocation_asked_for() -> None:
    """The issue's case: 61 layers x (128 x 4097 slots + 1 sink row) x 656 B of device_kv,
    which `build_tables` asked for in one allocation and a 24 GiB CPU machine did not have."""
    config = hisparse.HiSparseConfig.from_preset("deepseek-v3.2", max_requests=128)
    estimate = device_memory.device_table_bytes(config, config.num_extents)
    assert estimate["device_kv"] == 20_985_070_672 == 61 * (128 * 4097 + 1) * 656


def test_tables_larger_than_free_memory_are_refused_before_any_allocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = hisparse.HiSparseConfig.from_preset("tiny", max_requests=8)
    needs = sum(device_memory.device_table_bytes(config, config.num_extents).values())
    free = needs // 3
    monkeypatch.setattr(device_memory, "free_device_bytes", lambda device: free)
    allocated = []
    real_zeros = torch.zeros
    monkeypatch.setattr("hisparse.core.slot_tables.torch.zeros",
                        lambda *a, **k: allocated.append(a) or real_zeros(*a, **k))
    with pytest.raises(ConfigError) as caught:
        hisparse.HiSparseCache(config, device="cpu")
    message = str(caught.value)
    assert f"{needs} B" in message and f"{free} B" in message, message
    assert "max_requests" in message and "hot_slots" in message, message
    assert allocated == []
    monkeypatch.setattr(device_memory, "free_device_bytes", lambda device: needs)
    hisparse.HiSparseCache(config, device="cpu").close()  # exactly enough: it builds


def test_free_device_memory_on_a_cpu_is_the_available_host_memory() -> None:
    free = device_memory.free_device_bytes(torch.device("cpu"))
    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo
                         if line.startswith("MemAvailable:"))
    assert free is not None and abs(free - available) < 512 << 20  # the machine moves on
