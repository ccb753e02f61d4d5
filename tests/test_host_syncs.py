"""No call of the engine blocks the host on the device, except those documented to.

A framework that overlaps its scheduling with the device (SGLang's and vLLM's overlap
schedulers) loses a whole step whenever a call waits for the device. On CUDA a wait hides in
ordinary torch code: reading a device value (`int(t)`, `.item()`, a boolean mask's indexing,
`nonzero`), and writing a Python value or a host tensor built from a list into device memory
(`t[i] = 0`, `t[idx] = torch.tensor(values)`), which torch copies from pageable memory, and
such a copy waits for the stream.

The combination fuzz (every capability: verify and ragged steps, dedupe, prefixes, PD
reservations, preempt and resume, finish and abort, cancels) runs with validate mode off:

- everywhere, under a dispatch mode that records the torch ops of those patterns that the
  engine (`hisparse/core/`) itself runs; on the CPU backend the device work is the torch
  reference under `hisparse/kernels/`, whose ops are not the engine's;
- on a GPU, under `torch.cuda.set_sync_debug_mode`, which reports every synchronizing call
  torch makes, attributed to the library's innermost frame that made it.

Allowed (docs/integration.md lists them): a cancel, and the end of a ragged step in which a
request keeps none of its rows, which give a newest slot its previous row back from host
memory once the device's backups into it have landed (`DecodeStep._restore_newest_slots`,
`single.undo_one`); the host's own host-row writes' wait for the device work that may still
touch rows a finish freed (`HostRowGuard.drain`: `write_prefill` from host memory,
`reserve_host_slots`, a prefix's tail or private copy). A prefill from device memory waits
for nothing (its own test below). Everything else fails with the line that waits.
"""

from __future__ import annotations

import ast
import collections
import functools
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hisparse
from hisparse.tools.combination_fuzz import FUZZ_CONFIG, FuzzRank
from hisparse.tools.shared_pool_run import _cache

PACKAGE = Path(hisparse.__file__).resolve().parent
# Functions documented to wait for the device (see the module docstring).
ALLOWED = {"_restore_newest_slots", "undo_one", "drain"}
# Ops that, on an accelerator, read a device value back or copy a host value in through
# pageable memory (`lift_fresh`: a Python scalar or list made a host tensor for a write).
SYNCING_OPS = {"aten._local_scalar_dense", "aten.lift_fresh", "aten.nonzero",
               "aten.masked_select", "aten.is_nonzero", "aten.unique_consecutive",
               "aten._unique2", "aten.unique_dim"}
SHAPES = [dict(index_group_size=2, residency_map="position"),
          dict(index_group_size=3, residency_map="host_row", alias_extents=16)]


