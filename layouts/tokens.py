"""Canonical pages of ``k * B`` tokens <-> ``k`` pages of ``B`` tokens (pure numpy).

Engines cut a prefix into units of different token counts (vLLM's offloaded block, SGLang's
page). A canonical page of ``spec`` is ``outer`` runs of its ``block_size`` tokens, each token
``inner`` bytes (:func:`token_runs`): packed NHD (tokens, heads, K|V) and MLA (tokens, latent)
are token-major (``outer`` 1, so pages simply concatenate); split NHD (K|V, tokens, heads),
packed HND (heads, tokens, K|V) and split HND (K|V, heads, tokens) are not. A unit is its
layers' pages in layer order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .spec import LayerSpec, element_size

__all__ = ["join_units", "split_unit", "token_runs"]


def token_runs(spec: LayerSpec) -> tuple[int, int]:
    """``(outer, inner)``: the canonical page of ``spec`` viewed as ``(outer, block_size,
    inner)`` bytes. ValueError for pages whose bytes are not per token (scales inside,
    compressed states)."""
    if not isinstance(spec, LayerSpec):
        raise TypeError(f"spec: expected a layouts.LayerSpec, got {type(spec).__name__}")
    if spec.per_token_head_scales or spec.tokens_per_state != 1:
        raise ValueError("spec: pages with scales inside or compressed states are not per token")
    width = spec.head_size * element_size(spec.dtype)
    if spec.attention == "mla":
        return 1, width
    heads = spec.num_kv_heads
    if spec.packing == "packed":
        return (1, heads * 2 * width) if spec.order == "NHD" else (heads, 2 * width)
    return (2, heads * width) if spec.order == "NHD" else (2 * heads, width)


def _layers(unit: np.ndarray, specs: Sequence[LayerSpec], name: str) -> list[np.ndarray]:
    """``unit`` (1-D uint8) cut into each layer's ``(outer, tokens, inner)`` view."""
    shapes = [(*token_runs(s)[:1], s.block_size, token_runs(s)[1]) for s in specs]
    sizes = [int(np.prod(shape)) for shape in shapes]
    if unit.ndim != 1 or unit.dtype != np.uint8 or unit.size != sum(sizes):
        raise ValueError(f"{name}: expected {sum(sizes)} bytes (uint8, 1-D), got {unit.size}")
    at, out = 0, []
    for shape, size in zip(shapes, sizes):
        out.append(unit[at : at + size].reshape(shape))
        at += size
    return out


def join_units(units: Sequence[np.ndarray], specs: Sequence[LayerSpec]) -> np.ndarray:
    """The unit of ``len(units) * B`` tokens made of consecutive units of ``B`` tokens, whose
    layer ``l``'s page is ``specs[l]`` (``block_size`` = ``B``)."""
    if not units:
        raise ValueError("units: expected at least one unit")
    layers = [_layers(np.asarray(u), specs, f"units[{i}]") for i, u in enumerate(units)]
    return np.concatenate([np.concatenate(parts, axis=1).reshape(-1) for parts in zip(*layers)])


def split_unit(unit: np.ndarray, specs: Sequence[LayerSpec], parts: int) -> list[np.ndarray]:
    """The ``parts`` consecutive units of ``B / parts`` tokens a unit of ``B`` tokens (layer
    ``l``'s page ``specs[l]``) holds, first tokens first."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts: expected a positive int, got {parts!r}")
    if any(s.block_size % parts for s in specs):
        raise ValueError(f"parts: expected a divisor of every layer's block_size, got {parts}")
    layers = _layers(np.asarray(unit), specs, "unit")
    return [
        np.concatenate([np.split(page, parts, axis=1)[p].reshape(-1) for page in layers])
        for p in range(parts)
    ]
