"""Faults from outside the engine: host memory that cannot be allocated or registered, a pool
that runs out mid-admission or mid-decode, a PD transfer that never completes, preemption to
make room. Each gives a clear error, leaves no partial state, and the request can be retried;
the bytes are checked against the plain-Python oracle afterwards.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

import hisparse
from fakes.faulty_backend import FaultyBackend, InjectedFault
from hisparse.core.requests import RequestState
from hisparse.errors import HostAllocationError, PoolExhaustedError
from oracle import CacheModel
from test_engine_trace import check_against_model, check_empty
from test_reliability_state import assert_same_state, full_snapshot

LAYERS, WIDTH = 4, 32


def config(**overrides: Any) -> hisparse.HiSparseConfig:
    shape = dict(num_layers=LAYERS, row_bytes=WIDTH, top_k=4, hot_slots=8,
                 extent_tokens=4, max_requests=3, max_batch=3, host_pool_tokens=64,
                 max_seq_len=64, index_group_size=2, validate=True)
    return hisparse.HiSparseConfig.from_preset("tiny", **(shape | overrides))


class Lockstep:
    """A cache and its oracle; every helper does the same thing to both and checks them."""

    def __init__(self, cache: hisparse.HiSparseCache, seed: int) -> None:
        self.cache = cache
        self.model = CacheModel(cache.num_layers, cache.hot_slots, cache.index_group_size)
        self.rng = np.random.default_rng(seed)

    def rows(self, tokens: int) -> np.ndarray:
        return self.rng.integers(0, 256, (LAYERS, tokens, WIDTH), dtype=np.uint8)

    def admit(self, request_id: str, tokens: int) -> None:
        rows = self.rows(tokens)
        self.cache.admit(request_id, tokens)
        self.cache.write_prefill(request_id, torch.from_numpy(rows).to(self.cache.device))
        self.cache.commit_prefill(request_id)
        self.added(request_id, rows)

    def added(self, request_id: str, rows: np.ndarray) -> None:
        self.model.add(request_id, [[bytes(r) for r in layer] for layer in rows])
        self.model.seed(request_id)
        self.check()

    def decode(self, batch: list[str], steps: int = 1) -> None:
        """Decode steps with random top-k; every returned row's bytes are the oracle's."""
        cache = self.cache
        for _ in range(steps):
            cache.begin_decode_step(batch)
            new = self.rows(len(batch))
            for b, request_id in enumerate(batch):
                self.model.append(request_id, [bytes(new[layer, b]) for layer in range(LAYERS)])
            top_k = np.full((len(batch), cache.top_k), -1, dtype=np.int32)
            for b, request_id in enumerate(batch):
                n = cache.seq_len(request_id)
                chosen = self.rng.permutation(n)[: cache.top_k]
                top_k[b, : len(chosen)] = chosen
            device_top_k = torch.from_numpy(top_k).to(cache.device)  # one for every layer
            for layer in range(LAYERS):
                cache.write_newest(layer, torch.from_numpy(new[layer]).to(cache.device))
                got = cache.swap_in(layer, device_top_k).cpu()
                slots = self.model.swap_in(layer, batch, top_k.tolist())
                device_kv = cache.device_kv(layer).cpu()
                for b, request_id in enumerate(batch):
                    base = cache.request_slot(request_id) * cache.slots_per_request
                    assert got[b].tolist() == [base + s if s >= 0 else -1 for s in slots[b]]
                    for position, row in zip(top_k[b], got[b].tolist(), strict=True):
                        if row >= 0:
                            held = bytes(device_kv[row].numpy())
                            assert held == self.model.requests[request_id].rows[layer][position]
            cache.end_decode_step()
            self.check()

    def preempt(self, request_id: str) -> None:
        self.cache.preempt(request_id)
        self.model.release(request_id)
        self.check()

    def resume(self, request_id: str) -> None:
        self.cache.resume(request_id)
        self.model.seed(request_id)
        self.check()

    def finish(self, request_id: str) -> None:
        self.cache.finish(request_id)
        self.model.remove(request_id)
        self.check()

    def check(self) -> None:
        self.cache.backend.synchronize()  # host rows: backups land asynchronously on GPUs
        check_against_model(self.cache, self.model)


# --- construction ------------------------------------------------------------------------
@pytest.mark.parametrize("hook", ["alloc_host", "register_host"])
@pytest.mark.parametrize("call", [1, 2, LAYERS])
def test_host_memory_failing_at_construction_leaks_nothing(hook: str, call: int) -> None:
    backend = FaultyBackend(fail={hook: call})
    with pytest.raises(HostAllocationError, match=f"injected failure of {hook} call {call}"):
        hisparse.HiSparseCache(config(), device=backend)
    assert backend.calls["alloc_host"] == call  # it stopped at the failure
    assert backend.live_buffers == 0 and not backend._live
    with hisparse.HiSparseCache(config(), device=backend) as cache:  # a retry works
        assert len(cache.host_tensors()) == LAYERS
        assert backend.live_buffers == LAYERS
    assert backend.live_buffers == 0


# new_event 3: the last of the decode path's events (tables changed, step end, backup done).
@pytest.mark.parametrize("hook,call", [("new_event", 1), ("new_event", 3), ("kernels", 1)])
def test_a_failure_after_the_pool_frees_the_pool(hook: str, call: int) -> None:
    backend = FaultyBackend(fail={hook: call})
    with pytest.raises(InjectedFault):
        hisparse.HiSparseCache(config(), device=backend)
    assert backend.allocated_bytes == [64 * WIDTH] * LAYERS  # the pool had been allocated
    assert backend.live_buffers == 0 and not backend._live


# --- running out --------------------------------------------------------------------------
def test_the_pool_exhausted_mid_admission_leaves_nothing_and_the_retry_works(
    backend: Any, seed: int
) -> None:
    """A scheduler admits until the host pool is full; the failed request holds nothing, and
    after a finish frees extents the same request is admitted and decodes exactly."""
    run = Lockstep(hisparse.HiSparseCache(config(), device=backend), seed)
    run.admit("a", 30)  # 8 extents
    run.admit("b", 20)  # 5 extents: 13 of 16 used
    before = full_snapshot(run.cache)
    with pytest.raises(PoolExhaustedError, match=r"asked for 4 extents .* 3 of 16 are free"):
        run.cache.admit("c", 14)
    assert_same_state(before, full_snapshot(run.cache))
    with pytest.raises(PoolExhaustedError):  # the PD path refuses the same way
        run.cache.reserve_host_slots("c", 14)
    assert_same_state(before, full_snapshot(run.cache))
    run.decode(["a", "b"], steps=2)
    run.finish("b")
    run.admit("c", 14)
    run.decode(["a", "c"], steps=3)
    for request_id in ("a", "c"):
        run.finish(request_id)
    check_empty(run.cache)


def test_the_pool_exhausted_at_a_decode_step_appends_nothing(backend: Any, seed: int) -> None:
    """A step whose requests need a new extent the pool lacks is refused as a whole."""
    run = Lockstep(hisparse.HiSparseCache(config(), device=backend), seed)
    run.admit("a", 24)  # 6 extents, full: its next token needs a 7th
    run.admit("b", 39)  # 10 extents: 16 of 16 used
    before = full_snapshot(run.cache)
    with pytest.raises(PoolExhaustedError, match="asked for 1 extents"):
        run.cache.begin_decode_step(["b", "a"])
    assert_same_state(before, full_snapshot(run.cache))
    assert run.cache.seq_len("a") == 24 and run.cache.seq_len("b") == 39
    run.decode(["b"])  # "b" still has room in its last extent
    run.preempt("b")  # preempting keeps host rows: still no room
    with pytest.raises(PoolExhaustedError):
        run.cache.begin_decode_step(["a"])
    run.finish("b")
    run.decode(["a"], steps=5)


def test_a_transfer_that_never_completes_is_aborted_and_retried(backend: Any, seed: int) -> None:
    """PD: rows reserved, half written, then the deadline passes. Abort gives every row back;
    the retried transfer lands in full and the request decodes exactly."""
    run = Lockstep(hisparse.HiSparseCache(config(), device=backend), seed)
    run.admit("local", 10)
    pool_before = run.cache._pool.allocator.free_runs()
    slots_before = run.cache._slots.free_slots
    rows = run.rows(25)
    reservation = run.cache.reserve_host_slots("remote", 25)
    half = torch.from_numpy(reservation.rows[:12])
    for layer, host in enumerate(reservation.host_tensors):
        host[half] = torch.from_numpy(rows[layer, :12])
    landed = threading.Event()  # the completion notification that never comes
    if not landed.wait(timeout=0.02):  # the endpoint's deadline passes
        run.cache.abort("remote")
    assert run.cache._pool.allocator.free_runs() == pool_before
    assert run.cache._slots.free_slots == slots_before
    with pytest.raises(hisparse.errors.RequestStateError, match="already aborted"):
        run.cache.complete_transfer("remote")  # a late completion is refused
    run.check()

    retry = run.cache.reserve_host_slots("remote", 25)
    for layer, host in enumerate(retry.host_tensors):
        host[torch.from_numpy(retry.rows)] = torch.from_numpy(rows[layer])
    run.cache.complete_transfer("remote")
    run.added("remote", rows)
    run.decode(["local", "remote"], steps=4)


def test_complete_transfer_without_a_slot_stays_reserved_until_one_frees(
    backend: Any, seed: int
) -> None:
    run = Lockstep(hisparse.HiSparseCache(config(), device=backend), seed)
    for request_id in ("a", "b", "c"):
        run.admit(request_id, 6)
    rows = run.rows(9)
    reservation = run.cache.reserve_host_slots("pd", 9)
    for layer, host in enumerate(reservation.host_tensors):
        host[torch.from_numpy(reservation.rows)] = torch.from_numpy(rows[layer])
    run.model.add("pd", [[bytes(r) for r in layer] for layer in rows])  # host rows, no slot
    before = full_snapshot(run.cache)
    with pytest.raises(PoolExhaustedError, match="transfer of request 'pd'"):
        run.cache.complete_transfer("pd")
    assert_same_state(before, full_snapshot(run.cache))
    assert run.cache.request_state("pd") is RequestState.RESERVED
    run.finish("b")
    run.cache.complete_transfer("pd")
    run.model.seed("pd")
    run.decode(["a", "pd", "c"], steps=3)


def test_preemption_under_pressure_then_resume_keeps_every_byte(backend: Any, seed: int) -> None:
    """All device slots busy: a new request is refused, one is preempted to admit it, and the
    preempted one resumes when a slot frees, its hot buffer re-seeded from the host exactly."""
    run = Lockstep(hisparse.HiSparseCache(config(host_pool_tokens=256), device=backend), seed)
    for request_id, tokens in (("a", 30), ("b", 12), ("c", 5)):
        run.admit(request_id, tokens)
    run.decode(["a", "b", "c"], steps=6)  # "a" long with misses, "c" crosses short to long
    before = full_snapshot(run.cache)
    with pytest.raises(PoolExhaustedError, match="all 3 are in use"):
        run.cache.admit("urgent", 20)
    assert_same_state(before, full_snapshot(run.cache))
    run.preempt("a")
    run.admit("urgent", 20)
    run.decode(["urgent", "b", "c"], steps=5)
    with pytest.raises(PoolExhaustedError, match="resuming request 'a'"):
        run.cache.resume("a")
    run.finish("urgent")
    run.resume("a")
    run.decode(["a", "b", "c"], steps=6)
    for request_id in ("a", "b", "c"):
        run.finish(request_id)
    check_empty(run.cache)


class FailOnce:
    """Wraps a backend hook so that its next call raises, as a device out of memory would."""

    def __init__(self, hook: Any) -> None:
        self.hook, self.armed = hook, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise InjectedFault("device refused the work")
        return self.hook(*args, **kwargs)


@pytest.mark.parametrize("how", ["complete_transfer", "resume"])
def test_a_seed_that_fails_gives_its_device_slot_back(
    backend: Any, seed: int, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seed's last device call fails, after every table of the new slot was written: the
    request keeps its state, the slot and its tables are free again, and the retry decodes."""
    run = Lockstep(hisparse.HiSparseCache(config(), device=backend), seed)
    run.admit("a", 6)
    if how == "complete_transfer":
        rows = run.rows(9)
        reservation = run.cache.reserve_host_slots("b", 9)
        for layer, host in enumerate(reservation.host_tensors):
            host[torch.from_numpy(reservation.rows)] = torch.from_numpy(rows[layer])
        run.model.add("b", [[bytes(r) for r in layer] for layer in rows])
    else:
        run.admit("b", 11)
        run.decode(["a", "b"], steps=2)
        run.preempt("b")
    fault = FailOnce(run.cache.backend.record_event)
    monkeypatch.setattr(run.cache.backend, "record_event", fault)
    before = full_snapshot(run.cache)
    del before["tables.device_kv"]  # a free slot's rows hold whatever was there; never read
    fault.armed = True
    with pytest.raises(InjectedFault):
        getattr(run.cache, how)("b")
    after = full_snapshot(run.cache)
    del after["tables.device_kv"]
    assert_same_state(before, after)
    getattr(run.cache, how)("b")
    run.model.seed("b")
    run.decode(["a", "b"], steps=3)
    run.finish("a")
    run.finish("b")
    check_empty(run.cache)


