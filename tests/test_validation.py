"""Every public error path of HiSparseCache: the right error, a message that names the value
seen, and the whole engine state unchanged after it (tests/test_reliability_state.py lists
what "whole" covers). The table below is the coverage list: one row per bad call.

A world holds a request in every state (running long and short, prefilling, reserved,
preempted, finished); a setup adds what a row needs (an open step, full slots, a full pool,
a request at max_seq_len, a closed cache). After a rejected call the cache must still decode
byte-exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import hisparse
from hisparse.errors import (
    InvalidInputError,
    PoolExhaustedError,
    RequestStateError,
    UnknownRequestError,
)
from test_reliability_state import assert_same_state, full_snapshot, row_pattern

LAYERS, WIDTH, TOP_K, HOT, EXTENT, GROUP = 4, 32, 4, 8, 4, 2
MAX_SEQ, POOL_EXTENTS = 40, 48
UIDS = {"long": 1, "short": 2, "pre": 3, "res": 4, "parked": 5, "gone": 6, "extra": 7,
        "max": 8, "hog0": 9, "hog1": 10, "hog2": 11, "hog3": 12}


@dataclass
class World:
    cache: hisparse.HiSparseCache
    generator: torch.Generator

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def rows(self, name: str, layer: int, start: int, stop: int) -> torch.Tensor:
        return row_pattern(UIDS[name], layer, torch.arange(start, stop), WIDTH)

    def prompt(self, name: str, tokens: int) -> torch.Tensor:
        return torch.stack([self.rows(name, layer, 0, tokens) for layer in range(LAYERS)])

    def admit(self, name: str, tokens: int, commit: bool = True) -> None:
        self.cache.admit(name, tokens)
        self.cache.write_prefill(name, self.prompt(name, tokens).to(self.device))
        if commit:
            self.cache.commit_prefill(name)

    def newest(self, names: list[str], layer: int) -> torch.Tensor:
        rows = [self.rows(n, layer, self.cache.seq_len(n) - 1, self.cache.seq_len(n))
                for n in names]
        return torch.cat(rows).to(self.device)

    def top_k(self, *rows: list[int], columns: int = TOP_K) -> torch.Tensor:
        padded = [r + [-1] * (columns - len(r)) for r in rows]
        return torch.tensor(padded, dtype=torch.int32, device=self.device)

    def noise(self, *shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        data = torch.randint(0, 256, shape, dtype=torch.uint8, generator=self.generator)
        return data.to(self.device).view(dtype) if dtype != torch.uint8 else data.to(self.device)


def build_world(backend: Any, generator: torch.Generator) -> World:
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=LAYERS, row_bytes=WIDTH, top_k=TOP_K, hot_slots=HOT,
        index_group_size=GROUP, extent_tokens=EXTENT, max_requests=4, max_batch=3,
        host_pool_tokens=POOL_EXTENTS * EXTENT, max_seq_len=MAX_SEQ, validate=True,
    )
    world = World(hisparse.HiSparseCache(config, device=backend), generator)
    world.admit("long", 20)  # 5 full extents: its next token needs a new one
    world.admit("short", 5)
    world.cache.admit("pre", 6)
    world.cache.write_prefill("pre", world.prompt("pre", 3)[0].to(world.device), layer=0)
    world.cache.reserve_host_slots("res", 7)
    world.admit("parked", 10)
    world.cache.preempt("parked")
    world.admit("gone", 3)
    world.cache.finish("gone")
    return world


def open_step(world: World, write: bool = True, anchor: bool = True) -> None:
    cache = world.cache
    cache.begin_decode_step(["long", "short"])
    for layer in range(LAYERS if write else 0):
        cache.write_newest(layer, world.newest(["long", "short"], layer))
    if anchor:
        cache.swap_in(0, world.top_k([0, 5, 20], [1, 5]))


def fill_pool(world: World) -> None:
    for index in range(3):
        world.cache.reserve_host_slots(f"hog{index}", MAX_SEQ)
    free = world.cache._pool.allocator.free_extents
    world.cache.reserve_host_slots("hog3", free * EXTENT)


def take_aliases(world: World) -> None:
    """Reservations on all 20 tokens of "long" (5 whole extents: no own extent, no slot) until
    fewer than 5 of the cache's alias key extents are left."""
    index = 0
    while world.cache._prefixes.aliases.free >= 5:
        world.cache.reserve_host_slots(f"alias{index}", 20, prefix=("long", 20))
        index += 1


