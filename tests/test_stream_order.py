"""The engine's event waits, checked on CPU: side-stream work (follower replays, backups) runs
as late as the recorded events allow (`fakes.deferred_streams`), so a missing wait reads rows
a replay has not copied yet, or lets a backup copy buffers the next step already rewrote; and
host rows a default-stream kernel read count as in use until the host has waited for it, so a
missing drain before the CPU rewrites them shows in `host_races`. Every returned row is checked
as soon as `swap_in` returns, and every host row at the end."""

from __future__ import annotations

import pytest
import torch

import hisparse
from fakes.deferred_streams import DeferredStreamCpu
from hisparse.core.ordering import HostRowGuard, NewestBackup, StepEnd
from test_reliability_state import check_table_invariants, prefill_patterned, row_pattern

LAYERS, WIDTH, TOP_K, HOT, EXTENT, GROUP = 6, 32, 6, 8, 4, 3
REQUESTS = {"long": (1, 30), "mid": (2, 12), "short": (3, 4)}  # uid, prompt tokens


def check_hot_buffers(cache: hisparse.HiSparseCache, layer: int, names: list[str],
                      uids: dict[str, int] | None = None) -> None:
    """Every hot slot of `layer` that its group's tables say holds a token holds its bytes (a
    follower's too: rows a replay should have copied show here even if no top-k names them).
    `uids`: each request's row-pattern id (default: REQUESTS')."""
    uids = uids or {name: uid for name, (uid, _) in REQUESTS.items()}
    device_kv, group = cache.device_kv(layer), layer // GROUP
    slots = cache.slots_per_request
    for name in names:
        r = cache.request_slot(name)
        position_of = {int(row): p for p, row in enumerate(cache.host_rows(name))}
        for slot, row in enumerate(cache.tables.slot_key[group, r].tolist()):
            if row >= 0:
                want = row_pattern(uids[name], layer, torch.tensor([position_of[row]]), WIDTH)
                assert torch.equal(device_kv[r * slots + slot], want[0]), (layer, name, slot)


def deferred_cache(backend: DeferredStreamCpu, max_requests: int, pool_extents: int,
                   async_backup: bool = True) -> hisparse.HiSparseCache:
    """A cache whose follower replays (and backups, with `async_backup`) run on deferred side
    streams of `backend`."""
    config = hisparse.HiSparseConfig.from_preset(
        "tiny", num_layers=LAYERS, row_bytes=WIDTH, top_k=TOP_K, hot_slots=HOT,
        index_group_size=GROUP, extent_tokens=EXTENT, max_requests=max_requests,
        max_batch=min(3, max_requests), host_pool_tokens=pool_extents * EXTENT, max_seq_len=64,
        validate=False, async_backup=async_backup, shared_index_prefetch=True,
    )
    cache = hisparse.HiSparseCache(config, device=backend)
    assert cache._decode.prefetch_stream is not None
    assert cache._order.backup.asynchronous == async_backup
    return cache


