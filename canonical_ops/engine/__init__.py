"""The standalone offload frontend, for engines without vLLM.

* :class:`SharedOffloadRegion` (``shared_region``): one /dev/shm region of canonical rows
  per engine, shared by every rank of a node (pure Python + torch; no extension needed).
* :class:`OffloadWorker` (``worker``): one per rank; derives and verifies the layers'
  canonical mappings, builds the plan once, runs one op call per store or load.
* :class:`PageManager` (``page_manager``): scheduler side; block hash -> canonical page,
  readiness once every elected writer reported, LRU eviction, pins (pure Python).
* :class:`~.tiers.StageCache` (``tiers``): scheduler side of one pipeline stage; its region's
  pages first, then persistent tiers (``store``: checksummed unit files, Redis / Valkey): lookup
  falls through, fetches fill region pages from verified units, write-through persists rows.
* ``store``: ``FileStore``, ``RedisStore`` and their one unit format; ``python -m canonical_ops store``.
* ``demo``: ``python -m canonical_ops demo`` (shared memory, or a restart through ``--store``).

vLLM users do not need any of this: the vLLM plugin (:mod:`canonical_ops.vllm`) uses
vLLM's own region, scheduler and tiers, and only the ops core. Imports are lazy: the
compiled extension is loaded only when ``OffloadWorker`` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ..units import FileStore, ModelIdentity, RedisStore, StoreNamespace
    from .cache import StageCache, pp_layer_range, pp_layer_ranges
    from .pages import PageCapacityError, PageInfo, PageManager, PageState, PageStateError
    from .region import (
        RegionClosedError,
        RegionSpaceError,
        SharedOffloadRegion,
        region_path,
    )
    from .worker import OffloadWorker, TransferJob, canonical_row_bytes, group_layer_mappings

_EXPORTS = {
    "PageCapacityError": ".pages",
    "PageInfo": ".pages",
    "PageManager": ".pages",
    "PageState": ".pages",
    "PageStateError": ".pages",
    "RegionClosedError": ".region",
    "RegionSpaceError": ".region",
    "SharedOffloadRegion": ".region",
    "region_path": ".region",
    "OffloadWorker": ".worker",
    "TransferJob": ".worker",
    "canonical_row_bytes": ".worker",
    "group_layer_mappings": ".worker",
    "StageCache": ".cache",
    "pp_layer_range": ".cache",
    "pp_layer_ranges": ".cache",
    "FileStore": "..units",
    "RedisStore": "..units",
    "StoreNamespace": "..units",
    "ModelIdentity": "..units",
}

__all__ = [
    "FileStore",
    "ModelIdentity",
    "OffloadWorker",
    "PageCapacityError",
    "PageInfo",
    "PageManager",
    "PageState",
    "PageStateError",
    "RedisStore",
    "RegionClosedError",
    "RegionSpaceError",
    "SharedOffloadRegion",
    "StageCache",
    "StoreNamespace",
    "TransferJob",
    "canonical_row_bytes",
    "group_layer_mappings",
    "pp_layer_range",
    "pp_layer_ranges",
    "region_path",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
