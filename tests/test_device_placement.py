"""Which device a cache lives on, and who may drive it from where: a cache built for "cuda" (or
the default device) pins the GPU its tables live on, so the device checks refuse a tensor on
another GPU; bookkeeping works from any thread; a decode step needs the cache's device current."""

from __future__ import annotations

import pytest
import torch

import hisparse
from hisparse.errors import BackendUnavailableError, InvalidInputError
from test_cache_lifecycle import decode_and_check, on_a_new_thread
from test_engine_trace import assert_unchanged, build_cache, snapshot

BACKENDS = hisparse.available_backends()
TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices",
)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_the_cache_device_is_the_one_its_tables_live_on(backend_name: str) -> None:
    config = hisparse.HiSparseConfig.from_preset("tiny", max_requests=2)
    with hisparse.HiSparseCache(config, device=backend_name) as cache:
        assert cache.device == cache.device_kv(0).device == cache.tables.last_use.device


def test_the_default_device_is_the_one_its_tables_live_on() -> None:
    config = hisparse.HiSparseConfig.from_preset("tiny", max_requests=2)
    with hisparse.HiSparseCache(config) as cache:
        assert cache.device == cache.device_kv(0).device == cache.tables.last_use.device


@TWO_GPUS
@pytest.mark.parametrize("current", [0, 1])
def test_tensors_on_another_gpu_are_refused(current: int, rng: torch.Generator) -> None:
    config = hisparse.HiSparseConfig.from_preset("tiny", max_requests=2)
    # Driven with its GPU current: the Triton kernels launch on the current device.
    with torch.cuda.device(current):
        _refuse_the_other_gpu(hisparse.HiSparseCache(config, device="cuda"), current, rng)


def _refuse_the_other_gpu(cache: hisparse.HiSparseCache, current: int,
                          rng: torch.Generator) -> None:
    config, width = cache.config, cache.row_bytes
    mine, other = torch.device("cuda", current), torch.device("cuda", 1 - current)
    assert cache.device == mine
    prompt = torch.randint(0, 256, (config.num_layers, 40, width), dtype=torch.uint8,
                           generator=rng)
    cache.admit("a", 40)
    before = snapshot(cache)
    with pytest.raises(InvalidInputError, match=f"kv is on {other}"):
        cache.write_prefill("a", prompt.to(other))
    assert_unchanged(before, cache)
    cache.write_prefill("a", prompt.to(mine))
    cache.commit_prefill("a")
    cache.begin_decode_step(["a"])
    newest = torch.randint(0, 256, (1, width), dtype=torch.uint8, generator=rng)
    top_k = torch.full((1, config.top_k), -1, dtype=torch.int32)
    chosen = torch.randperm(41, generator=rng)[: config.top_k]
    top_k[0, : chosen.numel()] = chosen.to(torch.int32)
    before = snapshot(cache)
    with pytest.raises(InvalidInputError, match=f"got {other}"):
        cache.write_newest(0, newest.to(other))
    with pytest.raises(InvalidInputError, match=f"got {other}"):
        cache.swap_in(0, top_k.to(other))
    assert_unchanged(before, cache)
    for layer in range(config.num_layers):
        cache.write_newest(layer, newest.to(mine))
    rows = cache.swap_in(0, top_k.to(mine))[0].long()
    every = torch.cat([prompt[0], newest], dim=0)
    assert torch.equal(cache.device_kv(0)[rows[: chosen.numel()]].cpu(), every[chosen])
    cache.end_decode_step()
    cache.close()


ACCELERATORS = [name for name in BACKENDS if hisparse.get_backend(name).device_count() is not None]


@pytest.mark.skipif(not ACCELERATORS, reason="needs an accelerator (the CPU takes any index)")
@pytest.mark.parametrize("backend_name", ACCELERATORS)
def test_a_device_index_that_is_not_there_is_refused_before_allocating(
    backend_name: str,
) -> None:
    config = hisparse.HiSparseConfig.from_preset("tiny", max_requests=2)
    count = hisparse.get_backend(backend_name).device_count()
    with pytest.raises(BackendUnavailableError, match=f"sees {count} device"):
        hisparse.HiSparseCache(config, device=f"{backend_name}:{count}")
    with pytest.raises(BackendUnavailableError, match="not a device index"):
        hisparse.HiSparseCache(config, device=f"{backend_name}:first")


@TWO_GPUS
def test_a_cache_on_the_second_gpu_serves_threads_with_the_first_current(
    rng: torch.Generator,
) -> None:
    """A new thread starts with device 0 current. Its bookkeeping (admit, prefill, finish)
    runs on the cache's device; a decode step it begins is refused with the way out, changing
    nothing; with the cache's device made current the step decodes byte-exact."""

    def drive() -> None:
        assert torch.cuda.current_device() == 0
        cache.admit("a", 5)
        cache.write_prefill("a", torch.zeros(cache.num_layers, 5, cache.row_bytes,
                                             dtype=torch.uint8, device=cache.device))
        cache.commit_prefill("a")
        before = snapshot(cache)
        with pytest.raises(InvalidInputError, match=r"torch.cuda.set_device\(1\)"):
            cache.begin_decode_step(["a"])
        assert_unchanged(before, cache)
        cache.finish("a")
        with torch.cuda.device(1):
            decode_and_check(cache, rng)

    with torch.cuda.device(0):
        cache = build_cache("cuda:1", hot=8, top_k=4, extent=4, group=2, validate=True,
                            pool_extents=32)
        assert cache.device == torch.device("cuda", 1)
        on_a_new_thread(drive)
    assert cache.stats().misses > 0  # the long request really swapped rows in
    cache.close()
