"""The swap-in launch plan: every path choice of a shape in one frozen, printable object."""

from __future__ import annotations

import dataclasses

import pytest

from hisparse.kernels.swap_in.plan import DeviceTraits, LaunchPlan, Tuning, plan_launch

H200 = DeviceTraits(compute_units=132, pdl=True, interpreted=False, direct_launch=True)
NO_PDL = dataclasses.replace(H200, pdl=False)


def plan(rows: int, extent: int = 512, device: DeviceTraits = H200, **tune: object
         ) -> LaunchPlan:
    return plan_launch(rows, 2048, 4096, extent, False, device, tune=Tuning(**tune))


@pytest.mark.parametrize("rows", [1, 2, 16, 17, 63, 64, 128])
def test_the_shipped_tuning_picks_the_measured_paths(rows: int) -> None:
    """Tuning's thresholds, as benchmarks/NOTES.md measured them: the prefetching copy (and,
    with PDL asked for, a PDL copy) up to B=16, small classify chunks up to 16 rows, address
    order from 64 rows over token-granular extents only."""
    got = plan(rows)
    assert got.copy.variant == ("prefetched" if rows <= 16 else "planned")
    assert not got.pdl and not got.copy.pdl  # off unless asked for (Tuning.pdl)
    assert plan(rows, pdl=True).copy.pdl == (rows <= 16)
    assert got.classify_chunk == (64 if rows <= 16 else 256)
    assert got.classify_grid == (rows, 2048 // got.classify_chunk)
    assert not got.address_order
    assert plan(rows, extent=1).address_order == (rows >= 64)
    # The copy's width (rows a program, programs): the prefetching copy up to 32 programs per
    # SM, more rows a program where 2 rows leave entries over (B=16: 8 rows, one pass over
    # its 32768 entries); the planned copy 8 programs per SM, 1 from 64 rows on.
    widths = {1: (2, 1024), 2: (2, 2048), 16: (8, 4096), 17: (2, 1056), 63: (2, 1056),
              64: (2, 132), 128: (2, 132)}
    assert (got.copy.rows_per_iteration, got.copy.programs) == widths[rows]
    # A verify row's union is completed by the copy, but behind the one-per-SM copy.
    assert got.union_completion == ("own kernel" if rows >= 64 else "copy")


@pytest.mark.parametrize("tokens", [1, 2, 4, 8, 16])
def test_the_prefetching_copy_covers_a_verify_rows_entries_in_one_pass(tokens: int) -> None:
    """Up to 32 programs per SM of 2 rows each, then more rows per program (a power of two)."""
    got = plan_launch(1, 2048 * tokens, 4096 * tokens, 512, False, H200, tune=Tuning())
    rows_each = 2 * max(1, tokens // 4)
    assert got.copy.rows_per_iteration == rows_each
    assert got.copy.programs == min(2048 * tokens // rows_each, 132 * 32)
    assert got.copy.programs * got.copy.rows_per_iteration >= 2048 * tokens


def test_pdl_is_asked_for_and_needs_the_device() -> None:
    assert not plan(8).pdl and not plan(8).copy.pdl, "PDL is off by default"
    assert plan(8, pdl=True).pdl and plan(8, pdl=True).copy.pdl
    assert not plan(8, device=NO_PDL, pdl=True).pdl, "tuning cannot force PDL on a device"
    assert not plan(8, device=NO_PDL, pdl=True).copy.pdl


def test_skip_io_plans_no_copy_and_the_interpreter_keeps_grids_tiny() -> None:
    skipping = plan_launch(4, 2048, 4096, 512, False, H200, skip_io=True)
    assert skipping.copy.variant == "none" and skipping.union_completion == "own kernel"
    interpreted = DeviceTraits(compute_units=1, pdl=False, interpreted=True)
    assert plan(64, device=interpreted).copy.programs == Tuning().interpreter_copy_programs


def test_a_plan_is_frozen_and_prints_every_choice() -> None:
    got = plan(64, extent=1, pdl=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.rows = 2  # type: ignore[misc]
    text = str(got)
    for part in ("B=64", "classify: grid 64x8", "host-address order (1024 buckets)",
                 "copy:     planned", "PDL behind classify"):
        assert part in text, (part, text)
    assert "PDL behind select" not in text  # the copy is a dependent launch up to B=16 only
    assert "PDL" not in str(plan(64, extent=1)), "off by default"
