"""canonical_ops.transfer: host registration, error records, pools, and the CUDA job path of
TransferQueue (what both OffloadWorker and the vLLM worker run), emulated on the CPU with a
stand-in side stream (helpers.emulated_stream); the device itself is tested in
test_worker_cuda.py (marked cuda)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.emulated_stream import EmulatedCuda

from canonical_ops.engine import OffloadWorker
from canonical_ops.ops import CanonicalTransferError, transfer_error
from canonical_ops.plan import canonical_row_bytes, make_plan
from canonical_ops.transfer import (
    HOST_REGISTER_PORTABLE_MAPPED,
    CudaJobPools,
    ErrorRecords,
    HostRegistrationError,
    PlanCall,
    TransferQueue,
    register_host_memory,
    unregister_host_memory,
)
from layouts import LayerSpec, RankContext, group_layer_mappings

GIB = 1 << 30

# --------------------------------------------------------------------------- host registration


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls; fails the n-th register."""

    def __init__(self, fail_at: int | None = None, unregister_fails: bool = False) -> None:
        self.fail_at, self.unregister_fails = fail_at, unregister_fails
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        if self.fail_at is not None and len(self.registered) == self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered.append((address, size, flags))
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        return 1 if self.unregister_fails else 0

    def cudaGetErrorString(self, error: int) -> str:
        return {1: "invalid value", 2: "out of memory"}[error]


def test_memory_registered_in_pieces_of_at_most_the_cap():
    cudart = FakeCudart()
    pieces = register_host_memory(1 << 40, 150 * GIB, chunk_bytes=64 * GIB, cudart=cudart)
    assert pieces == [(1 << 40) + i * 64 * GIB for i in range(3)]
    assert [size for _, size, _ in cudart.registered] == [64 * GIB, 64 * GIB, 22 * GIB]
    assert {flags for _, _, flags in cudart.registered} == {HOST_REGISTER_PORTABLE_MAPPED}
    unregister_host_memory(pieces, cudart=cudart)
    assert cudart.unregistered == pieces[::-1]


def test_a_failing_piece_rolls_back_the_others_and_raises():
    cudart = FakeCudart(fail_at=2)
    with pytest.raises(HostRegistrationError, match=r"at offset 137438953472 .*out of memory"):
        register_host_memory(4096, 200 * GIB, chunk_bytes=64 * GIB, cudart=cudart)
    assert cudart.unregistered == [4096 + 64 * GIB, 4096]


def test_unregister_tries_every_piece_then_names_the_failures():
    cudart = FakeCudart(unregister_fails=True)
    with pytest.raises(RuntimeError, match=r"0x2000: invalid value, 0x1000: invalid value"):
        unregister_host_memory([0x1000, 0x2000], cudart=cudart)
    assert cudart.unregistered == [0x2000, 0x1000]


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (1.5, TypeError)])
def test_piece_size_is_checked(value, error):
    cudart = FakeCudart()
    with pytest.raises(error, match="chunk_bytes: expected an int >= 1"):
        register_host_memory(0, 10, chunk_bytes=value, cudart=cudart)
    assert cudart.registered == []


# --------------------------------------------------------------------------- records and pools


def test_error_records_are_reused_and_read_without_cuda():
    records = ErrorRecords(chunk=2, pin=False)
    first, second = records.acquire(), records.acquire()
    assert first.data_ptr() != second.data_ptr() and not first.any()
    assert records.release(first) is None  # nothing recorded
    second[:3] = torch.tensor([1, 0, 3])  # as a kernel would: block flag, pair 2
    error = records.release(second, np.array([4, 5, 99]), np.array([0, 1, 2]))
    assert isinstance(error, CanonicalTransferError)
    assert "pair: 2 (block_ids[2] = 99, page_ids[2] = 2)" in str(error)
    again = records.acquire()
    assert again.data_ptr() in (first.data_ptr(), second.data_ptr()) and not again.any()
    third = records.acquire()
    fourth = records.acquire()  # a new chunk; earlier records never move
    assert len({t.data_ptr() for t in (again, third, fourth)}) == 3


def test_transfer_error_names_the_kinds():
    assert transfer_error([0, 0, 0, 0]) is None
    assert "block id" in str(transfer_error([1, 0, 1, 0]))
    both = str(transfer_error([1, 1, 5, 0]))
    assert "block id and page id" in both and "pair: 4" in both


def test_job_pools_reuse_staging_by_capacity():
    pools = CudaJobPools(pin=False)
    small = pools.staging(10)
    assert small.numel() == 128 and small.dtype == torch.int64
    pools.release_staging(small)
    assert pools.staging(100).data_ptr() == small.data_ptr()
    assert pools.staging(1000).numel() == 1024


# --------------------------------------------------------------------------- emulated CUDA jobs

SPEC = LayerSpec("full", 16, 4, 32, "bfloat16", "packed", "HND")
CTX = RankContext(2, 8, 1)


def worker_pair(monkeypatch, fail=None):
    """Two workers over identical caches: one on the emulated CUDA path, one plain CPU."""
    out = []
    for emulated in (True, False):
        torch.manual_seed(7)
        kv = [torch.randn(8, 4, 16, 64).to(torch.bfloat16) for _ in range(2)]
        mappings = [g[CTX.rank] for g in group_layer_mappings([SPEC, SPEC], CTX)]
        pages = torch.zeros(8, canonical_row_bytes(mappings), dtype=torch.uint8)
        worker = OffloadWorker(kv, [SPEC, SPEC], CTX, pages)
        stream = EmulatedCuda(monkeypatch, fail).attach(worker._queue) if emulated else None
        out.append((worker, kv, pages, stream))
    return out


