"""canonical-kv ops: move KV-cache pages to and from canonical CPU pages with fused kernels.

``torch.ops.canonical.canonical_store`` / ``canonical_load`` copy every fragment
of every layer of a batch of blocks in ONE kernel launch (CPU: one parallel
loop), driven by a plan tensor built once by :func:`make_plan` from the
``layouts`` mappings.
"""

from ._extension import BUILT_WITH_CUDA
from .ops import CanonicalTransferError, check_device_errors, load, set_sm_budget, store
from .plan import default_area_offsets, make_plan

__all__ = [
    "BUILT_WITH_CUDA",
    "CanonicalTransferError",
    "check_device_errors",
    "default_area_offsets",
    "load",
    "make_plan",
    "set_sm_budget",
    "store",
]
