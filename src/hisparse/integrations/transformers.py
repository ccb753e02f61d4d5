"""hisparse under transformers' sparse-attention models: DeepSeek-V3.2 and the GLM-5 family.

`HiSparseDSACache(model, ...)` is a transformers `Cache` that keeps the main attention's KV
in a `HiSparseCache` (host pool plus a hot buffer per request) and the indexer's keys
densely, as transformers does. Pass it to `model.generate(..., past_key_values=cache)`:

- MLA's cached row is the compressed latent (`kv_a_layernorm`'s output, `kv_lora_rank`
  values) and the rotated rope key (`qk_rope_head_dim`), in the model's dtype; a forward
  hook on each `kv_a_layernorm` hands the latent to the cache's `update`.
- The model's attention is set to `"hisparse"` (an `AttentionInterface` function with the
  eager mask), which receives the indexer's top-k: a prefill attends densely over the
  prompt, as eager attention does, and its rows are written to the host pool once the
  forward pass completes; a decode step hands the top-k (indices into the left-padded key
  axis, made positions, padded with -1 to the cache's `top_k`) to `swap_in` and attends
  over the returned rows, expanded through `kv_b_proj`.
- A decode step opens at the first layer's cache update and ends after the model's forward
  pass (a forward hook called even when the pass raises, which cancels the step instead).
- Layers that reuse an earlier layer's top-k ("shared" in GLM's `indexer_types`) are the
  followers of the cache's index schedule (`hisparse_config_for`).

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
    from transformers import AttentionInterface
    from transformers.cache_utils import Cache, DynamicIndexedLayer
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
except ImportError as exc:
    raise MissingDependencyError(
        f"hisparse.integrations.transformers needs transformers 5.17 ({exc}); install it with "
        "pip install 'hisparse[transformers]'") from exc

from hisparse.attention import gather_rows, pad_top_k
from hisparse.config import HiSparseConfig
from hisparse.core.engine import HiSparseCache
from hisparse.footprint import device_bytes
from hisparse.integrations._engine_cache import EngineCache, admit_batch
from hisparse.layout.index_schedule import IndexSchedule

ATTENTION = "hisparse"  # the name the attention and its mask are registered under
SUPPORTED_MODELS = ("deepseek_v32", "glm_moe_dsa")
# The attention module of a layer whose cache update ran and whose attention has not yet.
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, HiSparseDSACache] = weakref.WeakKeyDictionary()


def register() -> None:
    """Register the `"hisparse"` attention and mask with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION, hisparse_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)


def hisparse_config_for(model: nn.Module, **overrides: Any) -> HiSparseConfig:
    """A `HiSparseConfig` with the model's shape: its layers, its latent row (kv_lora_rank +
    qk_rope_head_dim values of its dtype), its indexer's top-k and index schedule (GLM's
    `indexer_types`; every layer runs an indexer in DeepSeek-V3.2); `overrides` set the rest
    (hot_slots, max_requests, max_seq_len, host_pool_tokens, ...)."""
    config = _model_config(model)
    schedule = IndexSchedule.from_indexer_types(
        getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers)
    values: dict[str, Any] = {
        "model": config.model_type, "num_layers": config.num_hidden_layers,
        "kv_dtype": "bf16", "row_bytes": _row_values(config) * _dtype(model).itemsize,
        "row_bytes_by_dtype": None, "top_k": config.index_topk,
        "index_anchors": list(schedule.anchors)}
    if "index_group_size" in overrides:  # a uniform schedule replaces the model's
        values.pop("index_anchors")
    values.update(overrides)
    return HiSparseConfig.from_dict(values)


