"""The launch order of the swap-in kernels under programmatic dependent launch, as compiled.

With PDL a kernel may start before the one ahead of it in the stream has finished, so what it
does before its `griddepcontrol.wait` races with that kernel. The kernels are compiled for
sm_90 as the launch code launches them there (no GPU needed: triton's own ptxas, through
kernels/targets.py), and their PTX must keep three rules:
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
import re

import pytest

from hisparse.kernels.targets import run_in_subprocess

# Not imported here: triton must first be imported after interpreted_kernels sets
# TRITON_INTERPRET=1, or the interpreted kernel tests in this process break.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install 'hisparse[triton]')")

# The launches of a B=1 step (classify, select, prefetching copy) and a B=16 one with the
# prefetching copy turned off (the planned copy), as the launch code makes them on an sm_90
# device with PDL asked for (`Tuning.pdl`, off by default; kernels/compile_variants.py),
# compiled in a process of their own: the kernel tests set TRITON_INTERPRET=1 in this one.
SCENARIOS = ("B=1 fp8 extents, PDL", "B=16 fp8 extents, planned copy behind PDL")
NAMES = {"copy_prefetched": "prefetched_copy"}

# The instructions that order a kernel against its neighbours, in program order.
EVENT = re.compile(r"griddepcontrol\.(wait|launch_dependents)|\b(ld|st|atom|red)\.global")


def events(ptx: str) -> list[str]:
    return [m.group(1) or m.group(2) for m in EVENT.finditer(ptx)]


@pytest.fixture(scope="module")
def kernel_events() -> dict[str, list[str]]:
    extra = ["--asm", "ptx", *(f"--scenario={label}" for label in SCENARIOS)]
    entry = run_in_subprocess(["cuda:sm_90"], extra=extra, timeout=600)["targets"][0]
    if not entry["variants"]:
        pytest.skip(entry["reason"])  # this triton has no NVIDIA backend
    failed = [f"{v['kernel']} ({v['variant']}): {v['error']}" for v in entry["variants"]
              if v["error"]]
    assert not failed, failed
    ptx: dict[str, str] = {}
    for variant in entry["variants"]:
        if variant["pdl"]:
            ptx.setdefault(NAMES.get(variant["kernel"], variant["kernel"]), variant["asm"]["ptx"])
    if not ptx:  # the launch code uses PDL only where triton has grid dependency control
        pytest.skip("this triton has no grid dependency control: no launch uses PDL")
    assert set(ptx) == {"classify", "select", "copy", "prefetched_copy"}, sorted(ptx)
    return {name: events(text) for name, text in ptx.items()}


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
