"""SGLang's fused swap-in kernel, built from a user's SGLang install, run on SW-1's tables.

hisparse is judged against the best existing kernel measured side by side with it, in one
run. SGLang ships that kernel as CUDA source that its JIT layer (tvm-ffi) compiles on
first use. This module takes the kernel's device code from the user's copy of that source (a
pip-installed `sglang` or a path to its `hisparse.cuh`; nothing of it is kept in this
repository), compiles it with nvcc behind a small C launcher of our own, and drives it through
ctypes on the same tables, pool and top-k trace as hisparse's kernel
(`benchmarking.sw1_cell(..., kernel_for=...)`).

Supported: the kernel signature of SGLang 0.5.10.post1 (`sglang/jit_kernel/csrc/hisparse.cuh`,
the newest release on PyPI that this project's machines can install). Another signature is
refused with a message rather than guessed at.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hisparse.backends.base import Backend
from hisparse.errors import InvalidInputError
from hisparse.layout.tables import CacheTables

# Where each SGLang release keeps the kernel, relative to the `sglang` package.
SOURCE_PATHS = ("jit_kernel/csrc/hisparse.cuh", "kernels/jit/csrc/kvcacheio/hisparse.cuh")
KERNEL_NAME = "load_cache_to_device_buffer_kernel"
# The parameters (in order) of the kernel this launcher is written for: SGLang 0.5.10.post1.
KERNEL_PARAMETERS = (
    "top_k_tokens", "device_buffer_tokens", "host_cache_locs", "device_buffer_locs",
    "host_cache_k", "host_cache_v", "device_buffer_k", "device_buffer_v", "top_k_device_locs",
    "req_pool_indices", "seq_lens", "lru_slots", "num_real_reqs", "buffer_stride_0",
    "host_stride", "lru_slot_stride_0", "top_k_tokens_stride", "top_k_device_locs_stride",
    "page_size", "item_size_bytes",
)
KERNEL_TEMPLATE = ("template <int BLOCK_SIZE, int NUM_TOP_K, int HOT_BUFFER_SIZE, bool IsMLA, "
                   "typename SeqLensT>")
# SGLang 0.5.10.post1's coordinator launches the kernel with 1024 threads per request.
DEFAULT_BLOCK_SIZE = 1024

_LAUNCHER = r"""
extern "C" int hisparse_peer_swap_in(
    const int32_t* top_k, int32_t* buffer_tokens, const int64_t* host_locs,
    const int32_t* buffer_locs, const void* host_kv, void* device_kv, int32_t* out,
    const int64_t* req_slots, const int32_t* seq_lens, int16_t* lru, const int32_t* num_real,
    int64_t batch, int64_t buffer_stride, int64_t host_stride, int64_t lru_stride,
    int64_t top_k_stride, int64_t out_stride, int64_t row_bytes, void* stream) {
  auto kernel = load_cache_to_device_buffer_kernel<PEER_BLOCK, PEER_TOP_K, PEER_HOT, true,
                                                   int32_t>;
  constexpr size_t smem = SmemLayout<PEER_TOP_K, PEER_HOT>::BYTES;
  // Set once, before any graph capture (the first call is eager).
  static bool configured = false;
  if (!configured) {
    cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (status != cudaSuccess) return static_cast<int>(status);
    configured = true;
  }
  kernel<<<static_cast<unsigned>(batch), PEER_BLOCK, smem, static_cast<cudaStream_t>(stream)>>>(
      top_k, buffer_tokens, host_locs, buffer_locs, host_kv, nullptr, device_kv, nullptr, out,
      req_slots, seq_lens, lru, num_real, buffer_stride, host_stride, lru_stride, top_k_stride,
      out_stride, /*page_size=*/1, row_bytes);
  return static_cast<int>(cudaGetLastError());
}
"""


def find_source(path: str | None = None) -> Path:
    """`path`, or the kernel source of the installed `sglang` package (not imported)."""
    if path is not None:
        source = Path(path)
        if not source.is_file():
            raise InvalidInputError(f"SGLang kernel source {source} does not exist; pass the "
                                    "path of sglang/jit_kernel/csrc/hisparse.cuh")
        return source
    spec = importlib.util.find_spec("sglang")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        for relative in SOURCE_PATHS:
            if (Path(root) / relative).is_file():
                return Path(root) / relative
    raise InvalidInputError(
        "no SGLang kernel source found: install it (`pip install --no-deps "
        "sglang==0.5.10.post1`) or pass the path of its jit_kernel/csrc/hisparse.cuh")


def source_version(source: Path) -> str:
    """The SGLang release `source` came from: the dist-info beside its package, else
    "unknown" (a loose copy of the file says nothing about its release)."""
    for parent in source.resolve().parents:
        if parent.name == "sglang":
            infos = sorted(parent.parent.glob("sglang-*.dist-info"))
            if infos:
                return infos[-1].name.removeprefix("sglang-").removesuffix(".dist-info")
    return "unknown"


def nvcc_version() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    output = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release ([\d.]+)", output)
    return found.group(1) if found else output.strip().splitlines()[-1]


def describe(source: Path, block_size: int) -> dict[str, object]:
    """What a results file records about the peer kernel it timed."""
    return {
        "kernel": f"sglang-{source_version(source)}", "source": str(source),
        "source_sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "block_size": block_size, "nvcc": nvcc_version(),
        "how": "its kernel's device code compiled with nvcc behind hisparse's C launcher "
               "(benchmarks/sglang_peer.py), on the same tables, pool and top-k trace",
    }


def kernel_parameters(source: str) -> tuple[str, ...]:
    """The parameter names of the swap-in kernel in `source`, in order."""
    match = re.search(rf"__global__\s+void\s+{KERNEL_NAME}\s*\((.*?)\)\s*\{{", source, re.S)
    if match is None:
        raise InvalidInputError(f"{KERNEL_NAME} not found in the SGLang source")
    names = []
    for parameter in match.group(1).split(","):
        words = re.findall(r"[A-Za-z_]\w*", parameter)
        if words:
            names.append(words[-1])
    return tuple(names)


def device_code(source: str) -> str:
    """The device part of SGLang's hisparse.cuh: its anonymous namespace up to the host
    launcher (which needs SGLang's tvm-ffi headers), without the includes.

    Refuses a kernel whose template or parameters differ from those this module launches."""
    parameters = kernel_parameters(source)
    if parameters != KERNEL_PARAMETERS or KERNEL_TEMPLATE not in source:
        raise InvalidInputError(
            "this SGLang kernel's signature is not the one hisparse's launcher knows (SGLang "
            f"0.5.10.post1): parameters {parameters}; use that release's hisparse.cuh")
    begin = source.find("namespace {")
    launcher = re.search(r"template\s*<[^>]*>\s*void\s+load_cache_to_device_buffer\s*\(",
                         source)
    if begin < 0 or launcher is None or launcher.start() < begin:
        raise InvalidInputError("SGLang's hisparse.cuh does not have the expected layout "
                                "(an anonymous namespace, then the host launcher)")
    return ("#include <cuda_runtime.h>\n#include <stdint.h>\n"
            + source[begin:launcher.start()] + "}  // namespace\n")


def compile_library(source: Path, top_k: int, hot_slots: int, build_dir: Path,
                    block_size: int = DEFAULT_BLOCK_SIZE, arch: str = "sm_90") -> Path:
    """A shared library exposing `hisparse_peer_swap_in`, built once per source and sizes."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise InvalidInputError("nvcc is not on PATH; the SGLang kernel is CUDA source and "
                                "needs the CUDA toolkit's compiler")
    unit = device_code(source.read_text()) + _LAUNCHER
    defines = [f"-DPEER_BLOCK={block_size}", f"-DPEER_TOP_K={top_k}", f"-DPEER_HOT={hot_slots}"]
    key = hashlib.sha256((unit + " ".join(defines) + arch).encode()).hexdigest()[:16]
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"sglang_peer_{key}.so"
    if not library.exists():
        unit_path = build_dir / f"sglang_peer_{key}.cu"
        unit_path.write_text(unit)
        subprocess.run([nvcc, "-O3", "-std=c++17", f"-arch={arch}", "-shared",
                        "-Xcompiler", "-fPIC", *defines, "-o", str(library), str(unit_path)],
                       check=True)
    return library


