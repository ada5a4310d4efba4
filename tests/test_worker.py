"""OffloadWorker on CPU: plan built once, jobs, fallback layers, torch.compile of the launches."""

from __future__ import annotations

import pytest
import torch

from canonical_ops.frontend import OffloadWorker, canonical_row_bytes
from canonical_ops.frontend.worker import group_layer_mappings
from layouts import LayerSpec, RankContext


def setup(rank: int = 0, tp: int = 2, blocks: int = 6, rows: int = 8):
    spec = LayerSpec("full", 16, 8 // tp, 32, "bfloat16", "packed", "HND")
    ctx = RankContext(tp, 8, rank)
    kv = [torch.randn(blocks, 8 // tp, 16, 64).to(torch.bfloat16) for _ in range(3)]
    specs = [spec, spec, None]  # the last layer: an unrecognised layout, stored opaquely
    mappings = [
        g[rank]
        for g in group_layer_mappings(specs, ctx, fallback_page_sizes=[k.stride(0) * 2 for k in kv])
    ]
    pages = torch.zeros(rows, canonical_row_bytes(mappings), dtype=torch.uint8)
    return OffloadWorker(kv, specs, ctx, pages), kv, pages


def test_store_load_roundtrip_and_jobs() -> None:
    worker, kv, _ = setup()
    assert worker.format_id == "v1-hnd"
    assert set(worker.fallback_reasons) == {2} and "unrecognised" in worker.fallback_reasons[2]
    job = worker.store([1, 4], [7, 0])
    assert job.done and job.kind == "store" and job.num_bytes == 2 * 3 * kv[0][0].numel() * 2
    assert worker.poll() == []  # CPU jobs finish synchronously
    before = [k.clone() for k in kv]
    for k in kv:
        k[[2, 5]] = 0
    worker.wait(worker.load([7, 0], [2, 5]))
    for k, b in zip(kv, before):
        assert torch.equal(k[2], b[1]) and torch.equal(k[5], b[4])


def test_replicated_writer_bytes_counted() -> None:
    spec = LayerSpec("full", 16, 1, 32, "bfloat16", "packed", "NHD")
    kv = [torch.zeros(4, 1, 16, 64, dtype=torch.bfloat16)]
    maps = group_layer_mappings([spec], RankContext(4, 2, 1))
    pages = torch.zeros(4, canonical_row_bytes([maps[0][1]]), dtype=torch.uint8)
    worker = OffloadWorker(kv, [spec], RankContext(4, 2, 1), pages)
    # rank 1 writes odd pages only (2 replicas per head, rotating)
    assert worker.store([0, 1, 2], [0, 1, 3]).num_bytes == 2 * spec.page_size_bytes


def test_bad_ids_raise_and_write_nothing() -> None:
    worker, kv, pages = setup()
    with pytest.raises(IndexError, match="page_ids"):
        worker.store([0], [99])
    assert not pages.any()
    with pytest.raises(ValueError, match="specs"):
        OffloadWorker(kv, [None], worker.ctx, pages)


def test_launches_compile_fullgraph() -> None:
    """The per-step tensor calls trace without graph breaks and move the same bytes as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    compiled_worker, compiled_kv, compiled_pages = setup()
    torch.manual_seed(0)
    eager_worker, eager_kv, eager_pages = setup()

    def step(worker: OffloadWorker, blocks, page_ids, targets) -> None:
        worker.store_tensors(blocks, page_ids)
        worker.load_tensors(page_ids, targets)

    compiled = torch.compile(step, fullgraph=True)
    blocks, page_ids, targets = torch.tensor([0, 3]), torch.tensor([5, 6]), torch.tensor([1, 2])
    compiled(compiled_worker, blocks, page_ids, targets)
    step(eager_worker, blocks, page_ids, targets)
    assert compiled_pages.any() and torch.equal(compiled_pages, eager_pages)
    for got, want in zip(compiled_kv, eager_kv):
        assert torch.equal(got, want)
        assert torch.equal(got[1], got[0]) and torch.equal(got[2], got[3])
