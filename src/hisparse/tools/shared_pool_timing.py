"""Per-step timing of a shared host pool's ranks (issue 23), driven by
benchmarks/shared_pool.py through `hisparse.tools.shared_pool_run.run_group`.

* `timing_rank`: one rank of a group (shared or private pools) decoding long requests, the
  ranks in lockstep or, with `turn`/`turns`, the processes of several groups taking turns.
* `paired_rank`: one rank of a shared group that also holds a private cache of the same
  config and times one step on each within each of its turns, adjacent in time. Processes
  differ (their core, their Python heap) by more than a non-writer's code path differs from
  a private rank's, so only a ratio taken inside one process compares the code paths.
  `paired_summary` turns the ranks' results into per-step ratios.
* `one_process_ranks`: the same pairs with every rank's caches in one process, taking no
  turns: the code paths compared on one core.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from hisparse.core.host_pool import token_rows
from hisparse.tools.shared_pool_run import _cache, prompt_rows

TOP_K_SEED = 7  # the same top-k on every rank and on both caches of a paired rank


def _timing_config(batch: int, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The timed cache: `batch` requests of up to 4096 tokens, a pool that holds them all."""
    return {"num_layers": 8, "max_requests": batch, "max_seq_len": 4096,
            "host_pool_tokens": batch * 4096, **(overrides or {})}


def _prefill(cache: Any, batch: int, blank: bool = False) -> int:
    """Admit and prefill `batch` long requests; their prompt length. `blank`: zero rows, for
    a reader whose pool writes nothing, so that what its pool holds can only be the writer's."""
    prompt = 2 * cache.hot_slots + 64  # long: most of the top-k is swapped in
    for request in range(batch):
        cache.admit(request, prompt)
        rows = prompt_rows(request, 0, prompt, cache.num_layers, cache.row_bytes)
        if blank:
            rows = torch.zeros_like(rows)
        cache.write_prefill(request, rows.to(cache.device))
        cache.commit_prefill(request)
    return prompt


def _top_k(generator: torch.Generator, cache: Any, batch: int, length: int,
           miss_free: bool = False) -> torch.Tensor:
    """A random top-k over the whole prompt (most of it swapped in from host rows every
    step), or (`miss_free`) the first K positions every step: hits once resident, so a step
    reads no host row."""
    if miss_free:
        return torch.arange(cache.top_k, dtype=torch.int32).repeat(batch, 1).to(cache.device)
    return torch.randint(0, length, (batch, cache.top_k), generator=generator,
                         dtype=torch.int32).to(cache.device)


def _timed_step(cache: Any, batch: int, kv: torch.Tensor, top_k: torch.Tensor
                ) -> tuple[float, float, float | None, tuple[float, float, float]]:
    """One decode step (begin, every layer's write_newest and swap_in, end): its host
    seconds, the host seconds of it spent waiting for other ranks, on a GPU its device
    milliseconds (events around the step, on the compute stream), and the host seconds of
    its three phases (begin, the layers, end)."""
    shared = cache._shared
    waited = shared.waited_s if shared is not None else 0.0
    cuda = cache.device.type == "cuda"
    if cuda:
        start_event, end_event = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start_event.record()
    started = time.perf_counter()
    step = cache.begin_decode_step(list(range(batch)))
    begun = time.perf_counter()
    for layer in range(cache.num_layers):
        step.write_newest(layer, kv)
        step.swap_in(layer, top_k)
    layers_done = time.perf_counter()
    step.end()
    ended = time.perf_counter()
    elapsed = ended - started
    phases = (begun - started, layers_done - begun, ended - layers_done)
    device_ms = None
    if cuda:
        end_event.record()
        end_event.synchronize()
        device_ms = start_event.elapsed_time(end_event)
    waited = (shared.waited_s if shared is not None else 0.0) - waited
    return elapsed, waited, device_ms, phases


PHASES = ("begin_us", "layers_us", "end_us")


def _new_samples() -> dict[str, list[float]]:
    return {"host_us": [], "busy_us": [], "device_ms": [], **{p: [] for p in PHASES}}


def _add_sample(samples: dict[str, list[float]],
                timed: tuple[float, float, float | None, tuple[float, float, float]]) -> None:
    """One `_timed_step` result into `samples`: host and busy microseconds, device ms, and
    the host microseconds of each phase."""
    elapsed, waited, step_ms, phases = timed
    for phase, seconds in zip(PHASES, phases, strict=True):
        samples[phase].append(seconds * 1e6)
    samples["host_us"].append(elapsed * 1e6)
    samples["busy_us"].append((elapsed - waited) * 1e6)
    if step_ms is not None:
        samples["device_ms"].append(step_ms)


