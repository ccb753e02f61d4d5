"""Bound launches: the first call through triton, later ones straight to the compiled launcher
with the same arguments (kernels/launching.py). A fake kernel records both ways in, so the
argument order, the addresses and the fallbacks are checked without a GPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

# First, as every kernel test module: it sets TRITON_INTERPRET=1 without a GPU before triton
# is imported, so that the interpreted kernel tests after this module still interpret.
import interpreted_kernels  # noqa: F401
from hisparse.kernels import launching


class FakeCompiled:
    def __init__(self) -> None:
        self.function, self.packed_metadata = object(), object()
        self.metadata = SimpleNamespace()
        self.calls: list[tuple[Any, ...]] = []

    def run(self, *args: Any) -> None:
        self.calls.append(args)


class FakeKernel:
    """Parameters (a, b, n, X): X a constexpr passed by name."""

    arg_names = ("a", "b", "n", "X")
    __name__ = "fake"

    def __init__(self, compiled: FakeCompiled | None) -> None:
        self.compiled = compiled
        self.triton_calls: list[tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> FakeCompiled | None:
            self.triton_calls.append((grid, args, kwargs))
            return self.compiled
        return launch


@pytest.fixture
def no_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launching, "_hooks_installed", lambda: False)
    monkeypatch.setattr(launching, "_current_stream", lambda index: 1234)
    monkeypatch.setattr(launching, "DIRECT_LAUNCH_AVAILABLE", True)


def test_later_calls_go_to_the_compiled_launcher_with_every_argument_in_order(
        no_hooks: None) -> None:
    compiled = FakeCompiled()
    kernel = FakeKernel(compiled)
    a, b = torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)
    launch = launching.BoundLaunch(kernel, (3, 2), (a, b, 7), {"X": 5, "num_warps": 4},
                                   device=torch.device("cpu"), addresses={1: 4096})
    launch()
    assert kernel.triton_calls == [((3, 2, 1), (a, b, 7), {"X": 5, "num_warps": 4})]
    assert launch.direct and compiled.calls == []
    launch()
    launch()
    # grid, stream, function, metadata, no launch metadata or hooks, then a, b, n, X: tensors
    # as their addresses (b's given), constexprs too, launch options (num_warps) not.
    expected = (3, 2, 1, 1234, compiled.function, compiled.packed_metadata, None, None, None,
                a.data_ptr(), 4096, 7, 5)
    assert compiled.calls == [expected, expected]
    assert len(kernel.triton_calls) == 1


def test_a_new_tensor_keeps_the_kernel_only_at_the_same_alignment(no_hooks: None) -> None:
    compiled = FakeCompiled()
    kernel = FakeKernel(compiled)
    storage = torch.zeros(64, dtype=torch.int32)
    launch = launching.BoundLaunch(kernel, (1,), (storage[:8], storage[:8], 1), {"X": 1},
                                   device=torch.device("cpu"))
    launch()
    aligned = storage[16:24]  # 64 bytes in: still 16-byte aligned
    launch.rebind(0, aligned)
    launch()
    assert compiled.calls[-1][9] == aligned.data_ptr() and len(kernel.triton_calls) == 1
    misaligned = storage[1:9]  # 4 bytes in: triton would specialize differently
    launch.rebind(0, misaligned)
    assert not launch.direct
    launch()
    assert kernel.triton_calls[-1][1][0] is misaligned, "went back through triton"


def test_hooks_the_interpreter_or_an_opt_out_keep_every_call_on_triton(
        no_hooks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    a = torch.zeros(4, dtype=torch.int32)
    for kernel, direct in ((FakeKernel(None), True), (FakeKernel(FakeCompiled()), False)):
        launch = launching.BoundLaunch(kernel, (1,), (a, a, 2), {"X": 0},
                                       device=torch.device("cpu"), direct=direct)
        launch()
        launch()
        assert len(kernel.triton_calls) == 2 and not launch.direct
    compiled = FakeCompiled()
    kernel = FakeKernel(compiled)
    launch = launching.BoundLaunch(kernel, (1,), (a, a, 2), {"X": 0}, device=torch.device("cpu"))
    launch()
    monkeypatch.setattr(launching, "_hooks_installed", lambda: True)  # a profiler attached
    launch()
    assert len(kernel.triton_calls) == 2 and compiled.calls == []


def test_an_empty_hook_chain_is_no_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """triton 3.5+ keeps an empty HookChain where a profiler's hook would go: that must not
    send every launch back through triton's dispatch (it did, on the H200's triton 3.6)."""
    empty, attached = SimpleNamespace(calls=[]), SimpleNamespace(calls=[print])
    monkeypatch.setattr(launching, "_RUNTIME_KNOBS",
                        SimpleNamespace(launch_enter_hook=empty, launch_exit_hook=empty))
    assert not launching._hooks_installed()
    monkeypatch.setattr(launching, "_RUNTIME_KNOBS",
                        SimpleNamespace(launch_enter_hook=attached, launch_exit_hook=empty))
    assert launching._hooks_installed()
    monkeypatch.setattr(launching, "_RUNTIME_KNOBS",
                        SimpleNamespace(launch_enter_hook=None, launch_exit_hook=print))
    assert launching._hooks_installed()


def test_a_missing_constexpr_is_refused_when_bound() -> None:
    with pytest.raises(TypeError, match=r"no value bound for \['X'\]"):
        launching.BoundLaunch(FakeKernel(None), (1,), (None, None, 1), {},
                              device=torch.device("cpu"))


def test_a_stream_handed_in_is_the_one_launched_on_and_rebind_is_in_place(
        no_hooks: None) -> None:
    """`_run` reads the current stream once per swap-in and hands it to each launch; a
    rebound tensor replaces its entry without rebuilding the argument lists."""
    compiled = FakeCompiled()
    kernel = FakeKernel(compiled)
    a, b = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    launch = launching.BoundLaunch(kernel, (2,), (a, b, 7), {"X": 3},
                                   device=torch.device("cpu"))
    launch()  # through triton: keeps the compiled kernel
    flat = launch._flat
    launch(99)
    assert compiled.calls[-1][3] == 99
    launch()
    assert compiled.calls[-1][3] == 1234  # read from the current stream
    launch.rebind(0, b)
    assert launch._flat is flat and launch.address(0) == b.data_ptr()
    launch(5)
    assert compiled.calls[-1][-4] == b.data_ptr()


class KnownLauncher:
    """A launcher laid out as triton 3.6's CUDA one: `__call__` allocates scratch and calls the
    C function `launch`; `_c_launch` calls `launch` itself."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self) -> None:
        self.c_calls: list[tuple[Any, ...]] = []
        self.python_calls = 0
        self.launch = lambda *args: self.c_calls.append(args)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.python_calls += 1
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, global_scratch, profile_scratch, *args)


