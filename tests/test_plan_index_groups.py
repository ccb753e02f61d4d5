"""`hisparse plan` numbers against independent hand counts: indexer keys under index sharing.

Layers that share one indexer top-k (GLM-5.2/5.3 IndexShare, IndexCache) have no indexer of
their own, so they hold no indexer keys: the "shared" layers are built with `indexer = None`
(transformers' GlmMoeDsaAttention; vLLM builds the indexer only where `skip_topk` is false).
A request holds one indexer key per token per index group, not per layer.
"""

from __future__ import annotations

import json
import random

import pytest

from hisparse.cli.main import main
from hisparse.tools import planning
from hisparse.tools.planning import GIB, ModelShape, PlanSettings


def test_indexer_keys_are_held_once_per_index_group(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        layers, row, indexer = rng.randint(1, 100), rng.randint(1, 2048), rng.randint(1, 256)
        group, top_k = rng.randint(1, 8), rng.randint(1, 4096)
        hot = top_k + rng.randint(0, 4096)
        extent, context = rng.randint(1, 1024), rng.randint(1, 10**6)
        settings = PlanSettings(
            gpu_mem_bytes=rng.randint(10, 200) * GIB, weights_bytes=rng.randint(0, 9) * GIB,
            reserve_bytes=0, top_k=top_k, hot_slots=hot, extent_tokens=extent,
            miss_rate=rng.random(), link_bytes_per_s=rng.uniform(1e9, 1e11),
        )
        [p] = planning.plan(ModelShape("m", layers, row, indexer, group), settings, [context])
        indexers = -(-layers // group)  # the anchor layer of each group runs the indexer
        assert p.hisparse_footprint.indexer_keys == context * indexers * indexer
        baseline = context * (layers * row + indexers * indexer)
        assert p.baseline_request_bytes == baseline
        assert p.baseline_max_requests == settings.available_bytes // baseline


def test_glm5_preset_at_128k_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "glm-5.2", "--context", "131072", "--json"]) == 0
    [p] = json.loads(capsys.readouterr().out)["contexts"]
    # GLM-5.2: 78 layers, indexers at layers 0, 1, 2, 6, ..., 74: 21 indexers x 132 B per token.
    indexer_keys = 131072 * 21 * 132  # 363,331,584 B
    hot_rows = 4097 * 78 * 656  # 209,635,296 B
    # The resident map twice over: host rows, and as many alias key rows (shared prefixes).
    tables = (21 * (2 * 4096 + 1) * 4 + (131072 // 512 + 1) * 4
              + 2 * 21 * 131072 * 2)  # 11,699,288 B
    assert p["hisparse_footprint"]["indexer_keys"] == indexer_keys
    assert p["hisparse_request_bytes"] == indexer_keys + hot_rows + tables == 584_666_168
    assert p["hisparse_max_requests"] == 50 * GIB // 584_666_168 == 91
    assert p["baseline_request_bytes"] == 131072 * (78 * 656 + 21 * 132) == 7_070_023_680
    assert p["baseline_max_requests"] == 7
