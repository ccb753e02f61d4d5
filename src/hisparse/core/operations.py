"""The two wrappers of `HiSparseCache`'s calls: under the bookkeeping lock, and (most of those)
also one counted operation of a shared host pool (core/shared_pool.py).

A module of their own so that the cache's mixins (core/sharing.py) wrap their calls the same
way as the cache's own methods.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")
_C = TypeVar("_C")  # the cache (any object with `_lock` and `_shared`)


def bookkeeping(method: Callable[Concatenate[_C, _P], _R]) -> Callable[Concatenate[_C, _P], _R]:
    """Run a call under the cache's bookkeeping lock.

    A scheduler thread may admit, finish, preempt and read statistics while the model thread
    decodes (docs/reliability.md). Every call that reads or changes request records, the pool
    allocator or the step state takes the lock; the per-layer `write_newest` and `swap_in`
    do not: they touch only the open step's own slots and rows, which no locked call may
    change while the step is open.
    """

    @functools.wraps(method)
    def locked(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


def operation(method: Callable[Concatenate[_C, _P], _R]) -> Callable[Concatenate[_C, _P], _R]:
    """A `bookkeeping` call that is also one operation of a shared host pool: refused once
    the pool failed, and hashed with its arguments once it succeeds, so that the ranks can
    check that they made the same calls (a call that raises is no operation: it changed
    nothing, on every rank alike)."""
    name = method.__name__.lstrip("_")

    @functools.wraps(method)
    def counted(self: Any, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            shared = self._shared
            if shared is None:
                return method(self, *args, **kwargs)
            shared.begin_op()
            result = method(self, *args, **kwargs)
            shared.end_op(name, (*args, *kwargs.items()))
            return result

    return counted
