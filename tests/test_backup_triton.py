"""Triton newest-token backup against the torch reference and a plain row-by-row expectation.

On a GPU it runs natively (registered host rows, graph replay with changing real counts);
without one it runs on CPU tensors under TRITON_INTERPRET=1 at small sizes.
"""

from __future__ import annotations

import pytest
import torch

from hisparse.errors import InvalidInputError
from hisparse.kernels.backup_reference import backup_newest_reference
from hisparse.layout.tables import CacheTables
from interpreted_kernels import (  # sets TRITON_INTERPRET before kernels compile
    DEVICE,
    KERNEL_MARK,
    ON_GPU,
    backup_triton,
)

POISON_BYTE = 0xA5  # host rows start with it: a row the kernel must not touch keeps it

pytestmark = KERNEL_MARK

# (layers, device rows per layer, host rows per layer, row bytes, batch capacity)
SIZES = [(3, 21, 40, 16, 5), (2, 9, 12, 1152, 4)]
if ON_GPU:
    SIZES.append((61, 4 * 4097 + 1, 128 * 8, 656, 128))  # DeepSeek-V3.2: 61 layers, B=128


def make_tables(layers: int, device_rows: int, host_rows: int, row_bytes: int,
                gen: torch.Generator, with_addresses: bool) -> CacheTables:
    device_kv = torch.empty(layers, device_rows, row_bytes, dtype=torch.uint8, device=DEVICE)
    refill(device_kv, gen)
    host_kv = []
    for _ in range(layers):
        # One poisoned guard row on each side of every layer's rows (`guard_rows`).
        guarded = torch.full((host_rows + 2, row_bytes), POISON_BYTE, dtype=torch.uint8)
        guarded = guarded.pin_memory() if ON_GPU else guarded
        host_kv.append(guarded[1 : host_rows + 1])
    addresses = None
    if with_addresses:  # what the engine passes (data_ptr is the device address on CUDA/CPU)
        addresses = torch.tensor([h.data_ptr() for h in host_kv], dtype=torch.int64,
                                 device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    return CacheTables(
        device_kv=device_kv, host_kv=host_kv, page_table=empty, seq_lens=empty,
        slot_key=empty, last_use=empty, lru_clock=empty, resident=empty,
        counters=torch.zeros(layers, 3, dtype=torch.int64, device=DEVICE),
        hot_slots=1, extent_tokens=1, host_kv_addresses=addresses,
    )


def guard_rows(host: torch.Tensor) -> torch.Tensor:
    """The rows just before and after a host layer of `make_tables`: nothing may write them."""
    guarded = host._base
    assert guarded is not None and guarded.shape[0] == host.shape[0] + 2
    return guarded[[0, -1]]


def refill(rows: torch.Tensor, gen: torch.Generator) -> None:
    """Fresh random bytes, drawn on the rows' device from a seed taken from `gen`."""
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    rows.random_(0, 256, generator=torch.Generator(rows.device).manual_seed(seed))


def twin(tables: CacheTables) -> CacheTables:
    """Same device rows, its own poisoned host rows (for the reference)."""
    host_kv = [host.clone() for host in tables.host_kv]
    return CacheTables(**{**tables.__dict__, "host_kv": host_kv, "host_kv_addresses": None})


def random_step(batch_cap: int, device_rows: int, host_rows: int, gen: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct device and host rows for real batch rows; padding rows point at the sink
    device row and host row -1, as the engine's do."""
    num_real = int(torch.randint(0, batch_cap + 1, (1,), generator=gen))
    newest = torch.randperm(device_rows - 1, generator=gen)[:batch_cap]
    targets = torch.randperm(host_rows, generator=gen)[:batch_cap]
    newest[num_real:] = device_rows - 1
    targets[num_real:] = -1
    return (newest.to(torch.int32).to(DEVICE), targets.to(torch.int32).to(DEVICE),
            torch.tensor([num_real], dtype=torch.int32, device=DEVICE))


def expected_host(tables: CacheTables, newest: torch.Tensor, targets: torch.Tensor,
                  num_real: int, before: list[torch.Tensor]) -> list[torch.Tensor]:
    """Row by row in Python: what every host layer must hold after the backup."""
    want = [host.clone() for host in before]
    device_kv = tables.device_kv.cpu()
    for b in range(num_real):
        for layer, host in enumerate(want):
            host[int(targets[b])] = device_kv[layer, int(newest[b])]
    return want


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"L{s[0]}-W{s[3]}-B{s[4]}")
@pytest.mark.parametrize("with_addresses", [True, False], ids=["address-table", "data-ptr"])
def test_backup_matches_reference_and_plain_copy(sizes, with_addresses: bool,
                                                  rng: torch.Generator) -> None:
    layers, device_rows, host_rows, row_bytes, batch_cap = sizes
    got = make_tables(layers, device_rows, host_rows, row_bytes, rng, with_addresses)
    want = twin(got)
    for _ in range(3):
        newest, targets, num_real = random_step(batch_cap, device_rows, host_rows, rng)
        before = [host.clone() for host in got.host_kv]
        backup_triton.backup_newest_triton(got, newest, targets, num_real)
        backup_newest_reference(want, newest, targets, num_real)
        if ON_GPU:
            torch.cuda.synchronize()
        plain = expected_host(got, newest.cpu(), targets.cpu(), int(num_real), before)
        for layer in range(layers):
            assert torch.equal(got.host_kv[layer], want.host_kv[layer]), f"layer {layer}"
            assert torch.equal(got.host_kv[layer], plain[layer]), f"layer {layer}"
        # New device bytes for the next step, so every step's copy is checked afresh.
        refill(got.device_kv, rng)


def test_a_batch_of_padding_only_writes_nothing(rng: torch.Generator) -> None:
    got = make_tables(2, 9, 12, 16, rng, with_addresses=True)
    newest = torch.arange(4, dtype=torch.int32, device=DEVICE)
    targets = torch.arange(4, dtype=torch.int32, device=DEVICE)  # valid: only num_real stops it
    backup_triton.backup_newest_triton(got, newest, targets,
                                       torch.zeros(1, dtype=torch.int32, device=DEVICE))
    if ON_GPU:
        torch.cuda.synchronize()
    assert all(bool((host == POISON_BYTE).all()) for host in got.host_kv)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("newest-int64", "newest_rows must be torch.int32"),
        ("targets-short", "host_rows must have shape"),
        ("num-real-two", "num_real must have shape"),
        ("addresses-int32", "host_kv_addresses must be torch.int64"),
        ("odd-row-bytes", "multiple of 4"),
        ("host-too-narrow", "host_kv\\[1\\] must be a contiguous uint8"),
    ],
)
def test_bad_input_raises_and_writes_nothing(change: str, message: str,
                                             rng: torch.Generator) -> None:
    row_bytes = 18 if change == "odd-row-bytes" else 16
    tables = make_tables(2, 9, 12, row_bytes, rng, with_addresses=True)
    newest = torch.arange(4, dtype=torch.int32, device=DEVICE)
    targets = torch.arange(4, dtype=torch.int32, device=DEVICE)
    num_real = torch.full((1,), 4, dtype=torch.int32, device=DEVICE)
    if change == "newest-int64":
        newest = newest.long()
    elif change == "targets-short":
        targets = targets[:3]
    elif change == "num-real-two":
        num_real = torch.full((2,), 4, dtype=torch.int32, device=DEVICE)
    elif change == "addresses-int32":
        tables.host_kv_addresses = tables.host_kv_addresses.to(torch.int32)
    elif change == "host-too-narrow":
        tables.host_kv[1] = tables.host_kv[1][:, :8]
    with pytest.raises(InvalidInputError, match=message):
        backup_triton.backup_newest_triton(tables, newest, targets, num_real)
    assert all(bool((host == POISON_BYTE).all()) for host in tables.host_kv)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="graph capture needs a CUDA or ROCm GPU; none is visible")
