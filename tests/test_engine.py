"""Engine behaviour the random traces do not pin down: errors, statistics, seeding, streams."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hisparse
from hisparse.backends.cpu import CPU_FEATURES, CpuBackend
from hisparse.backends.features import Feature, FeatureTable, supported
from hisparse.errors import InvalidInputError, RequestStateError, UnknownRequestError
from test_engine_trace import assert_unchanged, build_cache, snapshot

W = 32


def running_cache(validate: bool = True, **overrides):
    shape = {"hot": 8, "top_k": 4, "extent": 4, "group": 2} | overrides
    cache = build_cache("cpu", validate=validate, pool_extents=32, **shape)
    for request_id, length in (("a", 20), ("b", 5)):
        cache.admit(request_id, length)
        cache.write_prefill(request_id, torch.randint(0, 256, (4, length, W), dtype=torch.uint8))
        cache.commit_prefill(request_id)
    return cache


def top_k(*rows: list[int], k: int = 4) -> torch.Tensor:
    return torch.tensor([r + [-1] * (k - len(r)) for r in rows], dtype=torch.int32)


BAD_CALLS = {
    "unknown id": (UnknownRequestError, lambda c: c.finish("nobody")),
    "admit twice": (RequestStateError, lambda c: c.admit("a", 3)),
    "admit zero tokens": (InvalidInputError, lambda c: c.admit("z", 0)),
    "resume running": (RequestStateError, lambda c: c.resume("a")),
    "commit twice": (RequestStateError, lambda c: c.commit_prefill("a")),
    "prefill after commit": (
        RequestStateError, lambda c: c.write_prefill("a", torch.zeros(4, 1, W, dtype=torch.uint8))),
    "swap_in outside a step": (RequestStateError, lambda c: c.swap_in(0, top_k([0]))),
    "duplicate ids": (InvalidInputError, lambda c: c.begin_decode_step(["a", "a"])),
    "over capacity": (InvalidInputError, lambda c: c.begin_decode_step(["a", "b", "c", "d"])),
    "not running": (UnknownRequestError, lambda c: c.begin_decode_step(["a", "ghost"])),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_calls_raise_and_change_nothing(name: str) -> None:
    cache = running_cache()
    error, call = BAD_CALLS[name]
    before = snapshot(cache)
    with pytest.raises(error):
        call(cache)
    assert_unchanged(before, cache)


STEP_CALLS = {
    "int64 top_k": lambda c: c.swap_in(0, top_k([0], [1]).long()),
    "top_k too narrow": lambda c: c.swap_in(0, top_k([0], [1], k=3)),
    "fewer rows than requests": lambda c: c.swap_in(0, top_k([0])),
    "more rows than capacity": lambda c: c.swap_in(0, top_k([0], [1], [2], [3])),
    "position = seq_len": lambda c: c.swap_in(0, top_k([21], [1])),
    "position < -1": lambda c: c.swap_in(0, top_k([0], [-3])),
    "duplicate position": lambda c: c.swap_in(0, top_k([3, 3], [1])),
    "non-contiguous": lambda c: c.swap_in(0, top_k([0, 1], [1, 2]).t().contiguous().t()),
    "follower first": lambda c: c.swap_in(1, top_k([0], [1])),
    "layer out of range": lambda c: c.swap_in(4, top_k([0], [1])),
    "row width": lambda c: c.write_newest(0, torch.zeros(2, W + 1, dtype=torch.uint8)),
    "second step": lambda c: c.begin_decode_step(["a"]),
    "finish during step": lambda c: c.finish("a"),
}


@pytest.mark.parametrize("name", STEP_CALLS)
def test_bad_calls_in_a_step_raise_and_change_nothing(name: str) -> None:
    cache = running_cache()
    cache.begin_decode_step(["a", "b"])
    before = snapshot(cache)
    with pytest.raises((InvalidInputError, RequestStateError)):
        STEP_CALLS[name](cache)
    assert_unchanged(before, cache)


def test_follower_with_another_top_k_is_rejected_in_validate_mode() -> None:
    cache = running_cache()
    cache.begin_decode_step(["a", "b"])
    cache.swap_in(0, top_k([0, 1], [2]))
    with pytest.raises(InvalidInputError, match="anchor layer 0"):
        cache.swap_in(1, top_k([0, 2], [2]))


def test_follower_with_another_batch_size_is_rejected() -> None:
    cache = running_cache(validate=False)
    cache.begin_decode_step(["a", "b"])
    cache.swap_in(0, top_k([0, 1], [2]))
    before = snapshot(cache)
    with pytest.raises(InvalidInputError, match="anchor layer 0 swapped in 2"):
        cache.swap_in(1, top_k([0, 1], [2], [-1]))
    assert_unchanged(before, cache)


@pytest.mark.parametrize("padded", [2, 3])
def test_a_batch_passed_unpadded_matches_the_padded_one(padded: int) -> None:
    """swap_in runs its kernels over the rows it is given; padding rows change nothing."""
    seed = int(torch.randint(0, 1 << 31, ()))
    caches = []
    for _ in range(2):  # two caches with the same fresh prefill bytes
        torch.manual_seed(seed)
        caches.append(running_cache())
    gen = torch.Generator().manual_seed(seed)
    for step in range(6):
        picks = [torch.randperm(20, generator=gen)[:4].tolist(),
                 torch.randperm(5, generator=gen)[:2].tolist()]
        returned = []
        for cache, rows in zip(caches, (2, padded), strict=True):
            cache.begin_decode_step(["a", "b"])
            batch = top_k(*picks, *([[]] * (rows - 2)))
            for layer in range(4):
                cache.write_newest(layer, torch.full((rows, W), step, dtype=torch.uint8))
                out = cache.swap_in(layer, batch)
                assert out.shape == (rows, 4)
                assert (out[2:] == -1).all(), "padding rows return no rows"
                returned.append((out[:2].clone(), cache.device_kv(layer)[out[:2].clamp(min=0)]))
            cache.end_decode_step()
        for (rows_a, kv_a), (rows_b, kv_b) in zip(returned[:4], returned[4:], strict=True):
            assert torch.equal(rows_a, rows_b) and torch.equal(kv_a, kv_b), step
    plain, padded_run = (snapshot(cache) for cache in caches)
    for name, tensor in plain["tensors"].items():
        if name != "host_kv":  # rows no request owns hold whatever the allocation held
            assert torch.equal(tensor, padded_run["tensors"][name]), name
    for request_id in ("a", "b"):
        rows = torch.from_numpy(caches[0].host_rows(request_id))
        for layer in range(4):
            assert torch.equal(caches[0].tables.host_kv[layer][rows],
                               caches[1].tables.host_kv[layer][rows]), (request_id, layer)


def test_double_finish_and_prefill_past_the_admitted_length() -> None:
    cache = running_cache()
    cache.finish("b")
    with pytest.raises(RequestStateError, match="already finished"):
        cache.finish("b")
    cache.admit("c", 6)
    with pytest.raises(InvalidInputError, match="admitted with"):
        cache.write_prefill("c", torch.zeros(3, W, dtype=torch.uint8), layer=0, start=4)


def test_statistics_count_bytes_exactly() -> None:
    cache = running_cache(validate=False)  # H = 8: "a" (20) is long, "b" (5) short
    # Before any lookup the hit rate is 0, not a perfect 1.
    assert [layer.hit_rate for layer in cache.stats().layers] == [0.0] * 4
    seeded = 9 + 5  # H + 1 tokens of "a", all 5 of "b"
    cache.begin_decode_step(["a", "b"])
    # One tensor for all: a follower passes its anchor's own top-k (or none).
    chosen = top_k([0, 1, 15, 20], [0, 9, -1])  # 9 >= seq_len 6: invalid
    for layer in range(4):
        cache.write_newest(layer, torch.zeros(2, W, dtype=torch.uint8))
        cache.swap_in(layer, chosen)
    cache.end_decode_step()
    stats = cache.stats()
    for layer in stats.layers:  # "a": 0, 1 miss, 15 and newest 20 hit; "b": 0 hits
        assert (layer.hits, layer.misses, layer.invalid) == (3, 2, 1)
        assert layer.hit_rate == 3 / 5
        assert layer.bytes_host_to_device == (2 + seeded) * W
        assert layer.bytes_device_to_host == (2 + 25) * W  # backups + prefill offload
    assert stats.to_dict()["total"] == {
        "hits": 4 * 3, "misses": 4 * 2, "invalid": 4 * 1,
        "bytes_host_to_device": 4 * (2 + seeded) * W, "bytes_device_to_host": 4 * (2 + 25) * W,
    }
    occupancy = stats.occupancy
    assert occupancy.host_rows_used == 21 + 6 and occupancy.host_extents_used == 6 + 2
    assert occupancy.internal_fragmentation_rows == 8 * 4 - 27
    assert occupancy.request_slots_used == 2
    assert occupancy.requests_by_state == {"running": 2}


def test_decoding_grows_a_request_by_one_adjacent_extent_exactly_when_full() -> None:
    """A request takes its next extent on the step whose token finds its last one full, and
    the one right after it while that is free, even with a lower run free: a context kept in
    one run is what the copy's read rate depends on (core/host_pool.py)."""
    cache = build_cache("cpu", hot=8, top_k=4, extent=4, group=2, validate=False,
                        pool_extents=32)
    for request_id, length in (("x", 4), ("a", 20)):  # x: extent 0; a: extents 1..5
        cache.admit(request_id, length)
        cache.write_prefill(request_id, torch.randint(0, 256, (4, length, W), dtype=torch.uint8))
        cache.commit_prefill(request_id)
    cache.finish("x")  # extent 0 is the lowest free run now
    for tokens in range(21, 30):
        cache.begin_decode_step(["a"])
        for layer in range(4):
            cache.write_newest(layer, torch.zeros(1, W, dtype=torch.uint8))
        cache.end_decode_step()
        extents = cache._requests.get("a", "look up").extents
        assert len(extents) == -(-tokens // 4), f"{tokens} tokens in {len(extents)} extents"
        assert extents == list(range(1, 1 + len(extents))), extents
    assert (np.diff(cache.host_rows("a")) == 1).all(), "one run of host rows"


def test_seeding_equals_appending_to_a_short_sequence() -> None:
    """H+1 tokens seeded at once give the state H appends to a short sequence give."""
    cache = running_cache(validate=False)
    hot = cache.hot_slots
    rows = torch.randint(0, 256, (4, hot + 1, W), dtype=torch.uint8)
    cache.admit("grown", 1)
    cache.write_prefill("grown", rows[:, :1])
    cache.commit_prefill("grown")
    for position in range(1, hot + 1):
        cache.begin_decode_step(["grown"])
        for layer in range(4):
            cache.write_newest(layer, rows[layer, position : position + 1])
        cache.end_decode_step()
    cache.admit("seeded", hot + 1)
    cache.write_prefill("seeded", rows)
    cache.commit_prefill("seeded")
    t, S = cache.tables, cache.slots_per_request
    grown, seeded = cache.request_slot("grown"), cache.request_slot("seeded")
    to_position = {}
    for name, slot in (("grown", grown), ("seeded", seeded)):
        rows_of = {int(r): p for p, r in enumerate(cache.host_rows(name))}
        to_position[name] = [[rows_of.get(int(r), -1) for r in t.slot_key[g, slot]]
                             for g in range(cache.num_groups)]
    assert to_position["grown"] == to_position["seeded"]
    assert torch.equal(t.last_use[:, grown], t.last_use[:, seeded])
    assert torch.equal(t.lru_clock[:, grown], t.lru_clock[:, seeded])
    assert torch.equal(t.device_kv[:, grown * S : (grown + 1) * S],
                       t.device_kv[:, seeded * S : (seeded + 1) * S])


class SideStreamCpu(CpuBackend):
    """The CPU backend pretending to have streams: runs the engine's side-stream code paths
    (anchor-issued follower replays, async backup) in program order."""

    name = "cpu-side-stream"
    features = FeatureTable(dict(CPU_FEATURES) | {Feature.ASYNC_BACKUP: supported()})

    def new_stream(self):
        return object()


@pytest.mark.parametrize("skip_io", [False, True])
def test_side_stream_paths_and_skip_io_match_the_plain_path(skip_io: bool) -> None:
    plain = running_cache(validate=False)
    config = plain.config.replace(async_backup=True, shared_index_prefetch=True, skip_io=skip_io)
    other = hisparse.HiSparseCache(config, device=SideStreamCpu())
    assert other._decode.prefetch_stream is not None and other._order.backup.asynchronous
    for request_id, length in (("a", 20), ("b", 5)):
        host = plain.host_tensors()
        rows = torch.stack([h[torch.from_numpy(plain.host_rows(request_id))] for h in host])
        other.admit(request_id, length)
        other.write_prefill(request_id, rows)
        other.commit_prefill(request_id)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        new = torch.randint(0, 256, (4, 2, W), dtype=torch.uint8, generator=g)
        n = plain.seq_len("a")
        chosen = top_k(torch.randperm(n + 1, generator=g)[:4].tolist(), [0, 2])
        for cache in (plain, other):
            cache.begin_decode_step(["a", "b"])
            outs = []
            for layer in range(4):
                cache.write_newest(layer, new[layer])
                outs.append(cache.swap_in(layer, chosen).clone())
            cache.end_decode_step()
            cache.outs = outs
        assert all(torch.equal(x, y) for x, y in zip(plain.outs, other.outs, strict=True))
        assert torch.equal(plain.tables.last_use, other.tables.last_use)
        assert torch.equal(plain.tables.lru_clock, other.tables.lru_clock)
        assert torch.equal(plain.tables.resident, other.tables.resident)
        for request_id in ("a", "b"):  # backups landed (skip_io leaves them alone)
            rows = torch.from_numpy(plain.host_rows(request_id))
            assert torch.equal(rows, torch.from_numpy(other.host_rows(request_id)))
            for x, y in zip(plain.host_tensors(), other.host_tensors(), strict=True):
                assert torch.equal(x[rows], y[rows])
        same_rows = torch.equal(plain.tables.device_kv, other.tables.device_kv)
        assert same_rows != skip_io or plain.stats().misses == 0
    assert [s.misses for s in plain.stats().layers] == [s.misses for s in other.stats().layers]
    # The probe moves no miss bytes, and must not report any: only the seeding crossed.
    plain_h2d = [s.bytes_host_to_device for s in plain.stats().layers]
    misses_h2d = [s.misses * W for s in plain.stats().layers]
    expected = [b - m for b, m in zip(plain_h2d, misses_h2d, strict=True)] if skip_io \
        else plain_h2d
    assert [s.bytes_host_to_device for s in other.stats().layers] == expected
    assert any(misses_h2d)


def test_a_position_keyed_map_serves_the_same_rows_as_a_host_row_map() -> None:
    """The residency map's key changes where a hit is looked up, never which slot serves it:
    two caches fed the same prompts, tokens and top-k return the same device rows holding the
    same bytes, step after step, and the position map holds one entry per request position."""
    rng = np.random.default_rng()
    caches = {key: running_cache(validate=False, residency_map=key)
              for key in ("host_row", "position")}
    prompts = torch.randint(0, 256, (4, 20, W), dtype=torch.uint8)
    for cache in caches.values():  # the same KV in both ("a" at 20 tokens, "b" at 5)
        for request_id, length in (("a", 20), ("b", 5)):
            cache.finish(request_id)
            cache.admit(request_id, length)
            cache.write_prefill(request_id, prompts[:, :length])
            cache.commit_prefill(request_id)
    tables = caches["position"].tables
    G, R, T = tables.last_use.shape[0], tables.page_table.shape[0], tables.positions_per_request
    assert tables.resident.shape == (G, R * T) and caches["position"].max_seq_len <= T
    for _ in range(12):
        new_rows = torch.randint(0, 256, (4, 2, W), dtype=torch.uint8)
        lengths = [caches["host_row"].seq_len(i) + 1 for i in ("a", "b")]
        # A top-k per group: fresh positions of each request, some repeated from before.
        picks = [top_k(*(sorted(rng.choice(n, size=min(n, 4), replace=False).tolist())
                         for n in lengths)) for _ in range(2)]
        served = {}
        for key, cache in caches.items():
            cache.begin_decode_step(["a", "b"])
            outs = []
            for layer in range(cache.num_layers):
                cache.write_newest(layer, new_rows[layer])
                out = cache.swap_in(layer, picks[layer // cache.index_group_size]).clone()
                outs.append((out, cache.tables.device_kv[layer][out.clamp(min=0).long()]))
            cache.end_decode_step()
            served[key] = outs
        for (out_row, kv_row), (out_pos, kv_pos) in zip(*served.values(), strict=True):
            assert torch.equal(out_row, out_pos) and torch.equal(kv_row, kv_pos)
    assert caches["host_row"].stats().misses == caches["position"].stats().misses > 0


def test_the_package_stays_small_enough_to_follow() -> None:
    """Issue 21's structure targets: no module of the package over 600 lines, no function
    over 80, `HiSparseCache` under 450; and the kernels and the layout import nothing of the
    engine or the tools (the layout types are the bottom of the package)."""
    import ast
    from pathlib import Path

    package = Path(hisparse.__file__).parent
    too_long = []
    for path in sorted(package.rglob("*.py")):
        layer = path.relative_to(package).parts[0]
        if layer in ("kernels", "layout"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                         [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                too_long += [f"{path.name} imports {n}" for n in names
                             if n.startswith(("hisparse.core", "hisparse.tools"))]
        text = path.read_text()
        if len(text.splitlines()) > 600:
            too_long.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            length = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and length > 80:
                too_long.append(f"{path.name}: {node.name}() is {length} lines")
            if isinstance(node, ast.ClassDef) and node.name == "HiSparseCache" and length >= 450:
                too_long.append(f"{path.name}: HiSparseCache is {length} lines")
    assert too_long == []
