"""Every exception and warning hisparse raises, under one root.

Messages follow one shape: what was wrong, the value seen, what to do.
"""

from __future__ import annotations


class HisparseError(Exception):
    """Root of every error hisparse raises on purpose."""


class ConfigError(HisparseError, ValueError):
    """A configuration key or value is invalid; the message lists every problem found."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(
            "invalid hisparse config:\n  - " + "\n  - ".join(self.problems)
        )


class BackendUnavailableError(HisparseError, RuntimeError):
    """The requested backend is unknown or has no usable device here."""


class UnsupportedFeatureError(HisparseError, NotImplementedError):
    """A feature was called on a backend whose feature table says it cannot do it."""

    def __init__(self, feature: str, backend: str, why: str, instead: str) -> None:
        self.feature = feature
        self.backend = backend
        self.why = why
        self.instead = instead
        super().__init__(
            f"{feature} is not supported on the {backend} backend: {why}. Instead, {instead}."
        )


class FeatureDisabledWarning(UserWarning):
    """A config asked for a feature the backend disables or lacks; it was turned off at init."""


class HostAllocationError(HisparseError, MemoryError):
    """Host memory for the pool could not be allocated or registered."""


class InvalidInputError(HisparseError, ValueError):
    """A call received an argument it cannot use; nothing in the cache was changed."""


class UnknownRequestError(InvalidInputError, KeyError):
    """A request id is not known to the cache (never admitted, or already freed)."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class RequestStateError(InvalidInputError):
    """The request is in a state that does not allow this call (e.g. decode after finish)."""


class PoolExhaustedError(HisparseError, MemoryError):
    """Not enough free host rows, device request slots or (shared prefixes under
    `residency_map: host_row`) alias key extents; nothing was allocated."""


class MissingDependencyError(HisparseError, ImportError):
    """An optional dependency a feature needs is not installed; the message names the extra."""


class TransferError(HisparseError, RuntimeError):
    """A KV transfer into reserved host rows failed or timed out; the rows were released."""


class SharedPoolError(HisparseError, RuntimeError):
    """A host pool shared by tensor-parallel ranks cannot be used: the name is taken or
    unknown, its layout differs from this cache's, a rank died, or the ranks' allocation
    decisions diverged. A pool that failed stays failed: every rank gets this error."""
