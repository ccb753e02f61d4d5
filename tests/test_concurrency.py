"""A scheduler thread and a model thread on one cache (docs/reliability.md, "Threads").

The model thread decodes (begin_decode_step, write_newest, swap_in, end_decode_step) and
checks the bytes of every row swap-in returns; the scheduler thread admits and prefills,
reserves and completes PD transfers, preempts and resumes, finishes, and reads statistics,
only ever for requests that are not in the model thread's batch (handed over through
queues, as a serving framework's scheduler does). The thread switch interval is shortened so
the two interleave inside the engine's calls. At the end the tables must satisfy every
invariant and no row may have been wrong.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import hisparse
from hisparse.core.requests import RequestState
from hisparse.errors import PoolExhaustedError
from test_reliability_state import check_table_invariants, row_pattern

LAYERS, WIDTH, TOP_K = 4, 32, 4


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every 10 us instead of 5 ms, so calls interleave mid-way."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(previous)


def build(backend: Any, validate: bool = True) -> hisparse.HiSparseCache:
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=LAYERS, row_bytes=WIDTH, top_k=TOP_K, hot_slots=8,
        index_group_size=2, extent_tokens=4, max_requests=6, max_batch=4,
        host_pool_tokens=1024, max_seq_len=256, validate=validate,
    )
    return hisparse.HiSparseCache(config, device=backend)


class Scheduler(threading.Thread):
    """Admits (plain or PD), parks (preempt + resume) and finishes requests off the batch."""

    def __init__(self, cache: hisparse.HiSparseCache, ready: queue.Queue, done: queue.Queue,
                 stop: threading.Event, seed: int) -> None:
        super().__init__(name="scheduler")
        self.cache, self.ready, self.done, self.stop = cache, ready, done, stop
        self.rng = np.random.default_rng(seed)
        self.next_uid = 1
        self.error: BaseException | None = None
        self.counts = {"admitted": 0, "transferred": 0, "parked": 0, "finished": 0,
                       "stats": 0, "refused": 0}

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.round()
        except BaseException as exc:  # reported by the test, with the thread's traceback
            self.error = exc
            self.stop.set()

    def round(self) -> None:
        cache = self.cache
        try:
            request_id, parked = self.done.get(timeout=0.001)
        except queue.Empty:
            request_id = None
        if request_id is not None:
            if parked:  # handed back to be preempted, then resumed and handed over again
                cache.preempt(request_id)
                assert cache.request_state(request_id) is RequestState.PREEMPTED
                cache.stats()
                cache.resume(request_id)
                self.counts["parked"] += 1
                self.ready.put(request_id)
            else:
                cache.finish(request_id)
                self.counts["finished"] += 1
        live = len(cache._requests)  # the private count is only read here, for pacing
        if live < cache.max_requests:
            self.start_one()
        cache.stats()
        self.counts["stats"] += 1

    def start_one(self) -> None:
        cache, uid = self.cache, self.next_uid
        tokens = int(self.rng.integers(1, 30))
        positions = torch.arange(tokens)
        rows = torch.stack([row_pattern(uid, layer, positions, WIDTH) for layer in range(LAYERS)])
        try:
            if self.rng.random() < 0.3:  # PD: the transfer engine writes the host rows
                reservation = cache.reserve_host_slots(uid, tokens)
                for layer, host in enumerate(reservation.host_tensors):
                    host[torch.from_numpy(reservation.rows)] = rows[layer]
                cache.complete_transfer(uid)
                self.counts["transferred"] += 1
            else:
                cache.admit(uid, tokens)
                cache.write_prefill(uid, rows.to(cache.device))
                cache.commit_prefill(uid)
                self.counts["admitted"] += 1
        except PoolExhaustedError:
            self.counts["refused"] += 1
            if uid in cache._requests:
                cache.abort(uid)
            self.next_uid += 1
            return
        self.next_uid += 1
        self.ready.put(uid)


def decode(cache: hisparse.HiSparseCache, ready: queue.Queue, done: queue.Queue,
           stop: threading.Event, steps: int, seed: int) -> dict[str, int]:
    """The model thread's loop; returns what it checked."""
    rng = np.random.default_rng(seed)
    batch: list[int] = []
    life: dict[int, int] = {}
    counts = {"steps": 0, "rows_verified": 0}
    while counts["steps"] < steps and not stop.is_set():
        while len(batch) < cache.batch_capacity:
            try:
                request_id = ready.get(timeout=0.001 if batch else 0.05)
            except queue.Empty:
                break
            batch.append(request_id)
            life.setdefault(request_id, int(rng.integers(5, 40)))
        if not batch:
            continue
        cache.begin_decode_step(batch)
        lengths = [cache.seq_len(r) for r in batch]
        uids = torch.tensor(batch)[:, None]
        for layer in range(LAYERS):
            newest = row_pattern(uids[:, 0], layer, torch.tensor(lengths) - 1, WIDTH)
            cache.write_newest(layer, newest.to(cache.device))
        for group in range(LAYERS // 2):
            top_k = torch.full((len(batch), TOP_K), -1, dtype=torch.int32)
            for b, n in enumerate(lengths):
                chosen = rng.permutation(n)[:TOP_K]
                top_k[b, : len(chosen)] = torch.from_numpy(chosen)
            device_top_k = top_k.to(cache.device)  # the follower passes its anchor's tensor
            for layer in (2 * group, 2 * group + 1):
                rows = cache.swap_in(layer, device_top_k).cpu()
                filled = top_k >= 0
                held = cache.device_kv(layer).cpu()[rows.clamp(min=0).long()]
                expected = row_pattern(uids, layer, top_k.clamp(min=0), WIDTH)
                wrong = filled & (held != expected).any(-1)
                assert not wrong.any(), f"layer {layer}: wrong rows at {wrong.nonzero()[:4]}"
                assert ((rows >= 0) == filled).all()
                counts["rows_verified"] += int(filled.sum())
        cache.end_decode_step()
        counts["steps"] += 1
        for request_id in list(batch):
            life[request_id] -= 1
            if life[request_id] <= 0:
                batch.remove(request_id)
                done.put((request_id, False))
            elif rng.random() < 0.05:
                batch.remove(request_id)
                done.put((request_id, True))  # park: the scheduler preempts and resumes it
    stop.set()
    return counts


@pytest.mark.parametrize("validate", [True, False])
def test_scheduler_and_model_threads_keep_every_byte(backend: Any, seed: int, validate: bool,
                                                     fast_switching: None) -> None:
    cache = build(backend, validate)
    ready: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    stop = threading.Event()
    scheduler = Scheduler(cache, ready, done, stop, seed)
    scheduler.start()
    try:
        counts = decode(cache, ready, done, stop, steps=150, seed=seed + 1)
    finally:
        stop.set()
        scheduler.join(timeout=30)
    if scheduler.error is not None:
        raise scheduler.error
    assert not scheduler.is_alive()
    assert counts["steps"] == 150 and counts["rows_verified"] > 0
    work = scheduler.counts
    assert work["admitted"] and work["transferred"] and work["finished"] and work["parked"]
    check_table_invariants(cache)
    stats = cache.stats()
    assert stats.misses > 0
    cache.close()


def test_the_per_layer_calls_take_no_lock_and_the_step_calls_do(backend: Any) -> None:
    """With the bookkeeping lock held elsewhere, write_newest and swap_in still run without
    asking for it (the hot path never waits on the scheduler), while end_decode_step asks for
    it and waits, its step still open (the lock notes the ask: no sleep decides)."""
    cache = build(backend)
    cache.admit("a", 12)
    cache.write_prefill("a", torch.zeros(LAYERS, 12, WIDTH, dtype=torch.uint8, device=cache.device))
    cache.commit_prefill("a")
    cache.begin_decode_step(["a"])
    hot_path_done = threading.Event()

    def hot_path() -> None:
        for layer in range(LAYERS):
            cache.write_newest(layer, torch.zeros(1, WIDTH, dtype=torch.uint8,
                                                  device=cache.device))
        top_k = torch.tensor([[0, 3, 12, -1]], dtype=torch.int32, device=cache.device)
        for layer in range(LAYERS):
            cache.swap_in(layer, top_k)
        hot_path_done.set()

    lock, asked = cache._lock, threading.Event()

    class NotingLock:  # the cache's lock, noting that a call has asked for it
        def __enter__(self) -> object:
            asked.set()
            return lock.__enter__()

        def __exit__(self, *exc: object) -> object:
            return lock.__exit__(*exc)

    cache._lock = NotingLock()
    with lock:  # the scheduler, mid-call
        worker = threading.Thread(target=hot_path)
        worker.start()
        assert hot_path_done.wait(timeout=10), "the hot path waited on the bookkeeping lock"
        assert not asked.is_set(), "the hot path asked for the bookkeeping lock"
        ender = threading.Thread(target=cache.end_decode_step)
        ender.start()
        give_up = time.monotonic() + 10
        while not asked.wait(timeout=0.01):
            assert ender.is_alive(), "end_decode_step ended without the bookkeeping lock"
            assert time.monotonic() < give_up, "end_decode_step never asked for the lock"
        assert cache._step is not None, "end_decode_step ended the step before the lock"
    ender.join(timeout=10)
    assert not ender.is_alive() and cache._step is None
    worker.join()
    cache.close()
