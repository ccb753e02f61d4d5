"""The staging ring `BatchBuffers.upload` sends from: a host copy is rewritten only once the
device has read it (its event), and while every copy is in flight the ring grows instead of
waiting. On the CPU one copy serves every upload (the copy is done when `copy_` returns)."""

from __future__ import annotations

import torch

from hisparse.core.batch import BatchBuffers, _StagingRing


class FakeEvent:
    def __init__(self) -> None:
        self.done = False


class FakeEvents:
    """Events the test completes by hand (a device that has not run the copies yet)."""

    def __init__(self) -> None:
        self.recorded: list[FakeEvent] = []

    def new_event(self) -> FakeEvent:
        return FakeEvent()

    def record_event(self, event: FakeEvent, device: object = None) -> None:
        event.done = False
        self.recorded.append(event)

    def event_done(self, event: FakeEvent | None) -> bool:
        return event is None or event.done


def buffers() -> BatchBuffers:
    return BatchBuffers(4, 8, 1, 99, torch.int16, torch.device("cpu"))


def test_a_copy_in_flight_is_never_rewritten_and_the_ring_grows_instead() -> None:
    events = FakeEvents()
    ring = _StagingRing(buffers().block, events, torch.device("meta"), pin=False)
    first = ring.take()
    ring.sent(first)
    second = ring.take()  # the first is in flight: a new copy
    assert second is not first
    ring.sent(second)
    third = ring.take()
    assert third is not first and third is not second
    ring.sent(third)
    first.event.done = True
    # The ring goes round: the next copy to reuse is the first, which has landed.
    assert ring.take() is first
    ring.sent(first)
    assert ring.take() is not second  # still in flight
    assert len(events.recorded) == 4


def test_on_the_cpu_one_copy_serves_every_upload() -> None:
    b = buffers()
    staged = {id(b.block._staging.take())}
    for count in (1, 3, 2, 4):
        b.upload({"req_slots": list(range(count)), "num_real": [count]})
        staged.add(id(b.block._staging.take()))
        assert b.req_slots.tolist() == list(range(count)) + [0] * (4 - count)
        assert b.num_real.tolist() == [count]
    assert len(staged) == 1
