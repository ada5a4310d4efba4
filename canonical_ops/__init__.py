"""canonical-kv: move KV-cache pages to and from canonical CPU pages with fused kernels.

The package has three parts:

* the **ops core** (this package): ``torch.ops.canonical.canonical_store`` /
  ``canonical_load`` from the compiled extension, typed wrappers :func:`store` /
  :func:`load`, fake kernels, and :func:`make_plan`, which turns the ``layouts``
  mappings into the plan tensor built once at init;
* :mod:`canonical_ops.units`: the unit store (one checksummed unit format, namespaces,
  file and Redis / Valkey stores) every engine persists through;
* adapters: :mod:`canonical_ops.vllm` (vLLM 0.33 worker and secondary tiers),
  :mod:`canonical_ops.sglang` (HiCache L3 backend) and :mod:`canonical_ops.engine`
  (the standalone engine of the demo and custom engines).

Imports are lazy: ``import canonical_ops`` (or ``canonical_ops.engine``) does not load
the compiled extension; the first use of an op-related name does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports
from .engine import __all__ as _engine_names

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ._extension import BUILT_WITH_CUDA
    from .checks import check_ids, check_int
    from .engine.cache import StageCache, pp_layer_range, pp_layer_ranges
    from .engine.pages import (
        PageCapacityError,
        PageManager,
        PageState,
        PageStateError,
    )
    from .engine.region import (
        RegionSpaceError,
        SharedOffloadRegion,
        region_path,
    )
    from .engine.worker import (
        OffloadWorker,
        TransferJob,
        canonical_row_bytes,
        group_layer_mappings,
    )
    from .ops import CanonicalTransferError, check_device_errors, load, set_sm_budget, store
    from .plan import default_area_offsets, make_plan
    from .units import FileStore, ModelIdentity, RedisStore, StoreNamespace

# Public name -> the module defining it (relative to this package): the ops core's own,
# then every public name of the standalone engine (a lazy package: importing it is light).
_EXPORTS = {
    "BUILT_WITH_CUDA": "._extension",
    "check_ids": ".checks",
    "check_int": ".checks",
    "CanonicalTransferError": ".ops",
    "check_device_errors": ".ops",
    "load": ".ops",
    "set_sm_budget": ".ops",
    "store": ".ops",
    "default_area_offsets": ".plan",
    "make_plan": ".plan",
}

_EXPORTS.update(dict.fromkeys(_engine_names, ".engine"))

__all__ = [
    "BUILT_WITH_CUDA",
    "CanonicalTransferError",
    "FileStore",
    "ModelIdentity",
    "OffloadWorker",
    "PageCapacityError",
    "PageManager",
    "PageState",
    "PageStateError",
    "RedisStore",
    "RegionSpaceError",
    "SharedOffloadRegion",
    "StageCache",
    "StoreNamespace",
    "TransferJob",
    "canonical_row_bytes",
    "check_device_errors",
    "check_ids",
    "check_int",
    "default_area_offsets",
    "group_layer_mappings",
    "load",
    "make_plan",
    "pp_layer_range",
    "pp_layer_ranges",
    "region_path",
    "set_sm_budget",
    "store",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
