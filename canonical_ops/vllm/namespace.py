"""The namespace of vLLM's primary rows for the canonical tiers (:mod:`.tiers`): one unit is
one row of vLLM's CPU region, opaque to the unit store, described by everything that decides
its bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (
    canonical_format_id,
)

from layouts import RankContext

from ..units import LayerGeometry, ModelIdentity, StoreNamespace

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

__all__ = ["UNIT_FORMAT", "row_namespace"]

UNIT_FORMAT = "vllm-offload-chunk-v1"  # a unit = one primary row, keyed by vLLM's offload key
_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "half", "float"})
_SHARED_FORMATS = ("v1-nhd", "v1-hnd")


def row_namespace(
    offloading_spec: OffloadingSpec, row_bytes: int, model_name: str | None = None
) -> StoreNamespace:
    """The namespace of vLLM's primary rows: everything that decides their bytes (the topology
    only when vLLM does not certify the config parallelism-agnostic). The block-hash seed is
    not described: it shapes the keys, and must stay secret."""
    config = offloading_spec.config
    if not config.canonical_layout:
        raise ValueError(
            "canonical_layout: expected true in kv_connector_extra_config for a canonical tier "
            "(direct-layout rows depend on the topology); add it, or use vLLM's 'fs' tier"
        )
    layout = config.kv_cache_layout
    fmt = canonical_format_id(layout) if layout else None
    if fmt not in _SHARED_FORMATS:
        raise ValueError(
            f"kv_cache_layout: expected an NHD or HND family layout, got "
            f"{config.kv_cache_layout!r} (canonical format {fmt!r})"
        )
    dtype = str(config.model.dtype).removeprefix("torch.")
    extra: dict[str, Any] = {
        "engine": "vllm",
        "unit": UNIT_FORMAT,
        "dtype": dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [
            {"tokens_per_block": g.tokens_per_block, "layer_names": list(g.layer_names)}
            for g in config.groups
        ],
    }
    parallel = config.parallel
    if not parallel.is_parallelism_agnostic:
        sizes = {name: getattr(parallel, f"{name}_size") for name in ("tp", "pp", "pcp", "dcp")}
        extra["topology"] = {**sizes, "world_size": parallel.world_size}
    # The row is opaque to the unit store (its per-layer layout is vLLM's, inside the row).
    tokens = max([g.tokens_per_block for g in config.groups] or [1])
    row = LayerGeometry.opaque_from_bytes(
        row_bytes, RankContext(1, 1, 0), block_size=tokens * config.cache.blocks_per_chunk
    )
    model = ModelIdentity(model_name if model_name is not None else config.model.name, "", extra)
    kv_quant = "none" if dtype in _FLOAT_DTYPES else dtype
    return StoreNamespace(fmt, model, kv_quant, (row,))
