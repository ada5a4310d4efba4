"""CanonicalOffloadingSpec: vLLM's ``TieringOffloadingSpec`` with our worker. Everything
scheduler-side is vLLM's; only the worker differs, over the same ``SharedOffloadRegion`` and
after vLLM's own validation of the canonical refs, so every byte lands where vLLM puts it."""

from __future__ import annotations

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from . import SPEC_NAME
from .shared import check_worker_rows, shared_prefix_options
from .worker import CanonicalOffloadingWorker

__all__ = ["CanonicalOffloadingSpec"]


class CanonicalOffloadingSpec(TieringOffloadingSpec):
    """vLLM offloading spec (``spec_name: "CanonicalOffloadingSpec"``) running canonical_ops.
    Refuses a config without ``"canonical_layout": true``: the scheduler side (namespace,
    portability gate) must agree with the canonical bytes the worker writes."""

    def __init__(self, config: OffloadingConfig) -> None:
        if not config.canonical_layout:
            raise ValueError(
                f"{SPEC_NAME} writes vLLM's canonical KV layout and needs "
                '"canonical_layout": true in kv_connector_extra_config (without it vLLM '
                "namespaces and sizes the cache for the direct layout). Add it, or use "
                'spec_name "CPUOffloadingSpec" / "TieringOffloadingSpec" for the direct layout.'
            )
        super().__init__(config)

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CanonicalOffloadingWorker:
        """Map the engine's shared region and build our worker over it (worker side)."""
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            # vLLM's own checks and messages: a ref without a mapping, or opaque
            # (per-topology) layers under a topology-shared storage namespace.
            self._validate_canonical_refs(kv_caches)
            shared = shared_prefix_options(self.extra_config)
            worker = CanonicalOffloadingWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks, region
            )
        except Exception:
            region.cleanup()
            raise
        try:  # a tier sharing KV with other engines: its rows must be what they write
            for option in shared:
                check_worker_rows(option, kv_caches, self.config, worker)
        except Exception:
            worker.shutdown()
            raise
        return worker

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """Our worker, built once. Unlike vLLM's, it decides by the KV tensors' device:
        CUDA (with canonical_ops' CUDA kernels) or CPU; the worker refuses anything else."""
        if self._worker is None:
            if self.num_chunks <= 0:
                raise ValueError(
                    f"{SPEC_NAME}: cpu_bytes_to_use={self.extra_config.get('cpu_bytes_to_use')} "
                    f"holds no chunk of {self.kv_bytes_per_chunk} bytes; raise cpu_bytes_to_use"
                )
            self._worker = self.create_worker(kv_caches)
        return self._worker
