"""The feature matrix: every backend's table matches the design's feature table, every cell
that is not "supported" raises at its entry points or warns at init, generated from the tables
themselves.

Backends are constructed directly: a feature table is data and needs no device.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hisparse
from hisparse.backends.base import FEATURE_ENTRY_POINTS, Backend, DeviceInfo
from hisparse.backends.cpu import CpuBackend
from hisparse.backends.cuda import CudaBackend
from hisparse.backends.features import (
    FACTS,
    RAISE_WHEN_REQUESTED,
    Feature,
    FeatureTable,
    Status,
    disabled,
    supported,
    unsupported,
)
from hisparse.backends.rocm import RocmBackend
from hisparse.backends.xpu import XpuBackend
from hisparse.config import FEATURE_FLAGS, HiSparseConfig, resolve_features
from hisparse.errors import FeatureDisabledWarning, UnsupportedFeatureError

S, D, U = Status.SUPPORTED, Status.DISABLED, Status.UNSUPPORTED
# The design's feature table, transcribed by hand: the independent reference for the tables.
DESIGN_MATRIX = {
    Feature.REGISTER_HOST_MEMORY: {"cuda": S, "rocm": S, "xpu": U, "cpu": U},
    Feature.ZERO_COPY_SWAP_IN: {"cuda": S, "rocm": S, "xpu": S, "cpu": U},
    Feature.GRAPH_CAPTURE: {"cuda": S, "rocm": S, "xpu": D, "cpu": U},
    Feature.ASYNC_BACKUP: {"cuda": S, "rocm": S, "xpu": S, "cpu": U},
    Feature.SHARED_INDEX_PREFETCH: {"cuda": S, "rocm": S, "xpu": D, "cpu": S},
    Feature.SKIP_IO_PROBE: {"cuda": S, "rocm": S, "xpu": U, "cpu": S},
    # Not in the design's table: an internal launch option the backends state (issue 21).
    Feature.PROGRAMMATIC_DEPENDENT_LAUNCH: {"cuda": S, "rocm": U, "xpu": U, "cpu": U},
    # Not in the design's table either: one host pool per node for the TP ranks (issue 23).
    Feature.SHARED_HOST_POOL: {"cuda": S, "rocm": S, "xpu": U, "cpu": S},
}
BUILTINS: dict[str, type[Backend]] = {
    "cuda": CudaBackend, "rocm": RocmBackend, "xpu": XpuBackend, "cpu": CpuBackend,
}


class EverythingOffBackend(CpuBackend):
    """An out-of-tree backend that lacks every feature, so every flag's path is exercised."""

    name = "nothing"
    features = FeatureTable({
        f: (disabled if i % 2 else unsupported)(f"{f} is off in this test", f"do without {f}")
        for i, f in enumerate(Feature)
    })


def non_supported_cells() -> list[tuple[str, Feature]]:
    cells = [
        (name, feature)
        for name, cls in {**BUILTINS, "nothing": EverythingOffBackend}.items()
        for feature, support in cls.features.items()
        if not support.usable
    ]
    return cells


def call(backend: Backend, feature: Feature, method: str) -> None:
    """Call `feature`'s entry point `method` as its users do."""
    if method == "graph_capture":
        backend.graph_capture()
    else:  # register_host, unregister_host: a shared host pool's segment with shared=True
        getattr(backend, method)(torch.empty(16, dtype=torch.uint8),
                                 shared=feature is Feature.SHARED_HOST_POOL)


def make(name: str) -> Backend:
    return {**BUILTINS, "nothing": EverythingOffBackend}[name]()


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_tables_match_the_design(name: str) -> None:
    table = BUILTINS[name].features
    assert {f: s.status for f, s in table.items()} == {
        f: cells[name] for f, cells in DESIGN_MATRIX.items()
    }
    for support in table.values():
        if not support.usable:
            assert support.reason and support.instead


def test_only_rocm_and_xpu_are_unverified_on_hardware() -> None:
    unverified = sorted(n for n, cls in BUILTINS.items() if not cls.verified_on_hardware)
    assert unverified == ["rocm", "xpu"]


