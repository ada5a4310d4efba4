"""The writer election (ranks holding the same bytes take turns by page id): the ranks a page
waits for (:class:`WriterElection`) and the bytes one rank moves (:class:`RankShare`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .mapping import CanonicalPageMapping
from .spec import is_int

__all__ = ["RankShare", "WriterElection"]


def _checked(name: str, mappings: Sequence[CanonicalPageMapping]) -> tuple:
    if isinstance(mappings, CanonicalPageMapping) or not isinstance(mappings, Sequence):
        raise TypeError(f"{name}: expected a sequence of CanonicalPageMapping")
    for index, mapping in enumerate(mappings):
        if not isinstance(mapping, CanonicalPageMapping):
            raise TypeError(
                f"{name}[{index}]: expected a CanonicalPageMapping, got {type(mapping).__name__}"
            )
        writers = mapping.num_writers
        if isinstance(writers, bool) or not isinstance(writers, int) or writers < 1:
            raise ValueError(f"{name}[{index}]: expected num_writers >= 1, got {writers!r}")
    return tuple(mappings)


class RankShare:
    """What ONE rank writes (its elected layers' local pages) and reads (every local page) per
    canonical page, over its ``mappings`` of a set of layers (a layer listed twice counts twice)."""

    def __init__(self, mappings: Sequence[CanonicalPageMapping]) -> None:
        self.mappings = _checked("mappings", mappings)
        self.period = math.lcm(*(m.num_writers for m in self.mappings)) if self.mappings else 1
        self._bytes = np.array(
            [
                sum(m.local_page_size_bytes for m in self.mappings if m.is_writer(residue))
                for residue in range(self.period)
            ],
            dtype=np.int64,
        )
        self._writes = tuple(
            any(m.is_writer(residue) for m in self.mappings) for residue in range(self.period)
        )
        self.page_bytes = sum(m.local_page_size_bytes for m in self.mappings)

    def writes(self, page_id: int) -> bool:
        """Whether the rank is elected for some layer of page ``page_id``."""
        return self._writes[int(page_id) % self.period]

    def store_bytes(self, page_ids) -> int:
        """Bytes the rank writes storing ``page_ids`` (integer array-like)."""
        ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
        if self.period == 1:
            return int(self._bytes[0]) * ids.size
        return int(self._bytes[ids % self.period].sum())

    def load_bytes(self, num_pages: int) -> int:
        """Bytes the rank reads loading ``num_pages`` pages (every local page, every layer)."""
        return self.page_bytes * int(num_pages)


class WriterElection:
    """The election of a set of layers (``layer_group_mappings[l][r]``: layer ``l``'s mapping at
    rank ``r``) over a group of ranks: a page is complete once every rank in :meth:`writers`
    stored it."""

    def __init__(self, layer_group_mappings: Sequence[Sequence[CanonicalPageMapping]]) -> None:
        name = "layer_group_mappings"
        groups = [
            _checked(f"{name}[{layer}]", group) for layer, group in enumerate(layer_group_mappings)
        ]
        if not groups:
            raise ValueError(f"{name}: expected at least one layer, got none")
        self.num_ranks = len(groups[0])
        if self.num_ranks == 0:
            raise ValueError(f"{name}[0]: expected at least one rank, got none")
        for layer, group in enumerate(groups):
            if len(group) != self.num_ranks:
                raise ValueError(
                    f"{name}[{layer}]: expected {self.num_ranks} ranks (as layer 0), "
                    f"got {len(group)}"
                )
        self.period = math.lcm(*(m.num_writers for group in groups for m in group))
        table = []
        for residue in range(self.period):
            ranks: set[int] = set()
            for layer, group in enumerate(groups):
                elected = {r for r, m in enumerate(group) if m.is_writer(residue)}
                if not elected:
                    raise ValueError(
                        f"{name}[{layer}]: no rank is the elected writer of pages {residue} "
                        f"mod {self.period}; these pages could never be complete"
                    )
                ranks |= elected
            table.append(frozenset(ranks))
        self._table = tuple(table)
        self._groups = groups

    def writers(self, page_id: int) -> frozenset[int]:
        """Ranks that write some byte of page ``page_id``."""
        return self._table[int(page_id) % self.period]

    def share(self, rank: int) -> RankShare:
        """Rank ``rank``'s :class:`RankShare` of these layers."""
        if not is_int(rank):
            raise TypeError(f"rank: expected an int, got {type(rank).__name__}")
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank: expected an int in [0, {self.num_ranks - 1}], got {rank}")
        return RankShare([group[rank] for group in self._groups])
