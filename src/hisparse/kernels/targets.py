"""Compile the Triton kernels for GPUs that are not here, and read what the builds use.

Stock Triton wheels compile for NVIDIA and AMD without a GPU or a vendor toolkit (they carry
ptxas and the AMD device libraries and link in-process), so every kernel can be built for
every target on a CPU machine: `triton.compile(ASTSource(...), target=GPUTarget(...))`.

What is compiled is what the launch code would launch: the variants come from
`compile_variants()` (`kernels/compile_variants.py`), which records the real launch
functions' launches. The checks are those a device would make at load time (threads against
the kernel's maximum, shared memory against the device's) plus a few it would not: spills,
the registers' fit on the target, the programmatic-dependent-launch instructions, the wave
size, and (NVIDIA) a word every thread loads and one thread rewrites before a branch on it
(`kernels/ptx_races.py`).

Compiling needs triton imported without TRITON_INTERPRET=1 (the interpreter compiles
nothing), so callers in a process that may have set it use `run_in_subprocess()`; the module
runs as `python -m hisparse.kernels.targets --json` for that. Importing this module imports
neither torch nor triton.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass
from typing import Any

from hisparse.kernels.compile_variants import Variant, compile_variants
from hisparse.kernels.ptx_races import reset_races

NEEDS_INTEL_BACKEND = "needs the Intel Triton backend (pytorch-triton-xpu)"


@dataclass(frozen=True)
class Target:
    """A GPU the kernels are compiled for, with the limits its builds are checked against."""

    name: str  # "cuda:sm_90", "hip:gfx942"
    backend: str  # GPUTarget.backend: cuda, hip, xpu
    arch: Any  # GPUTarget.arch: 90, "gfx942", a property dict for xpu
    warp_size: int
    triton_backend: str  # the key in triton.backends.backends that compiles for it
    hisparse_backend: str  # the hisparse backend that runs on it
    hardware: str
    pdl: bool  # has programmatic dependent launch (griddepcontrol)
    max_threads: int  # threads per block / workgroup
    max_shared: int  # bytes of shared memory / LDS one block may use (opt-in maximum)
    registers: int  # 32-bit registers a block's threads share (NVIDIA: per SM; AMD: VGPRs
    # per lane of one SIMD, shared by the waves on it)
    max_regs_per_thread: int
    missing_backend: str = ""  # the reason where triton_backend is not installed

    def gpu_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)

    def features(self) -> Any:
        """The feature table of the hisparse backend that runs on this target."""
        if self.backend == "cuda":
            from hisparse.backends.cuda import CUDA_FEATURES

            return CUDA_FEATURES
        if self.backend == "hip":
            from hisparse.backends.rocm import ROCM_FEATURES

            return ROCM_FEATURES
        from hisparse.backends.xpu import XPU_FEATURES

        return XPU_FEATURES


# Limits: NVIDIA CUDA C Programming Guide, compute capabilities 9.0 and 10.0 (227 KiB of
# shared memory per block with opt-in, 64 Ki registers per SM, 255 per thread); AMD CDNA3 /
# CDNA4 ISA guides (64 KiB / 160 KiB LDS per workgroup, 512 unified VGPRs per lane of a SIMD,
# 4 SIMDs per CU, 1024 work-items per workgroup).
_PVC = {  # Intel Data Center GPU Max 1550, as its Triton driver describes it
    "name": "Intel(R) Data Center GPU Max 1550", "device_id": 0x0BD5, "architecture": 0,
    "max_work_group_size": 1024, "max_num_sub_groups": 64, "sub_group_sizes": [16, 32],
    "has_fp64": True, "has_subgroup_2d_block_io": True, "has_2d_block_io": True,
    "has_subgroup_matrix_multiply_accumulate": True, "driver_version": "1.6.33578",
    "__intel_already_queried_extensions__": True,
}
TARGETS: tuple[Target, ...] = (
    Target("cuda:sm_90", "cuda", 90, 32, "nvidia", "cuda", "NVIDIA Hopper (H100, H200)",
           pdl=True, max_threads=1024, max_shared=232448, registers=65536,
           max_regs_per_thread=255),
    Target("cuda:sm_100", "cuda", 100, 32, "nvidia", "cuda", "NVIDIA Blackwell (B200, GB200)",
           pdl=True, max_threads=1024, max_shared=232448, registers=65536,
           max_regs_per_thread=255),
    Target("hip:gfx942", "hip", "gfx942", 64, "amd", "rocm", "AMD MI300X / MI325X (CDNA3)",
           pdl=False, max_threads=1024, max_shared=65536, registers=512,
           max_regs_per_thread=512),
    Target("hip:gfx950", "hip", "gfx950", 64, "amd", "rocm", "AMD MI350X / MI355X (CDNA4)",
           pdl=False, max_threads=1024, max_shared=163840, registers=512,
           max_regs_per_thread=512),
    Target("xpu:pvc", "xpu", _PVC, 32, "intel", "xpu", "Intel Data Center GPU Max (PVC)",
           pdl=False, max_threads=1024, max_shared=131072, registers=0,
           max_regs_per_thread=0, missing_backend=NEEDS_INTEL_BACKEND),
)


def find_target(name: str) -> Target:
    for target in TARGETS:
        if target.name == name:
            return target
    raise KeyError(f"unknown target {name!r}; known: {', '.join(t.name for t in TARGETS)}")


def target_name(backend: str, arch: Any) -> str:
    """The name `TARGETS` uses for a GPUTarget's (backend, arch), e.g. ("cuda", 90)."""
    if backend == "cuda":
        return f"cuda:sm_{arch}"
    if backend == "xpu" and isinstance(arch, dict):
        return "xpu:" + str(arch.get("name", "unknown"))
    return f"{backend}:{arch}"


