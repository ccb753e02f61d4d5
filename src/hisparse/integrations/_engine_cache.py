"""What the transformers caches backed by one `HiSparseCache` (`self.engine`) share: the edits
beam search and cache cropping would make, refused; the hit rate; the context manager."""

from __future__ import annotations

from typing import Any

from hisparse.errors import InvalidInputError


class EngineCache:
    """A mixin placed before transformers' `Cache` class in the bases of a hisparse cache."""

    engine: Any  # the cache's HiSparseCache
    close: Any  # each cache's own: removes its hooks, then closes the engine

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
