"""cancel_decode_step: a forward pass that fails part way through a step must leave every
request as it was before the step, whatever the step had done by then, so that the batch can
be decoded again (or dropped) with no lost or foreign bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hisparse
from test_reliability_state import check_table_invariants, prefill_patterned, row_pattern

LAYERS, WIDTH, TOP_K, HOT, EXTENT, GROUP = 4, 32, 4, 8, 4, 2
# Request -> (uid, prompt length): the new token of each lands in another regime.
REQUESTS = {
    "short": (1, 5),  # position 5 < H: its own hot slot
    "switch": (2, HOT),  # position H: the first token in the newest slot
    "long": (3, 20),  # position 20 > H, and 20 = 5 extents: it needs a new extent
    "long2": (4, 13),  # position 13 > H, inside its last extent
}
# How far the failed step got: (layers given write_newest, layers swapped in).
PROGRESS = {"nothing": (0, 0), "some rows": (3, 0), "anchor": (4, 1), "group": (2, 3),
            "everything": (4, 4)}


def build(backend: Any, prefetch: bool | None) -> hisparse.HiSparseCache:
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=LAYERS, row_bytes=WIDTH, top_k=TOP_K, hot_slots=HOT,
        index_group_size=GROUP, extent_tokens=EXTENT, max_requests=4, max_batch=4,
        host_pool_tokens=40 * EXTENT, max_seq_len=32, validate=True,
        shared_index_prefetch=prefetch,
    )
    cache = hisparse.HiSparseCache(config, device=backend)
    for name, (uid, tokens) in REQUESTS.items():
        prefill_patterned(cache, name, uid, tokens, LAYERS, WIDTH)
    return cache


def random_top_k(cache: hisparse.HiSparseCache, names: list[str], gen: torch.Generator
                 ) -> torch.Tensor:
    rows = []
    for name in names:
        n = cache.seq_len(name)
        chosen = torch.randperm(n, generator=gen)[:TOP_K].tolist()
        rows.append(chosen + [-1] * (TOP_K - len(chosen)))
    return torch.tensor(rows, dtype=torch.int32, device=cache.device)


def decode_and_verify(cache: hisparse.HiSparseCache, names: list[str], gen: torch.Generator,
                      uids: dict[str, int] | None = None) -> None:
    """A whole step with the true rows; every returned row and, after the backup, every host
    row of every token holds its bytes. `uids`: request -> the uid its rows were made with."""
    uids = uids or {name: uid for name, (uid, _) in REQUESTS.items()}
    cache.begin_decode_step(names)
    for layer in range(LAYERS):
        cache.write_newest(layer, torch.cat([
            row_pattern(uids[n], layer, torch.tensor([cache.seq_len(n) - 1]), WIDTH)
            for n in names]).to(cache.device))
    top_k = random_top_k(cache, names, gen)
    for layer in range(LAYERS):
        rows = cache.swap_in(layer, top_k).cpu().long()
        device_kv = cache.device_kv(layer).cpu()
        for b, name in enumerate(names):
            want = row_pattern(uids[name], layer, top_k[b].cpu(), WIDTH)
            assert torch.equal(device_kv[rows[b]], want), (name, layer)
    cache.end_decode_step()
    cache.backend.synchronize()
    for name in names:
        n, host_rows = cache.seq_len(name), torch.from_numpy(cache.host_rows(name))
        for layer in range(LAYERS):
            want = row_pattern(uids[name], layer, torch.arange(n), WIDTH)
            assert torch.equal(cache.host_tensors()[layer][host_rows], want), (name, layer)


@pytest.mark.parametrize("progress", PROGRESS)
@pytest.mark.parametrize("prefetch", [None, False], ids=["prefetch-default", "no-prefetch"])
def test_a_cancelled_step_leaves_every_request_as_before(backend: Any, progress: str,
                                                        prefetch: bool | None,
                                                        rng: torch.Generator) -> None:
    cache = build(backend, prefetch)
    names = list(REQUESTS)
    decode_and_verify(cache, names, rng)  # the long requests' hot buffers have churned
    lengths = {n: cache.seq_len(n) for n in names}
    free_extents = cache.stats().occupancy.host_extents_total - \
        cache.stats().occupancy.host_extents_used

    written, swapped = PROGRESS[progress]
    cache.begin_decode_step(names)
    for layer in range(written):  # rows of a forward pass that then failed: noise
        cache.write_newest(layer, torch.randint(0, 256, (len(names), WIDTH), dtype=torch.uint8,
                                                generator=rng).to(cache.device))
    top_k = random_top_k(cache, names, rng)  # may name the new token: it is in the step
    for layer in range(swapped):
        cache.swap_in(layer, top_k)
    cache.cancel_decode_step()

    assert {n: cache.seq_len(n) for n in names} == lengths
    occupancy = cache.stats().occupancy
    assert occupancy.host_extents_total - occupancy.host_extents_used == free_extents
    check_table_invariants(cache)
    with pytest.raises(hisparse.RequestStateError, match="needs an open decode step"):
        cache.end_decode_step()
    # The same batch decodes again as if the failed step had never been, then a smaller one.
    for batch in (names, names, ["long", "short"]):
        decode_and_verify(cache, batch, rng)
        check_table_invariants(cache)
    cache.close()


def test_a_cancelled_request_can_be_dropped_and_its_rows_reused(backend: Any,
                                                               rng: torch.Generator) -> None:
    """After a cancel the scheduler may abort the requests; the freed extents and slots go to
    the next request with none of the cancelled step's state attached."""
    cache = build(backend, None)
    names = list(REQUESTS)
    cache.begin_decode_step(names)
    for layer in range(LAYERS):
        cache.write_newest(layer, torch.zeros(len(names), WIDTH, dtype=torch.uint8,
                                              device=cache.device))
    cache.swap_in(0, random_top_k(cache, names, rng))
    cache.cancel_decode_step()
    cache.abort("long")
    cache.preempt("short")
    check_table_invariants(cache)
    uid, tokens = 9, 23
    prefill_patterned(cache, "new", uid, tokens, LAYERS, WIDTH)
    cache.resume("short")
    uids = {"new": uid, "short": REQUESTS["short"][0], "switch": REQUESTS["switch"][0]}
    for _ in range(3):
        decode_and_verify(cache, list(uids), rng, uids)
        check_table_invariants(cache)
    cache.close()
