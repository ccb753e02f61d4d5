"""`hisparse bench` on the CPU at tiny sizes: SW-1 cells, copy probes, JSON, errors."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from cli_checks import assert_plot_written_or_matplotlib_missing, usage_error_line
from conftest import needs_module
from hisparse.backends.base import Backend
from hisparse.backends.registry import get_backend
from hisparse.cli import bench as bench_cli
from hisparse.cli.main import main
from hisparse.errors import InvalidInputError
from hisparse.tools import benchmarking

TINY = ["--device", "cpu", "--no-progress", "--batches", "1", "2", "--churns", "0", "1",
        "--seq-len", "1024", "--top-k", "64", "--hot-slots", "128", "--warmup", "2",
        "--steps", "2", "--bulk-mib", "1", "--gather-pool-mib", "1",
        "--gather-rows", "100", "1000"]


def filled_pool(backend: Backend, requests: int, seq_len: int = 1024) -> torch.Tensor:
    """A host pool of `requests` x `seq_len` 656 B rows, each row's bytes its own."""
    pool = backend.alloc_host(requests * seq_len * 656).view(requests * seq_len, 656)
    benchmarking.fill_pool(pool)
    return pool


def bench_json(capsys: pytest.CaptureFixture[str], tmp_path, *argv: str,
               base: Sequence[str] = TINY) -> dict:
    target = tmp_path / "bench.json"
    assert main(["bench", *base, "--json", "--output", str(target), *argv]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert json.loads(target.read_text()) == doc
    return doc


def test_sw1_cells_and_copy_probes(capsys: pytest.CaptureFixture[str], tmp_path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where a file written unasked would land
    seed = str(np.random.default_rng().integers(2**31))
    doc = bench_json(capsys, tmp_path, "--seed", seed)
    assert doc["schema_version"] == 1 and doc["command"] == "bench"
    assert doc["backend"] == "cpu" and doc["cpu_numbers"] is True and doc["quick"] is True
    assert doc["swap_in_kernel"].endswith("swap_in_reference")
    assert doc["sw1"]["sizes"]["top_k"] == 64 and doc["sw1"]["sizes"]["hot_slots"] == 128
    cells = doc["sw1"]["cells"]
    assert [(c["layout"], c["batch"], c["churn"]) for c in cells] == [
        (layout, batch, churn) for layout in ("scattered", "extents") for batch in (1, 2)
        for churn in (0.0, 1.0)
    ]
    for cell in cells:
        assert cell["verified"] is True
        assert cell["timing"] == "eager"  # no graph capture on a CPU
        assert cell["p90_seconds"] >= cell["step_seconds"] > 0
        assert cell["extent_tokens"] == (1 if cell["layout"] == "scattered" else 512)
        assert cell["target_met"] is None  # CPU numbers are never judged against H200 targets
        if cell["churn"] == 0:
            assert cell["misses_per_step"] == 0 and cell["miss_bytes_per_second"] is None
        else:
            # Fresh positions were never selected nor seeded: each one misses.
            assert cell["misses_per_step"] == 64 * cell["batch"]
            assert cell["miss_bytes_per_second"] == pytest.approx(
                cell["misses_per_step"] * 656 / cell["step_seconds"])
    copies = {(r["name"], r["rows"]): r for r in doc["copy_limits"]}
    assert set(copies) == {("bulk host-to-device", None), ("bulk device-to-host", None),
                           ("gather", 100), ("gather", 1000)}
    assert copies[("bulk host-to-device", None)]["num_bytes"] == 1 << 20
    assert copies[("bulk host-to-device", None)]["h200_measured_limit"] == "52-55 GB/s"
    assert copies[("bulk host-to-device", None)]["h200_limit_bytes_per_second"] == [52e9, 55e9]
    # Only the 2048, 16384 and 131072-row gathers were measured on the H200.
    assert copies[("gather", 1000)]["h200_limit_bytes_per_second"] is None
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bench.json"]
    assert copies[("gather", 1000)]["num_bytes"] == 1000 * 656
    for result in copies.values():
        assert result["bytes_per_second"] == pytest.approx(
            result["num_bytes"] / result["seconds"])


def test_only_copy_and_table_output(capsys: pytest.CaptureFixture[str], tmp_path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "copy.json"
    assert main(["bench", *TINY, "--only", "copy", "--output", str(target)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "CPU numbers" in text and "Copy limits" in text and "SW-1" not in text
    assert f"wrote {target}" in captured.err
    doc = json.loads(target.read_text())
    assert doc["sw1"]["cells"] == [] and len(doc["copy_limits"]) == 4
    assert sorted(path.name for path in tmp_path.iterdir()) == ["copy.json"]


def test_bench_writes_no_file_unless_asked(capsys: pytest.CaptureFixture[str], tmp_path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`hisparse bench` used to leave hisparse-bench-cpu.json (and a PNG, with matplotlib) in
    the current directory: now only --output and --plot write files."""
    monkeypatch.chdir(tmp_path)
    assert main(["bench", *TINY, "--only", "copy"]) == 0
    captured = capsys.readouterr()
    assert "Copy limits" in captured.out and "wrote" not in captured.err
    assert list(tmp_path.iterdir()) == []


def test_the_h200_column_is_a_rate_in_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    """The copy-limit table's H200 column mixed "35-56 us" (the 2048-row gather, measured as a
    time) into a column of GB/s; now every entry is a rate, that one converted from its bytes."""
    assert main(["bench", *TINY, "--only", "copy", "--gather-pool-mib", "16",
                 "--gather-rows", "2048", "16384"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("copy "))
    assert lines[header].split()[-3:] == ["H200", "measured", "rate"]
    rows = lines[header + 2:header + 6]
    references = [row.split("B/s", 1)[1].strip() for row in rows]  # after the "rate" cell
    assert references == ["52.0-55.0 GB/s", "55.0 GB/s", "24.0-38.4 GB/s (measured as 35-56 us)",
                          "41.0-47.0 GB/s"], rows
    assert not any(row.rstrip().endswith(" us") for row in rows)
    low, high = bench_cli.COPY_LIMITS[("gather", 2048)].low_bytes_per_second, \
        bench_cli.COPY_LIMITS[("gather", 2048)].high_bytes_per_second
    assert (low, high) == pytest.approx((2048 * 656 / 56e-6, 2048 * 656 / 35e-6))


def test_the_plot_shows_the_reference_values_the_tables_show(
        capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    pyplot = pytest.importorskip("matplotlib.pyplot", reason="matplotlib is not installed "
                                 "(pip install 'hisparse[tools]')")
    target = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--gather-pool-mib", "16", "--gather-rows", "2048", "16384",
                 "--output", str(target)]) == 0
    document = json.loads(target.read_text())
    figure = bench_cli.draw(pyplot, document)
    try:
        sw1_axes, copy_axes = figure.axes
        target_lines = [line for line in sw1_axes.get_lines()
                        if line.get_label().startswith("H200 target 44 GB/s")]
        assert len(target_lines) == 1 and list(target_lines[0].get_ydata()) == [44, 44]
        (errorbars,) = [c for c in copy_axes.containers if c.get_label() == "H200 measured"]
        segments = errorbars.lines[2][0].get_segments()
        drawn = sorted((round(seg[0][0], 3), round(seg[1][0], 3)) for seg in segments)
        expected = sorted((round(low / 1e9, 3), round(high / 1e9, 3))
                          for low, high in (r["h200_limit_bytes_per_second"]
                                            for r in document["copy_limits"]))
        assert drawn == expected and len(drawn) == 4  # both bulk copies and both gathers
    finally:
        pyplot.close(figure)


def test_bench_takes_its_swap_in_shape_from_a_config_file(
        capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    config = tmp_path / "mine.yaml"
    config.write_text("top_k: 32\nhot_slots: 80\nrow_bytes: 128\nextent_tokens: 256\n"
                      "residency_map: position\n")
    # TINY without its --top-k 64 --hot-slots 128, which would win over the file.
    base = TINY[:TINY.index("--top-k")] + TINY[TINY.index("--hot-slots") + 2:]
    doc = bench_json(capsys, tmp_path, "--config", str(config), "--churns", "1",
                     "--batches", "1", "--layouts", "extents", base=base)
    sizes = doc["sw1"]["sizes"]
    assert (sizes["top_k"], sizes["hot_slots"], sizes["row_bytes"], sizes["extent_tokens"]) == (
        32, 80, 128, 256)
    (cell,) = doc["sw1"]["cells"]
    assert cell["residency_map"] == "position" and cell["verified"]
    assert cell["misses_per_step"] == 32 and cell["extent_tokens"] == 256
    gathers = [r for r in doc["copy_limits"] if r["name"] == "gather"]
    assert [r["num_bytes"] for r in gathers] == [100 * 128, 1000 * 128]
    # An option still wins over the file, under the same hot-buffer rule as plan and simulate.
    doc = bench_json(capsys, tmp_path, "--config", str(config), "--top-k", "16", "--only",
                     "sw1", "--churns", "0", "--batches", "1", "--layouts", "extents",
                     base=base)
    assert (doc["sw1"]["sizes"]["top_k"], doc["sw1"]["sizes"]["hot_slots"]) == (16, 80)
    with pytest.raises(SystemExit):
        main(["bench", *base, "--config", str(config), "--top-k", "100"])
    error = usage_error_line(capsys.readouterr().err, "bench")
    assert error.startswith("hisparse bench: error: argument --top-k: 100 entries do not fit "
                            f"the hot buffer of config file {config} (80 slots); pass "
                            "--hot-slots too")


def test_a_wrong_device_row_fails_the_byte_check() -> None:
    backend = get_backend("cpu")
    sizes = benchmarking.SW1Sizes(seq_len=1024, top_k=64, hot_slots=128)
    rng = np.random.default_rng()
    pool = filled_pool(backend, 2)
    assert len({bytes(row) for row in pool.numpy()}) == pool.shape[0], "rows must differ"
    tables, host_rows = benchmarking.build_tables(backend, pool, "extents", 2, sizes, rng)
    trace = benchmarking.ChurnTrace(2, sizes, churn=0.5, rng=rng)
    positions = trace.step()
    out = torch.full((2, 64), -1, dtype=torch.int32)
    kernel, _ = benchmarking.swap_in_kernel(backend)
    kernel(tables, 0, 0, torch.arange(2, dtype=torch.int32), torch.from_numpy(positions),
           torch.tensor([2], dtype=torch.int32), out)
    assert benchmarking.rows_match(tables, host_rows, positions, out)
    poisoned = int(out[1, int(rng.integers(64))])
    tables.device_kv[0, poisoned, int(rng.integers(656))] ^= 0xFF
    assert not benchmarking.rows_match(tables, host_rows, positions, out)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--churns", "2"], "--churns"),
        (["--layouts", "diagonal"], "--layouts"),
        (["--hot-slots", "10"], "--hot-slots"),
        (["--gather-rows", "10000000"], "--gather-rows"),
        (["--device", "no-such-device"], "--device"),
        (["--only", "everything"], "--only"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(
    capsys: pytest.CaptureFixture[str], argv: Sequence[str], named: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *TINY, *argv])
    assert exit_info.value.code == 2
    error = usage_error_line(capsys.readouterr().err, "bench")
    assert error.startswith("hisparse bench: error: argument") and named in error


def test_plot_writes_a_png_or_says_matplotlib_is_missing(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    target = tmp_path / "bench.png"
    code = main(["bench", *TINY, "--only", "copy", "--output", str(tmp_path / "b.json"),
                 "--plot", str(target)])
    assert_plot_written_or_matplotlib_missing(code, target, capsys)


def test_help_carries_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "hisparse bench --device cuda --output benchmarks/results/" in capsys.readouterr().out


@pytest.mark.parametrize(("churn", "residency_map"), [(0.25, "host_row"), (1.0, "host_row"),
                                                     (1.0, "position")])
def test_every_fresh_position_misses_also_after_the_trace_wraps(churn: float,
                                                                residency_map: str) -> None:
    """SW-1 promises churn x top_k misses a step; at churn 1.0 these sizes wrap the trace's
    cycle of fresh positions after 13 steps, and the hot buffer must have evicted them."""
    backend = get_backend("cpu")
    sizes = benchmarking.SW1Sizes(seq_len=1024, top_k=64, hot_slots=128)
    rng = np.random.default_rng()
    batch = 3
    pool = filled_pool(backend, batch)
    mirror = pool.clone()  # seeds the hot buffers like a device copy of the pool would
    tables, host_rows = benchmarking.build_tables(backend, pool, "scattered", batch, sizes, rng,
                                                  mirror=mirror, residency_map=residency_map)
    trace = benchmarking.ChurnTrace(batch, sizes, churn, rng)
    kernel, _ = benchmarking.swap_in_kernel(backend)
    req_slots = torch.arange(batch, dtype=torch.int32)
    num_real = torch.tensor([batch], dtype=torch.int32)
    fresh = round(churn * 64)
    for step in range(40):
        positions = torch.from_numpy(trace.step())
        out = torch.full((batch, 64), -1, dtype=torch.int32)
        before = int(tables.counters[0, 1])
        kernel(tables, 0, 0, req_slots, positions, num_real, out)
        misses = int(tables.counters[0, 1]) - before
        assert misses == batch * (64 if step == 0 else fresh), f"step {step}"
        wrong = benchmarking.wrong_rows(tables, mirror, torch.from_numpy(host_rows), positions,
                                        out)
        assert int(wrong) == 0, f"step {step}"


def small_cpu_cell_inputs(timed_steps: int) -> tuple[Backend, benchmarking.SW1Sizes,
                                                      torch.Tensor, int]:
    """A two-request SW-1 cell small enough for the CPU backend, with a fresh seed."""
    backend = get_backend("cpu")
    sizes = benchmarking.SW1Sizes(seq_len=1024, top_k=64, hot_slots=128, warmup_steps=1,
                                  timed_steps=timed_steps)
    return backend, sizes, filled_pool(backend, 2), int(np.random.default_rng().integers(2**31))


def test_a_cell_checked_every_step_against_a_mirror_and_planned_without_io() -> None:
    """The path benchmarks/swap_in.py takes: the pool's copy checks each step's rows, and the
    skip-IO probe times planning alone."""
    backend, sizes, pool, seed = small_cpu_cell_inputs(timed_steps=3)
    mirror = pool.clone()
    cell = benchmarking.sw1_cell(backend, pool, "extents", 2, 0.5, sizes, seed, mirror=mirror,
                                 skip_io=True)
    assert cell.verified and cell.misses_per_step == 2 * 32
    assert cell.skip_io_step_seconds is not None and cell.skip_io_step_seconds > 0
    # Rows copied on a miss come from the pool: against a mirror that differs from the pool
    # in one byte of every row, they fail the per-step check.
    mirror[:, int(np.random.default_rng().integers(656))] ^= 0xFF
    poisoned = benchmarking.sw1_cell(backend, pool, "extents", 2, 0.5, sizes, seed,
                                     mirror=mirror)
    assert poisoned.misses_per_step == 2 * 32 and not poisoned.verified


def test_a_cell_padded_to_a_larger_batch_capacity() -> None:
    """Padding rows (-1 top-k) cost nothing but time: same misses, rows checked, -1 returned."""
    backend, sizes, pool, seed = small_cpu_cell_inputs(timed_steps=3)
    capacity = int(np.random.default_rng().integers(3, 9))
    cell = benchmarking.sw1_cell(backend, pool, "extents", 2, 0.5, sizes, seed,
                                 mirror=pool.clone(), batch_capacity=capacity)
    assert cell.verified and cell.misses_per_step == 2 * 32
    assert cell.batch_capacity == capacity and cell.to_dict()["batch_capacity"] == capacity
    with pytest.raises(InvalidInputError, match="batch_capacity 1 is smaller than the batch 2"):
        benchmarking.sw1_cell(backend, pool, "extents", 2, 0.5, sizes, seed, batch_capacity=1)


def test_a_cell_with_clean_cache_lines_and_an_unknown_flush_mode() -> None:
    """The read-over flush runs the same cell; an unknown mode is refused before any work."""
    backend, sizes, pool, seed = small_cpu_cell_inputs(timed_steps=2)
    cell = benchmarking.sw1_cell(backend, pool, "extents", 2, 0.5, sizes, seed,
                                 mirror=pool.clone(), flush="read")
    assert cell.verified and cell.misses_per_step == 2 * 32
    with pytest.raises(InvalidInputError, match="unknown cache flush mode 'evict'"):
        benchmarking.sw1_cell(backend, pool, "extents", 2, 0.5, sizes, seed, flush="evict")


@needs_module("triton", "triton")  # _check_tables is the Triton kernels' own check
@pytest.mark.parametrize("residency_map", ["host_row", "position"])
@pytest.mark.parametrize("layout", benchmarking.LAYOUTS)
def test_sw1_tables_are_row_major_and_agree_with_the_hot_buffers(layout: str,
                                                                  residency_map: str) -> None:
    """The Triton kernels index slot_key and page_table as contiguous rows (only the data
    pointer reaches them): a column-major table would hand them other requests' rows, which the
    CPU reference (torch indexing honours strides) would never show. Every seeded slot's key
    (its host row, or its request and position) must be the key `resident` maps back to that
    slot."""
    from hisparse.kernels.swap_in.checks import check_tables

    backend = get_backend("cpu")
    sizes = benchmarking.SW1Sizes(seq_len=1024, top_k=64, hot_slots=128)
    batch = 3
    tables, host_rows = benchmarking.build_tables(backend, filled_pool(backend, batch), layout,
                                                  batch, sizes, np.random.default_rng(),
                                                  residency_map=residency_map)
    for name in ("page_table", "seq_lens", "slot_key", "last_use", "lru_clock", "resident",
                 "counters"):
        assert getattr(tables, name).is_contiguous(), name
    check_tables(tables)
    slot_key = tables.slot_key[0].numpy()
    hot = sizes.hot_slots
    seeded = np.arange(sizes.seq_len - 1 - hot, sizes.seq_len - 1)
    expected = (host_rows[:, seeded] if residency_map == "host_row"
                else np.arange(batch)[:, None] * sizes.seq_len + seeded)
    np.testing.assert_array_equal(slot_key, expected)
    np.testing.assert_array_equal(tables.resident[0, torch.from_numpy(slot_key).long()].numpy(),
                                  np.broadcast_to(np.arange(hot), (batch, hot)))



def test_an_archived_tree_reports_the_commit_it_was_exported_from(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU runs' tree is a `git archive` inside another checkout: its results must name
    the commit export-subst wrote into `archived_commit.txt`, not that checkout's HEAD; a
    checkout keeps the placeholder, and git is asked."""
    repo = pathlib.Path(benchmarking.__file__).resolve().parents[3]
    if not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    relative = benchmarking.ARCHIVED_COMMIT.resolve().relative_to(repo)
    attribute = subprocess.run(["git", "check-attr", "export-subst", str(relative)],
                               capture_output=True, text=True, cwd=repo, check=True).stdout
    assert attribute.strip().endswith("export-subst: set"), attribute
    assert benchmarking.ARCHIVED_COMMIT.read_text().strip() == "$Format:%H$"
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=repo, check=True).stdout.strip()
    assert benchmarking.source_commit() == head
    exported = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / "archived_commit.txt").write_text(exported + "\n")
    monkeypatch.setattr(benchmarking, "ARCHIVED_COMMIT", tmp_path / "archived_commit.txt")
    assert benchmarking.source_commit() == exported


def test_a_benchmarks_environment_records_the_launch_tuning_in_force() -> None:
    """Every benchmark JSON says whether its numbers had PDL (off by default) or another
    tuning: run_environment records the tuning in force when it is called."""
    from hisparse.kernels.swap_in import Tuning, tuning

    assert benchmarking.run_environment("cpu")["tuning"] == dataclasses.asdict(Tuning())
    assert benchmarking.run_environment("cpu")["tuning"]["pdl"] is False
    with tuning(pdl=True, copy_rows=4):
        recorded = benchmarking.run_environment("cpu")["tuning"]
    assert recorded["pdl"] is True and recorded["copy_rows"] == 4
