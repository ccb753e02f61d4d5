"""vLLM 0.34's HiSparse swap-in ops, built from a user's vLLM source distribution, on hisparse's
tables: `hisparse_resolve_residency` (the lookup, the exact-LRU victim choice and the compact
swap lists) then `hisparse_gather_compact` (the copy of the listed rows).

vLLM's wheel carries these ops compiled inside `_C_stable_libtorch`, which needs the rest of
vLLM; its source distribution carries `csrc/hisparse_kernels.cu`. This module builds that file
alone as a PyTorch stable-ABI extension (`torch.utils.cpp_extension.load`, nvcc for sm_90,
`TORCH_TARGET_VERSION` 2.11 and `USE_CUDA` as vLLM's CMake sets them) beside a registration unit
of our own whose op schemas are read out of the same source's `csrc/torch_bindings.cpp`, so the
ops take exactly vLLM's arguments. Nothing of vLLM is kept in this repository: the user points
`--vllm-source` (or HISPARSE_VLLM_SOURCE) at the unpacked source distribution, or at a copy of
its `csrc/` files `hisparse_kernels.cu`, `torch_utils.h`, `ops.h` and `torch_bindings.cpp`
beside its `PKG-INFO`.

The calls are `HiSparseRuntime._resolve_residency` and `_swap_rows` of vLLM 0.34
(`vllm/v1/hisparse/runtime.py`) with the parameters its runtime derives for a decode query of
`rows_per_request` tokens and top-k K: `region_stride` = the hot size (`device_buffer_size`),
`max_union_rows` = rows_per_request x K, hot pages of 64 rows (its `[num_blocks, 64, width]`
hot cache, `hot_block_table`, `attention_block_stride` 64), top-k positions relative to the
request translated in the kernel through a source block table of `block_size`-token pages
(`request_ids`, `source_block_table`), `request_state_indices`, `num_valid_rows` and the
uint64 hit/miss `stats`; no resident tier (`resident_block_table` None), no `valid_counts`.
vLLM issues both ops on a copy stream that the attention waits on; here they run on the
current stream, which times the same kernels.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hisparse.errors import InvalidInputError
from hisparse.layout.tables import CacheTables

SOURCE_FILES = ("csrc/hisparse_kernels.cu", "csrc/torch_utils.h", "csrc/ops.h",
                "csrc/torch_bindings.cpp")
OPS = ("hisparse_resolve_residency", "hisparse_gather_compact")
NAMESPACE = "hisparse_vllm_peer"
ENV_VAR = "HISPARSE_VLLM_SOURCE"
# vLLM's hot cache pages (`kFixedBlockSize` in its kernel, the MLA KV page of its models).
HOT_PAGE_ROWS = 64
# Host rows below this are vLLM's null page (a source page number 0 means "not host-backed"):
# the pool handed to vLLM starts one page before the rows hisparse's tables use.
NULL_PAGE_ROWS = 64
# vLLM's CMake: the stable-ABI floor it targets, and the CUDA branch of the C shim.
DEFINES = ("-DTORCH_TARGET_VERSION=0x020B000000000000ULL", "-DUSE_CUDA")


def find_source(path: str | None = None) -> Path:
    """The directory holding vLLM's `csrc/` files: `path`, else $HISPARSE_VLLM_SOURCE. A
    `.tar.gz` source distribution is unpacked (its four files and PKG-INFO) beside itself."""
    given = path or os.environ.get(ENV_VAR)
    if not given:
        raise InvalidInputError(f"no vLLM source given: pass --vllm-source or set {ENV_VAR} to "
                                "the unpacked vllm-0.34.0 source distribution")
    root = Path(given)
    if root.is_file() and root.name.endswith(".tar.gz"):
        root = _unpack(root)
    missing = [name for name in SOURCE_FILES if not (root / name).is_file()]
    if missing:
        raise InvalidInputError(f"vLLM source {root} lacks {', '.join(missing)}; pass the "
                                "unpacked source distribution (pip download --no-binary "
                                ":all: --no-deps vllm==0.34.0)")
    return root


def _unpack(archive: Path) -> Path:
    target = archive.with_name(archive.name.removesuffix(".tar.gz"))
    if all((target / name).is_file() for name in SOURCE_FILES):
        return target
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            relative = member.name.split("/", 1)[-1]
            if relative in (*SOURCE_FILES, "PKG-INFO") and member.isfile():
                member.name = relative
                tar.extract(member, target, filter="data")
    return target


def source_version(root: Path) -> str:
    """The release in the source's PKG-INFO, else "unknown"."""
    info = root / "PKG-INFO"
    if info.is_file():
        found = re.search(r"^Version:\s*(\S+)", info.read_text(errors="replace"), re.M)
        if found:
            return found.group(1)
    return "unknown"


