"""HiSparseConfig: presets, derivation, validation that reports every problem at once."""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import hisparse
from hisparse import config as config_module
from hisparse.config import HiSparseConfig, preset_dirs, preset_paths
from hisparse.errors import ConfigError, InvalidInputError

REPO = Path(__file__).resolve().parents[1]
SHIPPED = {"default", "deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4-pro", "glm-5", "glm-5.1",
           "glm-5.2", "glm-5.3", "tiny"}


def test_every_shipped_yaml_loads() -> None:
    found = sorted((REPO / "configs").rglob("*.yaml"))
    assert {p.stem for p in found} == SHIPPED  # a new preset must be added here on purpose
    for path in found:
        config = HiSparseConfig.from_yaml(path)
        assert config.model == path.stem
        first = path.read_text().splitlines()[0]
        assert first.startswith("# Used by:"), f"{path.name} should open with the command using it"
    assert set(preset_paths()) == SHIPPED


def test_default_yaml_lists_exactly_the_defaults() -> None:
    listed = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    assert set(listed) == set(HiSparseConfig.field_names())
    assert HiSparseConfig.from_preset("default") == HiSparseConfig()


def test_model_presets() -> None:
    deepseek = HiSparseConfig.from_preset("deepseek-v3.2")
    assert (deepseek.num_layers, deepseek.row_bytes, deepseek.top_k) == (61, 656, 2048)
    assert deepseek.num_index_groups == 61 and deepseek.hot_slots == 4096
    assert HiSparseConfig.from_preset("deepseek-v3.2", kv_dtype="bf16").row_bytes == 1152
    for version in ("glm-5", "glm-5.1"):  # an indexer in every layer
        glm = HiSparseConfig.from_preset(version)
        assert (glm.num_layers, glm.row_bytes, glm.top_k, glm.num_index_groups) == (
            78, 656, 2048, 78)
    # GLM-5.2/5.3: the schedule transformers' GlmMoeDsaConfig derives from index_topk_freq 4
    # and index_skip_topk_offset 3, written out here independently of the preset file.
    indexer_types = ["full" if max(i - 2, 0) % 4 == 0 else "shared" for i in range(78)]
    for version in ("glm-5.2", "glm-5.3"):
        glm = HiSparseConfig.from_preset(version)
        assert glm.index_group_size is None  # groups of 1, 1, then 4s: no uniform size
        assert glm.num_index_groups == indexer_types.count("full") == 21
        latest_full = 0
        for layer, kind in enumerate(indexer_types):
            latest_full = layer if kind == "full" else latest_full
            assert glm.anchor_layer(glm.group_of_layer(layer)) == latest_full, layer
    tiny = HiSparseConfig.from_preset("tiny")
    assert tiny.host_pool_bytes < 4 << 20  # small enough for CI and the interpreter


def test_overrides_and_derived_fields() -> None:
    tiny = HiSparseConfig.from_preset("tiny", max_requests=4, top_k=32)
    assert tiny.max_requests == 4 and tiny.batch_capacity == 4  # max_batch follows
    assert tiny.hot_slots == 128  # set in the preset, so not derived from top_k
    derived = HiSparseConfig(top_k=100)
    assert derived.hot_slots == 200
    assert derived.replace(top_k=300).hot_slots == 600  # derived again
    assert derived.replace(hot_slots=250).hot_slots == 250
    assert derived.replace(kv_dtype="bf16").row_bytes == 1152
    assert derived.replace(row_bytes=100, kv_dtype="bf16").row_bytes == 100
    assert derived.slots_per_request == 201
    rounded = HiSparseConfig(extent_tokens=500, host_pool_tokens=1001, max_seq_len=1000)
    assert rounded.host_rows == 1500


def test_alias_extents_default_to_the_pools_extent_count_under_host_row() -> None:
    """One alias key extent per extent of the pool by default (host_row), none under
    position; derived again when the pool or the map changes, kept when given."""
    tiny = HiSparseConfig.from_preset("tiny")
    assert (tiny.residency_map, tiny.alias_extents) == ("host_row", tiny.num_extents) == (
        "host_row", 128)
    assert tiny.replace(host_pool_tokens=4096).alias_extents == 64
    assert tiny.replace(residency_map="position").alias_extents == 0
    assert tiny.replace(alias_extents=5).replace(host_pool_tokens=4096).alias_extents == 5
    assert HiSparseConfig().alias_extents == 2048  # deepseek-v3.2's 1 Mi-token pool


