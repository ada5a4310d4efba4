"""vLLM 0.33 secondary tiers ``canonical_fs`` and ``canonical_redis``: each primary chunk (one
row of vLLM's CPU region) is one checksummed unit, keyed by vLLM's offload key. A load is verified
before vLLM sees it (a bad unit is a miss); all I/O runs as jobs with a ``deadline_s``. With
``shared_prefix`` (:mod:`.shared`) a unit is the row's layers' canonical pages in the namespace
every engine shares, found by SGLang and the standalone engine by the same key (scheme v2).
The namespace of the rows otherwise: :mod:`.namespace`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.logger import init_logger
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from layouts.cli import escape_text

from ..checks import check_bool, check_int, check_seconds
from ..units import JobOutcome, JobPool
from ..units.jobs import current_job
from ..units.tier import DEFAULT_DEADLINE_S, LoadItem, StoreItem, UnitStore, batch_outcome
from ..units.token_keys import TokenKeyScheme, offload_key_of, store_key
from .namespace import row_namespace
from .shared import SharedPrefix, chunk_pages, chunk_to_unit, shared_namespace, unit_to_chunk

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

    from ..units.jobs import IOJob

__all__ = ["CanonicalFileTier", "CanonicalRedisTier", "row_namespace", "warn_if_random_hash_seed"]

logger = init_logger(__name__)

CORRUPT_UNITS = "vllm:kv_offload_canonical_corrupt_units"
EXPIRED_JOBS = "vllm:kv_offload_canonical_expired_jobs"
REMOVED_UNITS = "vllm:kv_offload_canonical_removed_units"
_LABELS = ("tier_type",)
_METRICS = {  # counter -> its help text
    CORRUPT_UNITS: "Units that failed verification on load (each a miss; quarantined).",
    EXPIRED_JOBS: "Lookups, loads and stores that ran past deadline_s (a miss or a failed store).",
    REMOVED_UNITS: "Units the tier removed (LRU eviction to capacity_bytes, quarantine).",
}
_MAX_LOOKUP_ROUNDS = 8  # prefix lookups per batch of keys; later keys count as misses
unit_key = store_key  # an offload key's unit key: units.token_keys' one padding


def offload_key(unit: bytes) -> OffloadKey:
    """The offload key a unit key was made from (:func:`unit_key` inverted)."""
    return OffloadKey(offload_key_of(unit))


def warn_if_random_hash_seed(tier_type: str) -> bool:
    """Log one line when vLLM's block hashes use a random per-process seed; False while vLLM
    has not chosen its seed yet (tiers are built before ``init_none_hash``): call again later."""
    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        return False
    seed = kv_cache_utils.get_none_hash_seed()
    if os.getenv("PYTHONHASHSEED") is None and seed != kv_cache_utils.DEFAULT_NONE_HASH_SEED:
        logger.warning(
            "%s: vLLM hashes blocks with a random per-process seed (a non-cryptographic "
            "prefix_caching_hash_algo without PYTHONHASHSEED): KV stored by this engine is "
            "never found after a restart or by another engine; set PYTHONHASHSEED to one "
            "value on every engine, or use sha256",
            escape_text(tier_type),
        )
    return True


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup front end; each batch runs on the tier's lookup pool."""

    def __init__(self, tier: _CanonicalTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._lookup_batch(keys)


class _CanonicalTier(SecondaryTierManager):
    """What both tiers share: jobs, verified loads with partial keep, events and metrics."""

    medium: ClassVar[Medium] = Medium.STORAGE

    _THREADS = 16  # default n_read_threads and n_write_threads (vLLM fs tier's)

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        *,
        n_read_threads: int | None = None,
        n_write_threads: int | None = None,
        queue_depth: int = 64,
        deadline_s: float | None = DEFAULT_DEADLINE_S,
        authenticated: bool = False,
        enable_kv_events: bool = False,
        locality: str | None = None,
        model_name: str | None = None,
        shared_prefix: Mapping[str, Any] | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        secret = _secret(authenticated)
        self.locality = Locality(locality) if locality is not None else None
        reads, writes = (
            check_int(name, self._THREADS if n is None else n, minimum=1)
            for name, n in (
                ("n_read_threads", n_read_threads),
                ("n_write_threads", n_write_threads),
            )
        )
        queue_depth = check_int("queue_depth", queue_depth, minimum=1)
        self.deadline_s = deadline_s = check_seconds("deadline_s", deadline_s, optional=True)
        if model_name is not None and not (isinstance(model_name, str) and model_name):
            raise TypeError(f"model_name: expected a non-empty str, got {model_name!r}")
        self._own = row_namespace(offloading_spec, self.block_size_bytes, model_name)
        self._chunk_pages = None  # (pages, blocks per chunk): rows regrouped as shared units
        self.namespace, self._scheme = self._own, None
        if shared_prefix is not None:
            shared = SharedPrefix.from_option(shared_prefix)
            name = model_name if model_name is not None else offloading_spec.config.model.name
            from .spec import CanonicalOffloadingSpec  # the worker that proves the geometry

            if isinstance(offloading_spec, CanonicalOffloadingSpec):
                found, why = shared_namespace(shared, offloading_spec, self.block_size_bytes, name)
            else:
                found = None
                why = (
                    "spec_name is not CanonicalOffloadingSpec (only its worker checks the geometry)"
                )
            if found is None:
                logger.warning(
                    "%s: not sharing KV with other engines: %s",
                    escape_text(tier_type),
                    escape_text(why),
                )
            else:
                self.namespace = found
                hash_tokens = offloading_spec.config.cache.tokens_per_hash
                self._scheme = TokenKeyScheme(shared.hash_algorithm, hash_tokens)
                self._chunk_pages = chunk_pages(shared, offloading_spec.config)
        self._payload_bytes = (
            self.block_size_bytes if self._scheme is None else self.namespace.total_bytes
        )
        self._tokens_per_chunk = [
            g.tokens_per_block * offloading_spec.config.cache.blocks_per_chunk
            for g in offloading_spec.config.groups
        ]
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                logger.warning(
                    "%s: enable_kv_events is set but KV cache events are disabled globally; "
                    "the tier emits none",
                    escape_text(tier_type),
                )
        # IOJob id -> (the job, vLLM's job id, its keys, is a load)
        self._jobs: dict[int, tuple[IOJob, int, list[OffloadKey], bool]] = {}
        self._done: list[JobResult] = []  # refused at submission, or waited for by drain_jobs
        self._removed = 0
        self._reported = dict.fromkeys((CORRUPT_UNITS, EXPIRED_JOBS, REMOVED_UNITS), 0)
        self._store_options = {} if secret is None else {"secret": secret}
        self._io = JobPool(
            reads + writes,
            queue_depth,
            name=f"ckv-{tier_type}",
            deadline_s=deadline_s,
            read_threads=reads,  # vLLM's split: n_read_threads prefer loads
        )
        self._lookup_pool = JobPool(1, 4, name=f"ckv-{tier_type}-lookup", deadline_s=deadline_s)
        try:
            self.store: UnitStore = self._open_store(pool=self._io, **self._store_options)
        except BaseException:
            self._io.close(cancel=True)
            self._lookup_pool.close(cancel=True)
            raise
        self._rows = primary_kv_view.cast("B")  # released by shutdown (vLLM then unmaps)
        self._lookups = _Lookups(self)
        self._seed_checked = warn_if_random_hash_seed(tier_type)
        self._check_shared_hash()
        if self._scheme is not None:
            logger.info(
                "%s: KV shared with every engine in namespace %s (%s, %d tokens per unit)",
                escape_text(tier_type),
                self.namespace.hex[:16],
                self.namespace.key_scheme,
                self.namespace.unit_tokens,
            )

    def _check_shared_hash(self) -> None:
        """Once vLLM has chosen its seed: keep sharing only when vLLM's ``NONE_HASH`` is the
        shared scheme's (same algorithm and seed); else one line, and this engine's own
        namespace from then on (no I/O ran before: keys exist only after the seed)."""
        scheme = self._scheme
        none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
        if scheme is None or none_hash is None or getattr(self, "_hash_checked", False):
            return
        self._hash_checked = True
        if bytes(none_hash) == scheme.none_hash:
            return
        logger.warning(
            "%s: not sharing KV with other engines: vLLM's block hashes are not %s with seed "
            "PYTHONHASHSEED (or vllm-none-hash); set prefix_caching_hash_algo and "
            "PYTHONHASHSEED as on every other engine",
            escape_text(self.tier_type),
            scheme.describe(),
        )
        self.store.close(cancel=True)
        self.namespace, self._scheme, self._payload_bytes = self._own, None, self.block_size_bytes
        self._chunk_pages = None
        self.store = self._open_store(pool=self._io, **self._store_options)

    def _open_store(self, **options: Any) -> UnitStore:  # pragma: no cover - per tier
        raise NotImplementedError

    # ------------------------------------------------------------------ lookups

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {name: OffloadingCounterMetadata(text, _LABELS) for name, text in _METRICS.items()}

    def _lookup_batch(self, keys: list[OffloadKey]) -> list[bool]:
        """Whether each key is stored (lookup-manager thread; the I/O runs on the lookup pool,
        so a stuck lookup expires as misses instead of pinning that thread)."""
        job = self._lookup_pool.submit(
            "lookup", lambda: JobOutcome("ok", value=self._present(keys))
        )
        if not job.refused:
            with contextlib.suppress(TimeoutError):  # expired by then (deadline_s)
                self._lookup_pool.wait(
                    job, None if self.deadline_s is None else self.deadline_s + 5
                )
        return job.value if job.ok else [False] * len(keys)

    def _present(self, keys: list[OffloadKey]) -> list[bool]:
        """Per-key presence from prefix lookups (usually one or two round trips)."""
        found: list[bool] = []
        rest = keys
        for _ in range(_MAX_LOOKUP_ROUNDS):
            if not rest:
                break
            n = self.store.lookup([unit_key(k) for k in rest], 0, self.namespace.num_layers)
            found += [True] * n + [False] * (n < len(rest))
            rest = rest[n + 1 :]
        return found + [False] * len(rest)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._check_shared_hash()
        result = self._lookups.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if result else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()
        self._check_shared_hash()
        if not self._seed_checked:
            self._seed_checked = warn_if_random_hash_seed(self.tier_type)
        self._collect_removed()

    # ------------------------------------------------------------------ jobs

    def _row(self, chunk_id: Any) -> memoryview:
        """A chunk's unit payload: its whole row, or (shared) the row's canonical pages."""
        start = int(chunk_id) * self.block_size_bytes
        return self._rows[start : start + self._payload_bytes]

    def _position(self, key: OffloadKey, req_context: ReqContext) -> int:
        end = req_context.get_offload_key_position(key)
        if not end:
            return 0
        group = get_offload_group_idx(key)
        tokens = self._tokens_per_chunk[group] if group < len(self._tokens_per_chunk) else 1
        return max(0, end - 1) // max(1, tokens)

    def _submit(self, job: IOJob, job_metadata: TransferJob, keys: list, is_load: bool) -> None:
        if job.refused:
            self._done.append(self._result(job, job_metadata.job_id, keys, is_load))
        else:
            self._jobs[job.job_id] = (job, job_metadata.job_id, keys, is_load)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._check_shared_hash()
        keys = list(job_metadata.keys)
        ctx, layers = job_metadata.req_context, self.namespace.num_layers
        if self._chunk_pages is not None:
            job = self._regrouped(False, keys, list(job_metadata.chunk_ids), ctx)
            self._submit(job, job_metadata, keys, False)
            return
        items = [
            StoreItem(unit_key(key), 0, self._row(cid), self._position(key, ctx), layers)
            for key, cid in zip(keys, job_metadata.chunk_ids)
        ]
        self._submit(self.store.submit_stores(items), job_metadata, keys, False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._check_shared_hash()
        keys, layers = list(job_metadata.keys), self.namespace.num_layers
        if self._chunk_pages is not None:
            job = self._regrouped(True, keys, list(job_metadata.chunk_ids), None)
            self._submit(job, job_metadata, keys, True)
            return
        items = [  # tuples: what a LoadItem holds, built without a dataclass per chunk
            (unit_key(key), 0, layers, self._row(cid))
            for key, cid in zip(keys, job_metadata.chunk_ids)
        ]
        self._submit(self.store.submit_loads(items), job_metadata, keys, True)

    def _regrouped(self, is_load: bool, keys: list, chunk_ids: list, ctx: Any) -> IOJob:
        """ONE job storing or loading chunks whose rows are regrouped (``chunk_pages``) to and
        from shared units in scratch memory, on the I/O pool: rows are read and written only
        under the job's claim (never after its deadline), as the stores do."""
        pages, bpc = self._chunk_pages
        positions = [0] * len(keys) if is_load else [self._position(k, ctx) for k in keys]
        layers, store, unit_bytes = (
            self.namespace.num_layers,
            self.store,
            self.namespace.total_bytes,
        )

        def work() -> JobOutcome:
            job = current_job()
            if is_load:
                units = [np.empty(unit_bytes, np.uint8) for _ in chunk_ids]
                loads = [LoadItem(unit_key(k), 0, layers, u) for k, u in zip(keys, units)]
                outcomes = store.loads(loads).value
            elif job.claim():  # never read a row vLLM may have reused after the deadline
                try:
                    units = [chunk_to_unit(self._row(cid), pages, bpc) for cid in chunk_ids]
                finally:
                    job.release()
                stores = [
                    StoreItem(unit_key(k), 0, u, p, layers)
                    for k, u, p in zip(keys, units, positions)
                ]
                outcomes = store.stores(stores).value
            else:
                return JobOutcome("error", detail="expired before reading the rows")
            if not isinstance(outcomes, list):
                return JobOutcome("error", detail="the store failed the batch")
            if is_load:
                if not job.claim():  # expired: vLLM may have freed the rows
                    return JobOutcome("error", detail="expired before writing the rows")
                try:
                    for cid, unit, outcome in zip(chunk_ids, units, outcomes):
                        if outcome.status == "ok":
                            unit_to_chunk(unit, pages, bpc, self._row(cid))
                finally:
                    job.release()
            return batch_outcome(outcomes)

        kind = "loads" if is_load else "stores"
        return self._io.submit(kind, work, {"items": len(keys), "regrouped": bpc})

    def _result(self, job: IOJob, vllm_job: int, keys: list, is_load: bool) -> JobResult:
        """vLLM's JobResult of a finished job: a load keeps the keys whose unit was verified."""
        outcomes = job.value if isinstance(job.value, list) and len(job.value) == len(keys) else ()
        ok = [k for k, o in zip(keys, outcomes) if o.status == "ok"]
        elapsed = None
        if job.started_at is not None and job.finished_at is not None:
            elapsed = job.finished_at - job.started_at
        if not is_load:
            if self.events is not None and ok:
                self.events.append(OffloadingEvent(ok, self.medium, False, self.locality))
            return JobResult(vllm_job, len(ok) == len(keys), None, elapsed, job.nbytes or None)
        if len(ok) == len(keys):
            return JobResult(vllm_job, True, None, elapsed, job.nbytes or None)
        kept = set(ok)
        self._lookups.mark_miss([k for k in keys if k not in kept])
        return JobResult(vllm_job, False, tuple(ok) or None, elapsed, job.nbytes or None)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._done = self._done, []
        for job in self._io.poll():
            entry = self._jobs.pop(job.job_id, None)
            if entry is not None:
                results.append(self._result(*entry))
        return results

    def drain_jobs(self) -> None:
        """Wait for every submitted job (each ends by its deadline at the latest); their
        results come with the next :meth:`get_finished_jobs`."""
        for io_id in list(self._jobs):
            self._io.wait(self._jobs[io_id][0])
            self._done.append(self._result(*self._jobs.pop(io_id)))

    # ------------------------------------------------------------------ events and metrics

    def _collect_removed(self) -> None:
        take = getattr(self.store, "take_removed", None)
        removed = take() if take is not None else []
        if not removed:
            return
        self._removed += len(removed)
        if self.events is not None:
            keys = [offload_key(bytes(key)) for key, _first, _end in removed]
            self.events.append(OffloadingEvent(keys, self.medium, True, self.locality))

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._collect_removed()
        if self.events:
            events, self.events = self.events, []
            yield from events

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The counters' increase since the last call (vLLM sums them into Prometheus)."""
        totals = {
            CORRUPT_UNITS: self.store.metrics().corrupt_detected,
            EXPIRED_JOBS: self._io.stats().expired + self._lookup_pool.stats().expired,
            REMOVED_UNITS: self._removed,
        }
        stats = OffloadingConnectorStats()
        for name, total in totals.items():
            if total > self._reported[name]:
                stats.increase_counter(name, total - self._reported[name], (self.tier_type,))
                self._reported[name] = total
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        """Stop the lookup thread and the pools (queued jobs cancelled, running ones waited
        for until their deadline), then the store."""
        wait = None if self.deadline_s is None else self.deadline_s + 5
        self._lookups.shutdown()
        self._lookup_pool.close(cancel=True, timeout=wait)
        self._io.close(cancel=True, timeout=wait)
        self.store.close(cancel=True)
        self._jobs.clear()
        # vLLM unmaps the region after its tiers shut down; a thread abandoned in stuck
        # I/O may still hold a row, and then vLLM keeps the mapping (never unmaps under it).
        self._rows.release()


def _check_options(name: str, value: Any, refused: frozenset[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise TypeError(
            f"{name}: expected a mapping of option names to values, got a {type(value).__name__}"
        )
    clash = sorted(refused & set(value))
    if clash:
        raise ValueError(f"{name}: {clash} are set by the tier itself; remove them")
    return dict(value)


def _secret(authenticated: Any) -> Any:
    """The shared secret of an authenticated tier (from the environment), or None."""
    if not check_bool("authenticated", authenticated):
        return None
    from ..units import StoreSecret

    secret = StoreSecret.from_env()
    if secret is None:
        raise ValueError(
            "authenticated: expected CANONICAL_KV_STORE_SECRET or "
            "CANONICAL_KV_STORE_SECRET_FILE in the environment of every engine"
        )
    return secret


class CanonicalFileTier(_CanonicalTier):
    """``canonical_fs``: vLLM's ``fs`` tier, as checksummed units of a :class:`FileStore`.
    Options (the ``secondary_tiers`` entry's; README "vLLM tiers"): ``root_dir``,
    ``capacity_bytes``, ``fsync``, ``direct_io``, ``direct_reads``, ``group_shared`` and
    every tier's."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        capacity_bytes: int | None = None,
        fsync: bool = False,
        direct_io: bool = False,
        direct_reads: bool = True,
        group_shared: bool = False,
        **options: Any,
    ) -> None:
        if not isinstance(root_dir, str) or not root_dir:
            raise TypeError(f"root_dir: expected a directory path, got {root_dir!r}")
        self.root_dir = root_dir
        self._options = dict(
            capacity_bytes=capacity_bytes,
            fsync=fsync,
            direct_io=direct_io,
            direct_reads=direct_reads,
            group_shared=group_shared,
        )
        super().__init__(offloading_spec, primary_kv_view, tier_type, **options)

    def _open_store(self, **options: Any) -> UnitStore:
        from ..units import FileStore

        return FileStore(self.root_dir, self.namespace, **self._options, **options)


class CanonicalRedisTier(_CanonicalTier):
    """``canonical_redis``: primary chunks as checksummed units on a Redis / Valkey server or
    cluster (a :class:`RedisStore`; options ``url``, ``ttl_s``, ``key_prefix``, ``redis_options``).
    The server owns eviction (no removal events); a server down is a miss, never an error."""

    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    _THREADS = 4
    _TIER_SET = frozenset(
        ["url", "namespace", "pool", "threads", "queue_depth", "deadline_s", "secret"]
    )

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str,
        ttl_s: float | None = None,
        key_prefix: str = "ckv",
        redis_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise TypeError("url: expected a redis://, rediss://, unix:// or redis+cluster:// URL")
        self._url = url
        self._options = {"require_server": False, "ttl_s": ttl_s, "key_prefix": key_prefix}
        self._options.update(_check_options("redis_options", redis_options, self._TIER_SET))
        super().__init__(offloading_spec, primary_kv_view, tier_type, **options)

    def _open_store(self, **options: Any) -> UnitStore:
        from ..units import RedisStore

        return RedisStore(self._url, self.namespace, **self._options, **options)
