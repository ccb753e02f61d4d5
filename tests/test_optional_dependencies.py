"""The suite after `pip install -e '.[dev]'` alone: every test that needs an optional
dependency (triton, nixl, matplotlib, tqdm, prometheus_client) skips, saying which extra
installs it, instead of failing. `tests/test_cli_bench.py`'s table-layout test imported the
Triton kernels and failed there.

The run below hides the optional modules from a fresh interpreter (an entry of None in
`sys.modules` makes `import triton` fail as if it were not installed), then collects the whole
suite and runs the tests that import an optional module inside their body."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("triton", "nixl_cu12", "matplotlib", "tqdm", "prometheus_client")
# Tests that import an optional module in their body (collection alone does not reach them).
IN_BODY = [
    "tests/test_cli_bench.py::test_sw1_tables_are_row_major_and_agree_with_the_hot_buffers",
    "tests/test_cli_bench.py::test_the_plot_shows_the_reference_values_the_tables_show",
    "tests/test_cli_bench.py::test_plot_writes_a_png_or_says_matplotlib_is_missing",
    "tests/test_backends.py::test_gpu_backends_bind_the_triton_kernels",
    "tests/test_scripts_cli.py::test_kernel_stress_json_says_what_produced_it",
    "tests/test_scripts_cli.py::test_copy_limits_json_says_what_produced_it",
    "tests/test_scripts_cli.py::test_host_overhead_benchmark_times_every_call_of_every_cell",
    "tests/test_cli_plan.py::test_plot_writes_a_png_or_says_matplotlib_is_missing",
    "tests/test_cli_simulate.py::test_plot_writes_a_png_or_says_matplotlib_is_missing",
    "tests/test_cli_simulate.py::test_progress_counts_each_pass_to_the_steps_the_summary_reports",
]
RUNNER = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def run_without_optional(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-c", RUNNER, "-q", "-p", "no:cacheprovider", "-rs",
                           *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_suite_collects_without_any_optional_dependency() -> None:
    result = run_without_optional("--collect-only", "tests")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "error" not in result.stdout.splitlines()[-1], result.stdout[-3000:]


def test_tests_that_need_an_optional_dependency_skip_naming_its_extra() -> None:
    result = run_without_optional(*IN_BODY)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", result.stdout, re.MULTILINE)
    optional = [r for r in reasons if any(name.split("_")[0] in r for name in OPTIONAL)]
    assert optional, result.stdout[-3000:]  # the optional-module tests did skip
    for reason in optional:
        assert re.search(r"pip install 'hisparse\[\w+\]'", reason), reason
