"""Configurations vLLM refuses for the canonical layout fail at startup, with vLLM's reason.

Never a silent downgrade: no direct-layout bytes under a canonical namespace, no
opaque per-topology pages under a topology-shared one.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from helpers.vllm_harness import (
    Layer,
    Model,
    make_jobs,
    make_vllm_config,
    open_region,
    row_bytes_for,
    vllm_canonical_kv_caches,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

from canonical_ops.vllm import CanonicalOffloadingWorker

NUM_BLOCKS = 32
CERTIFIED = [
    Layer("model.layers.0.self_attn.attn", "packed_hnd"),
    Layer("model.layers.1.self_attn.attn", "split_nhd"),
]


def worker_connectors(config, model, tp):
    """Build the scheduler, then each rank's worker connector and register its caches."""
    kcc = model.kv_cache_config(tp)
    scheduler = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kcc)
    connectors = []
    try:
        for rank in range(tp):
            config.parallel_config.rank = rank
            connector = OffloadingConnector(config, KVConnectorRole.WORKER, kcc)
            connectors.append(connector)
            connector.register_kv_caches(model.rank_kv(tp, rank))
    finally:
        for connector in connectors:
            connector.shutdown()
        scheduler.shutdown()


def test_without_canonical_layout_the_spec_refuses(plugin_registered, models):
    config = make_vllm_config(models["llama8"], tp=1, extra={"canonical_layout": None})
    model = Model(CERTIFIED, total_heads=8, num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match='"canonical_layout": true'):
        OffloadingConnector(config, KVConnectorRole.SCHEDULER, model.kv_cache_config(1))


def test_missing_cpu_bytes_to_use_is_vllms_error(plugin_registered, models):
    config = make_vllm_config(models["llama8"], tp=1, extra={"cpu_bytes_to_use": None})
    model = Model(CERTIFIED, total_heads=8, num_blocks=NUM_BLOCKS)
    with pytest.raises(Exception, match="cpu_bytes_to_use must be specified"):
        OffloadingConnector(config, KVConnectorRole.SCHEDULER, model.kv_cache_config(1))


def test_store_threshold_is_refused_like_vllms_tiering(plugin_registered, models):
    config = make_vllm_config(models["llama8"], tp=1, extra={"store_threshold": 2})
    model = Model(CERTIFIED, total_heads=8, num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match="store_threshold is not supported"):
        OffloadingConnector(config, KVConnectorRole.SCHEDULER, model.kv_cache_config(1))


def test_a_cache_too_small_for_one_chunk_is_refused(plugin_registered, models):
    config = make_vllm_config(models["llama8"], tp=1, extra={"cpu_bytes_to_use": 1024})
    model = Model(CERTIFIED, total_heads=8, num_blocks=NUM_BLOCKS)
    connector = OffloadingConnector(config, KVConnectorRole.WORKER, model.kv_cache_config(1))
    try:
        with pytest.raises(ValueError, match="holds no chunk"):
            connector.register_kv_caches(model.rank_kv(1, 0))
    finally:
        connector.shutdown()


def test_opaque_layer_under_a_shared_namespace_is_refused(plugin_registered, models):
    # vLLM's config calls this topology portable, but one layer's tensor is a layout
    # vLLM cannot certify: it gets the opaque fallback, which must not be shared.
    layers = [*CERTIFIED, Layer("model.layers.2.self_attn.attn", "opaque")]
    config = make_vllm_config(models["llama8"], tp=2)
    with pytest.raises(RuntimeError, match="could not certify every layer as parallelism-agnostic"):
        worker_connectors(config, Model(layers, total_heads=8, num_blocks=NUM_BLOCKS), 2)


