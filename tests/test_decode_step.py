"""The decode step as an object, and the top-k rule of an index group's followers.

`begin_decode_step` returns a `DecodeStep` whose own verbs (`write_newest`, `swap_in`, `end`,
`cancel`) drive the step, mixed freely with the cache's; once over it refuses them all. A
follower layer of an index group may call `swap_in(layer)` without a top-k and gets its
anchor's rows; handed a tensor that does not hold its anchor's top-k it raises, with
`validate` off too.
Every returned row is checked against the KV kept outside the cache, written with fresh
random bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import hisparse
from fakes.deferred_streams import DeferredStreamCpu
from hisparse.core.step import DecodeStep
from hisparse.errors import InvalidInputError, RequestStateError
from test_reliability_state import assert_same_state, full_snapshot

LAYERS, WIDTH, TOP_K, HOT, EXTENT = 4, 32, 4, 8, 4
PROMPTS = {"long": 20, "mid": 11, "short": 3}  # long and mid are past H, short is not


def build(backend: Any, group: int, validate: bool = False) -> hisparse.HiSparseCache:
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=LAYERS, row_bytes=WIDTH, top_k=TOP_K, hot_slots=HOT,
        index_group_size=group, extent_tokens=EXTENT, max_requests=4, max_batch=3,
        host_pool_tokens=64 * EXTENT, max_seq_len=64, validate=validate,
        shared_index_prefetch=True,
    )
    return hisparse.HiSparseCache(config, device=backend)


class Reference:
    """Running requests of a cache and every row written so far, kept outside the cache."""

    def __init__(self, cache: hisparse.HiSparseCache, rng: torch.Generator,
                 prompts: dict[str, int] = PROMPTS) -> None:
        self.cache, self.rng = cache, rng
        self.kv: dict[str, torch.Tensor] = {}  # request -> [L, T, W]
        for name, tokens in prompts.items():
            self.kv[name] = self._noise(LAYERS, tokens)
            cache.admit(name, tokens)
            cache.write_prefill(name, self.kv[name].to(cache.device))
            cache.commit_prefill(name)

    def _noise(self, *shape: int) -> torch.Tensor:
        return torch.randint(0, 256, (*shape, WIDTH), dtype=torch.uint8, generator=self.rng)

    def newest(self, step: DecodeStep) -> torch.Tensor:
        """`[L, B, W]` rows of the step's new tokens, recorded as the reference's."""
        new = self._noise(LAYERS, step.batch_size)
        for b, name in enumerate(step.request_ids):
            self.kv[name] = torch.cat([self.kv[name], new[:, b : b + 1]], dim=1)
        return new.to(self.cache.device)

    def top_k(self, step: DecodeStep, rows: int | None = None) -> torch.Tensor:
        """Distinct random positions of each request (its new token included), -1 padded."""
        top_k = torch.full((rows or step.batch_size, TOP_K), -1, dtype=torch.int32)
        for b, position in enumerate(step.positions):
            chosen = torch.randperm(position + 1, generator=self.rng)[:TOP_K]
            top_k[b, : chosen.numel()] = chosen.to(torch.int32)
        return top_k.to(self.cache.device)

    def check(self, step: DecodeStep, layer: int, top_k: torch.Tensor,
              rows: torch.Tensor) -> None:
        hot, top_k, rows = self.cache.device_kv(layer).cpu(), top_k.cpu(), rows.cpu()
        assert rows.shape == top_k.shape
        for b in range(top_k.shape[0]):
            for k in range(TOP_K):
                position = int(top_k[b, k])
                if b >= step.batch_size or position < 0:
                    assert rows[b, k] == -1, (layer, b, k)
                    continue
                want = self.kv[step.request_ids[b]][layer, position]
                assert torch.equal(hot[rows[b, k]], want), (layer, b, k)


def backends() -> list[Any]:
    """The plain CPU backend (followers replay inline) and one whose follower replays run
    on a side stream as late as the engine's barriers allow."""
    return [pytest.param("cpu", id="inline"),
            pytest.param(DeferredStreamCpu, id="side-stream")]


def _backend(kind: Any) -> Any:
    return kind() if isinstance(kind, type) else kind


