"""SGLang's HiSparse entry points (0.5.23 and later), called through SGLang's own Python
wrappers and JIT build, outside SGLang.

`sglang/kernels/ops/kvcache/hisparse.py` holds `load_cache_to_device_buffer_mla` (the single-step
swap-in: one CTA of `block_size` threads per request) and `load_cache_to_device_buffer_spec_mla`
(the speculative verify swap-in over `[B, S, K]` top-k: a gather kernel and a commit kernel
chained with programmatic dependent launch). Both compile their `.cuh` on first use through
`sglang.kernels.jit.utils` (ninja, nvcc and apache-tvm-ffi), with the flags SGLang picks for
the local GPU. Importing them normally runs `sglang/__init__.py`, which needs the whole serving
stack; this module instead registers the few packages on the way to those files as bare
namespaces over the user's copy, plus a stand-in for the one serving utility the JIT layer
imports (`sglang.srt.utils.common.is_cuda` and `get_cuda_version`), and imports the rest as
SGLang ships it. Needed beside that copy: `apache-tvm-ffi` (SGLang 0.5.23 pins 0.1.11) and
`msgspec` importable, `ninja` and `nvcc` on PATH.

The user points `--sglang-root` (or HISPARSE_SGLANG_ROOT) at a directory holding the `sglang`
package (site-packages, or an unpacked wheel, or a copy of its `kernels/jit`,
`kernels/ops/kvcache/hisparse.py` and `srt/environ.py`; SW-2's `sglang_step` column also reads
the files of STEP_FILES), or at the wheel itself. Nothing of SGLang is kept in this repository.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from hisparse.errors import InvalidInputError

ENV_VAR = "HISPARSE_SGLANG_ROOT"
OPS_MODULE = "sglang.kernels.ops.kvcache.hisparse"
# What the entry points import, relative to the directory holding `sglang/`.
REQUIRED = ("sglang/kernels/ops/kvcache/hisparse.py", "sglang/kernels/jit/utils/__init__.py",
            "sglang/kernels/jit/csrc/kvcacheio/hisparse.cuh",
            "sglang/kernels/jit/csrc/kvcacheio/hisparse_spec.cuh", "sglang/srt/environ.py")
# Packages between `sglang` and those files whose __init__ would pull in the serving stack:
# registered as bare namespaces over the user's directories.
BARE_PACKAGES = ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.kvcache",
                 "sglang.srt", "sglang.srt.utils")
# What SW-2's `sglang_step` column (benchmarks/sglang_spec_step.py) reads or imports beside
# REQUIRED: the coordinator's and pools' methods of a verify step, the kernels they launch. A
# copy without them still runs the kernels; only that column is skipped.
STEP_FILES = ("sglang/srt/managers/hisparse_coordinator.py",
              "sglang/srt/mem_cache/hisparse_memory_pool.py",
              "sglang/srt/mem_cache/pool_host/mla.py", "sglang/srt/layers/dcp/layout.py",
              "sglang/kernels/ops/kvcache/cache_move.py", "sglang/kernels/ops/kvcache/hicache.py",
              "sglang/kernels/kernel_api_logging.py",
              "sglang/kernels/jit/csrc/kvcacheio/hicache_tma.cuh")
# Members of a wheel that `find_root` unpacks.
WHEEL_MEMBERS = ("sglang/kernels/jit/", "sglang/kernels/ops/kvcache/hisparse.py",
                 "sglang/srt/environ.py", ".dist-info/METADATA", *STEP_FILES)
# SGLang's coordinator default `swap_in_block_size` (sglang/srt/mem_cache/sparsity/factory.py).
COORDINATOR_BLOCK_SIZE = 960


def find_root(path: str | None = None) -> Path:
    """The directory holding SGLang's `sglang` package: `path`, else $HISPARSE_SGLANG_ROOT, else
    the installed distribution's. A `.whl` is unpacked (the files the entry points need)."""
    given = path or os.environ.get(ENV_VAR)
    if given:
        root = Path(given)
        if root.is_file() and root.suffix == ".whl":
            root = _unpack(root)
    else:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise InvalidInputError(f"no SGLang given: pass --sglang-root or set {ENV_VAR} to a "
                                    "directory holding the sglang package (for example the "
                                    "unpacked sglang-0.5.23 wheel)")
        root = Path(next(iter(spec.submodule_search_locations))).parent
    missing = [name for name in REQUIRED if not (root / name).is_file()]
    if missing:
        raise InvalidInputError(f"SGLang at {root} lacks {', '.join(missing)}; these entry "
                                "points are SGLang 0.5.23's (older releases kept the kernel in "
                                "sglang/jit_kernel, which benchmarks/sglang_peer.py builds)")
    return root


