"""The quiet step's Triton advance against its torch reference (core.batch.QuietRun).

On a GPU it runs natively (the bound launch's direct path after its first call); without one
on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels.advance_reference import AdvanceReference
from interpreted_kernels import DEVICE, KERNEL_MARK, advance_triton  # (sets the interpreter)

pytestmark = KERNEL_MARK


@pytest.mark.parametrize(("capacity", "slots"), [(1, 1), (3, 4), (16, 16), (128, 160)])
def test_the_kernel_moves_on_what_the_reference_moves_on(
        capacity: int, slots: int, rng: torch.Generator) -> None:
    """Random buffers and row counts: the real rows' host rows and lengths move on and their
    slots' lengths follow; padding rows and the other slots stay as they were."""
    def buffers() -> list[torch.Tensor]:
        batch_slots = torch.randperm(slots, generator=rng)[:capacity]
        return [t.to(DEVICE) for t in (
            batch_slots,
            torch.zeros(1, dtype=torch.int32),
            torch.randint(0, 1 << 20, (capacity,), dtype=torch.int32, generator=rng),
            torch.randint(1, 1 << 16, (capacity,), dtype=torch.int32, generator=rng),
            torch.randint(0, 1 << 16, (slots,), dtype=torch.int32, generator=rng))]

    got = buffers()
    want = [t.clone() for t in got]
    kernel = advance_triton.AdvanceTriton(*got, direct=False)
    reference = AdvanceReference(*want)
    for _ in range(3):
        rows = int(torch.randint(1, capacity + 1, (1,), generator=rng))
        got[1].fill_(rows)
        want[1].fill_(rows)
        kernel(rows)
        reference(rows)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.cpu(), b.cpu()), rows