def load_library(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    function = library.hisparse_peer_swap_in
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 7 + [ctypes.c_void_p]
    return library


@dataclass
class PeerTables:
    """SGLang's per-request tables for one layer of hisparse's `CacheTables` (the ones its
    coordinator keeps per request and layer): the same tokens in the same slots, the same LRU
    order, the same device rows."""

    buffer_tokens: torch.Tensor  # [R, H+1] int32: token position in each slot (H: newest)
    buffer_locs: torch.Tensor  # [R, H+1] int32: device row of each slot
    host_locs: torch.Tensor  # [R, seq_len] int64: host row of each position
    lru: torch.Tensor  # [R, H] int16: slots, least recently used first


def peer_tables(tables: CacheTables, host_rows: np.ndarray, layer: int = 0) -> PeerTables:
    """`host_rows` [R, seq_len]: the host row of every position (benchmarking.build_tables).

    A slot's token is its key's position where the residency map is keyed by position, else
    found by inverting `host_rows` at the slot's host row, so this holds for any layout; the
    newest slot holds position seq_len - 1 (docs/ARCHITECTURE.md)."""
    device = tables.last_use.device
    requests, seq_len = host_rows.shape
    slot_keys = tables.slot_key[layer].cpu().numpy().astype(np.int64)  # [R, H], -1 empty
    if tables.residency_map == "position":
        tokens = np.where(slot_keys >= 0, slot_keys % tables.positions_per_request, -1)
    else:
        position_of_row = np.full(int(host_rows.max()) + 1, -1, dtype=np.int64)
        position_of_row[host_rows.reshape(-1)] = np.tile(np.arange(seq_len), requests)
        tokens = np.where(slot_keys >= 0, position_of_row[np.maximum(slot_keys, 0)], -1)
    lengths = tables.seq_lens.cpu().numpy().astype(np.int64)
    buffer_tokens = np.concatenate([tokens, (lengths - 1)[:, None]], axis=1)
    slots = tables.slots_per_request
    buffer_locs = np.arange(requests)[:, None] * slots + np.arange(slots)[None, :]
    # Row-major: the kernel takes one row stride per table and assumes unit column strides
    # (numpy hands back column-major arrays from some of the steps above).
    return PeerTables(
        buffer_tokens=torch.from_numpy(buffer_tokens.astype(np.int32)).to(device).contiguous(),
        buffer_locs=torch.from_numpy(buffer_locs.astype(np.int32)).to(device).contiguous(),
        host_locs=torch.from_numpy(host_rows.astype(np.int64)).to(device).contiguous(),
        lru=lru_order(tables, layer).to(torch.int16).contiguous(),
    )


def lru_order(tables: CacheTables, group: int = 0) -> torch.Tensor:
    """[R, H] hot slots of each request, least recently used first: hisparse's stamps in the
    list form SGLang keeps (ascending last use, ties by slot id)."""
    stamps = tables.last_use[group].long()
    slot_ids = torch.arange(stamps.shape[1], device=stamps.device)
    return (stamps * stamps.shape[1] + slot_ids).argsort(dim=1)


class PeerSwapIn:
    """SGLang's kernel behind hisparse's swap-in call signature (benchmarking.sw1_cell).

    It keeps its own tables (`PeerTables`), so hisparse's `resident`, `slot_key` and LRU go
    stale once it runs: one cell, one kernel. It copies into `tables.device_kv[layer]` from
    `tables.host_kv[layer]` and returns device rows in `out`, as hisparse's kernel does. It
    counts nothing (`tables.counters` stay as they are)."""

    def __init__(self, library: ctypes.CDLL, backend: Backend, tables: CacheTables,
                 host_rows: np.ndarray, layer: int = 0) -> None:
        self.library = library
        self.layer = layer
        self.peer = peer_tables(tables, host_rows, layer)
        self.host_address = backend.device_address(tables.host_kv[layer])
        self.row_bytes = tables.device_kv.shape[-1]
        self.request_slots: torch.Tensor | None = None
        self.row_seq_lens: torch.Tensor | None = None
        self.slots_address = 0

    def __call__(self, tables: CacheTables, layer: int, group: int, req_slots: torch.Tensor,
                 top_k: torch.Tensor, num_real: torch.Tensor, out: torch.Tensor,
                 **options: object) -> None:
        if options or layer != self.layer:
            raise InvalidInputError(f"the SGLang kernel runs layer {self.layer} alone and takes "
                                    f"no options (got layer {layer}, {sorted(options)})")
        for name, tensor in (("top_k", top_k), ("out", out)):
            if tensor.stride(1) != 1:
                raise InvalidInputError(f"{name} must have unit column stride for the SGLang "
                                        f"kernel (strides {tensor.stride()}); pass a "
                                        ".contiguous() tensor")
        if self.request_slots is None or self.slots_address != req_slots.data_ptr():
            # Converted on the first (eager) call, outside any capture: SGLang reads int64
            # request slots and a sequence length per batch row, not per request slot.
            # (sw1_cell passes one fixed `req_slots` tensor per cell.)
            self.slots_address = req_slots.data_ptr()
            self.request_slots = req_slots.to(torch.int64)
            self.row_seq_lens = tables.seq_lens[req_slots.long()].to(torch.int32)
        peer = self.peer
        status = self.library.hisparse_peer_swap_in(
            top_k.data_ptr(), peer.buffer_tokens.data_ptr(), peer.host_locs.data_ptr(),
            peer.buffer_locs.data_ptr(), self.host_address,
            tables.device_kv[layer].data_ptr(), out.data_ptr(), self.request_slots.data_ptr(),
            self.row_seq_lens.data_ptr(), peer.lru.data_ptr(), num_real.data_ptr(),
            top_k.shape[0], peer.buffer_tokens.stride(0), peer.host_locs.stride(0),
            peer.lru.stride(0), top_k.stride(0), out.stride(0), self.row_bytes,
            torch.cuda.current_stream().cuda_stream)
        if status != 0:
            raise RuntimeError(f"SGLang's kernel failed to launch: CUDA error {status}")
