"""The engine's lifecycle: memory released by close(), and a cache that works
whichever torch inference mode it was built or is driven in."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable

import pytest
import torch

import hisparse
from test_engine_trace import build_cache

W = 32  # test_engine_trace.ROW_BYTES
BACKENDS = hisparse.available_backends()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_close_lets_go_of_the_host_pool(backend_name: str) -> None:
    """close() promises to free the host pool; the engine's tables must not keep it alive
    (a `with HiSparseCache(...) as cache:` block leaves the name bound after it ends)."""
    config = hisparse.HiSparseConfig.from_preset("tiny")
    with hisparse.HiSparseCache(config, device=backend_name) as cache:
        layers = [weakref.ref(tensor) for tensor in cache.host_tensors()]
        assert all(ref() is not None for ref in layers)
    gc.collect()
    assert [ref() is None for ref in layers] == [True] * config.num_layers
    cache.close()  # still idempotent


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_close_lets_go_of_the_device_tables(backend_name: str, rng: torch.Generator) -> None:
    """A framework that closes a cache to build the next one needs its device memory back at
    close(), not whenever the object is collected: every device tensor of the engine (and the
    kernels' scratch, keyed on the tables) must be unreachable from the closed cache."""
    cache = build_cache(backend_name, hot=8, top_k=4, extent=4, group=2, validate=True,
                        pool_extents=32)
    decode_and_check(cache, rng)  # a step ran, so the kernels' scratch exists too
    device_tensors = [weakref.ref(value) for value in vars(cache.tables).values()
                      if isinstance(value, torch.Tensor)]
    device_tensors.append(weakref.ref(cache.tables))
    on_cuda = cache.device.type == "cuda"
    if on_cuda:  # where torch counts the device memory, check it came back
        torch.cuda.synchronize(cache.device)
        gc.collect()
        before = torch.cuda.memory_allocated(cache.device)
        device_kv_bytes = cache.tables.device_kv.numel()
    cache.close()
    gc.collect()
    assert [ref() is None for ref in device_tensors] == [True] * len(device_tensors)
    if on_cuda:
        assert torch.cuda.memory_allocated(cache.device) <= before - device_kv_bytes
    with pytest.raises(hisparse.RequestStateError, match="closed"):
        cache.tables  # noqa: B018 (the access is the test)
    with pytest.raises(hisparse.RequestStateError, match="closed"):
        cache.begin_decode_step(["long"])
    with pytest.raises(AttributeError, match="no_such_attribute"):
        cache.no_such_attribute  # noqa: B018
    cache.close()  # still idempotent


def decode_and_check(cache: hisparse.HiSparseCache, rng: torch.Generator) -> None:
    """Admit two requests (one long, one short), decode a few steps with fresh random rows and
    top-k, and check every returned row's bytes against the KV kept outside the cache."""
    full: dict[str, torch.Tensor] = {}  # request -> [L, T, W] every token written so far
    for request_id, length in (("long", cache.hot_slots + 7), ("short", 3)):
        full[request_id] = torch.randint(0, 256, (cache.num_layers, length, W),
                                         dtype=torch.uint8, generator=rng)
        cache.admit(request_id, length)
        cache.write_prefill(request_id, full[request_id])
        cache.commit_prefill(request_id)
    ids = list(full)
    for _ in range(4):
        step = cache.begin_decode_step(ids)
        new = torch.randint(0, 256, (cache.num_layers, len(ids), W), dtype=torch.uint8,
                            generator=rng)
        top_k = torch.full((len(ids), cache.top_k), -1, dtype=torch.int32)
        for b, request_id in enumerate(ids):
            full[request_id] = torch.cat([full[request_id], new[:, b : b + 1]], dim=1)
            n = step.positions[b] + 1
            chosen = torch.randperm(n, generator=rng)[: cache.top_k]
            top_k[b, : chosen.numel()] = chosen.to(torch.int32)
        for layer in range(cache.num_layers):
            cache.write_newest(layer, new[layer].to(cache.device))
        device_top_k = top_k.to(cache.device)  # followers pass their anchor's tensor
        for layer in range(cache.num_layers):
            rows = cache.swap_in(layer, device_top_k).cpu()
            hot = cache.device_kv(layer).cpu()
            for b, request_id in enumerate(ids):
                for k in range(cache.top_k):
                    position = int(top_k[b, k])
                    if position < 0:
                        assert rows[b, k] == -1
                        continue
                    assert torch.equal(hot[rows[b, k]], full[request_id][layer, position])
        cache.end_decode_step()
    for request_id in ids:
        cache.finish(request_id)


def on_a_new_thread(work: Callable[[], None]) -> None:
    """Run `work` on a fresh thread (its own torch thread state) and re-raise what it raised."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # reported on the caller's thread
            failures.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if failures:
        raise failures[0]


def test_cache_built_in_inference_mode_serves_a_thread_outside_it(rng: torch.Generator) -> None:
    """Inference mode is per thread: a framework may build the cache under it (its model
    thread) and drive admission and decoding from a thread that is not. Inference tensors
    refuse in-place updates outside inference mode, so the engine's tables must be normal
    tensors; before, begin_decode_step raised halfway and left the request one token longer
    on the host side than on the device."""
    with torch.inference_mode():
        cache = build_cache("cpu", hot=8, top_k=4, extent=4, group=2, validate=True,
                            pool_extents=32)

    def drive() -> None:
        assert not torch.is_inference_mode_enabled()
        decode_and_check(cache, rng)

    on_a_new_thread(drive)
    assert cache.stats().misses > 0  # the long request really swapped rows in
    cache.close()


def test_cache_built_normally_serves_inference_mode(rng: torch.Generator) -> None:
    cache = build_cache("cpu", hot=8, top_k=4, extent=4, group=2, validate=True, pool_extents=32)
    with torch.inference_mode():
        decode_and_check(cache, rng)
    assert cache.stats().misses > 0
    cache.close()
