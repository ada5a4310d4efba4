"""CanonicalOffloadingSpec inside vLLM: plugin registration, scheduler and worker connectors.

Everything here goes through vLLM's own OffloadingConnector built from a real
VllmConfig (tiny local Llama config, CPU device, no download).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch
from helpers.vllm_harness import (
    Job,
    Layer,
    Model,
    VllmDescriptorReference,
    job_pairs,
    make_jobs,
    make_vllm_config,
    open_region,
    region_bytes,
    vllm_canonical_kv_caches,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from canonical_ops.vllm import CanonicalOffloadingSpec, CanonicalOffloadingWorker

NUM_BLOCKS = 64
LAYERS = [
    Layer("model.layers.0.self_attn.attn", "packed_nhd"),
    Layer("model.layers.1.self_attn.attn", "split_hnd"),
]


def test_importing_the_package_does_not_import_vllm():
    code = "import sys, canonical_ops.vllm; assert 'vllm' not in sys.modules, 'imported vllm'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.getcwd())


def test_general_plugin_registers_the_spec(plugin_registered):
    import vllm.plugins

    assert plugin_registered.name == "canonical_kv"
    # From scratch, as a fresh vLLM process does: the entry point registers the name.
    OffloadingSpecFactory._registry.pop("CanonicalOffloadingSpec", None)
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    spec_cls = OffloadingSpecFactory.get_spec_cls({"spec_name": "CanonicalOffloadingSpec"})
    assert spec_cls is CanonicalOffloadingSpec
    assert issubclass(spec_cls, TieringOffloadingSpec) and issubclass(spec_cls, CPUOffloadingSpec)
    # Without the plugin, vLLM's out-of-tree path finds the class by module.
    OffloadingSpecFactory._registry.pop("CanonicalOffloadingSpec")
    by_module = {"spec_name": "CanonicalOffloadingSpec", "spec_module_path": "canonical_ops.vllm"}
    assert OffloadingSpecFactory.get_spec_cls(by_module) is CanonicalOffloadingSpec
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    vllm.plugins.load_general_plugins()  # loading again is harmless
    import canonical_ops.vllm

    canonical_ops.vllm.register()  # and so is registering twice
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": "CanonicalOffloadingSpec"}) is spec_cls


@pytest.mark.parametrize("tiers", ["cpu", "cpu+fs"])
def test_scheduler_connector_keeps_vllms_manager(
    plugin_registered, models, monkeypatch, tmp_path, tiers
):
    created = []
    original = CanonicalOffloadingSpec.__init__

    def recording_init(self, config):
        original(self, config)
        created.append(self)

    monkeypatch.setattr(CanonicalOffloadingSpec, "__init__", recording_init)
    extra = {}
    if tiers == "cpu+fs":
        extra["secondary_tiers"] = [
            {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 1, "n_write_threads": 1}
        ]
    config = make_vllm_config(models["llama8"], tp=1, extra=extra)
    config.cache_config.kv_cache_layout = "LBNHC"  # resolved by the engine core in a real run
    model = Model(LAYERS, total_heads=8, num_blocks=NUM_BLOCKS)
    connector = OffloadingConnector(config, KVConnectorRole.SCHEDULER, model.kv_cache_config(1))
    try:
        assert len(created) == 1 and created[0].config.canonical_layout
        assert isinstance(connector.scheduler.manager, TieringOffloadingManager)
        assert created[0].num_chunks > 0
        if tiers == "cpu+fs":
            # vLLM's file tier, namespaced by the canonical format id as for vLLM's own worker.
            (tier,) = connector.scheduler.manager.secondary_tiers
            assert tier.file_mapper.fields["canonical_format"] == "v1-nhd"
    finally:
        connector.shutdown()


def test_worker_connectors_run_our_worker_end_to_end(plugin_registered, models):
    """Scheduler + TP=2 worker connectors: vLLM's worker-side code drives our worker."""
    tp, engine = 2, f"ckv-e2e-{uuid.uuid4().hex[:8]}"
    model = Model(LAYERS, total_heads=8, num_blocks=NUM_BLOCKS, seed=13)
    kcc = model.kv_cache_config(tp)
    config = make_vllm_config(models["llama8"], tp, engine_id=engine)
    scheduler = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kcc)
    connectors, kvs, references, ref_regions = [], [], [], []
    try:
        for rank in range(tp):
            config.parallel_config.rank = rank
            connector = OffloadingConnector(config, KVConnectorRole.WORKER, kcc)
            connectors.append(connector)
            kv = model.rank_kv(tp, rank)
            kvs.append(kv)
            connector.register_kv_caches(kv)
            worker = connector.connector_worker.worker
            assert isinstance(worker, CanonicalOffloadingWorker)
            # vLLM's descriptors over a region of the same geometry, for comparison.
            ckv = vllm_canonical_kv_caches(config, kcc, kv)
            region = open_region(f"{engine}-ref", worker.num_cpu_chunks, worker.row_bytes)
            ref_regions.append(region)
            references.append(VllmDescriptorReference(ckv, worker.blocks_per_chunk, region))

        bpc = connectors[0].connector_worker.worker.blocks_per_chunk
        jobs = make_jobs(1, bpc, NUM_BLOCKS, 16, [[(0, 3)], [(2, 4)]], seed=1)
        for connector, reference in zip(connectors, references):
            side = connector.connector_worker
            side.prepare_store_kv(
                OffloadingConnectorMetadata(
                    load_jobs={},
                    store_jobs={
                        i: TransferJob(f"req{i}", job.gpu_spec(), job.cpu_spec())
                        for i, job in enumerate(jobs, start=1)
                    },
                )
            )
            # Deferred stores are submitted at the next step's start.
            side.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
            assert side.get_finished(set()) == (set(), set())
            meta = side.build_connector_worker_meta()
            assert meta.completed_jobs == {1: 1, 2: 1}
            expected = sum(reference.run(job, store=True) for job in jobs)
            assert meta.transfer_stats.store.bytes == expected

        ours = connectors[0].connector_worker.worker.cpu_pages.reshape(-1)
        assert torch.equal(
            ours[: region_bytes(ref_regions[0]).numel()], region_bytes(ref_regions[0])
        )
        assert int(ours.count_nonzero()) > 0

        # Loads into fresh blocks: one synchronous (expedited), one asynchronous.
        for connector, kv in zip(connectors, kvs):
            side = connector.connector_worker
            targets = [
                Job(
                    [[NUM_BLOCKS // 2 + b for b in job.gpu_blocks[0]]],
                    job.block_indices,
                    job.chunks,
                )
                for job in jobs
            ]
            side.start_kv_transfers(
                OffloadingConnectorMetadata(
                    load_jobs={
                        10: TransferJob(
                            "sync", jobs[0].cpu_spec(), targets[0].gpu_spec(), sync=True
                        ),
                        11: TransferJob("async", jobs[1].cpu_spec(), targets[1].gpu_spec()),
                    },
                    store_jobs={},
                )
            )
            assert side.get_finished(set()) == (set(), {"async"})
            assert side.build_connector_worker_meta().completed_jobs == {10: 1, 11: 1}
            for job, target in zip(jobs, targets):
                for (_, block, _), (_, moved, _) in zip(
                    job_pairs(job, bpc), job_pairs(target, bpc)
                ):
                    for name, tensor in kv.items():
                        assert torch.equal(
                            tensor[moved].view(torch.int16), tensor[block].view(torch.int16)
                        ), name
    finally:
        for connector in connectors:
            connector.shutdown()
        references.clear()
        for region in ref_regions:
            region.cleanup()
        scheduler.shutdown()
