"""benchmarks/transformers_decode_v4.py at its tiny CPU shape: hisparse decodes the tokens of
transformers' own cache from the same synthetic 250-token context; the synthetic state has
the layout a real prefill leaves; and the comparison sees the CSA entries (control: entries
perturbed in one cache only change that request's logits)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install 'hisparse[transformers]'")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("needs transformers 5.17 or newer (DeepSeek-V4)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import transformers_decode_v4 as bench  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model's ops are too small to share (minutes, not
    seconds, on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(7)
    return bench.build(tiny=True, device=CPU, dtype=torch.float32)


def test_the_tiny_run_decodes_the_dense_caches_tokens(tmp_path: Path) -> None:
    output = tmp_path / "tiny.json"
    document = bench.main(["--tiny", "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(document))
    assert document["versions"]["transformers"] == transformers.__version__
    assert document["command"].endswith("--dtype float32")
    [run] = document["runs"]
    assert run["tokens_identical"] and run["token_match_fraction"] == 1.0, run
    assert run["first_step_max_logit_diff"] < 1e-4
    hs, dense = run["hisparse"], run["dense"]
    assert sum(hs["device_bytes_parts"].values()) == hs["device_bytes"]
    assert sum(dense["device_bytes_parts"].values()) == dense["device_bytes"]
    entries, batch = document["entries"], run["batch"]
    assert dense["device_bytes_parts"]["csa_entries"] >= 2 * batch * entries * 32 * 4
    assert hs["device_bytes_parts"]["csa_entries"] == 2 * 4  # one placeholder element a layer
    assert hs["entries_per_request"] == [(250 + 10) // 4] * batch
    assert 0.0 < hs["hit_rate"] < 1.0  # the 24 hot entries of 65 miss at times


@pytest.mark.parametrize("tokens", [250, 256, 3])
def test_the_synthetic_state_has_a_prefills_layout(model, tokens) -> None:
    """Every layer's attributes, tensor shapes and dtypes, counts and empty (None) slots
    match transformers' own cache after a real prefill of as many tokens."""
    real = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.randint(1, 64, (2, tokens)), past_key_values=real, use_cache=True)
    synthetic = bench.synthetic_cache(model, 2, tokens, seed=1, entries_device=CPU)
    assert [layout(layer) for layer in synthetic.layers] == [
        layout(layer) for layer in real.layers]


def layout(layer: object) -> dict[str, object]:
    def of(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype)
        if isinstance(value, dict):
            return {key: of(item) for key, item in value.items()}
        return value
    return {key: of(value) for key, value in vars(layer).items()}


def test_entries_perturbed_in_one_cache_change_that_requests_logits(model) -> None:
    args = argparse.Namespace(context=250, new_tokens=4, hot_slots=24, extent_tokens=8)
    context = functools.partial(bench.synthetic_cache, model, 2, 250, 3)

    def perturbed(device: torch.device) -> transformers.DynamicCache:
        cache = context(device)
        held = cache.layers[1].compressed_kv
        noise = torch.zeros_like(held["compressor"])
        noise[0] = torch.randn(noise[0].shape, generator=torch.Generator().manual_seed(5))
        held["compressor"] = held["compressor"] + noise  # request 0's entries, layer 1 only
        return cache

    first = torch.tensor([3, 9])
    hs = bench.run_hisparse(model, context, first, args)
    same = bench.run_dense(model, context, first, args)
    other = bench.run_dense(model, perturbed, first, args)
    assert bench.compared(hs, same)["first_step_max_logit_diff"] < 1e-4
    assert bench.compared(hs, other)["first_step_max_logit_diff"] > 1e-2
    step = (hs["logits"][:, 0] - other["logits"][:, 0]).abs().amax(-1)
    assert step[0] > 1e-2 and step[1] < 1e-4  # request 1 read unchanged entries


def test_a_dense_run_out_of_memory_is_a_result(model, monkeypatch) -> None:
    """What --oom-batch records where transformers' cache does not fit: hisparse's decode,
    the dense run's error, and no comparison."""
    def no_room(*args: object) -> dict[str, object]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 52.00 GiB\nmore")
    monkeypatch.setattr(bench, "run_dense", no_room)
    args = argparse.Namespace(context=250, new_tokens=4, hot_slots=24, extent_tokens=8, seed=0)
    entry = bench.batch_run(model, 3, args)
    assert entry["dense"] == {"out_of_memory": True,
                              "error": "CUDA out of memory. Tried to allocate 52.00 GiB"}
    assert entry["hisparse"]["out_of_memory"] is False
    assert entry["hisparse"]["entries_per_request"] == [(250 + 4) // 4] * 3
    assert "tokens_identical" not in entry