# ==== compiling and reading the builds =====================================================
def compile_variant(variant: Variant, target: Target) -> Any:
    import triton
    from triton.compiler import ASTSource

    source = ASTSource(fn=variant.fn, signature=variant.signature,
                       constexprs=variant.constexprs, attrs=variant.attrs)
    with _intel_arch(target):
        return triton.compile(source, target=target.gpu_target(), options=variant.options)


@contextlib.contextmanager
def _intel_arch(target: Target) -> Iterator[None]:
    """The Intel backend asks its driver for the device architecture unless told."""
    if target.backend != "xpu":
        yield
        return
    import triton

    intel = getattr(getattr(triton, "knobs", None), "intel", None)
    if intel is None or not hasattr(intel, "device_arch") or intel.device_arch:
        yield
        return
    intel.device_arch = "pvc"
    try:
        yield
    finally:
        intel.device_arch = None


def resources(compiled: Any, variant: Variant, target: Target) -> dict[str, Any]:
    """What the build uses, in the units Triton's driver reports on the device: n_regs,
    n_spills (local / scratch bytes per thread / 4), shared (bytes), and the threads."""
    metadata = compiled.metadata
    lanes = getattr(metadata, "warp_size", None) or getattr(metadata, "threads_per_warp", None)
    lanes = lanes or target.warp_size  # older metadata: the target's
    threads = metadata.num_warps * lanes
    found: dict[str, Any] = {"num_warps": metadata.num_warps, "warp_size": lanes,
                             "threads": threads, "shared": int(metadata.shared)}
    if target.backend == "cuda":
        found.update(_cubin_usage(compiled.asm["cubin"]))
        found["n_spills"] = found["stack_bytes"] // 4
        found["pdl_instructions"] = compiled.asm["ptx"].count("griddepcontrol.")
        found["max_threads"] = _nvidia_max_threads(found["n_regs"], target)
        found["reset_races"] = [astuple(race)
                                for race in reset_races(compiled.asm["ptx"])]
    elif target.backend == "hip":
        found.update(_amdgcn_usage(compiled.asm["amdgcn"], metadata.name))
        found["n_spills"] = found["scratch_bytes"] // 4
        found["shared"] += found.pop("static_lds")
        found["pdl_instructions"] = compiled.asm["amdgcn"].count("griddepcontrol")
        found["elf_machine"] = _elf_machine(compiled.asm["hsaco"])
    ttgir = compiled.asm.get("ttgir", "")
    layout = re.search(r'"ttg\.threads-per-warp" = (\d+)', ttgir)
    found["ttgir_threads_per_warp"] = int(layout.group(1)) if layout else None
    return found


