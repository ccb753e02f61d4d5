"""`swap_in(layer, top_k, newest_kv=kv)`: `write_newest` folded into the swap-in (on the GPUs
into its lookup launch: one launch fewer per layer), checked against the two calls it stands
for. Two caches decode the same random steps side by side, one through `write_newest` then
`swap_in`, one through the folded call: every returned row, every table, every device row and
the host rows the backups write must be the same, for single-token and verify steps, index
groups (a follower writes its own new rows) and both residency maps. A bad `newest_kv` is
refused before anything runs.

Runs on every usable backend (`--backend cuda` through the Triton launcher) and through the
Triton launcher under TRITON_INTERPRET=1 on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hisparse
from fakes.interpreted_triton import InterpretedTritonCpu
from hisparse.errors import InvalidInputError
from interpreted_kernels import ON_GPU
from test_engine_trace import NUM_LAYERS, ROW_BYTES, build_cache
from test_reliability_state import assert_same_state, full_snapshot

H, K, E = 12, 4, 4
PROMPTS = (5, 19, 31)  # short, just past the hot buffer, long


def _pair(device: object, group: int, residency_map: str, drafts: int
          ) -> tuple[hisparse.HiSparseCache, hisparse.HiSparseCache]:
    caches = tuple(build_cache(device, H, K, E, group, True, 32, max_requests=3, max_batch=3,
                               residency_map=residency_map, max_draft_tokens=drafts)
                   for _ in range(2))
    gen = torch.Generator().manual_seed(11)
    for request, tokens in enumerate(PROMPTS):
        rows = torch.randint(0, 256, (NUM_LAYERS, tokens, ROW_BYTES), dtype=torch.uint8,
                             generator=gen)
        for cache in caches:
            cache.admit(request, tokens)
            cache.write_prefill(request, rows.to(cache.device))
            cache.commit_prefill(request)
    return caches


def _host_bytes(cache: hisparse.HiSparseCache) -> list[torch.Tensor]:
    cache.backend.synchronize()  # the backup may still be landing on its side stream
    return [torch.cat([cache._pool.layers[layer][torch.from_numpy(cache.host_rows(r))].cpu()
                       for r in range(len(PROMPTS))]) for layer in range(NUM_LAYERS)]


def _device_state(cache: hisparse.HiSparseCache) -> dict[str, object]:
    """The snapshot without the host pool (its unused rows are uninitialised memory, its
    addresses the process's; `_host_bytes` compares the rows the requests hold)."""
    return {name: value for name, value in full_snapshot(cache).items()
            if name not in ("tables.host_kv", "tables.host_kv_addresses", "pool.layers")}


def _decode_side_by_side(device: object, group: int, residency_map: str, drafts: int,
                         steps: int, seed: int) -> None:
    separate, folded = _pair(device, group, residency_map, drafts)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        batch = sorted(rng.choice(len(PROMPTS), int(rng.integers(1, 4)), replace=False).tolist())
        tokens = int(rng.integers(1, drafts + 1))
        shape = (len(batch), tokens) if tokens > 1 else (len(batch),)
        steps_ = [c.begin_decode_step(batch, num_tokens=tokens) for c in (separate, folded)]
        positions = steps_[0].positions
        for layer in range(NUM_LAYERS):
            kv = torch.from_numpy(rng.integers(0, 256, (*shape, ROW_BYTES), dtype=np.uint8))
            top_k = None
            if layer % group == 0:
                columns = [[rng.permutation(int(np.ravel(p)[t]) + 1)[:K].tolist()
                            for t in range(tokens)] for p in positions]
                padded = [[row + [-1] * (K - len(row)) for row in request] for request in columns]
                top_k = torch.tensor(padded, dtype=torch.int32).reshape(*shape, K)
                top_k = top_k.to(separate.device), top_k.to(folded.device)
            separate.write_newest(layer, kv.to(separate.device))
            got_separate = separate.swap_in(layer, None if top_k is None else top_k[0])
            got_folded = folded.swap_in(layer, None if top_k is None else top_k[1],
                                        newest_kv=kv.to(folded.device))
            assert torch.equal(got_separate.cpu(), got_folded.cpu()), layer
            valid = got_folded.cpu() >= 0
            assert torch.equal(separate.device_kv(layer).cpu()[got_separate.cpu()[valid].long()],
                               folded.device_kv(layer).cpu()[got_folded.cpu()[valid].long()])
        accepted = [int(a) for a in rng.integers(1, tokens + 1, len(batch))]
        for cache in (separate, folded):
            cache.end_decode_step(accepted=accepted if tokens > 1 else None)
        assert_same_state(*(_device_state(c) for c in (separate, folded)))
        for want, got in zip(_host_bytes(separate), _host_bytes(folded), strict=True):
            assert torch.equal(want, got)
    assert separate.stats().to_dict() == folded.stats().to_dict()


@pytest.mark.parametrize(("group", "residency_map", "drafts"),
                         [(1, "host_row", 1), (2, "position", 1), (1, "host_row", 2),
                          (2, "host_row", 3)])
def test_a_folded_write_decodes_as_the_two_calls_do(
        backend: object, group: int, residency_map: str, drafts: int, seed: int) -> None:
    _decode_side_by_side(backend, group, residency_map, drafts, steps=8, seed=seed)


@pytest.mark.skipif(ON_GPU, reason="a GPU is visible: the cuda backend runs the launcher")
@pytest.mark.parametrize(("group", "residency_map"), [(1, "host_row"), (2, "position")])
def test_the_triton_launcher_writes_the_new_rows_in_its_lookup(
        group: int, residency_map: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter the folded call goes through the launcher's fused lookup (no
    `write_newest` launch), and decodes as the two calls do."""
    from interpreted_kernels import swap_in_triton

    fused: list[int] = []
    real = swap_in_triton.SwapInLauncher.swap_in

    def recording(self: object, layer: int, group: int, rows: int, top_k: torch.Tensor,
                  newest_kv: torch.Tensor | None = None) -> None:
        if newest_kv is not None:
            fused.append(layer)
        real(self, layer, group, rows, top_k, newest_kv)

    monkeypatch.setattr(swap_in_triton.SwapInLauncher, "swap_in", recording)
    backups = _count_backups(monkeypatch)
    _decode_side_by_side(InterpretedTritonCpu(), group, residency_map, 1, steps=4, seed=seed)
    assert fused and set(fused) <= set(range(0, NUM_LAYERS, group))
    # The separate cache backs up every step; the folded one only where a follower wrote its
    # rows through write_newest (index groups), the lookups having backed up all the others.
    assert backups == {"steps": 8, "launched": 4 if group == 1 else 8}


def _count_backups(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of ended single-token steps and of the backup launches they made."""
    from hisparse.core.kernels import DecodeKernels
    from hisparse.core.step import DecodeStep

    counts = {"steps": 0, "launched": 0}
    launch, end = DecodeKernels.launch_backup, DecodeStep.end

    def counted_launch(self: DecodeKernels, *args: object) -> None:
        counts["launched"] += 1
        launch(self, *args)

    def counted_end(self: DecodeStep, accepted: object = None) -> None:
        counts["steps"] += 1
        end(self, accepted)

    monkeypatch.setattr(DecodeKernels, "launch_backup", counted_launch)
    monkeypatch.setattr(DecodeStep, "end", counted_end)
    return counts


def _folding_device() -> object:
    return "cuda" if ON_GPU else InterpretedTritonCpu()


def test_a_write_newest_after_a_folded_swap_in_is_what_the_host_row_keeps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup backs each layer's rows up as it writes them; a later `write_newest` of a
    layer in the same step overwrites the device row, and the step's end then backs that up
    (its backup runs), so the host row holds the last rows written, as with the two calls.
    A step of folded calls only, and one cancelled after them, leave the same state as the
    two calls do."""
    backups = _count_backups(monkeypatch)
    separate, folded = _pair(_folding_device(), 1, "host_row", 1)
    rng = np.random.default_rng()
    batch = list(range(len(PROMPTS)))
    for rewrite, cancel in ((True, False), (False, True), (False, False)):
        steps = [c.begin_decode_step(batch) for c in (separate, folded)]
        for layer in range(NUM_LAYERS):
            kv, again = (torch.from_numpy(rng.integers(0, 256, (len(batch), ROW_BYTES),
                                                       dtype=np.uint8)) for _ in range(2))
            top_k = torch.tensor([rng.permutation(p + 1)[:K].tolist()
                                  for p in steps[0].positions], dtype=torch.int32)
            separate.write_newest(layer, kv.to(separate.device))
            separate.swap_in(layer, top_k.to(separate.device))
            folded.swap_in(layer, top_k.to(folded.device), newest_kv=kv.to(folded.device))
            if rewrite and layer == 0:
                for cache in (separate, folded):
                    cache.write_newest(layer, again.to(cache.device))
        for cache in (separate, folded):
            cache.cancel_decode_step() if cancel else cache.end_decode_step()
        assert_same_state(*(_device_state(c) for c in (separate, folded)))
        for want, got in zip(_host_bytes(separate), _host_bytes(folded), strict=True):
            assert torch.equal(want, got)
    assert backups == {"steps": 4, "launched": 3}  # the folded cache's: the rewritten step


@pytest.mark.parametrize("bad", ["wide", "few rows", "int64"])
def test_bad_new_rows_are_refused_before_the_swap_in(bad: str) -> None:
    cache, _ = _pair("cpu", 1, "host_row", 1)
    cache.begin_decode_step([0, 1, 2])
    kv = {"wide": torch.zeros(3, ROW_BYTES + 4, dtype=torch.uint8),
          "few rows": torch.zeros(2, ROW_BYTES, dtype=torch.uint8),
          "int64": torch.zeros(3, ROW_BYTES // 8 + 1, dtype=torch.int64)}[bad]
    top_k = torch.zeros(3, K, dtype=torch.int32)
    before = full_snapshot(cache)
    with pytest.raises(InvalidInputError, match="kv"):
        cache.swap_in(0, top_k, newest_kv=kv)
    assert_same_state(before, full_snapshot(cache))
    cache.cancel_decode_step()
