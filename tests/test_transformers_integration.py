"""transformers' DeepSeek-V3.2 and GLM-5 model code decoding through `HiSparseDSACache`.

Tiny random models of both families (GLM with GLM-5.2's indexer pattern scaled down: indexers
at layers 0, 1, 2 and 6 of 8), a batch of three left-padded prompts, and a hot buffer far below
the context, so that swaps evict: greedy generation must give transformers' own cache's tokens
(eager attention, the reference) with logits within float tolerance, and at least 30% of the
lookups must miss. A control that reads another layer's rows must not pass, and a forward pass
that raises must leave the cache as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install 'hisparse[transformers]'")

from hisparse.errors import InvalidInputError  # noqa: E402
from hisparse.integrations.transformers import (  # noqa: E402
    HiSparseDSACache,
    dense_cache_bytes,
)

NEW_TOKENS = 32
PROMPTS = (40, 25, 33)
SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
    num_experts_per_tok=2, n_group=1, topk_group=1, index_topk=16, index_head_dim=32,
    index_n_heads=2,
    max_position_embeddings=512, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1,
    eos_token_id=None)
CACHE = dict(hot_slots=16, max_requests=4, max_seq_len=128, host_pool_tokens=1024,
             extent_tokens=16)


def glm() -> torch.nn.Module:
    config = transformers.GlmMoeDsaConfig(num_hidden_layers=8, index_topk_freq=4,
                                          index_skip_topk_offset=3, **SHAPE)
    assert [i for i, t in enumerate(config.indexer_types) if t == "full"] == [0, 1, 2, 6]
    return transformers.GlmMoeDsaForCausalLM(config).eval()


def deepseek() -> torch.nn.Module:
    config = transformers.DeepseekV32Config(num_hidden_layers=3, **SHAPE)
    return transformers.DeepseekV32ForCausalLM(config).eval()


def prompts(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    length = max(PROMPTS)
    ids = torch.randint(2, SHAPE["vocab_size"], (len(PROMPTS), length), generator=generator)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(PROMPTS):  # left padding
        mask[row, length - tokens :] = 1
        ids[row, : length - tokens] = SHAPE["pad_token_id"]
    return ids, mask


def generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
             cache: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             do_sample=False, past_key_values=cache, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """Tiny matrices: torch's thread pool only contends with the other tests' processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[glm, deepseek], ids=["glm-5.2-pattern", "deepseek-v3.2"])
