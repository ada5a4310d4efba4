"""Which units to evict: least recently used first, tails first among equally recent ones
(recency quantised to ``granularity_s``; a tail is useless without its head).
:class:`LruPolicy` is a :class:`~.files.FileStore`'s index and ``store gc``'s order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..checks import check_seconds

__all__ = ["Entry", "LruPolicy", "cover"]


def cover(
    ranges: Collection[tuple[int, int]], first: int, end: int
) -> list[tuple[int, int]] | None:
    """Layer ranges covering ``[first, end)``: the exact one if there, else greedy (each
    reaching furthest); None when they do not."""
    if (first, end) in ranges:
        return [(first, end)]
    chain, at = [], first
    while at < end:
        best = max((r for r in ranges if r[0] <= at < r[1]), default=None, key=lambda r: r[1])
        if best is None:
            return None
        chain.append(best)
        at = best[1]
    return chain


@dataclass(eq=False)
class Entry:
    """One stored unit: its raw key and key digest, layer range, file bytes, prefix
    position and last use (ns since the epoch); ``where`` is the caller's (a directory)."""

    key: bytes
    kd: str
    first: int
    end: int
    size: int
    position: int
    last_used: int
    where: object = field(default=None, repr=False)
    ident: tuple[str, int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ident = (self.kd, self.first, self.end)


class LruPolicy:
    """A store's index of units: in least-recently-used-first order (the victims that free
    some bytes), and per key digest (the units that cover a layer range)."""

    def __init__(self, granularity_s: float = 1.0) -> None:
        granularity_s = check_seconds("recency_granularity_s", granularity_s)
        self.granularity_ns = max(1, int(granularity_s * 1e9))
        self._order: OrderedDict[Hashable, Entry] = OrderedDict()
        self._by_key: dict[str, dict[tuple[int, int], Entry]] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._order.values())

    def __contains__(self, ident: Hashable) -> bool:
        return ident in self._order

    def add(self, entry: Entry) -> None:
        """Insert (or replace) ``entry`` as the most recent."""
        self.drop(entry.ident)
        self._order[entry.ident] = entry
        self._by_key.setdefault(entry.kd, {})[(entry.first, entry.end)] = entry
        self.bytes += entry.size

    def drop(self, ident: tuple[str, int, int]) -> Entry | None:
        entry = self._order.pop(ident, None)
        if entry is not None:
            self.bytes -= entry.size
            ranges = self._by_key[entry.kd]
            del ranges[(entry.first, entry.end)]
            if not ranges:
                del self._by_key[entry.kd]
        return entry

    def ranges(self, kd: str) -> set[tuple[int, int]]:
        """The layer ranges indexed for key digest ``kd``."""
        return set(self._by_key.get(kd, ()))

    def cover(self, kd: str, first: int, end: int, excluded: Any = ()) -> list[Entry] | None:
        """Units of ``kd`` covering layers [first, end): the exact one if any, else greedy
        (each reaching furthest); None when they do not. ``excluded``: idents to skip."""
        ranges = self._by_key.get(kd, {})
        if not excluded and (exact := ranges.get((first, end))) is not None:
            return [exact]  # the usual case: the unit asked for
        if excluded:
            ranges = {r: e for r, e in ranges.items() if e.ident not in excluded}
        chain = cover(ranges, first, end)
        return None if chain is None else [ranges[r] for r in chain]

    def touch(self, entry: Entry, now_ns: int) -> None:
        """``entry`` was used at ``now_ns``: the most recent now."""
        entry.last_used = now_ns
        if entry.ident in self._order:
            self._order.move_to_end(entry.ident)

    def clear(self) -> None:
        self._order.clear()
        self._by_key.clear()
        self.bytes = 0

    def victims(self, need_bytes: int) -> list[Entry]:
        """Entries freeing at least ``need_bytes`` (all of them if they cannot): oldest
        bucket first, within it highest position first; only as many buckets as needed."""
        chosen: list[Entry] = []
        freed, bucket, current = 0, [], None
        for entry in [*self._order.values(), None]:
            key = None if entry is None else entry.last_used // self.granularity_ns
            if bucket and key != current:
                for victim in sorted(bucket, key=lambda e: (-e.position, e.last_used)):
                    if freed >= need_bytes:
                        return chosen
                    chosen.append(victim)
                    freed += victim.size
                bucket = []
            if entry is not None:
                current = key
                bucket.append(entry)
        return chosen
