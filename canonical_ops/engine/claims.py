"""The workers' claims on a shared region's rows: which bytes of every row each worker moves,
and whether as opaque pages (each rank's bytes whole, readable only at the topology that stored
them) or canonical ones. :class:`RowClaims` is the record a region keeps in its header (parsed,
checked, packed here; placed there by ``region``); :func:`unit_row_claim` is what a StageCache
of a namespace's units claims."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_RANGES",
    "RECORD_BYTES",
    "TABLES_BYTES",
    "RegionTopologyError",
    "RowArea",
    "RowClaims",
]
__all__ += ["Topology", "unit_row_claim"]

# The record: flags (_CLAIMED, _FOREIGN), a zero word, the claimed topology, the first other
# one, the number of opaque, canonical and foreign ranges; then, apart, the three range tables
# (opaque and canonical at the claimed topology, canonical elsewhere).
_CLAIMS = struct.Struct("<II4I4IHHH")
RECORD_BYTES = _CLAIMS.size
_CLAIMED, _FOREIGN = 1, 2
MAX_RANGES = 64  # per table; more are joined (the gap too: it only refuses more)
_RANGE = struct.Struct("<QQ")
_TABLE_BYTES = MAX_RANGES * _RANGE.size
TABLES_BYTES = 3 * _TABLE_BYTES
_TABLES = (0, _TABLE_BYTES, 2 * _TABLE_BYTES)  # offsets in the tables' bytes


class RegionTopologyError(ValueError):
    """A worker's layer areas cannot share the region's rows with what other workers claimed:
    an opaque page (each rank's bytes whole, ``parallelism_agnostic=False``) is readable only
    by the topology that stored it. Nothing was recorded."""


Topology = tuple[int, int, int, int]  # (tp, dcp, pcp, interleave), as units' opaque layers


def _topology_text(topology: Topology) -> str:
    return "tp={}, dcp={}, pcp={}, interleave={}".format(*topology)


@dataclass(frozen=True)
class RowArea:
    """Bytes ``[start, end)`` of every row that a worker moves, named ``name`` in errors (e.g.
    "layer 1"); ``opaque``: why its pages are each rank's bytes whole (layouts' fallback
    reason), None for canonical (parallelism free) pages."""

    name: str
    start: int
    end: int
    opaque: str | None = None


def unit_row_claim(namespace: Any, first: int, end: int) -> tuple[Topology | None, list[RowArea]]:
    """What a mover of ``namespace``'s units of layers ``[first, end)`` (a StageCache: row
    ``p`` holds one unit, the layers in order) claims of a region's rows: the topology of its
    opaque layers (a state layer's with interleave 1, as ``StateWorker`` claims; None when
    every layer is certified) and each layer's area, opaque where the namespace stores it so."""
    states = namespace.unit_kind == "state"
    geometries = (namespace.states if states else namespace.layers)[first:end]
    offsets = namespace.payload_offsets(first, end)
    kind = "state layer" if states else "layer"
    areas, topologies = [], set()
    for index, (geometry, start, stop) in enumerate(zip(geometries, offsets, offsets[1:])):
        reason = None
        if geometry.opaque:
            topology = tuple(geometry.topology)
            topologies.add((*topology, 1) if states else topology)
            why = getattr(geometry, "reason", "") or "not parallelism agnostic"
            reason = f"stored opaque in namespace {namespace.hex[:16]}... ({why})"
        areas.append(RowArea(f"{kind} {first + index}", start, stop, reason))
    if len(topologies) > 1:
        raise ValueError(f"namespace: expected opaque layers of one topology, got {topologies}")
    return (topologies.pop() if topologies else None), areas