def op_schemas(bindings: str) -> dict[str, str]:
    """Each op's schema string as vLLM's torch_bindings.cpp defines it (adjacent C string
    literals joined); refuses a source without one of `OPS`."""
    schemas = {}
    for call in re.finditer(r"\.def\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)\)", bindings):
        text = "".join(re.findall(r"\"((?:[^\"\\]|\\.)*)\"", call.group(1)))
        name = text.split("(", 1)[0].strip()
        if name in OPS:
            schemas[name] = re.sub(r"\s+", " ", text)
    missing = [name for name in OPS if name not in schemas]
    if missing:
        raise InvalidInputError(f"vLLM's torch_bindings.cpp defines no {', '.join(missing)}: "
                                "this module runs the ops of vLLM 0.34")
    return schemas


def registration_source(schemas: dict[str, str]) -> str:
    """The extension's registration unit: vLLM's schemas under NAMESPACE, its functions."""
    defs = "\n".join(f"  m.def({_c_string(schemas[name])});" for name in OPS)
    impls = "\n".join(f"  m.impl(\"{name}\", TORCH_BOX(&{name}));" for name in OPS)
    return (f"#include \"ops.h\"\n#include <torch/csrc/stable/library.h>\n\n"
            f"STABLE_TORCH_LIBRARY({NAMESPACE}, m) {{\n{defs}\n}}\n\n"
            f"STABLE_TORCH_LIBRARY_IMPL({NAMESPACE}, CUDA, m) {{\n{impls}\n}}\n")


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def build_inputs(root: Path, build_dir: Path) -> tuple[list[str], list[str]]:
    """(sources, include dirs) of the extension, written under `build_dir`."""
    build_dir.mkdir(parents=True, exist_ok=True)
    registration = build_dir / "registration.cpp"
    _write_if_changed(registration, registration_source(
        op_schemas((root / "csrc/torch_bindings.cpp").read_text())))
    includes = [str(root / "csrc")]
    if not _has_cublas_header():
        # torch_utils.h includes cuBLAS for one handle type the HiSparse ops never use; a
        # toolkit without cuBLAS's headers gets that type alone.
        stub = build_dir / "stub_include"
        stub.mkdir(exist_ok=True)
        _write_if_changed(stub / "cublas_v2.h", "#pragma once\n"
                          "typedef struct cublasContext* cublasHandle_t;\n")
        includes.append(str(stub))
    return [str(root / "csrc/hisparse_kernels.cu"), str(registration)], includes


def _write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def _has_cublas_header() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    roots = [Path(CUDA_HOME or "/usr/local/cuda") / "include"]
    try:
        import nvidia

        roots += [Path(p) / sub / "include" for p in nvidia.__path__
                  for sub in ("cublas", "cu13", "cu12")]
    except ImportError:
        pass
    return any((root / "cublas_v2.h").is_file() for root in roots)


