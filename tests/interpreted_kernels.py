"""The Triton kernel modules for the kernel tests: native on a GPU, interpreted without one.

Import this before anything else from `hisparse.kernels`: TRITON_INTERPRET=1 must be set before
the kernels are decorated (triton.jit picks the interpreter then), and a module another test
imported earlier, compiled, is reloaded here. Without Triton the importing module is skipped.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (pip install 'hisparse[triton]')")

from hisparse.kernels import (  # noqa: E402
    advance_triton,
    backup_triton,
    newest_triton,
)
from hisparse.kernels import swap_in as swap_in_triton  # noqa: E402, F401 (for the tests)
from hisparse.kernels.swap_in import select  # noqa: E402

# The kernel modules in import order: each binds the jit functions of those before it.
_SWAP_IN_MODULES = ("pdl", "lookup", "select", "copy", "launch")

if not ON_GPU:
    if type(select.select_kernel).__name__ != "InterpretedFunction":
        for name in _SWAP_IN_MODULES:
            importlib.reload(importlib.import_module(f"hisparse.kernels.swap_in.{name}"))
    if type(backup_triton._backup_kernel).__name__ != "InterpretedFunction":
        backup_triton = importlib.reload(backup_triton)
    if type(newest_triton._write_newest_kernel).__name__ != "InterpretedFunction":
        newest_triton = importlib.reload(newest_triton)
    if type(advance_triton._advance_kernel).__name__ != "InterpretedFunction":
        advance_triton = importlib.reload(advance_triton)

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# The marker of every test in a kernel test module (`pytestmark = KERNEL_MARK`).
KERNEL_MARK = pytest.mark.gpu if ON_GPU else pytest.mark.interpreter
