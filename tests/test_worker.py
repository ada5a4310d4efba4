"""OffloadWorker on CPU: plan built once, jobs, fallback layers, torch.compile of the launches."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers.ops import make_kv_cache

from canonical_ops.engine import OffloadWorker, canonical_row_bytes
from canonical_ops.engine.worker import group_layer_mappings, spec_mismatch
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
    job = worker.store(block_ids=[1, 4], page_ids=[7, 0])
    assert job.done and job.kind == "store" and job.num_bytes == 2 * 3 * kv[0][0].numel() * 2
    assert worker.poll() == []  # CPU jobs finish synchronously
    before = [k.clone() for k in kv]
    for k in kv:
        k[[2, 5]] = 0
    worker.wait(worker.load(block_ids=[2, 5], page_ids=[7, 0]))
    for k, b in zip(kv, before):
        assert torch.equal(k[2], b[1]) and torch.equal(k[5], b[4])


def test_replicated_writer_bytes_counted() -> None:
    spec = LayerSpec("full", 16, 1, 32, "bfloat16", "packed", "NHD")
    kv = [torch.zeros(4, 1, 16, 64, dtype=torch.bfloat16)]
    maps = group_layer_mappings([spec], RankContext(4, 2, 1))
    pages = torch.zeros(4, canonical_row_bytes([maps[0][1]]), dtype=torch.uint8)
    worker = OffloadWorker(kv, [spec], RankContext(4, 2, 1), pages)
    # rank 1 writes odd pages only (2 replicas per head, rotating)
    assert (
        worker.store(block_ids=[0, 1, 2], page_ids=[0, 1, 3]).num_bytes == 2 * spec.page_size_bytes
    )


def test_bad_ids_raise_and_write_nothing() -> None:
    worker, kv, pages = setup()
    with pytest.raises(IndexError, match="page_ids"):
        worker.store(block_ids=[0], page_ids=[99])
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
        worker.store_tensors(block_ids=blocks, page_ids=page_ids)
        worker.load_tensors(block_ids=targets, page_ids=page_ids)

    compiled = torch.compile(step, fullgraph=True)
    blocks, page_ids, targets = torch.tensor([0, 3]), torch.tensor([5, 6]), torch.tensor([1, 2])
    compiled(compiled_worker, blocks, page_ids, targets)
    step(eager_worker, blocks, page_ids, targets)
    assert compiled_pages.any() and torch.equal(compiled_pages, eager_pages)
    for got, want in zip(compiled_kv, eager_kv):
        assert torch.equal(got, want)
        assert torch.equal(got[1], got[0]) and torch.equal(got[2], got[3])


# --------------------------------------------------------------------------- call signatures


def test_store_and_load_ids_are_keyword_only() -> None:
    """store(blocks, pages) vs load(pages, blocks) once swapped silently: now a TypeError."""
    worker, _, pages = setup()
    ids = torch.tensor([1]), torch.tensor([2])
    for call in (worker.store, worker.load, worker.store_tensors, worker.load_tensors):
        with pytest.raises(TypeError, match="positional"):
            call(*ids)
    assert not pages.any()


# --------------------------------------------------------------------------- kv tensors vs specs


def rows_for(spec: LayerSpec, ctx: RankContext, num_rows: int = 4) -> torch.Tensor:
    mappings = [g[ctx.rank] for g in group_layer_mappings([spec], ctx)]
    return torch.zeros(num_rows, canonical_row_bytes(mappings), dtype=torch.uint8)


def readme_nhd_cache(blocks: int = 8) -> torch.Tensor:
    """The README's packed NHD cache: 2 heads x 16 tokens x (K, V of 128), token-major."""
    return torch.zeros(blocks, 16, 2, 256, dtype=torch.bfloat16).permute(0, 2, 1, 3)