def _cubin_usage(cubin: bytes) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "kernel.cubin")
        with open(path, "wb") as out:
            out.write(cubin)
        text = subprocess.run([_cuobjdump(), "-res-usage", path], capture_output=True,
                              text=True, check=True, timeout=120).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if usage is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line: {text[-500:]!r}")
    regs, stack, shared, local = map(int, usage.groups())
    return {"n_regs": regs, "stack_bytes": stack, "static_shared": shared, "local_bytes": local,
            "elf_machine": _elf_machine(cubin)}


def _cuobjdump() -> str:
    import triton

    knobs = getattr(triton, "knobs", None)
    with contextlib.suppress(AttributeError):
        return knobs.nvidia.cuobjdump.path
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")


def _nvidia_max_threads(regs: int, target: Target) -> int:
    """Threads a block of this kernel may have: registers go to warps in units of 256."""
    per_warp = max(256, math.ceil(regs * target.warp_size / 256) * 256)
    return min(target.max_threads, target.registers // per_warp * target.warp_size)


_AMD_FIELDS = {  # the code object's metadata (the amdgcn text's .amdgpu_metadata block)
    ".vgpr_count": "n_regs", ".agpr_count": "agprs", ".sgpr_count": "sgprs",
    ".vgpr_spill_count": "vgpr_spills", ".sgpr_spill_count": "sgpr_spills",
    ".private_segment_fixed_size": "scratch_bytes", ".group_segment_fixed_size": "static_lds",
    ".max_flat_workgroup_size": "max_threads", ".wavefront_size": "wave_size",
}


def _amdgcn_usage(amdgcn: str, name: str) -> dict[str, int]:
    block = amdgcn[amdgcn.find(".amdgpu_metadata"):amdgcn.find(".end_amdgpu_metadata")]
    # One code object per Triton kernel: one entry under amdhsa.kernels, and it is ours.
    names = re.findall(r"^\s+\.symbol:\s+(\S+)\.kd$", block, re.MULTILINE)
    if names != [name]:
        raise RuntimeError(f"expected the metadata of {name} alone, found kernels {names}")
    found: dict[str, int] = {}
    for key, label in _AMD_FIELDS.items():
        match = re.search(rf"^\s*{re.escape(key)}:\s+(\d+)", block, re.MULTILINE)
        found[label] = int(match.group(1)) if match else 0
    occupancy = re.search(r"; Occupancy: (\d+)", amdgcn)
    found["occupancy"] = int(occupancy.group(1)) if occupancy else 0
    return found


def _elf_machine(binary: bytes) -> int:
    """e_machine of an ELF image (190 NVIDIA CUDA, 224 AMD GPU); 0 when it is not one."""
    if not binary.startswith(b"\x7fELF"):
        return 0
    return int.from_bytes(binary[18:20], "little")


ELF_MACHINE = {"cuda": 190, "hip": 224}


def problems(variant: Variant, target: Target, found: dict[str, Any]) -> list[str]:
    """What a device would refuse, or what the build should not contain, for this build."""
    wrong = []
    threads = found["threads"]
    if found["warp_size"] != target.warp_size or found["ttgir_threads_per_warp"] not in (
            None, target.warp_size):
        wrong.append(f"built for {found['warp_size']}-lane warps "
                     f"(ttgir {found['ttgir_threads_per_warp']}), the target has "
                     f"{target.warp_size}")
    if target.backend in ELF_MACHINE and found.get("elf_machine") != ELF_MACHINE[target.backend]:
        wrong.append(f"the binary is no {target.backend} ELF (e_machine "
                     f"{found.get('elf_machine')})")
    if "max_threads" in found and threads > found["max_threads"]:
        # Triton's own load-time check (CompiledKernel._init_handles): OutOfResources.
        wrong.append(f"{found['num_warps']} warps x {found['warp_size']} lanes = {threads} "
                     f"threads, more than the {found['max_threads']} this build can launch")
    if threads > target.max_threads:
        wrong.append(f"{threads} threads per block, the target allows {target.max_threads}")
    if found["shared"] > target.max_shared:
        wrong.append(f"{found['shared']} bytes of shared memory, the target has "
                     f"{target.max_shared}")
    regs = found.get("n_regs")
    if regs is not None and target.max_regs_per_thread:
        if regs > target.max_regs_per_thread:
            wrong.append(f"{regs} registers per thread, at most {target.max_regs_per_thread}")
        if target.backend == "hip":  # the waves of a workgroup share 4 SIMDs' VGPR files
            waves_per_simd = math.ceil(found["num_warps"] / 4)
            if (regs + found.get("agprs", 0)) * waves_per_simd > target.registers:
                wrong.append(f"{regs} VGPRs x {waves_per_simd} waves per SIMD exceed the "
                             f"{target.registers} a SIMD lane has")
    branches: dict[tuple[int, int], list[int]] = {}
    for load, store, branch in found.get("reset_races", ()):
        branches.setdefault((load, store), []).append(branch)
    for (load, store), lines in branches.items():
        wrong.append(f"a word every thread loads (PTX line {load}) is rewritten by one thread "
                     f"(line {store}) with no barrier between, and branched on (lines "
                     f"{', '.join(map(str, lines))}): a late warp takes the other path "
                     "(kernels/ptx_races.py)")
    pdl_found = found.get("pdl_instructions", 0)
    if not target.pdl and (pdl_found or variant.uses_pdl):
        wrong.append(f"programmatic dependent launch on a target without it ({pdl_found} "
                     "griddepcontrol instructions)")
    if target.pdl and bool(pdl_found) != variant.uses_pdl:
        wrong.append(f"{pdl_found} griddepcontrol instructions in a "
                     f"{'PDL' if variant.uses_pdl else 'non-PDL'} launch")
    return wrong


# ==== running it ===========================================================================
def compile_report(target_names: Sequence[str] | None = None, quick: bool = False,
                   keep_asm: Sequence[str] = (), scenarios: Sequence[str] = ()) -> dict:
    """Compile the variants for each target: {triton, targets: [{target, compiled, reason,
    variants: [{kernel, variant, scenarios, constexprs, options, error, resources,
    problems, seconds[, asm]}]}]}. `keep_asm`: IR names (ptx, amdgcn) to return;
    `scenarios`: only those labels."""
    try:
        import triton
        from triton.backends import backends
    except ImportError as exc:
        return {"triton": None, "error": f"triton is not installed ({exc})", "targets": []}
    chosen = [find_target(n) for n in target_names] if target_names else list(TARGETS)
    report: dict[str, Any] = {"triton": triton.__version__, "targets": []}
    for target in chosen:
        entry: dict[str, Any] = {"target": target.name, "compiled": False, "reason": None,
                                 "variants": []}
        report["targets"].append(entry)
        if target.triton_backend not in backends:
            entry["reason"] = target.missing_backend or (
                f"this triton ({triton.__version__}) has no {target.triton_backend} backend")
            continue
        with _intel_arch(target):
            try:
                variants = compile_variants(target, quick=quick)
            except Exception as exc:  # the launch code refused a scenario: say so, per target
                entry["reason"] = (f"enumerating the launches failed: {type(exc).__name__}: "
                                   f"{exc}")
                continue
            if scenarios:
                variants = [v for v in variants if set(v.scenarios) & set(scenarios)]
            for variant in variants:
                entry["variants"].append(_compile_entry(variant, target, keep_asm))
        failed = [v for v in entry["variants"] if v["error"]]
        entry["compiled"] = bool(entry["variants"]) and not failed
        if failed:
            entry["reason"] = (f"{len(failed)} of {len(entry['variants'])} builds failed, "
                               f"first {failed[0]['kernel']} ({failed[0]['variant']}): "
                               f"{failed[0]['error'].splitlines()[0][:300]}")
    return report


def _compile_entry(variant: Variant, target: Target, keep_asm: Sequence[str]) -> dict:
    start = time.perf_counter()
    entry: dict[str, Any] = {
        "kernel": variant.kernel, "variant": variant.label, "scenarios": variant.scenarios,
        "constexprs": {k: _jsonable(v) for k, v in variant.described_constexprs().items()},
        "options": variant.options, "pdl": variant.uses_pdl, "error": None,
        "resources": None, "problems": [],
    }
    try:
        compiled = compile_variant(variant, target)
        entry["resources"] = resources(compiled, variant, target)
        entry["problems"] = problems(variant, target, entry["resources"])
        entry["asm"] = {name: compiled.asm[name] for name in keep_asm if name in compiled.asm}
    except Exception as exc:  # a compiler error is this build's result, not the run's
        entry["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
    entry["seconds"] = round(time.perf_counter() - start, 3)
    return entry


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) or value is None else repr(value)


class CompileJob:
    """`compile_report` in a child process without TRITON_INTERPRET (compiling needs the
    real triton.jit, and a compiler crash then ends the child, not the caller). It starts at
    once; `result()` waits for it."""

    def __init__(self, target_names: Sequence[str] | None = None, quick: bool = False,
                 extra: Sequence[str] = ()) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        env.pop("TRITON_INTERPRET", None)
        command = [sys.executable, "-m", "hisparse.kernels.targets", "--json", *extra]
        if target_names:
            command += ["--targets", ",".join(target_names)]
        if quick:
            command.append("--quick")
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, env=env)

    def result(self, timeout: float = 900) -> dict:
        try:
            out, err = self._process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.communicate()
            raise
        lines = out.strip().splitlines()
        if self._process.returncode != 0 or not lines:
            tail = (err.strip().splitlines() or ["no error text"])[-1]
            raise RuntimeError(
                f"the compile process exited with {self._process.returncode}: {tail}")
        return json.loads(lines[-1])