SETUPS: dict[str, Callable[[World], None]] = {
    "idle": lambda w: None,
    "in_step": open_step,
    "step_unwritten": lambda w: open_step(w, write=False, anchor=False),
    "full_slots": lambda w: w.admit("extra", 3),
    "full_pool": fill_pool,
    "at_limit": lambda w: w.admit("max", MAX_SEQ),
    "closed": lambda w: w.cache.close(),
    "aliases_taken": take_aliases,
}


@dataclass(frozen=True)
class BadCall:
    setup: str
    error: type[Exception]
    match: str  # a regex the message must contain: the value seen or the state found
    call: Callable[[hisparse.HiSparseCache, World], object]


M = "meta"  # a device no cache lives on
BAD_CALLS: dict[str, BadCall] = {
    # admission
    "admit an unhashable id": BadCall("idle", InvalidInputError, r"\['x'\] is not hashable",
                                      lambda c, w: c.admit(["x"], 3)),
    "admit a None id": BadCall("idle", InvalidInputError, "request id None",
                               lambda c, w: c.admit(None, 3)),
    "admit a tensor id": BadCall("idle", InvalidInputError, "Tensor.*by identity",
                                 lambda c, w: c.admit(torch.tensor(3), 3)),
    "admit numpy int64 tokens": BadCall("idle", InvalidInputError, "numpy.int64.*int\\(",
                                        lambda c, w: c.admit("x", np.int64(3))),
    "admit a 0-d tensor of tokens": BadCall("idle", InvalidInputError, "Tensor.*int\\(",
                                            lambda c, w: c.admit("x", torch.tensor(3))),
    "reserve numpy int32 tokens": BadCall("idle", InvalidInputError, "numpy.int32",
                                          lambda c, w: c.reserve_host_slots("x", np.int32(3))),
    "admit a live id": BadCall("idle", RequestStateError, "'long'.*already running",
                               lambda c, w: c.admit("long", 3)),
    "admit 0 tokens": BadCall("idle", InvalidInputError, "of 0 tokens",
                              lambda c, w: c.admit("x", 0)),
    "admit True tokens": BadCall("idle", InvalidInputError, "of True tokens",
                                 lambda c, w: c.admit("x", True)),
    "admit 3.0 tokens": BadCall("idle", InvalidInputError, "of 3.0 tokens",
                                lambda c, w: c.admit("x", 3.0)),
    "admit past max_seq_len": BadCall("idle", InvalidInputError, "41 tokens.*1..40",
                                      lambda c, w: c.admit("x", MAX_SEQ + 1)),
    "admit with no slot": BadCall("full_slots", PoolExhaustedError, "all 4 are in use",
                                  lambda c, w: c.admit("x", 1)),
    "admit with no extents": BadCall("full_pool", PoolExhaustedError, "asked for 2 extents",
                                     lambda c, w: c.admit("x", 5)),
    "reserve a live id": BadCall("idle", RequestStateError, "'res'.*already reserved",
                                 lambda c, w: c.reserve_host_slots("res", 3)),
    "reserve -1 tokens": BadCall("idle", InvalidInputError, "of -1 tokens",
                                 lambda c, w: c.reserve_host_slots("x", -1)),
    "reserve with no extents": BadCall("full_pool", PoolExhaustedError, "0 of 48 are free",
                                       lambda c, w: c.reserve_host_slots("x", 1)),
    # prefill
    "prefill an unknown id": BadCall("idle", UnknownRequestError, "'nobody'",
                                     lambda c, w: c.write_prefill("nobody", w.noise(4, 1, 32))),
    "prefill a finished id": BadCall("idle", RequestStateError, "'gone'.*already finished",
                                     lambda c, w: c.write_prefill("gone", w.noise(4, 1, 32))),
    "prefill a running request": BadCall("idle", RequestStateError, "it is running",
                                         lambda c, w: c.write_prefill("long", w.noise(4, 1, 32))),
    "prefill a preempted request": BadCall(
        "idle", RequestStateError, "it is preempted",
        lambda c, w: c.write_prefill("parked", w.noise(4, 1, 32))),
    "prefill a list": BadCall("idle", InvalidInputError, "got list",
                              lambda c, w: c.write_prefill("pre", [[0] * 32])),
    "prefill [T, W] without a layer": BadCall(
        "idle", InvalidInputError, r"3 dimensions, got shape \(2, 32\)",
        lambda c, w: c.write_prefill("pre", w.noise(2, 32))),
    "prefill rows 33 bytes wide": BadCall("idle", InvalidInputError, "33 bytes",
                                          lambda c, w: c.write_prefill("pre", w.noise(4, 2, 33))),
    "prefill from start '0'": BadCall(
        "idle", InvalidInputError, "start must be a plain int >= 0.*got '0'",
        lambda c, w: c.write_prefill("pre", w.noise(2, 32), layer=0, start="0")),
    "prefill from start None": BadCall(
        "idle", InvalidInputError, "start must be a plain int >= 0.*got None",
        lambda c, w: c.write_prefill("pre", w.noise(2, 32), layer=0, start=None)),
    "prefill sparse rows": BadCall(
        "idle", InvalidInputError, "dense .strided. tensor, got a sparse_coo one",
        lambda c, w: c.write_prefill("pre", w.noise(2, 32).to_sparse(), layer=0)),
    "prefill nested rows": BadCall(
        "idle", InvalidInputError, "dense .strided. tensor, got a nested one",
        lambda c, w: c.write_prefill("pre", torch.nested.nested_tensor(
            [w.noise(1, 32), w.noise(1, 32)]), layer=0)),
    "prefill 3 layers": BadCall("idle", InvalidInputError, "holds 3 layers",
                                lambda c, w: c.write_prefill("pre", w.noise(3, 2, 32))),
    "prefill layer 4": BadCall("idle", InvalidInputError, "got 4",
                               lambda c, w: c.write_prefill("pre", w.noise(2, 32), layer=4)),
    "prefill layer -1": BadCall("idle", InvalidInputError, "got -1",
                                lambda c, w: c.write_prefill("pre", w.noise(2, 32), layer=-1)),
    "prefill layer True": BadCall("idle", InvalidInputError, "got True",
                                  lambda c, w: c.write_prefill("pre", w.noise(2, 32), layer=True)),
    "prefill on another device": BadCall(
        "idle", InvalidInputError, "kv is on meta",
        lambda c, w: c.write_prefill("pre", torch.empty(4, 2, 32, dtype=torch.uint8, device=M))),
    "prefill strided bf16 rows": BadCall(
        "idle", InvalidInputError, "stride 2",
        lambda c, w: c.write_prefill("pre", w.noise(4, 2, 64, dtype=torch.bfloat16)[..., ::2])),
    "prefill past the admitted length": BadCall(
        "idle", InvalidInputError, r"rows 4..6 .* 6 tokens",
        lambda c, w: c.write_prefill("pre", w.noise(3, 32), layer=0, start=4)),
    "prefill at start -1": BadCall(
        "idle", InvalidInputError, "start must be a plain int >= 0.*got -1",
        lambda c, w: c.write_prefill("pre", w.noise(2, 32), layer=0, start=-1)),
    "commit a reserved request": BadCall("idle", RequestStateError, "it is reserved",
                                         lambda c, w: c.commit_prefill("res")),
    "commit twice": BadCall("idle", RequestStateError, "'long': it is running, not prefilling;",
                            lambda c, w: c.commit_prefill("long")),
    "commit with rows never written": BadCall(
        "idle", InvalidInputError, "rows 3..5 of layer 0 of request 'pre'",
        lambda c, w: c.commit_prefill("pre")),
    "commit an unknown id": BadCall("idle", UnknownRequestError, "'nobody'",
                                    lambda c, w: c.commit_prefill("nobody")),
    "complete a prefilling request": BadCall("idle", RequestStateError, "it is prefilling",
                                             lambda c, w: c.complete_transfer("pre")),
    "complete with no slot": BadCall("full_slots", PoolExhaustedError, "transfer of request 'res'",
                                     lambda c, w: c.complete_transfer("res")),
    # the plan of a step
    "plan a batch of 0": BadCall("idle", InvalidInputError, "batch_size.*got 0",
                                 lambda c, w: c.step_plan(0)),
    "plan a batch over max_batch": BadCall("idle", InvalidInputError, "1..3.*got 4",
                                           lambda c, w: c.step_plan(4)),
    "plan 2 tokens without draft slots": BadCall("idle", InvalidInputError,
                                                 "num_tokens.*got 2",
                                                 lambda c, w: c.step_plan(1, 2)),
    # opening a step
    "begin with a str": BadCall("idle", InvalidInputError, "got str 'long'",
                                lambda c, w: c.begin_decode_step("long")),
    "begin with None": BadCall("idle", InvalidInputError, "got NoneType",
                               lambda c, w: c.begin_decode_step(None)),
    "begin with a set": BadCall("idle", InvalidInputError, "got set",
                                lambda c, w: c.begin_decode_step({"long"})),
    "begin an empty batch": BadCall("idle", InvalidInputError, "got 0",
                                    lambda c, w: c.begin_decode_step([])),
    "begin over max_batch": BadCall(
        "idle", InvalidInputError, "1..3 requests.*got 4",
        lambda c, w: c.begin_decode_step(["long", "short", "pre", "res"])),
    "begin an unknown id": BadCall("idle", UnknownRequestError, "'ghost'",
                                   lambda c, w: c.begin_decode_step(["long", "ghost"])),
    "begin a finished id": BadCall("idle", RequestStateError, "already finished",
                                   lambda c, w: c.begin_decode_step(["gone"])),
    "begin a prefilling request": BadCall("idle", RequestStateError, "it is prefilling",
                                          lambda c, w: c.begin_decode_step(["pre"])),
    "begin a reserved request": BadCall("idle", RequestStateError, "it is reserved",
                                        lambda c, w: c.begin_decode_step(["short", "res"])),
    "begin a preempted request": BadCall("idle", RequestStateError, "it is preempted",
                                         lambda c, w: c.begin_decode_step(["parked"])),
    "begin a repeated id": BadCall("idle", InvalidInputError, r"\['long', 'long'\]",
                                   lambda c, w: c.begin_decode_step(["long", "long"])),
    "begin at max_seq_len": BadCall("at_limit", InvalidInputError, r"\['max'\].*max_seq_len=40",
                                    lambda c, w: c.begin_decode_step(["short", "max"])),
    "begin with no extent to grow": BadCall("full_pool", PoolExhaustedError, "asked for 1 ext",
                                            lambda c, w: c.begin_decode_step(["long"])),
    "begin twice": BadCall("in_step", RequestStateError, "already open",
                           lambda c, w: c.begin_decode_step(["parked"])),
    # ragged appends (0 or 1 rows a request)
    "begin appending 2 rows": BadCall(
        "idle", InvalidInputError, r"appends\[0\] = 2",
        lambda c, w: c.begin_decode_step(["long", "short"], appends=[2, 0])),
    "begin appending True": BadCall(
        "idle", InvalidInputError, r"appends\[1\] = True",
        lambda c, w: c.begin_decode_step(["long", "short"], appends=[0, True])),
    "begin appends for 1 of 2": BadCall(
        "idle", InvalidInputError, "appends has 1 entries for a batch of 2",
        lambda c, w: c.begin_decode_step(["long", "short"], appends=[1])),
    "begin appends a float tensor": BadCall(
        "idle", InvalidInputError, "1-D integer tensor, got torch.float32",
        lambda c, w: c.begin_decode_step(["long", "short"], appends=torch.ones(2))),
    "begin appends a set": BadCall(
        "idle", InvalidInputError, "appends must be a list, tuple or 1-D int tensor, got set",
        lambda c, w: c.begin_decode_step(["long", "short"], appends={0, 1})),
    "begin appends with dedupe": BadCall(
        "idle", InvalidInputError, "appends is for single-token steps.*dedupe=True",
        lambda c, w: c.begin_decode_step(["long", "short"], dedupe=True, appends=[1, 0])),
    "plan appends 'some'": BadCall("idle", InvalidInputError, "'every' or 'ragged', got 'some'",
                                   lambda c, w: c.step_plan(1, appends="some")),
    # out of order
    "write_newest outside a step": BadCall("idle", RequestStateError, "write_newest needs",
                                           lambda c, w: c.write_newest(0, w.noise(2, 32))),
    "swap_in outside a step": BadCall("idle", RequestStateError, "swap_in needs",
                                      lambda c, w: c.swap_in(0, w.top_k([0], [1]))),
    "end outside a step": BadCall("idle", RequestStateError, "end_decode_step needs",
                                  lambda c, w: c.end_decode_step()),
    "cancel outside a step": BadCall("idle", RequestStateError, "cancel_decode_step needs",
                                     lambda c, w: c.cancel_decode_step()),
    "end with unwritten layers": BadCall("step_unwritten", RequestStateError,
                                         r"layers \[0, 1, 2, 3\] got no write_newest",
                                         lambda c, w: c.end_decode_step()),
    # write_newest
    "write_newest layer 4": BadCall("in_step", InvalidInputError, "got 4",
                                    lambda c, w: c.write_newest(4, w.noise(2, 32))),
    "write_newest a list": BadCall("in_step", InvalidInputError, "got list",
                                   lambda c, w: c.write_newest(0, [[0] * 32] * 2)),
    "write_newest 1-D": BadCall("in_step", InvalidInputError, r"got shape \(64,\)",
                                lambda c, w: c.write_newest(0, w.noise(64))),
    "write_newest 31-byte rows": BadCall("in_step", InvalidInputError, "31 bytes",
                                         lambda c, w: c.write_newest(0, w.noise(2, 31))),
    "write_newest on another device": BadCall(
        "in_step", InvalidInputError, "got meta",
        lambda c, w: c.write_newest(0, torch.empty(2, 32, dtype=torch.uint8, device=M))),
    "write_newest 1 row for 2 requests": BadCall("in_step", InvalidInputError, "has 1 rows",
                                                 lambda c, w: c.write_newest(0, w.noise(1, 32))),
    "write_newest 4 rows, capacity 3": BadCall("in_step", InvalidInputError, "has 4 rows",
                                               lambda c, w: c.write_newest(0, w.noise(4, 32))),
    # swap_in
    "swap_in layer 4": BadCall("in_step", InvalidInputError, "got 4",
                               lambda c, w: c.swap_in(4, w.top_k([0], [1]))),
    "swap_in a list": BadCall("in_step", InvalidInputError, "got list",
                              lambda c, w: c.swap_in(0, [[0, 1, 2, 3]] * 2)),
    "swap_in int64 top_k": BadCall("in_step", InvalidInputError, "got torch.int64",
                                   lambda c, w: c.swap_in(0, w.top_k([0], [1]).long())),
    "swap_in top_k on another device": BadCall(
        "in_step", InvalidInputError, "got meta",
        lambda c, w: c.swap_in(0, torch.empty(2, 4, dtype=torch.int32, device=M))),
    "swap_in 1-D top_k": BadCall("in_step", InvalidInputError, r"got shape \(8,\)",
                                 lambda c, w: c.swap_in(0, w.top_k([0], [1]).flatten())),
    "swap_in non-contiguous top_k": BadCall(
        "in_step", InvalidInputError, "contiguous",
        lambda c, w: c.swap_in(0, w.top_k([0, 1], [1, 2], columns=8)[:, ::2])),
    "swap_in 1 row for 2 requests": BadCall("in_step", InvalidInputError, "has 1 rows",
                                            lambda c, w: c.swap_in(0, w.top_k([0]))),
    "swap_in 4 rows, capacity 3": BadCall("in_step", InvalidInputError, "has 4 rows",
                                          lambda c, w: c.swap_in(0, w.top_k([0], [1], [2], [3]))),
    "swap_in 3 columns": BadCall("in_step", InvalidInputError, "has 3 columns.*top_k=4",
                                 lambda c, w: c.swap_in(0, w.top_k([0], [1], columns=3))),
    "swap_in position = seq_len": BadCall("in_step", InvalidInputError,
                                          r"top_k\[0, 1\] = 21 .*\[-1, 21\)",
                                          lambda c, w: c.swap_in(0, w.top_k([0, 21], [1]))),
    "swap_in position -2": BadCall("in_step", InvalidInputError, r"top_k\[1, 0\] = -2",
                                   lambda c, w: c.swap_in(0, w.top_k([0], [-2]))),
    "swap_in a repeated position": BadCall("in_step", InvalidInputError, "position 3 more than",
                                           lambda c, w: c.swap_in(0, w.top_k([3, 1, 3], [1]))),
    "swap_in a follower first": BadCall("in_step", RequestStateError, "anchor layer 2",
                                        lambda c, w: c.swap_in(3, w.top_k([0], [1]))),
    "swap_in a follower off its anchor": BadCall(
        "in_step", InvalidInputError, "differs from what its anchor layer 0",
        lambda c, w: c.swap_in(1, w.top_k([0, 5, 19], [1, 5]))),
    # lifecycle
    "preempt during its step": BadCall("in_step", RequestStateError, "during the decode step",
                                       lambda c, w: c.preempt("long")),
    "finish during its step": BadCall("in_step", RequestStateError, "during the decode step",
                                      lambda c, w: c.finish("short")),
    "abort during its step": BadCall("in_step", RequestStateError, "during the decode step",
                                     lambda c, w: c.abort("long")),
    "preempt a prefilling request": BadCall("idle", RequestStateError, "it is prefilling",
                                            lambda c, w: c.preempt("pre")),
    "preempt twice": BadCall("idle", RequestStateError, "it is preempted",
                             lambda c, w: c.preempt("parked")),
    "resume a running request": BadCall("idle", RequestStateError, "it is running",
                                         lambda c, w: c.resume("long")),
    "resume with no slot": BadCall("full_slots", PoolExhaustedError, "resuming request 'parked'",
                                   lambda c, w: c.resume("parked")),
    "finish a reserved request": BadCall("idle", RequestStateError, "it is reserved",
                                         lambda c, w: c.finish("res")),
    "finish a prefilling request": BadCall("idle", RequestStateError, "it is prefilling",
                                           lambda c, w: c.finish("pre")),
    "finish twice (double free)": BadCall("idle", RequestStateError, "'gone'.*already finished",
                                          lambda c, w: c.finish("gone")),
    "abort after finish": BadCall("idle", RequestStateError, "already finished",
                                  lambda c, w: c.abort("gone")),
    "abort an unknown id": BadCall("idle", UnknownRequestError, "'nobody'.*admit it",
                                   lambda c, w: c.abort("nobody")),
    # accessors
    "state of a finished id (use after free)": BadCall(
        "idle", RequestStateError, "already finished", lambda c, w: c.request_state("gone")),
    "seq_len of an unknown id": BadCall("idle", UnknownRequestError, "'nobody'",
                                        lambda c, w: c.seq_len("nobody")),
    "slot of an unknown id": BadCall("idle", UnknownRequestError, "'nobody'",
                                     lambda c, w: c.request_slot("nobody")),
    "host rows of a finished id": BadCall("idle", RequestStateError, "already finished",
                                          lambda c, w: c.host_rows("gone")),
    "device_kv layer 4": BadCall("idle", InvalidInputError, "got 4",
                                 lambda c, w: c.device_kv(4)),
    # shared prefixes: a host-row map out of alias key extents refuses them (the rest:
    # tests/test_prefix_sharing.py)
    "admit on a prefix, no alias key extent free": BadCall(
        "aliases_taken", PoolExhaustedError, "alias key extent.*alias_extents=",
        lambda c, w: c.admit("x", 20, prefix=("long", 20))),
    "reserve on a prefix, no alias key extent free": BadCall(
        "aliases_taken", PoolExhaustedError, "alias key extent.*alias_extents=",
        lambda c, w: c.reserve_host_slots("x", 20, prefix=("long", 20))),
    "release a non-handle": BadCall("idle", InvalidInputError, "'long' is a str",
                                    lambda c, w: c.release_prefix("long")),
}

