"""NixlDecodeEndpoint bookkeeping when something raises, against a fake NIXL agent (no NIXL needed):
outcomes of transfers that already ended are never lost, and a request is never forgotten while
it still holds reserved rows. On the prefill side, a failed WRITE frees the decode node's rows
early (its failure notice) only once NIXL cancelled it."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import pd_workers
from hisparse.errors import RequestStateError, TransferError
from hisparse.pd.nixl_adapter import _NOTIF_PREFIX, PrefillWrite

CONFIG = pd_workers.SMALL_CACHE


class FakeAgent:
    """The part of a NIXL agent the decode endpoint calls; notifications are queued by tests."""

    def __init__(self, name: str, config: Any) -> None:
        self.name = name
        self.notifs: dict[str, list[bytes]] = {}

    def register_memory(self, tensors: list[Any]) -> object:
        return object()

    def deregister_memory(self, registration: object) -> None:
        pass

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        notifs, self.notifs = self.notifs, {}
        return notifs

    def done(self, transfer_id: str) -> None:
        message = _NOTIF_PREFIX + b"done " + transfer_id.encode()
        self.notifs.setdefault("prefill", []).append(message)


@pytest.fixture
def fake_nixl(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("nixl_cu12")
    module.nixl_agent_config = lambda backends: backends  # type: ignore[attr-defined]
    module.nixl_agent = FakeAgent  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nixl_cu12", module)


@pytest.fixture
def cache() -> Iterator[Any]:
    cache = pd_workers.make_cache(**CONFIG)
    yield cache
    cache.close()


def test_poll_that_raises_keeps_the_outcomes_of_transfers_that_ended(
    fake_nixl: None, cache: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hisparse.pd import NixlDecodeEndpoint

    now = [0.0]
    endpoint = NixlDecodeEndpoint(cache, "decode", timeout_s=5.0, clock=lambda: now[0])
    tickets = {rid: endpoint.prepare_request(rid, 16) for rid in ("A", "B", "C")}
    for rid in ("A", "B"):
        endpoint._agent.done(tickets[rid].transfer_id)
    endpoint.wait("A", timeout_s=1.0)  # B's outcome is kept for the next poll()

    # C's rows land, but completing it fails with something that is not a HisparseError
    # (e.g. the device running out of memory while seeding its hot buffer).
    complete = cache.complete_transfer

    def out_of_memory(request_id: Any) -> None:
        if request_id == "C":
            raise RuntimeError("out of memory while seeding")
        complete(request_id)

    monkeypatch.setattr(cache, "complete_transfer", out_of_memory)
    tickets["D"] = endpoint.prepare_request("D", 16)
    endpoint._agent.done(tickets["C"].transfer_id)
    endpoint._agent.done(tickets["D"].transfer_id)  # in the same batch, behind C's
    with pytest.raises(RuntimeError, match="out of memory"):
        endpoint.poll()
    monkeypatch.setattr(cache, "complete_transfer", complete)

    # B already runs in the cache: its outcome must still reach the scheduler. D's rows
    # landed too: its notification, unread when C's raised, is handled now.
    outcomes = endpoint.poll()
    assert [(o.request_id, o.ready) for o in outcomes] == [("B", True), ("D", True)]
    assert cache.request_state("B").name == "RUNNING"
    assert cache.request_state("D").name == "RUNNING"
    # C still holds reserved rows: the endpoint must not forget it, so its deadline frees them.
    assert endpoint.pending == ["C"]
    now[0] = 5.0
    [outcome] = endpoint.poll()
    assert outcome.request_id == "C" and isinstance(outcome.error, TransferError)
    for rid in ("A", "B", "D"):
        cache.finish(rid)
    occupancy = cache.stats().occupancy
    assert occupancy.host_extents_used == 0 and occupancy.request_slots_used == 0
    endpoint.close()


def test_pool_without_every_layer_is_refused_clearly_and_nothing_stays_reserved(
    fake_nixl: None, cache: Any
) -> None:
    from hisparse.pd import NixlDecodeEndpoint

    endpoint = NixlDecodeEndpoint(cache, "decode", host_tensors=cache.host_tensors()[:2])
    with pytest.raises(TransferError, match="2 layers"):
        endpoint.prepare_request("X", 4)
    assert endpoint.pending == []
    assert cache.stats().occupancy.host_extents_used == 0
    endpoint.close()


@pytest.mark.parametrize("timeout_s", [float("nan"), 0.0, -1.0])
def test_a_timeout_that_never_expires_or_already_has_is_refused_before_reserving(
    fake_nixl: None, cache: Any, timeout_s: float
) -> None:
    from hisparse.errors import InvalidInputError
    from hisparse.pd import NixlDecodeEndpoint

    # NaN compares false with every clock reading: the rows would stay reserved forever.
    with pytest.raises(InvalidInputError, match="timeout_s"):
        NixlDecodeEndpoint(cache, "decode", timeout_s=timeout_s)
    endpoint = NixlDecodeEndpoint(cache, "decode")
    with pytest.raises(InvalidInputError, match="timeout_s"):
        endpoint.prepare_request("X", 4, timeout_s=timeout_s)
    assert endpoint.pending == []
    assert cache.stats().occupancy.host_extents_used == 0
    endpoint.close()


class FakeSenderAgent:
    """A prefill agent whose posted WRITE failed, and which may refuse to cancel it."""

    def __init__(self, cancels: bool) -> None:
        self.cancels = cancels

    def check_xfer_state(self, handle: object) -> str:
        return "ERR"

    def release_xfer_handle(self, handle: object) -> None:
        if not self.cancels:
            raise RuntimeError("NIXL: handle busy")


@pytest.mark.parametrize("cancels", [True, False])
def test_a_failed_write_sends_its_failure_notice_only_once_cancelled(cancels: bool) -> None:
    """The notice frees the decode node's rows at once: sent while the WRITE may still be
    landing, it would let those rows go to another request under it."""
    notices: list[str] = []
    sender = SimpleNamespace(
        _agent=FakeSenderAgent(cancels),
        _notify_failure=lambda ticket, reason: notices.append(reason),
    )
    ticket = SimpleNamespace(transfer_id="t1", request_id="r1", agent_name="decode")
    write = PrefillWrite(sender, ticket, handle=object())  # type: ignore[arg-type]
    with pytest.raises(TransferError, match="on the failure notice" if cancels
                       else "at its deadline"):
        write.poll()
    assert notices == (["NIXL reported the transfer state ERR"] if cancels else [])
    with pytest.raises(TransferError):  # the error sticks; nothing is sent twice
        write.poll()
    assert len(notices) == (1 if cancels else 0)


def test_a_closed_endpoint_reserves_nothing(fake_nixl: None, cache: Any) -> None:
    from hisparse.pd import NixlDecodeEndpoint

    endpoint = NixlDecodeEndpoint(cache, "decode", timeout_s=5.0)
    endpoint.prepare_request("A", 16)
    endpoint.close()
    with pytest.raises(RequestStateError, match="closed; create a new one"):
        endpoint.prepare_request("B", 16)
    occupancy = cache.stats().occupancy
    assert occupancy.host_extents_used == 0 and occupancy.requests_by_state == {}


def test_a_prefix_is_not_transferred_and_a_failed_transfer_keeps_its_holders(
    fake_nixl: None,
) -> None:
    """With a shared prefix the ticket covers only the tokens after it; a transfer that
    times out releases the request's own rows and its hold on the prefix, nothing more."""
    import numpy as np
    import torch

    from hisparse.errors import InvalidInputError
    from hisparse.pd import NixlDecodeEndpoint

    cache = pd_workers.make_cache(**CONFIG, residency_map="position")
    cache.admit("A", 40)  # extents of 16: two whole, 8 tokens in a third
    cache.write_prefill("A", torch.zeros(CONFIG["num_layers"], 40, CONFIG["row_bytes"],
                                         dtype=torch.uint8))
    cache.commit_prefill("A")
    handle = cache.retain_prefix("A", 40)
    holders = list(cache._pool._holders)
    now = [0.0]
    endpoint = NixlDecodeEndpoint(cache, "decode", timeout_s=5.0, clock=lambda: now[0])
    ticket = endpoint.prepare_request("B", 50, prefix=handle)
    assert ticket.num_tokens == 10
    assert np.array_equal(ticket.rows(), cache.host_rows("B")[40:])
    late = endpoint.prepare_request("C", 45, prefix=("A", 33))
    assert late.num_tokens == 12
    endpoint._agent.done(ticket.transfer_id)
    [outcome] = endpoint.poll()
    assert outcome.request_id == "B" and outcome.ready
    assert cache.host_rows("B")[:32].tolist() == cache.host_rows("A")[:32].tolist()
    now[0] = 5.0
    [outcome] = endpoint.poll()  # C timed out: its rows released, the prefix's holders kept
    assert outcome.request_id == "C" and isinstance(outcome.error, TransferError)
    cache.finish("B")
    assert cache._pool._holders == holders
    with pytest.raises(InvalidInputError, match="nothing to transfer"):
        endpoint.prepare_request("D", 40, prefix=handle)
    assert endpoint.pending == [] and cache._pool._holders == holders
    cache.release_prefix(handle)
    cache.finish("A")
    assert cache._pool.allocator.free_extents == cache._pool.num_extents
    endpoint.close()
    cache.close()
