"""canonical-kv ops: move KV-cache pages to and from canonical CPU pages with fused kernels.

``torch.ops.canonical.canonical_store`` / ``canonical_load`` copy every fragment
of every layer of a batch of blocks in ONE kernel launch (CPU: one parallel
loop), driven by a plan tensor built once by :func:`make_plan` from the
``layouts`` mappings.
"""

from ._extension import BUILT_WITH_CUDA
from .ops import CanonicalTransferError, check_device_errors, load, set_sm_budget, store
from .page_manager import PageCapacityError, PageInfo, PageManager, PageState, PageStateError
from .plan import default_area_offsets, make_plan
from .shared_region import RegionSpaceError, SharedOffloadRegion, region_path
from .worker import OffloadWorker, TransferJob, canonical_row_bytes, group_layer_mappings

__all__ = [
    "BUILT_WITH_CUDA",
    "CanonicalTransferError",
    "OffloadWorker",
    "PageCapacityError",
    "PageInfo",
    "PageManager",
    "PageState",
    "PageStateError",
    "RegionSpaceError",
    "SharedOffloadRegion",
    "TransferJob",
    "canonical_row_bytes",
    "check_device_errors",
    "default_area_offsets",
    "group_layer_mappings",
    "load",
    "make_plan",
    "region_path",
    "set_sm_budget",
    "store",
]
