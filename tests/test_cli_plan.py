"""`hisparse plan`: the capacity arithmetic against hand calculations, and the command itself."""

from __future__ import annotations

import json
import math
import random

import pytest

from cli_checks import assert_plot_written_or_matplotlib_missing, usage_error_line
from hisparse.cli.main import main
from hisparse.errors import InvalidInputError
from hisparse.tools import planning
from hisparse.tools.planning import GIB, ModelShape, PlanSettings

DSV32_FP8 = ModelShape("deepseek-v3.2", num_layers=61, row_bytes=656, indexer_key_bytes=132)
ONE_H200 = PlanSettings(
    gpu_mem_bytes=140 * GIB, weights_bytes=80 * GIB, reserve_bytes=10 * GIB, top_k=2048,
    hot_slots=4096, extent_tokens=512, miss_rate=0.1, link_bytes_per_s=52e9,
)


def test_deepseek_v32_fp8_at_32k_matches_the_hand_calculation() -> None:
    [p] = planning.plan(DSV32_FP8, ONE_H200, [32768])
    # 50 GiB = 53,687,091,200 B for KV. Full KV: 32768 tokens x 61 layers x (656 + 132) B.
    assert p.baseline_request_bytes == 1_575_092_224
    assert p.baseline_max_requests == 34  # 53,687,091,200 / 1,575,092,224 = 34.08
    f = p.hisparse_footprint
    assert f.hot_rows == 163_945_552  # 4097 slots x 61 x 656
    assert f.indexer_keys == 263_847_936  # 32768 x 61 x 132
    # last_use and slot_key: 2 x 61 groups x 4096 x 4 B, and 61 LRU clocks of 4 B.
    assert f.lru_tables == 1_999_092
    assert f.page_table == 260  # 64 extents x 4 B + seq_len
    assert f.resident_map == 3_997_696  # 61 groups x 32768 host rows x 2 B (int16 slot ids)
    assert p.hisparse_request_bytes == 433_790_536
    assert p.hisparse_max_requests == 123  # 53,687,091,200 / 433,790,536 = 123.8
    assert p.limited_by == "device"
    assert p.host_request_bytes == 1_311_244_288  # 32768 x 61 x 656
    assert p.host_pool_bytes == 123 * 1_311_244_288
    # 123 requests x 61 layers x 204.8 misses x 656 B, over 52 GB/s.
    assert p.h2d_bytes_per_step == pytest.approx(1_008_019_046.4)
    assert p.h2d_seconds_per_step == pytest.approx(0.019384982, rel=1e-6)
    assert p.d2h_bytes_per_step == 123 * 61 * 656
    assert p.gain == pytest.approx(123 / 34)


def test_short_contexts_need_no_copies_and_host_memory_caps_concurrency() -> None:
    short_settings = PlanSettings(**{**ONE_H200.__dict__, "host_mem_bytes": 10 * GIB})
    short, long = planning.plan(DSV32_FP8, short_settings, [4096, 8192])
    assert short.h2d_bytes_per_step == 0  # 4096 tokens fit the 4096-slot hot buffer
    # Host: 8192 x 61 x 656 = 327,811,072 B per request; 10 GiB holds 32 of them.
    assert long.limited_by == "host"
    assert long.hisparse_max_requests == 10 * GIB // 327_811_072 == 32
    assert long.h2d_bytes_per_step == pytest.approx(32 * 61 * 204.8 * 656)


def test_index_groups_shrink_only_the_tables() -> None:
    glm_shared = ModelShape("glm-5", num_layers=78, row_bytes=656, index_group_size=4)
    [p] = planning.plan(glm_shared, ONE_H200, [1000])
    assert glm_shared.num_groups == 20  # ceil(78 / 4)
    assert p.hisparse_footprint.lru_tables == 20 * (2 * 4096 + 1) * 4
    assert p.hisparse_footprint.resident_map == 20 * 1024 * 2  # 1000 tokens -> 2 extents
    assert p.hisparse_footprint.hot_rows == 4097 * 78 * 656


