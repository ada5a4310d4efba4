"""CanonicalOffloadingWorker puts every byte where vLLM's canonical descriptors would.

For configurations derived by vLLM's own ``derive_canonical_mappings`` (via vLLM's
connector worker ``register_kv_caches``), every rank of the group stores the same
jobs through our worker into one shared vLLM ``SharedOffloadRegion`` and, through
vLLM's descriptors (helpers.vllm_harness.VllmDescriptorReference), into a second one. The two
regions must be identical byte for byte; loads must then restore each rank's
pages bit-exact (into other GPU blocks), for both.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from helpers.emulated_stream import EmulatedCuda
from helpers.vllm_harness import (
    BLOCK_SIZE,
    FULL_LAYOUTS,
    PAGE_ALIGN,
    Layer,
    Model,
    VllmDescriptorReference,
    job_pairs,
    load_targets,
    make_jobs,
    open_region,
    random_bits,
    region_bytes,
    row_bytes_for,
    vllm_canonical_kv_caches,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
    _opaque_fallback_mapping,
)
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

from canonical_ops.vllm import CanonicalOffloadingWorker

NUM_BLOCKS = 64
NUM_CHUNKS = 24


def single_group_plans(bpc: int) -> list[list[tuple[int, int]]]:
    """(first logical block index, count) per job: aligned, mid-chunk, one last sub-block."""
    return [
        [(0, 2 * bpc + 1)],
        [(bpc + 1 if bpc > 1 else 3, 5)],
        [(2 * bpc - 1, 1)],
        [(3 * bpc + bpc // 2, 2 * bpc)],
    ]


def vllm_ranks(vllm_config, model: Model, tp: int) -> list:
    """(kv tensors, CanonicalKVCaches) of every rank, as vLLM's connector derives them."""
    kcc = model.kv_cache_config(tp)
    ranks = []
    for rank in range(tp):
        vllm_config.parallel_config.rank = rank
        kv = model.rank_kv(tp, rank)
        ranks.append((kv, vllm_canonical_kv_caches(vllm_config, kcc, kv)))
    return ranks


def run_group(ranks, bpc: int, plans, *, row_slack=PAGE_ALIGN, seed: int = 0):
    """Store every job on every rank (ours and vLLM's reference), compare, then load back."""
    row = row_bytes_for(ranks[0][1], bpc, slack=row_slack)
    ours_id, ref_id = (f"ckv-{kind}-{uuid.uuid4().hex[:8]}" for kind in ("ours", "ref"))
    num_groups = len(ranks[0][1].group_data_refs)
    jobs = make_jobs(num_groups, bpc, NUM_BLOCKS, NUM_CHUNKS, plans, seed=seed)
    workers, references, regions = [], [], []
    try:
        for _, ckv in ranks:
            ours = open_region(ours_id, NUM_CHUNKS, row)
            regions.append(ours)
            workers.append(CanonicalOffloadingWorker(ckv, bpc, NUM_CHUNKS, ours))
            ref_region = open_region(ref_id, NUM_CHUNKS, row)
            regions.append(ref_region)
            references.append(VllmDescriptorReference(ckv, bpc, ref_region))

        # Stores: every rank, every job; sizes as vLLM's descriptors count them.
        for worker, reference in zip(workers, references):
            expected = {}
            for job_id, job in enumerate(jobs, start=1):
                assert worker.submit_store(job_id, job.gpu_spec(), job.cpu_spec())
                expected[job_id] = reference.run(job, store=True)
            results = {r.job_id: r for r in worker.get_finished()}
            assert sorted(results) == sorted(expected)
            for job_id, result in results.items():
                assert result.success
                assert result.transfer_size == expected[job_id]
                assert result.transfer_time is not None and result.transfer_time >= 0
            assert worker.get_finished() == []
            # Compared after each rank: a rank writing pages it is not elected for shows.
            assert_same_regions(regions[0], regions[1], row, workers.index(worker))

        # Loads: every rank restores every job into other blocks, bit-exact, via both paths.
        for (_, ckv), worker, reference in zip(ranks, workers, references):
            job_id = 100
            targets = []
            for index, job in enumerate(jobs):
                target = load_targets(job, NUM_BLOCKS, 0)
                targets.append(target)
                job_id += 1
                assert worker.submit_load(
                    job_id, job.cpu_spec(), target.gpu_spec(), expedited=bool(index % 2)
                )
            worker.wait(set(range(101, job_id + 1)))
            finished = worker.get_finished()
            assert sorted(r.job_id for r in finished) == list(range(101, job_id + 1))
            assert all(r.success for r in finished)
            check_restored(ckv, jobs, targets, bpc)
            # vLLM's descriptors restore the same pages (the reference itself is sound).
            for target in targets:
                zero_blocks(ckv, target)
            for target in targets:  # same chunks as the stores: vLLM's reference region
                reference.run(target, store=False)
            check_restored(ckv, jobs, targets, bpc)
    finally:
        for worker in workers:
            worker.shutdown()  # the worker owns its region
        references.clear()  # drop vLLM's views before unmapping the reference regions
        for region in regions[1::2]:
            region.cleanup()
    return ranks