class _Turns:
    """The processes of one barrier taking turns within each step, in an order that moves on
    by one each step (no process always follows the same one, the writer say), each waiting
    for the one before to finish its device work (its backup too): a process's time then
    holds no contention from the others, which share this machine's one GPU here but would
    have their own in a deployment. `turn` None: no turns, the processes run at once."""

    def __init__(self, barrier: Any, turn: int | None, turns: int) -> None:
        self.barrier, self.turn, self.turns = barrier, turn, turns
        self.place: int | None = None

    def start(self, step_index: int) -> None:
        self.barrier.wait()  # lockstep, untimed
        self.place = None if self.turn is None else (self.turn + step_index) % self.turns
        for _ in range(self.place or 0):
            self.barrier.wait()  # the earlier turns

    def finish(self, cache: Any) -> None:
        if self.place is None:
            return
        # The turn passes once all of this step's device work is done, the backup on its
        # side stream included: the next process's step must not share the GPU with it.
        cache.backend.synchronize(cache.device)
        for _ in range(self.turns - 1 - self.place):
            self.barrier.wait()  # the later turns


def timing_rank(barrier: Any, name: str | None, rank: int, ranks: int, steps: int,
                batch: int, device: str = "cpu", overrides: dict[str, Any] | None = None,
                warmup: int = 20, turn: int | None = None, turns: int = 1) -> dict[str, Any]:
    """Per-step host time (begin, every layer's write_newest and swap_in, end) and, on a GPU,
    device time (events around the step) of one rank decoding `batch` long requests. The
    ranks start each step together, as a TP group's collectives keep them (the barrier is
    not timed); `busy_us` leaves out the time a rank waited for another inside the step.
    `turn` of `turns`: the processes of the barrier (several groups at once) take turns
    within each step (`_Turns`), so that every group sees the machine at the same moments
    (its speed drifts over seconds)."""
    cache = _cache(name, rank, ranks, device, _timing_config(batch, overrides))
    prompt = _prefill(cache, batch)
    generator = torch.Generator().manual_seed(TOP_K_SEED)
    kv = torch.zeros(batch, cache.row_bytes, dtype=torch.uint8, device=cache.device)
    samples = _new_samples()
    order = _Turns(barrier, turn, turns)
    barrier.wait()
    for step_index in range(warmup + steps):
        order.start(step_index)
        top_k = _top_k(generator, cache, batch, prompt + step_index)
        timed = _timed_step(cache, batch, kv, top_k)
        if step_index >= warmup:
            _add_sample(samples, timed)
        order.finish(cache)
    barrier.wait()
    cache.close()
    return {"rank": rank, **samples}


def paired_rank(barrier: Any, name: str, rank: int, ranks: int, steps: int, batch: int,
                device: str = "cpu", overrides: dict[str, Any] | None = None,
                warmup: int = 20, miss_free: bool = False) -> dict[str, Any]:
    """One rank of a shared group (`name`, the writer rank 0) that also holds a private
    cache of the same config, and in each of its turns (`_Turns`, the group's processes in
    rotation) times one step on each with the same top-k, each first in half of the steps
    at every place in the rotation (`_shared_first`), so that neither always runs on a host
    warmed by the other. Between the two, the first one's device work (its backup too) is waited
    for, untimed, so that they do not overlap on the GPU. Reported: each cache's per-step
    `host_us`, `busy_us` (without waits for other ranks) and `device_ms` (on a GPU), in
    step order, and whether the shared cache is attached to the shared pool and holds the
    writer's prompt rows."""
    config = _timing_config(batch, overrides)
    shared = _cache(name, rank, ranks, device, config)
    private = _cache(None, rank, ranks, device, config)
    prompt = _prefill(shared, batch, blank=rank != 0)
    _prefill(private, batch)
    generator = torch.Generator().manual_seed(TOP_K_SEED)
    kv = torch.zeros(batch, shared.row_bytes, dtype=torch.uint8, device=shared.device)
    times = {which: _new_samples() for which in ("shared", "private")}
    order = _Turns(barrier, rank, ranks)
    barrier.wait()
    for step_index in range(warmup + steps):
        order.start(step_index)
        top_k = _top_k(generator, shared, batch, prompt + step_index, miss_free)
        pair = [("shared", shared), ("private", private)]
        first = pair if _shared_first(step_index, ranks) else pair[::-1]
        for position, (which, cache) in enumerate(first):
            if position:  # untimed: the first step's device work (its backup too) must
                cache.backend.synchronize(cache.device)  # not overlap the second's
            timed = _timed_step(cache, batch, kv, top_k)
            if step_index >= warmup:
                _add_sample(times[which], timed)
        order.finish(shared)
    pools = {"shared_pool_attached": shared._shared is not None
             and shared._pool.segment is not None,
             "private_pool_shared": private._pool.segment is not None,
             "prompt_rows_from_writer": _holds_prompts(shared, batch, prompt)}
    barrier.wait()  # no rank closes while another may still read its rows
    shared.close()
    private.close()
    return {"rank": rank, "writer": rank == 0, **times, **pools}


