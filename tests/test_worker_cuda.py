"""OffloadWorker's CUDA jobs on a GPU: side stream, per-job error records, pooled resources,
and ``poll()`` / ``wait()`` never waiting for the compute stream.

Marked ``cuda`` (skipped, with the reason, without a GPU); the same job path is emulated on
the CPU in test_ops_transfer.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from canonical_ops.engine import OffloadWorker, canonical_row_bytes
from canonical_ops.engine.worker import group_layer_mappings
from canonical_ops.ops import CanonicalTransferError
from layouts import LayerSpec, RankContext

# --------------------------------------------------------------------------- CUDA jobs


def _worker(num_blocks: int = 16, rows: int = 32):
    spec = LayerSpec("full", 16, 4, 64, "bfloat16", "packed", "HND")
    ctx = RankContext(2, 8, 1)
    kv = [torch.randn(num_blocks, 4, 16, 128, device="cuda").to(torch.bfloat16) for _ in range(2)]
    mappings = [g[ctx.rank] for g in group_layer_mappings([spec, spec], ctx)]
    pages = torch.zeros(rows, canonical_row_bytes(mappings), dtype=torch.uint8).pin_memory()
    return OffloadWorker(kv, [spec, spec], ctx, pages), kv, pages


def _busy_compute_stream(seconds: float = 1.0) -> None:
    """Queue a kernel that spins for about ``seconds`` on the current (compute) stream."""
    rate = torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate  # kHz
    torch.cuda._sleep(int(seconds * rate * 1000))


@pytest.mark.cuda
def test_poll_and_wait_do_not_wait_for_the_compute_stream():
    """Finished jobs are reported while a long kernel runs on the compute stream (before:
    poll() read the error word on the compute stream and waited for all model work)."""
    worker, _, _ = _worker()
    job = worker.store(block_ids=list(range(4)), page_ids=list(range(4)))
    worker.wait(job)
    done = worker.store(block_ids=[4, 5], page_ids=[4, 5])
    torch.cuda.synchronize()
    _busy_compute_stream(1.0)
    start = time.perf_counter()
    finished = worker.poll()
    assert time.perf_counter() - start < 0.2, "poll() waited for the compute stream"
    assert done in finished and done.error is None
    later = worker.store(block_ids=[6], page_ids=[6])  # ordered after the busy compute stream
    start = time.perf_counter()
    assert later not in worker.poll()
    assert time.perf_counter() - start < 0.2
    torch.cuda.synchronize()
    assert worker.wait(later).error is None


@pytest.mark.cuda
def test_concurrent_jobs_keep_their_own_errors():
    """A job with an out-of-range device id fails alone; jobs in flight with it on the same
    side stream (and the default error word of the plan) are not blamed."""
    worker, _, _ = _worker()
    good = worker.store(block_ids=list(range(3)), page_ids=list(range(3)))
    bad = worker.store(
        block_ids=torch.tensor([3, 99], device="cuda"),
        page_ids=torch.tensor([3, 4], device="cuda"),
    )
    also_good = worker.load(page_ids=list(range(8, 11)), block_ids=list(range(8, 11)))
    torch.cuda.synchronize()
    finished = worker.poll()
    assert {id(j) for j in finished} == {id(good), id(bad), id(also_good)}
    assert good.error is None and also_good.error is None
    assert isinstance(bad.error, CanonicalTransferError) and "pair: 1" in str(bad.error)
    with pytest.raises(CanonicalTransferError):
        worker.wait(bad)


@pytest.mark.cuda
def test_store_and_load_in_flight_together_run_in_submission_order():
    """A store and a load in flight together on the worker's side stream: the load sees the
    store's source blocks as they were (submission order), and every byte lands."""
    worker, kv, pages = _worker()
    originals = [k.clone() for k in kv]
    worker.wait(worker.store(block_ids=list(range(8)), page_ids=list(range(8))))
    store = worker.store(block_ids=list(range(8, 16)), page_ids=list(range(8, 16)))
    load = worker.load(
        page_ids=list(range(8)), block_ids=[15, 14, 13, 12, 11, 10, 9, 8]
    )  # pages 0-7 -> blocks
    for job in (store, load):
        assert worker.wait(job).error is None
    torch.cuda.synchronize()
    for k, original in zip(kv, originals):
        assert torch.equal(k[8:16], original[:8].flip(0))
    check = worker.load(
        page_ids=list(range(8, 16)), block_ids=list(range(8))
    )  # pages 8-15 -> blocks 0-7
    worker.wait(check)
    torch.cuda.synchronize()
    for k, original in zip(kv, originals):
        assert torch.equal(k[:8], original[8:16])
    assert pages.any()


@pytest.mark.cuda
def test_host_ids_checked_before_launch_on_cuda():
    worker, _, pages = _worker()
    before = pages.clone()
    with pytest.raises(IndexError, match="page_ids"):
        worker.store(block_ids=[0], page_ids=[10_000])
    with pytest.raises(ValueError, match="page_ids"):
        worker.store(block_ids=[0, 1], page_ids=[3, 3])
    with pytest.raises(ValueError, match="block_ids"):
        worker.load(page_ids=[0, 1], block_ids=[2, 2])
    torch.cuda.synchronize()
    assert torch.equal(pages, before) and worker.poll() == []


@pytest.mark.cuda
def test_jobs_reuse_pooled_events_staging_and_records():
    worker, _, _ = _worker()
    for _ in range(3):
        worker.wait(worker.store(block_ids=[0, 1], page_ids=[0, 1]))
    pools = worker._queue.pools
    assert len(pools._events) == 1 and len(pools.errors._chunks) == 1
    assert sum(len(free) for free in pools._staging.values()) == 1