def test_a_decode_step_whose_upload_fails_opens_nothing_and_the_retry_decodes(
    backend: Any, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's one host-to-device upload fails (a device out of memory) while one request
    needs a new extent: no token is appended, the extent goes back, no step is open, and the
    retried step decodes every byte as the oracle says."""
    run = Lockstep(hisparse.HiSparseCache(config(), device=backend), seed)
    run.admit("a", 8)  # a full extent: its next token needs a new one
    run.admit("b", 5)
    cache = run.cache
    fault = FailOnce(cache._decode.buffers.upload)
    monkeypatch.setattr(cache._decode.buffers, "upload", fault)
    before = full_snapshot(cache)
    fault.armed = True
    with pytest.raises(InjectedFault):
        cache.begin_decode_step(["a", "b"])
    assert_same_state(before, full_snapshot(cache))
    run.decode(["a", "b"], steps=4)


def test_a_reservation_whose_host_drain_fails_reserves_nothing(
    backend: Any, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting for the device's last host copies fails (the device is gone, say): the PD
    reservation must not stay behind for a caller that was told it failed."""
    run = Lockstep(hisparse.HiSparseCache(config(), device=backend), seed)
    run.admit("a", 6)
    cache = run.cache
    fault = FailOnce(cache.backend.synchronize_event)
    monkeypatch.setattr(cache.backend, "synchronize_event", fault)
    cache._order.host_rows.copies_in_flight = True  # as after a prefill from device memory
    before = full_snapshot(cache)
    fault.armed = True
    with pytest.raises(InjectedFault):
        cache.reserve_host_slots("pd", 9)
    assert_same_state(before, full_snapshot(cache))
    reservation = cache.reserve_host_slots("pd", 9)
    assert len(reservation.rows) == 9
    cache.abort("pd")
    run.decode(["a"], steps=2)


@pytest.mark.parametrize("kernel", ["launcher.swap_in", "launcher.replay", "backup"])
def test_a_kernel_that_fails_mid_step_stops_decoding_but_frees_everything(
    backend: Any, seed: int, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch that fails part way through a decode call (a compile error on a new device, a
    device fault) may leave the group's tables saying a row is resident that was never
    copied. The cache must refuse to decode from then on, with the reason, rather than serve
    such rows; it still lets the step be cancelled, the requests be finished or aborted, and
    itself be closed, with every host byte kept."""
    run = Lockstep(hisparse.HiSparseCache(config(), device=backend), seed)
    run.admit("a", 13)  # long: its steps have misses, and layer 1 replays layer 0's plan
    run.admit("b", 5)
    run.decode(["a", "b"], steps=2)
    cache = run.cache
    owner_name, _, name = kernel.rpartition(".")
    owner = cache._decode.kernels
    owner = getattr(owner, owner_name) if owner_name else owner
    fault = FailOnce(getattr(owner, name))
    monkeypatch.setattr(owner, name, fault)
    fault.armed = True
    top_k = torch.tensor([[0, 1, 2, 3], [0, 1, 2, -1]], dtype=torch.int32, device=cache.device)
    cache.begin_decode_step(["a", "b"])
    with pytest.raises(InjectedFault):
        for layer in range(LAYERS):
            cache.write_newest(layer, torch.zeros(2, WIDTH, dtype=torch.uint8,
                                                  device=cache.device))
            cache.swap_in(layer, top_k)
        cache.end_decode_step()
    refused = "decodes no more"
    if cache._step is not None:
        with pytest.raises(hisparse.RequestStateError, match=refused):
            cache.swap_in(0, top_k)
        with pytest.raises(hisparse.RequestStateError, match=refused):
            cache.end_decode_step()
        cache.cancel_decode_step()
    with pytest.raises(hisparse.RequestStateError, match=f"failed with InjectedFault.*{refused}"):
        cache.begin_decode_step(["a"])
    cache.finish("a")
    cache.abort("b")
    check_empty(cache)
    cache.close()
