"""CanonicalOffloadingWorker: vLLM's OffloadingWorker, moving bytes with torch.ops.canonical.

Built once per worker rank from vLLM's ``CanonicalKVCaches`` (the KV tensors
and, per KV-cache group, one ref per layer carrying vLLM's
``CanonicalPageMapping``) and vLLM's ``SharedOffloadRegion``. At construction
it carves the region's canonical views exactly as vLLM's own CPU worker does
(one cell per KV tensor, consecutive in each chunk row, each cell as large as
the largest canonical page of the refs on that tensor) and builds one
transfer plan per KV-cache group from the refs' mappings. From then on a job
is ONE ``canonical_store`` / ``canonical_load`` call per KV-cache group it
touches (one for every non-hybrid model): no per-fragment descriptors on the
host, no per-job allocation beyond the id arrays.

Page placement (vLLM's canonical layout): GPU block ``i`` of group ``g`` in a
job whose first block has logical index ``b`` and whose CPU chunks are
``C_g`` goes to canonical page ``C_g[(s + i) // bpc] * bpc + (s + i) % bpc``
with ``s = b % bpc`` and ``bpc = blocks_per_chunk``; page ``p`` of the ref on
tensor ``t`` lives at chunk row ``p // bpc``, byte
``cell_offset[t] + (p % bpc) * cell_size[t]`` plus the fragment's canonical
offset. Stores write only the pages this rank is elected for
(``mapping.is_writer(p)``); loads restore every byte of the local pages.

Streams (CUDA): one for stores, one for loads and one for expedited loads, so
an expedited load never queues behind regular loads; each job is ordered
after the work already queued on the caller's current stream. On CPU (KV
tensors in host memory: tests, CPU-only runs) a job runs synchronously inside
``submit_*`` and is reported by the next ``get_finished``.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

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
from canonical_ops._extension import BUILT_WITH_CUDA
from canonical_ops.checks import check_ids, check_int
from canonical_ops.ops import CudaJobPools
from canonical_ops.plan import make_plan

__all__ = [
    "CanonicalOffloadingWorker",
    "canonical_cell_sizes",
    "register_host_memory",
    "uncertified_refs",
]

logger = logging.getLogger(__name__)

# CUDA launches take at most this many layers (kernels/include/canonical/launch.h).
MAX_LAYERS_PER_PLAN = 496

# cudaHostRegister flags: portable (every context) | mapped (a device address for it).
HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2
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
    """A job spec's ids as int64, refusing non-integers (never rounded) and accepting
    vLLM's integer arrays of any width and shape."""
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
    """Canonical bytes per block of each KV tensor: the largest canonical page of its refs.

    This is the size of the tensor's cell in a chunk row (times blocks_per_chunk),
    as vLLM's CPU worker sizes its canonical views.
    """
    sizes = [0] * len(kv_caches.tensors)
    for refs in kv_caches.group_data_refs:
        for ref in refs:
            if ref.mapping is None:
                raise ValueError(
                    UNCERTIFIED_REASON.format(what=f"a ref of tensor {ref.tensor_idx}")
                )
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
    """vLLM's CanonicalPageMapping as ours, its page widened to the tensor's cell.

    The plan places sub-block ``j`` of a chunk at ``j * canonical_page_size``
    within the layer's area; vLLM places it at ``j * cell`` (the largest
    canonical page among the refs sharing that tensor), so the page is
    declared ``cell`` bytes long. Fragments are unchanged.
    """
    runs = tuple(
        layouts.CopyRun(
            int(r.local_offset),
            int(r.canonical_offset),
            int(r.fragment_size),
            int(r.num_fragments),
            int(r.local_stride),
            int(r.canonical_stride),
        )
        for r in mapping.runs
    )
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
    """The plan(s) of one KV-cache group: its refs as plan layers."""

    kv_caches: list[list[torch.Tensor]]  # per plan: one tensor per layer
    plans: list[torch.Tensor]
    # Byte accounting, per ref (as vLLM counts): local page sizes and writer rotation.
    local_bytes: int
    writer_terms: list[tuple[int, int, int]]  # (num_writers, writer_index, local bytes)

    def store_bytes(self, page_ids: np.ndarray) -> int:
        total = 0
        for num_writers, writer_index, size in self.writer_terms:
            if num_writers == 1:
                total += size * len(page_ids)
            else:
                total += size * int(np.count_nonzero(page_ids % num_writers == writer_index))
        return total


