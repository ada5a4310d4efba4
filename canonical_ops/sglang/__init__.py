"""SGLang HiCache L3 storage backend in canonical-kv units (ops core only).

SGLang 0.5.x loads it as a dynamic storage backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "canonical",
        "module_path": "canonical_ops.sglang", "class_name": "CanonicalHiCacheStorage",
        "interface_v1": 1, "store": "/var/cache/ckv"}'

Pages are stored as the same canonical units, keys (:mod:`canonical_ops.frontend.store.token_keys`)
and namespaces as the frontend engine's file and Redis tiers, so a prefix persisted by an
engine at one TP is served to another at any TP. Importing this package imports neither
SGLang nor the compiled extension; ``CanonicalHiCacheStorage`` (built on first access)
imports SGLang.

Modules: :mod:`.pages` (host page <-> canonical bytes), :mod:`.staging` (assembling a
unit from the TP ranks' shares), :mod:`.key_index` (SGLang page hash -> canonical key),
:mod:`.backend` (the ``HiCacheStorage`` subclass).
"""

from .backend import CONFIG_KEYS, BackendSetupError, CanonicalStorageCore, storage_class
from .key_index import TokenKeyIndex, install_hash_observer
from .pages import HostPageCodec
from .staging import BadFragment, FragmentStaging

__all__ = [
    "CONFIG_KEYS",
    "BackendSetupError",
    "BadFragment",
    "CanonicalHiCacheStorage",
    "CanonicalStorageCore",
    "FragmentStaging",
    "HostPageCodec",
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
