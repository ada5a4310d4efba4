"""SGLang HiCache L3 storage backend in canonical-kv units (README "SGLang HiCache backend"):
SGLang 0.5.x loads it with ``--hicache-storage-backend dynamic``. Importing it imports neither
SGLang nor the extension."""

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

__all__ = ["CONFIG_KEYS", "FP8_FORMATS", "BackendSetupError", "CanonicalHiCacheStorage"]
__all__ += ["CanonicalStorageCore", "FragmentStaging", "HostPageCodec", "PageTransfer"]
__all__ += ["TokenKeyIndex", "install_hash_observer", "storage_class"]


def __getattr__(name: str):
    # The HiCacheStorage subclass exists only once SGLang is importable: built on first access.
    if name == "CanonicalHiCacheStorage":
        return storage_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"CanonicalHiCacheStorage"})
