"""vLLM 0.33 integration: an offloading spec whose worker runs torch.ops.canonical.

Importing this package does not import vLLM; :func:`register` and the two
classes below do, when first used:

- :class:`CanonicalOffloadingSpec` (``canonical_ops.vllm.spec``): vLLM's CPU
  tiering spec with the canonical layout, whose ``get_worker`` returns
- :class:`CanonicalOffloadingWorker` (``canonical_ops.vllm.worker``): vLLM's
  ``OffloadingWorker``, one ``canonical_store`` / ``canonical_load`` per job.

:func:`register` is the ``vllm.general_plugins`` entry point: once
canonical-kv is installed, every vLLM process registers the spec name
``"CanonicalOffloadingSpec"`` with ``OffloadingSpecFactory``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .spec import CanonicalOffloadingSpec
    from .worker import CanonicalOffloadingWorker

__all__ = ["SPEC_NAME", "CanonicalOffloadingSpec", "CanonicalOffloadingWorker", "register"]

SPEC_NAME = "CanonicalOffloadingSpec"
_SPEC_MODULE = "canonical_ops.vllm.spec"


def register() -> None:
    """Register ``CanonicalOffloadingSpec`` with vLLM's OffloadingSpecFactory (idempotent).

    The spec's module is imported lazily, when vLLM first resolves the name.
    """
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if SPEC_NAME in getattr(OffloadingSpecFactory, "_registry", {}):
        return
    OffloadingSpecFactory.register_spec(SPEC_NAME, _SPEC_MODULE, SPEC_NAME)


def __getattr__(name: str) -> Any:
    if name == "CanonicalOffloadingSpec":
        from .spec import CanonicalOffloadingSpec

        return CanonicalOffloadingSpec
    if name == "CanonicalOffloadingWorker":
        from .worker import CanonicalOffloadingWorker

        return CanonicalOffloadingWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
