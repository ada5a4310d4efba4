"""canonical-kv: move KV-cache pages to and from canonical CPU pages with fused kernels. The ops
core (:func:`store`, :func:`load`, :func:`make_plan`), the unit store (:mod:`.units`) and the
adapters (:mod:`.vllm`, :mod:`.sglang`, :mod:`.engine`); the extension loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from .engine import REMOVED
from .engine import __all__ as _engine_names

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ._extension import BUILT_WITH_CUDA
    from .checks import check_ids, check_int
    from .engine.cache import StageCache, pp_layer_range, pp_layer_ranges
    from .engine.claims import RegionTopologyError, RowArea
    from .engine.misses import explain_miss
    from .engine.pages import PageCapacityError, PageManager, PageState, PageStateError
    from .engine.region import RegionSpaceError, SharedOffloadRegion, region_path
    from .engine.worker import (
        OffloadWorker,
        TransferJob,
        canonical_row_bytes,
        group_layer_mappings,
        physical_layout,
    )
    from .ops import CanonicalTransferError, check_device_errors, load, set_sm_budget, store
    from .plan import default_area_offsets, make_plan
    from .units import FileStore, ModelIdentity, RedisStore, StoreNamespace

# Public name -> the module defining it (relative to this package): the ops core's own,
# then every public name of the standalone engine (a lazy package: importing it is light).
_OPS_NAMES = ("CanonicalTransferError", "check_device_errors", "load", "set_sm_budget", "store")
_EXPORTS = {
    "BUILT_WITH_CUDA": "._extension",
    **dict.fromkeys(("check_ids", "check_int"), ".checks"),
    **dict.fromkeys(_OPS_NAMES, ".ops"),
    **dict.fromkeys(("default_area_offsets", "make_plan"), ".plan"),
    **dict.fromkeys(_engine_names, ".engine"),
}
__all__ = ["BUILT_WITH_CUDA", "check_ids", "check_int", "default_area_offsets", "make_plan"]
__all__ += ["CanonicalTransferError", "check_device_errors", "load", "set_sm_budget", "store"]
__all__ += ["FileStore", "ModelIdentity", "RedisStore", "StageCache", "StoreNamespace"]
__all__ += ["OffloadWorker", "TransferJob", "canonical_row_bytes", "group_layer_mappings"]
__all__ += ["PageCapacityError", "PageManager", "PageState", "PageStateError", "region_path"]
__all__ += ["RegionSpaceError", "SharedOffloadRegion", "pp_layer_range", "pp_layer_ranges"]
__all__ += ["RegionTopologyError", "RowArea", "explain_miss", "physical_layout"]
_lazy_getattr, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


def __getattr__(name: str):
    if name in REMOVED:  # a name of an earlier release: say what replaces it
        raise AttributeError(f"{__name__}.{name} was removed: {REMOVED[name]}")
    return _lazy_getattr(name)
