"""The extent allocator and the host pool: exact accounting, adjacency, freeing, errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hisparse
from hisparse.core.host_pool import ExtentAllocator, HostPool, token_rows, token_runs
from hisparse.errors import HostAllocationError, InvalidInputError, PoolExhaustedError


def runs_of(extents: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in itertools.pairwise(extents))


def test_a_growing_request_stays_in_one_run() -> None:
    allocator = ExtentAllocator(32)
    first = allocator.allocate(3)
    other = allocator.allocate(2)
    assert first == [0, 1, 2] and other == [3, 4]
    allocator.release(other)  # the neighbour leaves: the next extents continue the run
    grown = first + allocator.allocate(1, after=first[-1]) + allocator.allocate(1, after=3)
    assert grown == [0, 1, 2, 3, 4]
    blocker = allocator.allocate(1)  # [5]: the run cannot continue, the lowest fit is next
    assert blocker == [5] and allocator.allocate(2, after=4) == [6, 7]


def test_a_new_request_takes_the_lowest_run_that_fits_whole() -> None:
    allocator = ExtentAllocator(20)
    blocks = [allocator.allocate(2) for _ in range(10)]
    allocator.release(blocks[1] + blocks[4] + blocks[5])  # holes: [2,3] and [8..11]
    assert allocator.free_runs() == [(2, 2), (8, 4)]
    assert allocator.allocate(3) == [8, 9, 10]
    assert allocator.allocate(2) == [2, 3]
    # An exact fit below a longer run is taken whole; the longer run is not split.
    exact = ExtentAllocator(9)
    exact.allocate(9)
    exact.release([0, 1, 5, 6, 7, 8])
    assert exact.free_runs() == [(0, 2), (5, 4)]
    assert exact.allocate(2) == [0, 1] and exact.free_runs() == [(5, 4)]


def test_fragmented_pool_fills_from_the_longest_runs() -> None:
    allocator = ExtentAllocator(12)
    blocks = [allocator.allocate(1) for _ in range(12)]
    allocator.release(blocks[0] + blocks[3] + blocks[4] + blocks[5] + blocks[9] + blocks[10])
    assert allocator.allocate(5) == [3, 4, 5, 9, 10]
    assert allocator.free_extents == 1 and allocator.free_runs() == [(0, 1)]


@settings(deadline=None, max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9)), max_size=60), st.integers())
def test_random_allocations_account_exactly(operations, seed) -> None:
    rng = np.random.default_rng(abs(seed) % 2**32)
    total = 48
    allocator = ExtentAllocator(total)
    owned: list[list[int]] = []
    for kind, size in operations:
        if kind == 0 or not owned:  # new request
            if size > allocator.free_extents:
                before = allocator.free_runs()
                with pytest.raises(AssertionError):
                    allocator.allocate(size)
                assert allocator.free_runs() == before
                continue
            whole = any(length >= size for _, length in allocator.free_runs())
            got = allocator.allocate(size)
            assert len(got) == size and (runs_of(got) == 1 or not whole)
            owned.append(got)
        elif kind == 1:  # grow one request by one extent
            request = owned[int(rng.integers(len(owned)))]
            if allocator.free_extents:
                extends = allocator.is_free(request[-1] + 1)
                request += allocator.allocate(1, after=request[-1])
                if extends:
                    assert request[-1] == request[-2] + 1
        else:  # free one request
            allocator.release(owned.pop(int(rng.integers(len(owned)))))
        held = [e for request in owned for e in request]
        assert len(held) == len(set(held)), "an extent was handed out twice"
        free = [e for start, length in allocator.free_runs() for e in range(start, start + length)]
        assert sorted(free + held) == list(range(total))
        assert allocator.free_extents == len(free) == total - len(held)
        runs = allocator.free_runs()
        assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(runs))  # maximal
    for request in owned:
        allocator.release(request)
    assert allocator.free_runs() == [(0, total)]


def test_double_free_raises_and_changes_nothing() -> None:
    allocator = ExtentAllocator(8)
    got = allocator.allocate(3)
    allocator.release(got[:1])
    before = allocator.free_runs()
    with pytest.raises(InvalidInputError, match="double free"):
        allocator.release(got)  # extent 0 is already free
    with pytest.raises(InvalidInputError):
        allocator.release([1, 1])
    assert allocator.free_runs() == before


def test_token_rows_and_runs_follow_the_page_table() -> None:
    extents, e = [5, 6, 2, 9, 10], 4
    naive = [extents[p // e] * e + p % e for p in range(3, 19)]
    assert token_rows(extents, e, 3, 19).tolist() == naive
    runs = token_runs(extents, e, 3, 19)
    assert runs == [(3, 23, 5), (8, 8, 4), (12, 36, 7)]
    expanded = [row + i for _, row, length in runs for i in range(length)]
    assert expanded == naive


class CountingBackend:
    """Wraps the CPU backend, failing the n-th host allocation, counting frees."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.inner = hisparse.get_backend("cpu")
        self.fail_at, self.allocations, self.freed = fail_at, 0, []

    def alloc_host(self, num_bytes: int) -> torch.Tensor:
        self.allocations += 1
        if self.allocations == self.fail_at:
            raise HostAllocationError(f"injected failure for {num_bytes} bytes")
        return self.inner.alloc_host(num_bytes)

    def free_host(self, buffer: torch.Tensor) -> None:
        self.freed.append(buffer.data_ptr())
        self.inner.free_host(buffer)