def test_cross_layer_packed_kv_is_refused(plugin_registered, models):
    # Both layers' pages interleaved per block (block stride = 2 pages): vLLM offloads
    # such a layout as one opaque region without a mapping, which canonical cannot take.
    layers = [Layer(f"model.layers.{i}.self_attn.attn", "packed_hnd") for i in range(2)]
    model = Model(layers, total_heads=8, num_blocks=NUM_BLOCKS)
    base = model.rank_kv(1, 0)
    names = list(base)
    packed = torch.stack([base[n] for n in names], dim=1)  # (N, 2, H, bs, 2hs)
    kv = {n: packed[:, i] for i, n in enumerate(names)}
    config = make_vllm_config(models["llama8"], tp=1)
    kcc = model.kv_cache_config(1)
    scheduler = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kcc)
    connector = OffloadingConnector(config, KVConnectorRole.WORKER, kcc)
    try:
        with pytest.raises(RuntimeError, match="could not be certified for canonical offload"):
            connector.register_kv_caches(kv)
    finally:
        connector.shutdown()
        scheduler.shutdown()


# --------------------------------------------------------------------------- worker


@pytest.fixture
def certified(vllm_configs):
    model = Model(CERTIFIED, total_heads=8, num_blocks=NUM_BLOCKS)
    config = vllm_configs("llama8", 1)
    config.parallel_config.rank = 0
    return vllm_canonical_kv_caches(config, model.kv_cache_config(1), model.rank_kv(1, 0))


@pytest.fixture
def region_for():
    opened = []

    def open_(ckv, bpc=1, chunks=8):
        region = open_region(f"ckv-fc-{uuid.uuid4().hex[:8]}", chunks, row_bytes_for(ckv, bpc))
        opened.append(region)
        return region

    yield open_
    for region in opened:
        region.cleanup()  # a no-op for regions a worker already cleaned up


def test_worker_refuses_a_ref_without_mapping(certified, region_for):
    refs = [
        [
            CanonicalKVCacheRef(r.tensor_idx, r.page_size_bytes, None)
            for r in certified.group_data_refs[0]
        ]
    ]
    region = region_for(certified)
    with pytest.raises(RuntimeError, match="could not be certified for canonical offload"):
        CanonicalOffloadingWorker(CanonicalKVCaches(certified.tensors, refs), 1, 8, region)


def test_worker_requires_the_shared_region(certified):
    with pytest.raises(ValueError, match="SharedOffloadRegion"):
        CanonicalOffloadingWorker(certified, 1, 8, None)


def test_worker_refuses_a_chunk_count_the_region_lacks(certified, region_for):
    with pytest.raises(ValueError, match="num_cpu_chunks"):
        CanonicalOffloadingWorker(certified, 1, 9, region_for(certified))


def test_worker_refuses_devices_without_kernels(certified, region_for):
    meta = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t.tensor.to("meta"), t.page_size_bytes) for t in certified.tensors],
        certified.group_data_refs,
    )
    with pytest.raises(RuntimeError, match="has kernels for CUDA and CPU"):
        CanonicalOffloadingWorker(meta, 1, 8, region_for(certified))


def test_worker_rejects_bad_jobs_before_copying(certified, region_for):
    worker = CanonicalOffloadingWorker(certified, 4, 8, region_for(certified, bpc=4))
    try:
        (job,) = make_jobs(1, 4, NUM_BLOCKS, 8, [[(1, 6)]])
        before = worker.cpu_pages.clone()
        bad_chunk = type(job)(job.gpu_blocks, job.block_indices, [job.chunks[0], 8])
        with pytest.raises(IndexError, match="chunk ids"):
            worker.submit_store(1, bad_chunk.gpu_spec(), bad_chunk.cpu_spec())
        bad_block = type(job)([[NUM_BLOCKS, *job.gpu_blocks[0][1:]]], job.block_indices, job.chunks)
        with pytest.raises(IndexError, match="block ids"):
            worker.submit_store(2, bad_block.gpu_spec(), bad_block.cpu_spec())
        short = type(job)(job.gpu_blocks, job.block_indices, job.chunks[:1])
        with pytest.raises(ValueError, match="chunk ids"):
            worker.submit_store(3, short.gpu_spec(), short.cpu_spec())
        assert torch.equal(worker.cpu_pages, before)
        assert worker.get_finished() == []
        assert worker.submit_store(4, job.gpu_spec(), job.cpu_spec())
        assert [r.job_id for r in worker.get_finished()] == [4]
        assert not np.array_equal(worker.cpu_pages.numpy(), before.numpy())
    finally:
        worker.shutdown()
