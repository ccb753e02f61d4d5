"""The side-by-side harness for SGLang's kernel (benchmarks/sglang_peer.py) and the SW-1 cell
hook it uses: source extraction, table translation, the peer path of `sw1_cell`.

The kernel itself runs only where CUDA, nvcc and an SGLang source are all present."""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hisparse.backends.registry import get_backend
from hisparse.errors import InvalidInputError
from hisparse.layout.tables import CacheTables
from hisparse.tools import benchmarking

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sglang_peer  # a benchmark module, not part of the package

_PARAMETERS = ",\n    ".join(f"int64_t {name}" for name in sglang_peer.KERNEL_PARAMETERS)


def fake_source(parameters: str = _PARAMETERS, template: str = sglang_peer.KERNEL_TEMPLATE,
                ) -> str:
    """The layout of SGLang's hisparse.cuh with stand-in bodies."""
    return f"""#include <sgl_kernel/tensor.h>
#include <tvm/ffi/container/tensor.h>

namespace {{

constexpr int WARP_SIZE = 32;

{template}
__global__ void {sglang_peer.KERNEL_NAME}(
    {parameters}) {{
  int device_side_marker = 1;
}}

template <int BLOCK_SIZE, int NUM_TOP_K, int HOT_BUFFER_SIZE, bool IsMLA>
void load_cache_to_device_buffer(tvm::ffi::TensorView top_k_tokens) {{
  host_side_marker();
}}

}}  // namespace
"""


def test_device_code_keeps_the_kernel_and_drops_the_host_launcher() -> None:
    code = sglang_peer.device_code(fake_source())
    assert "device_side_marker" in code and "constexpr int WARP_SIZE" in code
    assert "host_side_marker" not in code and "tvm" not in code and "sgl_kernel" not in code
    assert code.startswith("#include <cuda_runtime.h>")
    assert code.count("namespace {") == 1 and code.rstrip().endswith("}  // namespace")
    assert sglang_peer.kernel_parameters(fake_source()) == sglang_peer.KERNEL_PARAMETERS


def test_another_kernel_signature_is_refused_not_guessed() -> None:
    newer = _PARAMETERS + ",\n    int64_t* miss_src_out"
    with pytest.raises(InvalidInputError, match=r"0\.5\.10\.post1.*miss_src_out"):
        sglang_peer.device_code(fake_source(parameters=newer))
    with pytest.raises(InvalidInputError, match="not the one hisparse's launcher knows"):
        sglang_peer.device_code(fake_source(template="template <int BLOCK_SIZE>"))
    with pytest.raises(InvalidInputError, match="not found"):
        sglang_peer.device_code("namespace { }")


def test_missing_source_says_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"does not exist.*hisparse\.cuh"):
        sglang_peer.find_source(str(tmp_path / "absent.cuh"))