def model(request: pytest.FixtureRequest, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    built = request.param()
    built.set_attn_implementation("eager")
    return built


@contextlib.contextmanager
def indexer_top_k(log: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Records each indexer top-k the model code takes (`scores.topk(index_topk)`: scores
    `[B, S, keys]`, the chosen key indices)."""
    original = torch.Tensor.topk

    def topk(self: torch.Tensor, k: int, *args: Any, **kwargs: Any) -> Any:
        out = original(self, k, *args, **kwargs)
        if k == SHAPE["index_topk"]:
            log.append((self.detach().clone(), out.indices.clone()))
        return out

    torch.Tensor.topk = topk  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]


def first_near_tie(want: list[tuple[torch.Tensor, torch.Tensor]],
                   got: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Per batch row, the first decode step at which the two runs' indexers chose different
    keys (NEW_TOKENS: none). Each such choice must be a near tie: the runs' scores agree to
    float rounding (the attention before sums in another order: 16 gathered rows against all
    keys masked), and so do the k-th and (k+1)-th best, so that rounding alone can swap
    them. Anything else is a wrong row upstream."""
    first = [NEW_TOKENS] * len(PROMPTS)
    assert len(want) == len(got)
    for (want_scores, want_keys), (scores, keys) in zip(want, got, strict=True):
        torch.testing.assert_close(scores, want_scores, rtol=1e-5, atol=1e-6)
        differ = (want_keys.sort(-1).values != keys.sort(-1).values).any(-1)
        for b, s in differ.nonzero().tolist():
            best = want_scores[b, s].sort(descending=True).values
            k = want_keys.shape[-1]
            assert best[k - 1] - best[k] <= 1e-6, (b, s, best[k - 1].item(), best[k].item())
            step = want_scores.shape[-1] - max(PROMPTS)  # the keys before this pass's query
            first[b] = min(first[b], step)
    return first


def test_greedy_tokens_match_transformers_own_cache(model: torch.nn.Module, seed: int) -> None:
    """Token for token and logit for logit, up to the first step (if any) where rounding
    tipped an indexer's near tie the other way in one run (checked to be that)."""
    ids, mask = prompts(seed)
    dense = transformers.DynamicCache(config=model.config)
    want_choices: list[tuple[torch.Tensor, torch.Tensor]] = []
    choices: list[tuple[torch.Tensor, torch.Tensor]] = []
    with indexer_top_k(want_choices):
        want_tokens, want_logits = generate(model, ids, mask, dense)
    with HiSparseDSACache(model, **CACHE) as cache, indexer_top_k(choices):
        tokens, logits = generate(model, ids, mask, cache)
        stats = cache.engine.stats()
        assert stats.misses >= 0.3 * (stats.hits + stats.misses), (stats.hits, stats.misses)
        assert 0 < cache.device_bytes() < dense_cache_bytes(dense)
    for b, step in enumerate(first_near_tie(want_choices, choices)):
        assert torch.equal(tokens[b, : ids.shape[1] + step], want_tokens[b, : ids.shape[1] + step])
        torch.testing.assert_close(logits[:step, b], want_logits[:step, b], rtol=1e-4, atol=1e-4)
    assert model.config._attn_implementation == "eager"  # given back by close()


def test_reading_another_layers_rows_does_not_pass(model: torch.nn.Module, seed: int) -> None:
    """The control: glue that reads layer l+1's rows for layer l's top-k (a wrong-layer bug)
    changes the logits beyond the tolerance the test above holds the real glue to."""
    ids, mask = prompts(seed)
    _, want_logits = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    layers = model.config.num_hidden_layers
    with HiSparseDSACache(model, **CACHE) as cache:
        read = cache.read_rows
        cache.read_rows = lambda layer, rows: read((layer + 1) % layers, rows)  # type: ignore
        _, logits = generate(model, ids, mask, cache)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)


def test_a_forward_pass_that_raises_changes_nothing(seed: int) -> None:
    """A decode pass that fails in its last layer cancels its step and rolls the lengths
    back: the generation then goes on with the tokens of a run that never failed."""
    torch.manual_seed(seed)
    model = glm()
    model.set_attn_implementation("eager")
    ids, mask = prompts(seed)
    want, _ = generate(model, ids, mask, transformers.DynamicCache(config=model.config))
    last = model.model.layers[-1].mlp
    calls = {"n": 0}

    def fail_once(module: torch.nn.Module, args: object) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # the second decode pass
            raise RuntimeError("injected")

    with HiSparseDSACache(model, **CACHE) as cache:
        handle = last.register_forward_pre_hook(fail_once)
        with pytest.raises(RuntimeError, match="injected"):
            generate(model, ids, mask, cache)
        handle.remove()
        lengths = [layer.get_seq_length() for layer in cache.layers]
        assert cache.engine._step is None  # cancelled
        # The two passes that completed (prefill, first decode) are what the cache holds.
        assert lengths == [ids.shape[1] + 1] * len(cache.layers)
        requests = cache.engine.stats().occupancy.requests_by_state
        assert requests.get("running") == len(PROMPTS)
    with HiSparseDSACache(model, **CACHE) as cache:  # and a fresh cache decodes as before
        tokens, _ = generate(model, ids, mask, cache)
    assert torch.equal(tokens, want)


def test_a_config_of_another_shape_is_refused() -> None:
    torch.manual_seed(0)
    model = deepseek()
    with pytest.raises(Exception, match="row_bytes: got 64, the model's latent row is 192"):
        HiSparseDSACache(model, row_bytes=64, **CACHE)
    with pytest.raises(InvalidInputError, match="supports deepseek_v32, glm_moe_dsa"):
        HiSparseDSACache(torch.nn.Linear(2, 2))


def test_beam_search_and_cache_edits_are_refused_naming_the_cache() -> None:
    torch.manual_seed(0)
    with HiSparseDSACache(deepseek(), **CACHE) as cache:
        for edit, args in (("crop", (1,)), ("reorder_cache", (torch.tensor([0]),)),
                           ("batch_repeat_interleave", (2,)),
                           ("batch_select_indices", (torch.tensor([0]),))):
            with pytest.raises(InvalidInputError, match=f"HiSparseDSACache does not support "
                                                        f"{edit}"):
                getattr(cache, edit)(*args)
        assert cache.hit_rate() == 0.0  # nothing looked up yet


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_benchmark_runs_tiny_and_matches_the_dense_cache(tmp_path: object,
                                                             dtype: str) -> None:
    """benchmarks/transformers_decode.py --tiny: a context loaded with `load_context` decodes
    the dense cache's tokens (the GPU run's check, at a CPU shape). In bfloat16 both caches
    are also fed a float32 run's tokens: on the CPU they compute alike, so they are as far
    from it as each other."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    output = Path(str(tmp_path)) / "tiny.json"
    env = {"PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "transformers_decode.py"), "--tiny",
         "--new-tokens", "4", "--dtype", dtype, "--output", str(output)],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(output.read_text())
    assert document["versions"]["transformers"] == transformers.__version__
    for family in ("glm-5.2", "deepseek-v3.2"):
        [run] = document["families"][family]["runs"]
        assert run["tokens_identical"], run
        assert run["hisparse"]["device_bytes"] < run["dense"]["device_bytes"]
        if dtype == "bfloat16":
            against = run["against_float32"]
            assert against["hisparse"] == against["dense"], against
            assert 0 < against["hisparse"]["max_logit_error"] < 1.0, against
        else:
            assert "against_float32" not in run


@pytest.mark.parametrize("chunk", [7, 64, 4096])
def test_the_benchmarks_dense_cache_built_in_chunks_holds_the_whole_expansion(
        chunk: int, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/transformers_decode.py's `dense_cache` expands the context a chunk of
    tokens at a time (so that a float32 batch of 8 fits a GPU): every layer's keys and values
    must equal one `expand_kv` over all tokens, up to rounding (a matrix product over 7 rows
    may sum in another order than over 50), and each chunk's the expansion of its tokens
    bit for bit."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import transformers_decode

    torch.manual_seed(seed)
    model = transformers_decode.build("glm-5.2", layers=2, tiny=True, device=torch.device("cpu"))
    rows, keys = transformers_decode.context(model, batch=2, tokens=50, seed=seed)
    cache = transformers_decode.dense_cache(model, rows, keys, chunk=chunk)
    c = model.config
    for layer, decoder in enumerate(model.model.layers):
        latent, rope = rows[layer].split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        key, value = decoder.self_attn.expand_kv(latent[:, None], rope[:, None])
        torch.testing.assert_close(cache.layers[layer].keys, key)
        torch.testing.assert_close(cache.layers[layer].values, value)
        for start in range(0, 50, chunk):
            span = slice(start, start + chunk)
            key, value = decoder.self_attn.expand_kv(latent[:, None, span], rope[:, None, span])
            assert torch.equal(cache.layers[layer].keys[:, :, span], key)
            assert torch.equal(cache.layers[layer].values[:, :, span], value)
    assert cache.get_seq_length() == 50