def _shared_first(step_index: int, turns: int) -> bool:
    """Whether a paired rank times its shared cache first at `step_index`. The first step of
    a turn runs on a host the previous process's turn left cold, the more so for a process
    late in the rotation; a process's place moves on by one a step, so alternating the order
    every step would tie each order to the same places (with 2 ranks, the reader's shared
    step would always be the cold one). The order flips once per full rotation instead."""
    return (step_index // turns) % 2 == 0


def one_process_ranks(name: str, ranks: int, steps: int, batch: int, device: str = "cpu",
                      overrides: dict[str, Any] | None = None, warmup: int = 20,
                      miss_free: bool = False) -> list[dict[str, Any]]:
    """A shared group's `ranks` caches (the writer rank 0 first) and a private cache per rank,
    all in this one process, on one core: per step each rank times one step on its shared
    cache and one on its private cache, the order alternating, every other cache's device
    work waited for before (untimed). The same results as `paired_rank`'s, for
    `paired_summary`, without a difference between processes or a turn handed over."""
    config = _timing_config(batch, overrides)
    shared = [_cache(name, rank, ranks, device, config) for rank in range(ranks)]
    private = [_cache(None, rank, ranks, device, config) for rank in range(ranks)]
    prompts = [_prefill(c, batch, blank=rank != 0) for rank, c in enumerate(shared)]
    for cache in private:
        _prefill(cache, batch)
    generator = torch.Generator().manual_seed(TOP_K_SEED)
    kv = torch.zeros(batch, shared[0].row_bytes, dtype=torch.uint8, device=shared[0].device)
    times = [{which: _new_samples() for which in ("shared", "private")} for _ in range(ranks)]
    for step_index in range(warmup + steps):
        top_k = _top_k(generator, shared[0], batch, prompts[0] + step_index, miss_free)
        for rank in range(ranks):
            pair = [("shared", shared[rank]), ("private", private[rank])]
            for which, cache in pair if step_index % 2 == 0 else pair[::-1]:
                cache.backend.synchronize(cache.device)
                timed = _timed_step(cache, batch, kv, top_k)
                if step_index >= warmup:
                    _add_sample(times[rank][which], timed)
    results = [{"rank": rank, "writer": rank == 0, **times[rank],
                "shared_pool_attached": shared[rank]._pool.segment is not None,
                "private_pool_shared": private[rank]._pool.segment is not None,
                "prompt_rows_from_writer": _holds_prompts(shared[rank], batch, prompts[rank])}
               for rank in range(ranks)]
    for cache in (*shared[::-1], *private):  # the readers before the writer
        cache.close()
    return results


def _holds_prompts(cache: Any, batch: int, prompt: int) -> bool:
    """Whether the host rows of every request's prompt hold its bytes (on a reader, which
    prefilled blank rows, those can only have come through the shared pool)."""
    if cache._shared is not None:
        cache._shared.before_read()  # the writer's copies of every operation so far landed
    host = cache.host_tensors()
    for request in range(batch):
        extents = cache._requests.get(request, "check").extents
        rows = torch.from_numpy(token_rows(extents, cache.extent_tokens, 0, prompt))
        expected = prompt_rows(request, 0, prompt, cache.num_layers, cache.row_bytes)
        if any(not torch.equal(host[layer][rows], expected[layer])
               for layer in range(cache.num_layers)):
            return False
    return True


def paired_stats(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Over the steps of `results` (ranks of `paired_rank`): the median of each cache's host,
    host-without-waits and device time, and of the per-step ratio shared / private (both in
    one process, adjacent in time), with its quartiles. Without waits, the private step's
    host time is its whole host time (it waits for no rank)."""
    out: dict[str, Any] = {"steps": sum(len(r["shared"]["host_us"]) for r in results)}
    metrics = (("host", "host_us"), ("host_busy", "busy_us"), ("device", "device_ms"),
               *((phase.removesuffix("_us"), phase) for phase in PHASES))
    for metric, key in metrics:
        private_key = "host_us" if key == "busy_us" else key
        pairs = [(s, p) for r in results
                 for s, p in zip(r["shared"][key], r["private"][private_key], strict=True)]
        if not pairs:
            continue  # no device times on a CPU
        ratios = sorted(s / p for s, p in pairs)
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        out[metric] = {"shared_median": statistics.median([s for s, _ in pairs]),
                       "private_median": statistics.median([p for _, p in pairs]),
                       "ratio_median": statistics.median(ratios),
                       "ratio_quartiles": [quartiles[0], quartiles[-1]]}
    return out


def paired_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The non-writer ranks' (all steps of ranks 1..n-1 together) and the writer's paired
    times and ratios, and each rank's own, with whether its shared cache reads the pool."""
    ranks = [{"rank": r["rank"], "writer": r["writer"],
              "shared_pool_attached": r["shared_pool_attached"],
              "private_pool_shared": r["private_pool_shared"],
              "prompt_rows_from_writer": r["prompt_rows_from_writer"], **paired_stats([r])}
             for r in results]
    return {"non_writer": paired_stats(results[1:]) if len(results) > 1 else None,
            "writer": paired_stats(results[:1]), "ranks": ranks}


__all__ = ["one_process_ranks", "paired_rank", "paired_stats", "paired_summary", "timing_rank"]
