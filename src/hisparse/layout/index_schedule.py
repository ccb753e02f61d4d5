"""Which layers run an indexer: the one place that maps layers to index groups and back.

A model runs its indexer at its anchor layers; every other layer (a follower) reuses the
top-k of the latest anchor at or before it. An index group is an anchor and its followers,
so groups are runs of consecutive layers of any lengths (GLM-5.2: layers 0, 1, 2, 6, 10, ...
run the indexer). A uniform `index_group_size` is the schedule `0, size, 2 * size, ...`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

# transformers' `indexer_types` entries (GlmMoeDsaConfig): "full" runs the indexer, "shared"
# reuses the previous full layer's top-k.
INDEXER_TYPES = ("full", "shared")


@dataclass(frozen=True)
class IndexSchedule:
    """The anchor layers of a model of `num_layers` layers (sorted, starting at 0).

    Build with `uniform(num_layers, size)`, `from_indexer_types(types)` or the constructor;
    `problems(...)` says what is wrong with a candidate without raising.
    """

    num_layers: int
    anchors: tuple[int, ...]
    _group_of: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        problems = self.problems(self.num_layers, self.anchors)
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "anchors", tuple(int(a) for a in self.anchors))
        groups = [bisect.bisect_right(self.anchors, layer) - 1
                  for layer in range(self.num_layers)]
        object.__setattr__(self, "_group_of", tuple(groups))

    @staticmethod
    def problems(num_layers: object, anchors: object) -> list[str]:
        """What makes `anchors` no schedule of `num_layers` layers (empty: it is one)."""
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            return [f"num_layers: expected a positive int, got {num_layers!r}"]
        if (not isinstance(anchors, Sequence) or isinstance(anchors, str)
                or not all(isinstance(a, int) and not isinstance(a, bool) for a in anchors)):
            return [f"index_anchors: expected a list of layer numbers, got {anchors!r:.200}"]
        if not anchors or anchors[0] != 0:
            return [f"index_anchors: got {list(anchors)!r:.200}; it must start at layer 0 (the "
                    "first layer always runs the indexer: a follower reuses an earlier top-k)"]
        if any(b <= a for a, b in itertools.pairwise(anchors)):
            return [f"index_anchors: got {list(anchors)!r:.200}; list each anchor layer once, "
                    "in increasing order"]
        if anchors[-1] >= num_layers:
            return [f"index_anchors: layer {anchors[-1]} is not a layer of the model "
                    f"(num_layers={num_layers}: layers 0..{num_layers - 1})"]
        return []

    # --- building --------------------------------------------------------------------------
    @classmethod
    def uniform(cls, num_layers: int, size: int) -> IndexSchedule:
        """Groups of `size` consecutive layers (the last may be shorter)."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"index_group_size: expected a positive int, got {size!r}")
        if isinstance(num_layers, int) and size > num_layers:
            raise ValueError(f"index_group_size: got {size}, larger than num_layers "
                             f"({num_layers})")
        return cls(num_layers, tuple(range(0, num_layers, size)))

    @classmethod
    def from_indexer_types(cls, types: Sequence[str]) -> IndexSchedule:
        """From transformers' per-layer `indexer_types` ("full" / "shared")."""
        bad = [(layer, t) for layer, t in enumerate(types) if t not in INDEXER_TYPES]
        if bad:
            layer, value = bad[0]
            raise ValueError(f"indexer_types[{layer}]: got {value!r}; valid choices: "
                             f"{', '.join(INDEXER_TYPES)}")
        return cls(len(types), tuple(i for i, t in enumerate(types) if t == "full"))

    # --- the mapping -----------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        """G: the number of indexers, one top-k (and one residency table) per group."""
        return len(self.anchors)

    @property
    def layer_groups(self) -> tuple[int, ...]:
        """The group of every layer, in layer order."""
        return self._group_of

    def group_of(self, layer: int) -> int:
        return self._group_of[layer]

    def anchor_of(self, layer: int) -> int:
        """The latest anchor at or before `layer`: the layer whose top-k `layer` uses."""
        return self.anchors[self._group_of[layer]]

    def layers_of(self, group: int) -> range:
        """The layers of `group`: its anchor first, then its followers."""
        stop = self.anchors[group + 1] if group + 1 < len(self.anchors) else self.num_layers
        return range(self.anchors[group], stop)

    def followers_of(self, group: int) -> range:
        layers = self.layers_of(group)
        return layers[1:]

    @property
    def shares(self) -> bool:
        """Whether any layer follows an anchor (else every layer plans its own swap-in)."""
        return self.num_groups < self.num_layers

    @property
    def uniform_size(self) -> int | None:
        """The group size if every group but the last has it, else None (irregular)."""
        if self.num_groups == 1:
            return self.num_layers
        size = self.anchors[1]
        return size if self.anchors == tuple(range(0, self.num_layers, size)) else None

    @property
    def largest_group(self) -> int:
        return max(len(self.layers_of(g)) for g in range(self.num_groups))

    def truncated(self, num_layers: int) -> IndexSchedule:
        """The schedule of the first `num_layers` layers."""
        return IndexSchedule(num_layers, tuple(a for a in self.anchors if a < num_layers))

    def whole_groups(self, at_least: int) -> int:
        """The fewest leading layers, at least `at_least`, that end on a group's boundary."""
        if at_least >= self.num_layers:
            return self.num_layers
        group = self._group_of[max(at_least, 1) - 1]
        return self.layers_of(group).stop

    def describe(self) -> str:
        """One line: "every layer", "groups of 4" or the anchor list."""
        if not self.shares:
            return "every layer runs its indexer"
        size = self.uniform_size
        if size is not None:
            return f"one indexer per {size} layers"
        return f"indexers at layers {', '.join(map(str, self.anchors))}"