def register_host_memory(
    cudart, base: int, size: int, *, chunk_bytes: int, flags: int = HOST_REGISTER_PORTABLE_MAPPED
) -> list[int] | None:
    """Register ``[base, base + size)`` with CUDA in chunks of at most ``chunk_bytes``.

    Returns the registered chunk addresses (to unregister later), or None after rolling
    back, when a call fails. ``cudart`` is ``torch.cuda.cudart()`` (or a stand-in).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: expected >= 1, got {chunk_bytes}")
    registered: list[int] = []
    for offset in range(0, size, chunk_bytes):
        address = base + offset
        status = cudart.cudaHostRegister(address, min(chunk_bytes, size - offset), flags)
        if int(getattr(status, "value", status)) != 0:
            for done in reversed(registered):
                cudart.cudaHostUnregister(done)
            return None
        registered.append(address)
    return registered


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


@dataclass
class _Job:
    job_id: int
    num_bytes: int
    started: float
    finished: float | None = None
    start_event: torch.cuda.Event | None = None
    end_event: torch.cuda.Event | None = None
    # CUDA: one device-error record per op call (pinned, written by that kernel), with the
    # call's host ids (to name a refused pair); pooled staging buffers of the ids.
    records: list[tuple[torch.Tensor, np.ndarray, np.ndarray]] = field(default_factory=list)
    staging: list[torch.Tensor] = field(default_factory=list)
    keep_alive: tuple = field(default=(), repr=False)

    def done(self) -> bool:
        return self.end_event is None or self.end_event.query()


class _Direction:
    """Jobs of one direction (stores, loads or expedited loads), in submission order."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pools = CudaJobPools(timing=True) if device.type == "cuda" else None
        self.jobs: deque[_Job] = deque()
        self.by_id: dict[int, _Job] = {}

    def finished(self) -> list[TransferResult]:
        """Jobs done, in order: one event query each, no CUDA call on the compute stream."""
        results = []
        while self.jobs and self.jobs[0].done():
            job = self.jobs.popleft()
            del self.by_id[job.job_id]
            results.append(self._result(job))
        return results

    def _result(self, job: _Job) -> TransferResult:
        success = True
        if job.end_event is not None:
            seconds = job.start_event.elapsed_time(job.end_event) * 1e-3
            success = self._release(job)
        else:
            seconds = job.finished - job.started
        job.keep_alive = ()
        return TransferResult(
            job_id=job.job_id, success=success, transfer_size=job.num_bytes, transfer_time=seconds
        )

    def _release(self, job: _Job) -> bool:
        """Read the job's own error records (host reads of pinned memory) and hand its
        pooled resources back; False if a kernel refused a pair."""
        success = True
        for record, blocks, pages in job.records:
            error = self.pools.errors.release(record, blocks, pages)
            if error is not None:
                logger.error("canonical %s job %d failed: %s", self.name, job.job_id, error)
                success = False
        for buffer in job.staging:
            self.pools.release_staging(buffer)
        self.pools.release_event(job.start_event)
        self.pools.release_event(job.end_event)
        job.records, job.staging = [], []
        job.start_event = job.end_event = None
        return success

    def wait(self, job_ids) -> None:
        for job_id in job_ids:
            job = self.by_id.get(job_id)
            if job is not None and job.end_event is not None:
                job.end_event.synchronize()

    def drain(self) -> None:
        for job in self.jobs:
            if job.end_event is not None:
                job.end_event.synchronize()
        self.jobs.clear()
        self.by_id.clear()