@pytest.mark.parametrize("kind", backends())
@pytest.mark.parametrize("group", [1, 3])
def test_the_step_object_drives_whole_decode_steps(kind: Any, group: int,
                                                   rng: torch.Generator) -> None:
    """Steps driven by the step's own verbs, by the cache's, and by both mixed, return the
    true rows on every layer; followers pass nothing, the anchor's tensor, or a new view of
    it (the same memory and geometry is the anchor's top-k)."""
    cache = build(_backend(kind), group)
    reference = Reference(cache, rng)
    names = list(PROMPTS)
    for index in range(6):
        step = cache.begin_decode_step(names)
        assert isinstance(step, DecodeStep) and step.request_ids == tuple(names)
        # A tuple of ints, quiet steps' too (they keep the moved-on array until it is read).
        assert step.positions == tuple(cache.seq_len(n) - 1 for n in names)
        assert all(type(p) is int for p in step.positions)
        via_cache = index % 3 == 1  # every layer through the cache; index % 3 == 2: mixed
        new = reference.newest(step)
        top_k = None
        for layer in range(LAYERS):
            verbs = cache if via_cache or (index % 3 == 2 and layer % 2) else step
            verbs.write_newest(layer, new[layer])
            if layer % group == 0:
                top_k = reference.top_k(step)
                rows = verbs.swap_in(layer, top_k)
            else:
                assert top_k is not None
                passed = (None, top_k, top_k.view(top_k.shape))[(layer + index) % 3]
                rows = verbs.swap_in(layer, passed)
            reference.check(step, layer, top_k, rows)
        (cache.end_decode_step if via_cache else step.end)()
        assert not step.is_open
        with pytest.raises(RequestStateError, match="needs an open decode step"):
            cache.end_decode_step()
    cache.backend.synchronize()
    for name in names:  # every backup landed in the right host rows
        host_rows = torch.from_numpy(cache.host_rows(name))
        for layer in range(LAYERS):
            assert torch.equal(cache.host_tensors()[layer][host_rows], reference.kv[name][layer])
    cache.close()


VERBS = {
    "write_newest": lambda step, c: step.write_newest(0, torch.zeros(2, WIDTH, dtype=torch.uint8)),
    "swap_in": lambda step, c: step.swap_in(0, torch.zeros(2, TOP_K, dtype=torch.int32)),
    "swap_in a follower": lambda step, c: step.swap_in(1),
    "end": lambda step, c: step.end(),
    "cancel": lambda step, c: step.cancel(),
}


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("how", ["ended", "cancelled"])
def test_a_step_that_is_over_refuses_every_verb(how: str, verb: str,
                                                rng: torch.Generator) -> None:
    """Nothing an old step object is asked to do may reach the cache: neither right after it
    ended or was cancelled, nor once the next step has taken over its buffers."""
    cache = build("cpu", group=2)
    reference = Reference(cache, rng, {"long": 20, "short": 3})
    names = ["long", "short"]
    old = cache.begin_decode_step(names)
    new = reference.newest(old)
    for layer in range(LAYERS):
        old.write_newest(layer, new[layer])
    top_k = reference.top_k(old)
    old.swap_in(0, top_k)
    if how == "ended":
        old.end()
    else:
        old.cancel()
        for name in names:  # the cancelled token is not the reference's either
            reference.kv[name] = reference.kv[name][:, :-1]
    for open_next in (False, True):
        if open_next:
            step = cache.begin_decode_step(names)
        before = full_snapshot(cache)
        with pytest.raises(RequestStateError, match=f"this decode step was {how} already"):
            VERBS[verb](old, cache)
        assert_same_state(before, full_snapshot(cache))
    new = reference.newest(step)
    top_k = reference.top_k(step)
    for layer in range(LAYERS):
        step.write_newest(layer, new[layer])
        reference.check(step, layer, top_k, step.swap_in(layer, top_k if layer % 2 == 0 else None))
    step.end()
    cache.close()


