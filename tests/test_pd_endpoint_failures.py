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
