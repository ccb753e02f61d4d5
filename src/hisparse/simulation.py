"""Decode simulation behind `hisparse simulate`: a top-k trace model and the loop that drives
the real engine with it.

The trace model stands in for a DSA indexer. Each step's top-k is built from four parts:
  * the newest token (the indexer always sees it; the engine keeps it in its own slot);
  * persistent heavy hitters: a fixed set of positions chosen in every step (attention sinks,
    key tokens), each replaced by a fresh position with probability `heavy_churn` per step;
  * carry-over: positions kept from the previous step's top-k, so that exactly
    `round(carryover * k)` of the step's `k` entries were also in the previous step's (at most
    k-1: the newest token is always new; heavy hitters drawn anew this step come first);
  * fresh picks for the rest, never from the previous step's top-k: with probability
    `recency_bias` from the newest `recent_window` tokens, else uniform over the context.
The default carry-over of 0.6 follows the published evidence that about 60% of a step's
top-k is kept from the previous step (GVR, arXiv 2604.22312, for DeepSeek-V3.2's indexer;
ShadowKV reports about 60% too); use 0.95 for the upper figure some IndexCache work claims.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from hisparse.errors import InvalidInputError

# Fresh picks are drawn by rejection: oversampling by this factor makes one round the common case.
_OVERSAMPLE = 2


@dataclass(frozen=True)
class TraceModel:
    """Knobs of the top-k trace; see the module docstring for what each one does."""

    top_k: int = 2048
    carryover: float = 0.6
    heavy_hitters: int = 64
    heavy_churn: float = 0.0
    recency_bias: float = 0.3
    recent_window: int = 4096

    def __post_init__(self) -> None:
        problems = []
        if self.top_k < 1:
            problems.append(f"top_k must be >= 1, got {self.top_k}")
        for name in ("carryover", "heavy_churn", "recency_bias"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                problems.append(f"{name} must be a fraction in [0, 1], got {value}")
        if not 0 <= self.heavy_hitters <= self.top_k:
            problems.append(
                f"heavy_hitters must be in [0, top_k={self.top_k}], got {self.heavy_hitters}"
            )
        if self.recent_window < 1:
            problems.append(f"recent_window must be >= 1, got {self.recent_window}")
        if problems:
            raise InvalidInputError("invalid trace model: " + "; ".join(problems))

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


class TopKTrace:
    """The top-k positions of one (request, index group) over successive decode steps."""

    def __init__(self, model: TraceModel, rng: np.random.Generator) -> None:
        self.model = model
        self.rng = rng
        self.previous = np.empty(0, dtype=np.int64)
        self.heavy = np.empty(0, dtype=np.int64)

    def step(self, seq_len: int) -> np.ndarray:
        """Distinct positions in [0, seq_len) for a request of `seq_len` tokens, in top-k order.

        Returns min(top_k, seq_len) int64 positions, the newest (seq_len - 1) among them.
        """
        if seq_len < 1:
            raise InvalidInputError(f"seq_len must be >= 1 to draw a top-k, got {seq_len}")
        model, rng, n = self.model, self.rng, seq_len
        k = min(model.top_k, n)
        previous = self.previous[self.previous < n]
        taken = np.zeros(n, dtype=bool)
        in_previous = np.zeros(n, dtype=bool)
        in_previous[previous] = True

        taken[n - 1] = True
        self._refresh_heavy_hitters(n)
        heavy = self.heavy[: max(k - 1, 0)]
        taken[heavy] = True

        carried_target = round(model.carryover * k)
        carried_already = int(np.count_nonzero(taken & in_previous))
        carry_pool = previous[~taken[previous]]
        carry_count = min(max(carried_target - carried_already, 0), carry_pool.size,
                          k - int(taken.sum()))
        taken[rng.choice(carry_pool, size=carry_count, replace=False)] = True

        need = k - int(taken.sum())
        fresh = self._draw_fresh(n, need, excluded=taken | in_previous)
        taken[fresh] = True
        # Too few positions outside the previous top-k: top up from it (short contexts only).
        need = k - int(taken.sum())
        if need > 0:
            leftover = np.flatnonzero(~taken)
            taken[rng.choice(leftover, size=need, replace=False)] = True

        selected = np.flatnonzero(taken)
        rng.shuffle(selected)  # an indexer's top-k comes in score order, not position order
        self.previous = selected
        return selected

    def _refresh_heavy_hitters(self, n: int) -> None:
        model, rng = self.model, self.rng
        wanted = min(model.heavy_hitters, max(n - 1, 0))
        if self.heavy.size < wanted:
            # First step, or a context that was too short for all of them so far.
            existing = np.zeros(n - 1, dtype=bool)
            existing[self.heavy] = True
            added = self._draw_uniform_excluding(wanted - self.heavy.size, existing)
            self.heavy = np.concatenate([self.heavy, added])
            return
        if model.heavy_churn == 0 or self.heavy.size == 0:
            return
        replace = rng.random(self.heavy.size) < model.heavy_churn
        if replace.any():
            keep = np.zeros(n, dtype=bool)
            keep[self.heavy[~replace]] = True
            replacements = self._draw_uniform_excluding(int(replace.sum()), keep[: n - 1])
            self.heavy = np.concatenate([self.heavy[~replace], replacements])

    def _draw_uniform_excluding(self, count: int, excluded: np.ndarray) -> np.ndarray:
        free = np.flatnonzero(~excluded)
        return self.rng.choice(free, size=min(count, free.size), replace=False)

    def _draw_fresh(self, n: int, need: int, excluded: np.ndarray) -> np.ndarray:
        model, rng = self.model, self.rng
        excluded = excluded.copy()
        need = min(need, n - int(excluded.sum()))
        # Decide each pick's source first, so the window gets `recency_bias` of the picks even
        # when the previous top-k already covers much of it.
        window_start = max(0, n - model.recent_window)
        window_free = window_start + np.flatnonzero(~excluded[window_start:])
        recent_count = min(int(rng.binomial(need, model.recency_bias)), window_free.size)
        recent = rng.choice(window_free, size=recent_count, replace=False)
        excluded[recent] = True
        picks = [recent]
        need -= recent_count
        for _ in range(4):  # rejection rounds: a uniform draw over a long context rarely repeats
            if need == 0:
                break
            candidates = rng.integers(0, n, _OVERSAMPLE * need + 16)
            candidates = candidates[~excluded[candidates]]
            _, first = np.unique(candidates, return_index=True)
            candidates = candidates[np.sort(first)][:need]
            excluded[candidates] = True
            picks.append(candidates)
            need -= candidates.size
        if need > 0:  # a short or crowded context: draw the rest exactly
            picks.append(self._draw_uniform_excluding(need, excluded))
        return np.concatenate(picks)


def make_traces(
    model: TraceModel, num_requests: int, num_groups: int, seed: int
) -> list[list[TopKTrace]]:
    """traces[request][group], each with its own generator derived from `seed`."""
    return [
        [TopKTrace(model, np.random.default_rng([seed, request, group]))
         for group in range(num_groups)]
        for request in range(num_requests)
    ]
