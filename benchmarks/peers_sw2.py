"""SW-2 beside the peers (benchmarks/peers.py --table sw2): per (S, B) one hisparse verify cache
(`verify_step.build`) and, on the same host pool and the same `[B, S, K]` top-k every step
(`verify_step.query_rows`: row 0 follows the last step's with churn c, row s keeps `overlap` of
row s - 1), SGLang 0.5.23's speculative swap-in alone, SGLang's whole verify step, and vLLM
0.34's two ops over the B x S verify rows.

Timed per step, eagerly (events behind a device-side sleep for device time, the host
wall-clock for host time), with the share of steps whose host outran the sleep (their device
time may hold waits for the host: `sleep_outrun`): hisparse's whole verify step (begin with S
tokens, the newest rows' write, the swap-in, end with accept counts drawn from 1..S), its
swap-in alone and the two parts around it (begin with the write; end); `sglang`, SGLang's
`load_cache_to_device_buffer_spec_mla` alone (gather and commit kernels); `sglang_step`, a
verify step as SGLang's coordinator runs one (benchmarks/sglang_spec_step.py, SGLang's own
method sources on stand-in pools): `prepare_verify` (the verify tokens bound to the extra
page's columns), the same swap-in, and `commit_accept_tokens` with the accept counts
hisparse's step got (a Triton device-to-device copy of the accepted rows into persistent
columns, a backup of all S verify rows into each request's reserved host page through SGLang's
JIT `transfer_hicache_all_layer_mla` on a side stream that the step then waits for, the
mapping and table updates); vLLM's resolve and gather. Left out of SGLang's step: the model's
writes of the verify rows and the sampling. `sglang_step` keeps its own spec state, device
rows and a copy of the host pool's used rows followed by a spare page per request (where its
backups land; no byte check reads them). Its `seq_lens` stay at the prompt's length (the
SW-2 positions stay below it), so every step binds the same verify tokens and does the same
work; each commit moves the newest accepted token into column H, a position no top-k asks
for. Both SGLang columns start as `reset` leaves a request (token t in hot slot t; the step's
then after one untimed prepare and commit, so that its column H never holds a position the
byte check reads: `SpecStepPeer.settle`), vLLM's empty, hisparse's as its prefill left it;
the warm-up steps settle all of them. Byte checks: the peers' rows every step, hisparse's on a
last, untimed step. Without SGLang's coordinator and pool files beside its kernels
(sglang_ops.STEP_FILES) the `sglang_step` column is skipped, its reason recorded in the cells'
`errors` and the result's `sglang_step`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import sglang_ops
import sglang_spec_step
import verify_step
import vllm_peer

GRID = {"tokens": (2, 3, 4), "batches": (1, 16, 64), "churns": (0.05, 0.2),
        "overlaps": (0.9, 0.5)}
QUICK = {"tokens": (2,), "batches": (1, 2), "churns": (0.2,), "overlaps": (0.9,)}
SIZES = {"top_k": 2048, "seq_len": 32768, "row_bytes": 656}
QUICK_SIZES = {"top_k": 1024, "seq_len": 8192, "row_bytes": 656}
# SGLang's extra page: its DSA KV page (the newest token, then the verify tokens).
SGLANG_PAGE = sglang_spec_step.PAGE
SLEEP_CYCLES = 2_000_000


class SpecPeer:
    """SGLang's speculative swap-in on B request slots of its own, over `host_cache` (the
    hisparse cache's host pool, or a copy of its used rows); `host_rows` [B, seq_len] the host
    rows of each request's positions."""

    def __init__(self, ops: Any, host_cache: torch.Tensor, host_rows: np.ndarray, S: int,
                 top_k: int, hot: int, truth: torch.Tensor) -> None:
        B, seq_len = host_rows.shape
        dev, P, width = truth.device, SGLANG_PAGE, hot + SGLANG_PAGE
        self.ops, self.host_cache, self.hot = ops, host_cache, hot
        self.state = sglang_ops.spec_state(ops, B, hot, S, top_k, dev)
        scratch = self.state.scratch_locs.shape[1]
        tokens = torch.full((B, width), -1, dtype=torch.int32, device=dev)
        tokens[:, :hot] = torch.arange(hot, dtype=torch.int32, device=dev)
        tokens[:, hot] = seq_len - 1
        tokens[:, hot + 1: hot + 1 + S] = seq_len + torch.arange(S, dtype=torch.int32,
                                                                  device=dev)
        self.tokens = tokens
        self.locs = torch.arange(B * width, dtype=torch.int32, device=dev).view(B, width)
        locs = np.full((B, seq_len + P), -1, dtype=np.int64)
        locs[:, :seq_len] = host_rows
        self.host_locs = torch.from_numpy(locs).to(dev)
        self.device = torch.zeros(B * (width + scratch), truth.shape[1], dtype=torch.uint8,
                                  device=dev)
        seeded = self.device[: B * width].view(B, width, -1)
        seeded[:, :hot] = truth[:hot]
        seeded[:, hot] = truth[seq_len - 1]
        for r in range(B):
            sglang_ops.reset_request(self.state, r, hot)
        self.state.scratch_locs.copy_(B * width + torch.arange(
            B * scratch, dtype=torch.int32, device=dev).view(B, scratch))
        self.slots = torch.arange(B, dtype=torch.int64, device=dev)
        self.seq_lens = (seq_len + 1 + torch.arange(S, dtype=torch.int32, device=dev)).repeat(B)
        self.num_real = torch.tensor([B], dtype=torch.int32, device=dev)
        self.out = torch.zeros(B, S, top_k, dtype=torch.int32, device=dev)

    def __call__(self, top_k: torch.Tensor) -> None:
        self.ops.load_cache_to_device_buffer_spec_mla(
            top_k_tokens=top_k, device_buffer_tokens=self.tokens, host_cache_locs=self.host_locs,
            device_buffer_locs=self.locs, host_cache=self.host_cache, device_buffer=self.device,
            top_k_device_locs=self.out, req_pool_indices=self.slots, seq_lens=self.seq_lens,
            state=self.state, num_real_reqs=self.num_real)

    def rows(self) -> torch.Tensor:
        return self.device


