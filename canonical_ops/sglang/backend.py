"""The SGLang HiCache L3 storage backend over canonical-kv's page stores.

:func:`storage_class` builds ``CanonicalHiCacheStorage``, a subclass of
SGLang's ``HiCacheStorage`` (imported only then). It keeps SGLang's host
pages in the same canonical units, under the same keys and namespace, as the
frontend engine's :class:`~canonical_ops.frontend.tiers.StageCache` and the
file / Redis tiers, so an engine of any TP reads what another wrote:

* **unit** = one page of tokens, layers ``[start_layer, end_layer)`` of the
  pool (the PP stage), every layer's whole canonical page (all heads);
* **key** = :mod:`~canonical_ops.frontend.store.token_keys` of the page's
  tokens (SGLang's page hash is only a local index: :mod:`.key_index`);
* **namespace** = model identity, KV quantisation and every layer's geometry
  (:class:`~canonical_ops.frontend.store.StoreNamespace`): a mismatch is a miss.

Configuration is SGLang's ``--hicache-storage-backend-extra-config`` JSON
(see the README's "SGLang HiCache backend" section and :data:`CONFIG_KEYS`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

import numpy as np

from layouts import RankContext

from ..units import FileStore, ModelIdentity, StoreNamespace
from .key_index import TokenKeyIndex, install_hash_observer
from .pages import HostPageCodec
from .staging import BadFragment, FragmentStaging

__all__ = ["CONFIG_KEYS", "BackendSetupError", "CanonicalStorageCore", "storage_class"]

logger = logging.getLogger(__name__)

# extra_config keys SGLang itself reads for a dynamic backend.
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}
CONFIG_KEYS = {
    "store": "directory (FileStore) or redis:// rediss:// unix:// URL (RedisStore); required",
    "store_options": "dict of keyword arguments for FileStore / RedisStore",
    "model_name": "model identity (default: SGLang's served model path)",
    "model_revision": "weights revision (default '')",
    "model_extra": "dict: anything else that changes a KV byte (RoPE scaling, LoRA, ...)",
    "kv_quant": "KV quantisation mode (default 'none'; required for 1-byte KV dtypes)",
    "num_layers": "layers of the whole model (required with pipeline parallelism)",
    "total_kv_heads": "KV heads of the model (default heads per rank x TP; required when "
    "TP exceeds the KV heads)",
    "staging_dir": "directory the TP group shares for assembling units (default under /dev/shm)",
    "staging_stale_s": "age (s) after which fragments of incomplete units are removed",
    "index_capacity": "SGLang page hashes kept in the local key index",
}


class BackendSetupError(ValueError):
    """A configuration or host pool the backend refuses (the message says which and why)."""


def _default_staging_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"canonical-kv-sglang-{os.getuid()}")


def _config(storage_config: Any) -> dict[str, Any]:
    extra = dict(getattr(storage_config, "extra_config", None) or {})
    unknown = sorted(set(extra) - set(CONFIG_KEYS) - _SGLANG_KEYS)
    if unknown:
        raise BackendSetupError(
            f"extra_config: unknown keys {unknown}; expected some of {sorted(CONFIG_KEYS)}"
        )
    store = extra.get("store")
    if not isinstance(store, str) or not store:
        raise BackendSetupError(
            f"extra_config.store: expected a store directory or redis:// URL, got {store!r}"
        )
    for name in ("store_options", "model_extra"):
        if not isinstance(extra.get(name, {}), dict):
            raise BackendSetupError(f"extra_config.{name}: expected a JSON object")
    return extra


def _int_option(extra: dict, name: str, default: int | None) -> int | None:
    value = extra.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BackendSetupError(f"extra_config.{name}: expected a positive int, got {value!r}")
    return value


class CanonicalStorageCore:
    """Everything the backend does, without SGLang's base class (see the module docstring).

    Parameters
    ----------
    storage_config : HiCacheStorageConfig
        SGLang's storage config of this rank (``tp_rank``, ``tp_size``,
        ``pp_size``, ``attn_cp_size``, ``dcp_size``, ``is_mla_model``,
        ``model_name``, ``extra_config``).
    """

    def __init__(self, storage_config: Any) -> None:
        self.config = _config(storage_config)
        self.tp_rank = int(storage_config.tp_rank)
        self.tp_size = int(storage_config.tp_size)
        self.pp_size = int(storage_config.pp_size)
        self.is_mla = bool(storage_config.is_mla_model)
        if int(getattr(storage_config, "attn_cp_size", 1)) > 1:
            raise BackendSetupError(
                "attn_cp_size: expected 1 (context-parallel attention shards pages by token; "
                "not supported by the canonical backend)"
            )
        if int(getattr(storage_config, "dcp_size", 1)) > 1:
            raise BackendSetupError(
                "dcp_size: expected 1 (decode-context parallelism is not supported by the "
                "canonical backend)"
            )
        if getattr(storage_config, "should_split_heads", False):
            raise BackendSetupError(
                "should_split_heads: expected False (heterogeneous-TP head splitting is "
                "what canonical units already do; use the canonical backend without it)"
            )
        name = self.config.get("model_name") or getattr(storage_config, "model_name", None)
        if not isinstance(name, str) or not name:
            raise BackendSetupError(
                f"extra_config.model_name: expected the model's name (SGLang gave {name!r})"
            )
        self.model = ModelIdentity(
            name, self.config.get("model_revision", ""), self.config.get("model_extra", {})
        )
        self.pool = None
        self.tier = None

    # ------------------------------------------------------------------ set-up

    def attach(self, pool: Any) -> None:
        """Build the codec, namespace, tier and key index for SGLang's host ``pool``."""
        if self.tier is not None:
            raise BackendSetupError("mem_pool_host: a host pool is already registered")
        codec = self._codec(pool)
        extra = self.config
        first, end = int(pool.start_layer), int(pool.end_layer)
        num_layers = _int_option(extra, "num_layers", end if self.pp_size == 1 else None)
        if num_layers is None:
            raise BackendSetupError(
                "extra_config.num_layers: expected the model's layer count with pipeline "
                "parallelism (each stage's namespace describes ALL layers)"
            )
        if not 0 <= first < end <= num_layers:
            raise BackendSetupError(
                f"num_layers: the pool's layers [{first}, {end}) do not fit a {num_layers}-layer "
                "model"
            )
        kv_quant = extra.get("kv_quant", "none")
        if not isinstance(kv_quant, str) or not kv_quant:
            raise BackendSetupError(f"extra_config.kv_quant: expected a str, got {kv_quant!r}")
        if codec.spec.element_size == 1 and codec.dtype in ("uint8", "int8") and kv_quant == "none":
            raise BackendSetupError(
                f"extra_config.kv_quant: the KV is stored as {codec.dtype}; name its "
                "quantisation (e.g. 'fp8_e4m3') so it never meets unquantised KV"
            )
        ctx = RankContext(self.tp_size, codec.total_kv_heads, self.tp_rank)
        self.namespace = StoreNamespace.from_specs(
            self.model, [codec.spec] * num_layers, ctx, kv_quant=kv_quant
        )
        self.first, self.end = first, end
        self.offsets = self.namespace.payload_offsets(first, end)[:-1]
        self.unit_bytes = self.namespace.layer_bytes(first, end)
        self.codec = codec
        self.writers = codec.writer_ranks()
        self.staging = None
        if self.writers != [self.tp_rank] and self.tp_rank in self.writers:
            stale = extra.get("staging_stale_s", 600.0)
            self.staging = FragmentStaging(
                extra.get("staging_dir") or _default_staging_dir(),
                self.namespace.digest,
                stale_s=stale,
            )
            self.staging.sweep()
        self.index = TokenKeyIndex(codec.page_size, _int_option(extra, "index_capacity", 1 << 20))
        self.tier = self._open_tier(extra["store"], dict(extra.get("store_options", {})))
        self.pool = pool

    def _codec(self, pool: Any) -> HostPageCodec:
        layout = getattr(pool, "layout", None)
        if getattr(pool, "kv_buffer", None) is None:
            raise BackendSetupError(
                f"mem_pool_host: expected a host pool with a kv_buffer, got {type(pool).__name__}"
            )
        if int(getattr(pool, "dcp_size", 1)) > 1:
            raise BackendSetupError("mem_pool_host: DCP host pools are not supported")
        layers = int(pool.end_layer) - int(pool.start_layer)
        if int(pool.layer_num) != layers:
            raise BackendSetupError(
                f"mem_pool_host: {pool.layer_num} layers but the stage has {layers} (draft "
                "model layers in the pool are not supported)"
            )
        dtype = str(pool.dtype).removeprefix("torch.")
        if self.is_mla or hasattr(pool, "kv_cache_dim"):
            return HostPageCodec(
                "mla",
                layout,
                int(pool.page_size),
                layers,
                1,
                int(pool.kv_cache_dim),
                dtype,
                self.tp_size,
                self.tp_rank,
                1,
            )
        if int(pool.v_head_dim) != int(pool.head_dim):
            raise BackendSetupError(
                f"mem_pool_host: K width {pool.head_dim} != V width {pool.v_head_dim}; "
                "canonical pages hold K and V of one head size"
            )
        heads = int(pool.head_num)
        total = _int_option(self.config, "total_kv_heads", heads * self.tp_size)
        if total % self.tp_size and self.tp_size % total:
            raise BackendSetupError(
                f"extra_config.total_kv_heads: {total} neither divides nor is a multiple of "
                f"TP={self.tp_size}"
            )
        if heads != max(1, total // self.tp_size):
            raise BackendSetupError(
                f"extra_config.total_kv_heads: {total} heads at TP={self.tp_size} put "
                f"{max(1, total // self.tp_size)} on a rank, the pool holds {heads}"
            )
        return HostPageCodec(
            "full",
            layout,
            int(pool.page_size),
            layers,
            heads,
            int(pool.head_dim),
            dtype,
            self.tp_size,
            self.tp_rank,
            total,
        )

    def _open_tier(self, location: str, options: dict[str, Any]):
        if location.startswith(("redis://", "rediss://", "unix://")):
            from ..units import RedisStore

            return RedisStore(location, self.namespace, **options)
        return FileStore(location, self.namespace, **options)

    def install_observer(self, utils_module: Any = None) -> None:
        """Feed the key index from SGLang's storage hashing (see :mod:`.key_index`)."""
        install_hash_observer(self.index, utils_module)

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()

    # ------------------------------------------------------------------ keys

    def _check_attached(self) -> None:
        if self.tier is None:
            raise RuntimeError("no host pool registered: call register_mem_pool_host first")

    def canonical_keys(self, keys: list[str]) -> list[bytes]:
        """Canonical keys of the leading SGLang keys the index knows (a prefix)."""
        out = []
        for key in keys:
            ckey = self.index.canonical(key)
            if ckey is None:
                break
            out.append(ckey)
        return out

    def batch_exists(self, keys: list[str]) -> int:
        self._check_attached()
        ckeys = self.canonical_keys(list(keys))
        if not ckeys:
            return 0
        return self.tier.lookup(ckeys, self.first, self.end)

    # ------------------------------------------------------------------ pages

    def load_page(self, key: str, page: Any) -> bool:
        """Fill ``page`` (a host page view, or SGLang's flat form of one) from the store.

        Nothing is written into ``page`` unless the unit was found and verified.
        """
        self._check_attached()
        ckey = self.index.canonical(key)
        if ckey is None:
            return False
        unit = np.empty(self.unit_bytes, dtype=np.uint8)
        job = self.tier.load(ckey, self.first, self.end, unit)
        if job.status != "ok":
            if job.status != "miss":
                logger.warning("canonical-kv: load of %s failed: %s", key, job.detail)
            return False
        self.codec.write_local(page, self.codec.gather(unit, self.offsets))
        return True

    def store_page(self, key: str, page: Any, position: int) -> bool:
        """Store this rank's share of ``page``; the unit is published once it is whole."""
        self._check_attached()
        ckey = self.index.canonical(key)
        if ckey is None:
            return False
        if self.tp_rank not in self.writers:
            return True  # its bytes are replicas an elected rank writes
        if self.tier.lookup([ckey], self.first, self.end) == 1:
            return True
        local = self.codec.read_local(page)
        if self.staging is None:
            return self._publish(ckey, {self.tp_rank: local}, position)
        args = (ckey, self.first, self.end, self.tp_size)
        try:
            self.staging.put(*args, self.tp_rank, local)
        except OSError as error:
            logger.warning("canonical-kv: fragment of %s not staged: %s", ckey.hex(), error)
            return False
        if not self.staging.present(*args, self.writers):
            return True  # the last writer to arrive publishes the unit
        fragments = {}
        nbytes = self.codec.num_layers * self.codec.local_page_bytes
        try:
            for rank in self.writers:
                fragments[rank] = self.staging.get(*args, rank, nbytes).reshape(
                    self.codec.num_layers, -1
                )
        except BadFragment as error:
            if self.tier.lookup([ckey], self.first, self.end) == 1:
                return True  # another rank assembled it and removed the fragments
            logger.warning("canonical-kv: unit %s not assembled: %s", ckey.hex(), error)
            self.staging.discard(*args)
            return False
        ok = self._publish(ckey, fragments, position)
        self.staging.discard(*args)
        return ok

    def _publish(self, ckey: bytes, fragments: dict[int, np.ndarray], position: int) -> bool:
        unit = np.zeros(self.unit_bytes, dtype=np.uint8)
        for rank, local in fragments.items():
            self.codec.scatter(rank, local, unit, self.offsets)
        job = self.tier.store(ckey, self.first, unit, position, end=self.end)
        if job.status != "ok":
            logger.warning("canonical-kv: store of %s failed: %s", ckey.hex(), job.detail)
        return job.status == "ok"


_storage_class = None


def storage_class() -> type:
    """``CanonicalHiCacheStorage``: SGLang's ``HiCacheStorage`` over canonical units.

    Built on first use (imports SGLang); the same class afterwards.
    """
    global _storage_class
    if _storage_class is None:
        _storage_class = _build_storage_class()
    return _storage_class


def _build_storage_class() -> type:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class CanonicalHiCacheStorage(HiCacheStorage):
        """SGLang HiCache L3 storage in canonical-kv units (see :mod:`canonical_ops.sglang`).

        Created by SGLang's storage factory (``--hicache-storage-backend
        dynamic``) as ``CanonicalHiCacheStorage(storage_config, kwargs)``;
        the host pool arrives through ``register_mem_pool_host``.
        """

        def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
            self.core = CanonicalStorageCore(storage_config)

        # -------------------------------------------------------------- set-up

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            super().register_mem_pool_host(mem_pool_host)
            self.core.attach(mem_pool_host)
            self.core.install_observer()

        def close(self) -> None:
            self.core.close()

        def clear(self) -> bool:
            # The store is shared with other engines: one engine's flush must not empty it.
            logger.info("canonical-kv: clear() leaves the shared store as it is")
            return False

        # -------------------------------------------------------------- lookups

        def exists(self, key: str) -> bool:
            return self.core.batch_exists([key]) == 1

        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
            return self.core.batch_exists(keys)

        # -------------------------------------------------------------- v1 (zero copy)

        def _pages(self, keys: list[str], host_indices: Any) -> list[int]:
            page = self.core.codec.page_size
            if host_indices is None or int(host_indices.numel()) != len(keys) * page:
                raise ValueError(
                    f"host_indices: expected {len(keys) * page} slots ({len(keys)} pages of "
                    f"{page}), got {None if host_indices is None else int(host_indices.numel())}"
                )
            return [int(host_indices[i * page]) for i in range(len(keys))]

        def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None):
            core = self.core
            results = [False] * len(keys)
            for i, index in enumerate(self._pages(keys, host_indices)):
                # A prefix: the first miss ends what SGLang can use.
                if not core.load_page(keys[i], core.codec.host_page(core.pool, index)):
                    break
                results[i] = True
            return results

        def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None):
            core = self.core
            base = len(getattr(extra_info, "prefix_keys", None) or [])
            return [
                core.store_page(keys[i], core.codec.host_page(core.pool, index), base + i)
                for i, index in enumerate(self._pages(keys, host_indices))
            ]

        # -------------------------------------------------------------- generic (flat pages)

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
            if target_location is None:
                raise ValueError("target_location: expected a flat host page tensor")
            return target_location if self.core.load_page(key, target_location) else None

        def batch_get(
            self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
        ):
            out = []
            for key, target in zip(keys, target_locations or [None] * len(keys)):
                page = self.get(key, target)
                out.append(page)
                if page is None:
                    out.extend([None] * (len(keys) - len(out)))
                    break
            return out

        def set(
            self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
        ) -> bool:
            if value is None:
                raise ValueError("value: expected a flat host page tensor")
            return self.core.store_page(key, value, 0)

        def batch_set(
            self,
            keys: list[str],
            values: Any = None,
            target_locations: Any = None,
            target_sizes: Any = None,
        ) -> bool:
            return all(self.core.store_page(k, v, i) for i, (k, v) in enumerate(zip(keys, values)))

    CanonicalHiCacheStorage.__module__ = "canonical_ops.sglang"
    CanonicalHiCacheStorage.__qualname__ = "CanonicalHiCacheStorage"
    return CanonicalHiCacheStorage