def build(root: Path, build_dir: Path, verbose: bool = False) -> Any:
    """Build (or reuse) the extension and return `torch.ops.hisparse_vllm_peer`."""
    from torch.utils import cpp_extension

    sources, includes = build_inputs(root, build_dir)
    digest = hashlib.sha256(b"".join(Path(s).read_bytes() for s in sources)).hexdigest()[:12]
    cpp_extension.load(
        name=f"hisparse_vllm_peer_{digest}", sources=sources, extra_include_paths=includes,
        extra_cflags=["-O3", "-std=c++17", *DEFINES],
        extra_cuda_cflags=["-O3", "-std=c++17", *DEFINES,
                           "-gencode=arch=compute_90,code=sm_90"],
        build_directory=str(build_dir), is_python_module=False, verbose=verbose)
    return getattr(torch.ops, NAMESPACE)


def describe(root: Path) -> dict[str, object]:
    """What a results file records about the vLLM ops it timed."""
    kernel = root / SOURCE_FILES[0]
    return {"kernel": f"vllm-{source_version(root)}", "source": str(root),
            "source_sha256": hashlib.sha256(kernel.read_bytes()).hexdigest(),
            "how": "csrc/hisparse_kernels.cu built alone as a stable-ABI torch extension "
                   "(benchmarks/vllm_peer.py), vLLM's op schemas, vLLM 0.34 runtime's "
                   "arguments"}


@dataclass
class VllmTables:
    """vLLM's per-request state for one layer of hisparse's tables: the same tokens in the
    same hot slots, the same LRU order; hot slot s of request r at device row r x H + s."""

    hot_cache: torch.Tensor  # [R x H / 64, 64, W] view of the device rows
    hot_block_table: torch.Tensor  # [R, H / 64] int32
    source_block_table: torch.Tensor  # [R, positions / block_size] int32, page numbers > 0
    device_global_indices: torch.Tensor  # [R, H] int32: vLLM host row of each slot's token
    lru_slots: torch.Tensor  # [R, H] int16, least recently used first
    block_size: int


