"""The combination fuzz: one seeded schedule of cache calls that draws every capability
together, checked byte for byte against a plain-Python model of what each row must hold.

Each step draws from the whole cross product: S from 1 to `max_draft_tokens` (verify steps,
with random accept counts), `dedupe` single-token steps, ragged steps (each request appends
0..S rows and a verify step keeps 0..a_b of them), the folded (`swap_in(...,
newest_kv=)`) and the two-call newest rows, cancels at a random layer, admits with whole or
chunked prefills, PD reservations, preempt and resume, finish and abort in any order, and,
where the residency map allows it, prefixes retained, shared and released; index groups and
both residency maps come from the config. Every rank of a shared pool (a process each,
`shared_pool_run.run_group`) runs the same schedule, so every rank makes the same calls, and
every rank checks every row it reads. The model: the KV of token `p` of a request is
`kv_at(seed, p, layer)` for the seed its `Origin` names at `p` (its prompt's, its prefix's, or
the step that wrote it: a verify step's drafts get fresh seeds, so a rejected draft's bytes
never match what the next step writes at that position).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hisparse.core.host_pool import token_rows
from hisparse.errors import PoolExhaustedError
from hisparse.tools.shared_pool_run import _cache, kv_at, prompt_rows

# The fuzz's cache: short extents and a tight pool, so requests span extents, the pool runs
# out now and then, and most requests are long (more tokens than hot slots): their swap-ins
# read host rows. Verify steps of up to 3 tokens (hot_slots >= max_draft_tokens x top_k).
FUZZ_CONFIG: dict[str, Any] = dict(
    num_layers=3, row_bytes_by_dtype={"fp8": 32, "bf16": 64}, top_k=8, hot_slots=24,
    index_group_size=1, max_requests=8, max_seq_len=160, host_pool_tokens=1024,
    extent_tokens=16, max_draft_tokens=3, validate=True)


# Where a request's (or a retained prefix's) KV comes from: `(end, seed)` runs in order,
# token `p` being the row of `seed` for the first run with `p < end`. A request admitted on
# an n-token prefix has its source's runs cut at n, then its own seed to the end.
Origin = tuple[tuple[int, int], ...]
_NO_END = 1 << 40


def seeds_at(origin: Origin, positions: np.ndarray) -> np.ndarray:
    """The KV seed of each of `positions` (any shape) of a holder of `origin`."""
    ends = np.array([end for end, _ in origin], dtype=np.int64)
    seeds = np.array([seed for _, seed in origin], dtype=np.int64)
    return seeds[np.searchsorted(ends, positions, side="right")]


def cut(origin: Origin, num_tokens: int) -> Origin:
    """The runs of the first `num_tokens` tokens."""
    kept, start = [], 0
    for end, seed in origin:
        if start >= num_tokens:
            break
        kept.append((min(end, num_tokens), seed))
        start = end
    return tuple(kept)


def swap_in_new_rows(step: Any, layer: int, top_k: torch.Tensor, kv: torch.Tensor,
                     folded: bool) -> torch.Tensor:
    """One layer of `step`: its new rows `kv` handed to the swap-in (`folded`) or written
    first by `write_newest`, the two ways a framework may give them; the returned rows."""
    if folded:
        return step.swap_in(layer, top_k, newest_kv=kv)
    step.write_newest(layer, kv)
    return step.swap_in(layer, top_k)


class FuzzRank:
    """One rank's run of the seeded schedule, checking every row it reads.

    Where the cache can share (`residency_map: position`, or host_row with alias key
    extents: `alias_extents > 0`) it shares prefixes too (`retain_prefix`, `release_prefix`,
    `admit` and `reserve_host_slots` on a retained prefix or on a live request's first
    tokens); a retained prefix that ends inside a running request's last extent sends that
    request to a private copy at its next decode step (counted as `private_copies`). Alias
    key extents that run out are refused like a full pool, alike on every rank."""

    MAX_HANDLES = 4  # retained at once: the tight pool must still admit

    def __init__(self, cache: Any, seed: int, writer: bool, folded: float = 0.5,
                 after_reads: Callable[[], None] | None = None) -> None:
        self.folded = folded  # the share of steps that hand the new rows to swap_in
        self.cache, self.writer = cache, writer
        # Called once a step's reads are checked (a test's gated writer lets its copies land).
        self.after_reads = after_reads
        # False for a writer whose copies a test delays without stream order (a CPU fake):
        # its own reads would see them late; the private-pool runs check a writer's reads.
        self.checks_reads = True
        self.rng = random.Random(seed)
        self.L, self.W = cache.num_layers, cache.row_bytes
        config = cache.config
        self.sharing = config.residency_map == "position" or config.alias_extents > 0
        self.seeds: dict[int, int] = {}  # request id -> its own KV seed
        self.origin: dict[int, Origin] = {}  # request id -> where each token's KV comes from
        self.length: dict[int, int] = {}  # tokens so far
        self.state: dict[int, str] = {}  # running / preempted / reserved
        self.handles: list[tuple[Any, Origin]] = []  # retained prefixes, oldest first
        self.next_id = 0
        self.counts = dict(steps=0, cancels=0, checked_rows=0, mismatches=0, admits=0, pd=0,
                           finishes=0, aborts=0, preempts=0, resumes=0, exhausted=0,
                           folded_steps=0, verify_steps=0, dedupe_steps=0,
                           ragged_steps=0, ragged_verify_steps=0, rejected_drafts=0)
        # For a mismatch's report: the last actions, and the first mismatches themselves.
        self.recent: deque[tuple[int, str]] = deque(maxlen=16)
        self.mismatch_details: list[dict[str, Any]] = []
        if self.sharing:
            self.counts.update(retains=0, releases=0, shared_admits=0, private_copies=0,
                               leaked_extents=0)

    def ids(self, state: str) -> list[int]:
        return [r for r, s in self.state.items() if s == state]

    def run(self, steps: int) -> dict[str, Any]:
        actions = [(self.admit, 3), (self.pd, 2), (self.finish, 1), (self.abort, 1),
                   (self.preempt, 1), (self.resume, 2), (self.decode, 12)]
        if self.sharing:
            actions += [(self.retain, 2), (self.release, 1)]
        while self.counts["steps"] < steps:
            action = self.rng.choices([a for a, _ in actions], [w for _, w in actions])[0]
            self.recent.append((self.counts["steps"], action.__name__))
            try:
                action()
            except PoolExhaustedError:
                self.counts["exhausted"] += 1  # the same on every rank: nothing changed
        self.check_host_rows()
        if self.sharing:
            self.give_everything_back()
        return self.counts

    def _new(self, tokens: int, prefix: tuple[Any, int, Origin] | None = None) -> int:
        request = self.next_id
        self.next_id += 1
        seed = self.seeds[request] = self.rng.getrandbits(40)
        self.origin[request] = (prefix[2] if prefix else ()) + ((_NO_END, seed),)
        self.length[request] = tokens
        return request

    def _forget(self, request: int) -> None:
        for table in (self.seeds, self.origin, self.length, self.state):
            table.pop(request, None)

    def _prefix(self) -> tuple[Any, int, Origin] | None:
        """Half the time (when sharing): `(prefix=, its tokens, its origin)` of a retained
        prefix or of the first tokens of a running or preempted request."""
        sources = self.ids("running") + self.ids("preempted")
        if not self.sharing or self.rng.random() < 0.5 or not (sources or self.handles):
            return None
        if self.handles and (not sources or self.rng.random() < 0.5):
            handle, origin = self.rng.choice(self.handles)
            return handle, handle.num_tokens, origin
        source = self.rng.choice(sources)
        tokens = self.rng.randint(1, self.length[source])
        return (source, tokens), tokens, cut(self.origin[source], tokens)

    def _new_length(self, prefix: tuple[Any, int, Origin] | None) -> int:
        first = prefix[1] if prefix else 0
        return min(self.cache.max_seq_len, first + self.rng.randint(0 if first else 1, 48))

    def admit(self) -> None:
        prefix = self._prefix()
        tokens = self._new_length(prefix)
        request = self._new(tokens, prefix)
        try:
            self.cache.admit(request, tokens, prefix=prefix[0] if prefix else None)
        except PoolExhaustedError:
            self._forget(request)
            raise
        first = prefix[1] if prefix else 0  # the prefix's rows are in the pool already
        rows = prompt_rows(self.seeds[request], first, tokens, self.L, self.W)
        split = self.rng.randint(first, tokens)  # in two calls, as a chunked prefill writes
        # From the device, as a prefill's KV comes (on CPU that is the host).
        rows = rows.to(self.cache.device)
        if split > first:
            self.cache.write_prefill(request, rows[:, : split - first], start=first)
        if split < tokens:
            self.cache.write_prefill(request, rows[:, split - first:], start=split)
        self.cache.commit_prefill(request)
        self.state[request] = "running"
        self.counts["admits"] += 1
        if prefix:
            self.counts["shared_admits"] += 1

    def pd(self) -> None:
        """A PD transfer: every rank reserves the rows; the transfer engine writes only the
        writer's reservation; every rank then completes."""
        prefix = self._prefix()
        tokens = self._new_length(prefix)
        request = self._new(tokens, prefix)
        try:
            reservation = self.cache.reserve_host_slots(
                request, tokens, prefix=prefix[0] if prefix else None)
        except PoolExhaustedError:
            self._forget(request)
            raise
        self.state[request] = "reserved"
        if self.writer:
            rows = prompt_rows(self.seeds[request], reservation.prefix_tokens, tokens, self.L,
                               self.W)
            index = torch.from_numpy(reservation.rows)
            for layer, host in enumerate(reservation.host_tensors):
                host[index] = rows[layer]
        self.cache.complete_transfer(request)  # no free slot: it stays reserved
        self.state[request] = "running"
        self.counts["pd"] += 1

    def retain(self) -> None:
        sources = self.ids("running") + self.ids("preempted")
        if len(self.handles) >= self.MAX_HANDLES or not (sources or self.handles):
            return
        if self.handles and (not sources or self.rng.random() < 0.3):  # cut a shorter one
            handle, origin = self.rng.choice(self.handles)
            tokens = self.rng.randint(1, handle.num_tokens)
            self.handles.append((self.cache.retain_prefix(handle, tokens), cut(origin, tokens)))
        else:  # often the whole request: it decodes into the retained tail's extent next
            source = self.rng.choice(sources)
            length = self.length[source]
            tokens = length if self.rng.random() < 0.5 else self.rng.randint(1, length)
            self.handles.append((self.cache.retain_prefix(source, tokens),
                                 cut(self.origin[source], tokens)))
        self.counts["retains"] += 1

    def release(self) -> None:
        if self.handles:
            handle, _ = self.handles.pop(self.rng.randrange(len(self.handles)))
            self.cache.release_prefix(handle)
            self.counts["releases"] += 1

    def give_everything_back(self) -> None:
        """Release every prefix and end every request, in random order: the pool is full
        again (an extent not given back, or given back twice, shows here or raises), and so
        are host_row's alias key extents (one not given back counts as a leaked extent)."""
        ends = [("release", h) for h, _ in self.handles] + [("abort", r) for r in self.state]
        self.rng.shuffle(ends)
        for call, what in ends:
            (self.cache.release_prefix if call == "release" else self.cache.abort)(what)
        self.handles = []
        for request in list(self.state):
            self._forget(request)
        pool, aliases = self.cache._pool, self.cache._prefixes.aliases
        self.counts["leaked_extents"] += pool.num_extents - pool.allocator.free_extents
        if aliases is not None:
            self.counts["leaked_extents"] += aliases.capacity - aliases.free

    def finish(self) -> None:
        done = self.ids("running") + self.ids("preempted")
        if done:
            request = self.rng.choice(done)
            self.cache.finish(request)
            self._forget(request)
            self.counts["finishes"] += 1

    def abort(self) -> None:
        if self.state:
            request = self.rng.choice(sorted(self.state))
            self.cache.abort(request)
            self._forget(request)
            self.counts["aborts"] += 1

    def preempt(self) -> None:
        running = self.ids("running")
        if running:
            request = self.rng.choice(running)
            self.cache.preempt(request)
            self.state[request] = "preempted"
            self.counts["preempts"] += 1

    def resume(self) -> None:
        waiting = self.ids("preempted") + self.ids("reserved")
        if waiting:
            request = self.rng.choice(waiting)
            if self.state[request] == "reserved":
                self.cache.complete_transfer(request)
            else:
                self.cache.resume(request)
            self.state[request] = "running"
            self.counts["resumes"] += 1

    def decode(self) -> None:
        """One decode step drawn from every kind: S tokens (a verify step when S > 1, with
        random accept counts), a de-duplicated single token, or a ragged step (each request
        appends 0..S rows; a verify step keeps 0..a_b of them, and any query of a request may
        read all it appended), folded or two-call newest rows, and one step in ten cancelled
        after a random layer."""
        cache, rng = self.cache, self.rng
        tokens = rng.randint(1, cache.max_draft_tokens)
        full = [r for r in self.ids("running") if self.length[r] + tokens > cache.max_seq_len]
        for request in full:
            cache.finish(request)
            self._forget(request)
        running = self.ids("running")
        if not running:
            return
        batch = rng.sample(running, rng.randint(1, len(running)))
        dedupe = tokens == 1 and rng.random() < 0.25
        # A ragged step (a compressed layer): a request that appends 0 gets no new token.
        ragged = not dedupe and rng.random() < 0.3
        appends = [rng.randint(0, tokens) for _ in batch] if ragged else None
        if self.sharing:  # (requests the step is about to move to a private copy)
            writers = cache._prefixes.writers
            self.counts["private_copies"] += sum(
                id(cache._requests.get(r, "x")) in writers for r in batch)
        step = cache.begin_decode_step(batch, num_tokens=tokens, dedupe=dedupe, appends=appends)
        first = np.array([self.length[r] for r in batch])
        own = np.array(step.appends)  # tokens each request's queries may read of its own
        positions = first[:, None] + np.arange(tokens)  # [B, S]
        # The step's own tokens' bytes come from fresh seeds: a rejected draft's never match.
        step_seeds = np.array([[rng.getrandbits(40) for _ in range(tokens)] for _ in batch])
        # What each query may select up to: its own position, or in a ragged step, for every
        # query, the request's last appended row.
        limits = (np.repeat((first + own - 1)[:, None], tokens, axis=1) if ragged
                  else positions)
        top_k = self._draw_top_k(limits, repeats=tokens > 1 or dedupe)  # [B, S, K]
        top = torch.from_numpy(top_k.astype(np.int32)).to(cache.device)
        if tokens == 1:
            top = top[:, 0]
        folded = rng.random() < self.folded
        cancel_after = rng.randrange(self.L) if rng.random() < 0.1 else None
        self.counts["folded_steps"] += folded
        self.counts["verify_steps"] += tokens > 1
        self.counts["dedupe_steps"] += dedupe
        self.counts["ragged_steps"] += ragged
        self.counts["ragged_verify_steps"] += ragged and tokens > 1
        self.recent.append((self.counts["steps"], f"S={tokens} dedupe={dedupe} folded={folded}"
                            f" cancel_after={cancel_after} appends={appends}"))
        for layer in range(self.L):
            kv = torch.from_numpy(kv_at(step_seeds, positions, layer, self.W)).to(cache.device)
            kv = kv[:, 0] if tokens == 1 else kv
            rows = swap_in_new_rows(step, layer, top, kv, folded)
            self.check(layer, rows.reshape(len(batch), tokens, -1), top_k, batch, first,
                       step_seeds)
            if layer == cancel_after:
                break
        if self.after_reads is not None:
            self.after_reads()
        if cancel_after is not None:
            step.cancel()
            self.counts["cancels"] += 1
        else:
            # (a single-token step keeps what it appended; a ragged verify step 0..a_b rows)
            accepted = (own.tolist() if tokens == 1 else
                        [rng.randint(0, int(a)) for a in own] if ragged else
                        [rng.randint(1, tokens) for _ in batch])
            step.end(accepted if tokens > 1 else None)
            for b, request in enumerate(batch):
                if accepted[b]:
                    self._keep(request, first[b], step_seeds[b, : accepted[b]])
                self.counts["rejected_drafts"] += int(own[b]) - accepted[b]
        self.counts["steps"] += 1

    def _draw_top_k(self, positions: np.ndarray, repeats: bool) -> np.ndarray:
        """`[B, S, K]`: row s of request b picks among positions up to `positions[b, s]`
        (its query token's own, or a ragged step's last appended row), -1 padded; with
        `repeats` (a union step) some positions are listed twice."""
        rng, K = self.rng, self.cache.top_k
        B, S = positions.shape
        top_k = np.full((B, S, K), -1, dtype=np.int64)
        for b in range(B):
            for s in range(S):
                own = int(positions[b, s])
                picks = rng.sample(range(own + 1), min(K, own + 1))
                if repeats and len(picks) > 1 and rng.random() < 0.5:
                    picks[-1] = picks[0]
                top_k[b, s, : len(picks)] = picks
        return top_k

    def _keep(self, request: int, first: int, seeds: np.ndarray) -> None:
        """The kept tokens `first..` of a step: their positions now hold the step's bytes."""
        kept = tuple((int(first) + offset + 1, int(seed))
                     for offset, seed in enumerate(seeds.tolist()))
        self.origin[request] = (*cut(self.origin[request], int(first)), *kept,
                                (_NO_END, self.seeds[request]))
        self.length[request] = int(first) + len(seeds)

    def check(self, layer: int, rows: torch.Tensor, top_k: np.ndarray, batch: list[int],
              first: np.ndarray, step_seeds: np.ndarray) -> None:
        """Every row swap_in returned (`[B, S, K]`) holds the bytes of the token asked for:
        an older one's from the model, the step's own from its fresh seed."""
        if not self.checks_reads:
            return
        valid = top_k >= 0
        device_rows = rows.cpu().numpy().astype(np.int64)
        got = self.cache.device_kv(layer).cpu().numpy()[np.where(valid, device_rows, 0)]
        picked = np.where(valid, top_k, 0)
        older = np.stack([seeds_at(self.origin[r], picked[b]) for b, r in enumerate(batch)])
        draft = picked - first[:, None, None]  # the step's token d, where 0 <= d
        own = np.take_along_axis(step_seeds[:, None, :].repeat(picked.shape[1], 1),
                                 np.clip(draft, 0, step_seeds.shape[1] - 1), axis=2)
        seeds = np.where(draft >= 0, own, older)
        expected = kv_at(seeds, picked, layer, self.W)
        wrong = valid & ((device_rows < 0) | (got != expected).any(axis=-1))
        self.counts["checked_rows"] += int(valid.sum())
        self.counts["mismatches"] += int(wrong.sum())
        for b, s, k in zip(*np.nonzero(wrong), strict=True):
            request = batch[b]
            self._report("swap_in", layer=layer, request=request, query=int(s),
                         position=int(top_k[b, s, k]), length=self.length[request] + 1,
                         device_row=int(device_rows[b, s, k]))

    def check_host_rows(self) -> None:
        """At the end: every live request's and retained prefix's rows in the host pool,
        once the writer's copies of every operation so far have landed."""
        shared = self.cache._shared
        self.cache.backend.synchronize(self.cache.device)  # this rank's own copies
        if shared is not None:
            shared.before_read()
        host = self.cache.host_tensors()
        holders = [(self.cache._requests.get(r, "check").extents, n, self.origin[r])
                   for r, n in self.length.items()]
        retained = self.cache._prefixes._retained
        holders += [(retained[h.handle_id][1].extents, h.num_tokens, origin)
                    for h, origin in self.handles]
        for extents, length, origin in holders:
            rows = token_rows(extents, self.cache.extent_tokens, 0, length)
            positions = np.arange(length)
            expected = torch.from_numpy(np.stack([
                kv_at(seeds_at(origin, positions), positions, layer, self.W)
                for layer in range(self.L)]))
            for layer in range(self.L):
                wrong = (host[layer][torch.from_numpy(rows)] != expected[layer]).any(dim=-1)
                self.counts["checked_rows"] += length
                self.counts["mismatches"] += int(wrong.sum())
                for position in torch.nonzero(wrong).flatten().tolist():
                    self._report("host rows at the end", layer=layer, position=position,
                                 length=length, host_row=int(rows[position]))

    def _report(self, where: str, **what: Any) -> None:
        if len(self.mismatch_details) < 5:
            self.mismatch_details.append({"where": where, "step": self.counts["steps"], **what,
                                          "recent": list(self.recent)})


def fuzz_rank(barrier: Any, name: str | None, rank: int, ranks: int, seed: int, steps: int,
              device: Any = "cpu", overrides: dict[str, Any] | None = None,
              folded: float = 0.5) -> dict[str, Any]:
    """One rank of the fuzz: the same schedule as every other rank of the group; `folded`
    of its steps hand the new rows to swap_in (`newest_kv=`), the rest write them first."""
    cache = _cache(name, rank, ranks, device, {**FUZZ_CONFIG, **(overrides or {})})
    barrier.wait()
    started = time.perf_counter()
    try:
        fuzz = FuzzRank(cache, seed, writer=rank == 0, folded=folded)
        counts = fuzz.run(steps)
    finally:
        barrier.wait()  # no rank closes while another may still wait on its rows
        cache.close()
    details = {"mismatch_details": fuzz.mismatch_details} if fuzz.mismatch_details else {}
    return {**counts, "rank": rank, "seconds": time.perf_counter() - started, **details}

