"""Helper processes for tests/test_pd_nixl.py: a prefill node and a decode node on loopback.

Each worker runs in a spawned process and takes commands from a pipe. Both sides derive
the KV bytes from a shared seed, so the data itself never crosses the pipe: what the decode
side finds in its host pool can only have come through NIXL.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

# A worker whose parent vanished (killed test run) exits after this long without a command.
IDLE_EXIT_S = 60.0

# The decode cache of the PD tests. Small on purpose: 16-token extents so requests span several
# extents and runs split.
SMALL_CACHE: dict[str, Any] = dict(
    num_layers=3,
    row_bytes=48,
    top_k=4,
    hot_slots=8,
    max_requests=4,
    max_seq_len=256,
    host_pool_tokens=512,
    extent_tokens=16,
    index_group_size=2,
    validate=True,
)


def expected_kv(seed: int, num_layers: int, num_tokens: int, row_bytes: int) -> torch.Tensor:
    """The KV rows a request with this seed carries: uint8 `[L, T, W]`."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, 256, (num_layers, num_tokens, row_bytes), dtype=torch.uint8, generator=generator
    )


def scattered_source_rows(seed: int, num_tokens: int, pool_rows: int) -> np.ndarray:
    """Distinct rows of the prefill pool for each token: shuffled blocks of 1..7 consecutive rows,
    so the writer must split the decode side's runs wherever the source jumps."""
    rng = np.random.default_rng(seed + 1)
    blocks, start = [], 0
    while start < pool_rows:
        length = int(rng.integers(1, 8))
        blocks.append(np.arange(start, min(start + length, pool_rows)))
        start += length
    order = rng.permutation(len(blocks))
    return np.concatenate([blocks[i] for i in order])[:num_tokens]


def _reply(conn: Connection, fn: Any, *args: Any) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except Exception as exc:  # the test asserts on the type name and message
        conn.send(("error", type(exc).__name__, str(exc)))


def prefill_worker(
    conn: Connection, agent_name: str, num_layers: int, row_bytes: int, pool_rows: int
) -> None:
    """Prefill node: its own paged KV pool, registered once; writes tickets on command.

    Commands: ("connect", metadata) -> agent name; ("write", ticket_bytes, seed) -> None
    after the write completed; ("exit",).
    """
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from hisparse.pd import NixlPrefillSender

    sender = NixlPrefillSender(agent_name)
    pool = torch.empty(num_layers, pool_rows, row_bytes, dtype=torch.uint8)
    sender.register([pool])

    def write(ticket_bytes: bytes, seed: int) -> None:
        from hisparse.pd import TransferTicket

        ticket = TransferTicket.from_bytes(ticket_bytes)
        # Garbage everywhere, the request's rows only where source_rows says.
        pool.random_(0, 256, generator=torch.Generator().manual_seed(seed + 2))
        rows = scattered_source_rows(seed, ticket.num_tokens, pool_rows)
        pool[:, torch.from_numpy(rows)] = expected_kv(
            seed, num_layers, ticket.num_tokens, row_bytes
        )
        sender.write(ticket, list(pool), rows).wait(timeout_s=20.0)

    while conn.poll(IDLE_EXIT_S):
        command, *args = conn.recv()
        if command == "exit":
            break
        _reply(conn, {"connect": sender.connect, "write": write}[command], *args)
    sender.close()


def decode_worker(
    conn: Connection, agent_name: str, config_overrides: dict[str, Any], num_tokens: int
) -> None:
    """Decode node that prepares one request, hands out metadata + ticket, then exits on command:
    the prefill side then writes to an agent that is gone."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from hisparse.pd import NixlDecodeEndpoint

    cache = make_cache(**config_overrides)
    endpoint = NixlDecodeEndpoint(cache, agent_name)
    ticket = endpoint.prepare_request("gone", num_tokens)
    conn.send((endpoint.publish(), ticket.to_bytes()))
    conn.poll(IDLE_EXIT_S)
    # Exit without close(): a crashed decode node does not say goodbye either.
    os._exit(0)


def make_cache(**overrides: Any) -> Any:
    """A small decode-side cache on the CPU backend."""
    from hisparse import HiSparseCache, HiSparseConfig

    config = HiSparseConfig.from_preset("tiny", **overrides)
    return HiSparseCache(config, device="cpu")