CLOSED_CALLS: dict[str, Callable[[hisparse.HiSparseCache, World], object]] = {
    "admit": lambda c, w: c.admit("x", 3),
    "reserve_host_slots": lambda c, w: c.reserve_host_slots("x", 3),
    "write_prefill": lambda c, w: c.write_prefill("pre", w.noise(4, 1, 32)),
    "commit_prefill": lambda c, w: c.commit_prefill("pre"),
    "complete_transfer": lambda c, w: c.complete_transfer("res"),
    "begin_decode_step": lambda c, w: c.begin_decode_step(["long"]),
    "write_newest": lambda c, w: c.write_newest(0, w.noise(1, 32)),
    "swap_in": lambda c, w: c.swap_in(0, w.top_k([0])),
    "end_decode_step": lambda c, w: c.end_decode_step(),
    "cancel_decode_step": lambda c, w: c.cancel_decode_step(),
    "device_kv": lambda c, w: c.device_kv(0),
    "host_tensors": lambda c, w: c.host_tensors(),
    "preempt": lambda c, w: c.preempt("long"),
    "resume": lambda c, w: c.resume("parked"),
    "finish": lambda c, w: c.finish("long"),
    "abort": lambda c, w: c.abort("res"),
    "stats": lambda c, w: c.stats(),
    "retain_prefix": lambda c, w: c.retain_prefix("long", 3),
    "release_prefix": lambda c, w: c.release_prefix(None),
}
for _name, _call in CLOSED_CALLS.items():
    BAD_CALLS[f"{_name} after close"] = BadCall("closed", RequestStateError, "is closed", _call)