class _IndexedLayer(DynamicIndexedLayer):
    """One layer's transformers-side cache: the indexer's keys (dense, `update_indexer`) and
    the key count the masks are sized by; the main KV lives in the `HiSparseCache`."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.length += key_states.shape[-2]
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.length

    def indexer_length(self) -> int:
        return 0 if self.indexer_keys is None else int(self.indexer_keys.shape[1])

    def roll_back(self, length: int, indexer_length: int) -> None:
        self.length = length
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, :indexer_length]


class HiSparseDSACache(EngineCache, Cache):
    """A transformers `Cache` whose main attention KV lives in hisparse (module docstring).

    Args:
        model: a `DeepseekV32ForCausalLM` or `GlmMoeDsaForCausalLM` (or their base models);
            its attention is set to `"hisparse"` until `close()`.
        config: a `HiSparseConfig` of the model's shape; None: `hisparse_config_for(model,
            **overrides)`.
        device: where the hot buffers live (None: the model's device).

    One cache serves one batch: its prefill admits one request per batch row.
    """

    def __init__(self, model: nn.Module, config: HiSparseConfig | None = None,
                 device: str | torch.device | None = None, **overrides: Any) -> None:
        model_config = _model_config(model)
        if config is None:
            config = hisparse_config_for(model, **overrides)
        elif overrides:
            raise ConfigError("pass either a config or overrides of the model's, not both")
        _check_fits(config, model, model_config)
        layers = getattr(model, "model", model).layers
        super().__init__(layers=[_IndexedLayer() for _ in range(len(layers))])
        self.model_config = model_config
        self.dtype = _dtype(model)
        self.engine = HiSparseCache(config, device=device or _device(model))
        self._attention = [layer.self_attn for layer in layers]
        self._latent: dict[int, torch.Tensor] = {}  # per layer: this pass's latent rows
        self._prefill: dict[int, torch.Tensor] = {}  # per layer: the prompt's rows [B, S, V]
        self._newest: dict[int, torch.Tensor] = {}  # per layer: the new token's rows [B, V]
        self._ids: list[str] | None = None  # one request per batch row, after the prefill
        self._pads: torch.Tensor | None = None  # [B] left-padding tokens per row
        self._step: Any = None
        self._top_k: tuple[torch.Tensor, torch.Tensor] | None = None  # (model's, converted)
        self._start: list[tuple[int, int]] | None = None  # lengths before this forward pass
        register()
        self._model = model
        self._previous_attention = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION)
        self._hooks = self._install_hooks(model, layers)

    # --- transformers' Cache ----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            self._start = [(layer.length, layer.indexer_length()) for layer in self.layers]
        keys, values = self.layers[layer_idx].update(key_states, value_states)
        rows = self._rows(layer_idx, key_states)
        _ACTIVE[self._attention[layer_idx]] = self
        if self._ids is None:  # a prefill: written once the forward pass completes
            self._prefill[layer_idx] = rows
            return keys, values
        if rows.shape[1] != 1:
            raise InvalidInputError(
                f"a forward pass of {rows.shape[1]} tokens after the prefill: HiSparseDSACache "
                "decodes one token per forward pass (no chunked prefill or speculative steps)")
        if layer_idx == 0:
            self._step = self.engine.begin_decode_step(self._ids)
        self._newest[layer_idx] = rows[:, 0]
        return keys, values

    def load_context(self, rows: torch.Tensor, indexer_keys: torch.Tensor) -> None:
        """Start from a context computed elsewhere (a prefill node, a benchmark's synthetic
        one) instead of a prefill pass: `rows [L, B, T, V]` latent rows in the model's dtype
        and `indexer_keys [L, B, T, index_head_dim]`, without padding. The next forward pass
        decodes token T of every row."""
        width = _row_values(self.model_config)
        if self._ids is not None or self._prefill:
            raise InvalidInputError("load_context: this cache holds a batch already; use a "
                                    "new HiSparseDSACache per batch")
        if (rows.ndim != 4 or rows.shape[0] != len(self.layers) or rows.shape[3] != width
                or rows.dtype != self.dtype or indexer_keys.shape[:3] != rows.shape[:3]):
            raise InvalidInputError(
                f"load_context: rows must be [{len(self.layers)}, B, T, {width}] {self.dtype} "
                f"and indexer_keys [{len(self.layers)}, B, T, D], got "
                f"{tuple(rows.shape)} {rows.dtype} and {tuple(indexer_keys.shape)}")
        for layer, keys in zip(self.layers, indexer_keys, strict=True):
            layer.dtype, layer.device, layer.is_initialized = rows.dtype, rows.device, True
            layer.update_indexer(keys)
            layer.length = rows.shape[2]
        self._pads = torch.zeros(rows.shape[1], dtype=torch.int32, device=rows.device)
        self._admit(rows)

    # --- what it holds ----------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Device bytes held: the hisparse tables and hot buffers, and the indexer's keys."""
        keys = sum(layer.indexer_keys.nbytes for layer in self.layers
                   if layer.indexer_keys is not None)
        return device_bytes(self.engine) + keys

    def close(self) -> None:
        """Free the requests, the host pool and the device tables; give the model its own
        attention back. Idempotent."""
        self._remove_hooks()
        if self._model is not None:
            self._model.set_attn_implementation(self._previous_attention)
            self._model = None
        self.engine.close()

    # --- the forward pass -------------------------------------------------------------------
    def _install_hooks(self, model: nn.Module, layers: nn.ModuleList) -> list[Any]:
        """A hook per `kv_a_layernorm` that keeps its latent for `update`, and one on the base
        model that finishes (or cancels) the forward pass. They hold the cache weakly."""
        ref = weakref.ref(self)

        def latent_hook(layer: int) -> Any:
            def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
                cache = ref()
                if cache is not None:
                    cache._latent[layer] = output
            return hook

        hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(latent_hook(index))
                 for index, layer in enumerate(layers)]
        hooks.append(self._hook_forward_end(getattr(model, "model", model)))
        return hooks

    def _rows(self, layer: int, key_states: torch.Tensor) -> torch.Tensor:
        """`[B, S, kv_lora_rank + rope]` rows of this pass's tokens: the latent and the rotated
        rope key (every head of `key_states` holds the same one)."""
        latent = self._latent.pop(layer, None)
        if latent is None:
            raise InvalidInputError(
                f"layer {layer} updated the cache without running its kv_a_layernorm: "
                "HiSparseDSACache caches MLA latents and needs the model's own attention")
        rope = key_states[:, 0, :, self.model_config.qk_nope_head_dim:]
        return torch.cat([latent.to(self.dtype), rope.to(self.dtype)], dim=-1)

    def _finish_forward(self, completed: bool) -> None:
        """After the base model's forward pass: write a prefill's rows or end the decode step;
        a pass that raised changes nothing (its step cancelled, the lengths rolled back)."""
        prefill, step, start = self._prefill, self._step, self._start
        self._prefill, self._newest, self._latent = {}, {}, {}
        self._step, self._top_k, self._start = None, None, None
        for module in self._attention:
            _ACTIVE.pop(module, None)
        if not completed:
            if step is not None and step.is_open:
                step.cancel()
            if start is not None:
                for layer, (length, indexer) in zip(self.layers, start, strict=True):
                    layer.roll_back(length, indexer)
            if self._ids is None:
                self._pads = None
            return
        if step is not None:
            step.end()
        elif prefill:
            self._admit(torch.stack([prefill[layer] for layer in range(len(self.layers))]))

    def _admit(self, rows: torch.Tensor) -> None:
        """Admit one request per batch row of `rows [L, B, S, V]` with its prompt (past its
        left padding)."""
        if self._pads is None:
            self._pads = torch.zeros(rows.shape[1], dtype=torch.int32, device=rows.device)
        pads = self._pads.tolist()
        self._ids = admit_batch(self.engine, "dsa", [rows[:, row, pad:]
                                                     for row, pad in enumerate(pads)])

    def note_prefill_mask(self, attention_mask: torch.Tensor | None, batch: int,
                          device: torch.device) -> None:
        """The left padding of each row, from the prefill's mask (its last query's keys)."""
        if self._pads is not None or self._ids is not None:
            return
        if attention_mask is None:
            self._pads = torch.zeros(batch, dtype=torch.int32, device=device)
            return
        keys = attention_mask[:, 0, -1, :]
        valid = keys if keys.dtype == torch.bool else keys == 0
        pads = valid.shape[1] - valid.sum(dim=1)
        suffix = torch.arange(valid.shape[1], device=valid.device)[None, :] >= pads[:, None]
        if not torch.equal(valid, suffix):
            raise InvalidInputError(
                "the prompt batch is not left-padded (a row's tokens are not its last ones); "
                "HiSparseDSACache needs left padding (tokenizer padding_side='left')")
        self._pads = pads.to(torch.int32)

    def decode_attention(self, module: nn.Module, query: torch.Tensor, indices: torch.Tensor,
                         scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode token per row: attention over the rows `swap_in` returned for the
        indexer's top-k, each latent expanded through the layer's `kv_b_proj`."""
        layer = module.layer_idx
        rows = self._swap_in(layer, indices)
        values, valid = self.read_rows(layer, rows)
        c = self.model_config
        latent, rope = values.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        batch, width = latent.shape[:2]
        heads = query.shape[1]
        expanded = module.kv_b_proj(latent).view(batch, width, heads, -1)
        k_nope, value = expanded.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, rope[:, :, None, :].expand(-1, -1, heads, -1)], dim=-1)
        weights = torch.matmul(query, keys.permute(0, 2, 3, 1)) * scaling  # [B, H, 1, K]
        weights = weights.masked_fill(~valid[:, None, None, :], torch.finfo(query.dtype).min)
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        output = torch.matmul(weights, value.transpose(1, 2))  # [B, H, 1, v_head_dim]
        return output.transpose(1, 2).contiguous(), weights

    def read_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV rows of `layer` at the rows `swap_in` returned, in the model's dtype."""
        return gather_rows(self.engine.device_kv(layer).view(self.dtype), rows)

    def _swap_in(self, layer: int, indices: torch.Tensor) -> torch.Tensor:
        """`swap_in` of the indexer's top-k `[B, 1, K']` (indices into the left-padded key
        axis) as positions; a layer handed its predecessor's very top-k (a "shared" layer)
        passes the same converted tensor."""
        if self._top_k is None or self._top_k[0] is not indices:
            assert self._pads is not None
            pads = self._pads[:, None]
            top_k = indices[:, 0, :]
            positions = torch.where(top_k >= pads, top_k - pads, -1)
            self._top_k = (indices, pad_top_k(positions, self.engine.top_k))
        return self._step.swap_in(layer, self._top_k[1], newest_kv=self._newest.pop(layer))


def hisparse_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: torch.Tensor | None,
                       scaling: float, dropout: float = 0.0, indices: torch.Tensor | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The `"hisparse"` attention: a decode step under a `HiSparseDSACache` attends over the
    rows its swap-in returned; anything else (a prefill, another cache) attends densely over
    `key`/`value` with the indexer's top-k as a mask, as transformers' eager attention does."""
    if indices is None:
        raise InvalidInputError(
            "the hisparse attention needs the indexer's top-k (`indices`): use it with a "
            "DeepSeek-V3.2 or GLM-5 (DSA) model")
    cache = _ACTIVE.pop(module, None)
    if cache is not None and query.shape[2] == 1 and cache._ids is not None:
        return cache.decode_attention(module, query, indices, scaling)
    if cache is not None:
        cache.note_prefill_mask(attention_mask, query.shape[0], query.device)
    return masked_attention(module, query, key, value, attention_mask, indices, scaling)


