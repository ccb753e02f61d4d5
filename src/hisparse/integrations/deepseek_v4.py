"""hisparse under transformers' DeepSeek-V4: the compressed sparse-attention (CSA) entries.

`HiSparseV4Cache(model, ...)` is a transformers `DynamicCache` whose CSA layers keep their
compressed entries (one per 4 tokens, `head_dim` values in the model's dtype) in a
`HiSparseCache`, one cache layer per CSA layer; everything else stays in transformers' own
layers: the sliding windows, the HCA entries, the indexer's keys, the compressors' buffers
and overlap state (docs/deepseek-v4.md). Pass it to `model.generate(...,
past_key_values=cache)`:

- A prefill attends over the pass's entries as transformers does; once the pass completes,
  each batch row is admitted with the padded length's entries (what the indexer's indices
  address), and the layers keep a zero-stride placeholder of the entries' shape.
- A decode step opens at the first CSA layer's compressor update, with every request
  appending the entry the compressor emitted (1 when the token closed a window, else 0: the
  framework's compressor decides, hisparse does not count tokens). A forward hook on each
  CSA compressor then replaces its output by the rows `swap_in(layer, top_k, newest_kv=)`
  returned for the indexer's top-k, gathered, with a bias of 0 for a valid row and -inf
  for none: the model's own attention, sinks included, runs over the raw window and those
  rows.
- The step ends after the base model's forward pass (a hook called even when the pass
  raises, which cancels the step and puts every layer's transformers-side state back).
- `load_context(source)` starts from transformers' own cache of a batch prefilled
  elsewhere instead of a prefill pass: its CSA entries are admitted, the rest taken over.

Supported: greedy or sampled generation of a left-padded batch, one token per decode
forward pass; not beam search, cache cropping or batch reordering.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from hisparse.errors import ConfigError, InvalidInputError, MissingDependencyError

try:
    from transformers import DynamicCache
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache
except ImportError as exc:
    raise MissingDependencyError(
        f"hisparse.integrations.deepseek_v4 needs transformers 5.17 or newer ({exc}); "
        "install it with pip install 'hisparse[transformers]'") from exc

from hisparse.attention import gather_rows, pad_top_k
from hisparse.config import HiSparseConfig
from hisparse.core.engine import HiSparseCache
from hisparse.footprint import device_bytes
from hisparse.integrations._engine_cache import EngineCache, admit_batch

CSA = "compressed_sparse_attention"


def csa_layers(model: nn.Module) -> list[int]:
    """The model layers whose compressed entries hisparse holds (its CSA layers)."""
    return [i for i, kind in enumerate(_model_config(model).layer_types) if kind == CSA]


def hisparse_v4_config_for(model: nn.Module, **overrides: Any) -> HiSparseConfig:
    """A `HiSparseConfig` of the model's CSA layers: one cache layer each (`managed_layers`,
    at the CSA `compress_rate`), rows of `head_dim` values of the model's dtype, its
    indexer's top-k, one index group per layer (each runs its own indexer); lengths count
    entries. `overrides` set the rest (hot_slots,
    max_requests, max_seq_len in entries, host_pool_tokens, ...)."""
    config = _model_config(model)
    csa = csa_layers(model)
    values: dict[str, Any] = {
        "model": config.model_type, "num_layers": len(csa), "managed_layers": csa,
        "compress_rate": int(config.compress_rates[CSA]), "kv_dtype": "bf16",
        "row_bytes": _row_bytes(model), "row_bytes_by_dtype": None,
        "top_k": config.index_topk, "index_group_size": 1}
    values.update(overrides)
    return HiSparseConfig.from_dict(values)


class _CSAEntries(DeepseekV4CSACache):
    """One CSA layer: transformers' own state but for the compressor's entries, which go to
    the owner's `HiSparseCache` (cache layer `index`)."""

    _layer_type = None  # not transformers' default CSA layer (subclasses register themselves)

    def __init__(self, model_config: Any, owner: HiSparseV4Cache, index: int) -> None:
        super().__init__(model_config)
        self._owner = weakref.ref(owner)
        self.index = index
        self.pending: torch.Tensor | None = None  # a prefill's entries, until the pass ends
        self.newest: torch.Tensor | None = None  # a decode pass's new entry [B, 0 or 1, D]

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        if name != "compressor":
            return super().update_compressor_states(name, compressed)
        owner = self._owner()
        self.entry_count[name] += compressed.shape[1]
        held = self.entry_count[name]
        if owner is None or owner.ids is None:  # a prefill: the queries read these entries
            self.pending = (compressed if self.pending is None
                            else torch.cat([self.pending, compressed], dim=1))
            result = self.pending
        else:
            owner.open_step(self, compressed)
            self.newest = compressed
            result = compressed.new_zeros(()).expand(compressed.shape[0], held,
                                                     compressed.shape[2])
        # What the layer holds (the entries live in hisparse): a placeholder of their shape.
        self.compressed_kv[name] = result.new_zeros(()).expand(result.shape)
        return result