def test_jobs_stay_in_flight_until_their_stream_ran(monkeypatch):
    (worker, kv, pages, stream), (cpu, cpu_kv, cpu_pages, _) = worker_pair(monkeypatch)
    job = worker.store(block_ids=[1, 4, 6], page_ids=[7, 0, 3])
    assert not job.done and worker.poll() == [] and not pages.any()
    assert stream.waited_on == ["compute"]  # ordered after the caller's stream
    stream.run()
    assert worker.poll() == [job] and job.done and job.error is None
    cpu.store(block_ids=[1, 4, 6], page_ids=[7, 0, 3])
    assert pages.any() and torch.equal(pages, cpu_pages)
    assert job.num_bytes == cpu.store(block_ids=[1], page_ids=[7]).num_bytes * 3
    for layer in kv:
        layer[[2, 5]] = 0
    load = worker.load(block_ids=[2, 5], page_ids=[7, 0])
    assert worker.wait(load) is load and load.error is None
    for layer, original in zip(kv, cpu_kv):
        assert torch.equal(layer[2], original[1]) and torch.equal(layer[5], original[4])


def test_wait_runs_its_own_job_only_and_resources_are_pooled(monkeypatch):
    ((worker, _, _, stream), _) = worker_pair(monkeypatch)
    first = worker.store(block_ids=[0, 1], page_ids=[0, 1])
    second = worker.store(block_ids=[2], page_ids=[2])
    worker.wait(first)
    assert first.done and not second.done and worker.poll() == []
    assert first._transfer._keep_alive == () and second._transfer._keep_alive
    stream.run()
    assert worker.poll() == [second]
    pools = worker._queue.pools

    def pooled():
        staged = sum(len(free) for free in pools._staging.values())
        return len(pools.errors._chunks), len(pools.errors._free), staged, len(pools._events)

    assert pooled() == (1, 64, 2, 2)  # two jobs were in flight together; all given back
    for _ in range(3):
        worker.wait(worker.store(block_ids=[0, 1], page_ids=[0, 1]))
    assert pooled() == (1, 64, 2, 2)  # reused: nothing allocated


def test_bad_host_ids_are_refused_before_anything_is_queued(monkeypatch):
    ((worker, _, pages, stream), _) = worker_pair(monkeypatch)
    with pytest.raises(IndexError, match=r"page_ids\[0\] = 64: expected 0 <= id < 8"):
        worker.store(block_ids=[0], page_ids=[64])
    with pytest.raises(IndexError, match=r"block_ids\[1\] = 8: expected 0 <= id < 8"):
        worker.load(block_ids=[0, 8], page_ids=[0, 1])
    with pytest.raises(ValueError, match=r"page_ids\[0\] and page_ids\[1\] are both 3"):
        worker.store(block_ids=[0, 1], page_ids=[3, 3])
    with pytest.raises(ValueError, match=r"block_ids\[0\] and block_ids\[1\] are both 2"):
        worker.load(block_ids=[2, 2], page_ids=[0, 1])
    with pytest.raises(TypeError, match="block_ids"):
        worker.store(block_ids=[0.5], page_ids=[1])
    assert stream.work == [] and worker.poll() == [] and not pages.any()
    assert worker._queue.pools.errors._chunks == []  # no record was taken


def test_a_refused_pair_fails_its_job_alone(monkeypatch):
    fail = {}
    ((worker, _, _, stream), _) = worker_pair(monkeypatch, fail)
    good = worker.store(block_ids=[0], page_ids=[0])
    fail["pair"] = 1  # the next kernel: as the device refuses an out-of-range id
    bad = worker.store(block_ids=[3, 4], page_ids=[5, 6])
    also_good = worker.store(block_ids=[5], page_ids=[7])
    stream.run()
    assert worker.poll() == [good, bad, also_good]
    assert good.error is None and also_good.error is None
    assert isinstance(bad.error, CanonicalTransferError)
    assert "pair: 1 (block_ids[1] = 4, page_ids[1] = 6)" in str(bad.error)
    with pytest.raises(CanonicalTransferError):
        worker.wait(bad)


def test_a_job_of_several_calls_and_plans(monkeypatch):
    """One record per kernel (call x plan), one staged copy per call, device time timed."""
    kv = [torch.randn(6, 4, 16, 64).to(torch.bfloat16) for _ in range(3)]
    mappings = [g[CTX.rank] for g in group_layer_mappings([SPEC] * 3, CTX)]
    pages = torch.zeros(4, canonical_row_bytes(mappings, 2), dtype=torch.uint8)
    offsets = np.cumsum([0] + [2 * m.canonical_page_size_bytes for m in mappings])
    plans = [
        ([kv[i]], make_plan([mappings[i]], [kv[i]], pages, pages_per_row=2, area_offsets=[o]))
        for i, o in enumerate(offsets[:3])
    ]
    queue = TransferQueue(torch.device("cpu"), pages, 2, timing=True)
    stream = EmulatedCuda(monkeypatch).attach(queue, timing=True)
    calls = [PlanCall(plans[:2], [0, 1], [6, 7]), PlanCall(plans[2:], [2], np.array([1]))]
    job = queue.submit(True, calls)
    assert len(job._records) == 3 and len(job._staging) == 2 and not job.ready()
    stream.run()
    queue.finish(job)
    assert job.error is None and job.seconds == pytest.approx(4e-3)  # 3 kernels + end: "4 ms"
    assert queue.finish(job) is job and job._records == []  # idempotent
    reference = torch.zeros_like(pages)
    for (kvs, plan), (blocks, ids) in zip(plans, [([0, 1], [6, 7])] * 2 + [([2], [1])]):
        torch.ops.canonical.canonical_store(
            kvs, reference, plan, torch.tensor(blocks), torch.tensor(ids)
        )
    assert reference.any() and torch.equal(pages, reference)
