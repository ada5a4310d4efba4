"""What a :class:`~canonical_ops.engine.cache.StageCache` reports: a lookup's blocks, a
fetch's and a persist's submissions, each finished fill or store, and its counters."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["FetchResult", "PersistResult", "StageCacheMetrics", "TierCounters", "TierEvent"]
__all__ += ["TierLookup"]


@dataclass(frozen=True)
class TierLookup:
    """Leading blocks ready in the region, then how many more the tiers hold (not verified
    yet) and the tier of each. ``pending``: the tiers have not answered yet; ask again."""

    in_region: int
    from_tiers: int
    sources: tuple[int, ...]
    pending: bool = False

    @property
    def total(self) -> int:
        return self.in_region + self.from_tiers


@dataclass(frozen=True)
class FetchResult:
    """Fills submitted, blocks already ``present`` in the region, blocks ``refused`` (a tier
    refused, or no page to spare), and per fetched block its page (None: not submitted)."""

    submitted: int
    present: int
    refused: int
    pages: tuple[int | None, ...]


@dataclass(frozen=True)
class PersistResult:
    """Stores submitted (one per block and tier), blocks not ready, stores refused, and
    stores ``skipped`` because the block came from that tier (or, promoting, a nearer one)."""

    submitted: int
    not_ready: int
    refused: int
    skipped: int


@dataclass(frozen=True)
class TierEvent:
    """One block's finished ``"fill"`` or ``"store"`` with the tier's status and detail."""

    kind: str
    block_hash: Hashable
    page_id: int
    tier: str
    status: str
    detail: str = ""


@dataclass(frozen=True)
class TierCounters:
    """What one stage did with one tier; fills missed: absent, corrupt or past the deadline.
    ``errors``: tier calls that raised or lookups that failed; ``last_error``: the latest."""

    name: str
    lookup_hit_blocks: int = 0
    fills_submitted: int = 0
    fills_ok: int = 0
    fills_missed: int = 0
    fills_failed: int = 0
    fills_refused: int = 0
    bytes_filled: int = 0
    stores_submitted: int = 0
    stores_ok: int = 0
    stores_failed: int = 0
    stores_refused: int = 0
    bytes_stored: int = 0
    errors: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class StageCacheMetrics:
    """A snapshot: blocks looked up and where they were found, jobs in flight, per tier."""

    layers: tuple[int, int]
    lookup_blocks: int
    region_hit_blocks: int
    tier_hit_blocks: int
    miss_blocks: int
    fills_in_flight: int
    stores_in_flight: int
    tiers: tuple[TierCounters, ...]