def test_a_step_open_when_its_cache_closes_refuses_every_verb(rng: torch.Generator) -> None:
    cache = build("cpu", group=2)
    Reference(cache, rng, {"long": 20})
    step = cache.begin_decode_step(["long"])
    cache.close()
    for verb in VERBS.values():
        with pytest.raises(RequestStateError, match="closed"):
            verb(step, cache)


def _anchored_step(cache: hisparse.HiSparseCache, reference: Reference, names: list[str],
                   rows: int | None = None) -> tuple[DecodeStep, torch.Tensor]:
    """A step whose every layer got its new row and whose layer 0 swapped in `rows` rows."""
    step = cache.begin_decode_step(names)
    new = reference.newest(step)
    for layer in range(LAYERS):
        step.write_newest(layer, new[layer])
    top_k = reference.top_k(step, rows)
    reference.check(step, 0, top_k, step.swap_in(0, top_k))
    return step, top_k


# Tensors that do not hold the anchor's top-k (a copy of it is accepted: test_index_schedule).
NOT_THE_ANCHORS = {
    "other positions": lambda top_k: torch.where(top_k > 0, top_k - 1, top_k),
    "the same memory, fewer rows": lambda top_k: top_k[:2],  # of 3: one padding row
}


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("kind", backends())
@pytest.mark.parametrize("other", NOT_THE_ANCHORS)
def test_a_follower_handed_another_top_k_raises_and_changes_nothing(
        other: str, kind: Any, validate: bool, rng: torch.Generator) -> None:
    """The misuse README's old snippet made on `tiny` (a top-k per layer): a follower would
    silently return its anchor's rows for positions it never asked for. It is refused (by
    shape, or by contents: with `validate` off too), naming the anchor and the fix; the
    follower then gets the true rows with its anchor's tensor or none."""
    cache = build(_backend(kind), group=2, validate=validate)
    names = ["long", "short"]
    reference = Reference(cache, rng)
    padded = 3 if other == "the same memory, fewer rows" else None
    step, top_k = _anchored_step(cache, reference, names, padded)
    wrong = NOT_THE_ANCHORS[other](top_k)
    assert wrong.is_contiguous() and wrong.dtype == torch.int32
    before = full_snapshot(cache)
    for verbs in (step, cache):
        with pytest.raises(InvalidInputError, match=r"anchor layer 0.*swap_in\(1\) without"):
            verbs.swap_in(1, wrong)
    assert_same_state(before, full_snapshot(cache))
    reference.check(step, 1, top_k, step.swap_in(1, top_k))
    # Layers 2 and 3 are the next group: its anchor may take the same tensor as layer 0's.
    reference.check(step, 2, top_k, step.swap_in(2, top_k))
    with pytest.raises(InvalidInputError, match=r"anchor layer 2.*swap_in\(3\) without"):
        step.swap_in(3, wrong)
    reference.check(step, 3, top_k, step.swap_in(3))
    step.end()
    cache.close()


@pytest.mark.parametrize("group", [1, 2])
def test_an_anchor_without_a_top_k_raises_and_changes_nothing(group: int,
                                                              rng: torch.Generator) -> None:
    cache = build("cpu", group=group)
    reference = Reference(cache, rng)
    step, _ = _anchored_step(cache, reference, list(PROMPTS))
    before = full_snapshot(cache)
    with pytest.raises(InvalidInputError, match=r"swap_in\(2\) needs its top_k"):
        step.swap_in(2)
    with pytest.raises(InvalidInputError, match=r"swap_in\(2\) needs its top_k"):
        cache.swap_in(2)
    assert_same_state(before, full_snapshot(cache))
    step.cancel()
    cache.close()


def test_a_follower_whose_anchor_has_not_swapped_in_this_step_raises(
        rng: torch.Generator) -> None:
    """Not even without a top-k: the anchor's rows from the last step are stale."""
    cache = build("cpu", group=2)
    reference = Reference(cache, rng)
    step, _ = _anchored_step(cache, reference, list(PROMPTS))
    step.end()
    step = cache.begin_decode_step(list(PROMPTS))
    before = full_snapshot(cache)
    with pytest.raises(RequestStateError, match=r"anchor layer 0, which has not swapped in"):
        step.swap_in(1)
    assert_same_state(before, full_snapshot(cache))
    step.cancel()
    cache.close()