@pytest.mark.parametrize("name", BAD_CALLS)
def test_a_bad_call_raises_and_changes_nothing(name: str, backend: Any,
                                               rng: torch.Generator) -> None:
    bad = BAD_CALLS[name]
    world = build_world(backend, rng)
    SETUPS[bad.setup](world)
    before = full_snapshot(world.cache)
    with pytest.raises(bad.error, match=bad.match):
        bad.call(world.cache, world)
    assert_same_state(before, full_snapshot(world.cache))
    if bad.setup != "closed":
        decode_and_verify(world)
        world.cache.close()


def decode_and_verify(world: World) -> None:
    """One full decode step after the rejected call; every returned row holds its bytes."""
    cache = world.cache
    if cache._step is None:
        full = cache._pool.allocator.free_extents == 0
        batch = ["short"] if full else ["long", "short"]  # "long" needs an extent to grow
        cache.begin_decode_step(batch)
    batch = list(cache._step.request_ids)
    for layer in sorted(set(range(LAYERS)) - cache._step._written):
        cache.write_newest(layer, world.newest(batch, layer))
    lengths = [cache.seq_len(n) for n in batch]
    chosen = [torch.randperm(n, generator=world.generator)[:TOP_K].tolist() for n in lengths]
    top_k = world.top_k(*chosen)
    for layer in range(LAYERS):
        rows = cache.swap_in(layer, top_k)
        device_kv = cache.device_kv(layer)
        for b, name in enumerate(batch):
            positions = top_k[b].cpu()
            got = device_kv[rows[b].long()].cpu()
            assert torch.equal(got, row_pattern(UIDS[name], layer, positions, WIDTH)), name
    cache.end_decode_step()


