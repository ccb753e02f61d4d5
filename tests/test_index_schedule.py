"""Index groups from a model's own indexer schedule (`IndexSchedule`, config `index_anchors`).

The mapping is checked against a brute-force reading of the schedule (a layer uses the latest
anchor at or before it), and a cache built with irregular schedules returns, on every layer,
the rows of the positions that layer's anchor chose: followers passing nothing, the anchor's
tensor, or a new tensor of equal contents (what real glue makes per layer); a follower handed
other contents raises and changes nothing.
"""

from __future__ import annotations

import random

import pytest
import torch

import hisparse
from hisparse.config import HiSparseConfig
from hisparse.errors import ConfigError, InvalidInputError
from hisparse.layout.index_schedule import IndexSchedule
from hisparse.tools.planning import ModelShape
from test_reliability_state import assert_same_state, full_snapshot

WIDTH, TOP_K, HOT, EXTENT = 16, 6, 12, 4


def random_anchors(rng: random.Random, layers: int) -> list[int]:
    return [0, *sorted(rng.sample(range(1, layers), rng.randint(0, layers - 1)))]


def latest_anchor(anchors: list[int], layer: int) -> int:
    return max(a for a in anchors if a <= layer)


def test_every_layer_maps_to_the_latest_anchor_at_or_before_it(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        layers = rng.randint(1, 40)
        anchors = random_anchors(rng, layers)
        schedule = IndexSchedule(layers, tuple(anchors))
        assert schedule.num_groups == len(anchors)
        for layer in range(layers):
            group = schedule.group_of(layer)
            assert schedule.anchors[group] == schedule.anchor_of(layer) == latest_anchor(
                anchors, layer)
            assert layer in schedule.layers_of(group)
        covered = [layer for g in range(schedule.num_groups) for layer in schedule.layers_of(g)]
        assert covered == list(range(layers))
        types = ["full" if layer in anchors else "shared" for layer in range(layers)]
        assert IndexSchedule.from_indexer_types(types) == schedule
        size = rng.randint(1, layers)
        uniform = IndexSchedule.uniform(layers, size)
        assert [uniform.group_of(layer) for layer in range(layers)] == [
            layer // size for layer in range(layers)]
        assert uniform.uniform_size == (size if layers > size else layers)


@pytest.mark.parametrize(("anchors", "named"), [
    ([1, 3], "must start at layer 0"),
    ([0, 3, 3], "each anchor layer once"),
    ([0, 4, 2], "in increasing order"),
    ([0, 8], "layer 8 is not a layer of the model"),
    ("0,2", "expected a list of layer numbers"),
])
def test_a_bad_schedule_names_the_problem(anchors: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        HiSparseConfig.from_preset("tiny", num_layers=8, index_anchors=anchors)
    with pytest.raises(ValueError, match="valid choices: full, shared"):
        IndexSchedule.from_indexer_types(["full", "dense"])


def test_the_schedule_keys_derive_each_other_and_an_override_replaces_them() -> None:
    irregular = HiSparseConfig.from_preset("tiny", num_layers=8, index_anchors=[0, 1, 5])
    assert irregular.index_group_size is None and irregular.num_index_groups == 3
    assert HiSparseConfig.from_dict(irregular.to_dict()) == irregular
    uniform = irregular.replace(index_group_size=3)  # replaces the listed anchors
    assert uniform.index_anchors == (0, 3, 6)
    assert uniform.replace(num_layers=4).index_anchors == (0, 3)  # derived again
    assert irregular.with_num_layers(3).index_anchors == (0, 1)
    with pytest.raises(ConfigError, match="are not groups of that size; set only one"):
        HiSparseConfig.from_preset("tiny", num_layers=8, index_group_size=2,
                                   index_anchors=[0, 1, 5])
    glm = HiSparseConfig.from_preset("glm-5.2", index_group_size=4)
    assert glm.index_anchors == tuple(range(0, 78, 4))


def test_the_plan_counts_one_indexer_per_anchor(seed: int) -> None:
    rng = random.Random(seed)
    layers = rng.randint(2, 80)
    anchors = random_anchors(rng, layers)
    config = HiSparseConfig.from_preset("tiny", num_layers=layers, index_anchors=anchors)
    shape = ModelShape("m", layers, 656, 132, config.index_group_size, config.index_anchors)
    assert shape.num_groups == config.num_index_groups == len(anchors)


class Model:
    """Requests' KV and each anchor's top-k kept outside the cache."""

    def __init__(self, cache: hisparse.HiSparseCache, rng: torch.Generator,
                 prompts: dict[str, int]) -> None:
        self.cache, self.rng, self.layers = cache, rng, cache.num_layers
        self.kv: dict[str, torch.Tensor] = {}
        for name, tokens in prompts.items():
            self.kv[name] = self.noise(self.layers, tokens)
            cache.admit(name, tokens)
            cache.write_prefill(name, self.kv[name])
            cache.commit_prefill(name)

    def noise(self, *shape: int) -> torch.Tensor:
        return torch.randint(0, 256, (*shape, WIDTH), dtype=torch.uint8, generator=self.rng)

    def newest(self, step: object) -> torch.Tensor:
        new = self.noise(self.layers, step.batch_size)
        for b, name in enumerate(step.request_ids):
            self.kv[name] = torch.cat([self.kv[name], new[:, b : b + 1]], dim=1)
        return new

    def top_k(self, step: object) -> torch.Tensor:
        top_k = torch.full((step.batch_size, TOP_K), -1, dtype=torch.int32)
        for b, position in enumerate(step.positions):
            chosen = torch.randperm(position + 1, generator=self.rng)[:TOP_K]
            top_k[b, : chosen.numel()] = chosen.to(torch.int32)
        return top_k

    def check(self, step: object, layer: int, top_k: torch.Tensor, rows: torch.Tensor) -> None:
        kv = self.cache.device_kv(layer)
        for b, name in enumerate(step.request_ids):
            for k in range(TOP_K):
                position = int(top_k[b, k])
                if position < 0:
                    assert rows[b, k] == -1
                else:
                    assert torch.equal(kv[rows[b, k]], self.kv[name][layer, position]), (
                        layer, b, k)


@pytest.mark.parametrize("validate", [False, True])
def test_followers_of_an_irregular_schedule_read_their_anchors_positions(
        seed: int, validate: bool) -> None:
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    layers = rng.randint(3, 9)
    anchors = random_anchors(rng, layers)
    config = HiSparseConfig.from_preset(
        "tiny", num_layers=layers, index_anchors=anchors, row_bytes=WIDTH, top_k=TOP_K,
        hot_slots=HOT, extent_tokens=EXTENT, max_requests=4, max_seq_len=64,
        host_pool_tokens=64 * EXTENT, validate=validate)
    cache = hisparse.HiSparseCache(config, device="cpu")
    prompts = {"a": 30, "b": 17, "c": 5}
    model = Model(cache, generator, prompts)
    for _ in range(6):
        step = cache.begin_decode_step(list(prompts))
        new = model.newest(step)
        chosen: torch.Tensor | None = None
        for layer in range(layers):
            step.write_newest(layer, new[layer])
            if layer in anchors:
                chosen = model.top_k(step)
                rows = step.swap_in(layer, chosen)
            else:
                assert chosen is not None
                # What a framework may pass: nothing, the anchor's tensor, or its own copy.
                passed = rng.choice([None, chosen, chosen.clone()])
                rows = step.swap_in(layer, passed)
            model.check(step, layer, chosen, rows)
        step.end()
    stats = {s.layer: s for s in cache.stats().layers}
    for layer in range(layers):
        anchor = stats[latest_anchor(anchors, layer)]
        assert (stats[layer].hits, stats[layer].misses) == (anchor.hits, anchor.misses)
    cache.close()


@pytest.mark.parametrize("validate", [False, True])
def test_a_follower_handed_its_own_other_top_k_raises_and_changes_nothing(
        seed: int, validate: bool) -> None:
    """A framework whose model runs an indexer at layer 2 while the cache's schedule makes it
    a follower of layer 1: the model's own top-k for layer 2 is refused, naming the fix."""
    generator = torch.Generator().manual_seed(seed)
    config = HiSparseConfig.from_preset(
        "tiny", num_layers=4, index_anchors=[0, 1], row_bytes=WIDTH, top_k=TOP_K,
        hot_slots=HOT, extent_tokens=EXTENT, max_requests=4, max_seq_len=64,
        host_pool_tokens=64 * EXTENT, validate=validate)
    cache = hisparse.HiSparseCache(config, device="cpu")
    prompts = {"a": 30, "b": 17}
    model = Model(cache, generator, prompts)
    step = cache.begin_decode_step(list(prompts))
    new = model.newest(step)
    for layer in range(4):
        step.write_newest(layer, new[layer])
    step.swap_in(0, model.top_k(step))
    anchor_top_k = model.top_k(step)
    model.check(step, 1, anchor_top_k, step.swap_in(1, anchor_top_k))
    own = anchor_top_k.clone()
    own[0, 0] = -1 if own[0, 0] != -1 else 0  # one entry differs
    before = full_snapshot(cache)
    with pytest.raises(InvalidInputError, match=r"anchor layer 1 swapped in.*index_anchors"):
        step.swap_in(2, own)
    assert_same_state(before, full_snapshot(cache))
    model.check(step, 2, anchor_top_k, step.swap_in(2, anchor_top_k.clone()))
    model.check(step, 3, anchor_top_k, step.swap_in(3))
    step.end()
    cache.close()
