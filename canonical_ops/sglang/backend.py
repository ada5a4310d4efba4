"""The SGLang HiCache L3 storage backend over canonical-kv's unit stores: a unit is one page of
tokens, the PP stage's layers, every layer's whole canonical page, keyed by key scheme v2 (vLLM's
block hash of the page's tokens, :mod:`.key_index`) in the namespace every engine shares for the
model (``StoreNamespace.shared_prefix``). Configuration: the
``--hicache-storage-backend-extra-config`` JSON."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from layouts import KVScales, RankContext
from layouts.cli import escape_text
from layouts.spec import dtype_name

from ..checks import check_seconds
from ..units import FileStore, ModelIdentity, StoreNamespace
from ..units.across import UnitsAcross, readable_across
from ..units.redis_url import REDIS_SCHEMES
from ..units.token_keys import HASH_ALGORITHMS, TokenKeyScheme
from .key_index import TokenKeyIndex, install_hash_observer
from .pages import HostPageCodec, PageTransfer
from .staging import FragmentStaging, default_staging_dir

__all__ = ["CONFIG_KEYS", "FP8_FORMATS", "BackendSetupError", "CanonicalStorageCore"]
__all__ += ["storage_class"]

logger = logging.getLogger(__name__)

# extra_config keys SGLang itself reads for a dynamic backend.
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}
CONFIG_KEYS = {
    "store": "directory (FileStore) or Redis URL (RedisStore, cluster included); required",
    "store_options": "dict of keyword arguments for FileStore / RedisStore",
    "model_name": "model identity (default: SGLang's served model path)",
    "model_revision": "weights revision (default '')",
    "model_extra": "dict: anything else that changes a KV byte (RoPE scaling, LoRA, ...)",
    "kv_quant": "KV quantisation (default 'none'; fp8 KV names its format: FP8_FORMATS)",
    "kv_scales": "fp8 KV's per-tensor scales as SGLang applies them (its attention layers' "
    "k_scale_float, v_scale_float): [k, v] for every layer, or one [k, v] per model layer; "
    "required with fp8",
    "num_layers": "layers of the whole model (required with pipeline parallelism)",
    "total_kv_heads": "KV heads of the model (default heads per rank x TP)",
    "staging_dir": "the TP group's private directory (default /dev/shm/canonical-kv-<uid>)",
    "staging_stale_s": "seconds after which shares of units that never completed go",
    "index_capacity": "SGLang page hashes kept in the local key index",
    "hash_algorithm": f"unit keys' hash, one of {HASH_ALGORITHMS} (vLLM's "
    "prefix_caching_hash_algo; default sha256); the seed is PYTHONHASHSEED as in vLLM",
    "authenticated": "true: units MAC-ed with the fleet's secret (CANONICAL_KV_STORE_SECRET or "
    "CANONICAL_KV_STORE_SECRET_FILE), as on every engine sharing them",
    "read_unit_tokens": "list: other engines' tokens per unit (e.g. vLLM's offloaded block) "
    "read across (a multiple or divisor of the page size: units split or joined)",
    "hash_block_tokens": "tokens per hash block (vLLM's block_size; default the page size); "
    "the page size must be a multiple",
}
# SGLang keeps fp8 KV as uint8 in its host pools: only this name tells the format (one
# spelling each; the fnuz ones for engines storing those, as SGLang on ROCm MI300 does).
FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz")
_TYPED = dict(store=str, store_options=dict, model_extra=dict, kv_quant=str, staging_dir=str)
_TYPED.update(hash_algorithm=str)


class BackendSetupError(ValueError):
    """A configuration or host pool the backend refuses (the message says which and why)."""


def _config(storage_config: Any) -> dict[str, Any]:
    extra = dict(getattr(storage_config, "extra_config", None) or {})
    unknown = sorted(set(extra) - set(CONFIG_KEYS) - _SGLANG_KEYS)
    if unknown:
        raise BackendSetupError(
            f"extra_config: unknown keys {unknown}; expected some of {sorted(CONFIG_KEYS)}"
        )
    for name, kind in _TYPED.items():
        value = extra.get(name)
        if (name == "store" or name in extra) and (not isinstance(value, kind) or value == ""):
            what = "a non-empty string" if kind is str else "a JSON object"
            raise BackendSetupError(
                f"extra_config.{name}: expected {what}, got a {type(value).__name__}"
            )
    kv_quant = extra.get("kv_quant", "none")
    if kv_quant.lower().startswith("fp8") and kv_quant not in FP8_FORMATS:
        raise BackendSetupError(
            f"extra_config.kv_quant: expected the fp8 format, one of {FP8_FORMATS}, got "
            f"{kv_quant!r} (fp8 KV reaches the host as uint8: e4m3 and e5m2 bytes must "
            "never share units)"
        )
    return extra


def _kv_scales(extra: dict, kv_quant: str, num_layers: int) -> list[KVScales] | None:
    """Every layer's per-tensor ``KVScales`` of fp8 KV (``extra_config.kv_scales``: one
    ``[k, v]`` for all layers, or one per layer), None for other KV. SGLang hands a backend no
    scale, and bytes of other scales mean other values: fp8 without them is refused."""
    value = extra.get("kv_scales")
    if kv_quant not in FP8_FORMATS:
        if value is not None:
            raise BackendSetupError(
                f"extra_config.kv_scales: fp8 KV's scales, given with kv_quant {kv_quant!r}; "
                f"expected an fp8 kv_quant (one of {FP8_FORMATS}) or no kv_scales"
            )
        return None
    expected = (
        f"extra_config.kv_scales: expected the per-tensor scales SGLang applies to this {kv_quant} "
        "KV (its attention layers' k_scale_float, v_scale_float: the checkpoint's, 1.0 without "
        f"any), finite positive numbers exact in float32: [k, v] for every layer, or one [k, v] "
        f"for each of the model's {num_layers} layers"
    )
    if value is None:
        raise BackendSetupError(f"{expected}; got none (units of other scales mean other values)")
    one = isinstance(value, list) and not any(isinstance(pair, list) for pair in value)
    pairs = [value] * num_layers if one else value
    if not isinstance(pairs, list) or len(pairs) != num_layers:
        raise BackendSetupError(f"{expected}; got {value!r:.80}")
    out = []
    for pair in pairs:  # KVScales rounds to float32: a value it changes is not SGLang's
        try:
            k, v = pair if isinstance(pair, list) else ()
            scales = KVScales("per-tensor", "float32", k, v)
            exact = (scales.k_scale, scales.v_scale) == (k, v)
        except (TypeError, ValueError, OverflowError):
            exact = False
        if not exact:
            raise BackendSetupError(f"{expected}; got {pair!r:.80}")
        out.append(scales)
    return out


def _int_option(extra: dict, name: str, default: int | None) -> int | None:
    value = extra.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BackendSetupError(f"extra_config.{name}: expected a positive int, got {value!r}")
    return value


# HiCacheStorageConfig fields that must keep their default: (default, why).
_REFUSED = {
    "attn_cp_size": (1, "context-parallel attention shards pages by token"),
    "dcp_size": (1, "decode-context parallelism shards pages by token"),
    "should_split_heads": (False, "heterogeneous-TP head splitting is what units already do"),
}


class CanonicalStorageCore:
    """Everything the backend does, without SGLang's base class, for this rank's
    ``storage_config`` (SGLang's ``HiCacheStorageConfig``)."""

    def __init__(self, storage_config: Any) -> None:
        cfg = self.config = _config(storage_config)
        for field, (default, why) in _REFUSED.items():
            if getattr(storage_config, field, default) != default:
                raise BackendSetupError(f"{field}: expected {default!r} ({why}; not supported)")
        self.tp_rank, self.tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
        self.pp_size, self.is_mla = int(storage_config.pp_size), bool(storage_config.is_mla_model)
        name = cfg.get("model_name") or getattr(storage_config, "model_name", None)
        if not isinstance(name, str) or not name:
            raise BackendSetupError(
                f"extra_config.model_name: expected the model's name (SGLang gave {name!r})"
            )
        self.model = ModelIdentity(name, cfg.get("model_revision", ""), cfg.get("model_extra", {}))
        self.pool = self.tier = self.staging = None

    def attach(self, pool: Any) -> None:
        """Build the codec, namespace, transfers, staging, key index and store for ``pool``."""
        if self.tier is not None:
            raise BackendSetupError("mem_pool_host: a host pool is already registered")
        codec, extra = self._codec(pool), self.config
        first, end = int(pool.start_layer), int(pool.end_layer)
        num_layers = _int_option(extra, "num_layers", end if self.pp_size == 1 else None)
        if num_layers is None or not 0 <= first < end <= num_layers:
            raise BackendSetupError(
                f"extra_config.num_layers: expected the model's layer count (with pipeline "
                f"parallelism: required), holding the pool's layers [{first}, {end}); got "
                f"{num_layers}"
            )
        kv_quant = extra.get("kv_quant", "none")
        if codec.dtype in ("uint8", "int8") and kv_quant == "none":
            raise BackendSetupError(
                f"extra_config.kv_quant: the KV is stored as {codec.dtype}; name its "
                f"quantisation (fp8: one of {FP8_FORMATS}) so it never meets other KV"
            )
        ctx = RankContext(self.tp_size, codec.total_kv_heads, self.tp_rank)
        spec, scales = codec.spec, _kv_scales(extra, kv_quant, num_layers)
        if scales is not None:  # fp8: named as the standalone engine names it, scales and all
            dtype = dtype_name(kv_quant)
            if codec.dtype not in ("uint8", dtype):
                raise BackendSetupError(
                    f"extra_config.kv_quant: {kv_quant} KV is one byte an element, but the "
                    f"host pool holds {codec.dtype}; expected the engine's own KV format"
                )
            spec, kv_quant = replace(spec, dtype=dtype), f"{dtype} per-tensor"
        own = StoreNamespace.from_specs(
            self.model, [spec] * num_layers, ctx, kv_quant=kv_quant, scales=scales
        )
        scheme = self._key_scheme(codec.page_size)
        self.namespace = _shared_or_own(own, scheme)
        self.first, self.end, self.codec = first, end, codec
        self.writers, me = codec.writer_ranks(), [self.tp_rank]
        self.loads = PageTransfer(codec, self.namespace, first, end, me)
        self.stores = None  # not elected: its bytes are replicas another rank writes
        if self.tp_rank in self.writers:
            self.stores = PageTransfer(codec, self.namespace, first, end, self.writers)
        if self.stores is not None and self.writers != me:
            directory = extra.get("staging_dir") or default_staging_dir()
            try:
                stale_s = check_seconds(
                    "extra_config.staging_stale_s", extra.get("staging_stale_s", 600)
                )
                self.staging = FragmentStaging(directory, self.namespace, codec, stale_s=stale_s)
            except OSError as error:
                raise BackendSetupError(f"extra_config.staging_dir: {error}") from None
            except (TypeError, ValueError) as error:
                raise BackendSetupError(str(error)) from None
            self.staging.sweep()
        capacity = _int_option(extra, "index_capacity", 1 << 20)
        self.index = TokenKeyIndex(scheme, codec.page_size, capacity)
        store, options = extra["store"], dict(extra.get("store_options", {}))
        if _authenticated(extra):
            options["secret"] = _store_secret()
        self.across: list[_Across] = []
        self.tier = _open_store(store, self.namespace, options)
        try:
            for across in self._across_namespaces():
                reader = _Across(across, _open_store(store, across.namespace, options))
                self.across.append(reader)
        except BaseException:
            self.close()
            raise
        self.pool = pool

    def _across_namespaces(self) -> list[UnitsAcross]:
        """How each ``read_unit_tokens`` this backend can read across is read (a multiple or
        divisor of the page size; one line says why another is not read)."""
        wanted = self.config.get("read_unit_tokens", [])
        if not isinstance(wanted, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in wanted
        ):
            raise BackendSetupError(
                f"extra_config.read_unit_tokens: expected a list of positive ints (other "
                f"engines' tokens per unit), got {wanted!r:.80}"
            )
        return readable_across(self.namespace, wanted)

    def _key_scheme(self, page_size: int) -> TokenKeyScheme:
        extra = self.config
        block = _int_option(extra, "hash_block_tokens", page_size)
        try:
            scheme = TokenKeyScheme(extra.get("hash_algorithm", "sha256"), block)
            scheme.check_unit_tokens(page_size)
        except ValueError as error:
            raise BackendSetupError(f"extra_config: {error} (the page size)") from None
        return scheme

    def _codec(self, pool: Any) -> HostPageCodec:
        if (
            getattr(pool, "kv_buffer", None) is None
            or hasattr(pool, "k_scale_host")
            or int(getattr(pool, "dcp_size", 1)) > 1
        ):
            raise BackendSetupError(
                f"mem_pool_host: expected a host pool with a kv_buffer, no KV scales (MXFP8) and "
                f"no DCP, got {type(pool).__name__}"
            )
        layers = int(pool.end_layer) - int(pool.start_layer)
        if int(pool.layer_num) != layers:
            raise BackendSetupError(
                f"mem_pool_host: {pool.layer_num} layers but the stage has {layers} (draft "
                "model layers in the pool are not supported)"
            )
        dtype = str(pool.dtype).removeprefix("torch.")
        common = (getattr(pool, "layout", None), int(pool.page_size), layers)
        if self.is_mla or hasattr(pool, "kv_cache_dim"):
            dims = (1, int(pool.kv_cache_dim), dtype, self.tp_size, self.tp_rank, 1)
            return HostPageCodec("mla", *common, *dims)
        if int(pool.v_head_dim) != int(pool.head_dim):
            raise BackendSetupError(
                f"mem_pool_host: K width {pool.head_dim} != V width {pool.v_head_dim}; "
                "canonical pages hold K and V of one head size"
            )
        heads, tp = int(pool.head_num), self.tp_size
        total = _int_option(self.config, "total_kv_heads", heads * tp)
        if (total % tp and tp % total) or heads != max(1, total // tp):
            raise BackendSetupError(
                f"extra_config.total_kv_heads: expected the model's KV heads, a multiple or "
                f"divisor of TP={tp} putting {heads} on a rank as the pool does, got {total}"
            )
        dims = (heads, int(pool.head_dim), dtype, tp, self.tp_rank, total)
        return HostPageCodec("full", *common, *dims)

    def close(self) -> None:
        for store in (self.tier, self.staging, *(a.store for a in getattr(self, "across", ()))):
            if store is not None:
                store.close()

    # ------------------------------------------------------------------ pages

    def _index(self) -> TokenKeyIndex:
        if self.tier is None:
            raise RuntimeError("no host pool registered: call register_mem_pool_host first")
        return self.index

    def batch_exists(self, keys: Sequence[str]) -> int:
        ckeys = self._index().prefix(keys)
        found = self.tier.lookup(ckeys, self.first, self.end) if ckeys else 0
        while found < len(keys) and any(
            across.store.lookup(ukeys, self.first, self.end) == len(ukeys)
            for across, ukeys, _ in self._across_units(keys, found)
        ):
            found += 1
        return found

    def _across_units(self, keys: Sequence[str], i: int) -> list[tuple[_Across, list, int]]:
        """Where page ``i`` of ``keys`` lies in units of other token counts: (the namespace's
        reader, the keys of the page's source units, the page's index in its sequence)."""
        out, index = [], self.index
        at = index.position(keys[i])
        if at is None:
            return out
        for reader in self.across:
            across = reader.units
            if not across.splits:
                ukeys = index.unit_keys_within(keys[i], across.tokens)
                if ukeys is not None:
                    out.append((reader, ukeys, at))
                continue
            # The source unit is named by its last page, which must be in this call.
            last = i + across.ratio - 1 - at % across.ratio
            if last < len(keys) and index.position(keys[last]) == at + last - i:
                out.append((reader, [index.canonical(keys[last])], at))
        return out

    def _load_across(self, keys: Sequence[str], pages: Sequence[Any], done: int) -> int:
        """Fill pages from ``done`` on from units of other token counts (``UnitsAcross``: split
        or joined), verified as any load; how many pages are filled in all."""
        transfer, loaded = self.loads, {}
        while done < len(pages):
            payload = None
            for reader, ukeys, at in self._across_units(keys, done):
                payload = self._across_payload(reader, ukeys, at, loaded)
                if payload is not None:
                    break
            if payload is None:
                return done
            transfer.rows[0].numpy()[:] = payload
            transfer.extract(1)
            transfer.give(0, pages[done])
            done += 1
        return done

    def _across_payload(self, reader: _Across, ukeys: list, at: int, loaded: dict) -> Any:
        """Page ``at``'s unit bytes from its source units ``ukeys``, each loaded and verified
        once (``loaded``: (reader's size, source index) -> row); None if one is not ok."""
        across, rows = reader.units, {}
        for source, key in zip(across.sources(at), ukeys):
            if (across.tokens, source) not in loaded:
                if len(loaded) > 8:
                    loaded.clear()
                row = np.empty(across.source_bytes(self.first, self.end), np.uint8)
                outcome = reader.store.load(key, self.first, self.end, row)
                if outcome.status != "ok":
                    if outcome.status != "miss":
                        _ok(outcome, "load")  # logs why
                    return None
                loaded[across.tokens, source] = row
            rows[source] = loaded[across.tokens, source]
        return across.build(rows, [at], self.first, self.end)[0]

    def load_pages(self, keys: Sequence[str], pages: Sequence[Any]) -> int:
        """Fill ``pages`` (host page views, or SGLang's flat forms) from the store, a prefix;
        returns how many. A page is written only from a unit found and verified."""
        ckeys, transfer, done = self._index().prefix(keys[: len(pages)]), self.loads, 0
        with transfer.lock:
            while done < len(ckeys):
                chunk = ckeys[done : done + transfer.batch]
                items = [(k, self.first, self.end, transfer.rows[i]) for i, k in enumerate(chunk)]
                outcomes = _each(self.tier.loads(items), len(items))
                found = next((i for i, o in enumerate(outcomes) if o.status != "ok"), len(chunk))
                if found < len(chunk) and outcomes[found].status != "miss":
                    _ok(outcomes[found], "load")  # logs why
                transfer.extract(found)
                for i in range(found):
                    transfer.give(i, pages[done + i])
                done += found
                if found < len(chunk):
                    break
            if self.across:
                done = self._load_across(keys, pages, done)
        return done

    def store_pages(self, keys: Sequence[str], pages: Sequence[Any], positions: Sequence[int]):
        """Store this rank's share of each page (a unit is published once whole): True for a
        page stored, staged or written by another rank; False for an unknown key or a failure."""
        ckeys = [self._index().canonical(key) for key in keys]
        results = [key is not None for key in ckeys]
        if self.stores is None:
            return results
        first, end, transfer = self.first, self.end, self.stores
        todo = [i for i, k in enumerate(ckeys) if k and not self.tier.lookup([k], first, end)]
        with transfer.lock:
            for start in range(0, len(todo), transfer.batch):
                chunk = todo[start : start + transfer.batch]
                for block, i in enumerate(chunk):
                    transfer.take(block, pages[i])
                ready = self._assemble(transfer, [ckeys[i] for i in chunk])
                publish = [(b, i) for b, i in enumerate(chunk) if ready[b]]
                items = [(ckeys[i], first, transfer.rows[b], positions[i], end) for b, i in publish]
                outcomes = _each(self.tier.stores(items), len(items)) if items else []
                for (b, _), outcome in zip(publish, outcomes):
                    ready[b] = _ok(outcome, "store")
                for b, i in enumerate(chunk):
                    results[i] = ready[b] is not False
                if self.staging is not None and publish:  # a failed one keeps them for a retry
                    self.staging.discard([ckeys[i] for b, i in publish if ready[b]], first, end)
        return results

    def _assemble(self, transfer: PageTransfer, ckeys: list[bytes]) -> list[bool | None]:
        """Place the writers' shares of each unit in its row: True (the row is the unit),
        None (shares still missing, or another rank published it), False (failed)."""
        first, end, me = self.first, self.end, self.tp_rank
        if self.staging is None:
            for block in range(len(ckeys)):
                transfer.place(me, block, block)
            return [True] * len(ckeys)
        shares = [(k, me, first, end, transfer.block_bytes(b)) for b, k in enumerate(ckeys)]
        ready: list[bool | None] = [None if ok else False for ok in self.staging.put(shares)]
        for block, key in enumerate(ckeys):
            if ready[block] is False or not self.staging.complete(key, first, end):
                continue  # the last writer to arrive publishes the unit
            for rank in self.writers:
                source, status = block, "ok"
                if rank != me:  # the spare block receives another rank's share, verified
                    source = transfer.spare
                    status = self.staging.get(key, rank, first, end, transfer.block_bytes(source))
                if status != "ok":
                    if not self.tier.lookup([key], first, end):  # not published by another
                        logger.warning("canonical-kv: unit %s not assembled: %s", key.hex(), status)
                        ready[block] = False
                    break
                transfer.place(rank, source, block)
            else:
                ready[block] = True
        return ready


@dataclass(frozen=True)
class _Across:
    """A reader of the shared units of another token count (``read_unit_tokens``)."""

    units: UnitsAcross
    store: Any


def _open_store(location: str, namespace: StoreNamespace, options: dict) -> Any:
    """The unit store at ``location`` (a directory, or a Redis URL) for ``namespace``."""
    if location.partition("://")[0] in REDIS_SCHEMES:
        from ..units import RedisStore

        return RedisStore(location, namespace, **options)
    return FileStore(location, namespace, **options)


def _authenticated(extra: dict) -> bool:
    value = extra.get("authenticated", False)
    if not isinstance(value, bool):
        raise BackendSetupError(
            f"extra_config.authenticated: expected true or false, got {value!r}"
        )
    return value


def _store_secret() -> Any:
    from ..units import StoreSecret

    try:
        secret = StoreSecret.from_env()
    except ValueError as error:
        raise BackendSetupError(f"extra_config.authenticated: {error}") from None
    if secret is None:
        raise BackendSetupError(
            "extra_config.authenticated: expected CANONICAL_KV_STORE_SECRET or "
            "CANONICAL_KV_STORE_SECRET_FILE in the environment of every engine"
        )
    return secret


def _shared_or_own(own: StoreNamespace, scheme: TokenKeyScheme) -> StoreNamespace:
    """The namespace every engine shares for this model and ``scheme`` (one start-up line),
    or, where its layers cannot be shared (opaque: read at this topology only), ``own`` with
    the scheme still described (its keys are the scheme's) and one line saying why."""
    try:
        shared = own.shared_prefix(scheme)
    except ValueError as error:
        logger.warning("canonical-kv: not sharing KV with other engines (%s); working alone", error)
        return replace(own, key_scheme=scheme.describe())
    logger.info(
        "canonical-kv: KV shared with every engine in namespace %s (%s, %d tokens per unit)",
        shared.hex[:16],
        scheme.describe(),
        shared.unit_tokens,
    )
    return shared


def _each(job: Any, count: int) -> list[Any]:
    """One outcome per item of a batch job (a batch that failed as a whole fails each)."""
    return job.value if job.value is not None else [job] * count


def _ok(outcome: Any, what: str) -> bool:
    if outcome.status != "ok":
        logger.warning("canonical-kv: %s failed: %s", what, escape_text(outcome.detail))
    return outcome.status == "ok"


def _flat(name: str, pages: Any, keys: Sequence[str]) -> Any:
    if pages is None or len(pages) != len(keys) or any(page is None for page in pages):
        raise ValueError(f"{name}: expected {len(keys)} flat host page tensors, got {pages!r:.80}")
    return pages


@functools.cache
def storage_class() -> type:
    """``CanonicalHiCacheStorage``: SGLang's ``HiCacheStorage`` over canonical units (built on
    first use: imports SGLang)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class CanonicalHiCacheStorage(HiCacheStorage):
        """SGLang HiCache L3 storage in canonical-kv units (see :mod:`canonical_ops.sglang`);
        the host pool arrives through ``register_mem_pool_host``."""

        def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
            self.core = CanonicalStorageCore(storage_config)

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            super().register_mem_pool_host(mem_pool_host)
            self.core.attach(mem_pool_host)
            install_hash_observer(self.core.index)

        def close(self) -> None:
            self.core.close()

        def clear(self) -> bool:
            # The store is shared with other engines: one engine's flush must not empty it.
            logger.info("canonical-kv: clear() leaves the shared store as it is")
            return False

        def exists(self, key: str) -> bool:
            return self.core.batch_exists([key]) == 1

        def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
            return self.core.batch_exists(keys)

        def _pages(self, keys: list[str], host_indices: Any) -> list[Any]:
            """v1 (zero copy): the pool's pages at ``host_indices``, one per key."""
            core, page = self.core, self.core.codec.page_size
            if host_indices is None or int(host_indices.numel()) != len(keys) * page:
                raise ValueError(
                    f"host_indices: expected {len(keys) * page} slots ({len(keys)} pages of "
                    f"{page}), got {None if host_indices is None else int(host_indices.numel())}"
                )
            return [core.codec.host_page(core.pool, int(i)) for i in host_indices[::page]]

        def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None):
            loaded = self.core.load_pages(keys, self._pages(keys, host_indices))
            return [i < loaded for i in range(len(keys))]

        def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None):
            base = len(getattr(extra_info, "prefix_keys", None) or [])
            pages = self._pages(keys, host_indices)
            return self.core.store_pages(keys, pages, range(base, base + len(keys)))

        # The generic calls: SGLang's flat pages (get_data_page, dummy flat pages).

        def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
            return self.batch_get([key], [target_location])[0]

        def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes=None):
            loaded = self.core.load_pages(keys, _flat("target_locations", target_locations, keys))
            return list(target_locations[:loaded]) + [None] * (len(keys) - loaded)

        def set(self, key: str, value: Any = None, target_location=None, target_sizes=None):
            return self.batch_set([key], [value])

        def batch_set(
            self, keys: list[str], values: Any = None, target_locations=None, target_sizes=None
        ) -> bool:
            pages = _flat("values", values, keys)
            return all(self.core.store_pages(keys, pages, range(len(keys))))

    CanonicalHiCacheStorage.__module__ = "canonical_ops.sglang"
    CanonicalHiCacheStorage.__qualname__ = "CanonicalHiCacheStorage"
    return CanonicalHiCacheStorage