def test_random_shapes_against_an_independent_formula() -> None:
    rng = random.Random()
    for _ in range(50):
        layers, row, indexer = rng.randint(1, 100), rng.randint(1, 2048), rng.randint(0, 256)
        group, top_k = rng.randint(1, 8), rng.randint(1, 4096)
        # Hot buffers past 32767 slots need int32 residency entries instead of int16.
        hot = top_k + rng.choice([rng.randint(0, 4096), rng.randint(29000, 40000)])
        extent = rng.randint(1, 1024)
        context = rng.randint(1, 10**6)
        shape = ModelShape("m", layers, row, indexer, group)
        settings = PlanSettings(
            gpu_mem_bytes=rng.randint(10, 200) * GIB, weights_bytes=rng.randint(0, 9) * GIB,
            reserve_bytes=0, top_k=top_k, hot_slots=hot, extent_tokens=extent,
            miss_rate=rng.random(), link_bytes_per_s=rng.uniform(1e9, 1e11),
        )
        [p] = planning.plan(shape, settings, [context])
        groups = -(-layers // group)
        extents = -(-context // extent)
        per_request = ((hot + 1) * layers * row + context * groups * indexer
                       + 4 * groups * (2 * hot + 1) + 4 * extents + 4
                       + (2 if hot < 32768 else 4) * groups * extents * extent)
        assert p.hisparse_request_bytes == per_request
        assert p.hisparse_max_requests == settings.available_bytes // per_request
        baseline = context * (layers * row + groups * indexer)
        assert p.baseline_max_requests == settings.available_bytes // baseline
        misses = settings.miss_rate * top_k if context > hot else 0
        assert math.isclose(p.h2d_bytes_per_step,
                            p.hisparse_max_requests * layers * misses * row, rel_tol=1e-12)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"hot_slots": 1000}, "hot buffer"),
        ({"weights_bytes": 200 * GIB}, "leave no room"),
        ({"miss_rate": 1.5}, "miss rate"),
    ],
)
def test_meaningless_plans_are_rejected(change: dict[str, object], named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        planning.plan(DSV32_FP8, PlanSettings(**{**ONE_H200.__dict__, **change}), [32768])


# --- the command -----------------------------------------------------------------------------
def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_for_the_deepseek_preset(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--preset", "deepseek-v3.2", "--gpu-mem-gib", "140",
                   "--weights-gib", "80", "--reserve-gib", "10", "--context", "32768", "8192")
    assert doc["schema_version"] == 1 and doc["command"] == "plan"
    assert doc["model"] == {
        "preset": "deepseek-v3.2", "config_file": None, "kv_dtype": "fp8", "num_layers": 61,
        "row_bytes": 656, "indexer_key_bytes": 132, "index_group_size": 1, "num_groups": 61,
        "index_anchors": list(range(61)),
    }
    assert doc["settings"]["available_bytes"] == 50 * GIB
    first, second = doc["contexts"]
    assert first["context_tokens"] == 32768 and second["context_tokens"] == 8192
    assert first["baseline_max_requests"] == 34
    assert first["hisparse_max_requests"] == 122  # 53,687,091,200 / 437,788,232 = 122.6
    # The preset keys its residency map by host row with as many alias key extents as the
    # pool has extents (shared prefixes): twice the resident map of a plain host-row one.
    assert first["hisparse_footprint"]["resident_map"] == 2 * 3_997_696
    assert first["hisparse_footprint"]["total"] == 433_790_536 + 3_997_696
    assert set(first) >= {"host_pool_bytes", "h2d_bytes_per_step", "h2d_seconds_per_step",
                          "d2h_bytes_per_step", "limited_by", "gain"}


def test_bf16_doubles_the_rows(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--kv-dtype", "bf16", "--context", "65536", "--indexer-bytes", "0")
    assert doc["model"]["row_bytes"] == 1152  # 576 bf16 values
    [p] = doc["contexts"]
    assert p["baseline_request_bytes"] == 65536 * 61 * 1152


def test_plan_table_names_the_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--context", "32768"]) == 0
    text = capsys.readouterr().out
    assert "deepseek-v3.2 fp8: 61 layers, 656 B rows" in text
    assert "HiSparse" in text and "H2D time/step" in text
    row = next(line for line in text.splitlines() if line.startswith("32768"))
    assert row.split()[1:3] == ["34", "122"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--kv-dtype", "fp16"], "--kv-dtype"),
        (["--context", "0"], "--context"),
        (["--miss-rate", "2"], "--miss-rate"),
        (["--gpu-mem-gib", "abc"], "--gpu-mem-gib"),
        (["--weights-gib", "500"], "--weights-gib"),
        (["--hot-slots", "100"], "--hot-slots"),
        (["--preset", "no-such-model"], "--preset"),
        (["--shared-prefix", "-1"], "--shared-prefix"),
        (["--sharing-requests", "0", "--shared-prefix", "8"], "--sharing-requests"),
        (["--sharing-requests", "4"], "--sharing-requests"),
        (["--shared-prefix", "40000", "--context", "32768"], "longer than context"),
        (["--tp", "0"], "--tp"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, "plan")
    assert error.startswith("hisparse plan: error:") and named in error


def test_plot_writes_a_png_or_says_matplotlib_is_missing(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    target = tmp_path / "plan.png"
    code = main(["plan", "--context", "8192", "32768", "--plot", str(target)])
    assert_plot_written_or_matplotlib_missing(code, target, capsys)


def test_help_shows_an_example_and_the_formulas(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    assert "hisparse plan --preset deepseek-v3.2" in text
    assert "C * (L * W + G * I)" in text


def test_resident_entry_bytes_match_the_engines_table_dtype() -> None:
    """planning spells the dtype rule out without torch; it must agree with the engine's."""
    from hisparse.layout.tables import residency_dtype

    for hot in (1, 4096, 32766, 32767, 32768, 65536):
        assert planning.resident_entry_bytes(hot) == residency_dtype(hot).itemsize, hot


def test_alias_key_extents_add_their_share_of_the_resident_map() -> None:
    """host_row with alias key extents (shared prefixes) holds a residency entry per key row:
    the pool's rows plus the aliases' (config alias_extents), so the per-request share grows
    by alias_extents over the pool's extents."""
    (plain,) = planning.plan(DSV32_FP8, ONE_H200, [32768])
    (aliased,) = planning.plan(
        DSV32_FP8, PlanSettings(**{**ONE_H200.__dict__, "resident_entries_per_token": 1.5}),
        [32768])
    assert aliased.hisparse_footprint.resident_map == 3 * plain.hisparse_footprint.resident_map // 2
    assert aliased.hisparse_max_requests <= plain.hisparse_max_requests


def test_draft_slots_count_in_the_device_budget() -> None:
    """A cache built for verify steps of D tokens keeps D reserved slots per request beside
    the LRU's H: the plan's hot rows per request are H + D, not H + 1."""
    (one,) = planning.plan(DSV32_FP8, ONE_H200, [32768])
    (four,) = planning.plan(DSV32_FP8,
                            PlanSettings(**{**ONE_H200.__dict__, "reserved_slots": 4}), [32768])
    row_bytes = DSV32_FP8.num_layers * DSV32_FP8.row_bytes
    assert four.hisparse_footprint.hot_rows - one.hisparse_footprint.hot_rows == 3 * row_bytes
    assert four.hisparse_max_requests <= one.hisparse_max_requests


# --- shared prefixes ---------------------------------------------------------------------------
def test_a_shared_prefix_saves_its_whole_extents_once_per_extra_sharer() -> None:
    sharing = PlanSettings(**{**ONE_H200.__dict__, "shared_prefix_tokens": 16000,
                              "sharing_requests": 32})
    [p] = planning.plan(DSV32_FP8, sharing, [32768])
    # 16000 tokens = 31 whole 512-token extents (15872 tokens) + 128 in a boundary extent,
    # which each request copies. 31 of the 32 sharers hold the 15872 rows by reference.
    assert p.sharing_requests == 32
    assert p.host_bytes_saved == 31 * 15872 * 61 * 656
    assert p.host_pool_bytes == 123 * 1_311_244_288 - p.host_bytes_saved
    assert p.hisparse_max_requests == 123  # device memory is per request, shared or not
    # N requests sharing a P-token prefix: P_E + N x their own rows, in whole extents.
    own = 32768 - 15872
    assert p.host_pool_bytes == ((123 - 32) * 32768 + 15872 + 32 * own) * 61 * 656


def test_with_a_host_cap_sharing_fits_more_requests(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        extent = rng.choice([16, 64, 512])
        context = rng.randint(1, 40000)
        prefix = rng.randint(0, context)
        sharers = rng.choice([None, rng.randint(1, 200)])
        cap = rng.randint(1, 200) * GIB
        settings = PlanSettings(**{**ONE_H200.__dict__, "extent_tokens": extent,
                                   "host_mem_bytes": cap, "shared_prefix_tokens": prefix,
                                   "sharing_requests": sharers})
        [p] = planning.plan(DSV32_FP8, settings, [context])
        device_limit = settings.available_bytes // p.hisparse_request_bytes

        # The pool's bytes for 0, 1, 2, ... requests, counted request by request: a sharer
        # after the first holds the prefix's whole extents by reference.
        whole, pool = prefix // extent * extent, [0]
        for index in range(device_limit):
            shares = prefix and index and (sharers is None or index < sharers)
            rows = planning.round_up(context, extent) - (whole if shares else 0)
            pool.append(pool[-1] + rows * 61 * 656)
        fits = max(r for r, size in enumerate(pool) if size <= cap)
        assert p.hisparse_max_requests == fits, (extent, context, prefix, sharers, cap)
        assert p.host_pool_bytes == pool[fits]
        assert p.limited_by == ("host" if fits < device_limit else "device")


def test_plan_shows_the_host_memory_a_shared_prefix_saves(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = run_json(capsys, "--context", "32768", "--shared-prefix", "16384",
                   "--sharing-requests", "32")
    assert doc["settings"]["shared_prefix_tokens"] == 16384
    [p] = doc["contexts"]
    assert p["host_bytes_saved"] == 31 * 16384 * 61 * 656 and p["sharing_requests"] == 32
    assert main(["plan", "--context", "32768", "--shared-prefix", "16384"]) == 0
    text = capsys.readouterr().out
    assert "shared prefix: 16384 tokens, held once by every request" in text
    assert "host saved" in text


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_shows_host_memory_per_node_with_and_without_a_shared_pool(
        capsys: pytest.CaptureFixture[str], tp: int) -> None:
    """Per node: tp pools, one per rank, against one pool the ranks share plus its header
    (which the segment's own layout sizes, independently of the planner)."""
    from hisparse.core.shared_segment import SegmentLayout

    doc = run_json(capsys, "--tp", str(tp), "--context", "32768", "131072")
    assert doc["settings"]["tp_ranks"] == tp
    header = SegmentLayout(61, 1 << 20, 656, 512, tp, 0).header_bytes
    for context in doc["contexts"]:
        pool = context["hisparse_max_requests"] * context["context_tokens"] * 61 * 656
        assert context["host_pool_bytes"] == pool
        assert context["host_node_bytes_private"] == tp * pool
        assert context["host_node_bytes_shared"] == pool + header
        assert header < 1 << 20  # "small metadata"
    assert main(["plan", "--tp", str(tp), "--context", "131072"]) == 0
    text = capsys.readouterr().out
    assert f"host/node x{tp}" in text and "host/node shared" in text
    assert f"tensor parallel: {tp} ranks per node" in text


def test_one_rank_plans_no_node_columns(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--context", "32768")
    [context] = doc["contexts"]
    assert context["host_node_bytes_private"] == context["host_pool_bytes"]
    assert context["host_node_bytes_shared"] == context["host_pool_bytes"]
    assert main(["plan", "--context", "32768"]) == 0
    assert "host/node" not in capsys.readouterr().out


# --- issue 39: what a deployment's config and an absurd value do to the plan -----------------
def test_a_shared_prefix_longer_than_the_default_contexts_names_context(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The defaults include 8192-token contexts: a 16384-token prefix used to fail without
    naming --context, the option that fixes it."""
    with pytest.raises(SystemExit):
        main(["plan", "--shared-prefix", "16384"])
    error = usage_error_line(capsys.readouterr().err, "plan")
    assert error.startswith("hisparse plan: error: argument --shared-prefix: 16384 tokens")
    assert "--context" in error and "8192" in error


@pytest.mark.parametrize(("argv", "option"), [
    (["--gpu-mem-gib", "1e30"], "--gpu-mem-gib"),
    (["--weights-gib", "1e30"], "--weights-gib"),
    (["--host-mem-gib", "1e30"], "--host-mem-gib"),
    (["--link-gbps", "1e30"], "--link-gbps"),
    (["--context", str(2**40)], "--context"),
    (["--top-k", "100000", "--context", "8192", "32768"], "--top-k"),
    (["--tp", "100000"], "--tp"),
])
def test_absurd_values_are_refused_naming_the_option(
    capsys: pytest.CaptureFixture[str], argv: list[str], option: str,
) -> None:
    """`--gpu-mem-gib 1e30` printed 31-digit request counts; `--top-k 100000` against
    8192-token contexts planned "gain 0.0x"."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, "plan")
    assert error.startswith(f"hisparse plan: error: argument {option}: "), error
    assert argv[1] in error or str(float(argv[1])) in error or "100000" in error, error


def test_a_config_files_request_limits_cap_the_plan(
    capsys: pytest.CaptureFixture[str], tmp_path,
) -> None:
    """max_requests and host_pool_tokens of a --config file are what the cache will admit:
    the HiSparse column is capped by them, and says which one capped it."""
    config = tmp_path / "deploy.yaml"
    config.write_text("model: deploy\nnum_layers: 61\nrow_bytes: 656\ntop_k: 2048\n"
                      "max_requests: 16\nhost_pool_tokens: 65536\nmax_seq_len: 32768\n")
    doc = run_json(capsys, "--config", str(config), "--context", "8192", "32768")
    short, long = doc["contexts"]
    assert short["hisparse_max_requests"] == 8 and short["limited_by"] == "host_pool_tokens"
    assert long["hisparse_max_requests"] == 2 and long["limited_by"] == "host_pool_tokens"
    assert short["host_pool_tokens"] == 65536 and long["host_pool_tokens"] == 65536
    config.write_text(config.read_text().replace("65536", "16777216"))
    doc = run_json(capsys, "--config", str(config), "--context", "8192")
    [short] = doc["contexts"]
    assert short["hisparse_max_requests"] == 16 and short["limited_by"] == "max_requests"
    assert short["host_pool_tokens"] == 16 * 8192
    assert main(["plan", "--config", str(config), "--context", "8192"]) == 0
    text = capsys.readouterr().out
    assert "max_requests 16" in text and "host_pool_tokens 16777216" in text


def test_requests_asks_whether_they_fit_and_what_to_set(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--requests 128 --context 131072`: do 128 requests of 128k tokens fit, and which
    host_pool_tokens, max_requests and max_seq_len would a cache for them need?"""
    doc = run_json(capsys, "--requests", "128", "--context", "131072", "8192")
    long, short = doc["requests"]
    assert long["requests"] == 128 and long["context_tokens"] == 131072
    assert long["host_pool_tokens"] == 128 * 131072
    per_request = doc["contexts"][0]["hisparse_request_bytes"]
    assert long["device_bytes"] == 128 * per_request
    assert long["fits"] == (128 * per_request <= doc["settings"]["available_bytes"]) is False
    assert short["fits"] is True and short["host_pool_tokens"] == 128 * 8192
    assert main(["plan", "--requests", "128", "--context", "8192"]) == 0
    text = capsys.readouterr().out
    assert "128 requests of 8192 tokens: fit" in text
    assert "host_pool_tokens: 1048576" in text and "max_requests: 128" in text


def test_a_context_past_the_configs_max_seq_len_is_warned_about(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--context", "262144", "8192", "--json"]) == 0
    captured = capsys.readouterr()
    doc, err = json.loads(captured.out), captured.err
    assert "warning" in err and "--context 262144" in err and "max_seq_len 131072" in err
    assert any("262144" in warning for warning in doc["warnings"])
    assert main(["plan", "--context", "131072"]) == 0
    assert capsys.readouterr().err == ""
