"""vLLM 0.33 integration: an offloading spec whose worker runs torch.ops.canonical
(:mod:`.spec`, :mod:`.worker`), and secondary tiers ``canonical_fs`` / ``canonical_redis``
persisting its chunks as checksummed units (:mod:`.tiers`). Importing it does not import vLLM.
:func:`register` is the ``vllm.general_plugins`` entry point (without it, vLLM finds each class by
``module_path``: ``"canonical_ops.vllm"`` or ``"canonical_ops.vllm.tiers"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .spec import CanonicalOffloadingSpec
    from .tiers import CanonicalFileTier, CanonicalRedisTier
    from .worker import CanonicalOffloadingWorker

__all__ = ["SPEC_NAME", "TIER_TYPES", "CanonicalFileTier", "CanonicalOffloadingSpec"]
__all__ += ["CanonicalOffloadingWorker", "CanonicalRedisTier", "register"]

SPEC_NAME = "CanonicalOffloadingSpec"
_SPEC_MODULE = "canonical_ops.vllm.spec"
# Secondary tier type -> class in canonical_ops.vllm.tiers.
TIER_TYPES = {"canonical_fs": "CanonicalFileTier", "canonical_redis": "CanonicalRedisTier"}
_TIERS_MODULE = "canonical_ops.vllm.tiers"
_LAZY = {SPEC_NAME: _SPEC_MODULE, "CanonicalOffloadingWorker": "canonical_ops.vllm.worker"}
_LAZY.update(dict.fromkeys(TIER_TYPES.values(), _TIERS_MODULE))
__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)


def register() -> None:
    """Register the spec with vLLM's OffloadingSpecFactory and the tiers with its
    SecondaryTierFactory (idempotent). Modules are imported when vLLM first resolves a name.
    """
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if SPEC_NAME not in getattr(OffloadingSpecFactory, "_registry", {}):
        OffloadingSpecFactory.register_spec(SPEC_NAME, _SPEC_MODULE, SPEC_NAME)
    for tier_type, class_name in TIER_TYPES.items():
        if tier_type not in getattr(SecondaryTierFactory, "_registry", {}):
            SecondaryTierFactory.register_tier(tier_type, _TIERS_MODULE, class_name)