def test_configs_are_frozen_and_hashable() -> None:
    config = HiSparseConfig.from_preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_k = 3
    with pytest.raises(TypeError):
        config.row_bytes_by_dtype["fp8"] = 1
    assert hash(config) == hash(HiSparseConfig.from_preset("tiny"))
    assert hisparse.HiSparseConfig is HiSparseConfig


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        HiSparseConfig.from_dict({
            "top_k": 0, "kv_dtype": "fp4", "async_backup": "yes", "colour": 1, "max_requests": -2,
        })
    problems = caught.value.problems
    assert len(problems) == 5, problems
    text = str(caught.value)
    assert "unknown key(s): colour; valid keys: model, num_layers" in text
    assert "kv_dtype: got 'fp4'; valid choices: fp8, bf16" in text
    assert "top_k: expected a positive int, got 0" in text
    assert "async_backup: got 'yes'; valid choices: true, false or null" in text
    assert "max_requests: expected a positive int, got -2" in text


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hot_slots": 10, "top_k": 64}, "hot_slots: got 10, must be at least"),
        ({"index_group_size": 5, "num_layers": 4}, "index_group_size: got 5"),
        ({"max_batch": 9}, "max_batch: got 9, larger than max_requests (8)"),
        ({"max_seq_len": 9000}, "max_seq_len: got 9000, more than the host pool holds (8192"),
        ({"host_pool_tokens": 2**31}, "must be < 2**31"),
        ({"hot_slots": 2**31}, "hot_slots: got 2147483648, must be < 2**31"),
        ({"num_layers": True}, "num_layers: expected a positive int, got True"),
        ({"skip_io": None}, "skip_io: got None; valid choices: true or false"),
        ({"validate": 1}, "validate: got 1"),
        ({"row_bytes_by_dtype": {"fp16": 3}}, "row_bytes_by_dtype: got"),
        ({"row_bytes_by_dtype": None}, "row_bytes: not given"),
        ({"model": ""}, "model: expected a non-empty string"),
        ({"residency_map": "row"}, "residency_map: got 'row'; valid choices: host_row, position"),
        ({"residency_map": "position", "max_requests": 2**15, "max_batch": 8,
          "max_seq_len": 2**16, "host_pool_tokens": 2**16},
         "residency_map: position keys max_requests * max_seq_len (in whole extents) = "
         "2147483648, must be < 2**31"),
        ({"alias_extents": -1}, "alias_extents: expected an int >= 0 or null"),
        ({"alias_extents": 2**25}, "alias_extents: host_row keys (pool extents + "
         "alias_extents) * extent_tokens = 2147491840, must be < 2**31"),
    ],
)
def test_bad_values_name_the_key_and_the_fix(change: dict, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        HiSparseConfig.from_preset("tiny", **change)
    assert named in str(caught.value)


def test_unknown_preset_and_bad_files(tmp_path: Path) -> None:
    available = ("available presets: deepseek-v3.2, deepseek-v4-flash, deepseek-v4-pro, default, "
                 "glm-5, glm-5.1, glm-5.2, glm-5.3, tiny")
    with pytest.raises(ConfigError, match=rf"unknown preset 'gpt'; {available}"):
        HiSparseConfig.from_preset("gpt")
    with pytest.raises(ConfigError, match="cannot read config file"):
        HiSparseConfig.from_yaml(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("top_k: [1,\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        HiSparseConfig.from_yaml(broken)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of config keys, got list"):
        HiSparseConfig.from_yaml(listed)
    typo = tmp_path / "typo.yaml"
    typo.write_text("top_kk: 5\n")
    with pytest.raises(ConfigError, match=rf"unknown key\(s\) in {typo}: top_kk"):
        HiSparseConfig.from_yaml(typo)
    # A bad keyword override is the caller's, not the file's; both are reported together.
    with pytest.raises(ConfigError) as caught:
        HiSparseConfig.from_yaml(typo, bogus=1)
    assert caught.value.problems[0].startswith(f"unknown key(s) in {typo}: top_kk")
    assert caught.value.problems[1].startswith("unknown override key(s): bogus;")
    empty_value = tmp_path / "empty.yaml"
    empty_value.write_text("top_k:\n")  # YAML null: no longer defaulted, a bad value
    with pytest.raises(ConfigError, match="top_k: expected a positive int, got None"):
        HiSparseConfig.from_yaml(empty_value)


@pytest.mark.parametrize("not_a_config", [{"num_layers": 4}, None, "tiny"])
def test_a_cache_refuses_what_is_not_a_config(not_a_config: object) -> None:
    import hisparse

    with pytest.raises(ConfigError, match="config must be a HiSparseConfig"):
        hisparse.HiSparseCache(not_a_config, device="cpu")


def test_a_partial_user_file_keeps_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("top_k: 512\nmax_requests: 4\n")
    config = HiSparseConfig.from_yaml(path, kv_dtype="bf16")
    assert (config.model, config.top_k, config.hot_slots, config.row_bytes) == (
        "mine", 512, 1024, 1152,
    )


def test_presets_are_found_in_an_installed_wheel(tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "site-packages" / "hisparse"
    (package / "_configs").mkdir(parents=True)
    (package / "_configs" / "only-in-wheel.yaml").write_text("num_layers: 2\nmax_seq_len: 64\n")
    monkeypatch.setattr(config_module, "__file__", str(package / "config.py"))
    assert preset_dirs() == [package / "_configs"]
    assert HiSparseConfig.from_preset("only-in-wheel").num_layers == 2


positive = st.integers(min_value=1, max_value=4096)


@st.composite
def valid_settings(draw: st.DrawFn) -> dict:
    top_k = draw(positive)
    extent = draw(st.integers(1, 1024))
    max_requests = draw(st.integers(1, 256))
    values = {
        "num_layers": draw(st.integers(1, 100)),
        "kv_dtype": draw(st.sampled_from(["fp8", "bf16"])),
        "top_k": top_k,
        "hot_slots": draw(st.none() | st.integers(top_k, 4 * top_k)),
        "max_requests": max_requests,
        "max_batch": draw(st.none() | st.integers(1, max_requests)),
        "extent_tokens": extent,
        "max_seq_len": draw(positive),
        "async_backup": draw(st.sampled_from([None, True, False])),
        "skip_io": draw(st.booleans()),
    }
    values["host_pool_tokens"] = values["max_seq_len"] + draw(st.integers(0, 10**6))
    values["index_group_size"] = draw(st.integers(1, values["num_layers"]))
    return values


@settings(max_examples=60, deadline=None)
@given(valid_settings())
def test_valid_settings_round_trip_and_keep_the_invariants(values: dict) -> None:
    config = HiSparseConfig.from_dict(values)
    assert HiSparseConfig.from_dict(config.to_dict()) == config
    assert config.hot_slots >= config.top_k
    assert config.host_rows % config.extent_tokens == 0
    assert 0 <= config.host_rows - config.host_pool_tokens < config.extent_tokens
    assert config.pages_per_request * config.extent_tokens >= config.max_seq_len
    assert config.num_index_groups == math.ceil(config.num_layers / config.index_group_size)
    assert config.anchor_layer(config.group_of_layer(config.num_layers - 1)) < config.num_layers
    assert yaml.safe_load(yaml.safe_dump(config.to_dict())) == config.to_dict()


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["num_layers", "top_k", "max_requests", "extent_tokens", "max_seq_len"]),
    st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=3), st.booleans(),
              st.none()),
)
def test_invalid_values_are_rejected_by_name(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        HiSparseConfig.from_preset("tiny", **{field: value})
    assert any(problem.startswith(f"{field}:") for problem in caught.value.problems)


def test_the_hot_buffers_old_key_still_loads_with_a_warning(tmp_path) -> None:
    """`hot_slots` was `device_buffer_size` until issue 21 gave the hot buffer one name: a
    file or an override with the old key loads the same config and says what to rename;
    both names at once is refused rather than one silently winning."""
    old_file = tmp_path / "old.yaml"
    old_file.write_text("num_layers: 2\ntop_k: 64\ndevice_buffer_size: 200\n")
    with pytest.warns(DeprecationWarning, match="'device_buffer_size' is now 'hot_slots'"):
        config = HiSparseConfig.from_yaml(old_file)
    assert config.hot_slots == 200 and config.slots_per_request == 201
    with pytest.warns(DeprecationWarning, match="override: the key 'device_buffer_size'"):
        assert HiSparseConfig.from_preset("tiny", device_buffer_size=300).hot_slots == 300
    with pytest.raises(ConfigError, match="keep hot_slots only"):
        HiSparseConfig.from_dict({"num_layers": 2, "hot_slots": 8, "device_buffer_size": 8})
    assert HiSparseConfig.from_preset("tiny", top_k=32, hot_slots=None).hot_slots == 64


@pytest.mark.parametrize(("key", "why"), [
    ("graph_capture", "hisparse never captures graphs itself"),
    ("zero_copy_swap_in", "it switched nothing"),
])
@pytest.mark.parametrize("value", [None, True, False])
def test_a_removed_switch_is_refused_saying_why(tmp_path: Path, key: str, why: str,
                                                value: object) -> None:
    """Issue 37: `graph_capture` and `zero_copy_swap_in` switched nothing; a config that still
    sets one (a file, a dict, an override or a replace, whatever the value) is refused with
    the reason and the fix, rather than dropped or taken for an unknown key."""
    old_file = tmp_path / "old.yaml"
    old_file.write_text(yaml.safe_dump({"num_layers": 2, key: value}))
    tiny = HiSparseConfig.from_preset("tiny")
    for build, where in [(lambda: HiSparseConfig.from_yaml(old_file), f"{old_file}: "),
                         (lambda: HiSparseConfig.from_dict({key: value}), ""),
                         (lambda: HiSparseConfig.from_preset("tiny", **{key: value}),
                          "override: "),
                         (lambda: tiny.replace(**{key: value}), "")]:
        with pytest.raises(ConfigError) as caught:
            build()
        assert caught.value.problems == [
            f"{where}{key} was removed: {config_module.REMOVED_KEYS[key]}"]
        assert why in caught.value.problems[0] and "delete the key" in caught.value.problems[0]
    assert key not in HiSparseConfig.field_names()
    assert tiny == HiSparseConfig.from_preset("tiny")  # nothing changed


def test_managed_layers_map_model_layers_to_cache_layers_and_are_checked() -> None:
    """`managed_layers` says which model layers the cache layers hold (DeepSeek-V4: its CSA
    layers); a layer it does not manage is refused by name; `with_num_layers` keeps a prefix."""
    rng = random.Random()
    layers = sorted(rng.sample(range(64), 5))
    config = HiSparseConfig(num_layers=5, managed_layers=layers, compress_rate=4)
    assert config.managed_layers == tuple(layers)
    assert [config.cache_layer(layer) for layer in layers] == [0, 1, 2, 3, 4]
    outside = next(i for i in range(65) if i not in layers)
    with pytest.raises(InvalidInputError, match=f"model layer {outside} is not managed"):
        config.cache_layer(outside)
    assert config.with_num_layers(2).managed_layers == tuple(layers[:2])
    assert config.to_dict()["managed_layers"] == layers
    assert HiSparseConfig(num_layers=3).cache_layer(2) == 2  # None: layers 0 .. n - 1
    tokens = rng.randrange(1, 1 << 20)
    assert config.rows_for_tokens(tokens) == tokens // 4
    for bad in ([3, 1, 2, 4, 5], [1, 1, 2, 3, 4], [1, 2, 3], [-1, 0, 1, 2, 3], ["a"] * 5):
        with pytest.raises(ConfigError, match="managed_layers: got"):
            HiSparseConfig(num_layers=5, managed_layers=bad)
    with pytest.raises(ConfigError, match="compress_rate: expected a positive int"):
        HiSparseConfig(compress_rate=0)


def test_plan_counts_a_v4_context_in_compressed_entries() -> None:
    """`hisparse plan` on a preset with compress_rate 4 plans a context of T tokens as T // 4
    rows, and says so."""
    import json
    import subprocess
    import sys

    tokens = random.choice([65536, 131072, 262144])
    result = subprocess.run([sys.executable, "-m", "hisparse", "plan", "--preset",
                             "deepseek-v4-flash", "--context", str(tokens), "--json"],
                            capture_output=True, text=True, check=True)
    document = json.loads(result.stdout)
    assert document["compress_rate"] == 4
    assert [(c["context_tokens"], c["context_rows"]) for c in document["contexts"]] == [
        (tokens, tokens // 4)]
