"""Ragged appends in verify steps (`begin_decode_step(ids, num_tokens=S, appends=[...])`): each
request's S query tokens close a_b windows, 0 <= a_b <= S, so it appends a_b rows, and
`end(accepted=[e_b])` keeps e_b of them, 0 <= e_b <= a_b (docs/deepseek-v4.md).

An independent model keeps, per request, which step wrote each position (its row is
`row_pattern(uid, layer, position)`, each step's rows with a fresh uid, so a rejected row never
matches what a later step writes there). Every request of every regime (short, switching to
the newest slot, long needing an extent, long inside one) runs random S, a_b, e_b and cancels
on both residency maps, with folded and two-call new rows: every returned row, every host row,
the table invariants, the lengths, the extents held and the bytes backed up are checked.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import hisparse
from hisparse.tools.combination_fuzz import swap_in_new_rows
from test_reliability_state import check_table_invariants, prefill_patterned, row_pattern

LAYERS, WIDTH, TOP_K, HOT, EXTENT, GROUP, D = 3, 32, 4, 16, 4, 2, 4
# Request -> prompt length: short ones, one about to switch to the newest slot, a long one
# whose next row starts an extent and one inside an extent.
PROMPTS = {"short": 5, "short2": 2, "switch": HOT - 1, "long": 24, "long2": 21}


def build(backend: Any, residency_map: str = "host_row", validate: bool = True
          ) -> hisparse.HiSparseCache:
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=LAYERS, row_bytes=WIDTH, top_k=TOP_K, hot_slots=HOT,
        index_group_size=GROUP, extent_tokens=EXTENT, max_requests=5, max_batch=5,
        host_pool_tokens=60 * EXTENT, max_seq_len=96, max_draft_tokens=D, validate=validate,
        residency_map=residency_map)
    cache = hisparse.HiSparseCache(config, device=backend)
    for uid, (name, tokens) in enumerate(PROMPTS.items(), start=1):
        prefill_patterned(cache, name, uid, tokens, LAYERS, WIDTH)
    return cache


class Model:
    """What each position of each request must hold: the uid of the step that wrote it."""

    def __init__(self) -> None:
        self.uids = {name: [uid] * n for uid, (name, n) in enumerate(PROMPTS.items(), start=1)}
        self.next_uid = 100

    def rows(self, name: str, layer: int, positions: list[int], step_uid: int = -1
             ) -> torch.Tensor:
        """The rows of `positions` (those at or past the stored length: the open step's)."""
        held = self.uids[name]
        uid = torch.tensor([held[p] if p < len(held) else step_uid for p in positions])
        return row_pattern(uid, layer, torch.tensor(positions), WIDTH)


def _top_k(rng: random.Random, visible: list[int], S: int) -> torch.Tensor:
    """`[B, S, K]`: every query of request b picks among positions below `visible[b]`,
    often its newest visible one (slot H's, or a draft slot's)."""
    rows = []
    for n in visible:
        queries = []
        for _ in range(S):
            picks = rng.sample(range(n), min(TOP_K, n))
            if rng.random() < 0.5 and n - 1 not in picks:
                picks[0] = n - 1
            queries.append(picks + [-1] * (TOP_K - len(picks)))
        rows.append(queries)
    return torch.tensor(rows, dtype=torch.int32)


def ragged_verify_step(cache: hisparse.HiSparseCache, model: Model, rng: random.Random,
                       names: list[str], S: int, appends: list[int], folded: bool,
                       cancel: bool, accepted: list[int] | str = "random") -> list[int]:
    """One step, every returned row checked; returns the rows each request kept
    (`accepted`: the counts, "random" ones, or "all": `end()` without them)."""
    before = [cache.seq_len(n) for n in names]
    step = cache.begin_decode_step(names, num_tokens=S, appends=appends)
    assert step.appends == tuple(appends) and step.plan.union
    assert step.plan.appends == "ragged" and [p[0] for p in step.positions] == before
    visible = [n + a for n, a in zip(before, appends, strict=True)]
    assert [cache.seq_len(n) for n in names] == visible
    uid = model.next_uid
    model.next_uid += 1
    top_k = _top_k(rng, visible, S).to(cache.device)
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    cancel_after = rng.randrange(LAYERS) if cancel else None
    for layer in range(LAYERS):
        # Row s of request b is its new row n0 + s for s < a_b; noise elsewhere (it must go
        # nowhere).
        kv = torch.randint(0, 256, (len(names), S, WIDTH), dtype=torch.uint8, generator=gen)
        for b, (name, n0, a) in enumerate(zip(names, before, appends, strict=True)):
            if a:
                kv[b, :a] = model.rows(name, layer, list(range(n0, n0 + a)), uid)
        kv = kv.to(cache.device)
        rows = swap_in_new_rows(step, layer, top_k, kv, folded)
        device_kv = cache.device_kv(layer).cpu()
        for b, name in enumerate(names):
            picked = top_k[b].cpu()
            got = device_kv[rows[b].cpu().long().clamp(min=0)]
            want = model.rows(name, layer, picked.clamp(min=0).flatten().tolist(), uid)
            want = want.view(S, TOP_K, WIDTH)
            assert bool((rows[b].cpu()[picked >= 0] >= 0).all()), (name, layer)
            assert torch.equal(got[picked >= 0], want[picked >= 0]), (name, layer, appends)
        if layer == cancel_after:
            break
    if cancel:
        step.cancel()
        return [0] * len(names)
    kept = (list(appends) if accepted == "all" else
            [rng.randint(0, a) for a in appends] if accepted == "random" else list(accepted))
    step.end(None if accepted == "all" else kept)
    for name, e in zip(names, kept, strict=True):
        model.uids[name] += [uid] * e
    return kept


def check_everything(cache: hisparse.HiSparseCache, model: Model) -> None:
    """Lengths, extents held, table invariants and every host row against the model."""
    cache.backend.synchronize()
    check_table_invariants(cache)
    host = cache.host_tensors()
    for name, uids in model.uids.items():
        assert cache.seq_len(name) == len(uids), name
        rows = torch.from_numpy(cache.host_rows(name))
        for layer in range(LAYERS):
            assert torch.equal(host[layer][rows],
                               model.rows(name, layer, list(range(len(uids))))), (name, layer)
    extents = sum(-(-len(uids) // EXTENT) for uids in model.uids.values())
    assert cache.stats().occupancy.host_extents_used == extents


def _backed_up(cache: hisparse.HiSparseCache) -> int:
    return cache.stats().layers[0].bytes_device_to_host


@pytest.mark.parametrize("residency_map", ["host_row", "position"])
@pytest.mark.parametrize("folded", [False, True], ids=["write-then-swap", "folded"])
def test_ragged_verify_steps_keep_exactly_the_accepted_rows(
        backend: Any, folded: bool, residency_map: str, seed: int) -> None:
    rng = random.Random(seed)
    cache = build(backend, residency_map)
    model = Model()
    names = list(PROMPTS)
    for _ in range(12):
        rng.shuffle(names)
        S = rng.randint(2, D)
        appends = [rng.randint(0, S) for _ in names]
        cancel = rng.random() < 0.2
        backed_up = _backed_up(cache)
        kept = ragged_verify_step(cache, model, rng, names, S, appends, folded, cancel)
        assert _backed_up(cache) - backed_up == sum(kept) * WIDTH, (appends, kept)
        check_everything(cache, model)
    cache.close()


def test_every_accept_case_of_one_request_and_single_token_steps_after(
        backend: Any, seed: int) -> None:
    """e_b = 0 with a_b > 0 (slot H gets its newest back from the host), e_b = 0 with a_b = 0,
    all kept (accepted=None), each followed by steps that read the newest slot."""
    rng = random.Random(seed)
    cache = build(backend)
    model = Model()
    names = list(PROMPTS)
    cases = [([3, 2, 3, 3, 1], [0, 0, 0, 0, 0]), ([0, 0, 0, 0, 0], [0, 0, 0, 0, 0]),
             ([1, 3, 0, 2, 3], None), ([2, 0, 3, 1, 1], [1, 0, 3, 0, 1])]
    for appends, accepted in cases:
        step = cache.begin_decode_step(names, num_tokens=3, appends=appends)
        step.cancel()  # nothing taken, nothing lost
        check_everything(cache, model)
        ragged_verify_step(cache, model, rng, names, 3, appends, accepted is None, False,
                           "all" if accepted is None else accepted)
        check_everything(cache, model)
        # a ragged step that reads each newest (slot H, or the short slot) and appends none
        ragged_verify_step(cache, model, rng, names, 2, [0] * 5, False, False)
    cache.close()


def test_an_unvalidated_step_serves_every_appended_row_to_every_query_and_no_more(
        backend: Any) -> None:
    """Query 0 may read the last appended row (the kernels' bound is the request's, not the
    query's own position); a position past it is invalid: -1 and counted."""
    cache = build(backend, validate=False)
    model = Model()
    names = ["long", "short"]
    n0 = [cache.seq_len(n) for n in names]
    step = cache.begin_decode_step(names, num_tokens=3, appends=[3, 1])
    for layer in range(LAYERS):
        step.write_newest(layer, torch.stack([
            model.rows("long", layer, [n0[0], n0[0] + 1, n0[0] + 2], 7),
            torch.cat([model.rows("short", layer, [n0[1]], 7), torch.zeros(2, WIDTH,
                                                                            dtype=torch.uint8)]),
        ]).to(cache.device))
    top_k = torch.full((2, 3, TOP_K), -1, dtype=torch.int32)
    top_k[0, 0, :2] = torch.tensor([n0[0] + 2, n0[0] - 1])
    top_k[1, 2, :2] = torch.tensor([n0[1], n0[1] + 1])  # n0 + 1: not appended
    invalid = cache.stats().layers[0].invalid
    rows = step.swap_in(0, top_k.to(cache.device)).cpu()
    device_kv = cache.device_kv(0).cpu()
    assert torch.equal(device_kv[rows[0, 0, :2].long()],
                       model.rows("long", 0, [n0[0] + 2, n0[0] - 1], 7))
    assert torch.equal(device_kv[rows[1, 2, 0].long()], model.rows("short", 0, [n0[1]], 7)[0])
    assert int(rows[1, 2, 1]) == -1
    assert cache.stats().layers[0].invalid == invalid + 1
    step.cancel()
    check_everything(cache, model)
    cache.close()


def test_the_plan_shows_a_ragged_verify_step(backend: Any) -> None:
    cache = build(backend)
    plan = cache.step_plan(3, 2, appends="ragged")
    assert plan.appends == "ragged" and plan.union and not plan.quiet_advance
    step = cache.begin_decode_step(["long", "short", "switch"], num_tokens=2,
                                   appends=torch.tensor([2, 0, 1]))
    assert step.plan is plan and step.appends == (2, 0, 1)
    step.cancel()
    # Every request appending S is still a ragged step (its accept counts start at 0).
    step = cache.begin_decode_step(["long", "short"], num_tokens=2, appends=[2, 2])
    assert step.plan.appends == "ragged"
    for layer in range(LAYERS):
        step.write_newest(layer, torch.zeros(2, 2, WIDTH, dtype=torch.uint8,
                                                device=cache.device))
    step.end([0, 2])
    assert cache.seq_len("long") == PROMPTS["long"] and cache.seq_len("short") == 7
    with pytest.raises(hisparse.InvalidInputError, match="dedupe=False"):
        cache.step_plan(2, 1, dedupe=True, appends="ragged")
    cache.close()


BAD_APPENDS = [([3, 0], r"appends\[0\] = 3.*0\.\.2"), ([0, -1], r"appends\[1\] = -1"),
               ([True, 0], r"appends\[0\] = True"), ([1.0, 0], r"appends\[0\] = 1\.0"),
               ([1], "appends has 1 entries for a batch of 2"),
               (torch.tensor([1.0, 0.0]), "1-D integer tensor")]


@pytest.mark.parametrize(("appends", "match"), BAD_APPENDS)
def test_bad_appends_are_refused_before_anything_changes(appends: Any, match: str) -> None:
    cache = build("cpu")
    with pytest.raises(hisparse.InvalidInputError, match=match):
        cache.begin_decode_step(["long", "short"], num_tokens=2, appends=appends)
    assert cache.seq_len("long") == PROMPTS["long"] and cache.seq_len("short") == 5
    with pytest.raises(hisparse.InvalidInputError, match="dedupe"):
        cache.begin_decode_step(["long", "short"], num_tokens=2, dedupe=True, appends=[1, 0])
    cache.begin_decode_step(["long", "short"], num_tokens=2, appends=[1, 0]).cancel()
    cache.close()


BAD_ACCEPTED = [([2, 0], r"accepted\[0\] = 2.*0\.\.1"), ([0, -1], r"accepted\[1\] = -1"),
                ([1], "accepted must list one int"), ([True, 0], r"accepted\[0\] = True"),
                ([1.0, 0], r"accepted\[0\] = 1\.0"), (torch.tensor([1.0, 0.0]), "integer")]


@pytest.mark.parametrize(("accepted", "match"), BAD_ACCEPTED)
def test_bad_accept_counts_are_refused_and_the_step_stays_open(accepted: Any,
                                                               match: str) -> None:
    cache = build("cpu")
    step = cache.begin_decode_step(["long", "short"], num_tokens=2, appends=[1, 0])
    for layer in range(LAYERS):
        step.write_newest(layer, torch.zeros(2, 2, WIDTH, dtype=torch.uint8,
                                                device=cache.device))
    with pytest.raises(hisparse.InvalidInputError, match=match):
        step.end(accepted)
    assert step.is_open and cache.seq_len("long") == PROMPTS["long"] + 1
    step.end([1, 0])
    assert cache.seq_len("long") == PROMPTS["long"] + 1 and cache.seq_len("short") == 5
    cache.close()


def test_a_full_request_may_append_nothing_but_not_a_row() -> None:
    """At max_seq_len a request still looks up (appending 0); one row more is refused before
    anything changes."""
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=LAYERS, row_bytes=WIDTH, top_k=TOP_K, hot_slots=HOT,
        index_group_size=GROUP, extent_tokens=EXTENT, max_requests=2, max_batch=2,
        host_pool_tokens=20 * EXTENT, max_seq_len=32, max_draft_tokens=D, validate=True)
    cache = hisparse.HiSparseCache(config, device="cpu")
    for uid, (name, tokens) in enumerate([("full", 32), ("other", 20)], start=1):
        prefill_patterned(cache, name, uid, tokens, LAYERS, WIDTH)
    with pytest.raises(hisparse.InvalidInputError, match=r"\['full'\] have fewer tokens left"):
        cache.begin_decode_step(["full", "other"], num_tokens=2, appends=[1, 0])
    assert cache.seq_len("full") == 32 and cache.seq_len("other") == 20
    step = cache.begin_decode_step(["full", "other"], num_tokens=2, appends=[0, 2])
    for layer in range(LAYERS):
        step.write_newest(layer, torch.zeros(2, 2, WIDTH, dtype=torch.uint8,
                                                device=cache.device))
    top_k = torch.tensor([[[31, 5, -1, -1]] * 2, [[21, 20, 3, -1]] * 2], dtype=torch.int32)
    rows = step.swap_in(0, top_k)
    assert torch.equal(cache.device_kv(0)[rows[0, 1, :2].long()],
                       row_pattern(1, 0, torch.tensor([31, 5]), WIDTH))
    step.end([0, 1])
    assert cache.seq_len("full") == 32 and cache.seq_len("other") == 21
    check_table_invariants(cache)
    cache.close()
