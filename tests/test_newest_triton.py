"""The Triton newest-token write against its torch reference (`index_copy_`).

On a GPU it runs natively (the bound launch's direct path after its first call); without one
on CPU tensors under TRITON_INTERPRET=1 at small sizes.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.kernels.newest_reference import NewestWriterReference
from interpreted_kernels import (  # sets TRITON_INTERPRET before kernels compile
    DEVICE,
    KERNEL_MARK,
    ON_GPU,
    newest_triton,
)

pytestmark = KERNEL_MARK

# (layers, device rows per layer incl. the sink, row bytes, batch capacity)
SIZES = [(3, 17, 16, 4), (2, 9, 1152, 3)]
if ON_GPU:
    SIZES.append((61, 4 * 128 + 1, 656, 128))  # DeepSeek-V3.2 rows, B=128


def buffers(device_rows: int, batch_cap: int, gen: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct device rows for the batch (padding at the sink row, the last), both widths."""
    rows = torch.randperm(device_rows - 1, generator=gen)[:batch_cap].to(torch.int32)
    rows[-1] = device_rows - 1
    newest = rows.to(DEVICE)
    return newest, newest.long()


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"L{s[0]}-W{s[2]}-B{s[3]}")
def test_the_kernel_writes_what_index_copy_writes(sizes, rng: torch.Generator) -> None:
    layers, device_rows, row_bytes, batch_cap = sizes
    got = torch.randint(0, 256, (layers, device_rows, row_bytes), dtype=torch.uint8,
                        generator=rng).to(DEVICE)
    want = got.clone()
    newest, newest_long = buffers(device_rows, batch_cap, rng)
    triton_writer = newest_triton.NewestWriterTriton(got, newest, newest_long)
    reference = NewestWriterReference(want, newest, newest_long)
    for step in range(3):
        if step == 2:  # the batch's rows move between steps: the same buffers, new values
            fresh, fresh_long = buffers(device_rows, batch_cap, rng)
            newest.copy_(fresh)
            newest_long.copy_(fresh_long)
        for layer in range(layers):
            for count in (batch_cap, max(1, batch_cap - 1)):
                kv = torch.randint(0, 256, (count, row_bytes), dtype=torch.uint8,
                                   generator=rng).to(DEVICE)  # a new tensor every call
                triton_writer(layer, kv)
                reference(layer, kv)
        if ON_GPU:
            torch.cuda.synchronize()
        assert torch.equal(got, want), f"step {step}"


def test_rows_the_kernel_cannot_take_go_through_index_copy(rng: torch.Generator) -> None:
    """A strided view and a misaligned start take the reference's copy, with its result."""
    layers, device_rows, row_bytes, batch_cap = SIZES[0]
    got = torch.zeros(layers, device_rows, row_bytes, dtype=torch.uint8, device=DEVICE)
    want = got.clone()
    newest, newest_long = buffers(device_rows, batch_cap, rng)
    triton_writer = newest_triton.NewestWriterTriton(got, newest, newest_long)
    reference = NewestWriterReference(want, newest, newest_long)
    wide = torch.randint(0, 256, (batch_cap, 2 * row_bytes + 1), dtype=torch.uint8,
                         generator=rng).to(DEVICE)
    for kv in (wide[:, :row_bytes], wide[:, 1 : row_bytes + 1]):
        triton_writer(0, kv)
        reference(0, kv)
    assert not triton_writer._launches  # neither was launched through the kernel
    assert torch.equal(got, want)
