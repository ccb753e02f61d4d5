"""Every ```python block of README.md and docs/*.md runs here, on whatever device is present
(the CPU on a machine without a GPU).

A block runs on its own, in a fresh namespace. The names it uses but does not define are the
serving framework's (a request, its prompt's KV, an indexer, an attention kernel, a transfer
engine): `FrameworkStandIns` below defines each of them, small and in plain sight, and the
attention stand-in checks every row the cache hands it against the KV the example wrote, byte
for byte. A block that is not a program carries, on the line before its fence,
`<!-- example: not run: REASON -->`; a block using a name no stand-in defines fails.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.util
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import hisparse
from hisparse.core.requests import RequestState

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"^<!-- example: not run: (?P<reason>\S.*\S) -->$")
# Optional packages a block may import, and the extra that installs each.
OPTIONAL = {"prometheus_client": "metrics", "matplotlib": "tools", "nixl_cu12": "pd"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the marker's reason

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            marker = NOT_RUN.match(lines[index - 1].strip()) if index else None
            blocks.append(Block(path, index + 1, "\n".join(lines[index + 1:end]) + "\n",
                                marker["reason"] if marker else None))
            index = end
        index += 1
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in python_blocks(path)]


def free_names(code: str) -> set[str]:
    """Names the block reads but neither assigns, imports nor defines (builtins aside)."""
    bound: set[str] = set()
    loaded: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound - set(dir(builtins))


def imported_modules(code: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found


# --- the framework's side, as small as the examples allow -------------------------------------
PRESET = "tiny"  # 4 layers in index groups of 2: followers must get their anchor's rows
PROMPT_TOKENS = 700  # past tiny's 128 hot slots, so a step has misses
VERIFY_S = 3  # tokens per verify step in the speculative-decoding example


@dataclass
class Request:
    """A framework's request: an id and its prompt's token ids."""

    id: str
    prompt: list[int]


@dataclass(frozen=True)
class LayerQuery:
    """A layer's attention queries; the attention stand-in only needs to know the layer."""

    layer: int


@dataclass
class TransferEngine:
    """A PD transfer engine: writes a request's prompt KV into the rows the decode side
    reserved (`res.rows[p]` of every layer's host tensor holds token p), as NIXL would."""

    prompt_kv: torch.Tensor  # [L, T, W]
    wrote: list[str] = field(default_factory=list)

    def write_into(self, res: Any) -> None:
        rows = torch.from_numpy(res.rows).long()
        for layer, host in enumerate(res.host_tensors):
            host[rows] = self.prompt_kv[layer].cpu()
        self.wrote.append(res.request_id)


class FrameworkStandIns:
    """Everything the integration examples take from the serving framework, for one block.

    The indexer draws distinct positions of the one request's context; the attention kernel
    checks that the rows `swap_in` returned hold, in this layer's `device_kv`, the KV of the
    positions of the top-k in effect (the last one the indexer returned: a follower layer
    attends over its anchor's top-k)."""

    def __init__(self) -> None:
        self.config = hisparse.HiSparseConfig.from_preset(PRESET)
        self.preset = PRESET
        self.device = hisparse.get_backend().device()
        config = self.config
        generator = torch.Generator().manual_seed(26)
        self.req = Request("req-0", list(range(PROMPT_TOKENS)))
        self.batch = [self.req]
        self.num_tokens = PROMPT_TOKENS
        shape = (config.num_layers, PROMPT_TOKENS, config.row_bytes)
        self.prompt_kv = torch.randint(0, 256, shape, dtype=torch.uint8,
                                       generator=generator).to(self.device)
        self.new_kv = torch.randint(0, 256, (config.num_layers, len(self.batch),
                                             config.row_bytes), dtype=torch.uint8,
                                    generator=generator).to(self.device)
        # A verify step's S tokens per request (speculative decoding): [L, B, S, W].
        self.draft_kv = torch.randint(0, 256, (config.num_layers, len(self.batch), VERIFY_S,
                                               config.row_bytes), dtype=torch.uint8,
                                      generator=generator).to(self.device)
        self.hidden = None  # the model's hidden states: the stand-in indexer needs none
        self.q = [LayerQuery(layer) for layer in range(config.num_layers)]
        self.transfer_engine = TransferEngine(self.prompt_kv)
        self._generator = generator
        self._top_k: torch.Tensor | None = None
        self.indexed_layers: list[int] = []
        self.attended_layers: list[int] = []
        self._cache: hisparse.HiSparseCache | None = None

    @property
    def cache(self) -> hisparse.HiSparseCache:
        """The framework's cache, for a block that continues the integration example."""
        if self._cache is None:
            self._cache = hisparse.HiSparseCache(self.config, device=self.device)
        return self._cache

    def indexer(self, layer: int, hidden: Any) -> torch.Tensor:
        positions = torch.randperm(PROMPT_TOKENS + 1, generator=self._generator)
        self._top_k = positions[:self.config.top_k].to(torch.int32)[None].to(self.device)
        self.indexed_layers.append(layer)
        return self._top_k

    def verify_indexer(self, layer: int, hidden: Any, positions: Any) -> torch.Tensor:
        """`[B, S, K]`: query token s draws from the positions up to its own (the prompt and
        the drafts before it), rows overlapping as consecutive drafts' do."""
        S, K = VERIFY_S, self.config.top_k
        rows = [torch.randperm(PROMPT_TOKENS + s + 1, generator=self._generator)[:K]
                for s in range(S)]
        self._top_k = torch.stack(rows).to(torch.int32)[None].to(self.device)
        self.indexed_layers.append(layer)
        return self._top_k

    def verify_attention(self, q: LayerQuery, kv: torch.Tensor,
                         rows: torch.Tensor) -> torch.Tensor:
        assert self._top_k is not None and self._top_k.dim() == 3, "verify_indexer first"
        layer = q.layer
        every_row = torch.cat([self.prompt_kv[layer], self.draft_kv[layer, 0]])
        if not torch.equal(kv[rows[0].long()], every_row[self._top_k[0].long()]):
            raise AssertionError(f"layer {layer}: verify rows differ from their KV")
        self.attended_layers.append(layer)
        return kv[rows[0].long()]

    def verify_sampler(self, batch: list[Request]) -> list[int]:
        """How many of each request's S tokens the target model accepted (1..S)."""
        return [int(torch.randint(1, VERIFY_S + 1, (1,), generator=self._generator))
                for _ in batch]

    def sparse_mla_attention(self, q: LayerQuery, kv: torch.Tensor,
                             rows: torch.Tensor) -> torch.Tensor:
        assert self._top_k is not None, "attention before any indexer call"
        layer = q.layer
        every_row = torch.cat([self.prompt_kv[layer], self.new_kv[layer]])  # [T + 1, W]
        expected = every_row[self._top_k[0].long()]
        got = kv[rows[0].long()]
        if not torch.equal(got, expected):
            raise AssertionError(f"layer {layer}: rows differ from its KV")
        self.attended_layers.append(layer)
        return got  # stands for the attention output

    def namespace(self, names: set[str]) -> dict[str, Any]:
        unknown = sorted(name for name in names if not hasattr(self, name))
        assert not unknown, f"no stand-in defines {unknown}: define it in this test"
        return {name: getattr(self, name) for name in names}

    def check_after(self, names: set[str]) -> None:
        """What a block that used the stand-ins must have done with them."""
        layers = list(range(self.config.num_layers))
        if "sparse_mla_attention" in names or "verify_attention" in names:
            assert self.attended_layers == layers
            # One indexer per index group, on its anchor layer.
            assert self.indexed_layers == layers[::self.config.index_group_size]
        if "transfer_engine" in names:
            assert self.transfer_engine.wrote == [self.req.id]
            assert self.cache.request_state(self.req.id) is RequestState.RUNNING

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()


