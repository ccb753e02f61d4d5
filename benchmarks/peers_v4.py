"""SW-1 at DeepSeek-V4's shape (issue 40): hisparse's swap-in of 584-byte compressed-sparse-
attention entries beside SGLang 0.5.23's V4 kernel, `load_cache_to_device_buffer_dsv4_mla`.

The shape: one CSA layer, every request at 16,384 entries (64k tokens at rate 4), top-k 512
(V4-Flash), hot buffers of 1024 and 2048 entries, B x churn x host layout as SW-1.

The entry layouts differ, and each kernel gets its own:
  * hisparse stores an entry as one 584-byte row (576 B of fp8 and bf16 values, then its
    8 B of scales; docs/deepseek-v4.md says why), on the host and on the device;
  * SGLang stores 64-entry pages of 37,440 B, on the host and on the device: the 64 values
    (64 x 576 B), then the 64 scales (64 x 8 B), padded to a multiple of 576 B. Its pool here
    is the same entries repacked that way (`paged`), and its returned rows are read back
    through the same page arithmetic (`unpaged_rows`) for the byte check.
With `--padded-entries` hisparse also runs over the same entries padded to 592-byte rows (a
16-byte multiple: its copy then moves 16-byte vectors instead of 8-byte ones), in the same
cells, to measure what the row width costs where SGLang's kernel is faster.
SGLang's kernel is called as its coordinator calls it for V4: `page_size=1`, `block_size=960`,
`item_size_bytes=584`, the persistent `num_real_reqs`, no miss plan. vLLM 0.34 does not run
V4 ("HiSparse does not support DeepSeek V4"), so it has no column here.

    PYTHONPATH=src python benchmarks/peers.py --table sw1-v4 --out results/peers-sw1-v4.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch

import sglang_ops
from hisparse.tools import benchmarking
from hisparse.tools.sw1_steps import LauncherSwapIn

PAGE_ENTRIES = 64
VALUE_BYTES = 576
SCALE_BYTES = 8
ENTRY_BYTES = VALUE_BYTES + SCALE_BYTES
PADDED_ENTRY_BYTES = -(-ENTRY_BYTES // 16) * 16  # 592
# FlashMLA reads a page's values as one aligned block: pages are padded to a multiple of 576 B.
PAGE_BYTES = -(-ENTRY_BYTES * PAGE_ENTRIES // VALUE_BYTES) * VALUE_BYTES
SCALES_AT = VALUE_BYTES * PAGE_ENTRIES
GRID = {"batches": (1, 16, 64, 128), "churns": (0.0, 0.05, 0.2, 1.0), "hots": (1024, 2048)}
QUICK = {"batches": (1, 4), "churns": (0.0, 0.2), "hots": (1024,)}


def sizes_for(hot: int, quick: bool = False, row_bytes: int = ENTRY_BYTES
              ) -> benchmarking.SW1Sizes:
    return benchmarking.SW1Sizes(seq_len=8192 if quick else 16384, top_k=512, hot_slots=hot,
                                 row_bytes=row_bytes, extent_tokens=512)


def padded_pool(pool: Any, backend: Any, row_bytes: int = PADDED_ENTRY_BYTES) -> Any:
    """`pool`'s entries as `row_bytes`-byte rows (zero padding after each entry's 584
    bytes) in registered host memory, with the mirror to check them against."""
    import peers as harness

    mirror = torch.nn.functional.pad(pool.mirror, (0, row_bytes - pool.mirror.shape[1]))
    full = backend.alloc_host(mirror.numel()).view(mirror.shape)
    full.copy_(mirror)
    return harness.Pool(full, full, mirror)


def paged(rows: torch.Tensor) -> torch.Tensor:
    """[N, 584] uint8 entries as SGLang's V4 pages: flat uint8, ceil(N / 64) x 37,440 bytes."""
    count = rows.shape[0]
    pages = -(-count // PAGE_ENTRIES)
    padded = torch.zeros(pages * PAGE_ENTRIES, ENTRY_BYTES, dtype=torch.uint8, device=rows.device)
    padded[:count] = rows
    padded = padded.view(pages, PAGE_ENTRIES, ENTRY_BYTES)
    page = torch.zeros(pages, PAGE_BYTES, dtype=torch.uint8, device=rows.device)
    page[:, :SCALES_AT] = padded[:, :, :VALUE_BYTES].reshape(pages, SCALES_AT)
    page[:, SCALES_AT: SCALES_AT + PAGE_ENTRIES * SCALE_BYTES] = \
        padded[:, :, VALUE_BYTES:].reshape(pages, -1)
    return page.view(-1)


def unpaged_rows(buffer: torch.Tensor, locs: torch.Tensor) -> torch.Tensor:
    """The 584-byte entries at entry indices `locs` (any shape) of a paged buffer."""
    flat = locs.reshape(-1).long()
    base = (flat // PAGE_ENTRIES) * PAGE_BYTES
    within = flat % PAGE_ENTRIES
    values = base[:, None] + within[:, None] * VALUE_BYTES + torch.arange(
        VALUE_BYTES, device=buffer.device)
    scales = base[:, None] + SCALES_AT + within[:, None] * SCALE_BYTES + torch.arange(
        SCALE_BYTES, device=buffer.device)
    rows = torch.cat([buffer[values], buffer[scales]], dim=1)
    return rows.view(*locs.shape, ENTRY_BYTES)


class SglangV4SwapIn(sglang_ops.SglangSwapIn):
    """SGLang's V4 entry point behind hisparse's swap-in call signature, as its single-step
    one (`sglang_ops.SglangSwapIn`: the same entries in the same slots and LRU order as
    hisparse's), over its own layout: the host pool repacked by `paged` into `host_pages`,
    the hot buffers repacked the same way. `device_rows` reads what it returned."""

    def __init__(self, ops: Any, tables: Any, host_rows: Any, host_pages: torch.Tensor,
                 block_size: int = sglang_ops.COORDINATOR_BLOCK_SIZE) -> None:
        super().__init__(ops, tables, host_rows, 0, block_size)
        self.entry = ops.load_cache_to_device_buffer_dsv4_mla
        repacked = paged(tables.host_kv[0].to(tables.device_kv.device))  # on the device
        self.host_cache = host_pages[: repacked.numel()].copy_(repacked)
        self.device_buffer = paged(tables.device_kv[0])

    def device_rows(self, locs: torch.Tensor) -> torch.Tensor:
        return unpaged_rows(self.device_buffer, locs)


def run_sw1_v4(args: argparse.Namespace, peers: Any, result: dict[str, Any],
               save: Callable[[argparse.Namespace, dict[str, Any]], None]) -> None:
    """Every cell of the V4 grid, hisparse and SGLang's V4 kernel alternating first, each
    byte-checked on every step (peers.sw1_cell)."""
    import peers as harness
    from hisparse.backends.registry import get_backend

    grid = QUICK if args.quick else GRID
    batches, churns = args.batches or grid["batches"], args.churns or grid["churns"]
    hots = args.hots or grid["hots"]
    backend = get_backend("cuda")
    link = max(c.bytes_per_second for c in benchmarking.bulk_copies(backend, 1 << 28)
               if c.name == "bulk host-to-device")
    result.update(link_GBps=round(link / 1e9, 2), cells=[], shape={
        "entry_bytes": ENTRY_BYTES, "padded_entry_bytes": PADDED_ENTRY_BYTES
        if args.padded_entries else None, "top_k": 512, "entries_per_request":
        sizes_for(hots[0], args.quick).seq_len, "sglang_page_bytes": PAGE_BYTES})
    largest = sizes_for(max(hots), args.quick)
    pool = harness.sw1_pool(max(batches), largest, args.seed)
    host_pages = backend.alloc_host(-(-pool.rows.shape[0] // PAGE_ENTRIES) * PAGE_BYTES)

    def own(tables: Any, host_rows: Any) -> tuple[Any, Callable[[], int | None]]:
        return LauncherSwapIn(backend), lambda: int(tables.counters[0, 1])

    kinds: dict[str, Callable[..., tuple[Any, Callable[[], int | None]]]] = {"hisparse": own}
    pools = {"hisparse": pool}  # each kind's pool; its row width sets the kind's sizes
    if args.padded_entries:
        padded = f"hisparse-{PADDED_ENTRY_BYTES}"
        kinds[padded], pools[padded] = own, padded_pool(pool, backend)
    if peers.sglang is not None:
        kinds["sglang"] = lambda tables, host_rows: (
            SglangV4SwapIn(peers.sglang, tables, host_rows, host_pages,
                           args.sglang_block_size), lambda: None)
        pools["sglang"] = pool
    for hot in hots:
        for layout in args.layouts:
            for batch in batches:
                for churn in churns:
                    row: dict[str, Any] = {"hot": hot, "B": batch, "churn": churn,
                                           "layout": layout}
                    names = list(kinds) if len(result["cells"]) % 2 == 0 else list(kinds)[::-1]
                    for name in names:
                        own_pool = pools[name]
                        try:
                            row[name] = harness.sw1_cell(
                                own_pool, layout, batch, churn, args, kinds[name],
                                sizes=sizes_for(hot, args.quick, own_pool.rows.shape[1]))
                            row[name]["link_ratio"] = round(
                                row[name]["miss_GBps"] * 1e9 / link, 3)
                        except Exception as exc:  # a refused cell must not cost the rest
                            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                        torch.cuda.synchronize()
                    for name in kinds:
                        if name != "hisparse" and all("device_us" in row.get(n, {})
                                                      for n in ("hisparse", name)):
                            row[f"hisparse_vs_{name}"] = round(
                                row["hisparse"]["device_us"] / row[name]["device_us"], 3)
                    print(json.dumps(row), flush=True)
                    result["cells"].append(row)
                    save(args, result)