def test_pool_allocates_one_buffer_per_layer_and_frees_each_once() -> None:
    backend = CountingBackend()
    pool = HostPool(backend, num_layers=3, num_extents=5, extent_tokens=4, row_bytes=16)
    assert [tuple(t.shape) for t in pool.layers] == [(20, 16)] * 3
    pointers = [t.data_ptr() for t in pool.layers]
    assert len(set(pointers)) == 3
    with pytest.raises(PoolExhaustedError, match=r"asked for 6 extents \(24 tokens\), 5 of 5"):
        pool.allocate(6)
    assert pool.allocator.free_extents == 5
    pool.close()
    pool.close()
    assert sorted(backend.freed) == sorted(pointers)


def test_pool_that_fails_halfway_frees_what_it_got() -> None:
    backend = CountingBackend(fail_at=3)
    with pytest.raises(HostAllocationError):
        HostPool(backend, num_layers=4, num_extents=2, extent_tokens=4, row_bytes=8)
    assert len(backend.freed) == 2


def test_a_failed_layer_allocation_names_the_pools_total_and_host_pool_tokens() -> None:
    """The error named the one buffer that failed (656 MiB, a layer's), not what the pool
    needs in all nor the config key that sizes it."""
    backend = CountingBackend(fail_at=3)
    with pytest.raises(HostAllocationError) as caught:
        HostPool(backend, num_layers=4, num_extents=2, extent_tokens=4, row_bytes=8)
    message = str(caught.value)
    assert message.startswith("the host pool needs 256 B (0.00 MiB) in all (4 layers x 8 rows x "
                              "8 B; the rows are host_pool_tokens rounded up to whole 4-token "
                              "extents); layer 2's buffer of 64 B (0.00 MiB) failed after 2 of 4 "
                              "layers were allocated (injected failure for 64 bytes)")
    assert message.endswith("lower host_pool_tokens (rows per layer) or free host memory.")
    assert len(backend.freed) == 2


def test_a_pool_larger_than_the_host_is_refused_before_any_layer_is_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every layer's buffer fits on its own (48 B each), the pool (192 B) does not.
    monkeypatch.setattr("hisparse.core.host_pool.available_host_bytes", lambda: 100)
    backend = CountingBackend()
    with pytest.raises(HostAllocationError) as caught:
        HostPool(backend, num_layers=4, num_extents=3, extent_tokens=2, row_bytes=8)
    assert str(caught.value) == (
        "the host pool needs 192 B (0.00 MiB) in all (4 layers x 6 rows x 8 B; the rows are "
        "host_pool_tokens rounded up to whole 2-token extents), but only 100 B (0.00 MiB) of "
        "host memory is available; lower host_pool_tokens (rows per layer) or free host memory.")
    assert backend.allocations == 0
