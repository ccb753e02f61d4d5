"""Every Triton kernel, in every variant the launch code chooses, built for the GPUs CI lacks.

Targets: cuda:sm_90 (H100/H200), cuda:sm_100 (B200), hip:gfx942 (MI300X), hip:gfx950 (MI355X),
and xpu:pvc where the Intel Triton backend is installed (it skips, with the reason, where it
is not). Stock Triton wheels build for NVIDIA and AMD on a CPU machine, so this runs in CI.

The variants are those the launch functions pick (kernels/compile_variants.py, `compile_variants()`,
which also gives the coverage argument: every value of every launch-time switch, the
switches that share a code path crossed, the shipped shapes and the hot-buffer sizes where
the selection changes code). What a CPU can check of a build, and is checked here:
- it compiles (a failure names the kernel, the variant and the target);
- it fits the target as a device would check at load time (threads per block against what
  the build can launch, shared memory / LDS against the device's) and in registers;
- it spills only where the NVIDIA build spills today;
- griddepcontrol (programmatic dependent launch) appears exactly in the PDL launches, and
  only on targets whose table has PDL (AMD and Intel: never);
- 64-lane targets get 64-lane builds: the wave size of the code object, the layouts, and
  blocks of num_warps x 64 threads (the count the launch code's warps become there).
Whether a reduction gives the right value on 64 lanes is Triton's lowering, proven only by
running it; the interpreter tests prove the kernels' semantics.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from hisparse.kernels.targets import NEEDS_INTEL_BACKEND, TARGETS, CompileJob, find_target

# Not imported here: triton must first be imported after interpreted_kernels sets
# TRITON_INTERPRET=1; the builds happen in child processes without it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install 'hisparse[triton]')")

# Two child processes at once, one per core of the CI box (about 30 s each, cold).
GROUPS = (("cuda:sm_90", "hip:gfx942", "xpu:pvc"), ("cuda:sm_100", "hip:gfx950"))
TARGET_NAMES = [t.name for t in TARGETS]
KERNELS = {"classify", "select", "copy", "copy_prefetched", "complete_union", "backup", "newest",
           "advance"}

# Builds known not to fit their target (none today). The selection's launch once gave a
# program 32 warps counted as 32-lane ones (H > 8192): 2048 threads on AMD's 64-lane waves,
# which AMD refuses, and at H=32768 more LDS than a workgroup may use. The launch plan caps
# the warps at 1024 lanes of the target's width now (DeviceTraits.warp_size), and both fit.
KNOWN_PROBLEMS: dict[tuple[str, str, str], str] = {}
# The NVIDIA builds that spill today: the selection at 32 warps, where 1024 threads per block
# leave each 64 registers (ptxas caps them to fit), for H > 8192, and for a verify row of
# 8192 or 16384 entries (S = 4 or 8 at K = 2048) at 16 or 32 warps: without the union in the
# swap-in the same builds spill 8 and 114 slots on sm_90, with it (its first-entry test; the
# copy completes the union) 12 and 144, and 146 where the first entries are all read from
# the presence table (verify_first_candidates off).
NVIDIA_SPILLS_TODAY = {("select", "B=1 H=16384"), ("select", "B=1 H=32768 int32 residency"),
                       ("select", "B=16 verify S=4, union in the swap-in, by position"),
                       ("select", "B=128 verify S=8, union in the swap-in"),
                       ("select", "B=1 verify S=8, first entries by the table alone")}


@pytest.fixture(scope="module")
def builds(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    chosen = request.config.getoption("--backend")
    if chosen not in (None, "cpu"):  # a GPU job: the device runs the kernels themselves
        pytest.skip(f"compile-only builds for other targets: the CPU job runs them, not "
                    f"--backend {chosen}")
    jobs = [CompileJob(group) for group in GROUPS]
    reports = [job.result(timeout=1500) for job in jobs]
    found = {}
    for report in reports:
        assert "error" not in report, report["error"]
        for entry in report["targets"]:
            found[entry["target"]] = {**entry, "triton": report["triton"]}
    return found


def built(builds: dict[str, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The target's builds; skips where this triton has no backend for it."""
    entry = builds[name]
    target = find_target(name)
    if not entry["variants"] and entry["reason"] and (
            entry["reason"] == target.missing_backend or "has no" in entry["reason"]):
        pytest.skip(f"{name}: {entry['reason']}")
    assert entry["variants"], f"{name}: nothing was built: {entry['reason']}"
    return entry["variants"]