def test_every_feature_that_can_be_off_has_one_way_in() -> None:
    """An entry point that raises, a config flag that warns or raises, or a stated fact: one
    of the three, so no feature is a switch that switches nothing (issue 37)."""
    can_be_off = {f for f, cells in DESIGN_MATRIX.items() if set(cells.values()) != {S}}
    flags = set(FEATURE_FLAGS.values())
    assert can_be_off <= set(FEATURE_ENTRY_POINTS) | flags | FACTS
    assert not (flags & FACTS) and not (set(FEATURE_ENTRY_POINTS) & FACTS)
    # Every feature is one of them (none left over from a removed switch).
    assert set(Feature) <= set(FEATURE_ENTRY_POINTS) | flags | FACTS


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_launch_options_follow_the_table(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend without PDL in its table never hands the launch plan PDL, whatever the
    device says; one with it passes on what the device and triton say."""
    backend_class = BUILTINS[name]
    monkeypatch.setattr(backend_class, "describe",
                        lambda self, index=None: DeviceInfo("a device with PDL", 7, 64, True))
    traits = backend_class().kernel_traits(torch.device("cpu"))
    has_pdl = DESIGN_MATRIX[Feature.PROGRAMMATIC_DEPENDENT_LAUNCH][name] is S
    assert (traits.pdl, traits.compute_units, traits.warp_size) == (has_pdl, 7, 64)


def test_a_table_must_cover_every_feature_and_explain_every_gap() -> None:
    with pytest.raises(ValueError, match="lacks entries for: skip_io_probe"):
        FeatureTable({f: supported() for f in Feature if f is not Feature.SKIP_IO_PROBE})
    with pytest.raises(ValueError, match="needs both a reason and an alternative"):
        unsupported("no reason given here", "")


@pytest.mark.parametrize(("name", "feature"), non_supported_cells())
def test_every_gap_raises_at_its_entry_points(name: str, feature: Feature) -> None:
    backend = make(name)
    support = backend.features[feature]
    methods = FEATURE_ENTRY_POINTS.get(feature, ())
    for method in methods:
        with pytest.raises(UnsupportedFeatureError) as caught:
            call(backend, feature, method)
        error = caught.value
        assert (error.feature, error.backend) == (feature.value, name)
        for part in (feature.value, f"the {name} backend", support.reason, support.instead):
            assert part in str(error), (method, part)
    with pytest.raises(UnsupportedFeatureError, match=feature.value):
        backend.require(feature)
    assert not backend.features.supports(feature)


@pytest.mark.parametrize(
    ("name", "feature"),
    [(n, f) for n, cls in BUILTINS.items() for f, s in cls.features.items() if s.usable],
)
def test_supported_cells_pass_require(name: str, feature: Feature) -> None:
    backend = make(name)
    backend.require(feature)
    assert backend.features.supports(feature)


def requested_gaps() -> list[tuple[str, str]]:
    """(backend, config flag) for every flag whose feature the backend cannot give."""
    return [
        (name, flag)
        for name, _ in {**BUILTINS, "nothing": None}.items()
        for flag, feature in FEATURE_FLAGS.items()
        if not make(name).features.supports(feature)
    ]


@pytest.mark.parametrize(("name", "flag"), requested_gaps())
def test_asking_for_a_gap_warns_once_or_raises(name: str, flag: str) -> None:
    backend = make(name)
    feature = FEATURE_FLAGS[flag]
    config = HiSparseConfig.from_preset("tiny", **{flag: True})
    if feature in RAISE_WHEN_REQUESTED:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # raising must not also warn
            with pytest.raises(UnsupportedFeatureError, match=feature.value):
                resolve_features(config, backend)
        return
    with pytest.warns(FeatureDisabledWarning) as record:
        resolved, turned_off = resolve_features(config, backend)
    assert len(record) == 1
    message = str(record[0].message)
    support = backend.features[feature]
    for part in (flag, name, str(support.status), support.reason, support.instead):
        assert part in message
    assert getattr(resolved, flag) is False
    assert turned_off == [feature]
    assert getattr(config, flag) is True  # the input is frozen and untouched


@pytest.mark.parametrize("name", [*sorted(BUILTINS), "nothing"])
def test_asking_for_everything_warns_once_per_missing_feature(name: str) -> None:
    backend = make(name)
    asked = {f: True for f, feat in FEATURE_FLAGS.items() if feat not in RAISE_WHEN_REQUESTED}
    config = HiSparseConfig.from_preset("tiny", **asked)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resolved, turned_off = resolve_features(config, backend)
    missing = [FEATURE_FLAGS[f] for f in asked
               if not backend.features.supports(FEATURE_FLAGS[f])]
    assert [w.category for w in record] == [FeatureDisabledWarning] * len(missing)
    assert turned_off == missing
    for flag in asked:
        assert getattr(resolved, flag) is backend.features.supports(FEATURE_FLAGS[flag])


@pytest.mark.parametrize("name", [*sorted(BUILTINS), "nothing"])
def test_unset_flags_follow_the_table_silently(name: str) -> None:
    backend = make(name)
    config = HiSparseConfig.from_preset("tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved, turned_off = resolve_features(config, backend)
        off, _ = resolve_features(
            config.replace(**{f: False for f in FEATURE_FLAGS if f != "skip_io"}), backend
        )
    assert turned_off == []
    for flag, feature in FEATURE_FLAGS.items():
        expected = False if flag == "skip_io" else backend.features.supports(feature)
        assert getattr(resolved, flag) is expected
        assert getattr(off, flag) is False
    assert resolved.hot_slots == config.hot_slots


def test_the_warning_is_a_user_warning_exported_at_top_level() -> None:
    assert issubclass(hisparse.FeatureDisabledWarning, UserWarning)
    assert hisparse.UnsupportedFeatureError is UnsupportedFeatureError
    assert issubclass(UnsupportedFeatureError, hisparse.HisparseError)