def assert_same_regions(ours, ref, row: int, worker_rank: int) -> None:
    ours_bytes, ref_bytes = region_bytes(ours), region_bytes(ref)
    assert int(ref_bytes.count_nonzero()) > 0
    mismatch = (ours_bytes != ref_bytes).nonzero()
    assert mismatch.numel() == 0, (
        f"after rank {worker_rank}'s stores, {mismatch.numel()} region bytes differ from vLLM's "
        f"placement; first at byte {int(mismatch[0])} (row {int(mismatch[0]) // row}, offset "
        f"{int(mismatch[0]) % row})"
    )


def zero_blocks(ckv, job) -> None:
    for g, blocks in enumerate(job.gpu_blocks):
        for ref in ckv.group_data_refs[g]:
            tensor = ckv.tensors[ref.tensor_idx].tensor
            for block in blocks:
                tensor[block].zero_()


def check_restored(ckv, jobs, targets, bpc) -> None:
    for job, target in zip(jobs, targets):
        pairs = job_pairs(job, bpc)
        assert len(pairs) == len(job_pairs(target, bpc))
        for (g, block, page), (_, target_block, _) in zip(pairs, job_pairs(target, bpc)):
            for ref in ckv.group_data_refs[g]:
                tensor = ckv.tensors[ref.tensor_idx].tensor
                size = ref.page_size_bytes
                assert torch.equal(tensor[target_block][:size], tensor[block][:size]), (
                    f"group {g} tensor {ref.tensor_idx}: block {target_block} was not restored "
                    f"from page {page} (source block {block})"
                )


# --------------------------------------------------------------------------- scenarios


@pytest.mark.parametrize("bpc", [1, 4])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_of_8_heads_every_layout_and_a_fallback_layer(vllm_configs, tp, bpc):
    layers = [
        Layer(f"model.layers.{i}.self_attn.attn", kind) for i, kind in enumerate(FULL_LAYOUTS)
    ]
    layers.append(Layer("model.layers.4.self_attn.attn", "opaque"))
    model = Model(layers, total_heads=8, num_blocks=NUM_BLOCKS, seed=tp)
    ranks = vllm_ranks(vllm_configs("llama8", tp), model, tp)
    run_group(ranks, bpc, single_group_plans(bpc), seed=tp * 10 + bpc)
    # vLLM certified the four layouts and gave the fifth layer its opaque fallback.
    refs = ranks[-1][1].group_data_refs[0]
    assert [ref.mapping.parallelism_agnostic for ref in refs] == [True] * 4 + [False]
    fallback = refs[4].mapping
    assert fallback.runs[0].canonical_offset == (tp - 1) * fallback.local_page_size_bytes


@pytest.mark.parametrize("bpc", [1, 4])
def test_replicated_gqa_heads(vllm_configs, bpc):
    # 2 KV heads over TP=4: ranks (0, 1) and (2, 3) hold the same head and take turns.
    layers = [
        Layer("model.layers.0.self_attn.attn", "packed_nhd"),
        Layer("model.layers.1.self_attn.attn", "split_hnd"),
    ]
    model = Model(layers, total_heads=2, num_blocks=NUM_BLOCKS, seed=5)
    ranks = vllm_ranks(vllm_configs("llama2", 4), model, 4)
    run_group(ranks, bpc, single_group_plans(bpc), seed=bpc)
    mapping = ranks[1][1].group_data_refs[0][0].mapping
    assert (mapping.num_writers, mapping.writer_index) == (2, 1)


@pytest.mark.parametrize(("tp", "bpc"), [(2, 1), (4, 4)])
def test_mla_latent_stored_once(vllm_configs, tp, bpc):
    layers = [Layer(f"model.layers.{i}.self_attn.attn", "mla") for i in range(2)]
    model = Model(layers, total_heads=8, num_blocks=NUM_BLOCKS, seed=9)
    ranks = vllm_ranks(vllm_configs("llama8", tp), model, tp)
    run_group(ranks, bpc, single_group_plans(bpc), seed=tp + bpc)
    mapping = ranks[-1][1].group_data_refs[0][0].mapping
    assert (mapping.num_writers, mapping.writer_index) == (tp, tp - 1)
    assert mapping.canonical_page_size_bytes == BLOCK_SIZE * 576 * 2