def masked_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     indices: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention restricted to the top-k keys, as the models' eager path computes it."""
    batch, _, length, _ = query.shape
    index_mask = torch.ones((batch, length, key.shape[2]), dtype=torch.bool,
                            device=query.device).scatter(-1, indices.long(), False).unsqueeze(1)
    low = torch.finfo(query.dtype).min
    if attention_mask is None:
        mask = torch.zeros_like(index_mask, dtype=query.dtype).masked_fill(index_mask, low)
    elif attention_mask.dtype == torch.bool:
        mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
            ~(attention_mask & ~index_mask), low)
    else:
        mask = attention_mask.masked_fill(index_mask, low)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling + mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def dense_cache_bytes(cache: Cache) -> int:
    """Device bytes a transformers cache holds in key, value and indexer-key tensors."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "indexer_keys"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.nbytes
    return total


# --- the model's shape ------------------------------------------------------------------------
def _model_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODELS:
        raise InvalidInputError(
            f"HiSparseDSACache supports {', '.join(SUPPORTED_MODELS)} models (MLA with a DSA "
            f"indexer), got model_type {model_type!r}")
    return config


def _row_values(config: Any) -> int:
    return int(config.kv_lora_rank + config.qk_rope_head_dim)


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _check_fits(config: HiSparseConfig, model: nn.Module, model_config: Any) -> None:
    row = _row_values(model_config) * _dtype(model).itemsize
    problems = []
    if config.num_layers != model_config.num_hidden_layers:
        problems.append(f"num_layers: got {config.num_layers}, the model has "
                        f"{model_config.num_hidden_layers}")
    if config.row_bytes != row:
        problems.append(f"row_bytes: got {config.row_bytes}, the model's latent row is {row} "
                        f"(kv_lora_rank + qk_rope_head_dim values of {_dtype(model)})")
    if config.top_k < model_config.index_topk:
        problems.append(f"top_k: got {config.top_k}, less than the indexer's index_topk "
                        f"({model_config.index_topk})")
    if problems:
        raise ConfigError([*problems, "build it with hisparse_config_for(model, ...)"])
