"""The standalone engine (a multi-process demo or a small custom engine; vLLM needs none of it):
``region`` (/dev/shm rows per engine and stage; ``claims``: the workers' claims on its rows),
``worker`` (one per rank, one op call per store or load), ``pages`` (block hash -> page,
readiness, LRU, pins, fills), ``cache`` (a stage's pages backed by unit stores; the stores it
reads across: ``stage_stores``; what it reports: ``stage_reports``), ``hybrid`` (the state
side), ``misses`` (why another topology's units of the model are misses here, in one line).
Imports are lazy."""

from __future__ import annotations

from typing import Any

from .._lazy import lazy_exports

# Public name -> the module defining it (imported on first use).
_EXPORTS = {
    **dict.fromkeys(("PageCapacityError", "PageManager", "PageState", "PageStateError"), ".pages"),
    **dict.fromkeys(("RegionSpaceError", "SharedOffloadRegion", "region_path"), ".region"),
    **dict.fromkeys(("RegionTopologyError", "RowArea"), ".claims"),
    **dict.fromkeys(("OffloadWorker", "TransferJob", "canonical_row_bytes"), ".worker"),
    **dict.fromkeys(("group_layer_mappings", "physical_layout"), ".worker"),
    **dict.fromkeys(("StageCache", "pp_layer_range", "pp_layer_ranges"), ".cache"),
    "explain_miss": ".misses",
    **dict.fromkeys(("FileStore", "ModelIdentity", "RedisStore", "StoreNamespace"), "..units"),
}
__all__ = sorted(_EXPORTS)

# Names of earlier releases that are gone, and what replaces them.
REMOVED = {
    "RegionClosedError": (
        "rank 0 creates the region and unlinks it when it closes, so a rank arriving "
        "later gets TimeoutError (no closed marker any more)"
    ),
    "PageInfo": "use PageManager.state / hash_of / refcount / generation / pending_writers",
}

_lazy_getattr, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


def __getattr__(name: str) -> Any:
    if name in REMOVED:
        raise AttributeError(f"{__name__}.{name} was removed: {REMOVED[name]}")
    return _lazy_getattr(name)
