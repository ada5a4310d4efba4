"""What callers hand the Redis tier (:class:`StoreItem`, :class:`LoadItem`) and read back
(:class:`RedisStoreMetrics`), and the checked requests the tier works on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from .jobs import JobOutcome
from .redis_index import _digest
from .tier import TierMetrics


@dataclass(frozen=True)
class StoreItem:
    """One unit to store: ``payload`` = layers ``[first, end)`` of ``key`` (see ``submit_store``)."""

    key: Any
    first: int
    payload: Any
    position: int
    end: int | None = None


@dataclass(frozen=True)
class LoadItem:
    """One unit to load: layers ``[first, end)`` of ``key`` into ``destination``."""

    key: Any
    first: int
    end: int
    destination: Any


@dataclass(frozen=True)
class RedisStoreMetrics(TierMetrics):
    """Counters of one :class:`RedisStore` since it started (a snapshot).

    Attributes
    ----------
    (those of :class:`~.tier.TierMetrics`, and:)
    stores_dropped : int
        Stores not done because the server was down, slow, or skipped by the breaker.
    stores_failed : int
        Stores the server refused (e.g. ``OOM`` under ``noeviction``, ``NOPERM``).
    lookups_refused : int
        Lookup jobs refused by back-pressure (queue full) or after close.
    loads_unavailable : int
        Of the misses, those due to the server being down, slow or skipped.
    lookups : int
        Lookup calls.
    lookups_unavailable : int
        Lookups answered 0 because the server was down, slow or skipped.
    lookup_seconds_total, lookup_seconds_max : float
        Wall time of lookups (mean = total / lookups).
    stale_removed : int
        Index entries or manifests naming vanished values (evicted, expired), removed.
    values_deleted : int
        Bad or stale values this store deleted (best effort).
    bytes_sent, bytes_received : int
        Value bytes written to / read from the server (units, chunks, manifests).
    round_trips : int
        Pipelines executed (each one network round trip per node).
    errors : int
        Failed round trips plus error replies of single commands.
    breaker_opens, breaker_skips : int
        Times the circuit breaker opened; round trips skipped while it was open.
    available : bool
        The breaker is closed (the server is believed reachable).
    """

    stores_dropped: int = 0
    loads_unavailable: int = 0
    lookups: int = 0
    lookups_refused: int = 0
    lookups_unavailable: int = 0
    lookup_seconds_total: float = 0.0
    lookup_seconds_max: float = 0.0
    stale_removed: int = 0
    values_deleted: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0
    errors: int = 0
    breaker_opens: int = 0
    breaker_skips: int = 0
    available: bool = True


_COUNTERS = tuple(f.name for f in fields(RedisStoreMetrics) if f.name != "available")


class _StoreReq:
    __slots__ = ("end", "first", "kd", "payload", "position", "raw_key")

    def __init__(self, raw_key: bytes, first: int, end: int, position: int, payload: memoryview):
        self.raw_key, self.first, self.end = raw_key, first, end
        self.position, self.payload = position, payload
        self.kd = _digest(raw_key)


class _LoadReq:
    __slots__ = ("dest", "end", "first", "kd", "raw_key")

    def __init__(self, raw_key: bytes, first: int, end: int, dest: memoryview):
        self.raw_key, self.first, self.end, self.dest = raw_key, first, end, dest
        self.kd = _digest(raw_key)


_STATUS_ORDER = {"ok": 0, "miss": 1, "corrupt": 2, "error": 3}


def _worst(outcomes: Sequence[JobOutcome]) -> str:
    return max((o.status for o in outcomes), key=_STATUS_ORDER.__getitem__, default="ok")


def batch_outcome(outcomes: list[JobOutcome]) -> JobOutcome:
    """The outcome of a batch job: the worst status, the counts, each item's outcome."""
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.status] = counts.get(outcome.status, 0) + 1
    return JobOutcome(
        _worst(outcomes),
        nbytes=sum(o.nbytes for o in outcomes),
        detail=", ".join(f"{n} {status}" for status, n in sorted(counts.items())),
        value=outcomes,
    )