def host_pages(host_rows: np.ndarray, block_size: int) -> np.ndarray:
    """[R, positions / block_size] vLLM page numbers of each request's positions, given the
    host row of every position (`host_rows`, rows of the pool hisparse's tables use); a page's
    rows must be consecutive. Page p holds vLLM host rows p x block_size on, which are the
    pool's rows (p x block_size - NULL_PAGE_ROWS) on."""
    positions = host_rows.shape[1]
    if positions % block_size or NULL_PAGE_ROWS % block_size:
        raise InvalidInputError(f"{positions} positions per request do not split into "
                                f"{block_size}-token pages; pick a block size dividing them "
                                f"and {NULL_PAGE_ROWS}")
    firsts = host_rows[:, ::block_size] + NULL_PAGE_ROWS
    expected = np.repeat(firsts, block_size, axis=1) + np.tile(np.arange(block_size),
                                                               positions // block_size)
    if firsts.min() < 0 or (firsts % block_size).any() or not np.array_equal(
            expected, host_rows + NULL_PAGE_ROWS):
        raise InvalidInputError(f"the host layout does not consist of {block_size}-token pages "
                                "of consecutive rows; use block size 1 for a scattered pool")
    # Row-major whatever the order of `host_rows`: vLLM's op refuses any other layout.
    return np.ascontiguousarray(firsts // block_size, dtype=np.int32)


def vllm_tables(tables: CacheTables, host_rows: np.ndarray, block_size: int,
                layer: int = 0) -> VllmTables:
    """vLLM's state for SW-1's tables: hot slot s of request r at device row r x H + s (the
    seeded rows are moved there; row r x (H + 1) + H, the newest token's, is not selectable),
    each slot's token given by its vLLM host row, hisparse's LRU order."""
    from sglang_peer import lru_order, peer_tables

    hot, requests = tables.hot_slots, host_rows.shape[0]
    if hot % HOT_PAGE_ROWS:
        raise InvalidInputError(f"vLLM's hot pages hold {HOT_PAGE_ROWS} rows; hot_slots {hot} "
                                "is not a multiple")
    rows = tables.device_kv[layer]
    seeded = rows.view(requests, hot + 1, -1)[:, :hot].clone()
    rows[: requests * hot] = seeded.reshape(requests * hot, -1)
    tokens = peer_tables(tables, host_rows, layer).buffer_tokens[:, :hot].long()
    held = torch.from_numpy(host_rows).to(tokens.device).gather(1, tokens.clamp(min=0))
    pages = requests * hot // HOT_PAGE_ROWS
    device = tokens.device
    return VllmTables(
        hot_cache=rows[: requests * hot].view(pages, HOT_PAGE_ROWS, -1),
        hot_block_table=torch.arange(pages, dtype=torch.int32, device=device).view(requests, -1),
        source_block_table=torch.from_numpy(host_pages(host_rows, block_size)).to(device),
        device_global_indices=torch.where(tokens >= 0, held + NULL_PAGE_ROWS, -1).to(
            torch.int32).contiguous(),
        lru_slots=lru_order(tables, layer).to(torch.int16).contiguous(),
        block_size=block_size)


class VllmSwapIn:
    """vLLM's two ops behind hisparse's swap-in call signature (benchmarking.sw1_cell): one
    query row per request, `max_union_rows` = K, the stats counters in `misses()`. `host_cache`
    is the pool with vLLM's null page in front (NULL_PAGE_ROWS rows before `tables.host_kv`)."""

    def __init__(self, ops: Any, host_cache: torch.Tensor, state: VllmTables,
                 rows_per_request: int = 1) -> None:
        self.ops, self.host_cache, self.state = ops, host_cache, state
        self.rows_per_request = rows_per_request
        device = state.lru_slots.device
        self.stats = torch.zeros(2, dtype=torch.uint64, device=device)
        self.buffers: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def _buffers(self, rows: int, top_k: int) -> tuple[torch.Tensor, ...]:
        if (rows, top_k) not in self.buffers:  # first (eager) call, outside any capture
            device = self.state.lru_slots.device
            per = self.rows_per_request
            self.buffers[(rows, top_k)] = (
                torch.empty(rows, top_k, dtype=torch.int32, device=device),  # hot rows
                torch.empty(rows, top_k, dtype=torch.int32, device=device),  # swap host rows
                torch.empty(rows, top_k, dtype=torch.int32, device=device),  # swap hot rows
                torch.empty(rows, dtype=torch.int32, device=device),  # swap counts
                torch.arange(rows // per, dtype=torch.int32, device=device).repeat_interleave(
                    per),  # request id of each row
                torch.arange(rows // per, dtype=torch.int32, device=device),  # state rows
            )
        return self.buffers[(rows, top_k)]

    def resolve_and_copy(self, top_k: torch.Tensor, num_valid_rows: torch.Tensor,
                         out: torch.Tensor) -> None:
        """vLLM's `_resolve_residency` then `_swap_rows` over `top_k` [rows, K] (request-
        relative positions, a request's rows adjacent); `out` gets the attention rows."""
        s = self.state
        hot_rows, swap_src, swap_dst, swap_counts, request_ids, states = self._buffers(
            *top_k.shape)
        region = s.lru_slots.shape[1]
        self.ops.hisparse_resolve_residency(
            self.host_cache, s.hot_cache, s.hot_block_table, top_k, hot_rows,
            s.device_global_indices, s.lru_slots, states, region,
            self.rows_per_request * top_k.shape[1], self.stats, out, HOT_PAGE_ROWS,
            request_ids, s.source_block_table, s.block_size, None, swap_src, swap_dst,
            swap_counts, None, 0, num_valid_rows)
        self.ops.hisparse_gather_compact(self.host_cache, s.hot_cache, swap_src, swap_dst,
                                         swap_counts)

    def misses(self) -> int:
        return int(self.stats.cpu().tolist()[1])

    def __call__(self, tables: CacheTables, layer: int, group: int, req_slots: torch.Tensor,
                 top_k: torch.Tensor, num_real: torch.Tensor, out: torch.Tensor,
                 **options: object) -> None:
        if options:
            raise InvalidInputError(f"vLLM's ops take no options (got {sorted(options)})")
        self.resolve_and_copy(top_k, num_real, out)
