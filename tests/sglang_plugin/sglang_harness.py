"""Real SGLang host pools, storage configs and backends on CPU, and the KV truth they hold.

Imported by the test modules of tests/sglang_plugin only (they run where SGLang is
installed: `make test-sglang`). The truth is independent of canonical-kv: a model's KV
is a deterministic function of (layer, token position, global head, K/V, element), so
any rank of any TP knows which bits its heads must hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

BACKEND = {
    "backend_name": "canonical",
    "module_path": "canonical_ops.sglang",
    "class_name": "CanonicalHiCacheStorage",
    "interface_v1": 1,
}


@dataclass(frozen=True)
class Model:
    """A small GQA model: ``layers`` layers of ``total_heads`` KV heads of ``head_dim``."""

    name: str = "test/tiny-gqa"
    layers: int = 3
    total_heads: int = 4
    head_dim: int = 8
    page_size: int = 4
    dtype: torch.dtype = torch.bfloat16
    seed: int = 7
    extra: dict = field(default_factory=dict)

    def global_heads(self, tp: int, rank: int) -> list[int]:
        """The model's heads on ``rank`` (a contiguous slice, or a replicated head)."""
        if self.total_heads >= tp:
            per = self.total_heads // tp
            return list(range(rank * per, (rank + 1) * per))
        return [rank // (tp // self.total_heads)]

    def truth(self, layer: int, tokens: int) -> torch.Tensor:
        """(2, tokens, total_heads, head_dim) bits of the KV of positions [0, tokens)."""
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[self.dtype.itemsize]
        rng = np.random.default_rng([self.seed, layer])
        raw = rng.integers(
            -(1 << 14), 1 << 14, (2, tokens, self.total_heads, self.head_dim), dtype=np.int64
        )
        return torch.from_numpy(raw).to(bits).view(self.dtype)


def make_pool(
    model: Model, tp: int, rank: int, layout: str, *, start: int = 0, end: int | None = None
) -> MHATokenToKVPoolHost:
    """SGLang's own MHA host pool of ``rank`` at TP=``tp`` (CPU, unpinned)."""
    end = model.layers if end is None else end
    heads = len(model.global_heads(tp, rank))
    device_tokens = 16 * model.page_size
    k = tuple(
        torch.zeros(device_tokens, heads, model.head_dim, dtype=model.dtype)
        for _ in range(end - start)
    )
    v = tuple(torch.zeros_like(t) for t in k)

    def pointers(ts):
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v), layout=KVBufferLayout.NHD
        ),
        page_size=model.page_size,
        head_num=heads,
        head_dim=model.head_dim,
        v_head_dim=model.head_dim,
        dtype=model.dtype,
        device=torch.device("cpu"),
    )
    return _host_pool(MHATokenToKVPoolHost, info, model, layout, start_layer=start, end_layer=end)


def _host_pool(cls, info, model: Model, layout: str, **layers):
    """SGLang's host pool ``cls`` over a device pool's ``info`` (CPU, unpinned, 2x its tokens)."""
    tokens = 16 * model.page_size
    return cls(info, 2.0, 0, model.page_size, layout, pin_memory=False, device="cpu",
               device_capacity_tokens=tokens, **layers)  # fmt: skip


def storage_config(tp: int, rank: int, extra: dict, *, model_name: str, **over):
    """SGLang's HiCacheStorageConfig of one rank."""
    fields = dict(
        tp_rank=rank,
        tp_size=tp,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=model_name,
        extra_config={**BACKEND, **extra},
    )
    fields.update(over)
    return HiCacheStorageConfig(**fields)


