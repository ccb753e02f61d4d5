"""SW-2's `sglang_step` column (benchmarks/sglang_spec_step.py, peers_sw2.py) on a CPU: SGLang's
own verify-step methods, read from a copy of SGLang 0.5.23 where one is present (the user's
.peer/sglang-0.5.23 or $HISPARSE_SGLANG_ROOT; skipped without one, as in CI), run over CPU
stand-ins of its two kernels (plain index copies, or for the row copy its own Triton kernel in
Triton's interpreter) and of its spec swap-in, their tables checked against SGLang's semantics
written out per token; and the column's refusals."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from hisparse.errors import InvalidInputError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import peers_sw2  # benchmark modules, not part of the package
import sglang_ops
import sglang_spec_step

REPO = Path(__file__).resolve().parent.parent


def sglang_copy() -> Path:
    """A copy of SGLang 0.5.23 holding the verify step's files: the user's .peer copy or
    $HISPARSE_SGLANG_ROOT (CI has neither)."""
    for given in (os.environ.get(sglang_ops.ENV_VAR), REPO / ".peer" / "sglang-0.5.23"):
        if given and Path(given).is_dir() and not sglang_spec_step.missing_files(Path(given)):
            return Path(given)
    pytest.skip("no copy of SGLang 0.5.23 with sglang_ops.STEP_FILES (.peer/sglang-0.5.23 or "
                f"${sglang_ops.ENV_VAR}): SGLang's own step methods are not vendored here")


class HostStream:
    def wait_stream(self, other: object) -> None:
        pass


class HostEvent:
    def __init__(self) -> None:
        self.recorded = self.waited = 0

    def record(self, stream: object = None) -> None:
        self.recorded += 1

    def wait(self, stream: object = None) -> None:
        self.waited += 1


class HostDeviceModule:
    """SGLang's `device_module` on the CPU: streams and events that order nothing."""

    Stream = HostStream
    Event = HostEvent

    @staticmethod
    def current_stream() -> HostStream:
        return HostStream()

    @staticmethod
    def stream(stream: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def cpu_kernels(tensors: dict[int, torch.Tensor], calls: list[str],
                row_copy: Callable[..., None] | None = None) -> sglang_spec_step.Kernels:
    """SGLang's two kernels as plain index copies (or its own row copy, `row_copy`),
    reaching the rows through the pointer tables its pools hand them (`tensors`: data pointer
    -> tensor), checking the other arguments."""

    def copy(data_ptrs: torch.Tensor, strides: torch.Tensor, dst: torch.Tensor,
             src: torch.Tensor, count: int, upper: int, config: dict) -> None:
        rows = tensors[int(data_ptrs[0])]
        assert data_ptrs.numel() == 1 and int(strides[0]) == rows.shape[1]
        assert count <= 256 and upper >= count and upper & (upper - 1) == 0
        assert config["byte_tiles"] == -(-rows.shape[1] // 128)
        if row_copy is not None:
            row_copy(data_ptrs, strides, dst, src, count, upper, config)
        else:
            rows[dst[:count].long()] = rows[src[:count].long()].clone()
        calls.append("copy")

    def backup(ptr_dst: torch.Tensor, indices_dst: torch.Tensor, ptr_src: torch.Tensor,
               indices_src: torch.Tensor, *, cache_src_stride_bytes: int,
               cache_dst_stride_bytes: int, element_size: int, page_size: int) -> None:
        host, device = tensors[int(ptr_dst[0])], tensors[int(ptr_src[0])]
        assert cache_src_stride_bytes == cache_dst_stride_bytes == element_size == host.shape[1]
        assert page_size == 64 and indices_dst.shape == indices_src.shape
        host[indices_dst.long()] = device[indices_src.long()]
        calls.append("backup")

    return sglang_spec_step.Kernels(HostDeviceModule, copy, backup, lambda **sizes: True)


def interpreted_sglang_copy(root: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """SGLang's own `copy_all_layer_kv_cache_func` (its cache_move.py, imported alone with a
    stand-in for the one serving utility it reads), run on the CPU by Triton's interpreter."""
    pytest.importorskip("triton", reason="triton runs SGLang's row copy")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when its kernels are decorated
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_cpu = lambda: False  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)
    spec = importlib.util.spec_from_file_location(
        "sglang_cache_move_interpreted", root / "sglang/kernels/ops/kvcache/cache_move.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.copy_all_layer_kv_cache_func


def register_pool_rows(tensors: dict[int, torch.Tensor], monkeypatch: pytest.MonkeyPatch
                       ) -> None:
    """Let `cpu_kernels` find every tensor the step's pool stand-ins point their tables at."""
    for name in ("device_pool", "host_pool"):
        original = getattr(sglang_spec_step, name)

        def wrapped(rows: torch.Tensor, *args: object, _original: object = original) -> object:
            tensors[rows.data_ptr()] = rows
            return _original(rows, *args)

        monkeypatch.setattr(sglang_spec_step, name, wrapped)


def expected_step(before: dict[str, torch.Tensor], rtdb: torch.Tensor, seq_lens: list[int],
                  accepted: list[int], S: int, hot: int, spare_first: int
                  ) -> dict[str, torch.Tensor]:
    """The tables after one verify step, from SGLang's semantics written out per token:
    prepare binds verify token s of request b (position L + s) to column H + 1 + s and maps
    its KV slot 1 + b S + s to that column's row; commit keeps an accepted token in a
    persistent column (its position if below H, else column H for the newest accepted one)
    by copying its row there and naming it in the tables and mapping (other slots map to 0),
    and backs every verify row up to the request's host page (row spare_first + 64 b + s)."""
    got = {name: tensor.clone() for name, tensor in before.items()}
    for b, (length, count) in enumerate(zip(seq_lens, accepted, strict=True)):
        for s in range(S):
            verify_row, position = int(rtdb[b, hot + 1 + s]), length + s
            got["tokens"][b, hot + 1 + s], got["locs"][b, hot + 1 + s] = position, verify_row
            kept = s < count and (position < hot or s == count - 1)
            got["mapping"][1 + b * S + s] = 0
            if kept:
                column = min(position, hot)
                destination = int(rtdb[b, column])
                got["rows"][destination] = before["rows"][verify_row]
                got["tokens"][b, column], got["locs"][b, column] = position, destination
                got["mapping"][1 + b * S + s] = destination
            got["host"][spare_first + 64 * b + s] = before["rows"][verify_row]
    return got


class TableSpec(types.SimpleNamespace):
    """A spec peer's tables; calling it runs its `swap_in` (the kernel's stand-in)."""

    def __call__(self, top_k: torch.Tensor) -> None:
        self.swap_in(top_k)


def spec_tables(rng: np.random.Generator, seq_lens: list[int], hot: int, width: int
                ) -> TableSpec:
    """A spec peer's tables as SGLang's admission leaves them (token t in column t, the newest
    token in column H, each column's allocated row), hot rows then rotated to scratch rows on
    some columns as its kernel does, random bytes everywhere."""
    B, P = len(seq_lens), sglang_spec_step.PAGE
    tokens = torch.full((B, hot + P), -1, dtype=torch.int32)
    tokens[:, :hot] = torch.arange(hot, dtype=torch.int32)
    for b, length in enumerate(seq_lens):
        tokens[b, hot] = length - 1
    slots = B * (hot + P)
    locs = torch.from_numpy(rng.permutation(slots).astype(np.int32)).view(B, hot + P)
    prompt_rows = max(seq_lens) * B
    host_locs = torch.full((B, max(seq_lens) + P), -1, dtype=torch.int64)
    for b, length in enumerate(seq_lens):
        host_locs[b, :length] = torch.from_numpy(rng.permutation(prompt_rows)[:length])
    return TableSpec(
        tokens=tokens, locs=locs, host_locs=host_locs, hot=hot, out=None,
        slots=torch.arange(B, dtype=torch.int64),
        device=torch.randint(0, 256, (slots + 2 * B * hot, width), dtype=torch.uint8),
        host_cache=torch.randint(0, 256, (prompt_rows + B * P, width), dtype=torch.uint8))


@pytest.mark.parametrize("copy", ["index copy", "SGLang's Triton copy, interpreted"])
@pytest.mark.parametrize("S", [2, 3, 4])
def test_sglangs_own_prepare_and_commit_leave_the_tables_its_semantics_give(
        S: int, copy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's prepare_verify and commit_accept_tokens (its own source) over the step peer's
    stand-ins, its backup an index copy and its row copy one too or its own Triton kernel
    (interpreted): after each of a few steps with random accept counts, the tokens and
    locations the spec kernel reads, the mapping, the device rows and the host rows match the
    per-token expectation; the verify binding is in place while the swap-in runs; the copy
    precedes the backup, which the step waits for."""
    rng = np.random.default_rng()
    hot, width = 16, 656
    seq_lens = [hot + int(rng.integers(0, 40)), int(rng.integers(1, hot - S)), hot - 1, hot - 2]
    spec = spec_tables(rng, seq_lens, hot, width)
    tensors: dict[int, torch.Tensor] = {}
    register_pool_rows(tensors, monkeypatch)
    calls: list[str] = []
    root = sglang_copy()
    row_copy = interpreted_sglang_copy(root, monkeypatch) if copy.startswith("SGLang") else None
    code = sglang_spec_step.load_step(root, cpu_kernels(tensors, calls, row_copy))
    spare_first = spec.host_cache.shape[0] - len(seq_lens) * 64
    step = sglang_spec_step.SpecStepPeer(spec, code, seq_lens, S, spare_first)
    rtdb = spec.locs.clone().long()  # each column's row as allocated, before any rotation
    mapping = step.coordinator.token_to_kv_pool_allocator.full_to_hisparse_device_index_mapping
    for b, length in enumerate(seq_lens):  # each request's own host page after the prompt
        assert spec.host_locs[b, length: length + 64].tolist() == list(
            range(spare_first + 64 * b, spare_first + 64 * b + 64))
    bound: list[bool] = []

    def swap_in(top_k: torch.Tensor) -> None:  # the verify binding, as the kernel would see it
        columns = hot + 1 + torch.arange(S)
        verify = 1 + torch.arange(len(seq_lens) * S).view(-1, S)
        bound.append(bool(
            (spec.tokens[:, columns] == torch.tensor(seq_lens)[:, None] + torch.arange(S)).all()
            and (spec.locs[:, columns].long() == rtdb[:, columns]).all()
            and (mapping[verify] == rtdb[:, columns]).all()))

    spec.swap_in = swap_in
    for done in range(1, 4):
        for b in range(len(seq_lens)):  # the swap-in kernel rotated some hot columns' rows
            column = int(rng.integers(0, hot))
            spec.locs[b, column] = int(spec.device.shape[0] - 1 - b)
        accepted = rng.integers(1, S + 1, len(seq_lens)).tolist()
        before = {"tokens": spec.tokens.clone(), "locs": spec.locs.clone(),
                  "rows": spec.device.clone(), "host": spec.host_cache.clone(),
                  "mapping": mapping.clone()}
        bound.clear()
        calls.clear()
        step(torch.zeros(1), step.stage(accepted))
        want = expected_step(before, rtdb, seq_lens, accepted, S, hot, spare_first)
        assert bound == [True]
        assert torch.equal(spec.tokens, want["tokens"]) and torch.equal(spec.locs, want["locs"])
        assert torch.equal(mapping, want["mapping"])
        assert torch.equal(spec.device, want["rows"])
        assert torch.equal(spec.host_cache, want["host"])
        assert calls[-1] == "backup" and "copy" in calls
        coordinator = step.coordinator
        assert not coordinator._has_pending_backup
        event = coordinator._backup_done_event
        assert event.recorded == event.waited == done  # one backup a step, waited for
        assert coordinator._skip_first_backup == [True] * len(seq_lens)
        coordinator._skip_first_backup = [False] * len(seq_lens)


def fake_spec_swap_in(*, top_k_tokens: torch.Tensor, device_buffer_tokens: torch.Tensor,
                      host_cache_locs: torch.Tensor, device_buffer_locs: torch.Tensor,
                      host_cache: torch.Tensor, device_buffer: torch.Tensor,
                      top_k_device_locs: torch.Tensor, req_pool_indices: torch.Tensor,
                      state: object, **rest: object) -> None:
    """SGLang's spec swap-in reduced to its contract, reading the tables as its kernel does: a
    token named by a column (hot or extra page) gives that column's row, any other the
    request's host row, copied once per call into its scratch rows (no admission)."""
    B, S, K = top_k_tokens.shape
    for b in range(B):
        r = int(req_pool_indices[b])
        claimed: dict[int, int] = {}
        for s in range(S):
            for k in range(K):
                token = int(top_k_tokens[b, s, k])
                hit = (device_buffer_tokens[r] == token).nonzero()
                if hit.numel():
                    top_k_device_locs[b, s, k] = device_buffer_locs[r, int(hit[0])]
                    continue
                if token not in claimed:
                    claimed[token] = int(state.scratch_locs[r, len(claimed)])
                    device_buffer[claimed[token]] = host_cache[host_cache_locs[r, token]]
                top_k_device_locs[b, s, k] = claimed[token]


def test_the_step_peer_runs_sglangs_steps_byte_correct_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the sglang_step column on the CPU (peers_sw2.step_peer over a SpecPeer and
    its own host copy; SGLang's kernels as CPU stand-ins): every step's returned rows are the
    positions' own, the prompt's host rows never change, each commit leaves the newest
    accepted token in column H and backs the verify rows up to the spare pages."""
    rng = np.random.default_rng()
    B, S, K, seq_len, width = 2, 3, 8, 96, 656
    hot = max(2, S) * K
    truth = torch.randint(0, 256, (seq_len, width), dtype=torch.uint8)
    host_rows = np.stack([b * seq_len + rng.permutation(seq_len) for b in range(B)])
    host = torch.zeros(B * seq_len, width, dtype=torch.uint8)
    for b in range(B):
        host[torch.from_numpy(host_rows[b])] = truth
    tensors: dict[int, torch.Tensor] = {}
    register_pool_rows(tensors, monkeypatch)
    code = sglang_spec_step.load_step(sglang_copy(), cpu_kernels(tensors, []))
    ops = types.SimpleNamespace(HiSparseSpecState=types.SimpleNamespace,
                                load_cache_to_device_buffer_spec_mla=fake_spec_swap_in)
    peer = peers_sw2.step_peer(ops, code, host, host_rows, S, K, hot, truth)
    pool = peer.spec.host_cache
    assert set(tensors) == {peer.rows().data_ptr(), pool.data_ptr()}
    prompt = pool[: B * seq_len].clone()
    assert torch.equal(prompt, host)
    for _ in range(4):
        top_k = torch.from_numpy(rng.integers(0, seq_len, (B, S, K)).astype(np.int32))
        top_k[:, :, 0] = seq_len - 1  # the prompt's last token: column H's before settle()
        accepted = rng.integers(1, S + 1, B).tolist()
        peer.rows()[peer.spec.locs[:, hot + 1: hot + 1 + S].long()] = torch.randint(
            0, 256, (B, S, width), dtype=torch.uint8)  # the model's writes of the verify rows
        verify_rows = peer.rows()[peer.spec.locs[:, hot + 1: hot + 1 + S].long()].clone()
        peer(top_k, peer.stage(accepted))
        assert peers_sw2.peer_wrong(peer.rows(), peer.out, top_k, truth) == 0
        assert peer.tokens[:, hot].tolist() == [seq_len + a - 1 for a in accepted]
        newest = peer.rows()[peer.spec.locs[:, hot].long()]
        assert all(torch.equal(newest[b], verify_rows[b, a - 1]) for b, a in enumerate(accepted))
        assert torch.equal(pool[: B * seq_len], prompt)
        spare = pool[B * seq_len:].view(B, 64, width)[:, :S]
        assert torch.equal(spare, verify_rows)
    peer.close()


def test_a_copy_without_the_coordinator_skips_the_step_column_and_the_table_goes_on(
        tmp_path: Path) -> None:
    """SGLang's kernels alone (REQUIRED) and the step's files but the coordinator: the step
    column is refused naming the file, the kernel column is still made."""
    for name in sglang_ops.REQUIRED + sglang_ops.STEP_FILES:
        if name != sglang_spec_step.COORDINATOR:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text("")
    with pytest.raises(InvalidInputError, match=r"lacks sglang/srt/managers/hisparse_coord"):
        sglang_spec_step.load_step(tmp_path, cpu_kernels({}, []))
    ops = types.SimpleNamespace(HiSparseSpecState=types.SimpleNamespace,
                                load_cache_to_device_buffer_spec_mla=fake_spec_swap_in)
    peers_loaded = types.SimpleNamespace(sglang=ops, vllm=None,
                                         records={"sglang": {"source": str(tmp_path)}})
    step = peers_sw2.load_step(peers_loaded)
    assert step[0] is None and "hisparse_coordinator.py" in step[1]
    seq_len, K, S = 64, 8, 2
    truth = torch.randint(0, 256, (seq_len, 656), dtype=torch.uint8)
    host_rows = np.arange(seq_len)[None]
    made, errors = peers_sw2.make_peers(peers_loaded, step, truth.clone(), host_rows, S, K,
                                        2 * K, truth)
    assert list(made) == ["sglang"] and list(errors) == ["sglang_step"]
    assert "lacks sglang/srt/managers/hisparse_coordinator.py" in errors["sglang_step"]
    assert peers_sw2.load_step(types.SimpleNamespace(sglang=None)) == (None, None)


def test_sglang_functions_are_compiled_alone_and_refuse_what_they_lack(tmp_path: Path) -> None:
    """A method compiles with the names it is given; a module-level name it is not given
    raises, named, on use; a missing method or file is named."""
    source = tmp_path / "mod.py"
    source.write_text("import os\nclass Pool:\n    def move(self, x: Missing) -> int:\n"
                      "        return helper(x) if flag else x\n")
    move = sglang_spec_step.compile_function(tmp_path, "mod.py", "Pool", "move",
                                             {"helper": lambda x: x + 1})
    with pytest.raises(InvalidInputError, match="reached `flag`"):
        move(None, 1)
    move = sglang_spec_step.compile_function(tmp_path, "mod.py", "Pool", "move",
                                             {"helper": lambda x: x + 1, "flag": True})
    assert move(None, 1) == 2
    with pytest.raises(InvalidInputError, match=r"mod\.py: Pool\.copy not found"):
        sglang_spec_step.compile_function(tmp_path, "mod.py", "Pool", "copy", {})
    with pytest.raises(InvalidInputError, match=r"lacks other\.py"):
        sglang_spec_step.compile_function(tmp_path, "other.py", None, "f", {})


def test_a_cell_reports_sglangs_step_beside_its_kernel_with_the_step_ratio_only() -> None:
    """A cell's summary: per column device and host medians and the share of outrun sleeps;
    hisparse's step against both SGLang columns, its swap-in against the kernel alone only."""
    keys = ("step_device", "step_host", "swap_device", "swap_host", "begin_device",
            "begin_host", "end_device", "end_host")
    samples = {"hisparse": {**{key: [4e-4, 6e-4, 5e-4] for key in keys},
                            "misses": [3, 5, 4], "sleep_outrun": [0.0, 0.0, 1.0]},
               "sglang": {"device": [2e-4] * 3, "host": [1e-5] * 3, "sleep_outrun": [0.0] * 3,
                          "misses": [7.0] * 3},
               "sglang_step": {"device": [1e-3, 2e-3, 3e-3], "host": [3e-4] * 3,
                               "sleep_outrun": [0.0, 1.0, 1.0], "misses": [6.0] * 3}}
    state = types.SimpleNamespace(scratch_locs=torch.zeros(2, 1024, dtype=torch.int32))
    made = {name: types.SimpleNamespace(state=state) for name in ("sglang", "sglang_step")}
    cell = peers_sw2.summarize(samples, made)
    assert cell["sglang_step"] == {"device_us": 2000.0, "host_us": 300.0,
                                   "sleep_outrun": pytest.approx(2 / 3),
                                   "slots_replaced_per_step": 6.0, "scratch_rows": 1024}
    assert cell["hisparse_step_vs_sglang_step"] == 0.25
    assert cell["hisparse_step_vs_sglang"] == 2.5 and cell["hisparse_swap_vs_sglang"] == 2.5
    assert "hisparse_swap_vs_sglang_step" not in cell
