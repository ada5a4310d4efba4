"""Derivation of canonical page mappings (format v1) from a LayerSpec and a RankContext. Fails
closed: a layer whose bytes cannot be proven to land in the same canonical place under every
topology falls back to opaque pages (each rank's page whole, readable by the same topology only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from .mapping import CanonicalPageMapping, CopyRun, coalesce_runs
from .spec import LayerSpec, RankContext
from .tiling import TilingError, verify_tiling

__all__ = [
    "CANONICAL_FORMAT_VERSION",
    "canonical_format_id",
    "certification_failure",
    "derive_group_mappings",
    "derive_layer_mapping",
    "group_layer_mappings",
    "opaque_fallback_mapping",
]

# Version of the canonical byte format; matches vLLM 0.33's format v1 exactly.
CANONICAL_FORMAT_VERSION = 1

# vLLM spells the two families by its layout enum too (LBNHC = NHD, LBHNC = HND).
_FORMAT_FAMILIES = {"NHD": "nhd", "HND": "hnd", "LBNHC": "nhd", "LBHNC": "hnd"}


def canonical_format_id(order: str) -> str:
    """Identity of the canonical byte format (version and stride-order family), for namespacing
    persisted KV: ``canonical_format_id("NHD") == "v1-nhd"``."""
    family = _FORMAT_FAMILIES.get(str(order).upper())
    if family is None:
        raise ValueError(f"order: expected 'NHD' or 'HND', got {order!r}")
    return f"v{CANONICAL_FORMAT_VERSION}-{family}"


def _place_tokens(regions: list[CopyRun], ctx: RankContext) -> tuple[CopyRun, ...]:
    """Runs putting each region (one row per token of the block) at its canonical tokens: with
    context parallelism one run per chunk of ``interleave`` tokens (``cp_size`` chunks apart)."""
    if ctx.cp_size > 1:
        regions = [
            CopyRun(  # the same run over the chunk's tokens from its first one
                local_offset=run.local_offset + first * run.local_stride,
                canonical_offset=run.canonical_offset
                + ctx.canonical_token(first) * run.canonical_stride,
                fragment_size=run.fragment_size,
                num_fragments=ctx.interleave,
                local_stride=run.local_stride,
                canonical_stride=run.canonical_stride,
            )
            for run in regions
            for first in range(0, run.num_fragments, ctx.interleave)
        ]
    return coalesce_runs(regions)


def _attention_regions(
    spec: LayerSpec, head_shard: int, num_head_shards: int, cp_size: int
) -> list[CopyRun]:
    """Per-token rows of a full-attention page holding head shard ``head_shard``: one region
    per page half (packed: one, split: K then V) for NHD, one per (half, head) for HND."""
    bs, heads, shards = spec.block_size, spec.num_kv_heads, num_head_shards
    halves = 1 if spec.packing == "packed" else 2
    head_bytes = 2 // halves * spec.head_size * spec.element_size  # a (token, head)'s half
    canonical_tokens = bs * cp_size  # tokens of one canonical page
    if spec.order == "NHD":
        row = heads * head_bytes
        return [
            CopyRun(
                local_offset=half * bs * row,
                canonical_offset=(half * canonical_tokens * shards + head_shard) * row,
                fragment_size=row,
                num_fragments=bs,
                local_stride=row,
                canonical_stride=shards * row,
            )
            for half in range(halves)
        ]
    head_span = canonical_tokens * head_bytes  # a head's rows in the canonical page
    return [
        CopyRun(
            local_offset=(half * heads + head) * bs * head_bytes,
            canonical_offset=((half * shards + head_shard) * heads + head) * head_span,
            fragment_size=head_bytes,
            num_fragments=bs,
            local_stride=head_bytes,
            canonical_stride=head_bytes,
        )
        for half in range(halves)
        for head in range(heads)
    ]


def _derive(spec: LayerSpec | None, ctx: RankContext) -> CanonicalPageMapping | str:
    """The certified mapping, or the reason the layer cannot be certified."""
    if spec is None:
        return "unrecognised physical layout (LayerSpec.from_tensor returned None)"
    bs, tp, total = spec.block_size, ctx.tp_size, ctx.total_kv_heads
    if ctx.cp_size > 1 and (ctx.interleave > bs or bs % ctx.interleave):
        return (
            f"interleave={ctx.interleave} must divide block_size={bs} "
            f"when context parallelism is used (dcp*pcp={ctx.cp_size})"
        )
    if spec.per_token_head_scales:
        return (
            "per-token-head quantisation scales inside the page are not part of canonical "
            "format v1 (scales in a companion tensor are: layouts.KVScales)"
        )
    if spec.tokens_per_state != 1:
        return f"tokens_per_state={spec.tokens_per_state} (only 1 is certified)"
    page = spec.page_size_bytes
    if spec.attention == "mla":  # the latent is replicated over TP
        num_head_shards, replication, held = 1, tp, f"tp_size={tp} for MLA"
        regions = [CopyRun(0, 0, page // bs, bs, page // bs, page // bs)]
    else:
        expected_heads = max(1, total // tp)
        if spec.num_kv_heads != expected_heads:
            return (
                f"num_kv_heads={spec.num_kv_heads} but {total} KV heads over tp_size={tp} "
                f"gives {expected_heads} per rank"
            )
        if total >= tp and total % tp:
            return f"tp_size={tp} does not divide total_kv_heads={total}"
        if total < tp and tp % total:
            return f"total_kv_heads={total} does not divide tp_size={tp} (replicated heads)"
        # TP shards the heads; past one head per rank, each head is replicated tp/total times.
        num_head_shards, replication = min(total, tp), max(1, tp // total)
        held = f"the head replication {replication}"
        head_shard = ctx.tp_rank // replication
        regions = _attention_regions(spec, head_shard, num_head_shards, ctx.cp_size)
    # DCP splits tokens among the ranks that hold the same (replicated) heads or latent.
    if replication % ctx.dcp_size:
        return f"dcp_size={ctx.dcp_size} does not divide {held}"
    return CanonicalPageMapping(
        canonical_page_size_bytes=ctx.cp_size * num_head_shards * page,
        local_page_size_bytes=page,
        runs=_place_tokens(regions, ctx),
        num_writers=replication // ctx.dcp_size,
        writer_index=(ctx.tp_rank % replication) // ctx.dcp_size,
        parallelism_agnostic=ctx.cp_size == 1,
        derived_for=spec,
    )


def derive_layer_mapping(spec: LayerSpec | None, ctx: RankContext) -> CanonicalPageMapping | None:
    """Certified canonical mapping of one layer at one rank, or None when it cannot be
    certified (fail closed; :func:`certification_failure` says why)."""
    result = _derive(spec, ctx)
    return None if isinstance(result, str) else result


def certification_failure(spec: LayerSpec | None, ctx: RankContext) -> str | None:
    """Why ``derive_layer_mapping(spec, ctx)`` fails closed, or None if it certifies."""
    result = _derive(spec, ctx)
    return result if isinstance(result, str) else None


def opaque_fallback_mapping(
    page_size_bytes: int,
    num_ranks: int,
    rank: int,
    *,
    derived_for: LayerSpec | None = None,
    fallback_reason: str = "stored opaquely",
) -> CanonicalPageMapping:
    """Fallback: the rank's page stored whole at the rank-exclusive offset ``rank * page_size``
    (readable only by the same topology: never parallelism agnostic); ``derived_for``: the
    page it stands for, when known; ``fallback_reason``: why the layer is opaque."""
    # A 0-byte page (a block shorter than one compressed state) is legal, as in vLLM.
    if page_size_bytes < 0:
        raise ValueError(f"page_size_bytes: expected an int >= 0, got {page_size_bytes!r}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks: expected a positive int, got {num_ranks!r}")
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank: expected an int in [0, {num_ranks}), got {rank!r}")
    if derived_for is not None and derived_for.page_size_bytes != page_size_bytes:
        raise ValueError(
            f"derived_for: expected a LayerSpec of {page_size_bytes}-byte pages, got one of "
            f"{derived_for.page_size_bytes} bytes"
        )
    run = CopyRun(0, rank * page_size_bytes, page_size_bytes, 1, page_size_bytes, page_size_bytes)
    return CanonicalPageMapping(
        canonical_page_size_bytes=num_ranks * page_size_bytes,
        local_page_size_bytes=page_size_bytes,
        runs=(run,),
        num_writers=1,
        writer_index=0,
        parallelism_agnostic=False,
        derived_for=derived_for,
        fallback_reason=str(fallback_reason),
    )


def opaque_group(
    page_size_bytes: int, num_ranks: int, reason: str, spec: LayerSpec | None = None
) -> tuple[CanonicalPageMapping, ...]:
    """:func:`opaque_fallback_mapping` of every rank of a group, indexed by rank."""
    return tuple(
        opaque_fallback_mapping(
            page_size_bytes, num_ranks, r, derived_for=spec, fallback_reason=reason
        )
        for r in range(num_ranks)
    )


def derive_group_mappings(
    spec: LayerSpec,
    tp_size: int,
    total_kv_heads: int,
    dcp_size: int = 1,
    pcp_size: int = 1,
    interleave: int = 1,
    *,
    layer_name: str = "<layer>",
) -> tuple[CanonicalPageMapping, ...]:
    """Mappings of one layer for every rank of a ``tp_size * pcp_size`` group, indexed by rank
    (``pcp_rank * tp_size + tp_rank``): all certified or all opaque, verified (``TilingError``
    naming ``layer_name``) and cached per (spec, topology)."""
    ctx = RankContext(tp_size, total_kv_heads, 0, dcp_size, pcp_size, interleave)
    return _group_mappings(spec, ctx, layer_name)


def _group_mappings(
    spec: LayerSpec, ctx: RankContext, layer_name: str
) -> tuple[CanonicalPageMapping, ...]:
    """:func:`derive_group_mappings` for the group of ``ctx`` (any of its ranks)."""
    if not isinstance(spec, LayerSpec):
        raise TypeError(f"spec: expected a LayerSpec, got {type(spec).__name__}")
    try:
        return _verified_group_mappings(spec, replace(ctx, rank=0))
    except TilingError as error:
        raise TilingError(layer_name, error.detail) from None


@lru_cache(maxsize=1024)
def _verified_group_mappings(spec: LayerSpec, ctx: RankContext) -> tuple[CanonicalPageMapping, ...]:
    derived = [_derive(spec, replace(ctx, rank=rank)) for rank in range(ctx.group_size)]
    reason = next((result for result in derived if isinstance(result, str)), None)
    if reason is None:
        mappings = tuple(derived)
    else:
        mappings = opaque_group(spec.page_size_bytes, ctx.group_size, reason, spec)
    verify_tiling(mappings)  # a failure is not cached: lru_cache stores only returns
    return mappings


def group_layer_mappings(
    specs: Sequence[LayerSpec | None],
    ctx: RankContext,
    *,
    fallback_page_sizes: Sequence[int] | None = None,
    layer_names: Sequence[str] | None = None,
) -> list[tuple[CanonicalPageMapping, ...]]:
    """Every layer's verified mappings for every rank of ``ctx``'s group; a layer whose spec is
    None gets the opaque fallback of ``fallback_page_sizes[l]`` bytes per page."""
    out = []
    for layer, spec in enumerate(specs):
        if spec is not None:
            name = layer_names[layer] if layer_names else f"layer {layer}"
            out.append(_group_mappings(spec, ctx, name))
        elif fallback_page_sizes is None:
            raise ValueError(f"specs[{layer}]: None needs fallback_page_sizes[{layer}]")
        else:
            reason = certification_failure(None, ctx)
            out.append(opaque_group(int(fallback_page_sizes[layer]), ctx.group_size, reason))
    return out