@functools.cache
def _functions(path: str) -> list[tuple[int, int, str]]:
    """(first line, last line, name) of every function in a source file."""
    tree = ast.parse(Path(path).read_text())
    return [(n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _library_frames(frames: list[traceback.FrameSummary]) -> list[tuple[str, int, str]]:
    """(path under the package, line, enclosing function) of the library's frames, innermost
    last."""
    found = []
    for frame in frames:
        path = Path(frame.filename).resolve()
        if PACKAGE in path.parents:
            lineno = frame.lineno or 0
            inner = [f for f in _functions(str(path)) if f[0] <= lineno <= f[1]]
            name = min(inner, key=lambda f: f[1] - f[0])[2] if inner else "<module>"
            found.append((str(path.relative_to(PACKAGE)), lineno, name))
    return found


def _unexplained(frames: list[tuple[str, int, str]], innermost: bool) -> str | None:
    """Where a sync the engine made came from (its innermost library frame), or None: not
    the engine's (no `core/` frame on the way: the fuzz's own checks; or, with `innermost`,
    the CPU backend's device work under `kernels/`), or an allowed function is on the way."""
    if not frames or any(name in ALLOWED for _, _, name in frames):
        return None
    in_core = [frames[-1]] if innermost else frames
    if not any(path.startswith("core/") for path, _, _ in in_core):
        return None
    path, line, name = frames[-1]
    return f"{path}:{line} ({name})"


class _SyncingOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func.overloadpacket._qualified_op_name.replace("::", ".") in SYNCING_OPS:
            where = _unexplained(_library_frames(traceback.extract_stack()), innermost=True)
            if where is not None:
                self.found[f"{func} at {where}"] += 1
        return func(*args, **(kwargs or {}))


def _fuzz(device: str, shape: dict[str, object], seed: int) -> FuzzRank:
    cache = _cache(None, 0, 1, device, {**FUZZ_CONFIG, **shape, "validate": False})
    return FuzzRank(cache, seed, writer=True, folded=0.5)


@pytest.mark.parametrize("shape", SHAPES, ids=["position", "host_row-aliases"])
def test_the_engine_runs_no_syncing_op_outside_cancels(shape: dict[str, object]) -> None:
    seed = int(torch.randint(0, 2**31, (1,)))
    fuzz = _fuzz("cpu", shape, seed)
    try:
        with _SyncingOps() as ops:
            counts = fuzz.run(120)
    finally:
        fuzz.cache.close()
    assert counts["mismatches"] == 0, (seed, fuzz.mismatch_details)
    assert counts["cancels"] and counts["verify_steps"], counts  # the allowed paths ran too
    assert not ops.found, (seed, dict(ops.found))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU "
                    "(torch.cuda.set_sync_debug_mode reports the device's synchronizations)")
@pytest.mark.parametrize("shape", SHAPES, ids=["position", "host_row-aliases"])
def test_no_call_synchronizes_the_gpu_outside_cancels(shape: dict[str, object]) -> None:
    seed = int(torch.randint(0, 2**31, (1,)))
    fuzz = _fuzz("cuda", shape, seed)
    found: collections.Counter[str] = collections.Counter()

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        # Called while the op that synchronizes is on the stack, so the frames name it.
        if "synchroniz" in str(message):
            where = _unexplained(_library_frames(traceback.extract_stack()), innermost=False)
            if where is not None:
                found[where] += 1

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                counts = fuzz.run(120)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        fuzz.cache.close()
    assert counts["mismatches"] == 0, (seed, fuzz.mismatch_details)
    assert not found, (seed, dict(found))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU "
                    "(torch.cuda.set_sync_debug_mode reports the device's synchronizations)")
def test_a_prefill_from_device_memory_into_freed_rows_does_not_wait_for_the_device() -> None:
    """After a step backed rows up and a finish freed its request's rows, admitting the next
    request and writing its prompt from device memory queue their copies behind that work on
    the device: torch reports no synchronization at all."""
    config = hisparse.HiSparseConfig.from_preset("tiny", max_requests=1, validate=False)
    cache = hisparse.HiSparseCache(config, device="cuda")
    L, W, T = config.num_layers, config.row_bytes, 200
    try:
        cache.admit("a", T)
        cache.write_prefill("a", torch.randint(0, 256, (L, T, W), dtype=torch.uint8,
                                               device="cuda"))
        cache.commit_prefill("a")
        step = cache.begin_decode_step(["a"])
        top_k = torch.arange(config.top_k, dtype=torch.int32, device="cuda")[None]
        for layer in range(L):
            step.swap_in(layer, top_k if layer == config.anchor_layer(
                config.group_of_layer(layer)) else None,
                newest_kv=torch.zeros(1, W, dtype=torch.uint8, device="cuda"))
        step.end()
        cache.finish("a")
        rows = torch.randint(0, 256, (L, T, W), dtype=torch.uint8, device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            cache.admit("b", T)
            cache.write_prefill("b", rows)
            cache.commit_prefill("b")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        host = torch.stack([cache.host_tensors()[layer][torch.from_numpy(
            cache.host_rows("b")).long()] for layer in range(L)])
        assert torch.equal(host, rows.cpu())
    finally:
        cache.close()