class VllmVerifyPeer:
    """vLLM's ops on the B x S verify rows: its own hot cache (empty at the start), the
    hisparse cache's host bytes copied behind vLLM's null page."""

    def __init__(self, ops: Any, host_cache: torch.Tensor, host_rows: np.ndarray, S: int,
                 top_k: int, hot: int) -> None:
        B = host_rows.shape[0]
        dev = torch.device("cuda")
        null = vllm_peer.NULL_PAGE_ROWS
        used = int(host_rows.max()) + 1
        from hisparse.backends.registry import get_backend

        self.raw = get_backend("cuda").alloc_host((used + null) * host_cache.shape[1])
        self.host = self.raw.view(used + null, host_cache.shape[1])
        self.host[null:].copy_(host_cache[:used])
        pages = B * hot // vllm_peer.HOT_PAGE_ROWS
        self.hot_rows = torch.zeros(B * hot, host_cache.shape[1], dtype=torch.uint8, device=dev)
        state = vllm_peer.VllmTables(
            hot_cache=self.hot_rows.view(pages, vllm_peer.HOT_PAGE_ROWS, -1),
            hot_block_table=torch.arange(pages, dtype=torch.int32, device=dev).view(B, -1),
            source_block_table=torch.from_numpy(
                vllm_peer.host_pages(host_rows, vllm_peer.HOT_PAGE_ROWS)).to(dev),
            device_global_indices=torch.full((B, hot), -1, dtype=torch.int32, device=dev),
            lru_slots=torch.arange(hot, dtype=torch.int16, device=dev).repeat(B, 1),
            block_size=vllm_peer.HOT_PAGE_ROWS)
        self.kernel = vllm_peer.VllmSwapIn(ops, self.host, state, rows_per_request=S)
        self.num_valid = torch.tensor([B * S], dtype=torch.int32, device=dev)
        self.out = torch.empty(B * S, top_k, dtype=torch.int32, device=dev)

    def __call__(self, top_k: torch.Tensor) -> None:
        self.kernel.resolve_and_copy(top_k.view(-1, top_k.shape[-1]), self.num_valid, self.out)

    def rows(self) -> torch.Tensor:
        return self.hot_rows

    def close(self) -> None:
        from hisparse.backends.registry import get_backend

        torch.cuda.synchronize()
        get_backend("cuda").free_host(self.raw)


