"""Exact-tiling verification of a group's canonical page mappings.

Writers elected for a page must write each canonical byte exactly once (a gap
would leave stale bytes for a reader, an overlap would race), and each rank's
runs must cover its own local page exactly once (so a load restores the whole
page). Done with numpy over coalesced fragments: fast enough to run for every
layer at engine start.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .mapping import CanonicalPageMapping

__all__ = ["TilingError", "verify_tiling"]


class TilingError(ValueError):
    """A group's mappings do not tile; names the layer and the first gap or overlap."""

    def __init__(self, layer_name: str | None, detail: str) -> None:
        self.layer_name = layer_name
        self.detail = detail
        where = f"layer {layer_name}" if layer_name is not None else "mappings"
        super().__init__(f"{where}: {detail}")


def _first_defect(starts: np.ndarray, ends: np.ndarray, size: int) -> tuple[str, int, int] | None:
    """First gap or overlap of sorted intervals against [0, size): (kind, begin, end)."""
    if starts.size == 0:
        return ("gap", 0, size)
    if starts[0] > 0:
        return ("gap", 0, int(starts[0]))
    if starts[0] < 0:
        return ("out of range", int(starts[0]), 0)
    bad = np.flatnonzero(ends[:-1] != starts[1:])
    if bad.size:
        i = int(bad[0])
        if ends[i] < starts[i + 1]:
            return ("gap", int(ends[i]), int(starts[i + 1]))
        return ("overlap", int(starts[i + 1]), int(min(ends[i], ends[i + 1])))
    if ends[-1] != size:
        kind = "gap" if ends[-1] < size else "out of range"
        return (kind, int(min(ends[-1], size)), int(max(ends[-1], size)))
    return None


def verify_tiling(mappings: Sequence[CanonicalPageMapping], layer_name: str | None = None) -> None:
    """Check that a group's mappings (indexed by rank) tile exactly.

    Parameters
    ----------
    mappings : sequence of CanonicalPageMapping, one per rank of the group.
    layer_name : str, optional
        Named in the error.

    Raises
    ------
    TilingError
        When ranks disagree on the canonical page size or writer count, when a
        rank's runs leave a gap in or overlap its local page, or when the
        writers elected for some page id (0 .. num_writers-1 covers every
        rotation) leave a gap in or overlap the canonical page. The message
        gives the byte range and the ranks involved.
    """
    if not mappings:
        raise TilingError(layer_name, "no mappings (expected one per rank)")
    size = mappings[0].canonical_page_size_bytes
    num_writers = mappings[0].num_writers
    for rank, mapping in enumerate(mappings):
        if mapping.canonical_page_size_bytes != size:
            raise TilingError(
                layer_name,
                f"rank {rank} has canonical_page_size_bytes={mapping.canonical_page_size_bytes}, "
                f"rank 0 has {size}",
            )
        if mapping.num_writers != num_writers:
            raise TilingError(
                layer_name,
                f"rank {rank} has num_writers={mapping.num_writers}, rank 0 has {num_writers}",
            )
        if not 0 <= mapping.writer_index < num_writers:
            raise TilingError(
                layer_name,
                f"rank {rank} has writer_index={mapping.writer_index}, "
                f"expected 0 <= writer_index < {num_writers}",
            )
        frags = mapping.fragments()  # sorted by local offset
        defect = _first_defect(
            frags[:, 0], frags[:, 0] + frags[:, 2], mapping.local_page_size_bytes
        )
        if defect:
            kind, begin, end = defect
            raise TilingError(
                layer_name,
                f"rank {rank}'s runs leave {'a ' if kind == 'gap' else 'an '}{kind} in its "
                f"local page at bytes [{begin}, {end}) of {mapping.local_page_size_bytes}",
            )
    all_frags = [m.fragments() for m in mappings]
    for page_id in range(num_writers):
        writers = [r for r, m in enumerate(mappings) if m.is_writer(page_id)]
        if not writers:
            raise TilingError(layer_name, f"page id {page_id} has no writer")
        starts = np.concatenate([all_frags[r][:, 1] for r in writers])
        sizes = np.concatenate([all_frags[r][:, 2] for r in writers])
        owner = np.concatenate([np.full(len(all_frags[r]), r, dtype=np.int64) for r in writers])
        order = np.argsort(starts, kind="stable")
        starts, ends, owner = starts[order], starts[order] + sizes[order], owner[order]
        defect = _first_defect(starts, ends, size)
        if defect:
            kind, begin, end = defect
            near = np.flatnonzero((starts < max(end, begin + 1)) & (ends > begin - 1))
            ranks = sorted({int(owner[i]) for i in near})
            raise TilingError(
                layer_name,
                f"writers {writers} of page ids = {page_id} (mod {num_writers}) leave "
                f"{'a ' if kind == 'gap' else 'an '}{kind} in the canonical page at bytes "
                f"[{begin}, {end}) of {size} (ranks touching it: {ranks})",
            )