@pytest.mark.parametrize(
    ("kv", "spec", "ctx", "match"),
    [
        pytest.param(
            readme_nhd_cache().contiguous(),  # physically head-major (HND)
            LayerSpec("full", 16, 2, 128, "bfloat16", "packed", "NHD"),
            RankContext(4, 8, 1),
            r"strides \(block, 256, 512, 1\) in elements \(packed NHD\), "
            r"got \(8192, 4096, 256, 1\), which is packed HND",
            id="contiguous-copy-of-permuted-nhd",
        ),
        pytest.param(
            torch.zeros(8, 2, 16, 256, dtype=torch.float32),
            LayerSpec("full", 16, 2, 128, "bfloat16", "packed", "HND"),
            RankContext(4, 8, 1),
            r"dtype bfloat16 \(2 bytes per element\), got float32 \(4 bytes per element\)",
            id="float32-tensor-bfloat16-spec",
        ),
        pytest.param(
            torch.zeros(8, 2, 16, 256, dtype=torch.bfloat16),
            LayerSpec("full", 16, 1, 128, "bfloat16", "packed", "HND"),  # TP=8 of 8 heads
            RankContext(8, 8, 3),
            r"shape \(num_blocks, 1, 16, 256\), got \(8, 2, 16, 256\)",
            id="tp8-spec-on-2-head-tensor",
        ),
    ],
)
def test_kv_cache_must_be_the_layout_its_spec_describes(kv, spec, ctx, match) -> None:
    """Each of these once moved bytes to the wrong canonical places without an error."""
    good_spec = LayerSpec("full", 16, 2, 128, "bfloat16", "packed", "NHD")
    good_ctx = RankContext(4, 8, 1)
    OffloadWorker([readme_nhd_cache()], [good_spec], good_ctx, rows_for(good_spec, good_ctx))
    exact = make_kv_cache(spec, 8, np.random.default_rng(0)).tensor  # layer 0 is fine
    mappings = [g[ctx.rank] for g in group_layer_mappings([spec, spec], ctx)]
    pages = torch.zeros(4, canonical_row_bytes(mappings), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_caches\[1\]: does not match specs\[1\]: ") as info:
        OffloadWorker([exact, kv], [spec, spec], ctx, pages)
    assert re.search(match, str(info.value)), str(info.value)


def test_replaced_or_restrided_kv_cache_is_refused_per_call() -> None:
    worker, kv, pages = setup()
    worker.kv_caches[1] = kv[1].clone()  # same dtype, shape and strides: only identity differs
    for call in (worker.store, worker.load, worker.store_tensors, worker.load_tensors):
        with pytest.raises(ValueError, match=r"kv_caches\[1\]: .*replaced"):
            call(block_ids=torch.tensor([0]), page_ids=torch.tensor([0]))
    worker.kv_caches[1] = kv[1]
    worker.store(block_ids=[0], page_ids=[0])
    # Same storage, block stride and block count (all the op itself checks), other strides:
    # the HND cache now reads as NHD.
    heads, width = kv[0].shape[1], kv[0].shape[3]
    kv[0].as_strided_(kv[0].shape, (kv[0].stride(0), width, heads * width, 1))
    with pytest.raises(ValueError, match=r"kv_caches\[0\]: expected .* changed in place"):
        worker.store(block_ids=[0], page_ids=[1])
    assert not pages[1].any()


# --------------------------------------------------------------------------- identity, rows


def test_storage_namespace_includes_topology_when_a_layer_is_opaque() -> None:
    tp2, tp4 = setup(tp=2)[0], setup(tp=4)[0]
    for worker in (tp2, tp4):
        assert worker.format_id == "v1-hnd"  # the page encoding; says nothing of topology
        assert worker.opaque_layers == [2] and not worker.is_topology_independent
        assert worker.storage_namespace.startswith("v1-hnd-topo-")
    assert "tp2-pcp1-dcp1" in tp2.storage_namespace
    assert tp2.storage_namespace != tp4.storage_namespace
    assert setup(tp=2, rank=1)[0].storage_namespace == tp2.storage_namespace  # one per group

    spec = LayerSpec("full", 16, 4, 32, "bfloat16", "packed", "HND")
    ctx = RankContext(2, 8, 0)
    certified = OffloadWorker(
        [torch.zeros(4, 4, 16, 64, dtype=torch.bfloat16)], [spec], ctx, rows_for(spec, ctx)
    )
    assert certified.is_topology_independent and certified.opaque_layers == []
    assert certified.storage_namespace == certified.format_id == "v1-hnd"


def mixed_layers(tp: int, rank: int, truth: torch.Tensor, blocks: int = 6):
    """Layer 0: an MLA latent with per-token-head scales (opaque: its canonical page is
    tp x the rank's page, so it differs between topologies); layer 1: 8 certified heads."""
    opaque = LayerSpec("mla", 8, 1, 16, "bfloat16", "packed", "NHD", per_token_head_scales=True)
    heads = 8 // tp
    certified = LayerSpec("full", 8, heads, 16, "bfloat16", "packed", "HND")
    kv = [
        torch.full((blocks, 8, 16), float(rank + 1), dtype=torch.bfloat16),
        truth[:, rank * heads : (rank + 1) * heads].clone(),
    ]
    return kv, [opaque, certified], RankContext(tp, 8, rank)


def test_rows_must_match_the_layer_areas_unless_offsets_are_given() -> None:
    """A TP=2 worker on TP=4 rows used to read layer 1 at TP=2's (shifted) area offset."""
    truth = torch.randn(6, 8, 8, 32).to(torch.bfloat16)  # (blocks, heads, tokens, K|V)
    layers = [mixed_layers(4, rank, truth) for rank in range(4)]
    _, specs, ctx = layers[0]
    pages = torch.zeros(
        4, canonical_row_bytes([g[0] for g in group_layer_mappings(specs, ctx)]), dtype=torch.uint8
    )
    writers = [OffloadWorker(kv, specs, ctx, pages) for kv, specs, ctx in layers]
    for writer in writers:
        writer.store(block_ids=[0, 1], page_ids=[2, 3])
    tp4_rows = writers[0].row_bytes
    assert writers[0].area_offsets == [0, 4 * 8 * 16 * 2]

    kv, specs, ctx = mixed_layers(2, 1, torch.zeros_like(truth))
    tp2_rows = canonical_row_bytes([g[1] for g in group_layer_mappings(specs, ctx)])
    assert tp2_rows < tp4_rows
    with pytest.raises(
        ValueError,
        match=rf"cpu_pages: expected rows of exactly {tp2_rows} bytes .* got rows "
        rf"of {tp4_rows} bytes.*area_offsets=",
    ):
        OffloadWorker(kv, specs, ctx, pages)
    reader = OffloadWorker(kv, specs, ctx, pages, area_offsets=writers[0].area_offsets)
    assert reader.storage_namespace != writers[0].storage_namespace  # its opaque bytes differ
    reader.load(block_ids=[4, 5], page_ids=[2, 3])
    assert torch.equal(kv[1][4:6], truth[0:2, 4:8])  # the certified layer, bit-exact
    with pytest.raises(ValueError, match=r"cpu_pages: expected rows of at least"):
        OffloadWorker(kv, specs, ctx, pages, area_offsets=[0, tp4_rows - 100])


def test_spec_mismatch_ignores_strides_of_size_one_dims() -> None:
    one_head = torch.zeros(4, 1, 16, 64, dtype=torch.bfloat16)  # contiguous: HND strides
    for order in ("NHD", "HND"):  # one head: both orders address the same bytes
        assert (
            spec_mismatch(one_head, LayerSpec("full", 16, 1, 32, "bf16", "packed", order)) is None
        )
    latent = torch.zeros(4, 16, 64, dtype=torch.bfloat16)
    assert spec_mismatch(latent, LayerSpec("mla", 16, 1, 64, "bfloat16", "packed", "NHD")) is None
    problem = spec_mismatch(latent, LayerSpec("mla", 16, 1, 32, "bfloat16", "packed", "NHD"))
    assert "shape (num_blocks, 16, 32)" in problem


def test_physical_layouts_tell_apart_engines_whose_unrecognised_pages_differ() -> None:
    """An opaque layer of unknown layout: the worker names its page's physical layout, and a
    namespace built with it differs from one of the same page size laid out otherwise."""
    from canonical_ops.engine import physical_layout
    from canonical_ops.units import ModelIdentity, StoreNamespace

    worker, kv, _ = setup()
    assert worker.physical_layouts[:2] == [None, None]  # certified layers need none
    assert worker.physical_layouts[2] == physical_layout(kv[2])
    assert physical_layout(kv[2]) == "bfloat16 block [4, 16, 64] strides [4096, 1024, 64, 1]"
    swapped = kv[2].transpose(1, 2).contiguous()  # same bytes per block, tokens before heads
    assert physical_layout(swapped) == "bfloat16 block [16, 4, 64] strides [4096, 256, 64, 1]"

    def namespace(layouts):
        spec = LayerSpec("full", 16, 4, 32, "bfloat16", "packed", "HND")
        return StoreNamespace.from_specs(
            ModelIdentity("m"),
            [spec, spec, None],
            RankContext(2, 8, 0),
            fallback_page_sizes=[k.stride(0) * 2 for k in kv],
            fallback_layouts=layouts,
            block_size=16,
        )

    ours = namespace(worker.physical_layouts)
    assert ours.layers[2].physical == physical_layout(kv[2])
    assert ours.digest != namespace([None, None, physical_layout(swapped)]).digest