def timed(call: Any) -> tuple[float, float, bool]:
    """(device seconds, host seconds, whether the host outran the sleep) of one eager call,
    queued behind a device sleep."""
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    begin.record()
    started = time.perf_counter()
    call()
    host = time.perf_counter() - started
    end.record()
    outran = begin.query()  # the device reached the call before the host had queued all of it
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3, host, outran


def hisparse_step(cache: Any, top_k: torch.Tensor, zeros: torch.Tensor, accepted: list[int],
                  check: torch.Tensor | None) -> dict[str, float]:
    """One verify step of the engine: device and host time of the whole step and of its
    swap-in alone; with `check` (the positions' true rows) the wrong rows, untimed."""
    B, S = top_k.shape[:2]
    torch.cuda.synchronize()
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    host = [0.0] * 4
    got: list[torch.Tensor] = []
    if check is None:
        torch.cuda._sleep(SLEEP_CYCLES)
    marks[0].record()
    host[0] = time.perf_counter()
    cache.begin_decode_step(list(range(B)), num_tokens=S)
    cache.write_newest(0, zeros)
    marks[1].record()
    host[1] = time.perf_counter()
    got.append(cache.swap_in(0, top_k))
    host[2] = time.perf_counter()
    marks[2].record()
    wrong = -1 if check is None else verify_step.wrong_rows(cache, got[0], top_k, check)
    cache.end_decode_step(accepted=accepted)
    host[3] = time.perf_counter()
    marks[3].record()
    # The device passed the first mark before the host had queued the step: the device time
    # then holds gaps where the device waited for the host.
    outran = marks[0].query()
    torch.cuda.synchronize()
    return {"step_device": marks[0].elapsed_time(marks[3]) / 1e3, "step_host": host[3] - host[0],
            "swap_device": marks[1].elapsed_time(marks[2]) / 1e3,
            "swap_host": host[2] - host[1], "wrong": wrong,
            # the rest of the step: begin with the new rows' write, and end
            "begin_device": marks[0].elapsed_time(marks[1]) / 1e3, "begin_host": host[1] - host[0],
            "end_device": marks[2].elapsed_time(marks[3]) / 1e3, "end_host": host[3] - host[2],
            "sleep_outrun": float(outran)}


def peer_wrong(rows: torch.Tensor, out: torch.Tensor, positions: torch.Tensor,
               truth: torch.Tensor) -> int:
    """Selected positions whose returned device row differs from the position's own row."""
    got = rows[out.reshape(-1).clamp(min=0).long()]
    want = truth[positions.reshape(-1).clamp(min=0).long()]
    selected = positions.reshape(-1) >= 0
    return int((selected & ((out.reshape(-1) < 0) | ~(got == want).all(-1))).sum())


def peer_step(name: str, peer: Any, top_k: torch.Tensor, truth: torch.Tensor, hot: int,
              accepted: list[int]) -> tuple[float, float, bool, int, int]:
    """(device s, host s, sleep outrun, misses, wrong rows) of one peer call: SGLang's misses
    are the hot slots whose token changed (CLOCK admits them there), vLLM's its stats' miss
    count. SGLang's step gets hisparse's accept counts, as the sampler's `accept_index`."""
    held = peer.tokens[:, :hot].clone() if name.startswith("sglang") else None
    before = peer.kernel.misses() if name == "vllm" else 0
    if name == "sglang_step":
        index = peer.stage(accepted)
        device, host, outran = timed(lambda: peer(top_k, index))
    else:
        device, host, outran = timed(lambda: peer(top_k))
    wrong = peer_wrong(peer.rows(), peer.out, top_k, truth)
    misses = (int((peer.tokens[:, :hot] != held).sum()) if held is not None
              else peer.kernel.misses() - before)
    return device, host, outran, misses, wrong


def load_step(peers: Any) -> tuple[Any, str | None]:
    """SGLang's verify-step code from the copy whose kernels `peers` loaded (None and why not
    where it lacks the files or kernels)."""
    if peers.sglang is None:
        return None, None
    root = Path(peers.records["sglang"]["source"])
    try:
        sglang_spec_step.check_root(root)  # first: a missing file is the likeliest reason
        return sglang_spec_step.load_step(root, sglang_spec_step.cuda_kernels()), None
    except Exception as exc:  # the column is skipped, the table goes on
        return None, f"{type(exc).__name__}: {exc}"[:400]