class CanonicalOffloadingWorker(OffloadingWorker):
    """vLLM ``OffloadingWorker`` whose transfers are ``torch.ops.canonical`` calls.

    Parameters
    ----------
    kv_caches : vllm.v1.kv_offload.base.CanonicalKVCaches
        This rank's KV tensors (leading dim = blocks; CUDA, or CPU for tests)
        and per-group refs; every ref must carry a canonical mapping.
    blocks_per_chunk : int
        GPU blocks per CPU chunk (the spec's ``blocks_per_chunk``).
    num_cpu_chunks : int
        Chunks in the region (the spec's ``num_chunks``).
    mmap_region : vllm SharedOffloadRegion
        The region shared by all ranks of the engine. Its canonical views are
        carved here (call once per region object); on success the worker owns
        the region and cleans it up in :meth:`shutdown`.
    """

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
        missing = uncertified_refs(kv_caches)
        if missing:
            where = ", ".join(f"group {g} ref {i}" for g, i in missing[:4])
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            raise RuntimeError(UNCERTIFIED_REASON.format(what=f"{where}{more}"))
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
        self._check_device()

        # The region's canonical views, carved as vLLM's CPU worker carves them.
        self.cell_sizes = canonical_cell_sizes(kv_caches)
        self.views = [
            mmap_region.create_next_canonical_view(size * self.blocks_per_chunk)
            for size in self.cell_sizes
        ]
        base = mmap_region.base_tensor
        row_stride = int(self.views[0].stride(0))  # the region's chunk row stride
        self.cell_offsets = [
            int(v.storage_offset()) - int(base.storage_offset()) for v in self.views
        ]
        self.row_bytes = row_stride
        # Every rank's plan addresses this one (num_chunks, row_stride) byte matrix.
        self.cpu_pages = torch.as_strided(
            base.view(torch.uint8), (self.num_cpu_chunks, row_stride), (row_stride, 1), 0
        )
        self._region: SharedOffloadRegion | None = mmap_region
        if self.device.type == "cuda":
            self._pin(mmap_region)

        self.groups = [self._build_group(g, refs) for g, refs in enumerate(self.group_refs)]
        self._store = _Direction("store", self.device)
        self._load = _Direction("load", self.device)
        self._expedited = _Direction("expedited load", self.device)
        self._directions = (self._store, self._load, self._expedited)
        logger.info(
            "canonical-kv offloading worker: %d KV tensors, %d group(s), %d chunks x %d "
            "blocks, cells %s bytes per block, on %s",
            len(self.kv_tensors),
            len(self.groups),
            self.num_cpu_chunks,
            self.blocks_per_chunk,
            self.cell_sizes,
            self.device,
        )

    # ------------------------------------------------------------------ setup

    def _check_device(self) -> None:
        device = self.device
        if device.type == "cpu":
            return
        if device.type != "cuda" or torch.version.hip is not None:
            raise RuntimeError(
                f"CanonicalOffloadingWorker: canonical_ops has kernels for CUDA and CPU KV "
                f"caches, not {device} ({'ROCm' if torch.version.hip else device.type}); use "
                f"vLLM's TieringOffloadingSpec (same canonical bytes) on this platform"
            )
        if not BUILT_WITH_CUDA:
            raise RuntimeError(
                "CanonicalOffloadingWorker: the KV caches are on CUDA but canonical_ops was "
                "built without its CUDA kernels (CANONICAL_KV_BUILD_CUDA=0 or no nvcc at "
                "install time); reinstall canonical-kv with nvcc available"
            )
        # A GPU the build has no kernel image for (e.g. built for sm_90 only, running on an
        # A100): refuse now, with the reason, rather than at the first transfer.
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            torch.ops.canonical._check_cuda_kernels(index)
        except RuntimeError as error:
            raise RuntimeError(f"CanonicalOffloadingWorker: {error}") from error

    def _pin(self, region: SharedOffloadRegion) -> None:
        """Register the whole region with CUDA: the kernel reads and writes it directly.

        Mapped registrations (portable | mapped: a device address valid on every system)
        in vLLM's chunk size (VLLM_KV_OFFLOAD_REGISTER_CHUNK_GB, default 64 GiB: vLLM caps
        each call), with torch's own CUDA runtime on the worker's device; each chunk is
        recorded on the region so that vLLM's ``cleanup`` unregisters it. vLLM's own
        registration if that fails. The kernel needs the chunks contiguous in the device's
        address space (true where UVA maps host pointers 1:1); every call checks it.
        """
        if not region.is_pinned:
            base, size = region.base_tensor.data_ptr(), region.total_size_bytes
            try:
                with torch.cuda.device(self.device):
                    cudart = torch.cuda.cudart()
                    chunks = register_host_memory(
                        cudart, base, size, chunk_bytes=_register_chunk_bytes()
                    )
            except Exception:
                logger.warning("canonical-kv: mapped registration unavailable", exc_info=True)
                chunks = None
            if chunks is not None:
                region.pinned_addresses.extend(chunks)
                region.is_pinned = True
            else:
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
        layers: list[tuple[int, object]] = []
        for ref in refs:
            key = (ref.tensor_idx, ref.mapping)
            if key not in layers:
                layers.append(key)
        kv_lists, plans = [], []
        for first in range(0, len(layers), MAX_LAYERS_PER_PLAN):
            part = layers[first : first + MAX_LAYERS_PER_PLAN]
            mappings = [_as_layouts_mapping(m, self.cell_sizes[t]) for t, m in part]
            kvs = [self.kv_tensors[t] for t, _ in part]
            try:
                plan = make_plan(
                    mappings,
                    kvs,
                    self.cpu_pages,
                    pages_per_row=self.blocks_per_chunk,
                    area_offsets=[self.cell_offsets[t] for t, _ in part],
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
        terms = [
            (ref.mapping.num_writers, ref.mapping.writer_index, ref.mapping.local_page_size_bytes)
            for ref in refs
        ]
        return _GroupPlan(
            kv_caches=kv_lists,
            plans=plans,
            local_bytes=sum(size for _, _, size in terms),
            writer_terms=terms,
        )

    # ------------------------------------------------------------------ jobs

    def job_pairs(
        self, gpu_spec: GPULoadStoreSpec, cpu_spec: LoadStoreSpec
    ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per group touched by a job: (group, GPU block ids, canonical page ids), int64.

        Follows vLLM's enumeration: groups in order, each taking ``group_sizes[g]``
        GPU blocks and ``ceil((skip + size) / bpc)`` CPU chunks, where
        ``skip = block_indices[g] % bpc`` sub-blocks of its first chunk are skipped.
        """
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
            sizes = [int(kv.size(0)) for kvs in self.groups[g].kv_caches for kv in kvs]
            num_blocks = min(sizes) if sizes else None  # a group without layers moves nothing
            if num_blocks is not None and (blocks.min() < 0 or blocks.max() >= num_blocks):
                raise IndexError(
                    f"GPU spec: group {g}'s block ids must lie in [0, {num_blocks}), got "
                    f"[{blocks.min()}, {blocks.max()}]"
                )
        return out

    def _submit(self, direction: _Direction, job_id: int, store: bool, gpu_spec, cpu_spec) -> bool:
        if job_id in direction.by_id:
            raise ValueError(f"job {job_id} is already in flight")
        pairs = self.job_pairs(gpu_spec, cpu_spec)
        if store:
            num_bytes = sum(self.groups[g].store_bytes(pages) for g, _, pages in pairs)
        else:
            num_bytes = sum(self.groups[g].local_bytes * len(pages) for g, _, pages in pairs)
        op = torch.ops.canonical.canonical_store if store else torch.ops.canonical.canonical_load
        job = _Job(job_id=job_id, num_bytes=num_bytes, started=time.perf_counter())

        if direction.stream is None:  # CPU KV caches: synchronous
            for g, blocks, pages in pairs:
                group = self.groups[g]
                block_ids, page_ids = torch.from_numpy(blocks), torch.from_numpy(pages)
                for kvs, plan in zip(group.kv_caches, group.plans):
                    op(kvs, self.cpu_pages, plan, block_ids, page_ids)
            job.finished = time.perf_counter()
        else:
            pools = direction.pools
            reporting = (
                torch.ops.canonical._canonical_store_reporting
                if store
                else torch.ops.canonical._canonical_load_reporting
            )
            job.start_event, job.end_event = pools.event(), pools.event()
            # Pinned host ids from the pool, one H2D copy per group on the transfer stream.
            staged = []
            for g, blocks, pages in pairs:
                count = len(blocks)
                host = pools.staging(2 * count)
                host[:count] = torch.from_numpy(blocks)
                host[count : 2 * count] = torch.from_numpy(pages)
                job.staging.append(host)
                staged.append((g, host, blocks, pages))
            stream = direction.stream
            # Stores read KV the model is still writing; loads must follow pending writes
            # (e.g. zeroing) of their destination blocks: order after the caller's stream.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            keep = []
            with torch.cuda.stream(stream):
                job.start_event.record(stream)
                for g, host, blocks, pages in staged:
                    count = len(blocks)
                    ids = host[: 2 * count].to(self.device, non_blocking=True)
                    group = self.groups[g]
                    for kvs, plan in zip(group.kv_caches, group.plans):
                        record = pools.errors.acquire()
                        try:
                            reporting(kvs, self.cpu_pages, plan, ids[:count], ids[count:], record)
                        except BaseException:
                            pools.errors.release(record)  # never handed to a kernel
                            raise
                        job.records.append((record, blocks, pages))
                    keep.append(ids)
                job.end_event.record(stream)
            job.keep_alive = tuple(keep)
        direction.jobs.append(job)
        direction.by_id[job_id] = job
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
