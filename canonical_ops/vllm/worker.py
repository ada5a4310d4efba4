"""CanonicalOffloadingWorker: vLLM's OffloadingWorker, moving bytes with torch.ops.canonical.

Carves vLLM's shared region as its CPU worker does and builds one plan per KV-cache group, so a
job is one op call per group it touches; jobs run on :class:`~canonical_ops.transfer.TransferQueue`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

import layouts
from canonical_ops.checks import check_ids, check_int
from canonical_ops.plan import check_kernels, make_plan
from canonical_ops.transfer import PlanCall, QueuedTransfer, TransferQueue, register_host_memory
from layouts.cli import escape_text

__all__ = ["CanonicalOffloadingWorker", "canonical_cell_sizes", "uncertified_refs"]

logger = logging.getLogger(__name__)

# CUDA launches take at most this many layers (kernels/include/canonical/launch.h).
MAX_LAYERS_PER_PLAN = 496

# vLLM registers its region in chunks of VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB (default 64 GiB):
# the driver's bookkeeping table per call caps one registration (NVRM page-table limit).
DEFAULT_REGISTER_CHUNK_GB = 64

UNCERTIFIED_REASON = (
    "canonical_layout was requested but the KV cache layout could not be certified for "
    "canonical offload: vLLM derived no canonical mapping for {what} (offload workers must be "
    "exactly the TP group, and packed / cross-layer KV layouts are not supported). Remove "
    "canonical_layout from kv_connector_extra_config, or use a spec without it."
)


def _spec_ids(name: str, ids) -> np.ndarray:
    """A job spec's ids (vLLM's integer arrays of any width and shape) as int64; non-integers
    are refused, never rounded."""
    array = np.asarray(ids)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    return check_ids(name, array.ravel())


def uncertified_refs(kv_caches: CanonicalKVCaches) -> list[tuple[int, int]]:
    """(group, ref index) of every ref without a canonical mapping."""
    return [
        (g, i)
        for g, refs in enumerate(kv_caches.group_data_refs)
        for i, ref in enumerate(refs)
        if ref.mapping is None
    ]


def canonical_cell_sizes(kv_caches: CanonicalKVCaches) -> list[int]:
    """Canonical bytes per block of each KV tensor: the largest canonical page of its refs
    (its cell in a chunk row, times blocks_per_chunk, as vLLM's CPU worker sizes its views).
    RuntimeError if a ref has no canonical mapping (:func:`uncertified_refs`)."""
    missing = uncertified_refs(kv_caches)
    if missing:
        where = ", ".join(f"group {g} ref {i}" for g, i in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise RuntimeError(UNCERTIFIED_REASON.format(what=f"{where}{more}"))
    sizes = [0] * len(kv_caches.tensors)
    for refs in kv_caches.group_data_refs:
        for ref in refs:
            sizes[ref.tensor_idx] = max(
                sizes[ref.tensor_idx], ref.mapping.canonical_page_size_bytes
            )
    unused = [t for t, size in enumerate(sizes) if size <= 0]
    if unused:
        raise ValueError(
            f"kv_caches: tensors {unused} have no ref with a non-empty canonical page "
            "(every KV tensor needs a cell in the canonical layout)"
        )
    return sizes


def _as_layouts_mapping(mapping, page_stride: int) -> layouts.CanonicalPageMapping:
    """vLLM's CanonicalPageMapping as ours, its page widened to the tensor's cell (vLLM places
    sub-block ``j`` of a chunk at ``j * cell``, the plan at ``j * canonical_page_size``)."""
    fields = [f.name for f in dataclasses.fields(layouts.CopyRun)]
    runs = tuple(layouts.CopyRun(*(int(getattr(r, f)) for f in fields)) for r in mapping.runs)
    return layouts.CanonicalPageMapping(
        canonical_page_size_bytes=int(page_stride),
        local_page_size_bytes=int(mapping.local_page_size_bytes),
        runs=runs,
        num_writers=int(mapping.num_writers),
        writer_index=int(mapping.writer_index),
        parallelism_agnostic=bool(mapping.parallelism_agnostic),
    )


@dataclass
class _GroupPlan:
    calls: list[tuple[list[torch.Tensor], torch.Tensor]]  # a KV-cache group's plans
    share: layouts.RankShare  # this rank's bytes per page, per ref (as vLLM counts)


def _register_chunk_bytes() -> int:
    """vLLM's registration chunk (VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB, default 64 GiB), in
    bytes, clamped to [64 MiB, 512 GiB] and 2 MiB-aligned as vLLM does."""
    raw = os.environ.get("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB", str(DEFAULT_REGISTER_CHUNK_GB))
    try:
        gib = int(raw)
    except ValueError:
        logger.warning("VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB=%r is not an int; using 64", raw)
        gib = DEFAULT_REGISTER_CHUNK_GB
    chunk = max(64 << 20, min(gib << 30, 512 << 30))
    return chunk - chunk % (2 << 20)


class _Direction:
    """Jobs of one direction (stores, loads or expedited loads) and its queue."""

    def __init__(self, name: str, queue: TransferQueue) -> None:
        self.name, self.queue = name, queue
        self.jobs: dict[int, tuple[int, QueuedTransfer]] = {}  # id -> (bytes, job), in order

    def finished(self) -> list[TransferResult]:
        """Jobs done, in order: one event query each, no CUDA call on the compute stream."""
        results = []
        for job_id, (num_bytes, job) in list(self.jobs.items()):
            if not job.ready():
                break
            del self.jobs[job_id]
            self.queue.finish(job)
            if job.error is not None:
                logger.error(
                    "canonical %s job %d failed: %s", self.name, job_id, escape_text(str(job.error))
                )
            results.append(TransferResult(job_id, job.error is None, num_bytes, job.seconds))
        return results

    def wait(self, job_ids) -> None:
        for job_id in job_ids:
            if job_id in self.jobs:
                self.queue.synchronize(self.jobs[job_id][1])

    def drain(self) -> None:
        for _, job in self.jobs.values():
            self.queue.synchronize(job)
        self.jobs.clear()


class CanonicalOffloadingWorker(OffloadingWorker):
    """vLLM ``OffloadingWorker`` whose transfers are ``torch.ops.canonical`` calls, over this
    rank's KV tensors (CUDA or CPU; every ref with a canonical mapping) and the engine's
    ``mmap_region``, whose views it carves and, once built, owns (:meth:`shutdown`)."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_cpu_chunks: int,
        mmap_region: SharedOffloadRegion,
    ) -> None:
        if mmap_region is None:
            raise ValueError(
                "mmap_region: the canonical layout needs vLLM's SharedOffloadRegion "
                "(shared by every rank of the engine), got None"
            )
        blocks_per_chunk = check_int("blocks_per_chunk", blocks_per_chunk, minimum=1)
        num_cpu_chunks = check_int("num_cpu_chunks", num_cpu_chunks, minimum=0)
        if not kv_caches.tensors:
            raise ValueError("kv_caches: expected at least one KV tensor, got none")
        self.cell_sizes = canonical_cell_sizes(kv_caches)
        if num_cpu_chunks != mmap_region.num_chunks:
            raise ValueError(
                f"num_cpu_chunks: the region has {mmap_region.num_chunks} chunks, "
                f"got {num_cpu_chunks}"
            )

        self.blocks_per_chunk = blocks_per_chunk
        self.num_cpu_chunks = num_cpu_chunks
        self.group_refs: list[list[CanonicalKVCacheRef]] = [
            list(refs) for refs in kv_caches.group_data_refs
        ]
        self.kv_tensors = [t.tensor for t in kv_caches.tensors]
        self.device = self.kv_tensors[0].device
        try:
            check_kernels(self.device, "CanonicalOffloadingWorker")
        except RuntimeError as error:
            raise RuntimeError(
                f"{error}. vLLM's TieringOffloadingSpec writes the same canonical bytes "
                f"without canonical_ops' kernels"
            ) from error

        # The region's canonical views, carved as vLLM's CPU worker carves them.
        self.views = [
            mmap_region.create_next_canonical_view(size * self.blocks_per_chunk)
            for size in self.cell_sizes
        ]
        base = mmap_region.base_tensor
        self.row_bytes = row_stride = int(self.views[0].stride(0))  # the region's chunk row stride
        self.cell_offsets = [
            int(v.storage_offset()) - int(base.storage_offset()) for v in self.views
        ]
        # Every rank's plan addresses this one (num_chunks, row_stride) byte matrix.
        self.cpu_pages = torch.as_strided(
            base.view(torch.uint8), (self.num_cpu_chunks, row_stride), (row_stride, 1), 0
        )
        self._region: SharedOffloadRegion | None = mmap_region
        if self.device.type == "cuda":
            self._pin(mmap_region)

        self.groups = [self._build_group(g, refs) for g, refs in enumerate(self.group_refs)]
        self._store, self._load, self._expedited = (
            _Direction(
                name, TransferQueue(self.device, self.cpu_pages, blocks_per_chunk, timing=True)
            )
            for name in ("store", "load", "expedited load")
        )
        self._directions = (self._store, self._load, self._expedited)
        logger.info(
            f"canonical-kv offloading worker: {len(self.kv_tensors)} KV tensors, "
            f"{len(self.groups)} group(s), {num_cpu_chunks} chunks x {blocks_per_chunk} "
            f"blocks, cells {self.cell_sizes} bytes per block, on {self.device}"
        )

    # ------------------------------------------------------------------ setup

    def _pin(self, region: SharedOffloadRegion) -> None:
        """Register the region with CUDA (the kernel addresses it directly): mapped and
        portable, in vLLM's chunk size, recorded on the region so that vLLM's ``cleanup``
        unregisters it; vLLM's own registration if that fails."""
        if not region.is_pinned:
            base, size = region.base_tensor.data_ptr(), region.total_size_bytes
            try:
                with torch.cuda.device(self.device):
                    chunks = register_host_memory(base, size, chunk_bytes=_register_chunk_bytes())
                region.pinned_addresses.extend(chunks)
                region.is_pinned = True
            except Exception:
                logger.warning("canonical-kv: mapped registration unavailable", exc_info=True)
                from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region

                pin_mmap_region(region, worker_slot_only=False)
        if not region.is_pinned or not self.cpu_pages.is_pinned():
            raise RuntimeError(
                "CanonicalOffloadingWorker: could not register the shared offload region with "
                "CUDA (cudaHostRegister failed; see the warning above), and the canonical "
                "kernels need device access to it. Check the memlock limit, or use vLLM's "
                "TieringOffloadingSpec, which copies from pageable memory"
            )

    def _build_group(self, g: int, refs: Sequence[CanonicalKVCacheRef]) -> _GroupPlan:
        # Identical refs (same tensor, same mapping) would copy the same bytes twice.
        layers = list(dict.fromkeys((ref.tensor_idx, ref.mapping) for ref in refs))
        bpc = self.blocks_per_chunk
        kv_lists, plans = [], []
        for first in range(0, len(layers), MAX_LAYERS_PER_PLAN):
            part = layers[first : first + MAX_LAYERS_PER_PLAN]
            mappings = [_as_layouts_mapping(m, self.cell_sizes[t]) for t, m in part]
            kvs = [self.kv_tensors[t] for t, _ in part]
            offsets = [self.cell_offsets[t] for t, _ in part]
            try:
                plan = make_plan(
                    mappings, kvs, self.cpu_pages, pages_per_row=bpc, area_offsets=offsets
                )
                # A transfer of no pairs runs every argument check now, at startup.
                empty = torch.empty(0, dtype=torch.int64, device=self.device)
                torch.ops.canonical.canonical_load(kvs, self.cpu_pages, plan, empty, empty)
            except (ValueError, TypeError, RuntimeError) as error:
                raise RuntimeError(
                    f"CanonicalOffloadingWorker: KV-cache group {g} cannot be planned: {error}"
                ) from error
            kv_lists.append(kvs)
            plans.append(plan)
        # Bytes as vLLM counts them: every ref, its own local page and writer turn.
        share = layouts.RankShare(
            [_as_layouts_mapping(ref.mapping, self.cell_sizes[ref.tensor_idx]) for ref in refs]
        )
        return _GroupPlan(calls=list(zip(kv_lists, plans)), share=share)

    # ------------------------------------------------------------------ jobs

    def job_pairs(
        self, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per group touched by a job: (group, GPU block ids, canonical page ids), int64, in
        vLLM's enumeration (group ``g`` takes ``group_sizes[g]`` GPU blocks and the chunks they
        fill after skipping ``block_indices[g] % bpc`` sub-blocks of its first)."""
        if not isinstance(gpu_spec, GPULoadStoreSpec):
            raise TypeError(f"expected a GPULoadStoreSpec, got {type(gpu_spec).__name__}")
        if not isinstance(cpu_spec, BlockIDsLoadStoreSpec):
            raise TypeError(
                f"expected a CPU spec with chunk ids (CPULoadStoreSpec), got "
                f"{type(cpu_spec).__name__}"
            )
        gpu_blocks = _spec_ids("GPU spec block_ids", gpu_spec.block_ids)
        chunks = _spec_ids("CPU spec block_ids", cpu_spec.block_ids)
        sizes, indices = list(gpu_spec.group_sizes), list(gpu_spec.block_indices)
        if len(sizes) != len(self.groups) or len(indices) != len(self.groups):
            raise ValueError(
                f"GPU spec: expected group_sizes and block_indices for {len(self.groups)} "
                f"KV-cache group(s), got {len(sizes)} and {len(indices)}"
            )
        if sum(sizes) != len(gpu_blocks):
            raise ValueError(
                f"GPU spec: group_sizes sum to {sum(sizes)} but it has {len(gpu_blocks)} block ids"
            )
        bpc = self.blocks_per_chunk
        out = []
        gpu_at = chunk_at = 0
        for g, (size, index) in enumerate(zip(sizes, indices)):
            size = int(size)
            if size == 0:
                continue
            skip = int(index) % bpc
            num_chunks = -(-(skip + size) // bpc)
            group_chunks = chunks[chunk_at : chunk_at + num_chunks]
            if len(group_chunks) != num_chunks:
                raise ValueError(
                    f"CPU spec: group {g} needs {num_chunks} chunk ids from position "
                    f"{chunk_at}, the spec has {len(chunks)}"
                )
            sub = np.arange(skip, skip + size, dtype=np.int64)
            pages = group_chunks[sub // bpc] * bpc + sub % bpc
            out.append((g, gpu_blocks[gpu_at : gpu_at + size], pages))
            gpu_at += size
            chunk_at += num_chunks
        if chunk_at != len(chunks):
            raise ValueError(
                f"CPU spec: the job's groups use {chunk_at} chunk ids, the spec has {len(chunks)}"
            )
        if chunks.size and (chunks.min() < 0 or chunks.max() >= self.num_cpu_chunks):
            raise IndexError(
                f"CPU spec: chunk ids must lie in [0, {self.num_cpu_chunks}), got "
                f"[{chunks.min()}, {chunks.max()}]"
            )
        for g, blocks, _ in out:
            sizes = [int(kv.size(0)) for kvs, _ in self.groups[g].calls for kv in kvs]
            num_blocks = min(sizes) if sizes else None  # a group without layers moves nothing
            if num_blocks is not None and (blocks.min() < 0 or blocks.max() >= num_blocks):
                raise IndexError(
                    f"GPU spec: group {g}'s block ids must lie in [0, {num_blocks}), got "
                    f"[{blocks.min()}, {blocks.max()}]"
                )
        return out

    def _submit(self, direction: _Direction, job_id: int, store: bool, gpu_spec, cpu_spec) -> bool:
        if job_id in direction.jobs:
            raise ValueError(f"job {job_id} is already in flight")
        pairs = self.job_pairs(gpu_spec, cpu_spec)
        num_bytes = 0
        for g, _, pages in pairs:
            share = self.groups[g].share
            num_bytes += share.store_bytes(pages) if store else share.load_bytes(len(pages))
        calls = [PlanCall(self.groups[g].calls, blocks, pages) for g, blocks, pages in pairs]
        direction.jobs[job_id] = (num_bytes, direction.queue.submit(store, calls))
        return True

    # ------------------------------------------------------------------ OffloadingWorker

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Store a job's GPU blocks into its CPU chunks (this rank's elected bytes only)."""
        return self._submit(self._store, job_id, True, src_spec, dst_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Load a job's CPU chunks into its GPU blocks; expedited loads use their own stream."""
        direction = self._expedited if expedited else self._load
        return self._submit(direction, job_id, False, dst_spec, src_spec)

    def get_finished(self) -> list[TransferResult]:
        return [r for direction in self._directions for r in direction.finished()]

    def wait(self, job_ids: set[int]) -> None:
        for direction in self._directions:
            direction.wait(job_ids)

    def shutdown(self) -> None:
        failed: BaseException | None = None
        for direction in self._directions:
            try:
                direction.drain()
            except Exception as error:  # keep draining the others, then clean up
                logger.exception("canonical-kv: draining %s jobs failed", direction.name)
                failed = failed or error
        if self._region is not None:
            self.views.clear()
            self.cpu_pages = None
            self.groups = []
            region, self._region = self._region, None
            region.cleanup()
        if failed is not None:
            raise failed
