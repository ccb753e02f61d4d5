"""PD disaggregation over NIXL on loopback: a prefill process writes a request's KV into the
decode process's host pool, the decode side verifies every byte, decodes with swap-in and frees.

The decode side runs in the test process (so it can look into its cache); the prefill side runs
in a spawned worker (tests/pd_workers.py) that derives the same bytes from a shared seed.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pd_workers
from conftest import POISON_BYTE
from hisparse.errors import InvalidInputError, MissingDependencyError, TransferError
from hisparse.pd import TransferTicket, coalesce_rows, import_nixl, split_runs

try:
    import_nixl()
    NIXL_MISSING = None
except ImportError as exc:
    NIXL_MISSING = str(exc)
needs_nixl = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"{NIXL_MISSING}")


@pytest.fixture(scope="module", autouse=True)
def host_only_ucx() -> Iterator[None]:
    """UCX on host transports only, here and in the spawned workers.

    On a CUDA machine UCX may also use its CUDA transports, whose registration cache can keep
    freed host buffers registered with the CUDA runtime; other code in the process then cannot
    register a new mapping at those addresses. These tests move host memory only.
    """
    previous = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp,self,sm"
    yield
    if previous is None:
        del os.environ["UCX_TLS"]
    else:
        os.environ["UCX_TLS"] = previous

CONFIG = pd_workers.SMALL_CACHE
NUM_LAYERS, ROW_BYTES = CONFIG["num_layers"], CONFIG["row_bytes"]
GROUP_SIZE = CONFIG["index_group_size"]
WORKER_TIMEOUT_S = 30.0


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def host_extents_used(cache: Any) -> int:
    return cache.stats().occupancy.host_extents_used


def poll_until(endpoint: Any, count: int, timeout_s: float = 10.0) -> list[Any]:
    outcomes: list[Any] = []
    give_up = time.monotonic() + timeout_s
    while len(outcomes) < count:
        assert time.monotonic() < give_up, f"only {len(outcomes)} of {count} transfers ended"
        outcomes += endpoint.poll()
        time.sleep(0.001)
    return outcomes


class Worker:
    """A spawned helper process driven through a pipe; always reaped."""

    def __init__(self, target: Any, *args: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe()
        self.process = context.Process(target=target, args=(child_end, *args), daemon=True)
        self.process.start()
        child_end.close()

    def call(self, *command: Any) -> Any:
        self.conn.send(command)
        return self.receive()

    def receive(self) -> Any:
        if not self.conn.poll(WORKER_TIMEOUT_S):
            raise AssertionError(f"worker gave no answer within {WORKER_TIMEOUT_S} s")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise AssertionError(f"worker raised {reply[1]}: {reply[2]}")
        return reply[1] if reply[0] == "ok" else reply

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(("exit",))
        self.process.join(WORKER_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, Worker]]:
    # Started together: each spends seconds importing torch, and on CI's two cores the
    # imports overlap instead of adding up.
    started = {
        "prefill": Worker(pd_workers.prefill_worker, unique("prefill"), NUM_LAYERS, ROW_BYTES, 256),
        "decode-gone": Worker(pd_workers.decode_worker, unique("decode-gone"), CONFIG, 20),
    }
    yield started
    for worker in started.values():
        worker.stop()


@pytest.fixture
def prefill_worker(workers: dict[str, Worker]) -> Worker:
    return workers["prefill"]


@pytest.fixture
def cache() -> Iterator[Any]:
    cache = pd_workers.make_cache(**CONFIG)
    for layer in cache_host_tensors(cache):
        layer.fill_(POISON_BYTE)
    yield cache
    cache.close()


def cache_host_tensors(cache: Any) -> list[torch.Tensor]:
    return list(cache.host_tensors())


@pytest.fixture
def endpoint(cache: Any) -> Iterator[Any]:
    from hisparse.pd import NixlDecodeEndpoint

    endpoint = NixlDecodeEndpoint(cache, unique("decode"), timeout_s=20.0)
    yield endpoint
    endpoint.close()


# --- two processes: the whole flow --------------------------------------------------------------


@needs_nixl
def test_prefill_process_writes_decode_verifies_decodes_and_frees(
    prefill_worker: Worker, cache: Any, endpoint: Any, seed: int
) -> None:
    prefill_worker.call("connect", endpoint.publish())
    rng = np.random.default_rng(seed)
    # A blocker request released in between scatters the later requests over the pool.
    lengths = {"short": 5, "two-extents": 29, "blocker": 16, "long": 70}
    seeds = {rid: int(rng.integers(2**31)) for rid in lengths}
    tickets = {}
    for rid, num_tokens in lengths.items():
        tickets[rid] = endpoint.prepare_request(rid, num_tokens)
    endpoint.cancel("blocker")
    tickets["after-gap"] = endpoint.prepare_request("after-gap", 40)
    lengths["after-gap"], seeds["after-gap"] = 40, int(rng.integers(2**31))
    del lengths["blocker"], tickets["blocker"]

    for rid, ticket in tickets.items():
        assert sum(n for _, _, n in ticket.runs) == lengths[rid]
        prefill_worker.call("write", ticket.to_bytes(), seeds[rid])
    outcomes = poll_until(endpoint, len(tickets))
    assert sorted(o.request_id for o in outcomes) == sorted(tickets)
    assert all(o.ready and o.error is None for o in outcomes)
    assert endpoint.pending == []

    # Every row byte for byte, and nothing written outside the reserved rows.
    host = cache_host_tensors(cache)
    written = np.zeros(host[0].shape[0], dtype=bool)
    expected = {}
    for rid, ticket in tickets.items():
        rows = torch.from_numpy(ticket.rows())
        expected[rid] = pd_workers.expected_kv(seeds[rid], NUM_LAYERS, lengths[rid], ROW_BYTES)
        for layer in range(NUM_LAYERS):
            assert torch.equal(host[layer][rows], expected[rid][layer]), (rid, layer)
        written[ticket.rows()] = True
    for layer in range(NUM_LAYERS):
        assert bool((host[layer][torch.from_numpy(~written)] == POISON_BYTE).all()), layer

    decode_steps(cache, expected, steps=3, rng=rng)
    assert cache.stats().misses > 0  # rows really came from the host pool, not only seeding

    for rid in tickets:
        cache.finish(rid)
    occupancy = cache.stats().occupancy
    assert occupancy.host_extents_used == 0
    assert occupancy.request_slots_used == 0


def decode_steps(
    cache: Any, expected: dict[str, torch.Tensor], steps: int, rng: np.random.Generator
) -> None:
    """Append tokens and swap in random top-k positions; the rows attention would read must be
    the transferred bytes (or the appended ones)."""
    request_ids = list(expected)
    top_k = CONFIG["top_k"]
    for _ in range(steps):
        cache.begin_decode_step(request_ids)
        newest = torch.from_numpy(
            rng.integers(0, 256, (NUM_LAYERS, len(request_ids), ROW_BYTES), dtype=np.uint8)
        )
        for b, rid in enumerate(request_ids):
            expected[rid] = torch.cat([expected[rid], newest[:, b : b + 1]], dim=1)
        for layer in range(NUM_LAYERS):
            cache.write_newest(layer, newest[layer])
            if layer % GROUP_SIZE == 0:  # followers of an index group reuse the anchor's top-k
                positions = np.full((len(request_ids), top_k), -1, dtype=np.int32)
                for b, rid in enumerate(request_ids):
                    seq_len = expected[rid].shape[1]
                    chosen = rng.choice(seq_len, size=min(top_k, seq_len), replace=False)
                    positions[b, : chosen.size] = chosen
            device_rows = cache.swap_in(layer, torch.from_numpy(positions)).clone()
            device_kv = cache.device_kv(layer)
            for b, rid in enumerate(request_ids):
                for k, position in enumerate(positions[b]):
                    if position < 0:
                        assert int(device_rows[b, k]) == -1
                        continue
                    got = device_kv[int(device_rows[b, k])].cpu()
                    assert torch.equal(got, expected[rid][layer, position]), (rid, layer, position)
        cache.end_decode_step()


# --- failure paths ------------------------------------------------------------------------------


@pytest.fixture
def sender() -> Iterator[Any]:
    from hisparse.pd import NixlPrefillSender

    sender = NixlPrefillSender(unique("prefill-local"))
    yield sender
    sender.close()


def local_source(sender: Any, num_tokens: int) -> torch.Tensor:
    source = torch.randint(0, 256, (NUM_LAYERS, num_tokens, ROW_BYTES), dtype=torch.uint8)
    sender.register([source])
    return source


@needs_nixl
def test_timeout_releases_rows_and_late_notification_is_ignored(
    cache: Any, sender: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from hisparse.pd import NixlDecodeEndpoint

    now = [0.0]
    endpoint = NixlDecodeEndpoint(cache, unique("decode"), timeout_s=5.0, clock=lambda: now[0])
    try:
        sender.connect(endpoint.publish())
        ticket = endpoint.prepare_request("slow", 21)
        assert host_extents_used(cache) == 2
        now[0] = 4.9
        assert endpoint.poll() == []
        now[0] = 5.0
        [outcome] = endpoint.poll()
        assert outcome.request_id == "slow" and not outcome.ready
        assert isinstance(outcome.error, TransferError)
        assert "timed out" in str(outcome.error) and "21 host rows were released" in str(
            outcome.error
        )
        assert host_extents_used(cache) == 0
        assert endpoint.pending == []

        # The same request id comes back; the old transfer's late notice must not complete it.
        retry = endpoint.prepare_request("slow", 21)
        source = local_source(sender, 21)
        with caplog.at_level(logging.WARNING, logger="hisparse.pd.nixl_adapter"):
            sender.write(ticket, list(source)).wait(timeout_s=10.0)
            deadline = time.monotonic() + 5.0
            while "late" not in caplog.text and time.monotonic() < deadline:
                assert endpoint.poll() == []
        assert "late 'done' notification" in caplog.text and ticket.transfer_id in caplog.text
        assert endpoint.pending == ["slow"] and host_extents_used(cache) == 2

        sender.write(retry, list(source)).wait(timeout_s=10.0)
        [outcome] = poll_until(endpoint, 1)
        assert outcome.ready and outcome.transfer_id == retry.transfer_id
        for layer, host in enumerate(cache_host_tensors(cache)):
            assert torch.equal(host[torch.from_numpy(retry.rows())], source[layer])
        cache.finish("slow")
        assert host_extents_used(cache) == 0
    finally:
        endpoint.close()


@needs_nixl
def test_request_released_behind_the_endpoints_back_still_times_out_cleanly(cache: Any) -> None:
    from hisparse.pd import NixlDecodeEndpoint

    now = [0.0]
    endpoint = NixlDecodeEndpoint(cache, unique("decode"), timeout_s=1.0, clock=lambda: now[0])
    try:
        endpoint.prepare_request("aborted-directly", 8)
        cache.abort("aborted-directly")
        now[0] = 1.0
        [outcome] = endpoint.poll()  # reports, never raises
        assert isinstance(outcome.error, TransferError) and endpoint.pending == []
        assert host_extents_used(cache) == 0
    finally:
        endpoint.close()


@needs_nixl
def test_descriptors_outside_the_pool_fail_on_both_sides_and_free_rows(
    cache: Any, endpoint: Any, sender: Any
) -> None:
    sender.connect(endpoint.publish())
    ticket = endpoint.prepare_request("bad", 20)
    pool_bytes = sum(t.numel() for t in cache_host_tensors(cache))
    # Past every registered byte of the decode pool: NIXL finds no registration to write to.
    moved = [address + 2 * pool_bytes for address in ticket.layer_addresses]
    stale = TransferTicket.from_dict({**ticket.to_dict(), "layer_addresses": moved})
    before = [t.clone() for t in cache_host_tensors(cache)]
    with pytest.raises(TransferError, match="could not start: NIXL refused the descriptors"):
        sender.write(stale, list(local_source(sender, 20)))
    [outcome] = poll_until(endpoint, 1)
    assert outcome.request_id == "bad" and isinstance(outcome.error, TransferError)
    assert sender.agent_name in str(outcome.error) and "released" in str(outcome.error)
    assert host_extents_used(cache) == 0
    for now, then in zip(cache_host_tensors(cache), before, strict=True):
        assert torch.equal(now, then)


@needs_nixl
def test_sources_that_do_not_match_the_ticket_are_refused_before_sending(
    cache: Any, endpoint: Any, sender: Any
) -> None:
    ticket = endpoint.prepare_request("mismatch", 12)
    source = local_source(sender, 12)
    with pytest.raises(InvalidInputError, match="not connected"):
        sender.write(ticket, list(source))
    sender.connect(endpoint.publish())
    with pytest.raises(InvalidInputError, match="2 source tensors"):
        sender.write(ticket, list(source[:2]))
    with pytest.raises(InvalidInputError, match="48-byte rows"):
        sender.write(ticket, [layer[:, :40] for layer in source])
    with pytest.raises(InvalidInputError, match="has 12 rows"):
        sender.write(ticket, list(source), np.arange(1, 13))
    unregistered = torch.zeros(NUM_LAYERS, 12, ROW_BYTES, dtype=torch.uint8)
    with pytest.raises(InvalidInputError, match="not in memory this sender registered"):
        sender.write(ticket, list(unregistered))
    assert endpoint.poll() == [] and endpoint.pending == ["mismatch"]
    endpoint.cancel("mismatch")
    assert host_extents_used(cache) == 0


@needs_nixl
def test_writing_to_a_decode_process_that_is_gone_raises_transfer_error(
    workers: dict[str, Worker], sender: Any
) -> None:
    worker = workers["decode-gone"]
    try:
        metadata, ticket_bytes = worker.receive()
        sender.connect(metadata)
    finally:
        worker.stop()
    assert worker.process.exitcode == 0
    source = local_source(sender, 20)
    with pytest.raises(TransferError, match="decode-gone") as error:
        sender.write(ticket_bytes, list(source)).wait(timeout_s=10.0)
    assert "re-run prefill" in str(error.value)


# --- without NIXL, and the pure ticket logic ----------------------------------------------------


def test_missing_nixl_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from hisparse.pd import NixlDecodeEndpoint, NixlPrefillSender

    monkeypatch.setitem(sys.modules, "nixl_cu12", None)
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'hisparse\[pd\]'"):
        NixlPrefillSender("nobody")
    with pytest.raises(MissingDependencyError, match=r"pip install 'hisparse\[pd\]'"):
        NixlDecodeEndpoint(object(), "nobody")  # type: ignore[arg-type]


@st.composite
def scattered_rows(draw: st.DrawFn) -> np.ndarray:
    pieces = draw(
        st.lists(st.tuples(st.integers(0, 300), st.integers(1, 9)), min_size=1, max_size=12)
    )
    return np.concatenate([np.arange(start, start + n) for start, n in pieces])


@settings(max_examples=60, deadline=None)
@given(destination=scattered_rows(), data=st.data())
def test_runs_cover_every_token_exactly_with_maximal_pieces(
    destination: np.ndarray, data: st.DataObject
) -> None:
    runs = coalesce_rows(destination)
    source = data.draw(st.permutations(list(range(destination.size + 5))))
    source = np.asarray(source[: destination.size])
    pieces = split_runs(runs, source)
    # Independent reference: walk token by token, start a piece wherever either side jumps.
    expected = []
    for t in range(destination.size):
        if t and destination[t] == destination[t - 1] + 1 and source[t] == source[t - 1] + 1:
            expected[-1][3] += 1
        else:
            expected.append([t, int(destination[t]), int(source[t]), 1])
    assert pieces.tolist() == expected
    assert len(runs) == 1 + int(np.count_nonzero(np.diff(destination) != 1))

    ticket = TransferTicket("t-0", "r", "agent", destination.size, 7, (1000, 5000), runs)
    assert np.array_equal(ticket.rows(), destination)
    assert TransferTicket.from_bytes(ticket.to_bytes()) == ticket
    descriptors = ticket.destination_descriptors()
    assert descriptors.shape == (2 * len(runs), 3)
    for layer, base in enumerate((1000, 5000)):
        for i, (_, first_row, count) in enumerate(runs):
            expected_descriptor = [base + 7 * first_row, 7 * count, 0]
            assert descriptors[layer * len(runs) + i].tolist() == expected_descriptor


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, "version 99 is not supported"),
        ({"runs": [[0, 0, 3], [4, 9, 2]]}, "does not continue at token 3"),
        ({"num_tokens": 9}, "runs cover 5 tokens of 9"),
        ({"row_bytes": "wide"}, "malformed"),
    ],
)
def test_altered_tickets_are_rejected(change: dict[str, Any], message: str) -> None:
    good = TransferTicket("t-1", "r", "agent", 5, 16, (4096,), ((0, 0, 3), (3, 9, 2)))
    with pytest.raises(InvalidInputError, match=message):
        TransferTicket.from_dict({**good.to_dict(), **change})
    with pytest.raises(InvalidInputError, match="not JSON"):
        TransferTicket.from_bytes(b"\xff not json")
