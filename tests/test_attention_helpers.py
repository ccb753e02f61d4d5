"""The framework-neutral helpers around `swap_in`: `pad_top_k`, `gather_rows`, `device_bytes`.

Each against an independent reference on fresh random inputs: padding keeps every position
and adds only -1; a gather of returned rows reads nothing for -1 entries (the last row holds
NaN bytes here, which torch's plain indexing would read); the device bytes are at least the
tables' own tensors and grow by exactly the hot rows a larger hot buffer adds.
"""

from __future__ import annotations

import random

import pytest
import torch

import hisparse
from hisparse.errors import InvalidInputError, RequestStateError


def test_pad_top_k_keeps_every_position_and_pads_with_minus_one(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        rows, width = rng.randint(1, 5), rng.randint(1, 40)
        columns = rng.randint(1, width)
        top_k = torch.randint(-1, 1000, (rows, 1, columns), dtype=rng.choice(
            [torch.int32, torch.int64]))
        padded = hisparse.pad_top_k(top_k, width)
        assert padded.dtype == torch.int32 and padded.shape == (rows, 1, width)
        assert torch.equal(padded[..., :columns].long(), top_k.long())
        assert bool((padded[..., columns:] == -1).all())
    exact = torch.zeros((2, 8), dtype=torch.int32)
    assert hisparse.pad_top_k(exact, 8) is exact
    with pytest.raises(InvalidInputError, match="more than the cache's top_k=4"):
        hisparse.pad_top_k(exact, 4)
    with pytest.raises(InvalidInputError, match="must be an integer tensor"):
        hisparse.pad_top_k(exact.float(), 8)


def test_gather_rows_reads_nothing_for_minus_one(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn((50, 12), generator=generator).to(torch.bfloat16)
    kv[-1] = float("nan")  # what plain indexing reads for -1
    rows = torch.randint(-1, 49, (3, 2, 16), generator=generator, dtype=torch.int32)
    rows[0, 0, 0] = -1
    values, valid = hisparse.gather_rows(kv, rows)
    assert values.shape == (3, 2, 16, 12) and torch.equal(valid, rows >= 0)
    assert bool(torch.isfinite(values.float()).all())
    for index in torch.cartesian_prod(*(torch.arange(n) for n in rows.shape)).tolist():
        row = int(rows[tuple(index)])
        want = kv[row] if row >= 0 else torch.zeros(12, dtype=kv.dtype)
        assert torch.equal(values[tuple(index)], want), index
    as_bytes, _ = hisparse.gather_rows(kv.view(torch.uint8), rows)
    assert torch.equal(as_bytes.view(torch.bfloat16), values)
    with pytest.raises(InvalidInputError, match="rows must be an integer tensor"):
        hisparse.gather_rows(kv, rows.float())


def test_device_bytes_count_the_tables_and_not_the_host_pool() -> None:
    def build(hot: int) -> hisparse.HiSparseCache:
        config = hisparse.HiSparseConfig.from_preset("tiny", hot_slots=hot)
        return hisparse.HiSparseCache(config, device="cpu")

    small, large = build(128), build(192)
    t = small.tables
    tables = sum(getattr(t, name).nbytes for name in (
        "device_kv", "page_table", "seq_lens", "slot_key", "last_use", "lru_clock",
        "resident", "counters"))
    host = sum(layer.nbytes for layer in small.host_tensors())
    assert tables <= hisparse.device_bytes(small) < tables + host
    config = small.config
    hot_rows = config.num_layers * config.max_requests * 64 * config.row_bytes
    assert hisparse.device_bytes(large) - hisparse.device_bytes(small) >= hot_rows
    small.close()
    with pytest.raises(RequestStateError, match="closed"):
        hisparse.device_bytes(small)
    large.close()
