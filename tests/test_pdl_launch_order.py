"""The launch order of the swap-in kernels under programmatic dependent launch, as compiled.

With PDL a kernel may start before the one ahead of it in the stream has finished, so what it
does before its `griddepcontrol.wait` races with that kernel. The kernels are compiled for
sm_90 (no GPU needed: triton's own ptxas), and their PTX must keep three rules:
- the selection lets its dependents launch only after its own wait. Triggered at its start,
  the copy ran while the classify grid still did, which on an H200 shared by 8 processes gave
  illegal addresses and wrong rows once per ~27k calls (benchmarks/NOTES.md, sixteenth pass);
- the selection reads nothing but its row context (written before the classify kernel began)
  and stores nothing before its wait;
- the copies store nothing before their wait, and the planned copy loads nothing either (its
  plan is the selection's output; the prefetching copy reads classify output, done by then).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: triton must first be imported after interpreted_kernels sets
# TRITON_INTERPRET=1, or the interpreted kernel tests in this process break.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install 'hisparse[triton]')")

ROOT = Path(__file__).resolve().parent.parent

# Compiled in a process of its own: the kernel tests set TRITON_INTERPRET=1 in this one, and
# the interpreter compiles nothing.
COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hisparse.kernels.swap_in import copy, lookup, pdl, select

from triton.backends import backends

if "nvidia" not in backends:  # a ROCm or XPU build of triton
    print(json.dumps({"skip": f"this triton ({triton.__version__}) has no NVIDIA backend"}))
    sys.exit(0)
if not pdl.HAVE_GDC:
    print(json.dumps({"skip": f"triton {triton.__version__} has no grid dependency control"}))
    sys.exit(0)
POINTER_TYPES = {"resident_ptr": "*i16", "counters_ptr": "*i64"}
SHARED = {"EARLY_LOADS": True, "POSITION_KEYED": False, "USE_PDL": True,
          "ADDRESS_ORDER": False, "NUM_BUCKETS": 16}
KERNELS = {
    "classify": (lookup.classify_kernel, 4, {**SHARED, "COUNTER_SEM": "relaxed", "CHUNK_K": 16}),
    "select": (select.select_kernel, 4, {**SHARED, "FAST_ROUNDS": 2, "BLOCK_K": 16,
                                     "BLOCK_H": 32}),
    "copy": (copy.copy_kernel, 2, {"ROW_WORDS": 4, "BLOCK_WORDS": 4, "BLOCK_BATCH": 4,
                                 "ROWS": 2, "USE_PDL": True}),
    "prefetched_copy": (copy.copy_prefetched_kernel, 2, {"ROW_WORDS": 4, "BLOCK_WORDS": 4,
                                                       "ROWS": 2, "USE_PDL": True,
                                                       "MISS_ROW_CACHE": ".cg"}),
}
ptx = {}
for name, (fn, warps, constants) in KERNELS.items():
    names = [p.name for p in fn.params]
    signature = {n: "constexpr" if n in constants else
                 POINTER_TYPES.get(n, "*i32") if n.endswith("_ptr") else "i32" for n in names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(n),): v for n, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "launch_pdl": True})
    ptx[name] = compiled.asm["ptx"]
print(json.dumps({"ptx": ptx}))
"""

# The instructions that order a kernel against its neighbours, in program order.
EVENT = re.compile(r"griddepcontrol\.(wait|launch_dependents)|\b(ld|st|atom|red)\.global")


def events(ptx: str) -> list[str]:
    return [m.group(1) or m.group(2) for m in EVENT.finditer(ptx)]


@pytest.fixture(scope="module")
def kernel_events() -> dict[str, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    if "skip" in answer:
        pytest.skip(answer["skip"])
    return {name: events(ptx) for name, ptx in answer["ptx"].items()}


def before_wait(sequence: list[str]) -> list[str]:
    assert sequence.count("wait") == 1, sequence
    return sequence[: sequence.index("wait")]


def test_the_selection_lets_the_copy_launch_only_after_its_own_wait(
        kernel_events: dict[str, list[str]]) -> None:
    select = kernel_events["select"]
    assert select.count("launch_dependents") == 1, select
    assert select.index("launch_dependents") > select.index("wait"), select


def test_the_selection_only_reads_its_row_context_before_its_wait(
        kernel_events: dict[str, list[str]]) -> None:
    early = before_wait(kernel_events["select"])
    # num_real, the request slot, its sequence length and its LRU clock.
    assert early == ["ld"] * 4, early


def test_the_copies_store_nothing_before_their_wait(
        kernel_events: dict[str, list[str]]) -> None:
    assert before_wait(kernel_events["copy"]) == []
    assert set(before_wait(kernel_events["prefetched_copy"])) == {"ld"}
    for name in ("copy", "prefetched_copy"):
        assert "launch_dependents" not in kernel_events[name], name


def test_the_classify_kernel_lets_the_selection_launch_at_its_start(
        kernel_events: dict[str, list[str]]) -> None:
    """The classify kernel itself is launched normally (it waits for all earlier work): its
    trigger first lets the selection's launch overlap it, and it has no wait."""
    classify = kernel_events["classify"]
    assert classify[0] == "launch_dependents" and "wait" not in classify, classify