def test_release_comes_from_the_dist_info_beside_the_package(tmp_path: Path) -> None:
    source = tmp_path / "sglang" / "jit_kernel" / "csrc" / "hisparse.cuh"
    source.parent.mkdir(parents=True)
    source.write_text(fake_source())
    assert sglang_peer.source_version(source) == "unknown"
    (tmp_path / "sglang-0.5.10.post1.dist-info").mkdir()
    assert sglang_peer.source_version(source) == "0.5.10.post1"
    record = sglang_peer.describe(source, 1024)
    assert record["kernel"] == "sglang-0.5.10.post1" and record["block_size"] == 1024
    assert record["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert sglang_peer.find_source(str(source)) == source


def small_cell_inputs(rng: np.random.Generator) -> tuple[benchmarking.SW1Sizes, torch.Tensor]:
    sizes = benchmarking.SW1Sizes(seq_len=1024, top_k=64, hot_slots=128, warmup_steps=1,
                                  timed_steps=2)
    pool = get_backend("cpu").alloc_host(2 * sizes.seq_len * 656).view(-1, 656)
    benchmarking.fill_pool(pool)
    return sizes, pool


@pytest.mark.parametrize("residency_map", ["host_row", "position"])
@pytest.mark.parametrize("layout", benchmarking.LAYOUTS)
def test_peer_tables_hold_the_same_tokens_rows_and_lru(layout: str, residency_map: str) -> None:
    """Every slot's token maps back to the key (host row, or request and position) hisparse
    has in that slot, after some steps of hisparse's own kernel have moved the LRU and
    refilled slots."""
    rng = np.random.default_rng()
    sizes, pool = small_cell_inputs(rng)
    backend = get_backend("cpu")
    tables, host_rows = benchmarking.build_tables(backend, pool, layout, 2, sizes, rng,
                                                  residency_map=residency_map)
    kernel, _ = benchmarking.swap_in_kernel(backend)
    trace = benchmarking.ChurnTrace(2, sizes, float(rng.uniform(0.1, 1.0)), rng)
    req_slots = torch.arange(2, dtype=torch.int32)
    num_real = torch.tensor([2], dtype=torch.int32)
    out = torch.full((2, sizes.top_k), -1, dtype=torch.int32)
    for _ in range(int(rng.integers(1, 4))):
        kernel(tables, 0, 0, req_slots, torch.from_numpy(trace.step()), num_real, out)
    peer = sglang_peer.peer_tables(tables, host_rows)
    hot = sizes.hot_slots
    tokens = peer.buffer_tokens.numpy()
    assert peer.buffer_tokens.shape == (2, hot + 1) and peer.lru.dtype == torch.int16
    # The kernel takes one row stride per table: every table must be row-major.
    for table in (peer.buffer_tokens, peer.buffer_locs, peer.host_locs, peer.lru):
        assert table.is_contiguous()
    for b in range(2):
        assert tokens[b, hot] == sizes.seq_len - 1  # the newest slot
        keys = (host_rows[b, tokens[b, :hot]] if residency_map == "host_row"
                else b * sizes.seq_len + tokens[b, :hot])
        assert (keys == tables.slot_key[0, b].numpy()).all()
    # The same order as hisparse's stamps, by an independent sort of (last use, slot id).
    stamps = tables.last_use[0].tolist()
    for b in range(2):
        expected = sorted(range(hot), key=lambda s, row=stamps[b]: (row[s], s))
        assert peer.lru[b].tolist() == expected
    expected_locs = np.arange(2)[:, None] * (hot + 1) + np.arange(hot + 1)[None, :]
    assert (peer.buffer_locs.numpy() == expected_locs).all()
    assert torch.equal(peer.host_locs, torch.from_numpy(host_rows))


class CountlessKernel:
    """hisparse's CPU kernel with its counters hidden: a peer that counts nothing."""

    def __init__(self, tables: CacheTables, corrupt: bool) -> None:
        self.kernel, _ = benchmarking.swap_in_kernel(get_backend("cpu"))
        self.corrupt = corrupt

    def __call__(self, tables: CacheTables, *args: object) -> None:
        counters = tables.counters.clone()
        self.kernel(tables, *args)
        tables.counters.copy_(counters)
        if self.corrupt:  # one returned row's bytes flipped
            out = args[-1]
            tables.device_kv[0, int(out[0, 0])] ^= 0xFF


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_peer_kernel_is_timed_on_the_same_cell_and_checked_byte_for_byte(
        corrupt: bool) -> None:
    rng = np.random.default_rng()
    sizes, pool = small_cell_inputs(rng)
    churn = float(rng.choice([0.25, 0.5, 1.0]))
    cell = benchmarking.sw1_cell(
        get_backend("cpu"), pool, "scattered", 2, churn, sizes, int(rng.integers(2**31)),
        mirror=pool.clone(),
        kernel_for=lambda tables, host_rows: CountlessKernel(tables, corrupt))
    assert cell.misses_counted_by == "trace"
    assert cell.misses_per_step == 2 * round(churn * sizes.top_k)
    assert cell.verified is not corrupt
    with pytest.raises(InvalidInputError, match="pass one of skip_io and kernel_for"):
        benchmarking.sw1_cell(get_backend("cpu"), pool, "scattered", 2, churn, sizes,
                              skip_io=True, kernel_for=lambda tables, host_rows: None)


def test_no_flush_leaves_the_caches_alone() -> None:
    flusher = benchmarking.CacheFlusher(torch.device("cpu"), "none")
    flusher.flush()
    assert flusher.scratch is None and flusher.mode == "none"


def _peer_unavailable() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if shutil.which("nvcc") is None:
        return "needs nvcc (the SGLang kernel is CUDA source)"
    try:
        sglang_peer.find_source()
    except InvalidInputError as error:
        return str(error)
    return None


@pytest.mark.skipif(_peer_unavailable() is not None, reason=str(_peer_unavailable()))
@pytest.mark.parametrize("layout", benchmarking.LAYOUTS)
def test_sglang_kernel_returns_the_right_rows_on_sw1(layout: str, tmp_path: Path) -> None:
    """SGLang's kernel, built and driven by the harness, on a small SW-1 cell: every step's
    rows equal the host rows byte for byte (so the translated tables are right)."""
    backend = get_backend("cuda")
    rng = np.random.default_rng()
    sizes = benchmarking.SW1Sizes(seq_len=16384, top_k=256, hot_slots=512, warmup_steps=2,
                                  timed_steps=3)
    library = sglang_peer.load_library(sglang_peer.compile_library(
        sglang_peer.find_source(), sizes.top_k, sizes.hot_slots, tmp_path))
    with benchmarking.sw1_pool(backend, 3, sizes) as pool:
        mirror = pool.cuda()
        churn = float(rng.choice([0.05, 0.2, 1.0]))
        cell = benchmarking.sw1_cell(
            backend, pool, layout, 3, churn, sizes, int(rng.integers(2**31)), mirror=mirror,
            kernel_for=lambda tables, host_rows: sglang_peer.PeerSwapIn(
                library, backend, tables, host_rows))
    assert cell.verified
    assert cell.misses_per_step == 3 * round(churn * sizes.top_k)
