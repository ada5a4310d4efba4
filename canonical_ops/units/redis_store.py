"""A shared tier of canonical units on Redis or Valkey (standalone, TLS, or Cluster).

The values are the very units of the file store (:mod:`.encoding`: header +
payload, XXH3-128 over both); nothing else is ever loaded. Every engine that
shares a server (or cluster) shares the KV of every namespace it knows, across
tensor and pipeline splits, exactly like a shared :class:`~.files.FileStore`
directory, but over the network and with one round trip per batch.

The tier in parts (each module's docstring is the reference for its part):

* :mod:`.redis_index`: the keys (``P:v1:{<ns>:<kd>}:<first>-<end>``, chunks,
  ``...:idx``), and each block key's index of stored layer ranges: lookups
  and covers across pipeline splits;
* :mod:`.redis_chunks`: a unit as one value (``SET NX``: the first writer
  wins) or, above ``max_value_bytes`` (16 MiB), as chunks under a manifest;
* :mod:`.redis_batches`: the round trips of a batched store and a batched
  load (every load verified before a byte reaches the destination);
* :mod:`.redis_connection`: URLs, clients, timeouts, retries, the circuit
  breaker, round trips (through redis-py, or direct);
* :mod:`.redis_wire`: the commands; the packer that sends a unit without
  joining it; the reader of direct round trips (a value read once, from the
  kernel into a reused buffer, verified, then copied into its destination);
* :mod:`.redis_records`: the items callers pass and the metrics they read;
* this module: :class:`RedisStore`, the tier (arguments, jobs, counters).

Only commands Valkey also has are used: GET, SET (NX, GET, PX), EXISTS, DEL,
PERSIST, PEXPIRE (NX, GT), ZADD (GT), ZRANGE (BYSCORE), ZREMRANGEBYSCORE and
ZREM; Redis >= 7.0 or Valkey >= 7.2 (SET NX GET needs 7.0).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..checks import check_int
from .files import key_digest
from .jobs import IOJob, JobOutcome, JobPool, run_inline
from .namespace import StoreNamespace
from .redis_batches import _Publishing, _Reading
from .redis_chunks import (
    _MAX_VALUE_LIMIT,
    _MIN_VALUE_BYTES,
    DEFAULT_MAX_VALUE_BYTES,
    MANIFEST_MAGIC,
)
from .redis_connection import (
    RedisConnection,
    RedisStoreError,
    _Breaker,
    _check_seconds,
    _check_str,
    _Unavailable,
    check_url,
    client_options,
    redact_url,
)
from .redis_index import _Keys, _Ranges, covered_prefix, lookup_ops
from .redis_records import (
    _COUNTERS,
    LoadItem,
    RedisStoreMetrics,
    StoreItem,
    _LoadReq,
    _StoreReq,
    batch_outcome,
)
from .tier import TierBase
from .unit import normalize_key

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "MANIFEST_MAGIC",
    "LoadItem",
    "RedisStore",
    "RedisStoreError",
    "RedisStoreMetrics",
    "StoreItem",
]

# ---------------------------------------------------------------------- the store


class RedisStore(_Publishing, _Reading, TierBase):
    """Canonical units on a Redis / Valkey server or cluster, for one :class:`StoreNamespace`.

    Parameters
    ----------
    url : str
        ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS),
        ``unix:///path/to/socket[?db=N]``, or ``redis+cluster://`` /
        ``rediss+cluster://`` for a Redis Cluster (any node; the others are
        discovered). Query arguments are passed to redis-py (e.g.
        ``?ssl_cert_reqs=none``).
    namespace : StoreNamespace
    cluster : bool | None
        Use redis-py's ``RedisCluster``; default: from the URL scheme.
    username, password : str | None
        ACL user and password; override the URL's.
    db : int | None
        Database number (standalone only); overrides the URL's.
    ttl_s : float | None
        Expire every stored unit after this many seconds; None = keep until
        the server evicts it.
    max_value_bytes : int
        Largest value written; larger units are chunked (see the module
        docstring). Default 16 MiB; at least 4096, at most 512 MiB.
    max_pipeline_bytes : int
        A batch moving more value bytes than this is sent as several
        pipelines (bounds client and server buffers). Default 256 MiB.
    socket_timeout_s, connect_timeout_s : float
        Per socket operation / connect (defaults 5 s, 2 s).
    lookup_timeout_s : float
        Timeout of synchronous :meth:`lookup` calls (default 0.5 s; no retries).
    retries : int
        redis-py retries of a failed command (exponential back-off from 50 ms,
        at most 0.5 s); default 2.
    breaker_failures : int
        Consecutive failed round trips that open the circuit breaker (default 2).
    breaker_backoff_s, breaker_max_backoff_s : float
        First and largest pause before probing a failed server (1 s, 30 s).
    chunk_pending_s : float
        Expiry of a chunked unit's chunks until its manifest is published (60 s).
    require_server : bool
        Raise when the server is unreachable at start-up (default). False:
        warn and start with the breaker open (probing later).
    ssl_ca_certs, ssl_certfile, ssl_keyfile : str | None
        TLS files for ``rediss://`` (CA bundle; client certificate and key).
    client_kwargs : Mapping | None
        More keyword arguments for the redis-py client (they win over the above).
    key_prefix : str
        First component of every key (default ``"ckv"``).
    threads, queue_depth, pool :
        As :class:`~.files.FileStore`: the store's own :class:`JobPool`
        (default 4 threads, 64 queued jobs) or a shared one.

    Raises
    ------
    RedisStoreError
        Wrong credentials, missing ACL permissions, a server too old, or
        (with ``require_server``) no server at start-up; the message names
        the URL (password redacted).
    """

    def __init__(
        self,
        url: str,
        namespace: StoreNamespace,
        *,
        cluster: bool | None = None,
        username: str | None = None,
        password: str | None = None,
        db: int | None = None,
        ttl_s: float | None = None,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_pipeline_bytes: int = 256 << 20,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        lookup_timeout_s: float = 0.5,
        retries: int = 2,
        breaker_failures: int = 2,
        breaker_backoff_s: float = 1.0,
        breaker_max_backoff_s: float = 30.0,
        chunk_pending_s: float = 60.0,
        require_server: bool = True,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
        key_prefix: str = "ckv",
        threads: int | None = None,
        queue_depth: int | None = None,
        pool: JobPool | None = None,
    ) -> None:
        if not isinstance(namespace, StoreNamespace):
            raise TypeError(f"namespace: expected a StoreNamespace, got {type(namespace).__name__}")
        self.namespace = namespace
        scheme = check_url(url)
        self.url = redact_url(url)
        if cluster is not None and not isinstance(cluster, (bool, np.bool_)):
            raise TypeError(f"cluster: expected a bool or None, got {cluster!r}")
        if cluster is not None and not cluster and scheme.endswith("+cluster"):
            raise ValueError(f"cluster: expected True or None with a {scheme}:// URL, got False")
        self.cluster = scheme.endswith("+cluster") if cluster is None else bool(cluster)
        if self.cluster and scheme == "unix":
            raise ValueError("url: expected a redis:// or rediss:// URL with cluster=True")
        username = _check_str("username", username)
        password = _check_str("password", password)
        if db is not None:
            db = check_int("db", db, minimum=0)
        self.ttl_s = _check_seconds("ttl_s", ttl_s, optional=True)
        self.max_value_bytes = check_int(
            "max_value_bytes", max_value_bytes, minimum=_MIN_VALUE_BYTES, maximum=_MAX_VALUE_LIMIT
        )
        self.max_pipeline_bytes = check_int(
            "max_pipeline_bytes", max_pipeline_bytes, minimum=self.max_value_bytes
        )
        self.socket_timeout_s = _check_seconds("socket_timeout_s", socket_timeout_s)
        self.connect_timeout_s = _check_seconds("connect_timeout_s", connect_timeout_s)
        self.lookup_timeout_s = _check_seconds("lookup_timeout_s", lookup_timeout_s)
        self.retries = check_int("retries", retries, minimum=0, maximum=10)
        self.chunk_pending_s = _check_seconds("chunk_pending_s", chunk_pending_s)
        breaker_failures = check_int("breaker_failures", breaker_failures, minimum=1)
        backoff = _check_seconds("breaker_backoff_s", breaker_backoff_s)
        max_backoff = _check_seconds("breaker_max_backoff_s", breaker_max_backoff_s)
        if max_backoff < backoff:
            raise ValueError(
                f"breaker_max_backoff_s: expected >= breaker_backoff_s={backoff}, got {max_backoff}"
            )
        if not isinstance(require_server, (bool, np.bool_)):
            raise TypeError(f"require_server: expected a bool, got {require_server!r}")
        for name, value in (
            ("ssl_ca_certs", ssl_ca_certs),
            ("ssl_certfile", ssl_certfile),
            ("ssl_keyfile", ssl_keyfile),
        ):
            _check_str(name, value)
        if client_kwargs is not None and not isinstance(client_kwargs, Mapping):
            raise TypeError(f"client_kwargs: expected a mapping or None, got {client_kwargs!r}")
        if not isinstance(key_prefix, str):
            raise TypeError(
                f"key_prefix: expected a non-empty str without braces, got {key_prefix!r}"
            )
        if not key_prefix or set("{}") & set(key_prefix):
            raise ValueError(
                f"key_prefix: expected a non-empty str without braces, got {key_prefix!r}"
            )
        threads, queue_depth = self._pool_args(pool, threads, queue_depth)

        options = client_options(
            url,
            scheme,
            cluster=self.cluster,
            username=username,
            password=password,
            db=db,
            ssl_files={
                "ssl_ca_certs": ssl_ca_certs,
                "ssl_certfile": ssl_certfile,
                "ssl_keyfile": ssl_keyfile,
            },
            client_kwargs=client_kwargs,
            connect_timeout_s=self.connect_timeout_s,
        )
        self._server_keys = _Keys(key_prefix, namespace)
        self._ranges = _Ranges(namespace.num_layers)
        self._init_base()
        self._counts: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)
        self._counts["lookup_seconds_total"] = 0.0
        self._counts["lookup_seconds_max"] = 0.0
        self._breaker = _Breaker(breaker_failures, backoff, max_backoff)
        self._tls = threading.local()
        self._connection = RedisConnection(
            self.url,
            options,
            cluster=self.cluster,
            socket_timeout_s=self.socket_timeout_s,
            lookup_timeout_s=self.lookup_timeout_s,
            retries=self.retries,
            breaker=self._breaker,
            max_pipeline_bytes=self.max_pipeline_bytes,
            count=self._count,
        )
        try:
            self._connection.start(self._server_keys.base, bool(require_server))
        except BaseException:
            self._connection.close()
            raise
        # The pool last: a failed start-up leaves no threads behind.
        self._attach_pool(pool, threads, queue_depth, "ckv-redis")

    # ------------------------------------------------------------------ keys

    def unit_key(self, key: Any, first: int, end: int) -> str:
        """The server key of ``key``'s unit (or manifest) of layers ``[first, end)``."""
        first, end = self._range(first, end)
        return self._server_keys.unit(key_digest(normalize_key(key)), first, end)

    def index_key(self, key: Any) -> str:
        """The server key of ``key``'s index of stored layer ranges (a sorted set)."""
        return self._server_keys.index(key_digest(normalize_key(key)))

    def chunk_keys(self, key: Any, first: int, end: int, nonce: bytes, count: int) -> list[str]:
        """The server keys of chunks 0..count-1 of a chunked unit whose manifest names ``nonce``."""
        base = self.unit_key(key, first, end)
        return [f"{base}:{nonce.hex()}:{i}" for i in range(count)]

    # ------------------------------------------------------------------ argument checks

    def _store_req(self, item: Any, name: str) -> _StoreReq:
        if not isinstance(item, StoreItem):
            if not isinstance(item, (tuple, list)) or not 4 <= len(item) <= 5:
                raise TypeError(
                    f"{name}: expected a StoreItem or (key, first, payload, position[, end]), "
                    f"got {type(item).__name__}"
                )
            item = StoreItem(*item)
        raw_key, first, end, position, view = self._store_args(
            item.key, item.first, item.payload, item.position, item.end, name
        )
        return _StoreReq(raw_key, first, end, position, view)

    def _load_req(self, item: Any, name: str) -> _LoadReq:
        if not isinstance(item, LoadItem):
            if not isinstance(item, (tuple, list)) or len(item) != 4:
                raise TypeError(
                    f"{name}: expected a LoadItem or (key, first, end, destination), "
                    f"got {type(item).__name__}"
                )
            item = LoadItem(*item)
        raw_key, first, end, view = self._load_args(
            item.key, item.first, item.end, item.destination, name
        )
        return _LoadReq(raw_key, first, end, view)

    # ------------------------------------------------------------------ lookup

    def lookup(self, keys: Sequence[Any], first: int, end: int) -> int:
        """Length of the prefix of ``keys`` whose layers ``[first, end)`` are stored
        (:meth:`.PageTier.lookup`).

        One pipelined round trip for the whole batch (the keys' indexes), on
        the caller's thread, bounded by ``lookup_timeout_s`` (no retries). A
        unit evicted since is a miss at load time. Server down, slow or
        skipped: 0 (counted), never an exception.
        """
        self._check_open()
        first, end = self._range(first, end)
        raws = self._keys(keys)
        return self._lookup(raws, first, end, lookup=True)

    def _lookup(self, raws: list[bytes], first: int, end: int, *, lookup: bool) -> int:
        started = time.perf_counter()
        found, unavailable = 0, False
        if raws:
            ops = lookup_ops(self._server_keys, raws, first, end)
            try:
                replies = self._connection.roundtrip(ops, lookup=lookup, direct=True)
            except _Unavailable:
                unavailable = True
                replies = []
            found = covered_prefix(self._ranges, replies, first, end)
        elapsed = time.perf_counter() - started
        with self._lock:
            c = self._counts
            c["lookups"] += 1
            c["lookup_blocks"] += len(raws)
            c["lookup_hit_blocks"] += found
            c["lookups_unavailable"] += unavailable
            c["lookup_seconds_total"] += elapsed
            c["lookup_seconds_max"] = max(c["lookup_seconds_max"], elapsed)
        return found

    def submit_lookup(self, keys: Sequence[Any], first: int, end: int) -> IOJob:
        """:meth:`lookup` in a pool thread (``socket_timeout_s``, retries); the job's value is the prefix length."""
        self._check_open()
        first, end = self._range(first, end)
        raws = self._keys(keys)
        job = self.pool.submit(
            "lookup",
            lambda: JobOutcome("ok", value=self._lookup(raws, first, end, lookup=False)),
            {"keys": raws, "first": first, "end": end},
        )
        if job.refused:
            self._count("lookups_refused")
        return job

    # ------------------------------------------------------------------ store

    def _store_job(self, reqs: list[_StoreReq], single: bool) -> IOJob:
        if single:
            r = reqs[0]
            info = {"key": r.raw_key, "first": r.first, "end": r.end, "position": r.position}
            return self.pool.make_job("store", lambda: self._store_units(reqs)[0], info)
        info = {"items": len(reqs), "keys": [r.raw_key for r in reqs]}
        return self.pool.make_job("stores", lambda: batch_outcome(self._store_units(reqs)), info)

    def _submit(self, job: IOJob, counter: str) -> IOJob:
        job = self.pool.submit_job(job)
        if job.refused:
            self._count(counter, max(1, job.info.get("items", 1)))
        return job

    def submit_store(
        self, key: Any, first: int, payload: Any, position: int, *, end: int | None = None
    ) -> IOJob:
        """Queue the store of one unit; never blocks (:meth:`.PageTier.submit_store`).

        Returns
        -------
        IOJob
            ``"ok"`` once stored (or already there: see ``detail``), ``"error"``
            when dropped (server down: ``detail`` starts with ``"dropped"``) or
            refused by the server, or ``"refused"`` at once when the queue is full.
        """
        self._check_open()
        req = self._store_req(StoreItem(key, first, payload, position, end), "item")
        return self._submit(self._store_job([req], True), "stores_refused")

    def store(
        self, key: Any, first: int, payload: Any, position: int, *, end: int | None = None
    ) -> IOJob:
        """:meth:`submit_store`, run in the calling thread; returns the finished job."""
        self._check_open()
        req = self._store_req(StoreItem(key, first, payload, position, end), "item")
        return run_inline(self._store_job([req], True))

    def submit_stores(self, items: Sequence[StoreItem | tuple]) -> IOJob:
        """Queue the store of several units as ONE job: one pipelined round trip.

        Parameters
        ----------
        items : sequence of StoreItem or (key, first, payload, position[, end])
            As :meth:`submit_store`'s arguments.

        Returns
        -------
        IOJob
            Its ``value`` is a list of :class:`JobOutcome`, one per item in
            order (``"ok"`` or ``"error"``); its status is the worst of them
            (``"refused"`` at once when the queue is full).
        """
        self._check_open()
        reqs = [self._store_req(item, f"items[{i}]") for i, item in enumerate(items)]
        return self._submit(self._store_job(reqs, False), "stores_refused")

    def stores(self, items: Sequence[StoreItem | tuple]) -> IOJob:
        """:meth:`submit_stores`, run in the calling thread; returns the finished job."""
        self._check_open()
        reqs = [self._store_req(item, f"items[{i}]") for i, item in enumerate(items)]
        return run_inline(self._store_job(reqs, False))

    # ------------------------------------------------------------------ load

    def _load_job(self, reqs: list[_LoadReq], single: bool) -> IOJob:
        if single:
            r = reqs[0]
            info = {"key": r.raw_key, "first": r.first, "end": r.end}
            return self.pool.make_job("load", lambda: self._load_units(reqs)[0], info)
        info = {"items": len(reqs), "keys": [r.raw_key for r in reqs]}
        return self.pool.make_job("loads", lambda: batch_outcome(self._load_units(reqs)), info)

    def submit_load(self, key: Any, first: int, end: int, destination: Any) -> IOJob:
        """Queue the load of layers ``[first, end)`` of ``key`` into ``destination``
        (:meth:`.PageTier.submit_load`).

        Returns
        -------
        IOJob
            ``"ok"``, ``"miss"`` (absent, evicted, expired, corrupt, or server
            unavailable: see ``detail``) or, at once, ``"refused"``.
        """
        self._check_open()
        req = self._load_req(LoadItem(key, first, end, destination), "item")
        return self._submit(self._load_job([req], True), "loads_refused")

    def load(self, key: Any, first: int, end: int, destination: Any) -> IOJob:
        """:meth:`submit_load`, run in the calling thread; returns the finished job."""
        self._check_open()
        req = self._load_req(LoadItem(key, first, end, destination), "item")
        return run_inline(self._load_job([req], True))

    def submit_loads(self, items: Sequence[LoadItem | tuple]) -> IOJob:
        """Queue the load of several units as ONE job (one round trip when stored as asked).

        Parameters
        ----------
        items : sequence of LoadItem or (key, first, end, destination)

        Returns
        -------
        IOJob
            Its ``value`` is a list of :class:`JobOutcome`, one per item in
            order (``"ok"`` or ``"miss"``); its status is the worst of them.
        """
        self._check_open()
        reqs = [self._load_req(item, f"items[{i}]") for i, item in enumerate(items)]
        return self._submit(self._load_job(reqs, False), "loads_refused")

    def loads(self, items: Sequence[LoadItem | tuple]) -> IOJob:
        """:meth:`submit_loads`, run in the calling thread; returns the finished job."""
        self._check_open()
        reqs = [self._load_req(item, f"items[{i}]") for i, item in enumerate(items)]
        return run_inline(self._load_job(reqs, False))

    # ------------------------------------------------------------------ upkeep

    def metrics(self) -> RedisStoreMetrics:
        """A consistent snapshot of the counters."""
        with self._lock:
            counts = dict(self._counts)
        counts["breaker_opens"] = self._breaker.opens
        counts["breaker_skips"] = self._breaker.skips
        return RedisStoreMetrics(**counts, available=self._breaker.closed)

    @property
    def available(self) -> bool:
        """False while the circuit breaker skips the server."""
        return self._breaker.closed

    def close(self, *, cancel: bool = False) -> None:
        """Finish (or cancel) queued jobs of an owned pool, then close the connections."""
        if self._closed:
            return
        self._closed = True
        if self._own_pool:
            self.pool.close(cancel=cancel)
        self._connection.close()

    def __enter__(self) -> RedisStore:
        return self

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        return f"RedisStore({self.url!r}, {kind}, namespace={self.namespace.hex[:16]}...)"
