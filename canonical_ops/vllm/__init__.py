"""vLLM 0.33 integration: an offloading spec whose worker runs torch.ops.canonical, and
secondary tiers that persist its chunks as checksummed units.

Importing this package does not import vLLM; :func:`register` and the classes below do,
when first used:

- :class:`CanonicalOffloadingSpec` (``canonical_ops.vllm.spec``): vLLM's CPU
  tiering spec with the canonical layout, whose ``get_worker`` returns
- :class:`CanonicalOffloadingWorker` (``canonical_ops.vllm.worker``): vLLM's
  ``OffloadingWorker``, one ``canonical_store`` / ``canonical_load`` per job.
- :class:`CanonicalFileTier` and :class:`CanonicalRedisTier` (``canonical_ops.vllm.tiers``):
  secondary tiers ``canonical_fs`` and ``canonical_redis`` of vLLM's tiering manager.

:func:`register` is the ``vllm.general_plugins`` entry point: once canonical-kv is
installed, every vLLM process registers the spec name ``"CanonicalOffloadingSpec"`` and
the tier types ``"canonical_fs"`` and ``"canonical_redis"``. Without the plugin, vLLM finds
each class by ``module_path`` (``"canonical_ops.vllm"`` or ``"canonical_ops.vllm.tiers"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec import CanonicalOffloadingSpec
    from .tiers import CanonicalFileTier, CanonicalRedisTier
    from .worker import CanonicalOffloadingWorker

__all__ = [
    "SPEC_NAME",
    "TIER_TYPES",
    "CanonicalFileTier",
    "CanonicalOffloadingSpec",
    "CanonicalOffloadingWorker",
    "CanonicalRedisTier",
    "register",
]

SPEC_NAME = "CanonicalOffloadingSpec"
_SPEC_MODULE = "canonical_ops.vllm.spec"
# Secondary tier type -> class in canonical_ops.vllm.tiers.
TIER_TYPES = {"canonical_fs": "CanonicalFileTier", "canonical_redis": "CanonicalRedisTier"}
_TIERS_MODULE = "canonical_ops.vllm.tiers"
_LAZY = {
    "CanonicalOffloadingSpec": _SPEC_MODULE,
    "CanonicalOffloadingWorker": "canonical_ops.vllm.worker",
    "CanonicalFileTier": _TIERS_MODULE,
    "CanonicalRedisTier": _TIERS_MODULE,
}


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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