# --- the tests --------------------------------------------------------------------------------
def test_every_document_with_python_has_its_blocks_here() -> None:
    names = {block.path.name for block in BLOCKS}
    assert {"README.md", "integration.md", "metrics.md", "ARCHITECTURE.md"} <= names
    for block in BLOCKS:
        if block.not_run is not None:
            assert len(block.not_run.split()) >= 4, f"{block.name}: say why it does not run"


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_the_block_runs(block: Block) -> None:
    if block.not_run is not None:
        pytest.skip(f"marked not run: {block.not_run}")
    for module in imported_modules(block.code) & OPTIONAL.keys():
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install 'hisparse[{OPTIONAL[module]}]')")
    names = free_names(block.code)
    stand_ins = FrameworkStandIns()
    namespace = {"__name__": "__docs_example__", **stand_ins.namespace(names)}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block.code, block.name, "exec"), namespace)
        stand_ins.check_after(names)
    finally:
        for value in namespace.values():  # the caches a block built: free their memory now
            if isinstance(value, hisparse.HiSparseCache):
                value.close()
        stand_ins.close()


def test_the_attention_stand_in_catches_a_follower_with_its_own_top_k() -> None:
    """The README's old loop gave every layer its own top-k; on `tiny` (groups of 2) layer 1
    silently got layer 0's rows. The stand-ins catch exactly that."""
    old_loop = """
config = hisparse.HiSparseConfig.from_preset(preset, max_requests=64)
cache = hisparse.HiSparseCache(config, device=device)
cache.admit(req.id, len(req.prompt))
for layer in range(config.num_layers):
    cache.write_prefill(req.id, prompt_kv[layer], layer=layer)
cache.commit_prefill(req.id)
step = cache.begin_decode_step([r.id for r in batch])
for layer in range(config.num_layers):
    cache.write_newest(layer, new_kv[layer])
    top_k = indexer(layer, hidden)
    rows = cache.swap_in(layer, top_k)
    out = sparse_mla_attention(q[layer], cache.device_kv(layer), rows)
"""
    stand_ins = FrameworkStandIns()
    namespace = {"hisparse": hisparse, **stand_ins.namespace(free_names(old_loop) - {"hisparse"})}
    try:
        # Where the engine itself refuses a follower's different top-k (a HisparseError naming
        # the anchor), it refuses first; else the stand-in's byte check fails.
        with pytest.raises((AssertionError, hisparse.errors.HisparseError)) as caught:
            exec(compile(old_loop, "old README loop", "exec"), namespace)
        if isinstance(caught.value, AssertionError):
            assert str(caught.value) == "layer 1: rows differ from its KV"
        else:
            assert "anchor" in str(caught.value)
    finally:
        namespace["cache"].close()