def test_side_stream_work_is_waited_for_before_it_is_needed(rng: torch.Generator) -> None:
    backend = DeferredStreamCpu()
    cache = deferred_cache(backend, max_requests=4, pool_extents=64)
    for name, (uid, tokens) in REQUESTS.items():
        prefill_patterned(cache, name, uid, tokens, LAYERS, WIDTH)
    names = list(REQUESTS)
    deferred = 0
    for step in range(12):
        cache.begin_decode_step(names)
        lengths = [cache.seq_len(n) for n in names]
        for layer in range(LAYERS):
            cache.write_newest(layer, torch.cat([
                row_pattern(REQUESTS[n][0], layer, torch.tensor([length - 1]), WIDTH)
                for n, length in zip(names, lengths, strict=True)]))
        top_k = torch.full((len(names), TOP_K), -1, dtype=torch.int32)
        for b, n in enumerate(lengths):
            chosen = torch.randperm(n, generator=rng)[:TOP_K]
            top_k[b, : chosen.numel()] = chosen.to(torch.int32)
        # Some steps skip one follower, some every follower (so that the next step's first
        # anchor finds its group's replays still queued): each replay must still land, and
        # read its own step's plan, before the group plans again.
        followers = {layer for layer in range(LAYERS) if layer % GROUP}
        skipped = followers if step % 4 == 3 else (
            {step % LAYERS} & followers if step % 3 == 2 else set())
        for layer in range(LAYERS):
            if layer in skipped:
                continue
            rows = cache.swap_in(layer, top_k)
            if layer % GROUP == 0:
                deferred = max(deferred, backend.pending())  # the followers' replays
            device_kv = cache.device_kv(layer)
            for b, name in enumerate(names):
                want = row_pattern(REQUESTS[name][0], layer, top_k[b], WIDTH)
                got = device_kv[rows[b].long()]
                valid = top_k[b] >= 0
                assert torch.equal(got[valid], want[valid]), (step, layer, name)
            check_hot_buffers(cache, layer, names)
        cache.end_decode_step()
        deferred = max(deferred, backend.pending())  # the backup
        check_table_invariants(cache)
    assert deferred > 0, "nothing was deferred: the test exercises no ordering"
    backend.synchronize()
    for name, (uid, _) in REQUESTS.items():
        rows = torch.from_numpy(cache.host_rows(name))
        for layer in range(LAYERS):
            want = row_pattern(uid, layer, torch.arange(rows.numel()), WIDTH)
            assert torch.equal(cache.host_tensors()[layer][rows], want), (name, layer)
    cache.close()
    assert backend.host_races == []