class HiSparseV4Cache(EngineCache, DynamicCache):
    """A transformers cache whose CSA entries live in hisparse (module docstring).

    Args:
        model: a `DeepseekV4ForCausalLM` (or its base model), eager attention.
        config: a `HiSparseConfig` of its CSA layers; None: `hisparse_v4_config_for(model,
            **overrides)`.
        device: where the hot buffers live (None: the model's device).

    One cache serves one batch: its prefill admits one request per batch row.
    """

    def __init__(self, model: nn.Module, config: HiSparseConfig | None = None,
                 device: str | torch.device | None = None, **overrides: Any) -> None:
        model_config = _model_config(model)
        if config is None:
            config = hisparse_v4_config_for(model, **overrides)
        elif overrides:
            raise ConfigError("pass either a config or overrides of the model's, not both")
        _check_fits(config, model)
        super().__init__(config=model_config)
        self.csa_layers = list(config.managed_layers or ())
        for index, layer in enumerate(self.csa_layers):
            self.layers[layer] = _CSAEntries(model_config, self, index)
        self.dtype = next(model.parameters()).dtype
        self.engine = HiSparseCache(config, device=device or next(model.parameters()).device)
        self.ids: list[str] | None = None  # one request per batch row, after the prefill
        self._step: Any = None
        self._top_k: dict[int, torch.Tensor] = {}  # per CSA layer: this pass's indexer top-k
        self._saved: list[dict[str, Any]] | None = None  # every layer's state before the pass
        self._hooks = self._install_hooks(getattr(model, "model", model))

    # --- transformers' Cache ----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:  # a pass that raises puts these back
            self._saved = [_state_of(layer) for layer in self.layers]
        if self.ids is not None and key_states.shape[-2] != 1:
            raise InvalidInputError(
                f"a forward pass of {key_states.shape[-2]} tokens after the prefill: "
                "HiSparseV4Cache decodes one token per forward pass")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def load_context(self, source: DynamicCache) -> None:
        """Start from a context prefilled elsewhere (a prefill node's, a benchmark's synthetic
        one) instead of a prefill pass: `source` is transformers' own cache of this model
        holding an unpadded batch. Each CSA layer's compressed entries (`[B, n, head_dim]` in
        the model's dtype, on the host or the device) are admitted, one request per batch
        row; every other state (windows, HCA entries, indexer keys, the compressors' buffers
        and overlap state) is taken over by reference, so `source` must not decode on. The
        next forward pass decodes every row's next token."""
        if self.ids is not None or any(layer.is_initialized for layer in self.layers):
            raise InvalidInputError("load_context: this cache holds a batch already; use a "
                                    "new HiSparseV4Cache per batch")
        self._admit(torch.stack(_source_entries(source, self)))
        for mine, theirs in zip(self.layers, source.layers, strict=True):
            state = _state_of(theirs)
            if isinstance(mine, _CSAEntries):  # the entries live in hisparse now
                held = state["compressed_kv"]["compressor"]
                state["compressed_kv"]["compressor"] = theirs.keys.new_zeros(()).expand(
                    held.shape)
            mine.__dict__.update(state)

    # --- what it holds ----------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Device bytes held: hisparse's tables and hot buffers, and every tensor of
        transformers' layers (windows, HCA entries, indexer keys, buffers)."""
        return device_bytes(self.engine) + framework_bytes(self)

    def close(self) -> None:
        """Remove the hooks, free the requests, the host pool and the device tables."""
        self._remove_hooks()
        self.engine.close()

    # --- the forward pass -------------------------------------------------------------------
    def _install_hooks(self, base: nn.Module) -> list[Any]:
        """Per CSA layer: one hook keeping its indexer's top-k and one replacing its
        compressor's output; one on the base model ending (or cancelling) the pass. They
        hold the cache weakly."""
        ref = weakref.ref(self)

        def keep_top_k(index: int) -> Any:
            def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
                cache = ref()
                if cache is not None:
                    cache._top_k[index] = output
            return hook

        def replace(index: int) -> Any:
            def hook(module: nn.Module, args: Any, output: Any) -> Any:
                cache = ref()
                if cache is None or cache._step is None:
                    return output  # a prefill attends over the pass's entries
                return cache._selected_entries(index)
            return hook

        hooks = []
        for index, layer in enumerate(self.csa_layers):
            compressor = base.layers[layer].self_attn.compressor
            hooks.append(compressor.indexer.register_forward_hook(keep_top_k(index)))
            hooks.append(compressor.register_forward_hook(replace(index)))
        hooks.append(self._hook_forward_end(base))
        return hooks

    def open_step(self, layer: _CSAEntries, new: torch.Tensor) -> None:
        """At the first CSA layer's compressor update of a decode pass: open the step, each
        request appending the entries its compressor emitted (all rows share the phase)."""
        if self._step is None:
            appends = [int(new.shape[1])] * new.shape[0]
            self._step = self.engine.begin_decode_step(self.ids, appends=appends)

    def _selected_entries(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressor's output for a decode query: the indexer's selected entries
        `[B, 1, K, D]` and their bias `[B, 1, 1, K]` (0, or -inf where none)."""
        layer = self.layers[self.csa_layers[index]]
        new = layer.newest
        batch, width = new.shape[0], self.engine.row_bytes
        newest = (new[:, 0].contiguous().view(torch.uint8) if new.shape[1] else
                  torch.zeros(batch, width, dtype=torch.uint8, device=new.device))
        top_k = pad_top_k(self._top_k.pop(index)[:, 0].to(torch.int32), self.engine.top_k)
        rows = self._step.swap_in(index, top_k, newest_kv=newest)
        values, valid = gather_rows(self.engine.device_kv(index).view(self.dtype), rows)
        bias = torch.zeros(valid.shape, dtype=values.dtype, device=values.device)
        bias = bias.masked_fill(~valid, float("-inf"))
        return values[:, None], bias[:, None, None, :]

    def _finish_forward(self, completed: bool) -> None:
        """After the base model's pass: admit a prefill's entries or end the decode step; a
        pass that raised changes nothing (its step cancelled, every layer's state put back)."""
        step, saved = self._step, self._saved
        self._step, self._saved, self._top_k = None, None, {}
        entries = [self.layers[layer] for layer in self.csa_layers]
        pending = [layer.pending for layer in entries]
        for layer in entries:
            layer.pending = layer.newest = None
        if not completed:
            if step is not None and step.is_open:
                step.cancel()
            if saved is not None:
                for layer, state in zip(self.layers, saved, strict=True):
                    layer.__dict__.update(state)
            return
        if step is not None:
            step.end()
        elif self.ids is None and pending and pending[0] is not None:
            self._admit(torch.stack(pending))

    def _admit(self, entries: torch.Tensor) -> None:
        """One request per batch row of `entries [L, B, n, D]`: the padded prompt's entries
        (the indexer's indices address them, padding windows included)."""
        if entries.shape[2] == 0:
            raise InvalidInputError(
                f"the prompt of {entries.shape[2]} entries made no compressed entry (shorter "
                "than one window of the CSA rate); pass a prompt of at least that many tokens")
        rows = entries.to(self.dtype).contiguous().view(torch.uint8)
        self.ids = admit_batch(self.engine, "v4", [rows[:, row] for row in range(rows.shape[1])])


def framework_bytes(cache: DynamicCache) -> int:
    """Device bytes of every tensor transformers' layers of `cache` hold (each storage once;
    a zero-stride placeholder counts its one element)."""
    seen: dict[int, int] = {}
    for layer in cache.layers:
        for value in vars(layer).values():
            tensors = value.values() if isinstance(value, dict) else (value,)
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_of(layer: Any) -> dict[str, Any]:
    """A layer's attributes, its dicts copied (transformers replaces tensors, never edits
    them in place, so references are a snapshot)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in vars(layer).items()}


def _source_entries(source: Any, cache: HiSparseV4Cache) -> list[torch.Tensor]:
    """The CSA entries `[B, n, head_dim]` of each CSA layer of `source`, checked: transformers'
    own V4 cache of the same layer layout, every layer filled, the entries of one shape in
    the model's dtype."""
    layers = getattr(source, "layers", None)
    kinds = [type(layer).__name__ for layer in layers or ()]
    want = [DeepseekV4CSACache.__name__ if isinstance(layer, _CSAEntries)
            else type(layer).__name__ for layer in cache.layers]
    if kinds != want:
        raise InvalidInputError(
            f"load_context: source must be transformers' own cache of this model (layers "
            f"{want}), got {type(source).__name__} with layers {kinds}")
    if not all(layer.is_initialized for layer in layers):
        raise InvalidInputError("load_context: source holds no context (a layer was never "
                                "filled); prefill it first")
    entries = [layers[layer].compressed_kv["compressor"] for layer in cache.csa_layers]
    if not all(isinstance(entry, torch.Tensor) for entry in entries):
        raise InvalidInputError("load_context: a CSA layer of source holds no compressed "
                                "entries; prefill it first")
    shapes = {tuple(entry.shape) for entry in entries}
    width = cache.engine.row_bytes // cache.dtype.itemsize
    if (len(shapes) != 1 or len(entries[0].shape) != 3 or entries[0].shape[2] != width
            or any(entry.dtype != cache.dtype for entry in entries)):
        raise InvalidInputError(
            f"load_context: every CSA layer's entries must be [B, n, {width}] {cache.dtype} "
            f"(one shape), got {[f'{tuple(e.shape)} {e.dtype}' for e in entries]}")
    return entries


def _model_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "deepseek_v4":
        raise InvalidInputError(
            f"HiSparseV4Cache supports DeepSeek-V4 models (model_type 'deepseek_v4'), got "
            f"model_type {getattr(config, 'model_type', None)!r}; use HiSparseDSACache "
            "(hisparse.integrations.transformers) for DeepSeek-V3.2 and GLM-5")
    return config


def _row_bytes(model: nn.Module) -> int:
    return int(_model_config(model).head_dim) * next(model.parameters()).dtype.itemsize


def _check_fits(config: HiSparseConfig, model: nn.Module) -> None:
    model_config, csa = _model_config(model), csa_layers(model)
    problems = []
    if config.managed_layers != tuple(csa):
        problems.append(f"managed_layers: got {config.managed_layers}, the model's CSA "
                        f"layers are {csa}")
    if config.row_bytes != _row_bytes(model):
        problems.append(f"row_bytes: got {config.row_bytes}, an entry is {_row_bytes(model)} "
                        "bytes (head_dim values of the model's dtype)")
    if config.top_k < model_config.index_topk:
        problems.append(f"top_k: got {config.top_k}, less than the indexer's index_topk "
                        f"({model_config.index_topk})")
    if problems:
        raise ConfigError([*problems, "build it with hisparse_v4_config_for(model, ...)"])
