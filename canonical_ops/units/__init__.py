"""Persistent, checksummed store of canonical units in files and on Redis / Valkey.

A *unit* is one block's canonical pages of a contiguous layer range (a region row of the
pipeline stage owning those layers), tagged by a :class:`StoreNamespace` (not TP/PP/CP of a
certified model) and encoded once (:mod:`.unit`: the same bytes in every store).
:class:`FileStore` keeps units in files shared by processes and engines, :class:`RedisStore`
on a Redis / Valkey server or cluster shared by engines on many hosts; both implement
:class:`UnitStore` (batch-first jobs on a bounded :class:`JobPool`).

>>> ns = StoreNamespace.from_specs(ModelIdentity("llama"), [spec] * 32, ctx)  # doctest: +SKIP
>>> store = FileStore("/var/cache/ckv", ns, capacity_bytes=100 << 30)        # doctest: +SKIP
>>> store.store(block_hash, 0, region_row, position=3).ok                    # doctest: +SKIP
True
>>> store.lookup([block_hash], 0, 32), store.load(block_hash, 0, 32, other_row).ok  # doctest: +SKIP
(1, True)
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .auth import StoreSecret
from .files import FileStore, GcReport, StoreMetrics, StoreRootError
from .jobs import IOJob, JobOutcome, JobPool, PoolStats, current_job
from .namespace import LayerGeometry, ModelIdentity, StoreNamespace
from .tier import LoadItem, PageTier, StoreItem, TierBase, TierMetrics, UnitStore
from .unit import (
    CorruptUnit,
    PayloadVerifier,
    UnitHeader,
    decode_and_verify,
    decode_header,
    encode_header,
    encode_unit,
    header_length,
    normalize_key,
    verify_payload,
)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .redis_store import RedisStore, RedisStoreError, RedisStoreMetrics

# The Redis tier loads redis-py on first use only: a file store needs no Redis client.
_REDIS = dict.fromkeys(("RedisStore", "RedisStoreError", "RedisStoreMetrics"), ".redis_store")
__getattr__, __dir__ = lazy_exports(__name__, globals(), _REDIS)

__all__ = [
    "CorruptUnit",
    "FileStore",
    "GcReport",
    "IOJob",
    "JobOutcome",
    "JobPool",
    "LayerGeometry",
    "LoadItem",
    "ModelIdentity",
    "PageTier",
    "PayloadVerifier",
    "PoolStats",
    "RedisStore",
    "RedisStoreError",
    "RedisStoreMetrics",
    "StoreItem",
    "StoreMetrics",
    "StoreNamespace",
    "StoreRootError",
    "StoreSecret",
    "TierBase",
    "TierMetrics",
    "UnitHeader",
    "UnitStore",
    "current_job",
    "decode_and_verify",
    "decode_header",
    "encode_header",
    "encode_unit",
    "header_length",
    "normalize_key",
    "verify_payload",
]