def _unpack(wheel: Path) -> Path:
    target = wheel.with_name(wheel.name.removesuffix(".whl"))
    if all((target / name).is_file() for name in REQUIRED + STEP_FILES):
        return target
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if any(name.startswith(m) or (m.startswith(".") and name.endswith(m))
                   for m in WHEEL_MEMBERS):
                archive.extract(name, target)
    return target


def version(root: Path) -> str:
    """The release in the dist-info beside the package, else "unknown"."""
    for info in sorted(root.glob("sglang-*.dist-info")):
        metadata = info / "METADATA"
        if metadata.is_file():
            found = re.search(r"^Version:\s*(\S+)", metadata.read_text(errors="replace"), re.M)
            if found:
                return found.group(1)
    return "unknown"


def load(root: Path, build_dir: Path) -> types.ModuleType:
    """SGLang's `sglang.kernels.ops.kvcache.hisparse` from `root`, its JIT builds cached under
    `build_dir` (SGLANG_JIT_CACHE_DIR). Refuses a process that imported another SGLang."""
    for dependency, what in (("tvm_ffi", "apache-tvm-ffi==0.1.11"), ("msgspec", "msgspec")):
        if importlib.util.find_spec(dependency) is None:
            raise InvalidInputError(f"SGLang's JIT layer needs {what}: install it (pip install "
                                    f"{what}; offline: pip install --no-index --find-links DIR)")
    loaded = sys.modules.get("sglang")
    if loaded is not None:
        where = list(getattr(loaded, "__path__", []))
        if where != [str(root / "sglang")]:
            raise InvalidInputError(f"this process already imported sglang from {where}; run "
                                    "the peer in a process of its own")
        return importlib.import_module(OPS_MODULE)
    os.environ.setdefault("SGLANG_JIT_CACHE_DIR", str(build_dir))
    for name in BARE_PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")))]
        sys.modules[name] = package
    common = types.ModuleType("sglang.srt.utils.common")
    common.is_cuda = lambda: torch.version.cuda is not None  # type: ignore[attr-defined]
    common.get_cuda_version = lambda: tuple(  # type: ignore[attr-defined]
        int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    sys.modules[common.__name__] = common
    return importlib.import_module(OPS_MODULE)


def describe(root: Path, block_size: int | None = None) -> dict[str, object]:
    """What a results file records about the SGLang kernels it timed."""
    kernels = root / "sglang/kernels/jit/csrc/kvcacheio"
    digest = hashlib.sha256()
    for name in ("hisparse.cuh", "hisparse_spec.cuh"):
        digest.update((kernels / name).read_bytes())
    record: dict[str, object] = {
        "kernel": f"sglang-{version(root)}", "source": str(root),
        "kernels_sha256": digest.hexdigest(),
        "how": "SGLang's own Python entry points and JIT build (benchmarks/sglang_ops.py)"}
    if block_size is not None:
        record["block_size"] = block_size
    return record


def spec_state(ops: Any, requests: int, hot: int, steps: int, top_k: int,
               device: torch.device) -> Any:
    """An empty `HiSparseSpecState` sized as SGLang's HiSparseSpecSwapManager sizes it for
    `requests` request slots (one layer): hash banks of next_pow2(2H), the CLOCK row and one
    epoch row per request, a scratch of min(S K, max(1024, S K - H)) rows per request, and the
    counter and metadata rows shared by all layers."""
    occurrences = steps * top_k
    scratch = min(occurrences, max(1024, occurrences - hot))
    hash_size = 1 << max(1, (2 * hot - 1).bit_length())
    state = ops.HiSparseSpecState(
        cache_index=torch.full((requests, 2, hash_size), -1, dtype=torch.int64, device=device),
        cache_policy=torch.zeros((requests + 1, hot), dtype=torch.int32, device=device),
        scratch_locs=torch.zeros((requests, scratch), dtype=torch.int32, device=device),
        scratch_state=torch.full((requests + 1, max(4 * requests, 5 * occurrences)), -1,
                                 dtype=torch.int32, device=device))
    state.scratch_state[0].zero_()
    return state


def reset_request(state: Any, request: int, hot: int) -> None:
    """A request's spec state as SGLang's `HiSparseSpecSwapManager.reset` leaves it at
    admission: bank 0 seeded with token t in slot t for t < H, its CLOCK word, epoch row and
    four counters zero, its metadata row -1."""
    hash_size = state.cache_index.shape[-1]
    tokens = torch.arange(hot, dtype=torch.int64, device=state.cache_index.device)
    slots = (tokens * 2654435761) & (hash_size - 1)
    state.cache_index[request].fill_(-1)
    state.cache_index[request, 0, slots] = (tokens << 32) | tokens
    state.cache_policy[0, request] = 0
    state.cache_policy[request + 1].zero_()
    requests = state.scratch_locs.shape[0]
    state.scratch_state[0, request: 4 * requests: requests] = 0
    state.scratch_state[request + 1].fill_(-1)


class SglangSwapIn:
    """SGLang's single-step entry point behind hisparse's swap-in call signature
    (benchmarking.sw1_cell), called as its coordinator's `_run_swap_in_kernel` calls it:
    `page_size=1`, `block_size` (COORDINATOR_BLOCK_SIZE by default), the persistent
    `num_real_reqs`, no miss plan. Its tables (`sglang_peer.PeerTables`: the same tokens in
    the same slots and LRU order as hisparse's) are its own; it copies into
    `tables.device_kv[layer]` from `tables.host_kv[layer]` and counts nothing (SW-1's trace
    gives its misses: every exact LRU misses churn x K rows a step)."""

    def __init__(self, ops: Any, tables: Any, host_rows: Any, layer: int = 0,
                 block_size: int = COORDINATOR_BLOCK_SIZE) -> None:
        from sglang_peer import peer_tables

        self.ops, self.layer, self.block_size = ops, layer, block_size
        self.entry = ops.load_cache_to_device_buffer_mla  # (a layout of SGLang's own: another)
        self.peer = peer_tables(tables, host_rows, layer)
        self.host_cache = tables.host_kv[layer]
        self.device_buffer = tables.device_kv[layer]
        self.row_bytes = tables.device_kv.shape[-1]
        self.per_slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, tables: Any, layer: int, group: int, req_slots: torch.Tensor,
                 top_k: torch.Tensor, num_real: torch.Tensor, out: torch.Tensor,
                 **options: object) -> None:
        if options or layer != self.layer:
            raise InvalidInputError(f"the SGLang kernel runs layer {self.layer} alone and takes "
                                    f"no options (got layer {layer}, {sorted(options)})")
        key = req_slots.data_ptr()
        if key not in self.per_slots:  # the first (eager) call, outside any capture
            self.per_slots[key] = (req_slots.to(torch.int64),
                                   tables.seq_lens[req_slots.long()].to(torch.int32))
        slots, seq_lens = self.per_slots[key]
        peer = self.peer
        self.entry(
            top_k, peer.buffer_tokens, peer.host_locs, peer.buffer_locs, self.host_cache,
            self.device_buffer, out, slots, seq_lens, peer.lru, self.row_bytes,
            top_k.shape[1], tables.hot_slots, page_size=1, block_size=self.block_size,
            num_real_reqs=num_real)
