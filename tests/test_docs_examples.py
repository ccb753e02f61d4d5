"""Every ```python block of README.md and docs/*.md runs here as written, on whatever device is
present (the CPU on a machine without a GPU).

A block runs in a fresh namespace and must define every name it uses: the serving framework's
side of an example (requests, an indexer, an attention kernel, a transfer engine) is written
out in the document itself, as small stand-ins a reader can see and replace. The examples
check their own results (rows byte for byte, attention against attention over the full KV),
so a block that runs has shown what it claims. A marker on the line before a block's fence
changes how it runs:

    <!-- example: NAME -->               names the block, for `uses`
    <!-- example: uses NAME -->          runs the block named NAME (same document) first, in the
                                         same namespace: shared stand-ins, written out once
    <!-- example: not run: REASON -->    not run; REASON says why (the hardware it needs; in
                                         docs/ARCHITECTURE.md also an API listing)
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.util
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import hisparse

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- example: (?P<body>\S.*\S) -->$")
# Optional packages a block may use (by the module it imports), what provides each, and the
# extra that installs it.
OPTIONAL = {"prometheus_client": ("prometheus_client", "metrics"),
            "matplotlib": ("matplotlib", "tools"),
            "hisparse.pd": ("nixl_cu12", "pd"),
            "hisparse.integrations": ("transformers", "transformers"),
            "transformers": ("transformers", "transformers")}
# Words a "not run" reason must contain: a block is left out only for hardware it needs.
HARDWARE = ("GPU", "CUDA", "ROCm", "XPU", "hardware", "NVIDIA", "AMD", "Intel")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    marker: str | None  # the marker's body: "NAME", "uses NAME" or "not run: REASON"

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        if self.marker and self.marker.startswith("not run:"):
            return self.marker.removeprefix("not run:").strip()
        return None

    @property
    def uses(self) -> str | None:
        if self.marker and self.marker.startswith("uses "):
            return self.marker.removeprefix("uses ").strip()
        return None

    @property
    def label(self) -> str | None:
        if self.marker and self.not_run is None and self.uses is None:
            return self.marker
        return None


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            marker = MARKER.match(lines[index - 1].strip()) if index else None
            blocks.append(Block(path, index + 1, "\n".join(lines[index + 1:end]) + "\n",
                                marker["body"] if marker else None))
            index = end
        index += 1
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in python_blocks(path)]


def chain(block: Block) -> list[Block]:
    """The blocks to run for `block`, in order: the ones it uses (transitively), then itself."""
    blocks = [block]
    while blocks[0].uses is not None:
        named = [b for b in BLOCKS if b.path == block.path and b.label == blocks[0].uses]
        assert len(named) == 1, (f"{blocks[0].name} uses {blocks[0].uses!r}: "
                                 f"{len(named)} blocks of {block.path.name} carry that name")
        blocks.insert(0, named[0])
        assert len(blocks) < 8, f"{block.name}: `uses` goes round in a circle"
    return blocks


def free_names(code: str) -> set[str]:
    """Names the code reads but neither assigns, imports nor defines (builtins aside)."""
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
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def missing_optional(code: str) -> str | None:
    """Why the code cannot run here (an optional package absent), or None."""
    for module in sorted(imported_modules(code)):
        for prefix, (needed, extra) in OPTIONAL.items():
            if (module == prefix or module.startswith(prefix + ".")) \
                    and importlib.util.find_spec(needed) is None:
                return f"{needed} is not installed (pip install 'hisparse[{extra}]')"
    return None


def run_blocks(blocks: list[Block]) -> dict[str, Any]:
    """Runs the blocks in one fresh namespace, printing nothing; closes the caches they built."""
    namespace: dict[str, Any] = {"__name__": "__docs_example__"}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            for block in blocks:
                exec(compile(block.code, block.name, "exec"), namespace)
    finally:
        for value in list(namespace.values()):  # free the caches' memory now
            if isinstance(value, hisparse.HiSparseCache):
                value.close()
    return namespace


# --- the tests --------------------------------------------------------------------------------
def test_every_document_with_python_has_its_blocks_here() -> None:
    names = {block.path.name for block in BLOCKS}
    assert {"README.md", "integration.md", "metrics.md", "pd.md"} <= names
    for block in BLOCKS:
        if block.not_run is not None and block.path.name != "ARCHITECTURE.md":
            assert any(word in block.not_run for word in HARDWARE), (
                f"{block.name} is marked not run ({block.not_run!r}): only a block that needs "
                "hardware may be; give any other its stand-ins and let it run")


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_the_block_defines_every_name_it_uses(block: Block) -> None:
    if block.not_run is not None:
        pytest.skip(f"marked not run: {block.not_run}")
    blocks = chain(block)
    defined: set[str] = set()
    for each in blocks:
        tree = ast.parse(each.code)
        missing = free_names(each.code) - defined
        assert not missing, (f"{each.name} uses {sorted(missing)} without defining them: "
                             "write their stand-ins into the document")
        defined |= {name for node in ast.walk(tree) for name in _bound(node)}


def _bound(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
        return {node.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    return set()


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_the_block_runs(block: Block) -> None:
    if block.not_run is not None:
        pytest.skip(f"marked not run: {block.not_run}")
    blocks = chain(block)
    reason = missing_optional("".join(b.code for b in blocks))
    if reason is not None:
        pytest.skip(reason)
    run_blocks(blocks)


def test_the_integration_check_catches_a_follower_with_its_own_top_k() -> None:
    """docs/integration.md's attention check is a real one: a loop that gives every layer its
    own top-k (on `tiny`'s index groups of 2, layer 1 then reads layer 0's rows) fails it, or
    the cache refuses the follower's tensor first."""
    stand_ins = next(b for b in BLOCKS if b.path.name == "integration.md"
                     and b.label == "framework-stand-ins")
    wrong_loop = Block(stand_ins.path, 0, """
config = hisparse.HiSparseConfig.from_preset(preset)
cache = hisparse.HiSparseCache(config, device=device)
cache.admit(req.id, len(req.prompt))
cache.write_prefill(req.id, prompt_kv)
cache.commit_prefill(req.id)
step = cache.begin_decode_step([r.id for r in batch])
for layer in range(config.num_layers):
    step.write_newest(layer, new_kv[layer])
    top_k = torch.randperm(T + 1, device=device)[:K].to(torch.int32)[None]  # every layer
    rows = cache.swap_in(layer, top_k)
    out = sparse_mla_attention(q[layer], cache.device_kv(layer), rows)
    assert torch.equal(out, sparse_mla_attention(q[layer], full_kv(layer), top_k))
""", None)
    with pytest.raises((AssertionError, hisparse.errors.HisparseError)) as caught:
        run_blocks([stand_ins, wrong_loop])
    if isinstance(caught.value, hisparse.errors.HisparseError):
        assert "anchor" in str(caught.value)


def test_a_block_that_uses_an_undefined_name_fails_the_name_check() -> None:
    """The name check itself: a block leaning on a name no block defines is reported."""
    orphan = Block(ROOT / "README.md", 0, "rows = step.swap_in(0, top_k)\n", None)
    assert free_names(orphan.code) == {"step", "top_k"}