def run_in_subprocess(target_names: Sequence[str] | None = None, quick: bool = False,
                      timeout: float = 900, extra: Sequence[str] = ()) -> dict:
    """`CompileJob(...).result(timeout)`."""
    return CompileJob(target_names, quick, extra).result(timeout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hisparse.kernels.targets",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="", help="comma-separated names (default: all)")
    parser.add_argument("--quick", action="store_true", help="the tiny preset's launches only")
    parser.add_argument("--scenario", action="append", default=[], help="only these labels")
    parser.add_argument("--asm", action="append", default=[], help="return this IR (ptx, ...)")
    parser.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = parser.parse_args(argv)
    names = [n for n in args.targets.split(",") if n]
    report = compile_report(names, quick=args.quick, keep_asm=args.asm, scenarios=args.scenario)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"triton {report['triton']}")
    for entry in report["targets"]:
        print(f"{entry['target']}: {'compiled' if entry['compiled'] else 'NOT compiled'}"
              f"{': ' + entry['reason'] if entry['reason'] else ''}")
        for v in entry["variants"]:
            res = v["resources"] or {}
            usage = ", ".join(f"{k} {res[k]}" for k in ("num_warps", "n_regs", "n_spills",
                                                        "shared") if k in res)
            status = v["error"] or "; ".join(v["problems"]) or "ok"
            print(f"  {v['kernel']:<15} {v['variant']:<40} {usage}  {v['seconds']:.2f} s  "
                  f"{status[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["TARGETS", "CompileJob", "Target", "Variant", "compile_report", "compile_variants",
           "find_target", "problems", "resources", "run_in_subprocess"]
