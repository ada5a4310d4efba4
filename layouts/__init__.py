"""canonical-kv layouts: canonical page mappings of KV caches, format v1. The only part of
canonical-kv that reasons about parallelism; pure Python and numpy (no torch ops, no I/O).

Quickstart
----------
>>> from layouts import LayerSpec, derive_group_mappings
>>> spec = LayerSpec("full", block_size=16, num_kv_heads=2, head_size=128,
...                  dtype="bfloat16", packing="packed", order="NHD")
>>> mappings = derive_group_mappings(spec, tp_size=4, total_kv_heads=8)
>>> mappings[1].runs[0].canonical_offset  # rank 1 writes heads 2-3 of each token
1024
"""

from .derive import (
    CANONICAL_FORMAT_VERSION,
    canonical_format_id,
    certification_failure,
    derive_group_mappings,
    derive_layer_mapping,
    group_layer_mappings,
    opaque_fallback_mapping,
)
from .election import RankShare, WriterElection
from .mapping import CanonicalPageMapping, CopyRun
from .pipeline import pp_layer_range, pp_layer_ranges
from .quant import KVScales, derive_scaled_group_mappings
from .spec import LayerSpec, RankContext
from .state import StateSpec, derive_state_group_mappings, state_certification_failure
from .tiling import TilingError, verify_tiling

__all__ = [
    "CANONICAL_FORMAT_VERSION",
    "CanonicalPageMapping",
    "CopyRun",
    "KVScales",
    "LayerSpec",
    "RankContext",
    "RankShare",
    "StateSpec",
    "TilingError",
    "WriterElection",
    "canonical_format_id",
    "certification_failure",
    "derive_group_mappings",
    "derive_layer_mapping",
    "derive_scaled_group_mappings",
    "derive_state_group_mappings",
    "group_layer_mappings",
    "opaque_fallback_mapping",
    "pp_layer_range",
    "pp_layer_ranges",
    "state_certification_failure",
    "verify_tiling",
]
