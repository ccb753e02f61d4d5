"""`hisparse simulate` on the CPU backend at tiny sizes, checked against a plain-Python LRU."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from collections.abc import Sequence

import pytest

from cli_checks import assert_plot_written_or_matplotlib_missing, usage_error_line
from hisparse.cli import simulate as simulate_cli
from hisparse.cli.main import main
from hisparse.tools.simulation import TraceModel, make_traces

# The tiny preset: 4 layers in index groups of 2, top-k 64, 128 hot slots, 64 B fp8 rows.
TINY = {"layers": 4, "group_size": 2, "top_k": 64, "hot": 128, "row_bytes": 64}


def simulate_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code = main(["simulate", "--device", "cpu", "--preset", "tiny", "--layers", "4",
                 "--no-progress", "--json", *argv])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def lru_model_counts(
    trace: TraceModel, seed: int, requests: int, context: int, steps: int
) -> list[tuple[int, int]]:
    """Hits and misses per step over all layers, from an exact LRU over token positions.

    Independent of the engine: it knows only docs/ARCHITECTURE.md
    (seeding, the newest token's own slot, the misses take the least recently used non-hit
    slots, slots used in the same step ordered by slot id). It keeps, per (request, group),
    the tokens in LRU order, each with its slot.
    """
    hot, groups = TINY["hot"], TINY["layers"] // TINY["group_size"]
    traces = make_traces(trace, requests, groups, seed)
    # After seeding, slot s holds the s-th of the H tokens before the newest, oldest first.
    lru = [[[(token, slot) for slot, token in enumerate(range(context - 1 - hot, context - 1))]
            for _ in range(groups)] for _ in range(requests)]
    counts = []
    for step in range(steps):
        seq_len = context + step + 1
        hits = misses = 0
        for request in range(requests):
            for group in range(groups):
                order = lru[request][group]
                top_k = traces[request][group].step(seq_len)
                held = {token for token, _ in order}
                hit_tokens = {p for p in top_k if p in held}
                missed = [p for p in top_k if p != seq_len - 1 and p not in hit_tokens]
                evictable = [(t, s) for t, s in order if t not in hit_tokens]
                victims = sorted(s for _, s in evictable[: len(missed)])
                kept = evictable[len(missed):]
                # Everything used this step is newest, in slot-id order among itself.
                used = [(t, s) for t, s in order if t in hit_tokens]
                used += list(zip(missed, victims, strict=True))
                lru[request][group] = kept + sorted(used, key=lambda entry: entry[1])
                hits += (len(top_k) - len(missed)) * TINY["group_size"]
                misses += len(missed) * TINY["group_size"]
        counts.append((hits, misses))
    return counts


def test_hits_and_misses_match_an_independent_lru_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seed = random.randrange(2**31)
    requests, context, steps = 3, 700, 8
    doc = simulate_json(capsys, "--requests", str(requests), "--steps", str(steps),
                        "--warmup", "2", "--context", str(context), "--seed", str(seed),
                        "--carryover", "0.5", "--heavy-hitters", "4", "--recent-window", "200",
                        "--no-split")
    trace = TraceModel(top_k=TINY["top_k"], carryover=0.5, heavy_hitters=4, recent_window=200)
    expected = lru_model_counts(trace, seed, requests, context, steps)
    measured = [(s["hits"], s["misses"]) for s in doc["steps"]]
    assert measured == expected
    for step in doc["steps"]:
        # Every top-k entry of every layer is either a hit or a miss (contexts exceed top-k).
        assert step["hits"] + step["misses"] == requests * TINY["layers"] * TINY["top_k"]
        assert step["bytes_host_to_device"] == step["misses"] * TINY["row_bytes"]


def test_json_document_schema_and_summary(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    target = tmp_path / "results" / "sim.json"
    target.parent.mkdir()  # --output makes no folders (tests/test_cli_inputs.py)
    doc = simulate_json(capsys, "--requests", "2", "--steps", "5", "--warmup", "1",
                        "--context", "400", "--seed", str(random.randrange(2**31)),
                        "--output", str(target))
    assert json.loads(target.read_text()) == doc
    assert doc["schema_version"] == 1 and doc["command"] == "simulate"
    assert doc["backend"] == "cpu" and doc["device"] == "cpu"
    assert set(doc) >= {"config", "workload", "summary", "split_note", "steps",
                        "disabled_features"}
    assert doc["config"]["num_layers"] == 4 and doc["config"]["max_requests"] == 2
    assert doc["workload"]["trace"]["carryover"] == 0.6
    steps = doc["steps"]
    assert [s["step"] for s in steps] == list(range(5))
    assert [s["warmup"] for s in steps] == [True, False, False, False, False]
    assert steps[0]["churn"] is None  # no previous top-k before the first step
    assert all(abs(s["churn"] - 0.4) < 0.02 for s in steps[1:])  # 1 - carry-over, rounded
    summary = doc["summary"]
    timed = steps[1:]
    hits, misses = sum(s["hits"] for s in timed), sum(s["misses"] for s in timed)
    assert summary["timed_steps"] == 4
    assert summary["hit_rate"] == pytest.approx(hits / (hits + misses))
    assert summary["misses_per_step"] == pytest.approx(misses / 4)
    assert summary["bytes_host_to_device_per_step"] == pytest.approx(misses / 4 * 64)
    # The CPU backend has the skip-IO probe, so the split is measured, every step.
    assert doc["split_note"].startswith("measured")
    assert all(s["planning_seconds"] > 0 for s in steps)
    assert summary["planning_seconds_per_step"] > 0
    assert summary["copy_seconds_per_step"] is not None
    assert summary["peak_device_bytes"] is None  # CPU: device tensors are host memory
    assert summary["peak_host_rss_bytes"] > summary["host_pool_bytes"] > 0


def test_same_seed_same_run_and_no_split_reports_none(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--requests", "2", "--steps", "4", "--warmup", "0", "--context", "300",
            "--seed", str(random.randrange(2**31)), "--no-split")
    first, again = simulate_json(capsys, *argv), simulate_json(capsys, *argv)
    counts = [[(s["hits"], s["misses"]) for s in d["steps"]] for d in (first, again)]
    assert counts[0] == counts[1]
    assert first["split_note"].startswith("not measured")
    assert first["summary"]["planning_seconds_per_step"] is None
    assert all(s["planning_seconds"] is None for s in first["steps"])


def test_no_split_is_reported_where_the_backend_lacks_skip_io(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hisparse.backends.cpu import CpuBackend
    from hisparse.backends.features import Feature, FeatureTable, unsupported

    entries = dict(CpuBackend.features.items())
    entries[Feature.SKIP_IO_PROBE] = unsupported("faked for this test", "time the whole step")
    monkeypatch.setattr(CpuBackend, "features", FeatureTable(entries))
    doc = simulate_json(capsys, "--requests", "1", "--steps", "3", "--warmup", "0",
                        "--context", "300")
    assert "no skip-IO probe (faked for this test)" in doc["split_note"]
    assert doc["summary"]["planning_seconds_per_step"] is None
    assert doc["summary"]["copy_seconds_per_step"] is None


def test_table_output_and_progress_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--device", "cpu", "--preset", "tiny", "--layers", "4",
                 "--requests", "2", "--steps", "3", "--warmup", "1", "--context", "300"]) == 0
    captured = capsys.readouterr()
    assert "tiny on cpu (cpu backend): 2 requests x 4 layers x 3 steps" in captured.out
    assert "CPU numbers" in captured.out
    for metric in ("hit rate", "misses per step", "H2D bytes per step", "planning", "copy",
                   "peak host RSS"):
        assert metric in captured.out
    assert "6/6" in captured.err or "decode steps" in captured.err  # counter or tqdm


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--device", "no-such-device"], "--device"),
        (["--carryover", "1.5"], "--carryover"),
        (["--steps", "0"], "--steps"),
        (["--steps", "4", "--warmup", "4"], "--warmup"),
        (["--hot-slots", "10"], "--hot-slots"),
        (["--heavy-hitters", "100"], "--heavy-hitters"),
        (["--kv-dtype", "int4"], "--kv-dtype"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(
    capsys: pytest.CaptureFixture[str], argv: Sequence[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--preset", "tiny", "--no-progress", *argv])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, "simulate")
    assert error.startswith("hisparse simulate: error: argument") and named in error


def test_plot_writes_a_png_or_says_matplotlib_is_missing(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    target = tmp_path / "sim.png"
    code = main(["simulate", "--device", "cpu", "--preset", "tiny", "--requests", "1",
                 "--steps", "3", "--warmup", "1", "--context", "300", "--no-progress",
                 "--no-split", "--plot", str(target)])
    assert_plot_written_or_matplotlib_missing(code, target, capsys)


def test_help_defaults_match_the_trace_model(capsys: pytest.CaptureFixture[str]) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(TraceModel) if f.name != "top_k"}
    assert defaults == simulate_cli.TRACE_DEFAULTS
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = capsys.readouterr().out
    assert "hisparse simulate --preset deepseek-v3.2" in text
    assert "arXiv 2604.22312" in text


def test_progress_counts_each_pass_to_the_steps_the_summary_reports(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The progress counted 48 steps where the summary said 24: it ran one count over the run
    and its skip-IO replay. Now each pass counts to --steps under its own name."""
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain counter: one line per update
    code = main(["simulate", "--device", "cpu", "--preset", "tiny", "--requests", "1",
                 "--steps", "3", "--warmup", "1", "--context", "512"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "x 3 steps (1 warm-up)" in captured.out
    counts = [line for line in captured.err.splitlines() if line.startswith("simulate: ")]
    assert counts == [f"simulate: decode steps: {i}/3" for i in (1, 2, 3)] + [
        f"simulate: skip-IO replay: {i}/3" for i in (1, 2, 3)]


def test_without_the_split_only_the_decode_steps_are_counted(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert main(["simulate", "--device", "cpu", "--preset", "tiny", "--requests", "1",
                 "--steps", "2", "--warmup", "0", "--context", "512", "--no-split"]) == 0
    counts = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("simulate: ")]
    assert counts == ["simulate: decode steps: 1/2", "simulate: decode steps: 2/2"]