def test_the_table_covers_every_public_call() -> None:
    """Each public method of HiSparseCache has at least one bad call in the table."""
    public = {name for name in dir(hisparse.HiSparseCache)
              if not name.startswith("_") and callable(getattr(hisparse.HiSparseCache, name))}
    no_bad_input = {"close"}  # idempotent; takes nothing
    source = "\n".join(
        f"{name} {call.call.__code__.co_names}" for name, call in BAD_CALLS.items()
    )
    missing = sorted(n for n in public - no_bad_input if n not in source)
    assert not missing, f"no bad call for {missing}"


ADVICE = ("first", "call", "use", "pass", "raise", "finish", "admit", "move", "convert",
          "wrap", "list", "split", "create", "pad", "set")


def says_what_to_do(message: str) -> bool:
    """The message ends in advice: its last clause names something to do."""
    tail = message.rsplit(";", 1)[-1] if ";" in message else message.rsplit(":", 1)[-1]
    return any(word in tail.lower() for word in ADVICE)


def test_every_message_says_what_to_do(backend: Any, rng: torch.Generator) -> None:
    """Message shape: what was wrong, the value seen (the row's regex), then what to do."""
    vague = []
    for name, bad in BAD_CALLS.items():
        world = build_world(backend, rng)
        SETUPS[bad.setup](world)
        with pytest.raises(bad.error) as caught:
            bad.call(world.cache, world)
        message = str(caught.value)
        if not says_what_to_do(message):
            vague.append(f"{name}: {message}")
        world.cache.close()
    assert not vague, "\n".join(vague)


def test_state_errors_read_as_sentences_and_their_advice_works(backend: Any,
                                                               rng: torch.Generator) -> None:
    """A second commit_prefill (or write_prefill after the commit) says which state the call
    needs in plain words; a finished id's error advises re-admitting it, and re-admitting
    the very same id works (it used to say "under a new id")."""
    world = build_world(backend, rng)
    cache = world.cache
    with pytest.raises(RequestStateError) as caught:
        cache.commit_prefill("long")
    assert str(caught.value) == (
        "cannot commit prefill for request 'long': it is running, not prefilling; a running "
        "request decodes: call preempt(id) to park it or finish(id) to free it")
    with pytest.raises(RequestStateError) as caught:
        cache.write_prefill("long", world.noise(LAYERS, 1, WIDTH))
    assert "it is running, not prefilling or reserved;" in str(caught.value)
    for call in (lambda: cache.finish("gone"), lambda: cache.seq_len("gone")):
        with pytest.raises(RequestStateError) as caught:
            call()
        message = str(caught.value)
        assert "'gone'" in message and "finished" in message and "new id" not in message
        assert "admit it again" in message
    world.admit("gone", 3)  # the advice, followed: the same id starts a new request
    assert cache.seq_len("gone") == 3
    cache.close()