def step_peer(ops: Any, code: Any, host: torch.Tensor, host_rows: np.ndarray, S: int, K: int,
              hot: int, truth: torch.Tensor) -> sglang_spec_step.SpecStepPeer:
    """SGLang's step on a SpecPeer of its own over its own copy of the host pool's used rows,
    then a spare page of host rows per request (where its commits back up verify rows)."""
    from hisparse.backends.registry import get_backend

    B, seq_len = host_rows.shape
    used, width = int(host_rows.max()) + 1, host.shape[1]
    backend = get_backend(truth.device.type)
    raw = backend.alloc_host((used + B * SGLANG_PAGE) * width)
    pool = raw.view(used + B * SGLANG_PAGE, width)
    pool[:used].copy_(host[:used])
    pool[used:].zero_()
    try:
        peer = sglang_spec_step.SpecStepPeer(SpecPeer(ops, pool, host_rows, S, K, hot, truth),
                                             code, [seq_len] * B, S, used)
        peer.settle()  # also builds its Triton copy and JIT backup, outside any timing
    except Exception:
        backend.free_host(raw)
        raise

    def close() -> None:
        if truth.is_cuda:
            torch.cuda.synchronize()
        backend.free_host(raw)

    peer.close = close  # type: ignore[attr-defined]
    return peer


def make_peers(peers: Any, step: tuple[Any, str | None], host: torch.Tensor,
               host_rows: np.ndarray, S: int, K: int, hot: int,
               truth: torch.Tensor) -> tuple[dict[str, Any], dict[str, str]]:
    """The peers of one (S, B), by column name, and why any of them is missing."""
    made: dict[str, Any] = {}
    errors: dict[str, str] = {}
    code, skipped = step
    if skipped is not None:
        errors["sglang_step"] = skipped
    makers = (("sglang", peers.sglang is not None,
               lambda: SpecPeer(peers.sglang, host, host_rows, S, K, hot, truth)),
              ("sglang_step", code is not None,
               lambda: step_peer(peers.sglang, code, host, host_rows, S, K, hot, truth)),
              ("vllm", peers.vllm is not None,
               lambda: VllmVerifyPeer(peers.vllm, host, host_rows, S, K, hot)))
    for name, wanted, make in makers:
        if wanted:
            try:
                made[name] = make()
            except Exception as exc:  # a peer refusing these sizes: say so, go on
                errors[name] = f"{type(exc).__name__}: {exc}"[:400]
    return made, errors


