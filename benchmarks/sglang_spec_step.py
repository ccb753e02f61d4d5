"""SGLang 0.5.23's speculative verify step as its coordinator runs one, outside SGLang (the
`sglang_step` column of SW-2, benchmarks/peers_sw2.py).

Around its swap-in kernel SGLang's EAGLE worker calls `HiSparseCoordinator.prepare_spec_verify`
and `commit_spec_accept_tokens`, that is `HiSparseSpecSwapManager.prepare_verify` and
`commit_accept_tokens` (sglang/srt/managers/hisparse_coordinator.py). They need SGLang's
coordinator, memory pools and batch, hence its serving stack. Here each method that the step runs
is read from the user's copy at run time (nothing of SGLang is kept in this repository), compiled
alone from its `ast` with the few module-level names it uses, and called on stand-ins holding the
fields it reads (a module-level name the harness does not provide raises on any use):

  * `HiSparseSpecSwapManager.prepare_verify`: binds the S verify tokens to columns H+1.. of the
    request's extra page (tokens and locations) and maps their KV slots to those rows;
  * the spec swap-in (`load_cache_to_device_buffer_spec_mla`, benchmarks/sglang_ops.py);
  * `HiSparseSpecSwapManager.commit_accept_tokens`: a device-to-device copy of the accepted rows
    into their persistent columns through `HiSparseDSATokenToKVPool.transfer_values_on_device`
    (sglang/srt/mem_cache/hisparse_memory_pool.py: the Triton `copy_all_layer_kv_cache_func`
    of sglang/kernels/ops/kvcache/cache_move.py, 256 rows a launch), then
    `_backup_device_locs_to_host`: `HiSparseCoordinator.wait_for_pending_backup` and
    `MLATokenToKVPoolHost.backup_from_device_all_layer` (sglang/srt/mem_cache/pool_host/mla.py,
    io_backend "kernel", layer_first) on a side stream, which the current stream then waits
    for; then the mapping and table updates.

The backup: where SGLang's `can_use_hicache_jit_kernel` holds, its host pool calls its JIT
`transfer_hicache_all_layer_mla` (sglang/kernels/ops/kvcache/hicache.py; for 656-byte rows the
TMA variant, sm90 and later), which is what runs here; elsewhere SGLang calls sgl_kernel's
compiled `transfer_kv_all_layer_mla`, which this harness does not build: the column is then
refused with that reason. The host pool's pointer table holds the raw host address, as SGLang's
`make_kernel_ptr_table` does on CUDA without sgl_kernel's `get_device_accessible_ptr`.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import dis
import hashlib
import importlib
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hisparse.errors import InvalidInputError
from sglang_ops import STEP_FILES

COORDINATOR = "sglang/srt/managers/hisparse_coordinator.py"
DEVICE_POOL = "sglang/srt/mem_cache/hisparse_memory_pool.py"
HOST_POOL = "sglang/srt/mem_cache/pool_host/mla.py"
DCP_LAYOUT = "sglang/srt/layers/dcp/layout.py"
# name -> (file, class or None for a module-level function) of every SGLang function the step
# runs, compiled in this order (later ones may call earlier ones by their module-level name).
METHODS: dict[str, tuple[str, str | None]] = {
    "maybe_dcp_kernel_indices": (DCP_LAYOUT, None),
    "prepare_verify": (COORDINATOR, "HiSparseSpecSwapManager"),
    "_backup_device_locs_to_host": (COORDINATOR, "HiSparseSpecSwapManager"),
    "commit_accept_tokens": (COORDINATOR, "HiSparseSpecSwapManager"),
    "wait_for_pending_backup": (COORDINATOR, "HiSparseCoordinator"),
    "transfer_values_on_device": (DEVICE_POOL, "HiSparseDSATokenToKVPool"),
    "backup_from_device_all_layer": (HOST_POOL, "MLATokenToKVPoolHost"),
}
# Compiles a method with its annotations left as strings (they name SGLang's serving types).
FUTURE_ANNOTATIONS = importlib.import_module("__future__").annotations.compiler_flag
# SGLang's DSA KV page: the extra page after the H hot columns (newest token, verify tokens).
PAGE = 64


class Absent:
    """A module-level name of an SGLang file that this harness does not provide (a branch the
    benchmark's pools never take): calling it, testing it or reading from it raises."""

    def __init__(self, name: str, where: str) -> None:
        self._name, self._where = name, where

    def _refuse(self) -> InvalidInputError:
        return InvalidInputError(f"{self._where} reached `{self._name}`, which the SW-2 harness "
                                 "does not provide (a pool or branch it does not stand in for)")

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise self._refuse()

    def __bool__(self) -> bool:
        raise self._refuse()

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise self._refuse()


@dataclasses.dataclass
class Kernels:
    """What SGLang's step methods launch, by their module-level names: the device module
    (`get_device_module()`), the Triton row copy and the host pool's JIT backup."""

    device_module: Any
    copy_all_layer_kv_cache_func: Callable[..., None]
    transfer_hicache_all_layer_mla: Callable[..., None]
    can_use_hicache_jit_kernel: Callable[..., bool]


@dataclasses.dataclass
class StepCode:
    """SGLang's step methods compiled from `root`, by name, and the kernels they call."""

    root: Path
    kernels: Kernels
    methods: dict[str, Callable[..., Any]]


def missing_files(root: Path) -> list[str]:
    return [name for name in STEP_FILES if not (root / name).is_file()]


def check_root(root: Path) -> None:
    """Refuse a copy of SGLang without the files the step reads or imports."""
    missing = missing_files(root)
    if missing:
        raise InvalidInputError(
            f"SGLang at {root} lacks {', '.join(missing)}: SGLang's verify step (the sglang_step "
            "column) runs its coordinator's and pools' own methods from these files; copy them "
            "from the sglang-0.5.23 wheel beside the others")


def global_names(code: types.CodeType) -> set[str]:
    """The global names a code object and the code nested in it load."""
    names = {ins.argval for ins in dis.get_instructions(code)
             if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def compile_function(root: Path, file: str, owner: str | None, name: str,
                     names: dict[str, Any]) -> Callable[..., Any]:
    """`owner.name` (or the module-level `name`) of `root/file`, compiled alone with `names` for
    the module-level names it uses (others: `Absent`). Annotations stay unevaluated."""
    path = root / file
    if not path.is_file():
        raise InvalidInputError(f"SGLang at {root} lacks {file}, which holds "
                                f"{owner + '.' if owner else ''}{name}")
    tree = ast.parse(path.read_text(), filename=str(path))
    scope: list[ast.stmt] = tree.body
    if owner is not None:
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner]
        scope = classes[0].body if classes else []
    found = [n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name]
    where = f"{file}: {owner + '.' if owner else ''}{name}"
    if not found:
        raise InvalidInputError(f"{where} not found: not SGLang 0.5.23's layout")
    if found[0].decorator_list:
        raise InvalidInputError(f"{where} is decorated; the harness would not apply that")
    code = compile(ast.Module(body=[found[0]], type_ignores=[]), str(path), "exec",
                   flags=FUTURE_ANNOTATIONS, dont_inherit=True)
    namespace: dict[str, Any] = {"__name__": f"sglang_step:{name}"}
    for used in global_names(code) - set(dir(builtins)):
        namespace[used] = names[used] if used in names else Absent(used, where)
    exec(code, namespace)  # defines the one function, nothing else
    return namespace[name]


def load_step(root: Path, kernels: Kernels) -> StepCode:
    """SGLang's step methods from the user's copy at `root`, bound to `kernels`."""
    check_root(root)
    names: dict[str, Any] = {
        "torch": torch, "device_module": kernels.device_module,
        "copy_all_layer_kv_cache_func": kernels.copy_all_layer_kv_cache_func,
        "jit_transfer_hicache_all_layer_mla": kernels.transfer_hicache_all_layer_mla}
    methods: dict[str, Callable[..., Any]] = {}
    for name, (file, owner) in METHODS.items():
        methods[name] = compile_function(root, file, owner, name, names)
        if owner is None:
            names[name] = methods[name]
    return StepCode(root, kernels, methods)


def cuda_kernels() -> Kernels:
    """SGLang's Triton copy and JIT backup from the copy `sglang_ops.load` registered."""
    utils = sys.modules.get("sglang.srt.utils")
    if utils is None:
        raise InvalidInputError("load SGLang's ops first (sglang_ops.load)")
    if not hasattr(utils, "is_cpu"):  # cache_move.py's one serving utility
        utils.is_cpu = lambda: False  # type: ignore[attr-defined]
    cache_move = importlib.import_module("sglang.kernels.ops.kvcache.cache_move")
    hicache = importlib.import_module("sglang.kernels.ops.kvcache.hicache")
    return Kernels(torch.cuda, cache_move.copy_all_layer_kv_cache_func,
                   hicache.transfer_hicache_all_layer_mla, hicache.can_use_hicache_jit_kernel)


def describe(root: Path) -> dict[str, object]:
    """What a results file records about the step's SGLang code."""
    digest = hashlib.sha256()
    for name in STEP_FILES:
        digest.update((root / name).read_bytes())
    return {"source": str(root), "files_sha256": digest.hexdigest(),
            "methods": [f"{owner}.{name}" if owner else name
                        for name, (_, owner) in METHODS.items()],
            "how": "SGLang's own method sources compiled from the user's copy and called on "
                   "stand-in pools (benchmarks/sglang_spec_step.py)"}


def device_pool(rows: torch.Tensor, code: StepCode) -> types.SimpleNamespace:
    """HiSparseDSATokenToKVPool as its `transfer_values_on_device` reads it: one layer of
    `rows` [slots, row bytes] uint8, its pointer and row stride tables."""
    pool = types.SimpleNamespace(kv_buffer=[rows], layer_num=1,
                                 bytes_per_token=rows.shape[1] * rows.element_size())
    pool.data_ptrs = torch.tensor([rows.data_ptr()], dtype=torch.uint64, device=rows.device)
    pool.data_strides = torch.full_like(pool.data_ptrs, pool.bytes_per_token)
    pool.transfer_values_on_device = types.MethodType(
        code.methods["transfer_values_on_device"], pool)
    return pool


def host_pool(rows: torch.Tensor, device: types.SimpleNamespace,
              code: StepCode) -> types.SimpleNamespace:
    """MLATokenToKVPoolHost (layer_first, one layer, no DCP) as its
    `backup_from_device_all_layer` reads it, over the host rows [tokens, row bytes]."""
    width = rows.shape[1] * rows.element_size()
    can_use_jit = code.kernels.can_use_hicache_jit_kernel(page_size=PAGE, element_size=width)
    if not can_use_jit:
        raise InvalidInputError(
            f"SGLang's JIT HiCache kernel does not take {width}-byte rows on this device "
            "(can_use_hicache_jit_kernel is False): SGLang would back up through sgl_kernel's "
            "transfer_kv_all_layer_mla, which this harness does not build")
    pool = types.SimpleNamespace(
        _is_dummy=False, _layer_shard_enabled=False, dcp_size=1, dcp_rank=0,
        layout="layer_first", page_size=PAGE, layer_num=1, kv_cache_dim=rows.shape[1],
        dtype=rows.dtype, token_stride_size=width, device_row_stride_bytes=width,
        device_rows_packed=True, can_use_jit=can_use_jit, kv_buffer=rows.unsqueeze(0),
        data_refs=[rows], device_data_ptrs=device.data_ptrs,
        device_kv_buffers=tuple(device.kv_buffer),
        alloc_paged_token_slots=Absent("alloc_paged_token_slots", "prepare_verify"))
    pool.data_ptrs = torch.tensor([rows.data_ptr()], dtype=torch.uint64,
                                  device=device.data_ptrs.device)
    pool.backup_from_device_all_layer = types.MethodType(
        code.methods["backup_from_device_all_layer"], pool)
    return pool


class SpecStepPeer:
    """SGLang's verify step on a SpecPeer (benchmarks/peers_sw2.py) of its own: prepare_verify,
    the spec swap-in, commit_accept_tokens, as SGLang's coordinator runs them.

    Its coordinator stand-in holds the very tables the spec kernel reads (tokens and locations
    as `[1, R, H + P]` views, host locations), `req_to_device_buffer` (each column's device row
    as allocated), a KV slot per verify token (SGLang's full-pool slots, 1..B S; `req_to_token`
    holds them at positions L..L+S-1) and its mapping to device rows. Each request's positions
    L..L+P-1 get a host page of their own, rows `spare_first + b P ..` of the spec peer's host
    pool, where commit backs up the S verify rows (accepted and rejected). `seq_lens` (L per
    request) stay as given: each step binds the same verify tokens and does the same work."""

    def __init__(self, spec: Any, code: StepCode, seq_lens: Sequence[int], S: int,
                 spare_first: int) -> None:
        B, dev, hot = spec.tokens.shape[0], spec.tokens.device, spec.hot
        self.spec, self.S = spec, S
        if spare_first + B * PAGE > spec.host_cache.shape[0]:
            raise InvalidInputError("the host pool has no spare page per request")
        if max(seq_lens) + PAGE > spec.host_locs.shape[1]:
            raise InvalidInputError("the host locations do not reach the verify positions")
        lengths = torch.tensor(list(seq_lens), dtype=torch.int64)
        verify = 1 + torch.arange(B * S, dtype=torch.int64, device=dev)
        req_to_token = torch.zeros(B, int(lengths.max()) + PAGE, dtype=torch.int32, device=dev)
        for b in range(B):
            first = int(lengths[b])
            spec.host_locs[b, first: first + PAGE] = spare_first + b * PAGE + torch.arange(PAGE)
            req_to_token[b, first: first + S] = verify[b * S: (b + 1) * S].to(torch.int32)
        pool = device_pool(spec.device, code)
        streams = code.kernels.device_module
        coordinator = types.SimpleNamespace(
            page_size=PAGE, device_buffer_size=hot,
            req_to_device_buffer=spec.locs.to(torch.int64),
            req_device_buffer_tokens=spec.tokens.unsqueeze(0),
            req_device_buffer_token_locs=spec.locs.unsqueeze(0),
            req_to_host_pool=spec.host_locs,
            req_to_host_pool_allocated_len=lengths + PAGE,
            token_to_kv_pool_allocator=types.SimpleNamespace(
                full_to_hisparse_device_index_mapping=torch.zeros(
                    1 + B * S + PAGE, dtype=torch.int64, device=dev)),
            req_to_token_pool=types.SimpleNamespace(req_to_token=req_to_token),
            mem_pool_device=pool, mem_pool_host=host_pool(spec.host_cache, pool, code),
            decode_backup_stream=streams.Stream(), decode_producer_stream=None,
            _backup_done_event=streams.Event(), _has_pending_backup=False,
            _skip_first_backup=[False] * B)
        coordinator.wait_for_pending_backup = types.MethodType(
            code.methods["wait_for_pending_backup"], coordinator)
        manager = types.SimpleNamespace(_coordinator=coordinator, num_draft_tokens=S,
                                        enabled=True)
        for name in ("prepare_verify", "_backup_device_locs_to_host", "commit_accept_tokens"):
            setattr(manager, name, types.MethodType(code.methods[name], manager))
        self.coordinator, self.manager = coordinator, manager
        self.batch = types.SimpleNamespace(
            req_pool_indices=spec.slots, out_cache_loc=verify,
            seq_lens=lengths.to(dev), forward_mode=types.SimpleNamespace(is_idle=lambda: False),
            reqs=[types.SimpleNamespace(kv=types.SimpleNamespace(
                req_pool_idx=b, kv_allocated_len=int(lengths[b]) + S)) for b in range(B)])

    def settle(self) -> None:
        """An untimed prepare and commit, each request keeping one verify token: the state a
        verify step leaves, column H holding the newest token (position L, past what SW-2's
        top-k names). Then no row a swap-in returns is one that its step's commit overwrites:
        SGLang's attention reads those rows before the commit, the byte check after it."""
        self.manager.prepare_verify(self.batch)
        self.manager.commit_accept_tokens(self.batch, self.stage([1] * len(self.batch.reqs)))

    def stage(self, accepted: Sequence[int]) -> torch.Tensor:
        """SGLang's `accept_index` [B, S] int32 for these accept counts (its sampler's: request
        b's kept tokens are verify slots b S + s, s < accepted[b], the rest -1), made before the
        timed call since SGLang's sampler leaves it on the device."""
        B, S = len(accepted), self.S
        index = torch.full((B, S), -1, dtype=torch.int32)
        for b, count in enumerate(accepted):
            index[b, :count] = b * S + torch.arange(count, dtype=torch.int32)
        return index.to(self.spec.tokens.device)

    def __call__(self, top_k: torch.Tensor, accept_index: torch.Tensor) -> None:
        self.manager.prepare_verify(self.batch)
        self.spec(top_k)
        self.manager.commit_accept_tokens(self.batch, accept_index)

    @property
    def tokens(self) -> torch.Tensor:
        return self.spec.tokens

    @property
    def out(self) -> torch.Tensor:
        return self.spec.out

    @property
    def state(self) -> Any:
        return self.spec.state

    def rows(self) -> torch.Tensor:
        return self.spec.device