def _joined(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` sorted and merged, at most MAX_RANGES (the nearest ones joined, gap and all:
    a claim only ever covers more, so it refuses more, never less)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    while len(out) > MAX_RANGES:
        i = min(range(len(out) - 1), key=lambda k: out[k + 1][0] - out[k][1])
        out[i : i + 2] = [(out[i][0], out[i + 1][1])]
    return out


def _overlap(area: RowArea, ranges: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    return next(((s, e) for s, e in ranges if s < area.end and area.start < e), None)


@dataclass
class RowClaims:
    """The workers' claims on the rows: ``topology`` of the first claimant with one, the
    ``opaque`` and ``canonical`` ranges moved at it, ``foreign`` ranges moved as canonical
    pages by workers of another topology (the first of which is ``other``) or of none (a
    StageCache of certified units); ``damaged``: the record did not parse (``raw``: the
    record's and the tables' bytes it came from, written back as they were: a damaged record
    is never repaired)."""

    topology: Topology | None = None
    other: Topology | None = None
    opaque: list[tuple[int, int]] = field(default_factory=list)
    canonical: list[tuple[int, int]] = field(default_factory=list)
    foreign: list[tuple[int, int]] = field(default_factory=list)
    damaged: bool = False
    raw: tuple[bytes, bytes] = (b"", b"")

    @classmethod
    def parse(cls, record: bytes, tables_raw: bytes, row_bytes: int) -> RowClaims:
        """The claims in ``record`` (RECORD_BYTES or more) and ``tables_raw`` (TABLES_BYTES),
        checked (another process wrote them: ``damaged`` when they are not what
        :meth:`pack_into` writes for rows of ``row_bytes``)."""
        flags, zero, *fields = _CLAIMS.unpack_from(record)
        topologies, counts = fields[:8], fields[8:]
        tables = []
        for offset, count in zip(_TABLES, counts):  # a table holds MAX_RANGES, no more
            entries = range(min(count, MAX_RANGES))
            tables.append(
                [_RANGE.unpack_from(tables_raw, offset + i * _RANGE.size) for i in entries]
            )
        claimed = tuple(topologies[:4]) if flags & _CLAIMED else None
        other = tuple(topologies[4:]) if flags & _FOREIGN else None
        claims = cls(claimed, other, *tables, raw=(bytes(record), bytes(tables_raw)))
        problems = (
            zero,
            flags & ~(_CLAIMED | _FOREIGN),
            any(t is not None and min(t) < 1 for t in (claimed, other)),
            claimed is None and any(topologies[:4]),
            other is None and any(topologies[4:]),
            claimed is None and (other or claims.opaque or claims.canonical),
            any(count > MAX_RANGES for count in counts),
            any(not all(0 <= s < e <= row_bytes for s, e in t) for t in tables),
        )
        claims.damaged = any(problems)
        return claims

    def pack_into(self, record: memoryview, tables_raw: memoryview) -> None:
        """Write the claims into ``record`` and ``tables_raw`` (zeroed, the sizes parsed)."""
        if self.damaged:  # as read: damage stays visible to every later claimant
            record[:], tables_raw[:] = self.raw
            return
        flags = (_CLAIMED if self.topology else 0) | (_FOREIGN if self.other else 0)
        topologies = (*(self.topology or (0,) * 4), *(self.other or (0,) * 4))
        tables = (self.opaque, self.canonical, self.foreign)
        _CLAIMS.pack_into(record, 0, flags, 0, *topologies, *map(len, tables))
        for offset, table in zip(_TABLES, tables):
            for i, (start, end) in enumerate(table):
                _RANGE.pack_into(tables_raw, offset + i * _RANGE.size, start, end)

    def refusal(self, topology: Topology | None, areas: Sequence[RowArea]) -> str | None:
        """Why a worker at ``topology`` (None: of no topology, canonical pages only) moving
        ``areas`` may not use these rows, or None."""
        if self.damaged:
            return "its record of the workers' claims is damaged (not written by this code)"
        here = _topology_text(topology) if topology else "no topology (certified pages only)"
        owner = self.topology
        there = _topology_text(owner) if owner else ""
        for area in areas:
            if area.opaque and owner is not None and topology != owner:
                return (
                    f"{area.name} is stored opaque at {here} (fallback reason: {area.opaque}): "
                    f"its pages are each rank's bytes whole, but the region's rows are claimed "
                    f"by workers at {there}"
                )
            if area.opaque:
                readers = [(r, there) for r in self.canonical]
                readers += [(r, _topology_text(self.other) if self.other else "no topology")
                            for r in self.foreign]  # fmt: skip
                taken = next(((r, who) for r, who in readers if _overlap(area, [r])), None)
                if taken is not None:
                    return (
                        f"{area.name} is stored opaque at {here} (fallback reason: "
                        f"{area.opaque}), but workers at {taken[1]} already use bytes "
                        f"{list(taken[0])} of each row as canonical pages"
                    )
                continue
            taken = _overlap(area, self.opaque)
            if taken is not None and topology == owner:
                return (
                    f"{area.name} (bytes {[area.start, area.end]} of each row) holds pages "
                    f"stored opaque by workers at {there} (bytes {list(taken)}), but this "
                    f"worker of the same topology takes them as canonical pages: the two lay "
                    f"that layer out differently (another spec, or another layer there)"
                )
            if taken is not None:
                return (
                    f"{area.name} (bytes {[area.start, area.end]} of each row) holds pages "
                    f"stored opaque by workers at {there} (not parallelism agnostic); this "
                    f"worker at {here} would read them as canonical pages"
                )
        return None

    def add(self, topology: Topology | None, areas: Sequence[RowArea]) -> None:
        """Record a worker the :meth:`refusal` check admitted."""
        ranges = [(a.start, a.end) for a in areas]
        if topology is not None and self.topology is None:
            self.topology = topology
        if topology is not None and topology == self.topology:
            self.opaque = _joined(self.opaque + [r for r, a in zip(ranges, areas) if a.opaque])
            canonical = [r for r, a in zip(ranges, areas) if not a.opaque]
            self.canonical = _joined(self.canonical + canonical)
        else:
            self.other = self.other or topology
            self.foreign = _joined(self.foreign + ranges)
