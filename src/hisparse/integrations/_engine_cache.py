"""What the transformers caches backed by one `HiSparseCache` (`self.engine`) share: the edits
beam search and cache cropping would make, refused; the hit rate; the context manager; the
hook that ends (or cancels) a step after each forward pass; and admitting a prefilled batch,
all of it or none."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from hisparse.errors import InvalidInputError

_SERIAL = itertools.count()  # request ids unique across the caches of one process


class EngineCache:
    """A mixin placed before transformers' `Cache` class in the bases of a hisparse cache."""

    engine: Any  # the cache's HiSparseCache
    close: Any  # each cache's own: removes its hooks, then closes the engine
    _hooks: list[Any]  # the handles of the hooks it installed
    _finish_forward: Any  # each cache's own: ends the pass's step, or cancels it

    def _hook_forward_end(self, base: torch.nn.Module) -> Any:
        """A hook on `base` (the model's forward) calling `_finish_forward` after every pass
        that used this cache, also one that raised (`completed=False`: cancel)."""
        ref = weakref.ref(self)

        def after_forward(module: torch.nn.Module, args: Any, kwargs: dict[str, Any],
                          output: Any) -> None:
            cache = ref()
            if cache is not None and kwargs.get("past_key_values") is cache:
                cache._finish_forward(completed=output is not None)

        return base.register_forward_hook(after_forward, with_kwargs=True, always_call=True)

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def crop(self, *args: Any, **kwargs: Any) -> None:
        raise self._unsupported("crop")

    def reorder_cache(self, *args: Any, **kwargs: Any) -> None:
        raise self._unsupported("reorder_cache (beam search)")

    def batch_repeat_interleave(self, *args: Any, **kwargs: Any) -> None:
        raise self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, *args: Any, **kwargs: Any) -> None:
        raise self._unsupported("batch_select_indices")

    def hit_rate(self) -> float:
        """Hits over lookups of every swap-in so far (followers count their anchor's)."""
        stats = self.engine.stats()
        looked_up = stats.hits + stats.misses
        return stats.hits / looked_up if looked_up else 0.0

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unsupported(self, action: str) -> InvalidInputError:
        return InvalidInputError(
            f"{type(self).__name__} does not support {action}; generate without beam search "
            "or cache editing, or use transformers' own cache")


def admit_batch(engine: Any, name: str, prompts: Sequence[torch.Tensor]) -> list[str]:
    """Admit, prefill and commit one request per prompt (`[L, T, W]` rows each) and return
    their ids (`hisparse-{name}-{serial}-{row}`); if any call fails, the requests admitted so
    far are aborted, so the engine is as it was."""
    serial = next(_SERIAL)
    ids = [f"hisparse-{name}-{serial}-{row}" for row in range(len(prompts))]
    admitted: list[str] = []
    try:
        for request, rows in zip(ids, prompts, strict=True):
            engine.admit(request, rows.shape[1])
            admitted.append(request)
            engine.write_prefill(request, rows)
            engine.commit_prefill(request)
    except BaseException:
        for request in admitted:
            engine.abort(request)
        raise
    return ids