class OtherLauncher(KnownLauncher):
    """triton 3.9's layout: the C function takes other arguments, so only `__call__` is safe."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *args):
        self.python_calls += 1


def compiled_with(launcher: KnownLauncher) -> FakeCompiled:
    compiled = FakeCompiled()
    compiled.run = launcher  # type: ignore[method-assign]
    return compiled


def test_the_known_launcher_is_called_at_its_c_function_with_what_its_call_would_pass(
        no_hooks: None) -> None:
    """The C call must carry exactly what the launcher's `__call__` passes for the same
    `compiled.run(...)` arguments: compared against that `__call__` run for real."""
    launcher = KnownLauncher()
    kernel = FakeKernel(compiled_with(launcher))
    a, b = torch.zeros(8, dtype=torch.int32), torch.zeros(4, dtype=torch.int64)
    launch = launching.BoundLaunch(kernel, (3, 2), (a, b, 7), {"X": 5},
                                   device=torch.device("cpu"))
    launch()  # through triton
    launch(77)
    compiled = kernel.compiled
    launcher(3, 2, 1, 77, compiled.function, compiled.packed_metadata, None, None, None,
             a.data_ptr(), b.data_ptr(), 7, 5)
    assert launcher.python_calls == 1 and len(launcher.c_calls) == 2
    assert launcher.c_calls[0] == launcher.c_calls[1]
    assert launcher.c_calls[0][:7] == (3, 2, 1, 77, compiled.function, False, True)
    launch.rebind(1, a)  # a rebound address reaches the C call too
    launch(77)
    assert launcher.c_calls[-1][-3] == a.data_ptr()


def test_an_unknown_launcher_or_a_kernel_with_scratch_keeps_the_python_call(
        no_hooks: None) -> None:
    a = torch.zeros(4, dtype=torch.int32)
    scratch = KnownLauncher()
    scratch.global_scratch_size = 128  # type: ignore[misc]
    for launcher in (OtherLauncher(), scratch):
        kernel = FakeKernel(compiled_with(launcher))
        launch = launching.BoundLaunch(kernel, (1,), (a, a, 2), {"X": 0},
                                       device=torch.device("cpu"))
        launch()
        launch()
        assert launch._c_call is None
        assert launcher.python_calls == 1, "went to `compiled.run`: the launcher's own call"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (triton's launcher)")
def test_on_cuda_the_installed_triton_launcher_is_recognized_or_not_by_its_source() -> None:
    """On the GPU: a real kernel's bound launch takes the C path exactly when the installed
    triton's launcher has the known layout (triton 3.6 does), and launches correctly."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)

    x = torch.zeros(100, dtype=torch.int32, device="cuda")
    launch = launching.BoundLaunch(add_one, (1,), (x, 100), {"BLOCK": 128}, device=x.device)
    for _ in range(3):
        launch()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 3))
    launcher_type = type(launch._compiled.run)
    assert (launch._c_call is not None) == launching._known_layout(launcher_type)
    if triton.__version__.startswith("3.6"):
        assert launch._c_call is not None, "triton 3.6's CUDA launcher has the known layout"
