"""Derivation of canonical page mappings (format v1) from a LayerSpec and a RankContext.

This is the only code in canonical-kv that reasons about TP/DCP/PCP, heads and
tokens. It fails closed: whenever a layer's bytes cannot be proven to land in
the same canonical place under every topology (an unexpected head count, a TP
size that does not divide, quantisation scales outside the page, ...), the
layer gets no certified mapping, and the group falls back to an opaque mapping
that stores each rank's page whole at a rank-exclusive offset. Opaque pages
are only readable by the same topology, which is safe; a wrong certified
mapping would silently hand a reader another rank's bytes, which is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
    """Identity of the canonical byte format, for namespacing persisted KV.

    Canonical pages keep the worker's stride order, so a reader must match both
    the version and the family: ``canonical_format_id("NHD") == "v1-nhd"``.
    """
    family = _FORMAT_FAMILIES.get(str(order).upper())
    if family is None:
        raise ValueError(f"order: expected 'NHD' or 'HND', got {order!r}")
    return f"v{CANONICAL_FORMAT_VERSION}-{family}"


@dataclass(frozen=True)
class _TokenRegion:
    """A byte region of the page that repeats once per token."""

    local_offset: int
    canonical_offset: int
    bytes_per_token: int
    canonical_token_stride: int


def _place_tokens(
    regions: list[_TokenRegion], num_tokens: int, ctx: RankContext
) -> tuple[CopyRun, ...]:
    """Runs putting each region's per-token rows at their canonical token positions.

    Without context parallelism a region is one strided run over all tokens;
    with it, one run per chunk of ``interleave`` tokens, since consecutive
    chunks of this rank sit ``cp_size`` chunks apart canonically.
    """
    runs: list[CopyRun] = []
    for region in regions:
        if ctx.cp_size == 1:
            starts = [(0, 0)]
            count = num_tokens
        else:
            starts = [
                (first, ctx.canonical_token(first))
                for first in range(0, num_tokens, ctx.interleave)
            ]
            count = ctx.interleave
        for local_token, canonical_token in starts:
            runs.append(
                CopyRun(
                    local_offset=region.local_offset + local_token * region.bytes_per_token,
                    canonical_offset=region.canonical_offset
                    + canonical_token * region.canonical_token_stride,
                    fragment_size=region.bytes_per_token,
                    num_fragments=count,
                    local_stride=region.bytes_per_token,
                    canonical_stride=region.canonical_token_stride,
                )
            )
    return coalesce_runs(runs)


def _attention_regions(
    spec: LayerSpec, head_shard: int, num_head_shards: int, cp_size: int
) -> list[_TokenRegion]:
    """Per-token byte regions of a full-attention page holding head shard ``head_shard``."""
    bs, heads, elem = spec.block_size, spec.num_kv_heads, spec.element_size
    canonical_tokens = bs * cp_size  # tokens of one canonical page
    if spec.packing == "packed":
        head_bytes = 2 * spec.head_size * elem  # K and V of one (token, head)
        if spec.order == "NHD":
            row = heads * head_bytes
            return [_TokenRegion(0, head_shard * row, row, num_head_shards * row)]
        return [
            _TokenRegion(
                local_offset=head * bs * head_bytes,
                canonical_offset=(head_shard * heads + head) * canonical_tokens * head_bytes,
                bytes_per_token=head_bytes,
                canonical_token_stride=head_bytes,
            )
            for head in range(heads)
        ]
    head_bytes = spec.head_size * elem  # K or V of one (token, head)
    local_half = bs * heads * head_bytes
    if spec.order == "NHD":
        row = heads * head_bytes
        canonical_half = canonical_tokens * num_head_shards * row
        return [
            _TokenRegion(
                local_offset=half * local_half,
                canonical_offset=half * canonical_half + head_shard * row,
                bytes_per_token=row,
                canonical_token_stride=num_head_shards * row,
            )
            for half in range(2)  # K, then V
        ]
    total_heads = num_head_shards * heads
    return [
        _TokenRegion(
            local_offset=half * local_half + head * bs * head_bytes,
            canonical_offset=(half * total_heads + head_shard * heads + head)
            * canonical_tokens
            * head_bytes,
            bytes_per_token=head_bytes,
            canonical_token_stride=head_bytes,
        )
        for half in range(2)
        for head in range(heads)
    ]


def _derive(spec: LayerSpec | None, ctx: RankContext) -> CanonicalPageMapping | str:
    """The certified mapping, or the reason the layer cannot be certified."""
    if spec is None:
        return "unrecognised physical layout (LayerSpec.from_tensor returned None)"
    bs = spec.block_size
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

    if spec.attention == "mla":
        # The latent is replicated over TP; CP splits its tokens across DCP groups.
        if ctx.tp_size % ctx.dcp_size:
            return f"dcp_size={ctx.dcp_size} does not divide tp_size={ctx.tp_size} for MLA"
        row = page // bs
        return CanonicalPageMapping(
            canonical_page_size_bytes=ctx.cp_size * page,
            local_page_size_bytes=page,
            runs=_place_tokens([_TokenRegion(0, 0, row, row)], bs, ctx),
            num_writers=ctx.tp_size // ctx.dcp_size,
            writer_index=ctx.tp_rank // ctx.dcp_size,
            parallelism_agnostic=ctx.cp_size == 1,
            derived_for=spec,
        )

    total, tp = ctx.total_kv_heads, ctx.tp_size
    expected_heads = max(1, total // tp)
    if spec.num_kv_heads != expected_heads:
        return (
            f"num_kv_heads={spec.num_kv_heads} but {total} KV heads over tp_size={tp} "
            f"gives {expected_heads} per rank"
        )
    if total >= tp:
        if total % tp:
            return f"tp_size={tp} does not divide total_kv_heads={total}"
        num_head_shards, replication = tp, 1
    else:
        if tp % total:
            return f"total_kv_heads={total} does not divide tp_size={tp} (replicated heads)"
        num_head_shards, replication = total, tp // total
    # DCP splits tokens among the ranks that hold the same (replicated) heads.
    if replication % ctx.dcp_size:
        return f"dcp_size={ctx.dcp_size} does not divide the head replication {replication}"
    head_shard = ctx.tp_rank // replication
    regions = _attention_regions(spec, head_shard, num_head_shards, ctx.cp_size)
    return CanonicalPageMapping(
        canonical_page_size_bytes=ctx.cp_size * num_head_shards * page,
        local_page_size_bytes=page,
        runs=_place_tokens(regions, bs, ctx),
        num_writers=replication // ctx.dcp_size,
        writer_index=(ctx.tp_rank % replication) // ctx.dcp_size,
        parallelism_agnostic=ctx.cp_size == 1,
        derived_for=spec,
    )


def derive_layer_mapping(spec: LayerSpec | None, ctx: RankContext) -> CanonicalPageMapping | None:
    """Certified canonical mapping of one layer at one rank.

    Returns
    -------
    CanonicalPageMapping | None
        None when the layer cannot be certified (fail closed); the reason is
        available from :func:`certification_failure`.
    """
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
    """Fallback: the rank's page stored whole at the rank-exclusive offset ``rank * page_size``.

    Readable only by the same topology, which is why it is never certified as
    parallelism agnostic. ``derived_for``: the page it stands for, when known
    (:func:`derive_group_mappings` passes the layer's spec); ``fallback_reason``:
    why the layer is opaque.
    """
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
    """Mappings of one layer for every rank of a ``tp_size * pcp_size`` group, verified.

    Every rank certifies, or every rank gets :func:`opaque_fallback_mapping`
    (mixing the two would tile nothing). The result is checked by
    :func:`verify_tiling`, which raises ``TilingError`` naming ``layer_name``.
    Results are cached per (spec, topology): a model's identical layers cost
    one derivation.

    Returns
    -------
    tuple[CanonicalPageMapping, ...]
        Indexed by rank (``pcp_rank * tp_size + tp_rank``).
    """
    if not isinstance(spec, LayerSpec):
        raise TypeError(f"spec: expected a LayerSpec, got {type(spec).__name__}")
    try:
        return _verified_group_mappings(
            spec, tp_size, total_kv_heads, dcp_size, pcp_size, interleave
        )
    except TilingError as error:
        raise TilingError(layer_name, error.detail) from None


@lru_cache(maxsize=1024)
def _verified_group_mappings(
    spec: LayerSpec,
    tp_size: int,
    total_kv_heads: int,
    dcp_size: int,
    pcp_size: int,
    interleave: int,
) -> tuple[CanonicalPageMapping, ...]:
    contexts = [
        RankContext(tp_size, total_kv_heads, rank, dcp_size, pcp_size, interleave)
        for rank in range(tp_size * pcp_size)
    ]
    derived = [_derive(spec, ctx) for ctx in contexts]
    reason = next((result for result in derived if isinstance(result, str)), None)
    if reason is not None:
        derived = [
            opaque_fallback_mapping(
                spec.page_size_bytes,
                len(contexts),
                ctx.rank,
                derived_for=spec,
                fallback_reason=reason,
            )
            for ctx in contexts
        ]
    mappings = tuple(derived)
    verify_tiling(mappings)  # a failure is not cached: lru_cache stores only returns
    return mappings


def group_layer_mappings(
    specs: Sequence[LayerSpec | None],
    ctx: RankContext,
    *,
    fallback_page_sizes: Sequence[int] | None = None,
    layer_names: Sequence[str] | None = None,
) -> list[tuple[CanonicalPageMapping, ...]]:
    """Every layer's verified mappings for every rank of ``ctx``'s group.

    A layer whose spec is None (layout not recognised) gets the opaque fallback with
    ``fallback_page_sizes[l]`` bytes per page (its block size in bytes). Every opaque
    mapping carries its ``fallback_reason``.
    """
    out = []
    for layer, spec in enumerate(specs):
        if spec is None:
            if fallback_page_sizes is None:
                raise ValueError(f"specs[{layer}]: None needs fallback_page_sizes[{layer}]")
            page, ranks = int(fallback_page_sizes[layer]), ctx.group_size
            reason = certification_failure(None, ctx)
            out.append(
                tuple(
                    opaque_fallback_mapping(page, ranks, r, fallback_reason=reason)
                    for r in range(ranks)
                )
            )
            continue
        name = layer_names[layer] if layer_names else f"layer {layer}"
        out.append(
            derive_group_mappings(
                spec,
                ctx.tp_size,
                ctx.total_kv_heads,
                ctx.dcp_size,
                ctx.pcp_size,
                ctx.interleave,
                layer_name=name,
            )
        )
    return out
