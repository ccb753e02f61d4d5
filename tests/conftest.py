"""Fixtures and helpers every hisparse test can use.

Fixtures
  backend       One registered backend per parametrization (test ids are the names). Where a
                backend cannot run here the case skips with that backend's own
                `unavailable_reason()`. With `--backend NAME` (or HISPARSE_TEST_BACKEND=NAME)
                only that backend runs, and it fails instead of skipping when unusable: a
                CI job for a device must not pass by skipping everything.
  device        `backend.device()`.
  seed, rng     A fresh seed per test (HISPARSE_TEST_SEED=N replays one) and a torch.Generator
                seeded with it; the seed is printed, so a failure shows it.
  tiny_config   `HiSparseConfig.from_preset("tiny")`.
  isolated_registry
                The backend registry as it was before the test, restored after it (for tests
                that register backends or fake the environment).
  fake_env      `fake_env("rocm")` makes torch look like a ROCm (or "cuda", "xpu", "none")
                machine for the test: tests/fakes/environment.py.

Marker
  @pytest.mark.requires(Feature.X)   skips unless the `backend` supports X; the reason is
                                     generated from the feature table.

Helpers (`from conftest import random_bytes, poisoned, needs_module, POISON_BYTE, POISON_INDEX`)
  random_bytes(shape, generator, device)  uint8 noise
  poisoned(shape, dtype, device)          a tensor full of POISON_BYTE / POISON_INDEX, so any
                                          entry a kernel failed to write shows up
  needs_module(module, extra)             a skipif marker: the test needs an optional
                                          dependency (triton, nixl, matplotlib, ...); the
                                          reason names the extra that installs it. A test
                                          module that imports it at the top uses
                                          pytest.importorskip with the same reason instead.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch

from hisparse.backends import registry
from hisparse.backends.base import Backend
from hisparse.backends.features import Feature

POISON_BYTE = 0xA5
POISON_INDEX = -7  # no kernel ever writes it: -1 means "none"


def random_bytes(
    shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str = "cpu"
) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).to(device)


def poisoned(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    value = POISON_BYTE if dtype == torch.uint8 else POISON_INDEX
    return torch.full(shape, value, dtype=dtype, device=device)


def needs_module(module: str, extra: str) -> pytest.MarkDecorator:
    """Skip unless the optional `module` is importable, saying which extra installs it."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install 'hisparse[{extra}]')")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default=os.environ.get("HISPARSE_TEST_BACKEND") or None,
        help="run backend-parametrized tests only on this backend, failing if it is unusable "
        "(default: every registered backend, skipping unusable ones; env HISPARSE_TEST_BACKEND)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "requires(feature): skip unless the backend fixture supports the feature"
    )
    # Without a GPU the Triton kernels run interpreted, which must be chosen before anything
    # imports triton (transformers does): any subset of the suite then starts as all of it
    # does, where a kernel test module is collected first.
    if importlib.util.find_spec("triton") is not None:
        import interpreted_kernels  # noqa: F401
    chosen = config.getoption("--backend")
    if chosen:
        # Refuse the whole run at once, with one line, rather than failing case by case.
        try:
            reason = registry.find_backend(chosen).unavailable_reason()
        except Exception as exc:  # an unknown name
            reason = str(exc)
        if reason is not None:
            raise pytest.UsageError(f"--backend {chosen} was asked for but is not usable here: "
                                    f"{reason}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    chosen = metafunc.config.getoption("--backend")
    names = [chosen] if chosen else registry.registered_backends()
    metafunc.parametrize("backend", names, indirect=True, ids=names)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Backend:
    name = request.param
    try:
        found = registry.find_backend(name)
    except Exception as exc:  # an unknown --backend name
        pytest.fail(f"--backend {name}: {exc}")
    reason = found.unavailable_reason()
    if reason is not None:
        if request.config.getoption("--backend"):
            pytest.fail(f"--backend {name} was asked for but is not usable here: {reason}")
        pytest.skip(f"{name}: {reason}")
    for marker in request.node.iter_markers("requires"):
        feature = Feature(marker.args[0])
        support = found.features[feature]
        if not support.usable:
            pytest.skip(f"{name}: {feature} is {support.status} ({support.reason})")
    return found


@pytest.fixture
def device(backend: Backend) -> torch.device:
    return backend.device()


@pytest.fixture
def seed() -> int:
    chosen = os.environ.get("HISPARSE_TEST_SEED")
    value = int(chosen) if chosen else int.from_bytes(os.urandom(4), "little")
    print(f"seed={value} (replay with HISPARSE_TEST_SEED={value})")
    return value


@pytest.fixture
def rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def tiny_config():
    from hisparse.config import HiSparseConfig

    return HiSparseConfig.from_preset("tiny")


@pytest.fixture
def isolated_registry() -> Iterator[None]:
    registry.registered_backends()  # load the built-ins so they are part of the snapshot
    factories = dict(registry._factories)
    instances = dict(registry._instances)
    registry._reset_for_tests()
    yield
    registry._factories.clear()
    registry._factories.update(factories)
    registry._instances.clear()
    registry._instances.update(instances)
    registry._reset_default()


@pytest.fixture
def fake_env(monkeypatch: pytest.MonkeyPatch, isolated_registry: None):
    """`fake_env(kind, gpus=1)`: pretend this machine has `kind` GPUs ("cuda", "rocm", "xpu",
    or "none"); see tests/fakes/environment.py. Registrations are released after the test."""
    from fakes.environment import fake_environment, release_fake_registrations

    made = []

    def make(kind: str, gpus: int = 1):
        made.append(fake_environment(monkeypatch, kind, gpus))
        return made[-1]

    yield make
    if made:
        release_fake_registrations()
    registry._reset_for_tests()


@pytest.fixture
def pool_name(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh shared-pool name per test; a segment file it leaves is an assertion failure,
    not litter (a gated run's reader posts are removed without one: a failed run leaves
    them)."""
    from fakes.gated_writer import ReaderPosts
    from hisparse.core.shared_segment import segment_path

    name = f"t{os.getpid()}-{request.node.name}"[:120].replace("[", "-").replace("]", "")
    yield name
    ReaderPosts(name, 1).unlink()
    path = segment_path(name)
    leaked = os.path.exists(path)
    if leaked:
        os.unlink(path)
    assert not leaked, f"{path} was left behind"
