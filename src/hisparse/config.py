"""`HiSparseConfig`: the typed, frozen, validated configuration, loaded from YAML presets.

Field meanings and symbols are in docs/ARCHITECTURE.md ("Config"). YAML keys are the field
names. Presets live in `configs/` (source tree) or `hisparse/_configs` (installed wheel).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import yaml

from hisparse.backends.features import RAISE_WHEN_REQUESTED, Feature
from hisparse.errors import ConfigError, FeatureDisabledWarning, InvalidInputError
from hisparse.layout.index_schedule import IndexSchedule
from hisparse.layout.widths import RESIDENCY_MAPS

if TYPE_CHECKING:
    from hisparse.backends.base import Backend

KV_DTYPES = ("fp8", "bf16")
INT32_LIMIT = 2**31  # rows and slots are int32 on the device
MAX_DRAFT_TOKENS = 16  # verify steps of up to this many tokens per request (draft slots)
# Config flags that switch a backend feature; None = use it where supported.
FEATURE_FLAGS: Mapping[str, Feature] = MappingProxyType({
    "async_backup": Feature.ASYNC_BACKUP,
    "shared_index_prefetch": Feature.SHARED_INDEX_PREFETCH,
    "skip_io": Feature.SKIP_IO_PROBE,
})
# Keys that switched nothing and were removed: a config that still sets one is refused, saying
# why and what to do (a silent drop would let a user believe the switch still works).
REMOVED_KEYS: Mapping[str, str] = MappingProxyType({
    "graph_capture": (
        "hisparse never captures graphs itself: the caller captures its own decode step, "
        "swap-in included, where the backend has graphs "
        "(backend.features.supports(Feature.GRAPH_CAPTURE)); delete the key"),
    "zero_copy_swap_in": (
        "it switched nothing: every backend runs its own swap-in kernel, the fused zero-copy "
        "one wherever it has one (backend.features.supports(Feature.ZERO_COPY_SWAP_IN)); "
        "delete the key"),
})
_DEEPSEEK_ROW_BYTES = MappingProxyType({"fp8": 656, "bf16": 1152})


@dataclasses.dataclass(frozen=True, slots=True)
class HiSparseConfig:
    """One cache's shape and switches. Build with `from_preset`, `from_yaml` or `from_dict`.

    Defaults describe DeepSeek-V3.2 (configs/default.yaml lists them). Fields left as None
    are derived: `row_bytes` from `row_bytes_by_dtype[kv_dtype]`, `hot_slots` as
    `max(2, max_draft_tokens) * top_k`, `max_batch` as `max_requests`, `residency_map` as
    `"host_row"`, `alias_extents` as the pool's extent count (0 under `position`),
    `index_anchors` from `index_group_size` (1: every layer) and `index_group_size` from
    `index_anchors` (None when the groups differ in size); `replace()` derives them again.
    `index_schedule` maps layers to index groups (`layout.index_schedule.IndexSchedule`).
    """

    model: str = "default"
    num_layers: int = 61
    # The model layers the cache layers hold, in order (None: layers 0 .. num_layers - 1); a
    # DeepSeek-V4 cache holds its compressed sparse-attention layers only.
    managed_layers: tuple[int, ...] | None = None
    # Tokens per row: 1, or 4 for DeepSeek-V4's compressed entries. Lengths, positions, top-k
    # and every size here count rows; this only turns a context in tokens into rows.
    compress_rate: int = 1
    kv_dtype: str = "fp8"
    row_bytes: int | None = None
    row_bytes_by_dtype: Mapping[str, int] | None = dataclasses.field(
        default_factory=lambda: _DEEPSEEK_ROW_BYTES, hash=False
    )
    top_k: int = 2048
    hot_slots: int | None = None  # H, the LRU slots; None: max(2, max_draft_tokens) * top_k
    # Which layers run an indexer: either a uniform group size (layers 0, n, 2n, ... run it)
    # or the anchor layers themselves (GLM-5.2: 0, 1, 2, 6, 10, ...); set one, or both alike.
    index_group_size: int | None = None
    index_anchors: tuple[int, ...] | None = None
    max_requests: int = 64
    max_batch: int | None = None
    max_seq_len: int = 131072
    host_pool_tokens: int = 1048576
    extent_tokens: int = 512
    residency_map: str | None = None
    # host_row only: residency-key extents for requests admitted on a shared prefix, one per
    # shared extent such a request holds (core/prefixes.py), so that two requests holding one
    # host row never share a `resident` entry. None: as many as the pool has extents (the
    # residency map doubles: G x alias_extents x extent_tokens more int16 entries); 0: sharing
    # is refused under host_row. Unused (derived 0) under position.
    alias_extents: int | None = None
    async_backup: bool | None = None
    shared_index_prefetch: bool | None = None
    skip_io: bool = False
    validate: bool = False
    # D: the most tokens one verify step appends per request (speculative decoding); the cache
    # reserves D never-evicted device slots per request for them (docs/ARCHITECTURE.md). The
    # first verify (or dedupe) step also allocates the Triton swap-in's presence table:
    # max_batch x (max_seq_len + D) x 4 bytes of device memory (32 MiB at 64 x 128k).
    max_draft_tokens: int = 1
    _derived: frozenset[str] = dataclasses.field(
        default=frozenset(), init=False, repr=False, compare=False
    )
    _schedule: IndexSchedule | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        problems: list[str] = []
        derived = set()
        set_field = object.__setattr__  # frozen: derived values are filled in here only

        if not isinstance(self.model, str) or not self.model:
            problems.append(f"model: expected a non-empty string, got {self.model!r}")
        if self.kv_dtype not in KV_DTYPES:
            problems.append(
                f"kv_dtype: got {self.kv_dtype!r}; valid choices: {', '.join(KV_DTYPES)}"
            )
        self._derive_row_bytes(problems, derived)
        positive = ("num_layers", "top_k", "index_group_size", "max_requests", "max_seq_len",
                    "host_pool_tokens", "extent_tokens", "row_bytes", "max_draft_tokens",
                    "compress_rate")
        bad = set()  # fields already reported: nothing is derived or checked from them
        for name in positive:
            value = getattr(self, name)
            if value is None and name == "index_group_size":
                continue  # derived below
            if not _is_int(value) or value <= 0:
                bad.add(name)
                # A missing row_bytes was reported above, with what would have derived it.
                if value is not None or name != "row_bytes":
                    problems.append(f"{name}: expected a positive int, got {value!r}")
        self._derive_schedule(problems, derived, bad)
        self._check_managed_layers(problems, bad)

        if self.hot_slots is None and not {"top_k", "max_draft_tokens"} & bad:
            # A verify step of D tokens may select D * top_k distinct positions, all of which
            # must fit the LRU at once (the union): the default makes room for them.
            set_field(self, "hot_slots", max(2, self.max_draft_tokens) * self.top_k)
            derived.add("hot_slots")
        if self.max_batch is None and "max_requests" not in bad:
            set_field(self, "max_batch", self.max_requests)
            derived.add("max_batch")
        for name, low in (("hot_slots", self.top_k), ("max_batch", 1)):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                problems.append(f"{name}: expected an int, got {value!r}")
                bad.add(name)
            elif _is_int(value) and _is_int(low) and value < low:
                what = "top_k" if name == "hot_slots" else "1"
                problems.append(f"{name}: got {value}, must be at least {what} ({low})")

        if self.residency_map is None:
            set_field(self, "residency_map", "host_row")
            derived.add("residency_map")
        elif self.residency_map not in RESIDENCY_MAPS:
            problems.append(f"residency_map: got {self.residency_map!r}; valid choices: "
                            f"{', '.join(RESIDENCY_MAPS)} or null (host_row)")
            bad.add("residency_map")
        self._derive_alias_extents(problems, derived, bad)

        for name in FEATURE_FLAGS:
            value = getattr(self, name)
            allowed = (True, False) if name == "skip_io" else (True, False, None)
            if value not in allowed or not isinstance(value, (bool, type(None))):
                choices = "true or false" if name == "skip_io" else "true, false or null"
                problems.append(f"{name}: got {value!r}; valid choices: {choices}")
        if not isinstance(self.validate, bool):
            problems.append(f"validate: got {self.validate!r}; valid choices: true or false")

        if not bad:
            problems.extend(self._check_limits())
        if problems:
            raise ConfigError(problems)
        set_field(self, "_derived", frozenset(derived))

    def _derive_schedule(self, problems: list[str], derived: set[str], bad: set[str]) -> None:
        """`index_anchors` and `index_group_size` from each other, and the `IndexSchedule`."""
        set_field = object.__setattr__
        size, anchors, layers = self.index_group_size, self.index_anchors, self.num_layers
        if {"num_layers", "index_group_size"} & bad:
            bad.add("index_anchors")
            return
        if anchors is not None:
            if isinstance(anchors, list):
                anchors = tuple(anchors)
                set_field(self, "index_anchors", anchors)
            wrong = IndexSchedule.problems(layers, anchors)
            if wrong:
                problems.extend(wrong)
                bad.add("index_anchors")
                return
            schedule = IndexSchedule(layers, anchors)
            if size is None:
                set_field(self, "index_group_size", schedule.uniform_size)
                derived.add("index_group_size")
            elif schedule.uniform_size != size or schedule.anchors != tuple(range(0, layers, size)):
                problems.append(
                    f"index_group_size: got {size}, but index_anchors {list(anchors)!r:.200} "
                    "are not groups of that size; set only one of them")
                bad.add("index_anchors")
                return
        else:
            if size is None:
                size = 1
                set_field(self, "index_group_size", 1)
                derived.add("index_group_size")
            try:
                schedule = IndexSchedule.uniform(layers, size)
            except ValueError as exc:
                problems.append(str(exc))
                bad.add("index_anchors")
                return
            set_field(self, "index_anchors", schedule.anchors)
            derived.add("index_anchors")
        set_field(self, "_schedule", schedule)

    def _check_managed_layers(self, problems: list[str], bad: set[str]) -> None:
        layers = self.managed_layers
        if layers is None or "num_layers" in bad:
            return
        if isinstance(layers, list):
            layers = tuple(layers)
            object.__setattr__(self, "managed_layers", layers)
        if not isinstance(layers, tuple) or len(layers) != self.num_layers or not all(
                _is_int(x) and x >= 0 for x in layers) or list(layers) != sorted(set(layers)):
            problems.append(f"managed_layers: got {layers!r:.200}; expected num_layers "
                            f"({self.num_layers}) distinct model layer numbers >= 0 in "
                            "increasing order, or null (layers 0 .. num_layers - 1)")
            bad.add("managed_layers")

    def cache_layer(self, model_layer: int) -> int:
        """The cache layer that holds model layer `model_layer` (`managed_layers`).

        Raises:
            InvalidInputError: the model layer is not one this cache manages.
        """
        layers = self.managed_layers or range(self.num_layers)
        if _is_int(model_layer) and model_layer in layers:
            return layers.index(model_layer)
        raise InvalidInputError(
            f"model layer {model_layer!r} is not managed by this cache: its managed_layers "
            f"are {list(layers)!r:.200}; keep that layer's KV in the framework")

    def rows_for_tokens(self, tokens: int) -> int:
        """The rows a context of `tokens` tokens holds: one per `compress_rate` tokens."""
        return tokens // self.compress_rate

    def _derive_alias_extents(self, problems: list[str], derived: set[str],
                              bad: set[str]) -> None:
        """`alias_extents` for the residency map: the pool's extent count under host_row."""
        value = self.alias_extents
        if value is None:
            if not {"host_pool_tokens", "extent_tokens", "residency_map"} & bad:
                object.__setattr__(self, "alias_extents",
                                   self.num_extents if self.residency_map == "host_row" else 0)
                derived.add("alias_extents")
        elif not _is_int(value) or value < 0:
            problems.append(f"alias_extents: expected an int >= 0 or null (the pool's extent "
                            f"count), got {value!r}")
            bad.add("alias_extents")

    def _derive_row_bytes(self, problems: list[str], derived: set[str]) -> None:
        """`row_bytes` from `row_bytes_by_dtype[kv_dtype]` where it is not given."""
        set_field = object.__setattr__
        by_dtype = self.row_bytes_by_dtype
        if by_dtype is not None:
            if not isinstance(by_dtype, Mapping) or any(
                k not in KV_DTYPES or not _is_int(v) or v <= 0 for k, v in by_dtype.items()
            ):
                problems.append(
                    f"row_bytes_by_dtype: got {by_dtype!r}; expected a mapping from "
                    f"{' / '.join(KV_DTYPES)} to a positive number of bytes"
                )
                by_dtype = None
            else:
                set_field(self, "row_bytes_by_dtype", MappingProxyType(dict(by_dtype)))
        if self.row_bytes is None:
            if by_dtype is not None and self.kv_dtype in KV_DTYPES and self.kv_dtype in by_dtype:
                set_field(self, "row_bytes", by_dtype[self.kv_dtype])
                derived.add("row_bytes")
            elif self.kv_dtype in KV_DTYPES:
                problems.append(
                    f"row_bytes: not given and row_bytes_by_dtype has no entry for "
                    f"kv_dtype {self.kv_dtype!r}; set one of them"
                )

    def _check_limits(self) -> list[str]:
        problems = []
        if self.max_draft_tokens > MAX_DRAFT_TOKENS:
            problems.append(f"max_draft_tokens: got {self.max_draft_tokens}, at most "
                            f"{MAX_DRAFT_TOKENS} are supported")
        elif self.max_draft_tokens > 1 and (
                self.max_draft_tokens * self.top_k > self.hot_slots):
            # Refused here rather than at a step: a union that does not fit would leave
            # misses without a slot, i.e. rows the swap-in cannot return.
            problems.append(
                f"hot_slots: got {self.hot_slots}, a verify step of "
                f"max_draft_tokens={self.max_draft_tokens} tokens may select "
                f"{self.max_draft_tokens} x top_k = {self.max_draft_tokens * self.top_k} "
                "distinct positions, which must all fit the hot buffer; raise "
                "hot_slots or lower max_draft_tokens"
            )
        if self.hot_slots >= INT32_LIMIT:
            problems.append(f"hot_slots: got {self.hot_slots}, must be < 2**31")
        if self.max_batch > self.max_requests:
            problems.append(
                f"max_batch: got {self.max_batch}, larger than max_requests ({self.max_requests}); "
                "a batch row is one decoding request"
            )
        if self.host_rows >= INT32_LIMIT:
            problems.append(
                f"host_pool_tokens: {self.host_pool_tokens} rounds up to {self.host_rows} rows, "
                "must be < 2**31 (int32 row ids)"
            )
        if self.max_seq_len > self.host_rows:
            problems.append(
                f"max_seq_len: got {self.max_seq_len}, more than the host pool holds "
                f"({self.host_rows} rows); raise host_pool_tokens or lower max_seq_len"
            )
        position_keys = self.max_requests * self.pages_per_request * self.extent_tokens
        if self.residency_map == "position" and position_keys >= INT32_LIMIT:
            problems.append(
                f"residency_map: position keys max_requests * max_seq_len (in whole extents) = "
                f"{position_keys}, must be < 2**31; use host_row or fewer requests"
            )
        host_keys = (self.num_extents + (self.alias_extents or 0)) * self.extent_tokens
        if self.residency_map == "host_row" and host_keys >= INT32_LIMIT:
            problems.append(
                f"alias_extents: host_row keys (pool extents + alias_extents) * extent_tokens "
                f"= {host_keys}, must be < 2**31; lower alias_extents or host_pool_tokens"
            )
        if self.max_requests * self.slots_per_request >= INT32_LIMIT:
            problems.append(
                f"max_requests * (hot_slots + max_draft_tokens) = "
                f"{self.max_requests * self.slots_per_request} device rows, must be < 2**31"
            )
        return problems

    # --- derived sizes (docs/ARCHITECTURE.md symbols) ------------------------------------
    @property
    def slots_per_request(self) -> int:
        """H + D: slot H holds the newest token, slots H..H+D-1 a verify step's drafts."""
        return self.hot_slots + self.max_draft_tokens

    @property
    def batch_capacity(self) -> int:
        """Bcap: the padded batch size swap-in is captured for."""
        return self.max_batch

    @property
    def index_schedule(self) -> IndexSchedule:
        """Which layers run an indexer, and the index group of every layer."""
        assert self._schedule is not None  # set by __post_init__ of every valid config
        return self._schedule

    @property
    def num_index_groups(self) -> int:
        """G: groups of layers that share one indexer's top-k (and one residency table)."""
        return self.index_schedule.num_groups

    def group_of_layer(self, layer: int) -> int:
        return self.index_schedule.group_of(layer)

    def anchor_layer(self, group: int) -> int:
        """The first layer of `group`: it plans the misses the rest of the group replays."""
        return self.index_schedule.anchors[group]

    @property
    def num_extents(self) -> int:
        return math.ceil(self.host_pool_tokens / self.extent_tokens)

    @property
    def host_rows(self) -> int:
        """N: host rows per layer, `host_pool_tokens` rounded up to whole extents."""
        return self.num_extents * self.extent_tokens

    @property
    def pages_per_request(self) -> int:
        """P: page-table width."""
        return math.ceil(self.max_seq_len / self.extent_tokens)

    @property
    def host_pool_bytes(self) -> int:
        return self.num_layers * self.host_rows * self.row_bytes

    # --- building ------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "") -> HiSparseConfig:
        """Build from a mapping of field names; unknown keys are rejected with the valid list."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source or 'config'}: expected a mapping of keys, got {values!r}")
        _refuse_removed_keys(values, source)
        values = _renamed_keys(values, source)
        known = set(cls.field_names())
        unknown = sorted(map(str, set(values) - known))
        problems = []
        if unknown:
            where = f" in {source}" if source else ""
            problems.append(
                f"unknown key(s){where}: {', '.join(unknown)}; "
                f"valid keys: {', '.join(cls.field_names())}"
            )
        try:
            config = cls(**{k: v for k, v in values.items() if k in known})
        except ConfigError as exc:
            problems.extend(exc.problems)
        if problems:
            raise ConfigError(problems)
        return config

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> HiSparseConfig:
        """Load a YAML file of field names (unset ones keep their defaults), then `overrides`."""
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        _refuse_removed_keys(overrides, "override")
        overrides = dict(_renamed_keys(overrides, "override"))
        if not isinstance(loaded, Mapping):
            raise ConfigError(
                f"{path}: expected a mapping of config keys, got {type(loaded).__name__}"
            )
        known = set(cls.field_names()) | set(RENAMED_KEYS)
        # An unknown override is the caller's mistake, not the file's: say so.
        problems = [
            f"unknown override key(s): {', '.join(sorted(map(str, set(overrides) - known)))}; "
            f"valid keys: {', '.join(cls.field_names())}"
        ] if set(overrides) - known else []
        if isinstance(loaded, Mapping):
            loaded = _renamed_keys(loaded, str(path))
        overrides = {k: v for k, v in overrides.items() if k in known}
        values = {"model": path.stem, **_without_replaced_schedule(loaded, overrides),
                  **overrides}
        try:
            config = cls.from_dict(values, source=str(path))
        except ConfigError as exc:
            problems = list(exc.problems) + problems
        if problems:
            raise ConfigError(problems)
        return config

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> HiSparseConfig:
        """Load a shipped preset by name, then apply overrides.

        Raises:
            ConfigError: the preset does not exist (the message lists those that do), or a
                value is invalid.

        Example:
            >>> HiSparseConfig.from_preset("glm-5", kv_dtype="bf16").row_bytes
            1152
        """
        presets = preset_paths()
        if name not in presets:
            raise ConfigError(
                f"unknown preset {name!r}; available presets: {', '.join(sorted(presets))} "
                "(or load your own file with HiSparseConfig.from_yaml(path))"
            )
        return cls.from_yaml(presets[name], **overrides)

    def with_num_layers(self, num_layers: int) -> HiSparseConfig:
        """The first `num_layers` layers of this model: a uniform schedule is kept, listed
        anchors past the new last layer and managed layers past the new count are dropped."""
        managed = None if self.managed_layers is None else self.managed_layers[:num_layers]
        if "index_anchors" in self._derived:
            return self.replace(num_layers=num_layers, managed_layers=managed)
        anchors = [a for a in self.index_schedule.anchors if a < num_layers]
        return self.replace(num_layers=num_layers, index_anchors=anchors,
                            managed_layers=managed)

    def replace(self, **changes: Any) -> HiSparseConfig:
        """A validated copy with `changes`; derived fields are derived again."""
        values = {k: v for k, v in self.to_dict().items() if k not in self._derived}
        values = _without_replaced_schedule(values, changes)
        values.update(changes)
        return type(self).from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in self.field_names()}
        if values["row_bytes_by_dtype"] is not None:
            values["row_bytes_by_dtype"] = dict(values["row_bytes_by_dtype"])
        for name in ("index_anchors", "managed_layers"):
            if values[name] is not None:
                values[name] = list(values[name])
        return values


SCHEDULE_KEYS = ("index_group_size", "index_anchors")


def _without_replaced_schedule(values: Mapping[str, Any],
                               changes: Mapping[str, Any]) -> dict[str, Any]:
    """`values` less its index schedule where `changes` set one: an override of either key
    replaces the schedule (a preset's anchors give way to `index_group_size`, and back)."""
    if not any(key in changes for key in SCHEDULE_KEYS):
        return dict(values)
    return {k: v for k, v in values.items() if k not in SCHEDULE_KEYS}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def preset_dirs() -> list[Path]:
    """Where presets are looked up: the installed wheel's copy first, then the source tree."""
    package = Path(__file__).resolve().parent
    candidates = [package / "_configs", package.parents[1] / "configs"]
    return [d for d in candidates if d.is_dir()]


def preset_paths() -> dict[str, Path]:
    """Preset name -> YAML file; the first directory of `preset_dirs()` that has a name wins."""
    found: dict[str, Path] = {}
    for directory in preset_dirs():
        for path in sorted(directory.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def resolve_features(
    config: HiSparseConfig, backend: Backend
) -> tuple[HiSparseConfig, list[Feature]]:
    """The config with every feature flag decided for `backend`, and the features turned off.

    None means "use it where supported" and stays silent; True on a backend that disables or
    lacks the feature turns it off with one FeatureDisabledWarning; False stays off.

    Raises:
        UnsupportedFeatureError: `skip_io=True` (or another feature in RAISE_WHEN_REQUESTED)
            on a backend without it: silently dropping it would time the wrong thing.
    """
    changes: dict[str, bool] = {}
    turned_off: list[Feature] = []
    for flag, feature in FEATURE_FLAGS.items():
        asked = getattr(config, flag)
        usable = backend.features.supports(feature)
        if asked and not usable:
            if feature in RAISE_WHEN_REQUESTED:
                backend.require(feature)
            support = backend.features[feature]
            warnings.warn(
                f"{flag} was requested but is {support.status} on the {backend.name} backend: "
                f"{support.reason}; turning it off. Instead, {support.instead}.",
                FeatureDisabledWarning,
                stacklevel=2,
            )
            turned_off.append(feature)
        changes[flag] = usable if asked is None else bool(asked) and usable
    return config.replace(**changes), turned_off


def _refuse_removed_keys(values: Mapping[str, Any], source: str) -> None:
    """Raise ConfigError for every key of REMOVED_KEYS that `values` sets (whatever its value)."""
    removed = [key for key in REMOVED_KEYS if key in values]
    if removed:
        where = f"{source}: " if source else ""
        raise ConfigError([f"{where}{key} was removed: {REMOVED_KEYS[key]}" for key in removed])


# Keys a config file or override may still use, with their new names; each use warns once.
RENAMED_KEYS = {"device_buffer_size": "hot_slots"}


def _renamed_keys(values: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    old = [key for key in RENAMED_KEYS if key in values]
    if not old:
        return values
    renamed = dict(values)
    for key in old:
        new = RENAMED_KEYS[key]
        if new in renamed:
            raise ConfigError(f"{source or 'config'}: {key} and {new} are the same setting "
                              f"({key} is its old name); keep {new} only")
        warnings.warn(f"{source or 'config'}: the key {key!r} is now {new!r}; rename it "
                      "(the old name will stop working)", DeprecationWarning, stacklevel=4)
        renamed[new] = renamed.pop(key)
    return renamed