def run_pair(args: Any, peers: Any, S: int, B: int, sizes: dict[str, int],
             cells: list[tuple[float, float]], step: tuple[Any, str | None]
             ) -> list[dict[str, Any]]:
    K, seq_len, W = sizes["top_k"], sizes["seq_len"], sizes["row_bytes"]
    hot = max(2, S) * K
    steps = args.warmup + args.steps + 1
    growth = -(-(len(cells) * steps * S + 2) // 64) * 64
    kv = torch.randint(0, 256, (1, seq_len, W), dtype=torch.uint8)
    cache = verify_step.build("cuda", K, hot, S, B, seq_len, W, growth, kv)
    truth = kv[0].cuda()
    host_rows = np.stack([cache.host_rows(b)[:seq_len] for b in range(B)])
    made, errors = make_peers(peers, step, cache.tables.host_kv[0], host_rows, S, K, hot, truth)
    zeros = torch.zeros(B, S, W, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng([args.seed, S, B])
    previous = rng.integers(0, seq_len, (B, K))
    results = []
    for overlap, churn in cells:
        cell, previous = run_cell(args, cache, made, errors, truth, zeros, rng, previous,
                                  (S, B, K, hot, seq_len, overlap, churn))
        print(json.dumps(cell), flush=True)
        results.append(cell)
    cache.close()
    for peer in made.values():
        if hasattr(peer, "close"):
            peer.close()
    return results


def run_cell(args: Any, cache: Any, made: dict[str, Any], errors: dict[str, str],
             truth: torch.Tensor, zeros: torch.Tensor, rng: np.random.Generator,
             previous: np.ndarray, shape: tuple) -> tuple[dict[str, Any], np.ndarray]:
    S, B, _, hot, seq_len, overlap, churn = shape
    samples: dict[str, dict[str, list[float]]] = {"hisparse": {}, **{n: {} for n in made}}
    wrong = {"hisparse": 0, **{n: 0 for n in made}}
    last = args.warmup + args.steps
    for step in range(last + 1):
        rows = verify_step.query_rows(rng, previous, seq_len, hot, S, churn, overlap)
        previous = rows[:, 0]
        top_k = torch.from_numpy(rows.astype(np.int32)).cuda()
        accepted = rng.integers(1, S + 1, B).tolist()
        before = int(cache.tables.counters[0, 1])
        ours = hisparse_step(cache, top_k, zeros, accepted, truth if step == last else None)
        if step == last:
            wrong["hisparse"] = ours["wrong"]
        elif step >= args.warmup:
            ours["misses"] = int(cache.tables.counters[0, 1]) - before
            for key, value in ours.items():
                samples["hisparse"].setdefault(key, []).append(value)
        for name, peer in list(made.items()):
            try:
                measured = peer_step(name, peer, top_k, truth, hot, accepted)
            except Exception as exc:  # a launch refused at these sizes: say so, go on
                errors[name] = f"{type(exc).__name__}: {exc}"[:400]
                del made[name], samples[name], wrong[name]
                continue
            wrong[name] += measured[-1]
            if args.warmup <= step < last:
                for key, value in zip(("device", "host", "sleep_outrun", "misses"),
                                      measured[:4], strict=True):
                    samples[name].setdefault(key, []).append(float(value))
    cell: dict[str, Any] = {"S": S, "B": B, "churn": churn, "overlap": overlap,
                            "wrong_rows": wrong, **({"errors": errors} if errors else {})}
    cell.update(summarize(samples, made))
    return cell, previous


def summarize(samples: dict[str, dict[str, list[float]]],
              made: dict[str, Any]) -> dict[str, Any]:
    """A cell's medians per column and hisparse's ratios to each peer's."""
    mine = samples["hisparse"]
    cell: dict[str, Any] = {"hisparse": {
        f"{key}_us": round(statistics.median(mine[key]) * 1e6, 1)
        for key in ("step_device", "step_host", "swap_device", "swap_host", "begin_device",
                    "begin_host", "end_device", "end_host")}}
    cell["hisparse"]["unique_misses_per_step"] = statistics.mean(mine["misses"])
    # The share of timed steps whose device time may hold waits for the host (SLEEP_CYCLES).
    cell["hisparse"]["sleep_outrun"] = statistics.mean(mine["sleep_outrun"])
    for name in made:
        got = samples[name]
        cell[name] = {"device_us": round(statistics.median(got["device"]) * 1e6, 1),
                      "host_us": round(statistics.median(got["host"]) * 1e6, 1),
                      "sleep_outrun": statistics.mean(got["sleep_outrun"]),
                      ("slots_replaced_per_step" if name.startswith("sglang")
                       else "unique_misses_per_step"): statistics.mean(got["misses"])}
        if name.startswith("sglang"):  # more misses a request than this and its kernel may race
            cell[name]["scratch_rows"] = int(made[name].state.scratch_locs.shape[1])
        cell[f"hisparse_step_vs_{name}"] = round(
            cell["hisparse"]["step_device_us"] / cell[name]["device_us"], 3)
        if name != "sglang_step":  # a swap-in beside a whole step says nothing
            cell[f"hisparse_swap_vs_{name}"] = round(
                cell["hisparse"]["swap_device_us"] / cell[name]["device_us"], 3)
    return cell


def run_sw2(args: Any, peers: Any, result: dict[str, Any], save: Any) -> None:
    grid, sizes = (QUICK, QUICK_SIZES) if args.quick else (GRID, SIZES)
    tokens, batches = args.tokens or grid["tokens"], args.batches or grid["batches"]
    churns, overlaps = args.churns or grid["churns"], args.overlaps or grid["overlaps"]
    result.update({"sizes": sizes, "sglang_extra_page": SGLANG_PAGE, "cells": []})
    step = load_step(peers)
    if step[0] is not None:
        result["sglang_step"] = sglang_spec_step.describe(step[0].root)
    elif step[1] is not None:
        result["sglang_step"] = {"skipped": step[1]}
    cells = [(overlap, churn) for overlap in overlaps for churn in churns]
    for S in tokens:
        for B in batches:
            result["cells"] += run_pair(args, peers, S, B, sizes, cells, step)
            save(args, result)
    for cell in result["cells"]:
        cell["correct"] = not any(cell["wrong_rows"].values())