def test_graph_replay_with_changing_real_counts(rng: torch.Generator) -> None:
    layers, device_rows, host_rows, row_bytes, batch_cap = SIZES[-1]
    got = make_tables(layers, device_rows, host_rows, row_bytes, rng, with_addresses=True)
    newest, targets, num_real = random_step(batch_cap, device_rows, host_rows, rng)
    backup_triton.backup_newest_triton(got, newest, targets, num_real)  # compiles outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backup_triton.backup_newest_triton(got, newest, targets, num_real)
    counts = []
    for _ in range(4):
        new_newest, new_targets, new_real = random_step(batch_cap, device_rows, host_rows, rng)
        newest.copy_(new_newest)
        targets.copy_(new_targets)
        num_real.copy_(new_real)
        counts.append(int(new_real))
        refill(got.device_kv, rng)
        before = [host.clone() for host in got.host_kv]
        graph.replay()
        torch.cuda.synchronize()
        plain = expected_host(got, newest.cpu(), targets.cpu(), int(num_real), before)
        for layer in range(layers):
            assert torch.equal(got.host_kv[layer], plain[layer]), f"layer {layer}"
    assert len(set(counts)) > 1, "replays never changed num_real"


def test_the_bound_launcher_replays_its_launch_and_rebinds_for_other_tensors(
        rng: torch.Generator) -> None:
    """The engine's `BackupLauncher`: the same persistent buffers every step (refilled in
    place) give the reference's rows through the launch bound at the first call; other
    tensors are checked and bound anew, and a call that fails its checks leaves nothing
    bound to replay."""
    layers, device_rows, host_rows, row_bytes, batch_cap = SIZES[0]
    got = make_tables(layers, device_rows, host_rows, row_bytes, rng, with_addresses=True)
    want = twin(got)
    launcher = backup_triton.BackupLauncher(direct=True)
    newest, targets, num_real = random_step(batch_cap, device_rows, host_rows, rng)
    for step in range(4):
        if step == 2:  # new buffers: a fresh bind
            newest, targets, num_real = (t.clone() for t in (newest, targets, num_real))
        fresh = random_step(batch_cap, device_rows, host_rows, rng)
        for buffer, values in zip((newest, targets, num_real), fresh, strict=True):
            buffer.copy_(values)  # in place, as begin_decode_step uploads into its buffers
        launcher(got, newest, targets, num_real)
        backup_newest_reference(want, newest, targets, num_real)
        if ON_GPU:
            torch.cuda.synchronize()
        for layer in range(layers):
            assert torch.equal(got.host_kv[layer], want.host_kv[layer]), (step, layer)
        refill(got.device_kv, rng)
    with pytest.raises(InvalidInputError, match="num_real"):
        launcher(got, newest, targets, num_real.to(torch.int64))
    assert launcher._launch is None and launcher._last == ()
