"""Text picture of which rank writes which bytes of one canonical page."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .derive import _group_mappings, canonical_format_id, certification_failure
from .mapping import CanonicalPageMapping
from .spec import LayerSpec, RankContext

RANK_SYMBOLS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _coverage(mapping: CanonicalPageMapping, edges: np.ndarray) -> np.ndarray:
    """Bytes of each column [edges[i], edges[i+1]) that ``mapping`` writes: the bytes written
    below each edge (sorted fragments' cumulative sizes), differenced per column."""
    frags = mapping.fragments()
    order = np.argsort(frags[:, 1], kind="stable")
    starts, sizes = frags[order, 1], frags[order, 2]
    ends = starts + sizes
    if len(starts) > 1 and bool((ends[:-1] > starts[1:]).any()):
        # Overlapping fragments (never in a verified mapping): count them naively.
        lo = np.maximum(starts[None, :], edges[:-1, None])
        hi = np.minimum(ends[None, :], edges[1:, None])
        return np.clip(hi - lo, 0, None).sum(axis=1)
    cumulative = np.concatenate(([0], np.cumsum(sizes)))
    begun = np.searchsorted(starts, edges, side="right")  # fragments starting at or before
    below = cumulative[begun]
    # Only the last fragment begun may extend past the edge: drop its part above it.
    last = np.maximum(begun - 1, 0)
    overhang = np.where(begun > 0, np.clip(ends[last] - edges, 0, None), 0)
    return np.diff(below - overhang)


def _column_edges(mappings: Sequence[CanonicalPageMapping], page_id: int, width: int) -> np.ndarray:
    """Exact fragment boundaries when few enough, otherwise ``width`` equal byte ranges."""
    size = mappings[0].canonical_page_size_bytes
    bounds = {0, size}
    for m in mappings:
        if m.is_writer(page_id):
            frags = m.fragments()
            bounds.update(frags[:, 1].tolist())
            bounds.update((frags[:, 1] + frags[:, 2]).tolist())
            if len(bounds) > width + 1:
                break
    if len(bounds) <= width + 1:
        return np.array(sorted(bounds), dtype=np.int64)
    return np.linspace(0, size, width + 1).round().astype(np.int64)


def picture(mappings: Sequence[CanonicalPageMapping], page_id: int = 0, width: int = 64) -> str:
    """One row per rank, one column per byte range of canonical page ``page_id``: the rank's
    symbol where it writes the whole range, ``+`` where part of it, ``.`` where none."""
    edges = _column_edges(mappings, page_id, width)
    widths = np.diff(edges)
    exact = len(edges) - 1 < width
    lines = [
        f"canonical page {page_id}: {mappings[0].canonical_page_size_bytes} bytes, "
        f"{len(widths)} columns of "
        + ("exact fragment ranges" if exact else f"~{int(widths.mean())} bytes")
    ]
    for rank, mapping in enumerate(mappings):
        symbol = RANK_SYMBOLS[rank % len(RANK_SYMBOLS)]
        if mapping.is_writer(page_id):
            covered = _coverage(mapping, edges)
            cells = "".join(
                symbol if c == w else ("+" if c else ".") for c, w in zip(covered, widths)
            )
            written = int(mapping.fragments()[:, 2].sum())
        else:
            cells, written = " " * len(widths), 0
        note = f"writes {written} B" if written else "not elected for this page"
        lines.append(f"rank {rank:>3} |{cells}| {note}")
    return "\n".join(lines)


def explain(spec: LayerSpec, ctx: RankContext, page_id: int = 0, width: int = 64) -> str:
    """Full report: topology, page sizes, certification, writer rotation, picture, format id."""
    mappings = _group_mappings(spec, ctx, "<layer>")
    reason = certification_failure(spec, ctx)
    out = [
        f"layer: {spec.attention} attention, {spec.packing} {spec.order}, {spec.dtype}, "
        f"block_size {spec.block_size}, {spec.num_kv_heads} KV head(s) per rank of "
        f"{spec.head_size} elements",
        f"topology: TP={ctx.tp_size} DCP={ctx.dcp_size} PCP={ctx.pcp_size} "
        f"interleave={ctx.interleave} ({ctx.group_size} ranks), "
        f"{ctx.total_kv_heads} KV heads in total",
        f"format id: {canonical_format_id(spec.order)}",
        f"local page: {mappings[0].local_page_size_bytes} B per rank; canonical page: "
        f"{mappings[0].canonical_page_size_bytes} B",
        "certified: yes" + (" (parallelism agnostic)" if mappings[0].parallelism_agnostic else "")
        if reason is None
        else f"certified: NO, opaque fallback (each rank's page whole at rank * page): {reason}",
        f"fragments per rank: {', '.join(str(len(m.fragments())) for m in mappings[:16])}"
        + (" ..." if len(mappings) > 16 else ""),
    ]
    num_writers = mappings[0].num_writers
    for pid in range(num_writers):
        writers = [r for r, m in enumerate(mappings) if m.is_writer(pid)]
        out.append(f"writers of pages p with p % {num_writers} == {pid}: ranks {writers}")
    out.append(picture(mappings, page_id, width))
    return "\n".join(out)
