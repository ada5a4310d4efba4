"""Byte mappings between one rank's physical KV page and a canonical page (a layer's block
without parallelism), as strided :class:`CopyRun` records ordered and coalesced exactly as
vLLM 0.33's canonical format v1, so two programs that agree on them write the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .spec import LayerSpec

__all__ = ["CanonicalPageMapping", "CopyRun", "coalesce_runs"]


@dataclass(frozen=True)
class CopyRun:
    """A strided byte correspondence between a local page and a canonical page: fragment ``i``
    spans ``[local_offset + i * local_stride, + fragment_size)`` in the rank's page and
    ``[canonical_offset + i * canonical_stride, + fragment_size)`` in the canonical one (bytes)."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    canonical_stride: int


_run_fields = attrgetter(*(f.name for f in fields(CopyRun)))  # a run as a tuple, field order


@dataclass(frozen=True)
class CanonicalPageMapping:
    """How one rank's page (``local_page_size_bytes``, unpadded) maps into a canonical
    (parallelism-free) page: ``runs`` cover the local page exactly once, in both directions;
    the ``num_writers`` ranks holding these exact bytes take turns by page id (this one is
    ``writer_index``); ``parallelism_agnostic``: the same canonical bytes under any TP.

    ``derived_for``: the rank's page it was derived for (every ``layouts`` mapping carries it,
    and ``make_plan`` refuses a tensor that is not that page; None only for hand-built
    mappings, checked for fit alone). ``fallback_reason``: why the layer is stored opaquely
    (the rank's page whole, same topology only), or None. Neither takes part in equality:
    mappings compare by their bytes, as vLLM's do.
    """

    canonical_page_size_bytes: int
    local_page_size_bytes: int
    runs: tuple[CopyRun, ...]
    num_writers: int
    writer_index: int
    parallelism_agnostic: bool
    derived_for: LayerSpec | None = field(default=None, compare=False, repr=False)
    fallback_reason: str | None = field(default=None, compare=False, repr=False)

    def is_writer(self, page_id: int) -> bool:
        """Whether this rank stores canonical page ``page_id`` (rotation by page)."""
        return page_id % self.num_writers == self.writer_index

    @property
    def num_fragments(self) -> int:
        """Total fragments over all runs, before fragment-level coalescing."""
        return sum(run.num_fragments for run in self.runs)

    @cached_property
    def _fragments(self) -> np.ndarray:
        # Expand every run at once: fragment j of a run sits j strides from its offset.
        fields = np.array([_run_fields(r) for r in self.runs], dtype=np.int64).reshape(-1, 6)
        counts = fields[:, 3]
        per_frag = np.repeat(fields, counts, axis=0)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        index = np.arange(per_frag.shape[0], dtype=np.int64) - first
        local = per_frag[:, 0] + index * per_frag[:, 4]
        canonical = per_frag[:, 1] + index * per_frag[:, 5]
        size = per_frag[:, 2]
        order = np.argsort(local, kind="stable")
        local, canonical, size = local[order], canonical[order], size[order]
        # A fragment continues the previous one when it is adjacent in both pages.
        joins = (local[1:] == local[:-1] + size[:-1]) & (
            canonical[1:] == canonical[:-1] + size[:-1]
        )
        starts = np.flatnonzero(np.concatenate(([local.size > 0], ~joins)))
        out = np.stack([local[starts], canonical[starts], np.add.reduceat(size, starts)], axis=1)
        out.setflags(write=False)
        return out

    def fragments(self) -> np.ndarray:
        """Every fragment as a read-only, shared int64 array (n, 3) of (local_offset,
        canonical_offset, size), sorted by local offset, those adjacent in both pages merged."""
        return self._fragments


def coalesce_runs(runs: list[CopyRun] | tuple[CopyRun, ...]) -> tuple[CopyRun, ...]:
    """Merge contiguous fragments within and across runs, in order: exactly what vLLM 0.33
    stores in its mappings, so comparisons of ``runs`` between the two are meaningful."""
    out: list[CopyRun] = []
    for run in runs:
        if (
            run.num_fragments > 1
            and run.local_stride == run.fragment_size
            and run.canonical_stride == run.fragment_size
        ):
            size = run.fragment_size * run.num_fragments
            run = CopyRun(run.local_offset, run.canonical_offset, size, 1, size, size)
        if out and out[-1].num_fragments == 1 and run.num_fragments == 1:
            prev = out[-1]
            if (
                prev.local_offset + prev.fragment_size == run.local_offset
                and prev.canonical_offset + prev.fragment_size == run.canonical_offset
            ):
                size = prev.fragment_size + run.fragment_size
                out[-1] = CopyRun(prev.local_offset, prev.canonical_offset, size, 1, size, size)
                continue
        out.append(run)
    return tuple(out)
