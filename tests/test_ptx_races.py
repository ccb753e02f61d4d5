"""`kernels/ptx_races.reset_races`: a word every thread loads, one thread rewrites with no
barrier between, and the program branches on (the selection's miss count did this).

On PTX written here (each rule of the scan, one case each), and on a real Triton build for
sm_90 in a child process: the racy kernel is found and the same kernel with a barrier is not.
The shipped kernels' builds are checked by tests/test_kernel_targets.py (`problems`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hisparse.kernels.ptx_races import ResetRace, reset_races

HEAD = """\
	mov.u32 	%r3, %tid.x;
	and.b32 	%r4, %r3, 31;
	shr.u32 	%r5, %r3, 5;
	or.b32 	%r6, %r4, %r5;
	setp.eq.b32 	%p25, %r6, 0;
	ld.global.b32 { %r57 }, [ %rd19 + 0 ];
	setp.ne.b32 	%p24, %r57, 0;
	and.pred 	%p18, %p25, %p24;
"""
STORE = "	@%p18 st.global.b32 [ %rd19 + 0 ], { %r1019 };\n"
BRANCH = """\
	setp.lt.s32 	%p28, %r57, 1;
	@%p28 bra 	$L__BB0_13;
"""


def lines_of(ptx: str, *starts: str) -> list[int]:
    found = [i for i, line in enumerate(ptx.splitlines(), 1) if line.strip().startswith(starts)]
    assert found, starts
    return found


def test_a_load_a_one_thread_store_and_a_branch_on_the_value_is_a_race() -> None:
    ptx = HEAD + STORE + BRANCH
    load, = lines_of(ptx, "ld.global")
    store, = lines_of(ptx, "@%p18 st.global")
    branch, = lines_of(ptx, "@%p28 bra")
    assert reset_races(ptx) == [ResetRace(load, store, branch)]


def test_a_barrier_between_the_load_and_the_store_orders_them() -> None:
    assert reset_races(HEAD + "	bar.sync 	0;\n" + STORE + BRANCH) == []
    # ... but only between them: after the store it is too late.
    assert reset_races(HEAD + STORE + "	bar.sync 	0;\n" + BRANCH) != []


def test_no_branch_on_the_value_is_no_race() -> None:
    # The value only reaches the one thread's own store: every other thread's copy is unused.
    assert reset_races(HEAD + STORE + "	@%p30 bra 	$L__BB0_2;\n") == []


def test_a_store_by_every_thread_is_each_threads_own_word() -> None:
    every = STORE.replace("@%p18 ", "")
    assert reset_races(HEAD + every + BRANCH) == []


def test_the_value_is_followed_through_arithmetic_but_not_through_shared_memory() -> None:
    derived = """\
	add.s32 	%r60, %r57, -1;
	setp.gt.s32 	%p29, %r60, 0;
	@%p29 bra 	$L__BB0_4;
"""
    assert len(reset_races(HEAD + STORE + derived)) == 1
    reduced = """\
	st.shared.b32 	[%r140], %r57;
	bar.sync 	0;
	ld.shared.b32 	%r61, [%r140];
	setp.gt.s32 	%p29, %r61, 0;
	@%p29 bra 	$L__BB0_4;
"""
    assert reset_races(HEAD + STORE + reduced) == []


RACY_KERNEL = textwrap.dedent('''
    import json, sys
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from hisparse.kernels.ptx_races import reset_races

    @triton.jit
    def kernel(count_ptr, rows_ptr, out_ptr, BARRIER: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        n = tl.load(count_ptr + b)
        if BARRIER:
            tl.debug_barrier()
        tl.store(count_ptr + b, 0)
        if n > 0:
            offs = tl.arange(0, BLOCK)
            x = tl.load(rows_ptr + offs)
            tl.store(out_ptr + b * BLOCK + offs, tl.cumsum(x, axis=0))

    found = {}
    for barrier in (False, True):
        source = ASTSource(fn=kernel, signature={"count_ptr": "*i32", "rows_ptr": "*i32",
                                                 "out_ptr": "*i32", "BARRIER": "constexpr",
                                                 "BLOCK": "constexpr"},
                           constexprs={"BARRIER": barrier, "BLOCK": 2048})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 8})
        found[str(barrier)] = len(reset_races(compiled.asm["ptx"]))
    print(json.dumps(found))
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (pip install 'hisparse[triton]')")
def test_a_triton_build_of_the_pattern_is_found_and_its_barrier_fixes_it(tmp_path) -> None:
    # A child process: this one may have set TRITON_INTERPRET=1, which compiles nothing; a
    # file: triton reads a kernel's source from it.
    script = tmp_path / "racy_kernel.py"
    script.write_text(RACY_KERNEL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["False"] >= 1, "the racy build was not found"
    assert found["True"] == 0, "the build with a barrier was flagged"