def test_hybrid_groups_sharing_tensors(vllm_configs):
    # Two KV-cache groups (full + sliding window) whose layers alias the same tensors,
    # as vLLM's hybrid allocator lays them out; jobs touch one group or both.
    # Group 1 lists its layers in the other order, so its refs are (tensor 1, tensor 0).
    layers = [
        Layer("model.layers.0.self_attn.attn", "packed_nhd", group=0),
        Layer("model.layers.1.self_attn.attn", "split_hnd", group=0),
        Layer(
            "model.layers.2.self_attn.attn",
            "split_hnd",
            group=1,
            alias_of="model.layers.1.self_attn.attn",
        ),
        Layer(
            "model.layers.3.self_attn.attn",
            "packed_nhd",
            group=1,
            alias_of="model.layers.0.self_attn.attn",
        ),
    ]
    model = Model(layers, total_heads=8, num_blocks=NUM_BLOCKS, seed=11)
    bpc = 4
    plans = [
        [(1, 5), (6, 3)],
        [(0, 4), (0, 0)],
        [(0, 0), (3, 2)],
        [(8, 9), (13, 1)],
    ]
    ranks = vllm_ranks(vllm_configs("llama8", 2), model, 2)
    run_group(ranks, bpc, plans, seed=2)
    ckv = ranks[0][1]
    assert len(ckv.tensors) == 2
    assert [[ref.tensor_idx for ref in refs] for refs in ckv.group_data_refs] == [[0, 1], [1, 0]]


