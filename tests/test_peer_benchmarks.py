"""The newest peers' harness (benchmarks/peers.py, peers_sw2.py, sglang_ops.py, vllm_peer.py)
on a CPU: argument checks, the peers' state built from hisparse's tables, the byte check (SW-2's
`sglang_step` column: tests/test_sglang_spec_step.py). The peers' kernels themselves run only
where CUDA and the user's peer sources are present (scripts/gpu-run)."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from hisparse.backends.registry import get_backend
from hisparse.errors import InvalidInputError
from hisparse.tools import benchmarking
from hisparse.tools.sw1_steps import LauncherSwapIn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import peers  # benchmark modules, not part of the package
import peers_sw2
import peers_v4
import sglang_ops
import vllm_peer

BINDINGS = """
STABLE_TORCH_LIBRARY_FRAGMENT(_C_cache_ops, ops) {
  ops.def(
      "other_op(Tensor x) -> ()");
  ops.def(
      "hisparse_resolve_residency(Tensor host_cache,"
      "                 Tensor! hot_cache,"
      "                 int max_union_rows,"
      "                 Tensor? num_valid_rows=None) -> ()");
  ops.def(
      "hisparse_gather_compact(Tensor host_cache,"
      "                        Tensor miss_counts) -> ()");
}
"""


def test_op_schemas_are_read_from_the_bindings_and_registered_under_our_namespace() -> None:
    schemas = vllm_peer.op_schemas(BINDINGS)
    assert schemas["hisparse_resolve_residency"] == (
        "hisparse_resolve_residency(Tensor host_cache, Tensor! hot_cache, int max_union_rows, "
        "Tensor? num_valid_rows=None) -> ()")
    assert set(schemas) == set(vllm_peer.OPS)
    unit = vllm_peer.registration_source(schemas)
    assert f"STABLE_TORCH_LIBRARY({vllm_peer.NAMESPACE}, m)" in unit
    assert unit.count("TORCH_BOX(&hisparse_") == 2 and "other_op" not in unit
    with pytest.raises(InvalidInputError, match="hisparse_gather_compact"):
        vllm_peer.op_schemas(BINDINGS.replace("hisparse_gather_compact", "renamed"))


def test_vllm_source_is_found_or_refused_with_the_way_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"lacks csrc/hisparse_kernels\.cu"):
        vllm_peer.find_source(str(tmp_path))
    for name in vllm_peer.SOURCE_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(BINDINGS)
    (tmp_path / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.34.0\n")
    assert vllm_peer.find_source(str(tmp_path)) == tmp_path
    assert vllm_peer.describe(tmp_path)["kernel"] == "vllm-0.34.0"


def test_host_pages_follow_the_rows_and_refuse_a_scattered_pool() -> None:
    rng = np.random.default_rng()
    pages = rng.permutation(12)[:8].reshape(2, 4)  # pool pages of 64 rows, random order
    host_rows = (pages[:, :, None] * 64 + np.arange(64)).reshape(2, 256)
    got = vllm_peer.host_pages(host_rows, 64)
    assert (got == pages + 1).all()  # page 0 is vLLM's null page
    one = vllm_peer.host_pages(host_rows, 1)
    assert (one == host_rows + vllm_peer.NULL_PAGE_ROWS).all()
    with pytest.raises(InvalidInputError, match="64-token pages"):
        vllm_peer.host_pages(rng.permutation(512).reshape(2, 256), 64)


@pytest.mark.parametrize("layout", benchmarking.LAYOUTS)
def test_vllm_state_holds_hisparses_tokens_rows_and_lru(layout: str) -> None:
    """After hisparse's own kernel has moved some slots, each vLLM hot slot names (by vLLM host
    row) the token hisparse's slot holds, and holds that token's bytes."""
    rng = np.random.default_rng()
    sizes = benchmarking.SW1Sizes(seq_len=2048, top_k=64, hot_slots=128, extent_tokens=64)
    backend = get_backend("cpu")
    pool = backend.alloc_host(2 * sizes.seq_len * 656).view(-1, 656)
    benchmarking.fill_pool(pool)
    tables, host_rows = benchmarking.build_tables(backend, pool, layout, 2, sizes, rng,
                                                  mirror=pool.clone())
    kernel, _ = benchmarking.swap_in_kernel(backend)
    trace = benchmarking.ChurnTrace(2, sizes, 0.5, rng)
    out = torch.full((2, sizes.top_k), -1, dtype=torch.int32)
    for _ in range(2):
        kernel(tables, 0, 0, torch.arange(2, dtype=torch.int32),
               torch.from_numpy(trace.step()), torch.tensor([2], dtype=torch.int32), out)
    keys = tables.slot_key[0].clone()
    block = 1 if layout == "scattered" else 64
    state = vllm_peer.vllm_tables(tables, host_rows, block)
    hot = sizes.hot_slots
    assert (state.device_global_indices.long() - vllm_peer.NULL_PAGE_ROWS == keys.long()).all()
    rows = state.hot_cache.reshape(-1, 656)
    assert torch.equal(rows, pool[keys.reshape(-1).long()])
    assert state.hot_block_table.shape == (2, hot // 64)
    assert (state.source_block_table.numpy() == vllm_peer.host_pages(host_rows, block)).all()
    for name in ("hot_block_table", "source_block_table", "device_global_indices", "lru_slots"):
        assert getattr(state, name).is_contiguous(), name  # vLLM's op refuses other layouts
    stamps = tables.last_use[0].tolist()
    for b in range(2):
        assert state.lru_slots[b].tolist() == sorted(range(hot), key=lambda s: (stamps[b][s], s))


def test_spec_state_is_sized_and_reset_as_sglangs_manager_does() -> None:
    ops = types.SimpleNamespace(HiSparseSpecState=types.SimpleNamespace)
    hot, S, K, R = 4096, 3, 2048, 3
    state = sglang_ops.spec_state(ops, R, hot, S, K, torch.device("cpu"))
    assert state.cache_index.shape == (R, 2, 8192)
    assert state.scratch_locs.shape == (R, max(1024, S * K - hot))
    assert state.scratch_state.shape == (R + 1, 5 * S * K)
    assert (state.scratch_state[0] == 0).all() and (state.scratch_state[1:] == -1).all()
    state.cache_policy.fill_(7)
    state.scratch_state[0].fill_(5)
    sglang_ops.reset_request(state, 1, hot)
    tokens = torch.arange(hot)
    bank = state.cache_index[1, 0]
    where = (tokens * 2654435761) % 8192
    # Every seeded entry that no later token overwrote packs (slot t, token t).
    last = {int(w): int(t) for t, w in zip(tokens, where, strict=True)}
    for w, t in last.items():
        assert int(bank[w]) == (t << 32) | t
    assert int((bank != -1).sum()) == len(last) and (state.cache_index[1, 1] == -1).all()
    assert (state.cache_index[0] == -1).all()  # other requests untouched
    assert int(state.cache_policy[0, 1]) == 0 and (state.cache_policy[2] == 0).all()
    assert int(state.cache_policy[0, 0]) == 7 and (state.cache_policy[1] == 7).all()
    assert state.scratch_state[0, 1::R][:4].tolist() == [0, 0, 0, 0]
    assert state.scratch_state[0, 0] == 5


def test_peer_byte_check_counts_wrong_and_missing_rows() -> None:
    rng = np.random.default_rng()
    truth = torch.randint(0, 256, (300, 16), dtype=torch.uint8)
    positions = torch.from_numpy(rng.integers(0, 300, (2, 3, 40)).astype(np.int32))
    positions[0, 0, :5] = -1
    rows = torch.zeros(2 * 3 * 40, 16, dtype=torch.uint8)
    out = torch.randperm(rows.shape[0]).to(torch.int32).view(2, 3, 40)
    rows[out.reshape(-1).long()] = truth[positions.reshape(-1).clamp(min=0).long()]
    assert peers_sw2.peer_wrong(rows, out, positions, truth) == 0
    rows[int(out[1, 2, 7])] ^= 1
    out[0, 1, 3] = -1
    assert peers_sw2.peer_wrong(rows, out, positions, truth) == 2
    out[0, 0, 0] = -1  # an unselected position's output is not checked
    assert peers_sw2.peer_wrong(rows, out, positions, truth) == 2


def test_arguments_are_checked_before_anything_runs() -> None:
    args = peers.parse_args(["--table", "sw2", "--peers", "vllm", "--tokens", "2", "4"])
    assert args.peers == ("vllm",) and args.tokens == [2, 4] and args.table == "sw2"
    assert peers.parse_args(["--build-only", "--peers", ""]).peers == ()
    for bad in (["--table", "sw1", "--peers", "trtllm"], ["--peers", "vllm"],
                ["--table", "sw1", "--layouts", "striped"], ["--table", "sw1", "--steps", "0"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


def test_cell_correctness_covers_every_kernel_of_both_tables() -> None:
    assert peers.cell_correct({"hisparse": {"correct": True}, "vllm": {"error": "refused"}})
    assert not peers.cell_correct({"hisparse": {"correct": True}, "sglang": {"correct": False}})
    assert peers.cell_correct({"wrong_rows": {"hisparse": 0, "sglang": 0}})
    assert not peers.cell_correct({"wrong_rows": {"hisparse": 0, "vllm": 3}})


def test_sglang_root_is_checked_and_its_dependencies_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="lacks sglang/kernels/ops/kvcache"):
        sglang_ops.find_root(str(tmp_path))
    for name in sglang_ops.REQUIRED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    info = tmp_path / "sglang-0.5.23.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Name: sglang\nVersion: 0.5.23\n")
    assert sglang_ops.find_root(str(tmp_path)) == tmp_path
    assert sglang_ops.version(tmp_path) == "0.5.23"
    if any(sglang_ops.importlib.util.find_spec(m) is None for m in ("tvm_ffi", "msgspec")):
        with pytest.raises(InvalidInputError, match=r"apache-tvm-ffi|msgspec"):
            sglang_ops.load(tmp_path, tmp_path / "build")


class TraceCountedPeer:
    """hisparse's CPU kernel with its counters hidden (a peer that counts nothing), one
    returned row flipped on request."""

    def __init__(self, corrupt: bool) -> None:
        self.kernel, _ = benchmarking.swap_in_kernel(get_backend("cpu"))
        self.corrupt = corrupt

    def __call__(self, tables: object, *args: object) -> None:
        counters = tables.counters.clone()
        self.kernel(tables, *args)
        tables.counters.copy_(counters)
        if self.corrupt:
            tables.device_kv[0, int(args[-1][0, 0])] ^= 0xFF


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_sw1_cell_times_counts_and_checks_each_kernel(corrupt: bool) -> None:
    """The cell loop on the CPU backend: hisparse's own counters and a peer's trace count
    agree on churn x K misses a row, eager calls are timed, a flipped row fails the cell."""
    rng = np.random.default_rng()
    sizes = benchmarking.SW1Sizes(seq_len=1024, top_k=64, hot_slots=128)
    backend = get_backend("cpu")
    rows = backend.alloc_host(2 * sizes.seq_len * 656).view(-1, 656)
    benchmarking.fill_pool(rows)
    pool = peers.Pool(rows, rows, rows.clone())
    args = peers.parse_args(["--table", "sw1", "--warmup", "1", "--steps", "3",
                             "--eager-steps", "2", "--seed", str(int(rng.integers(2**31)))])
    churn = float(rng.choice([0.25, 0.5]))
    own = peers.sw1_cell(pool, "scattered", 2, churn, args, lambda tables, host_rows: (
        LauncherSwapIn(backend), lambda: int(tables.counters[0, 1])),
        backend=backend, sizes=sizes)
    peer = peers.sw1_cell(pool, "scattered", 2, churn, args, lambda tables, host_rows: (
        TraceCountedPeer(corrupt), lambda: None), backend=backend, sizes=sizes)
    expected = 2 * round(churn * sizes.top_k)
    assert own["misses_per_step"] == expected and own["misses_counted_by"] == "kernel counters"
    assert peer["misses_per_step"] == expected and peer["misses_counted_by"] == "trace"
    assert own["correct"] and peer["correct"] is not corrupt
    assert own["eager_host_us"] > 0 and own["device_us"] > 0


def test_the_launcher_swap_in_returns_the_kernels_rows_and_binds_once_per_buffers() -> None:
    """The peer tables time hisparse through the engine's bound launcher: over the same
    tables and trace it must return what the checked kernel function returns, and bind once
    for one set of batch buffers and again when the buffers change."""
    seed = int(np.random.default_rng().integers(2**31))
    sizes = benchmarking.SW1Sizes(seq_len=512, top_k=32, hot_slots=64)
    backend = get_backend("cpu")
    rows = backend.alloc_host(3 * sizes.seq_len * 656).view(-1, 656)
    benchmarking.fill_pool(rows)
    made: list[int] = []

    def counted(*args: object, **options: object) -> object:
        made.append(1)
        return backend.kernels.swap_in_launcher(*args, **options)

    launcher = LauncherSwapIn(types.SimpleNamespace(
        kernels=types.SimpleNamespace(swap_in_launcher=counted)))
    results = []
    for kernel in (benchmarking.swap_in_kernel(backend)[0], launcher):
        tables, _ = benchmarking.build_tables(backend, rows, "scattered", 3, sizes,
                                              np.random.default_rng(seed))
        trace = benchmarking.ChurnTrace(3, sizes, 0.5, np.random.default_rng(seed))
        req_slots = torch.arange(3, dtype=torch.int32)
        num_real = torch.tensor([3], dtype=torch.int32)
        out = torch.full((3, sizes.top_k), -1, dtype=torch.int32)
        steps = []
        for step in range(5):
            if step == 3:  # new batch buffers: the launcher must bind to these
                out = out.clone()
            kernel(tables, 0, 0, req_slots, torch.from_numpy(trace.step()).contiguous(),
                   num_real, out)
            steps.append(tables.device_kv[0][out.clamp(min=0).long()].clone())
        results.append(steps)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert len(made) == 2, made


def test_v4_pages_hold_each_entry_as_sglang_addresses_it() -> None:
    """`paged` puts entry i's 576 value bytes at page*37440 + slot*576 and its 8 scale bytes at
    page*37440 + 36864 + slot*8 (SGLang's get_pointer_paged); `unpaged_rows` reads them back."""
    count = int(np.random.default_rng().integers(65, 300))
    rows = torch.randint(0, 256, (count, peers_v4.ENTRY_BYTES), dtype=torch.uint8)
    flat = peers_v4.paged(rows)
    assert peers_v4.PAGE_BYTES == 37440 and flat.numel() == -(-count // 64) * 37440
    entry = int(np.random.default_rng().integers(count))
    page, slot = divmod(entry, 64)
    start = page * 37440
    assert torch.equal(flat[start + slot * 576: start + slot * 576 + 576], rows[entry, :576])
    assert torch.equal(flat[start + 36864 + slot * 8: start + 36864 + slot * 8 + 8],
                       rows[entry, 576:])
    locs = torch.randint(0, count, (3, 5))
    assert torch.equal(peers_v4.unpaged_rows(flat, locs), rows[locs])


class PagedPeer:
    """A stand-in for SGLang's V4 kernel on the CPU: hisparse's swap-in, then its device rows
    repacked into pages, read back through `device_rows` (the byte check's reader)."""

    def __init__(self, backend: object, corrupt: bool) -> None:
        self.kernel, self.corrupt = benchmarking.swap_in_kernel(backend)[0], corrupt
        self.pages = torch.empty(0, dtype=torch.uint8)

    def __call__(self, tables: object, *args: object, **options: object) -> None:
        self.kernel(tables, *args, **options)
        self.pages = peers_v4.paged(tables.device_kv[0])
        if self.corrupt:  # one scale byte of the first returned entry
            entry = int(args[-1][0, 0])
            self.pages[(entry // 64) * peers_v4.PAGE_BYTES + peers_v4.SCALES_AT
                       + (entry % 64) * 8] ^= 0xFF

    def device_rows(self, locs: torch.Tensor) -> torch.Tensor:
        return peers_v4.unpaged_rows(self.pages, locs)


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_v4_cell_checks_a_peers_rows_in_its_own_page_layout(corrupt: bool) -> None:
    """A kernel keeping its own device layout is byte-checked through its reader: a flipped
    scale byte (outside the 576 value bytes) fails the cell."""
    rng = np.random.default_rng()
    sizes = benchmarking.SW1Sizes(seq_len=1024, top_k=64, hot_slots=128,
                                  row_bytes=peers_v4.ENTRY_BYTES)
    backend = get_backend("cpu")
    rows = backend.alloc_host(2 * sizes.seq_len * sizes.row_bytes).view(-1, sizes.row_bytes)
    benchmarking.fill_pool(rows)
    pool = peers.Pool(rows, rows, rows.clone())
    args = peers.parse_args(["--table", "sw1-v4", "--warmup", "1", "--steps", "2",
                             "--eager-steps", "1", "--seed", str(int(rng.integers(2**31)))])
    cell = peers.sw1_cell(pool, "extents", 2, 0.5, args, lambda tables, host_rows: (
        PagedPeer(backend, corrupt), lambda: None), backend=backend, sizes=sizes)
    assert cell["correct"] is not corrupt and cell["misses_per_step"] == 2 * 32


def test_padded_v4_entries_hold_each_entry_then_zeros_and_swap_in_byte_exact() -> None:
    """`--padded-entries`: hisparse over 592-byte rows (the 584-byte entries padded to a
    16-byte multiple) returns, in a checked cell, rows whose first 584 bytes are the
    entries; the padding is zero on the host and in the mirror."""
    rng = np.random.default_rng()
    backend = get_backend("cpu")
    sizes = benchmarking.SW1Sizes(seq_len=1024, top_k=64, hot_slots=128,
                                  row_bytes=peers_v4.ENTRY_BYTES, extent_tokens=512)
    rows = backend.alloc_host(2 * sizes.seq_len * sizes.row_bytes).view(-1, sizes.row_bytes)
    benchmarking.fill_pool(rows)
    padded = peers_v4.padded_pool(peers.Pool(rows, rows, rows.clone()), backend)
    assert peers_v4.PADDED_ENTRY_BYTES == 592 and padded.rows.shape == (rows.shape[0], 592)
    assert torch.equal(padded.rows[:, :584], rows) and not padded.rows[:, 584:].any()
    assert torch.equal(padded.mirror, padded.rows)
    args = peers.parse_args(["--table", "sw1-v4", "--padded-entries", "--warmup", "1",
                             "--steps", "2", "--eager-steps", "1",
                             "--seed", str(int(rng.integers(2**31)))])
    wide = dataclasses.replace(sizes, row_bytes=592)
    cell = peers.sw1_cell(padded, "extents", 2, 0.5, args, lambda tables, host_rows: (
        LauncherSwapIn(backend), lambda: int(tables.counters[0, 1])), backend=backend,
        sizes=wide)
    assert cell["correct"] and cell["misses_per_step"] == 2 * 32
    with pytest.raises(SystemExit):
        peers.parse_args(["--table", "sw1", "--padded-entries"])  # V4's entries only