def _one_step(cache: hisparse.HiSparseCache, uids: dict[str, int], layers: list[int],
              rng: torch.Generator, cancel: bool = False) -> int:
    """A decode step whose swap_in runs only on `layers` (the others' replays stay queued),
    ended or (`cancel`) cancelled; returns how much side-stream work was queued then."""
    names = list(uids)
    cache.begin_decode_step(names)
    lengths = [cache.seq_len(n) for n in names]
    for layer in range(LAYERS):
        cache.write_newest(layer, torch.cat([
            row_pattern(uids[n], layer, torch.tensor([length - 1]), WIDTH)
            for n, length in zip(names, lengths, strict=True)]))
    top_k = torch.full((len(names), TOP_K), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        top_k[b] = torch.randperm(n - 1, generator=rng)[:TOP_K].to(torch.int32)
    for layer in layers:
        rows = cache.swap_in(layer, top_k)
        device_kv = cache.device_kv(layer)
        for b, name in enumerate(names):
            want = row_pattern(uids[name], layer, top_k[b], WIDTH)
            assert torch.equal(device_kv[rows[b].long()], want), (layer, name)
    queued = cache.backend.pending()
    if cancel:
        cache.cancel_decode_step()
    else:
        cache.end_decode_step()
    return queued


@pytest.mark.parametrize(("async_backup", "cancel"), [(False, False), (True, False),
                                                     (False, True)])
def test_a_freed_slot_and_its_rows_wait_for_the_last_steps_side_stream_work(
        async_backup: bool, cancel: bool, rng: torch.Generator) -> None:
    """A request finished right after a step (ended or cancelled) whose follower replays (or
    backup) are still queued: the request that takes its slot and host rows next must not get
    them overwritten by that late work (a replay copies the old plan's host rows into the old
    victims' slots; a backup writes the old newest token into its host row), nor its prefill
    written into rows the step's swap-ins may still be reading."""
    backend = DeferredStreamCpu()
    cache = deferred_cache(backend, max_requests=1, pool_extents=16, async_backup=async_backup)
    uids = {"long": 1, "next": 9}
    tokens = 30
    for name in ("long", "next"):
        if name == "next":
            # One token longer: it takes the freed slot and host extents, with the row of the
            # token the last step appended to "long" (and backed up) among its prompt's rows.
            newest_row = int(cache.host_rows("long")[-1])
            assert backend.pending_reads, "no swap-in read is pending: the test checks no drain"
            cache.finish("long")
            tokens += 1
        cache.admit(name, tokens)
        cache.write_prefill(name, torch.stack(
            [row_pattern(uids[name], layer, torch.arange(tokens), WIDTH)
             for layer in range(LAYERS)]))
        cache.commit_prefill(name)
        if name == "long":
            # Anchors only: every follower's replay stays queued on the side stream.
            queued = _one_step(cache, {"long": 1}, [0, GROUP], rng, cancel)
            assert queued > 0, "nothing was deferred: the test checks no ordering"
    assert newest_row in cache.host_rows("next"), "the new request got other rows"
    for _ in range(3):
        _one_step(cache, {"next": 9}, list(range(LAYERS)), rng)
        check_hot_buffers(cache, 1, ["next"], uids)
    backend.synchronize()
    rows = torch.from_numpy(cache.host_rows("next"))
    for layer in range(LAYERS):
        want = row_pattern(uids["next"], layer, torch.arange(rows.numel()), WIDTH)
        assert torch.equal(cache.host_tensors()[layer][rows], want), layer
    cache.close()
    assert backend.host_races == []


def _ordering(backend: DeferredStreamCpu) -> tuple[StepEnd, HostRowGuard, NewestBackup]:
    """The host-row rules of one cache, its backup on a side stream of `backend`."""
    device = torch.device("cpu")
    step_end = StepEnd(backend, device)
    guard = HostRowGuard(backend, device, step_end)
    return step_end, guard, NewestBackup(backend, device, backend.new_stream(), guard)


def test_device_writes_of_host_rows_on_several_streams_are_all_waited_for() -> None:
    """Prefills' device-to-host copies on two scheduler streams and a backup on its own: the
    host's next write of host rows waits for all three, though it waits on the last
    prefill's and the last backup's events alone (a prefill follows the one before on the
    device)."""
    backend = DeferredStreamCpu()
    step_end, guard, backup = _ordering(backend)
    landed: list[str] = []
    for name in ("prefill 1", "prefill 2"):
        with backend.stream_scope(backend.new_stream()):
            guard.device_prefill(lambda name=name: backend._issue(lambda: landed.append(name)))
    backup.issue(lambda: backend._issue(lambda: landed.append("backup")), step_end)
    assert landed == []
    guard.drain()
    assert sorted(landed) == ["backup", "prefill 1", "prefill 2"]


def test_a_host_row_write_waits_for_the_host_row_work_alone() -> None:
    """Work queued after the last device write of host rows (the next forward pass, the next
    step's replays) still runs on after a drain: the host waits for those writes and the
    last step's end, not for the device."""
    backend = DeferredStreamCpu()
    step_end, guard, backup = _ordering(backend)
    landed: list[str] = []
    backup.issue(lambda: backend._issue(lambda: landed.append("backup")), step_end)
    with backend.stream_scope(backup.stream):
        backend._issue(lambda: landed.append("later work"))
    guard.drain()
    assert landed == ["backup"]
    backend.synchronize()
    assert landed == ["backup", "later work"]


@pytest.mark.parametrize("backed_up", [True, False], ids=["backup", "lookups-backed-up"])
def test_a_prefill_from_device_memory_follows_the_last_step_on_the_device(
        backed_up: bool) -> None:
    """`write_prefill` from device memory into rows a finish freed: its copies follow the last
    step's end (whose kernels may still read those rows) and its backup if it launched one
    (which may still write them) on the device, and the host waits for nothing."""
    backend = DeferredStreamCpu()
    step_end, guard, backup = _ordering(backend)
    landed: list[str] = []
    step_stream, copy_stream = backend.new_stream(), backend.new_stream()
    with backend.stream_scope(step_stream):
        backend._issue(lambda: landed.append("the last step reads the rows"))
        step_end.mark()
    if backed_up:
        backup.issue(lambda: backend._issue(lambda: landed.append("a backup")), step_end)
    with backend.stream_scope(copy_stream):
        guard.device_prefill(lambda: backend._issue(lambda: landed.append("the prefill")))
    assert landed == []  # nothing ran on the host's account
    copy_stream.run_through(len(copy_stream.queued))
    assert landed == ["the last step reads the rows", *(["a backup"] * backed_up),
                      "the prefill"]
