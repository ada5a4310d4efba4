"""Quantised KV: a layer's scales (:class:`KVScales`), and the canonical pages that carry them.

Per-tensor scales travel as values in the store namespace; per-token-head scales are a companion
full-attention page of head size 1, derived by the same rules as the data. Scales inside the data
page stay uncertified (stored opaquely, as vLLM 0.33 does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .derive import derive_group_mappings, opaque_group
from .mapping import CanonicalPageMapping
from .spec import PACKINGS, LayerSpec, check_choice, dtype_name
from .tiling import verify_tiling

__all__ = [
    "QUANTISED_KV_DTYPES",
    "SCALE_DTYPES",
    "SCALE_GRANULARITIES",
    "KVScales",
    "derive_scaled_group_mappings",
    "scales_mismatch",
]

SCALE_GRANULARITIES = ("per-tensor", "per-token-head")
# Scale dtypes and the numpy type that rounds a per-tensor value to them.
SCALE_DTYPES = {"float32": np.float32, "float16": np.float16}
# KV dtypes that carry scales: 1-byte floats and int8 (e8m0 is a scale format, not KV).
QUANTISED_KV_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "int8")


def _scale_value(name: str, value: Any, dtype: str) -> float:
    """``value`` rounded to ``dtype`` (as the engine holds it); finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a finite positive number, got {value!r}")
    with np.errstate(over="ignore"):  # an overflow is reported below, as inf
        rounded = float(SCALE_DTYPES[dtype](value))
    if not math.isfinite(rounded) or rounded <= 0:
        raise ValueError(
            f"{name}: expected a finite positive number representable in {dtype}, got {value!r}"
        )
    return rounded


@dataclass(frozen=True)
class KVScales:
    """How one quantised layer's KV is scaled: ``granularity`` ("per-tensor" or "per-token-head")
    and scale ``dtype`` ("float32" or "float16"); per-tensor: ``k_scale`` and ``v_scale``
    (required, rounded to ``dtype`` as the engine stores them); per-token-head: the companion
    tensor's ``packing`` (its stride order is the data's). A bad field raises naming it."""

    granularity: str
    dtype: str = "float32"
    k_scale: float | None = None
    v_scale: float | None = None
    packing: str = "split"

    def __post_init__(self) -> None:
        check_choice("granularity", self.granularity, SCALE_GRANULARITIES)
        try:
            name = dtype_name(self.dtype)
        except ValueError:
            name = str(self.dtype)
        if name not in SCALE_DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(SCALE_DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", name)
        check_choice("packing", self.packing, PACKINGS)
        if self.granularity == "per-tensor":
            if self.k_scale is None or self.v_scale is None:
                raise ValueError("k_scale, v_scale: expected both for per-tensor scales")
            if self.packing != "split":
                raise ValueError(
                    f"packing: per-tensor scales have no page; expected the default 'split', "
                    f"got {self.packing!r}"
                )
            object.__setattr__(self, "k_scale", _scale_value("k_scale", self.k_scale, name))
            object.__setattr__(self, "v_scale", _scale_value("v_scale", self.v_scale, name))
        elif self.k_scale is not None or self.v_scale is not None:
            raise ValueError(
                "k_scale, v_scale: expected None for per-token-head scales (they are in the "
                "companion tensor)"
            )

    @property
    def has_page(self) -> bool:
        """Whether the scales are a companion page (per-token-head) moved with the data."""
        return self.granularity == "per-token-head"

    def page_spec(self, spec: LayerSpec) -> LayerSpec:
        """The companion page of per-token-head scales of ``spec``'s data page (one rank's): full
        attention, head size 1, the scale dtype, the data's block size, heads and stride order."""
        problem = scales_mismatch(spec, self)
        if problem is not None:
            raise ValueError(f"spec: {problem}")
        if not self.has_page:
            raise ValueError(
                "granularity: per-tensor scales have no page (expected per-token-head)"
            )
        return LayerSpec(
            "full", spec.block_size, spec.num_kv_heads, 1, self.dtype, self.packing, spec.order
        )

    def describe(self) -> dict[str, Any]:
        """JSON description (part of a store namespace's layer geometry)."""
        out: dict[str, Any] = {"granularity": self.granularity, "dtype": self.dtype}
        if self.has_page:
            out["packing"] = self.packing
        else:
            out["k_scale"], out["v_scale"] = self.k_scale, self.v_scale
        return out


def scales_mismatch(spec: LayerSpec, scales: KVScales) -> str | None:
    """Why ``scales`` cannot scale the data page ``spec``, or None if they can."""
    if not isinstance(spec, LayerSpec):
        return f"expected a LayerSpec, got {type(spec).__name__}"
    if not isinstance(scales, KVScales):
        return f"expected KVScales, got {type(scales).__name__}"
    if spec.dtype not in QUANTISED_KV_DTYPES:
        return f"scaled KV must have a quantised dtype {QUANTISED_KV_DTYPES}, got {spec.dtype}"
    if spec.per_token_head_scales:
        return (
            "per_token_head_scales=True means scales inside the data page (uncertified); "
            "companion KVScales describe scales outside it: expected one or the other"
        )
    if scales.has_page and spec.attention != "full":
        return f"per-token-head scales need full attention (K and V heads), got {spec.attention}"
    return None


def derive_scaled_group_mappings(
    spec: LayerSpec,
    scales: KVScales,
    tp_size: int,
    total_kv_heads: int,
    dcp_size: int = 1,
    pcp_size: int = 1,
    interleave: int = 1,
    *,
    layer_name: str = "<layer>",
) -> tuple[tuple[CanonicalPageMapping, ...], tuple[CanonicalPageMapping, ...] | None]:
    """A quantised layer's ``(data_mappings, scale_mappings)``, each indexed by rank and verified
    (``scale_mappings``: None for per-tensor scales). Should data and scales certify apart, both
    fall back to opaque pages rather than pair certified data with scales in another place."""
    problem = scales_mismatch(spec, scales)
    if problem is not None:
        raise ValueError(f"scales: cannot scale {layer_name}: {problem}")
    topology = (tp_size, total_kv_heads, dcp_size, pcp_size, interleave)
    data = derive_group_mappings(spec, *topology, layer_name=layer_name)
    if not scales.has_page:
        return data, None
    page, page_name = scales.page_spec(spec), f"{layer_name} (scales)"
    scale = derive_group_mappings(page, *topology, layer_name=page_name)
    reasons = {data[0].fallback_reason, scale[0].fallback_reason}
    if len(reasons) > 1 and None in reasons:  # one certified, the other not: neither is
        reason = f"data and scales certify apart: {next(r for r in reasons if r is not None)}"
        data = opaque_group(spec.page_size_bytes, len(data), reason, spec)
        scale = opaque_group(page.page_size_bytes, len(scale), reason, page)
        verify_tiling(data, layer_name)
        verify_tiling(scale, page_name)
    return data, scale
