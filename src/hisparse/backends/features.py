"""Feature tables as data: what each backend can do, and what happens when it cannot."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


class Feature(str, enum.Enum):
    """The rows of the feature table (host pool allocation is part of every backend)."""

    REGISTER_HOST_MEMORY = "register_host_memory"
    # The swap-in reads missing rows straight out of host memory (the fused Triton kernel):
    # a fact the benchmarks report, not a switch; the backend binds the kernel it has.
    ZERO_COPY_SWAP_IN = "zero_copy_swap_in"
    # The caller may capture its decode step, swap-in included, in a graph (hisparse never
    # captures one itself): `Backend.graph_capture` raises where the table says no.
    GRAPH_CAPTURE = "graph_capture"
    ASYNC_BACKUP = "async_backup"
    SHARED_INDEX_PREFETCH = "shared_index_prefetch"
    SKIP_IO_PROBE = "skip_io_probe"
    # Kernels of one swap-in overlap their launch with the one ahead (griddepcontrol). Not a
    # config key: the launch plan uses it wherever the backend and the device have it.
    PROGRAMMATIC_DEPENDENT_LAUNCH = "programmatic_dependent_launch"
    # One host pool in shared memory for the tensor-parallel ranks of a node (issue 23):
    # every rank maps it and makes it device-readable. Asked for with `shared_pool=` on the
    # cache, not a config key; a backend without it keeps a private pool per rank, warned.
    SHARED_HOST_POOL = "shared_host_pool"

    def __str__(self) -> str:
        return self.value


# A config that asks for one of these on a backend that lacks it must fail, not be turned off:
# turning the skip-IO probe off would silently time the copy it exists to leave out.
RAISE_WHEN_REQUESTED = frozenset({Feature.SKIP_IO_PROBE})
# Features no caller asks for, so they have no raising entry point: facts the launch plan
# (Backend.kernel_traits) and the benchmarks read, going without them where they are missing.
FACTS = frozenset({Feature.PROGRAMMATIC_DEPENDENT_LAUNCH, Feature.ZERO_COPY_SWAP_IN})


class Status(str, enum.Enum):
    SUPPORTED = "supported"
    DISABLED = "disabled"  # implemented but turned off at init with a warning (not verified)
    UNSUPPORTED = "unsupported"  # bound to a raising stub

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Support:
    status: Status
    reason: str = ""
    instead: str = ""  # the way out, for DISABLED and UNSUPPORTED entries

    def __post_init__(self) -> None:
        if self.status is not Status.SUPPORTED and not (self.reason and self.instead):
            raise ValueError(f"a {self.status} feature needs both a reason and an alternative")

    @property
    def usable(self) -> bool:
        return self.status is Status.SUPPORTED


def supported(note: str = "") -> Support:
    return Support(Status.SUPPORTED, note)


def disabled(reason: str, instead: str) -> Support:
    return Support(Status.DISABLED, reason, instead)


def unsupported(reason: str, instead: str) -> Support:
    return Support(Status.UNSUPPORTED, reason, instead)


class FeatureTable(Mapping[Feature, Support]):
    """A frozen mapping with exactly one entry per Feature."""

    def __init__(self, entries: Mapping[Feature, Support]) -> None:
        missing = [f.value for f in Feature if f not in entries]
        if missing:
            raise ValueError(f"feature table lacks entries for: {', '.join(missing)}")
        self._entries = MappingProxyType(dict(entries))

    def __getitem__(self, feature: Feature) -> Support:
        return self._entries[Feature(feature)]

    def __iter__(self):
        return iter(Feature)

    def __len__(self) -> int:
        return len(self._entries)

    def supports(self, feature: Feature) -> bool:
        """Whether `feature` works here (its entry is SUPPORTED)."""
        return self[feature].usable

    def to_dict(self) -> dict[str, dict[str, str]]:
        return {
            f.value: {"status": s.status.value, "reason": s.reason, "instead": s.instead}
            for f, s in self.items()
        }