def where(variant: dict[str, Any], name: str) -> str:
    return f"{variant['kernel']} ({variant['variant']}) on {name}"


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_every_kernel_variant_compiles(builds, name: str) -> None:
    variants = built(builds, name)
    failures = [f"{where(v, name)}: {v['error']}" for v in variants if v["error"]]
    assert not failures, f"triton {builds[name]['triton']}:\n" + "\n".join(failures)
    assert {v["kernel"] for v in variants} == KERNELS


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_every_value_of_every_launch_switch_is_built(builds, name: str) -> None:
    """The coverage claim of compile_variants(), held against what was built."""
    pdl = {True, False} if find_target(name).pdl else {False}
    expected = {
        "classify": {"EARLY_LOADS": {True, False}, "POSITION_KEYED": {True, False},
                     "KEY_EXTENTS": {True, False}, "USE_PDL": pdl,
                     "COUNTER_SEM": {"relaxed", "acq_rel"}, "ADDRESS_ORDER": {True, False},
                     "WRITE_NEWEST": {True, False}, "BACKUP_NEWEST": {True, False}},
        "select": {"EARLY_LOADS": {True, False}, "POSITION_KEYED": {True, False},
                   "KEY_EXTENTS": {True, False}, "USE_PDL": pdl, "ADDRESS_ORDER": {True, False}},
        "copy": {"USE_PDL": pdl},
        "copy_prefetched": {"USE_PDL": pdl, "MISS_ROW_CACHE": {".cg" if p else "" for p in pdl}},
    }
    variants = built(builds, name)
    for kernel, switches in expected.items():
        for switch, values in switches.items():
            seen = {v["constexprs"][switch] for v in variants if v["kernel"] == kernel}
            assert seen == values, f"{kernel}.{switch} on {name}: built {seen}, not {values}"
    hot = {v["constexprs"]["BLOCK_H"] for v in variants if v["kernel"] == "select"}
    # Both of the selection's scans (packed up to BLOCK_H 16384, two above) and 32 warps.
    assert min(hot) <= 16384 < max(hot) and 16384 in hot, hot
    rows = {v["constexprs"]["ROW_WORDS"] for v in variants if v["kernel"] == "backup"}
    assert min(rows) <= 128 < max(rows), rows  # the backup's 1 and 2 warps
    # Verify rows de-duplicated in the swap-in at S = 2, 4 and 8 (K = 2048), and the newest
    # writer's and the advance's warp counts.
    widths = {v["constexprs"]["BLOCK_K"] for v in variants
              if v["kernel"] == "select" and v["constexprs"]["DEDUP"]}
    assert {4096, 8192, 16384} <= widths, widths
    for kernel in ("newest", "advance"):
        warps = {v["options"]["num_warps"] for v in variants if v["kernel"] == kernel}
        assert len(warps) == 2, (kernel, warps)


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_the_builds_fit_the_target(builds, name: str) -> None:
    target = find_target(name)
    variants = built(builds, name)
    flagged = {(target.backend, v["kernel"], v["variant"]): v for v in variants if v["problems"]}
    unexpected = [f"{where(v, name)}: {'; '.join(v['problems'])}"
                  for key, v in flagged.items() if key not in KNOWN_PROBLEMS]
    assert not unexpected, "\n".join(unexpected)
    fixed = [f"{kernel} ({variant}) on {name}: {why}"
             for (backend, kernel, variant), why in KNOWN_PROBLEMS.items()
             if backend == target.backend and (backend, kernel, variant) not in flagged]
    assert not fixed, "these builds fit now; drop them from KNOWN_PROBLEMS:\n" + "\n".join(fixed)


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_builds_spill_only_where_the_nvidia_build_does_today(builds, name: str) -> None:
    variants = built(builds, name)
    spilling = {(v["kernel"], v["variant"]): v["resources"]["n_spills"] for v in variants
                if v["resources"] and v["resources"].get("n_spills")}
    if find_target(name).backend == "cuda":
        new = {key: n for key, n in spilling.items() if key not in NVIDIA_SPILLS_TODAY}
        assert not new, f"{name} spills where it did not (kernel, variant: spill slots): {new}"
        return
    reference = {(v["kernel"], v["variant"]) for v in built(builds, "cuda:sm_90")
                 if v["resources"] and v["resources"]["n_spills"]}
    new = {key: n for key, n in spilling.items() if key not in reference}
    assert not new, f"{name} spills where cuda:sm_90 does not: {new}"


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_pdl_instructions_only_where_the_target_has_pdl(builds, name: str) -> None:
    target = find_target(name)
    variants = built(builds, name)
    # The launch code's own rule picked PDL for these launches (compile_variants asks it).
    assert any(v["pdl"] for v in variants) is target.pdl, name
    for v in variants:
        if v["resources"] is None:
            continue  # did not compile: reported above
        count = v["resources"].get("pdl_instructions", 0)
        if target.pdl:
            assert (count > 0) is v["pdl"], f"{where(v, name)}: {count} griddepcontrol"
        else:
            assert count == 0 and not v["pdl"], f"{where(v, name)}: {count} griddepcontrol"


@pytest.mark.parametrize("name", [t.name for t in TARGETS if t.warp_size == 64])
def test_64_lane_targets_get_64_lane_builds(builds, name: str) -> None:
    for v in built(builds, name):
        found = v["resources"]
        if found is None:
            continue
        assert found["warp_size"] == found["wave_size"] == 64, where(v, name)
        assert found["ttgir_threads_per_warp"] == 64, where(v, name)
        assert found["threads"] == found["num_warps"] * 64, where(v, name)
        # The code object's own limit is what a launch of this build may use.
        if (find_target(name).backend, v["kernel"], v["variant"]) not in KNOWN_PROBLEMS:
            assert found["threads"] <= found["max_threads"], where(v, name)


def test_xpu_needs_the_intel_backend_or_builds(builds) -> None:
    entry = builds["xpu:pvc"]
    if entry["variants"]:  # the Intel backend is installed: its builds are the tests above
        return
    assert entry["reason"] == NEEDS_INTEL_BACKEND
