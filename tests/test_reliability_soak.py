"""scripts/soak at a few steps: its summary adds up, and a corrupted row makes it fail."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

import hisparse

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "soak"
SMALL = ["--device", "cpu", "--steps", "40", "--requests", "4", "--pool-tokens", "32768",
         "--min-prompt", "300", "--max-prompt", "900", "--min-life", "5", "--max-life", "25",
         "--verify-every", "4"]


def load_soak() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("soak_script", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def test_a_short_soak_verifies_rows_and_reports_memory(tmp_path: Path, seed: int) -> None:
    out = tmp_path / "soak.json"
    assert load_soak().main([*SMALL, "--seed", str(seed), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["steps"] == 40 and summary["mismatches"] == 0
    assert summary["verifications"] == 10  # every 4th step
    assert summary["rows_verified"] > 0
    assert summary["bytes_verified"] == summary["rows_verified"] * 656
    assert summary["finished"] > 0 and summary["admitted"] >= 4 + summary["finished"]
    assert summary["host_rss"]["growth_after_warmup"] is not None
    assert len(summary["memory_samples"]) >= 20


def test_a_corrupted_row_is_counted_and_fails_the_run(monkeypatch: pytest.MonkeyPatch,
                                                      seed: int) -> None:
    real = hisparse.HiSparseCache.swap_in

    def corrupting(self: hisparse.HiSparseCache, layer: int, top_k,  # type: ignore[no-untyped-def]
                   newest_kv=None):
        rows = real(self, layer, top_k, newest_kv=newest_kv)
        first = int(rows[0][rows[0] >= 0][0])
        self.device_kv(layer)[first, 3] ^= 0xFF
        return rows

    monkeypatch.setattr(hisparse.HiSparseCache, "swap_in", corrupting)
    soak = load_soak()
    assert soak.main([*SMALL, "--steps", "8", "--seed", str(seed)]) == 1