def test_refs_with_smaller_canonical_pages_use_the_tensor_cell():
    """Refs sharing a tensor with different canonical page sizes: sub-block j sits at
    j x the tensor's cell (its largest canonical page), as vLLM's views place it."""
    gen = torch.Generator().manual_seed(4)
    tensors, refs = [], [[], []]
    for t, (big, small) in enumerate([(4096, 2048), (1024, 1024)]):
        data = random_bits((NUM_BLOCKS, big // 2), generator=gen).view(torch.int8)
        tensors.append(CanonicalKVCacheTensor(tensor=data, page_size_bytes=big))
        refs[0].append(CanonicalKVCacheRef(t, big, _opaque_fallback_mapping(big, 1, 0)))
        refs[1].insert(0, CanonicalKVCacheRef(t, small, _opaque_fallback_mapping(small, 1, 0)))
    ckv = CanonicalKVCaches(tensors=tensors, group_data_refs=refs)
    plans = [[(1, 5), (6, 3)], [(0, 0), (2, 7)], [(4, 4), (0, 0)]]
    run_group([(None, ckv)], 4, plans, seed=7)


@pytest.mark.parametrize("kinds", [FULL_LAYOUTS, ("mla", "mla")], ids=["full", "mla"])
def test_cross_topology_tp4_store_tp2_and_tp1_load(vllm_configs, kinds):
    """Canonical pages written by TP=4 are read by TP=2 and TP=1 (every certified layout)."""
    layers = [Layer(f"model.layers.{i}.self_attn.attn", kind) for i, kind in enumerate(kinds)]
    model = Model(layers, total_heads=8, num_blocks=NUM_BLOCKS, seed=21)
    bpc = 4
    jobs = make_jobs(1, bpc, NUM_BLOCKS, NUM_CHUNKS, single_group_plans(bpc), seed=3)
    engine = f"ckv-x-{uuid.uuid4().hex[:8]}"
    workers = []

    def worker_for(tp, rank, zero):
        config = vllm_configs("llama8", tp)
        config.parallel_config.rank = rank
        kv = model.rank_kv(tp, rank, zero=zero)
        ckv = vllm_canonical_kv_caches(config, model.kv_cache_config(tp), kv)
        region = open_region(engine, NUM_CHUNKS, row_bytes_for(ckv, bpc))
        worker = CanonicalOffloadingWorker(ckv, bpc, NUM_CHUNKS, region)
        workers.append(worker)
        return worker, kv

    try:
        for rank in range(4):
            writer, _ = worker_for(4, rank, zero=False)
            for job_id, job in enumerate(jobs, start=1):
                writer.submit_store(job_id, job.gpu_spec(), job.cpu_spec())
        for tp in (2, 1):
            for rank in range(tp):
                reader, kv = worker_for(tp, rank, zero=True)
                for job_id, job in enumerate(jobs, start=1):
                    reader.submit_load(job_id, job.cpu_spec(), job.gpu_spec())
                assert all(r.success for r in reader.get_finished())
                truth = model.rank_kv(tp, rank)
                for job in jobs:
                    blocks = [b for bs in job.gpu_blocks for b in bs]
                    for name in truth:
                        assert torch.equal(
                            kv[name][blocks].view(torch.int16),
                            truth[name][blocks].view(torch.int16),
                        ), f"TP={tp} rank {rank} {name}: wrong bytes after loading TP=4 pages"
    finally:
        for worker in workers:
            worker.shutdown()


def test_cuda_job_path_emulated_matches_the_cpu_worker(vllm_configs, monkeypatch):
    """The CUDA job path (canonical_ops.transfer, emulated on the CPU with a stand-in side
    stream per direction): jobs are reported once their stream ran, in order, with the CPU
    worker's sizes and bytes; an expedited load is not queued behind a regular one; a
    refused pair fails its job alone."""
    layers = [
        Layer(f"model.layers.{i}.self_attn.attn", kind) for i, kind in enumerate(FULL_LAYOUTS)
    ]
    model = Model(layers, total_heads=8, num_blocks=NUM_BLOCKS, seed=13)
    tp, bpc = 2, 4
    ((_, ckv),) = vllm_ranks(vllm_configs("llama8", tp), model, tp)[1:]
    jobs = make_jobs(1, bpc, NUM_BLOCKS, NUM_CHUNKS, single_group_plans(bpc), seed=6)
    row = row_bytes_for(ckv, bpc)
    fail = {}
    cuda = EmulatedCuda(monkeypatch, fail)
    emulated, plain = (
        CanonicalOffloadingWorker(
            ckv, bpc, NUM_CHUNKS, open_region(f"ckv-{kind}-{uuid.uuid4().hex[:8]}", NUM_CHUNKS, row)
        )
        for kind in ("emulated", "plain")
    )
    try:
        streams = {d.name: cuda.attach(d.queue, timing=True) for d in emulated._directions}
        for job_id, job in enumerate(jobs, start=1):
            assert emulated.submit_store(job_id, job.gpu_spec(), job.cpu_spec())
            plain.submit_store(job_id, job.gpu_spec(), job.cpu_spec())
        assert emulated.get_finished() == [] and not emulated.cpu_pages.any()
        streams["store"].run()
        results, expected = emulated.get_finished(), plain.get_finished()
        assert [r.job_id for r in results] == [r.job_id for r in expected] == [1, 2, 3, 4]
        for result, want in zip(results, expected):
            assert result.success and result.transfer_time >= 0
            assert result.transfer_size == want.transfer_size
        assert emulated.cpu_pages.any() and torch.equal(emulated.cpu_pages, plain.cpu_pages)
        targets = [load_targets(job, NUM_BLOCKS, 0) for job in jobs[:2]]
        emulated.submit_load(101, jobs[0].cpu_spec(), targets[0].gpu_spec())
        emulated.submit_load(102, jobs[1].cpu_spec(), targets[1].gpu_spec(), expedited=True)
        emulated.wait({102})  # its own stream only: the regular load stays queued
        assert [r.job_id for r in emulated.get_finished()] == [102]
        streams["load"].run()
        assert [(r.job_id, r.success) for r in emulated.get_finished()] == [(101, True)]
        check_restored(ckv, jobs[:2], targets, bpc)
        fail["pair"] = 0
        emulated.submit_store(201, jobs[2].gpu_spec(), jobs[2].cpu_spec())
        emulated.submit_store(202, jobs[3].gpu_spec(), jobs[3].cpu_spec())
        emulated.wait({201, 202})
        assert [(r.job_id, r.success) for r in emulated.get_finished()] == [
            (201, False),
            (202, True),
        ]
    finally:
        emulated.shutdown()
        plain.shutdown()


@pytest.mark.cuda
def test_cuda_worker_matches_the_cpu_worker(vllm_configs):
    """On a GPU: the CUDA kernels place and restore exactly what the (vLLM-verified) CPU
    path does, on pinned shared regions, with events, streams and expedited loads."""
    layers = [
        Layer(f"model.layers.{i}.self_attn.attn", kind) for i, kind in enumerate(FULL_LAYOUTS)
    ]
    layers.append(Layer("model.layers.4.self_attn.attn", "opaque"))
    model = Model(layers, total_heads=8, num_blocks=NUM_BLOCKS, seed=31)
    tp, bpc = 2, 4
    ranks = vllm_ranks(vllm_configs("llama8", tp), model, tp)
    jobs = make_jobs(1, bpc, NUM_BLOCKS, NUM_CHUNKS, single_group_plans(bpc), seed=5)
    row = row_bytes_for(ranks[0][1], bpc)
    gpu_id, cpu_id = (f"ckv-{kind}-{uuid.uuid4().hex[:8]}" for kind in ("gpu", "cpu"))
    pairs, workers = [], []
    try:
        for _, ckv in ranks:
            on_gpu = CanonicalKVCaches(
                [CanonicalKVCacheTensor(t.tensor.cuda(), t.page_size_bytes) for t in ckv.tensors],
                ckv.group_data_refs,
            )
            gpu = CanonicalOffloadingWorker(
                on_gpu, bpc, NUM_CHUNKS, open_region(gpu_id, NUM_CHUNKS, row)
            )
            workers.append(gpu)
            cpu = CanonicalOffloadingWorker(
                ckv, bpc, NUM_CHUNKS, open_region(cpu_id, NUM_CHUNKS, row)
            )
            workers.append(cpu)
            pairs.append((gpu, cpu, on_gpu, ckv))
        for gpu, cpu, _, _ in pairs:
            for job_id, job in enumerate(jobs, start=1):
                gpu.submit_store(job_id, job.gpu_spec(), job.cpu_spec())
                cpu.submit_store(job_id, job.gpu_spec(), job.cpu_spec())
            gpu.wait(set(range(1, len(jobs) + 1)))
            results = {r.job_id: r for r in gpu.get_finished()}
            expected = {r.job_id: r for r in cpu.get_finished()}
            assert sorted(results) == sorted(expected)
            for job_id, result in results.items():
                assert result.success and result.transfer_time >= 0
                assert result.transfer_size == expected[job_id].transfer_size
        assert torch.equal(pairs[0][0].cpu_pages, pairs[0][1].cpu_pages)
        for gpu, cpu, on_gpu, ckv in pairs:
            targets = [load_targets(job, NUM_BLOCKS, 0) for job in jobs]
            for job_id, (job, target) in enumerate(zip(jobs, targets), start=101):
                gpu.submit_load(
                    job_id, job.cpu_spec(), target.gpu_spec(), expedited=job_id % 2 == 0
                )
                cpu.submit_load(job_id, job.cpu_spec(), target.gpu_spec())
            gpu.wait(set(range(101, 101 + len(jobs))))
            assert all(r.success for r in gpu.get_finished())
            torch.cuda.synchronize()
            for t_gpu, t_cpu in zip(on_gpu.tensors, ckv.tensors):
                assert torch.equal(t_gpu.tensor.cpu(), t_cpu.tensor.contiguous())
    finally:
        for worker in workers:
            worker.shutdown()


@pytest.mark.cuda
def test_cuda_get_finished_does_not_wait_for_the_compute_stream(vllm_configs):
    """get_finished() reports a finished job while a long kernel runs on the compute stream
    (each job's own error record is read on the host: no copy queued behind model work)."""
    import time

    model = Model([Layer("model.layers.0.self_attn.attn", FULL_LAYOUTS[0])], total_heads=8,
                  num_blocks=NUM_BLOCKS, seed=41)  # fmt: skip
    tp, bpc = 1, 2
    ((_, ckv),) = vllm_ranks(vllm_configs("llama8", tp), model, tp)
    on_gpu = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t.tensor.cuda(), t.page_size_bytes) for t in ckv.tensors],
        ckv.group_data_refs,
    )
    region_id = f"ckv-busy-{uuid.uuid4().hex[:8]}"
    worker = CanonicalOffloadingWorker(
        on_gpu, bpc, NUM_CHUNKS, open_region(region_id, NUM_CHUNKS, row_bytes_for(ckv, bpc))
    )
    try:
        job = make_jobs(1, bpc, NUM_BLOCKS, NUM_CHUNKS, single_group_plans(bpc), seed=2)[0]
        worker.submit_store(1, job.gpu_spec(), job.cpu_spec())
        worker.wait({1})
        rate = torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate
        torch.cuda._sleep(int(1.0 * rate * 1000))  # ~1 s on the compute stream
        start = time.perf_counter()
        results = worker.get_finished()
        assert time.perf_counter() - start < 0.2, "get_finished() waited for the compute stream"
        assert [r.job_id for r in results] == [1] and results[0].success
    finally:
        torch.cuda.synchronize()
        worker.shutdown()