def make_backend(pool, tp: int, rank: int, extra: dict, *, model_name: str, **over):
    """The backend as SGLang's HiCacheController makes it: the factory, then the pool."""
    config = storage_config(tp, rank, extra, model_name=model_name, **over)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def _rows(pool, component: int, local_layer: int, slots: torch.Tensor) -> tuple:
    """Index of the ``[slots, heads, dim]`` rows of K (0) or V (1) of one layer, per layout.

    Written from SGLang's documented buffer shapes, independently of canonical_ops.
    """
    page = pool.page_size
    if pool.layout == "layer_first":  # (2, L, slots, H, D)
        return (component, local_layer, slots)
    if pool.layout == "page_first":  # (2, slots, L, H, D)
        return (component, slots, local_layer)
    if pool.layout == "page_first_direct":  # (2, pages, L, P, H, D)
        return (component, slots // page, local_layer, slots % page)
    if pool.layout == "page_head":  # (2, pages, H, P, L, D)
        return (component, slots // page, slice(None), slots % page, local_layer)
    raise AssertionError(pool.layout)


def fill_pages(model: Model, pool, tp: int, rank: int, slots: torch.Tensor, first: int = 0):
    """Write the truth of tokens [0, len(slots)) of this rank's heads into the pool's slots."""
    heads = model.global_heads(tp, rank)
    for local_layer in range(pool.layer_num):
        kv = model.truth(first + local_layer, len(slots))[:, :, heads]
        for component in (0, 1):
            pool.kv_buffer[_rows(pool, component, local_layer, slots)] = kv[component]


def pool_rows(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's (2, slots, heads, dim) rows at ``slots`` (a copy)."""
    return [
        torch.stack([pool.kv_buffer[_rows(pool, c, layer, slots)] for c in (0, 1)])
        for layer in range(pool.layer_num)
    ]


def check_pages(model: Model, pool, tp: int, rank: int, slots: torch.Tensor, first: int = 0):
    """Assert the pool holds exactly the truth of this rank's heads at ``slots``."""
    heads = model.global_heads(tp, rank)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[model.dtype.itemsize]
    for local_layer, rows in enumerate(pool_rows(pool, slots)):
        kv = model.truth(first + local_layer, len(slots))[:, :, heads]
        assert torch.equal(rows.view(bits), kv.view(bits)), (
            f"rank {rank}/{tp}: layer {first + local_layer} differs from the truth"
        )


# ------------------------------------------------------------------ MLA


def make_mla_pool(model: Model, layout: str):
    """SGLang's own MLA host pool (the latent is the same on every TP rank); ``head_dim`` is
    the latent width (kv_lora_rank + rope dims, split 3:1 here)."""
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device_tokens = 16 * model.page_size
    rope = model.head_dim // 4
    buffers = tuple(
        torch.zeros(device_tokens, 1, model.head_dim, dtype=model.dtype)
        for _ in range(model.layers)
    )
    info = MLABufferInfo(
        buffers=buffers,
        data_ptrs=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64),
        layer_indices=tuple(range(model.layers)),
        device_layer_num=model.layers,
        page_size=model.page_size,
        kv_lora_rank=model.head_dim - rope,
        qk_rope_head_dim=rope,
        kv_cache_dim=model.head_dim,
        dtype=model.dtype,
        device=torch.device("cpu"),
    )
    layers = {"start_layer": 0, "end_layer": model.layers, "target_layer_num": model.layers}
    return _host_pool(MLATokenToKVPoolHost, info, model, layout, **layers)


def _mla_rows(pool, layer: int, slots: torch.Tensor) -> tuple:
    """Index of the ``[slots, width]`` latent rows of one layer, per layout."""
    page = pool.page_size
    if pool.layout == "layer_first":  # (L, slots, 1, W)
        return (layer, slots, 0)
    if pool.layout == "page_first":  # (slots, L, 1, W)
        return (slots, layer, 0)
    if pool.layout == "page_first_direct":  # (pages, L, P, 1, W)
        return (slots // page, layer, slots % page, 0)
    raise AssertionError(pool.layout)


def mla_truth(model: Model, layer: int, tokens: int) -> torch.Tensor:
    """(tokens, width) bits of the latent of positions [0, tokens)."""
    return model.truth(layer, tokens)[0, :, 0]


def fill_mla(model: Model, pool, slots: torch.Tensor) -> None:
    for layer in range(pool.layer_num):
        pool.kv_buffer[_mla_rows(pool, layer, slots)] = mla_truth(model, layer, len(slots))


def check_mla(model: Model, pool, slots: torch.Tensor) -> None:
    for layer in range(pool.layer_num):
        got = pool.kv_buffer[_mla_rows(pool, layer, slots)]
        want = mla_truth(model, layer, len(slots))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"layer {layer}"


# ------------------------------------------------------------------ TP groups


MODEL = Model()
TOKENS = list(range(1000, 1000 + 3 * MODEL.page_size))


def sglang_keys(model: Model = MODEL, tokens=TOKENS, **kw):
    """SGLang's storage page hashes of ``tokens`` (what its controller passes the backend).

    Called after the backends exist, as in an engine: the key index learns the canonical
    keys while SGLang hashes a request's tokens.
    """
    return get_storage_hash_str(tokens, None, page_size=model.page_size, **kw)


def group(model, tp, layout, extra, *, ranks=None, **over):
    """(pool, backend) of every rank of a TP group (or of ``ranks`` of it)."""
    out = []
    for rank in range(tp) if ranks is None else ranks:
        pool = make_pool(model, tp, rank, layout)
        out.append((pool, make_backend(pool, tp, rank, extra, model_name=model.name, **over)))
    return out


def write(model, ranks, tp, keys, tokens=TOKENS):
    """Each rank fills its pages with the truth and stores them (v1); returns the results."""
    results = []
    for pool, backend in ranks:
        slots = pool.alloc(len(tokens))
        fill_pages(model, pool, tp, backend.core.tp_rank, slots)
        results.append(backend.batch_set_v1(keys, slots))
    return results


def unit_files(store_dir: Path) -> list[Path]:
    return sorted(Path(store_dir).rglob("*.ckv"))


def fragments(extra: dict) -> list[Path]:
    """The fragment units in the staging directory (shares of units not yet published)."""
    return unit_files(Path(extra["staging_dir"]))
