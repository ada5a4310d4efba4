"""Exact-tiling verification of a group's canonical page mappings: a page's elected writers write
each canonical byte exactly once (a gap leaves stale bytes, an overlap races) and each rank's runs
cover its local page exactly once (a load restores it whole)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .mapping import CanonicalPageMapping

__all__ = ["TilingError", "verify_tiling", "verify_writers"]


class TilingError(ValueError):
    """A group's mappings do not tile; names the layer and the first gap or overlap."""

    def __init__(self, layer_name: str | None, detail: str) -> None:
        self.layer_name = layer_name
        self.detail = detail
        where = f"layer {layer_name}" if layer_name is not None else "mappings"
        super().__init__(f"{where}: {detail}")


def _first_defect(starts: np.ndarray, ends: np.ndarray, size: int) -> tuple[str, int, int] | None:
    """First gap or overlap of sorted intervals against [0, size): (what, begin, end), what
    being "a gap", "an overlap" or "an out of range"."""
    if starts.size == 0:
        return ("a gap", 0, size)
    if starts[0] > 0:
        return ("a gap", 0, int(starts[0]))
    if starts[0] < 0:
        return ("an out of range", int(starts[0]), 0)
    bad = np.flatnonzero(ends[:-1] != starts[1:])
    if bad.size:
        i = int(bad[0])
        if ends[i] < starts[i + 1]:
            return ("a gap", int(ends[i]), int(starts[i + 1]))
        return ("an overlap", int(starts[i + 1]), int(min(ends[i], ends[i + 1])))
    if ends[-1] != size:
        kind = "a gap" if ends[-1] < size else "an out of range"
        return (kind, int(min(ends[-1], size)), int(max(ends[-1], size)))
    return None


def verify_tiling(mappings: Sequence[CanonicalPageMapping], layer_name: str | None = None) -> None:
    """Check that a group's mappings (indexed by rank) tile exactly: :func:`verify_writers`,
    and each rank's runs cover its local page exactly once. A ``TilingError`` names
    ``layer_name``, the first disagreement, gap or overlap, its byte range and the ranks."""
    verify_writers(mappings, layer_name, local=True)


def verify_writers(
    mappings: Sequence[CanonicalPageMapping],
    layer_name: str | None = None,
    part: str = "",
    *,
    local: bool = False,
) -> None:
    """The canonical side of :func:`verify_tiling` (its local side too when ``local``): ranks
    agree on page size and writer count, and every rotation's writers write each canonical byte
    exactly once. ``part``: which part of the layer (e.g. a state segment) the error names."""
    prefix = f"{part}: " if part else ""
    if not mappings:
        raise TilingError(layer_name, f"{prefix}no mappings (expected one per rank)")
    size = mappings[0].canonical_page_size_bytes
    num_writers = mappings[0].num_writers
    for rank, mapping in enumerate(mappings):
        for name, want in (("canonical_page_size_bytes", size), ("num_writers", num_writers)):
            if getattr(mapping, name) != want:
                raise TilingError(
                    layer_name,
                    f"{prefix}rank {rank} has {name}={getattr(mapping, name)}, rank 0 has {want}",
                )
        if not 0 <= mapping.writer_index < num_writers:
            raise TilingError(
                layer_name,
                f"{prefix}rank {rank} has writer_index={mapping.writer_index}, "
                f"expected 0 <= writer_index < {num_writers}",
            )
    all_frags = [m.fragments() for m in mappings]  # sorted by local offset
    for rank, frags in enumerate(all_frags if local else ()):
        local_size = mappings[rank].local_page_size_bytes
        defect = _first_defect(frags[:, 0], frags[:, 0] + frags[:, 2], local_size)
        if defect:
            kind, begin, end = defect
            raise TilingError(
                layer_name,
                f"{prefix}rank {rank}'s runs leave {kind} in its local page at bytes "
                f"[{begin}, {end}) of {local_size}",
            )
    for page_id in range(num_writers):
        writers = [r for r, m in enumerate(mappings) if m.is_writer(page_id)]
        if not writers:
            raise TilingError(layer_name, f"{prefix}page id {page_id} has no writer")
        starts = np.concatenate([all_frags[r][:, 1] for r in writers])
        sizes = np.concatenate([all_frags[r][:, 2] for r in writers])
        owner = np.concatenate([np.full(len(all_frags[r]), r, dtype=np.int64) for r in writers])
        order = np.argsort(starts, kind="stable")
        starts, ends, owner = starts[order], starts[order] + sizes[order], owner[order]
        defect = _first_defect(starts, ends, size)
        if defect and (size or defect[0] != "a gap"):  # an empty page has no gap
            kind, begin, end = defect
            near = np.flatnonzero((starts < max(end, begin + 1)) & (ends > begin - 1))
            ranks = sorted({int(owner[i]) for i in near})
            raise TilingError(
                layer_name,
                f"{prefix}writers {writers} of page ids = {page_id} (mod {num_writers}) leave "
                f"{kind} in the canonical page at bytes [{begin}, {end}) of {size} "
                f"(ranks touching it: {ranks})",
            )
