"""SGLang HiCache L3 storage backend in canonical-kv units (README "SGLang HiCache backend").

SGLang 0.5.x loads it with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "canonical", "module_path":
"canonical_ops.sglang", "class_name": "CanonicalHiCacheStorage", "interface_v1": 1, "store":
"/var/cache/ckv"}'``. Pages become the units every engine of the package reads, at any TP.
Modules: :mod:`.pages` (pages <-> unit bytes through the plan and the CPU kernel),
:mod:`.staging` (a unit assembled from the TP ranks' shares), :mod:`.key_index` (SGLang page
hash -> canonical key), :mod:`.backend`. Importing it imports neither SGLang nor the extension.
"""

from .backend import (
    CONFIG_KEYS,
    FP8_FORMATS,
    BackendSetupError,
    CanonicalStorageCore,
    storage_class,
)
from .key_index import TokenKeyIndex, install_hash_observer
from .pages import HostPageCodec, PageTransfer
from .staging import FragmentStaging

__all__ = [
    "CONFIG_KEYS",
    "FP8_FORMATS",
    "BackendSetupError",
    "CanonicalHiCacheStorage",
    "CanonicalStorageCore",
    "FragmentStaging",
    "HostPageCodec",
    "PageTransfer",
    "TokenKeyIndex",
    "install_hash_observer",
    "storage_class",
]


def __getattr__(name: str):
    # The HiCacheStorage subclass exists only once SGLang is importable: built on first access.
    if name == "CanonicalHiCacheStorage":
        return storage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"CanonicalHiCacheStorage"})
