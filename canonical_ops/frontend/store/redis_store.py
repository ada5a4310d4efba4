"""A shared tier of canonical units on Redis or Valkey (standalone, TLS, or Cluster).

The values are the very units of the file store (:mod:`.encoding`: header +
payload, XXH3-128 over both); nothing else is ever loaded. Every engine that
shares a server (or cluster) shares the KV of every namespace it knows, across
tensor and pipeline splits, exactly like a shared :class:`~.files.FileStore`
directory, but over the network and with one round trip per batch.

Keys (``P`` = ``key_prefix``, default ``"ckv"``)
-------------------------------------------------
::

    P:v1:{<ns>:<kd>}:<first>-<end>              a unit, or the manifest of a chunked unit
    P:v1:{<ns>:<kd>}:<first>-<end>:<nonce>:<i>  chunk i of the chunked unit whose
                                                 manifest names <nonce>
    P:v1:{<ns>:<kd>}:idx                        index: sorted set of "<first>-<end>"
                                                 members scored by expiry (unix ms, inf)

``<ns>`` is the first 32 hex characters of the namespace digest, ``<kd>`` the
key digest of the file store (:func:`.files.key_digest`: 32 hex characters of
sha256 of the block key's bytes). The ``{...}`` hash tag puts every key of one
block key in one cluster slot, so one block's unit, chunks and index always
live on one node and a pipeline's commands for it arrive in order.

Values and publication
----------------------
A unit of at most ``max_value_bytes`` (default 16 MiB: a Llama-3-8B block of
2 MiB or a DeepSeek-V3 block of 4.3 MiB is one value) is stored as one value
with ``SET key unit NX`` (``PX ttl`` with a TTL): the first writer wins, a
later writer's ``SET`` does nothing, and a reader sees a whole unit or
nothing. A larger unit is *chunked*: the writer draws a random 64-bit nonce,
writes chunk 0 = the unit's header and chunks 1..n = its payload in pieces of
``max_value_bytes`` (each with a pending expiry, ``chunk_pending_s``), then,
in the same pipeline (so after the chunks, on the same node), the *manifest*
``CKVMANI\\0`` + nonce + sizes with ``SET key manifest NX GET``. Only the
writer whose manifest landed keeps its chunks (``PERSIST``, or the TTL); a
loser deletes its own. Readers follow the manifest to that one writer's
chunks: two writers' chunks can never be joined (their nonces differ). A
writer that died before its manifest leaves only chunks that expire; one that
died after it, before keeping its chunks, leaves a manifest whose chunks
expire: a miss for the first reader, which removes it. The chunks
concatenated are byte for byte the unit a single value would hold. (A
manifest damaged in the server is a miss and is removed; the chunks it named
are left to their pending expiry, or to eviction once kept.)

Why 16 MiB: Redis refuses values over 512 MiB (``proto-max-bulk-len``), and
a server is single threaded, so one big value stalls every other client while
it is read and copied (milliseconds per ten MiB); 16 MiB keeps that stall
short and still stores realistic units whole (one round trip per load).

The ``v1`` in every key is the unit format version (:data:`.encoding.FORMAT_VERSION`):
a reader of one format never sees, or deletes as corrupt, units of another.

Reading
-------
Every load verifies the whole unit (header fields against the namespace, key
and layer range, sizes, checksum over header and payload) BEFORE any of its
bytes is copied into the destination. A value that fails (e.g. damaged with
``SETRANGE``) is counted (``corrupt_detected``), deleted (best effort: a
plain ``DEL``, which at worst removes a unit that a writer republished in the
same instant, i.e. causes a later miss) and is a miss, never a load. A unit
evicted by the server (``maxmemory-policy allkeys-lru``) or expired, a
chunked unit missing a chunk, and an index entry naming a vanished unit are
misses too (and cleaned up).

Pipeline splits
---------------
Each store adds ``"<first>-<end>"`` to the block key's index (``ZADD GT``,
score = its expiry) in the same pipeline as the unit, after it. A reader
whose stage owns layers ``[a, b)`` reads the index in its lookup round trip
(with an ``EXISTS`` of its exact unit) and covers ``[a, b)`` with the stored
ranges: the exact unit if present, else greedy longest-first, as the file
store does. A lookup is exact for the reader's own split; a cover from other
splits is taken on the index's word (a unit evicted since is a miss at load
time, which then drops it from the index). A load first tries the exact unit
and reads the index in the same round trip; a cross-split load takes a second
round trip for the covering units (and one more for chunks of chunked ones).

Failures
--------
All I/O runs in the threads of a bounded :class:`.JobPool`; submissions
never block and a full queue is a refused job. Every socket operation has a
timeout (``socket_timeout_s``, ``connect_timeout_s``; a synchronous
:meth:`RedisStore.lookup` uses its own connections with ``lookup_timeout_s``
and no retries); redis-py retries a failed command ``retries`` times with
exponential back-off. After ``breaker_failures`` consecutive failed round
trips a circuit breaker skips the server for ``breaker_backoff_s`` (doubling
up to ``breaker_max_backoff_s``), then lets one operation probe it; the first
success closes it. While the server is down or slow, lookups return 0, loads
are misses and stores are dropped, all counted in :class:`RedisStoreMetrics`;
no exception reaches the caller from a job or a lookup. Wrong credentials
(or an ACL user without the needed commands) at start-up are always a
:class:`RedisStoreError` naming the URL; an unreachable server at start-up is
one too unless ``require_server=False`` (then a warning and the breaker open).

Only commands Valkey also has are used: GET, SET (NX, GET, PX), EXISTS, DEL,
PERSIST, PEXPIRE (NX, GT), ZADD (GT), ZRANGE (BYSCORE), ZREMRANGEBYSCORE and
ZREM; Redis >= 7.0 or Valkey >= 7.2 (SET NX GET needs 7.0).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import re
import secrets
import struct
import threading
import time
import urllib.parse
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ...checks import check_int
from .encoding import (
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    CorruptUnit,
    PayloadVerifier,
    decode_and_verify,
    decode_header,
    encode_header,
    header_length,
    normalize_key,
)
from .files import key_digest
from .jobs import IOJob, JobOutcome, JobPool, run_inline
from .namespace import StoreNamespace
from .tier import TierBase, TierMetrics

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "MANIFEST_MAGIC",
    "LoadItem",
    "RedisStore",
    "RedisStoreError",
    "RedisStoreMetrics",
    "StoreItem",
]

_log = logging.getLogger(__name__)

MANIFEST_MAGIC = b"CKVMANI\x00"
_MANIFEST_VERSION = 1
# magic, version, reserved, chunk_bytes, payload_chunks, unit_length, nonce
_MANIFEST = struct.Struct("<8sHHQIQ8s")
DEFAULT_MAX_VALUE_BYTES = 16 << 20
# Redis's own bulk limit (proto-max-bulk-len); chunks must also hold a whole header.
_MAX_VALUE_LIMIT = 512 << 20
_MIN_VALUE_BYTES = 4096
assert _MIN_VALUE_BYTES >= MAX_HEADER_BYTES
# A manifest may name at most this many payload chunks: a forged one cannot make
# a reader send an unbounded pipeline.
_MAX_CHUNKS = 1 << 16
# Per thread, a store batch's single values are assembled in a reused buffer of up
# to this size (a larger batch uses a fresh one, freed after its round trip).
_SCRATCH_RETAIN_BYTES = 128 << 20
# Rounds of one batched load: exact + index, covering units, their chunks, and
# retries around units that turn out bad; each round resolves or excludes.
_MAX_LOAD_ROUNDS = 16
_RANGE = re.compile(rb"(\d{1,6})-(\d{1,6})")
_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_STATUS_ORDER = {"ok": 0, "miss": 1, "corrupt": 2, "error": 3}
# Server unreachable, slow, or refusing us right now: the breaker counts these.
_UNAVAILABLE = (
    redis.exceptions.ConnectionError,  # includes AuthenticationError, BusyLoadingError
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
    OSError,
)


class RedisStoreError(RuntimeError):
    """A Redis tier that cannot start: bad credentials, permissions, server, or URL."""


class _Unavailable(Exception):
    """A round trip that did not happen (server down, slow, or skipped by the breaker)."""


# ---------------------------------------------------------------------- checks


def _check_seconds(name: str, value: Any, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    what = "a number of seconds > 0" + (" or None" if optional else "")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name}: expected {what}, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    return float(value)


def _check_str(name: str, value: Any, *, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str{' or None' if optional else ''}, got {value!r}")
    return value


def redact_url(url: str) -> str:
    """``url`` with any password (in the authority or the query) replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    netloc = parts.netloc
    if "@" in netloc:
        auth, host = netloc.rsplit("@", 1)
        user = auth.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in auth else f"{auth}@{host}"
    query = parts.query
    if query:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{k}={'***' if k.lower() == 'password' else v}" for k, v in pairs)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


# ---------------------------------------------------------------------- records


@dataclass(frozen=True)
class StoreItem:
    """One unit to store: ``payload`` = layers ``[first, end)`` of ``key`` (see ``submit_store``)."""

    key: Any
    first: int
    payload: Any
    position: int
    end: int | None = None


@dataclass(frozen=True)
class LoadItem:
    """One unit to load: layers ``[first, end)`` of ``key`` into ``destination``."""

    key: Any
    first: int
    end: int
    destination: Any


@dataclass(frozen=True)
class RedisStoreMetrics(TierMetrics):
    """Counters of one :class:`RedisStore` since it started (a snapshot).

    Attributes
    ----------
    (those of :class:`~.tier.TierMetrics`, and:)
    stores_dropped : int
        Stores not done because the server was down, slow, or skipped by the breaker.
    stores_failed : int
        Stores the server refused (e.g. ``OOM`` under ``noeviction``, ``NOPERM``).
    lookups_refused : int
        Lookup jobs refused by back-pressure (queue full) or after close.
    loads_unavailable : int
        Of the misses, those due to the server being down, slow or skipped.
    lookups : int
        Lookup calls.
    lookups_unavailable : int
        Lookups answered 0 because the server was down, slow or skipped.
    lookup_seconds_total, lookup_seconds_max : float
        Wall time of lookups (mean = total / lookups).
    stale_removed : int
        Index entries or manifests naming vanished values (evicted, expired), removed.
    values_deleted : int
        Bad or stale values this store deleted (best effort).
    bytes_sent, bytes_received : int
        Value bytes written to / read from the server (units, chunks, manifests).
    round_trips : int
        Pipelines executed (each one network round trip per node).
    errors : int
        Failed round trips plus error replies of single commands.
    breaker_opens, breaker_skips : int
        Times the circuit breaker opened; round trips skipped while it was open.
    available : bool
        The breaker is closed (the server is believed reachable).
    """

    stores_dropped: int = 0
    loads_unavailable: int = 0
    lookups: int = 0
    lookups_refused: int = 0
    lookups_unavailable: int = 0
    lookup_seconds_total: float = 0.0
    lookup_seconds_max: float = 0.0
    stale_removed: int = 0
    values_deleted: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    round_trips: int = 0
    errors: int = 0
    breaker_opens: int = 0
    breaker_skips: int = 0
    available: bool = True


_COUNTERS = tuple(f.name for f in fields(RedisStoreMetrics) if f.name != "available")


class _Breaker:
    """Consecutive-failure circuit breaker with exponential back-off and single probes."""

    def __init__(self, threshold: int, backoff_s: float, max_backoff_s: float) -> None:
        self.threshold = threshold
        self.base = backoff_s
        self.cap = max_backoff_s
        self._lock = threading.Lock()
        self._failures = 0
        self._open = False
        self._until = 0.0
        self._backoff = backoff_s
        self._probe_since: float | None = None
        self.opens = 0
        self.skips = 0

    def allow(self) -> bool:
        """Whether a round trip may go to the server now (one probe at a time when open)."""
        with self._lock:
            if not self._open:
                return True
            now = time.monotonic()
            # A probe that never reported back (its job was dropped) frees the slot later.
            stuck = self._probe_since is not None and now - self._probe_since > self.cap
            if now >= self._until and (self._probe_since is None or stuck):
                self._probe_since = now
                return True
            self.skips += 1
            return False

    def success(self) -> bool:
        """The server answered; True when this closes an open breaker."""
        with self._lock:
            was_open = self._open
            self._failures = 0
            self._open = False
            self._probe_since = None
            self._backoff = self.base
            return was_open

    def failure(self) -> bool:
        """A round trip failed; True when this opens the breaker."""
        with self._lock:
            self._failures += 1
            probing = self._probe_since is not None
            opened = False
            if probing or self._failures >= self.threshold:
                if probing:  # the server is still away: wait longer before the next probe
                    self._backoff = min(self._backoff * 2, self.cap)
                opened = not self._open
                self.opens += opened
                self._open = True
                self._until = time.monotonic() + self._backoff
                self._probe_since = None
            return opened

    @property
    def backoff(self) -> float:
        return self._backoff

    def force_open(self) -> None:
        with self._lock:
            self._failures = max(self._failures, self.threshold)
            self.opens += not self._open
            self._open = True
            self._until = time.monotonic() + self._backoff

    @property
    def closed(self) -> bool:
        with self._lock:
            return not self._open


class _Op:
    """One command of a pipeline: redis-py method, arguments, and value bytes it moves."""

    __slots__ = ("args", "kwargs", "name", "size")

    def __init__(self, name: str, *args: Any, size: int = 0, **kwargs: Any) -> None:
        self.name, self.args, self.kwargs, self.size = name, args, kwargs, size


class _Parts:
    """One bulk-string argument given as consecutive buffers (a unit's header, then its
    payload), sent one after the other: the value is never joined into one copy."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: Any) -> None:
        self.parts = parts
        self.nbytes = sum(len(part) for part in parts)

    def __len__(self) -> int:
        return self.nbytes


class _PartsPacker:
    """A redis-py command packer (its ``command_packer=`` option) that knows :class:`_Parts`.

    RESP frames a bulk string by its length, so its bytes may leave in several
    ``sendall`` calls; redis-py's own packer only takes one buffer per argument,
    which would cost a copy of every unit (measured: a third of a SET's time on a
    busy host). Commands without :class:`_Parts` go to redis-py's packer unchanged.
    """

    def __init__(self) -> None:
        encoder = redis.connection.Encoder("utf-8", "strict", False)
        self._encode = encoder.encode
        self._plain = redis.connection.PythonRespSerializer(6000, encoder.encode)

    def pack(self, *args: Any) -> list[Any]:
        if not any(isinstance(arg, _Parts) for arg in args):
            return self._plain.pack(*args)
        out: list[Any] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, _Parts):
                out.append(b"$%d\r\n" % arg.nbytes)
                out.extend(arg.parts)
                out.append(b"\r\n")
            else:
                data = self._encode(arg)
                out.append(b"$%d\r\n" % len(data))
                out.append(data)
                out.append(b"\r\n")
        return out


_PACKER = _PartsPacker()


class _StoreReq:
    __slots__ = ("end", "first", "kd", "payload", "position", "raw_key")

    def __init__(self, raw_key: bytes, first: int, end: int, position: int, payload: memoryview):
        self.raw_key, self.first, self.end = raw_key, first, end
        self.position, self.payload = position, payload
        self.kd = _digest(raw_key)


class _LoadReq:
    __slots__ = ("dest", "end", "first", "kd", "raw_key")

    def __init__(self, raw_key: bytes, first: int, end: int, dest: memoryview):
        self.raw_key, self.first, self.end, self.dest = raw_key, first, end, dest
        self.kd = _digest(raw_key)


class _Publish:
    """How one store request is published: where its replies start, its chunks."""

    __slots__ = ("at", "chunks", "manifest", "req", "sent")

    def __init__(self, req: _StoreReq, at: int) -> None:
        self.req, self.at = req, at
        self.chunks: list[str] = []
        self.manifest: bytes | None = None
        self.sent = 0


class _Manifest:
    __slots__ = ("chunk_bytes", "nonce", "payload_chunks")

    def __init__(self, nonce: bytes, chunk_bytes: int, payload_chunks: int) -> None:
        self.nonce, self.chunk_bytes, self.payload_chunks = nonce, chunk_bytes, payload_chunks


class _Load:
    """One item of a batched load while its rounds run."""

    __slots__ = ("done", "excluded", "manifests", "outcome", "problems", "ranges", "req")

    def __init__(self, req: _LoadReq) -> None:
        self.req = req
        self.ranges: set[tuple[int, int]] = set()
        self.excluded: set[tuple[int, int]] = set()
        self.done: set[tuple[int, int]] = set()
        self.manifests: dict[tuple[int, int], _Manifest] = {}
        self.problems: list[str] = []
        self.outcome: JobOutcome | None = None


def _digest(raw_key: bytes) -> str:
    """:func:`.files.key_digest` of an already normalized key (skips normalizing again)."""
    return hashlib.sha256(raw_key).hexdigest()[:32]


def _get(key: str, size: int) -> _Op:
    # execute_command: the hot commands skip redis-py's per-method argument handling.
    return _Op("execute_command", "GET", key, size=size)


def _zrange(index: str, now_ms: float) -> _Op:
    """The index's ranges whose units have not expired (score = expiry, unix ms)."""
    return _Op("execute_command", "ZRANGE", index, f"{now_ms:.0f}", "+inf", "BYSCORE")


def _deletes(keys: Sequence[str]) -> list[_Op]:
    """One DEL per key: a cluster pipeline refuses multi-key DEL (even within one slot)."""
    return [_Op("delete", key) for key in keys]


def _cover(ranges: set[tuple[int, int]], first: int, end: int) -> list[tuple[int, int]] | None:
    """Ranges covering ``[first, end)``: the exact one if present, else greedy longest-first."""
    if (first, end) in ranges:
        return [(first, end)]
    chain, position = [], first
    while position < end:
        best = None
        for a, b in ranges:
            if a <= position < b and (best is None or b > best[1]):
                best = (a, b)
        if best is None:
            return None
        chain.append(best)
        position = best[1]
    return chain


def _copy_range(parts: Sequence[memoryview], start: int, stop: int, target: memoryview) -> None:
    """Copy bytes ``[start, stop)`` of the concatenation of ``parts`` into ``target``."""
    position = written = 0
    for part in parts:
        size = len(part)
        if position + size > start and position < stop:
            lo, hi = max(start - position, 0), min(stop - position, size)
            target[written : written + hi - lo] = part[lo:hi]
            written += hi - lo
        position += size
        if position >= stop:
            break


def _worst(outcomes: Sequence[JobOutcome]) -> str:
    return max((o.status for o in outcomes), key=_STATUS_ORDER.__getitem__, default="ok")


def _chain_errors(error: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


# ---------------------------------------------------------------------- the store


class RedisStore(TierBase):
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
        scheme = self._check_url(url)
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

        self._options = self._client_options(
            url, scheme, username, password, db, ssl_ca_certs, ssl_certfile, ssl_keyfile,
            client_kwargs,
        )  # fmt: skip
        self._key_base = f"{key_prefix}:v{FORMAT_VERSION}:{{{namespace.hex[:32]}:"
        self._init_base()
        self._counts: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)
        self._counts["lookup_seconds_total"] = 0.0
        self._counts["lookup_seconds_max"] = 0.0
        self._breaker = _Breaker(breaker_failures, backoff, max_backoff)
        self._client_lock = threading.Lock()
        self._tls = threading.local()
        # Our packer rides on the connections the store creates; a cluster client
        # creates its nodes' own, so there a unit is joined into one buffer first.
        self._zero_copy = not self.cluster
        self._known_ranges: dict[bytes, tuple[int, int]] = {}
        self._client: Any = None
        self._lookup_client: Any = None
        try:
            self._start(bool(require_server))
        except BaseException:
            self._close_clients()
            raise
        # The pool last: a failed start-up leaves no threads behind.
        self._attach_pool(pool, threads, queue_depth, "ckv-redis")

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def _check_url(url: Any) -> str:
        if not isinstance(url, str):
            raise TypeError(f"url: expected a redis://, rediss:// or unix:// URL str, got {url!r}")
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in _SCHEMES:
            raise ValueError(
                f"url: expected a URL with scheme {', '.join(s + '://' for s in _SCHEMES)}; "
                f"got {redact_url(url)!r}"
            )
        return scheme

    def _client_options(
        self,
        url: str,
        scheme: str,
        username: str | None,
        password: str | None,
        db: int | None,
        ssl_ca_certs: str | None,
        ssl_certfile: str | None,
        ssl_keyfile: str | None,
        client_kwargs: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """redis-py keyword arguments: the URL's, then the explicit arguments over them."""
        plain = scheme.replace("+cluster", "") + url[len(scheme) :]
        try:
            options = redis.connection.parse_url(plain)
        except ValueError as error:
            raise ValueError(f"url: {error} (in {redact_url(url)!r})") from None
        tls = scheme.startswith("rediss")
        options.pop("connection_class", None)
        if scheme == "unix":
            options["connection_class"] = redis.connection.UnixDomainSocketConnection
        if username is not None:
            options["username"] = username
        if password is not None:
            options["password"] = password
        if db is not None:
            options["db"] = db
        if self.cluster:
            if options.pop("db", 0) not in (0, None):
                raise ValueError("db: expected 0 (or none) with a Redis Cluster, which has one db")
            options["ssl"] = tls
        elif tls:
            options["connection_class"] = redis.connection.SSLConnection
        for name, value in (
            ("ssl_ca_certs", ssl_ca_certs),
            ("ssl_certfile", ssl_certfile),
            ("ssl_keyfile", ssl_keyfile),
        ):
            if value is not None:
                if not tls:
                    raise ValueError(f"{name}: TLS files need a rediss:// URL, got {self.url!r}")
                options[name] = value
        if scheme != "unix":
            options.setdefault("host", "localhost")
            options["socket_keepalive"] = True
        options["socket_connect_timeout"] = self.connect_timeout_s
        # Bigger reads than redis-py's 64 KiB: units are megabytes.
        options["socket_read_size"] = 1 << 20
        options.update(client_kwargs or {})
        if options.get("decode_responses"):
            raise ValueError("client_kwargs: decode_responses must stay False (values are bytes)")
        return options

    def _new_client(self, *, lookup: bool) -> Any:
        options = dict(self._options)
        timeout = self.lookup_timeout_s if lookup else self.socket_timeout_s
        options.setdefault("socket_timeout", timeout)
        retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), 0 if lookup else self.retries)
        if self.cluster:
            options.pop("connection_class", None)
            return redis.RedisCluster(retry=retry, require_full_coverage=True, **options)
        options["retry"] = retry
        options["command_packer"] = _PACKER
        connection_class = options.pop("connection_class", redis.connection.Connection)
        pool = redis.ConnectionPool(connection_class=connection_class, **options)
        return redis.Redis(connection_pool=pool)

    def _clients(self) -> tuple[Any, Any]:
        """(data client, lookup client), created on first use (a cluster connects then)."""
        with self._client_lock:
            if self._client is None:
                client = self._new_client(lookup=False)
                try:
                    lookup = self._new_client(lookup=True)
                except BaseException:
                    client.close()
                    raise
                self._client, self._lookup_client = client, lookup
            return self._client, self._lookup_client

    def _start(self, require_server: bool) -> None:
        """Connect, authenticate and check the commands this tier uses (one probe pipeline)."""
        probe = f"{self._key_base}probe}}:{secrets.token_hex(8)}"
        # The value goes out the way units do (in two pieces, or joined) and must read back.
        value = _Parts(b"ck", memoryview(b"v-")) if self._zero_copy else b"ckv-"
        ops = [
            _Op("set", probe, value, nx=True, get=True, px=10_000),
            _Op("get", probe),
            _Op("exists", probe),
            _Op("zadd", probe + ":idx", {b"0-1": math.inf}, gt=True),
            _Op("zrange", probe + ":idx", 0, "+inf", byscore=True),
            _Op("pexpire", probe + ":idx", 10_000, nx=True),
            *_deletes([probe, probe + ":idx"]),
        ]
        try:
            client, _ = self._clients()
            results = self._pipeline(client, ops)
        except Exception as error:
            chain = _chain_errors(error)
            if any(isinstance(e, redis.exceptions.AuthenticationError) for e in chain):
                raise RedisStoreError(
                    f"url: authentication failed at {self.url!r} (wrong password or unknown "
                    f"user): {error}"
                ) from error
            if isinstance(error, redis.RedisError) and not isinstance(error, _UNAVAILABLE):
                raise RedisStoreError(
                    f"url: the server at {self.url!r} refused the start-up probe: {error}"
                ) from error
            if not isinstance(error, _UNAVAILABLE):
                raise
            if require_server:
                raise RedisStoreError(
                    f"url: no Redis server reachable at {self.url!r}: {error} "
                    "(require_server=False starts degraded and probes later)"
                ) from error
            warnings.warn(
                f"RedisStore: no server reachable at {self.url!r} ({error}); starting with the "
                "tier off (misses, dropped stores) and probing it again later",
                RuntimeWarning,
                stacklevel=3,
            )
            self._breaker.force_open()
            return
        if not any(isinstance(r, Exception) for r in results) and results[1] != b"ckv-":
            raise RedisStoreError(  # a redis-py that packs commands differently
                f"url: a value written to {self.url!r} read back as {results[1]!r}"
            )
        for result in results:
            if isinstance(result, redis.exceptions.NoPermissionError):
                raise RedisStoreError(
                    f"url: the user of {self.url!r} may not run the commands this tier needs "
                    f"(GET SET EXISTS DEL PERSIST PEXPIRE ZADD ZRANGE ZREMRANGEBYSCORE ZREM on keys "
                    f"{self._key_base.split(':{')[0]}:*): {result}"
                )
            if isinstance(result, redis.exceptions.AuthenticationError):
                raise RedisStoreError(f"url: authentication failed at {self.url!r}: {result}")
            if isinstance(result, Exception):
                raise RedisStoreError(
                    f"url: the server at {self.url!r} refused a command this tier needs "
                    f"(Redis >= 7.0 or Valkey >= 7.2 required): {result}"
                )

    # ------------------------------------------------------------------ keys

    def _tag(self, kd: str) -> str:
        return f"{self._key_base}{kd}}}"

    def unit_key(self, key: Any, first: int, end: int) -> str:
        """The server key of ``key``'s unit (or manifest) of layers ``[first, end)``."""
        first, end = self._range(first, end)
        return f"{self._tag(key_digest(normalize_key(key)))}:{first}-{end}"

    def index_key(self, key: Any) -> str:
        """The server key of ``key``'s index of stored layer ranges (a sorted set)."""
        return f"{self._tag(key_digest(normalize_key(key)))}:idx"

    def chunk_keys(self, key: Any, first: int, end: int, nonce: bytes, count: int) -> list[str]:
        """The server keys of chunks 0..count-1 of a chunked unit whose manifest names ``nonce``."""
        base = self.unit_key(key, first, end)
        return [f"{base}:{nonce.hex()}:{i}" for i in range(count)]

    def _unit_key(self, kd: str, first: int, end: int) -> str:
        return f"{self._tag(kd)}:{first}-{end}"

    def _chunk_keys(self, kd: str, first: int, end: int, nonce: bytes, count: int) -> list[str]:
        base = f"{self._tag(kd)}:{first}-{end}:{nonce.hex()}:"
        return [f"{base}{i}" for i in range(count)]

    def _index_key(self, kd: str) -> str:
        return f"{self._tag(kd)}:idx"

    def _parse_ranges(self, members: Any) -> set[tuple[int, int]]:
        """Index members as layer ranges; anything malformed is ignored (never trusted)."""
        out = set()
        if not isinstance(members, (list, tuple)):
            return out
        known = self._known_ranges
        for member in members:
            rng = known.get(member)
            if rng is None:
                if not isinstance(member, bytes):
                    continue
                match = _RANGE.fullmatch(member)
                if match is None:
                    continue
                first, end = int(match[1]), int(match[2])
                if not 0 <= first < end <= self.namespace.num_layers:
                    continue
                rng = (first, end)
                if len(known) < 4096:  # the few splits a deployment uses
                    known[member] = rng
            out.add(rng)
        return out

    # ------------------------------------------------------------------ round trips

    def _pipeline(self, client: Any, ops: Sequence[_Op]) -> list[Any]:
        """Send ``ops`` as pipelines of at most ``max_pipeline_bytes``; replies in order.

        Error replies of single commands are returned in place; a failed round trip
        raises (the caller decides what it means).
        """
        results: list[Any] = []
        start = 0
        while start < len(ops):
            stop, size = start, 0
            while stop < len(ops) and (
                stop == start or size + ops[stop].size <= self.max_pipeline_bytes
            ):
                size += ops[stop].size
                stop += 1
            pipe = client.pipeline(transaction=False)
            for op in ops[start:stop]:
                getattr(pipe, op.name)(*op.args, **op.kwargs)
            replies = pipe.execute(raise_on_error=False)
            self._count("round_trips")
            for reply in replies:
                if isinstance(reply, _UNAVAILABLE):
                    raise reply
            results.extend(replies)
            start = stop
        return results

    def _roundtrip(self, ops: Sequence[_Op], *, lookup: bool = False) -> list[Any]:
        """:meth:`_pipeline` through the breaker; raises :class:`_Unavailable` on failure."""
        if not ops:
            return []
        if not self._breaker.allow():
            raise _Unavailable("server skipped (circuit breaker open after failures)")
        try:
            data, fast = self._clients()
            results = self._pipeline(fast if lookup else data, ops)
        except _UNAVAILABLE as error:
            self._count("errors")
            if self._breaker.failure():
                _log.warning(
                    "RedisStore %s unavailable (%s: %s): skipping it, probing again in %.1f s "
                    "(lookups 0, loads miss, stores dropped meanwhile)",
                    self.url, type(error).__name__, error, self._breaker.backoff,
                )  # fmt: skip
            raise _Unavailable(f"{type(error).__name__}: {error}") from error
        except redis.RedisError as error:  # a reply we cannot use for the whole pipeline
            self._count("errors")
            self._recovered()  # the server answered
            raise _Unavailable(f"{type(error).__name__}: {error}") from error
        self._recovered()
        errors = sum(isinstance(r, Exception) for r in results)
        if errors:
            self._count("errors", errors)
        return results

    def _recovered(self) -> None:
        if self._breaker.success():
            _log.warning("RedisStore %s reachable again", self.url)

    def _cleanup(self, ops: list[_Op], deleted: int) -> None:
        """Best-effort removal of bad or stale values (one round trip, errors ignored)."""
        if not ops:
            return
        try:
            self._roundtrip(ops)
        except _Unavailable:
            return
        self._count("values_deleted", deleted)

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
            # Per key: its index, and whether the exact unit is there. The index may still
            # list a unit the server evicted; for the common case (the same split) the
            # EXISTS makes the answer exact. Covers from other splits are not checked.
            now_ms = time.time() * 1000.0
            ops = []
            for raw in raws:
                kd = _digest(raw)
                ops.append(_zrange(self._index_key(kd), now_ms))
                ops.append(_Op("execute_command", "EXISTS", self._unit_key(kd, first, end)))
            try:
                replies = self._roundtrip(ops, lookup=lookup)
            except _Unavailable:
                unavailable = True
                replies = []
            for members, exists in zip(replies[0::2], replies[1::2]):
                if isinstance(members, Exception) or isinstance(exists, Exception):
                    break
                ranges = self._parse_ranges(members)
                if exists:
                    ranges.add((first, end))
                else:
                    ranges.discard((first, end))
                if _cover(ranges, first, end) is None:
                    break
                found += 1
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
        return self.pool.make_job("stores", lambda: self._batch(self._store_units(reqs)), info)

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

    @staticmethod
    def _batch(outcomes: list[JobOutcome]) -> JobOutcome:
        counts: dict[str, int] = {}
        for outcome in outcomes:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
        return JobOutcome(
            _worst(outcomes),
            nbytes=sum(o.nbytes for o in outcomes),
            detail=", ".join(f"{n} {status}" for status, n in sorted(counts.items())),
            value=outcomes,
        )

    def _scratch(self, nbytes: int) -> memoryview:
        """This thread's buffer for the single values of one batch (reused: no page faults).

        A value must be one bulk string, so header and payload are copied together
        once; into fresh memory that copy costs page faults worth half the SET
        itself, so each thread keeps its buffer (up to ``_SCRATCH_RETAIN_BYTES``).
        Only valid until the thread's next store call: the round trip is over then.
        """
        buffer = getattr(self._tls, "scratch", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = np.empty(nbytes, dtype=np.uint8)
            if nbytes <= _SCRATCH_RETAIN_BYTES:
                self._tls.scratch = buffer
        return memoryview(buffer)[:nbytes]

    def _plan_store(
        self,
        req: _StoreReq,
        ops: list[_Op],
        index_ops: list[_Op],
        ttl_ms: int | None,
        scratch: memoryview,
    ) -> tuple[_Publish, memoryview]:
        """Append the commands publishing ``req`` to ``ops``, its index's to ``index_ops``.

        Returns the plan and what is left of ``scratch`` (the single value's bytes).
        """
        key = self._unit_key(req.kd, req.first, req.end)
        head = header_length(req.raw_key)
        total = head + len(req.payload)
        plan = _Publish(req, len(ops))
        if total <= self.max_value_bytes and self._zero_copy:
            header = encode_header(
                self.namespace, req.raw_key, req.first, req.end, req.position, req.payload
            )
            value = _Parts(header, req.payload)
            ops.append(_Op("set", key, value, nx=True, px=ttl_ms, size=total))
            plan.sent = total
        elif total <= self.max_value_bytes:
            # Copy first, then hash the copy (still in cache): the checksum covers
            # exactly the bytes sent.
            value, scratch = scratch[:total], scratch[total:]
            value[head:] = req.payload
            value[:head] = encode_header(
                self.namespace, req.raw_key, req.first, req.end, req.position, value[head:]
            )
            ops.append(_Op("set", key, value, nx=True, px=ttl_ms, size=total))
            plan.sent = total
        else:
            header = encode_header(
                self.namespace, req.raw_key, req.first, req.end, req.position, req.payload
            )
            # Chunk 0 is the header, then the payload in place (no copy): the chunks
            # concatenated are the unit. They wait with a pending expiry until the
            # manifest naming their nonce is known to be the one published.
            step = self.max_value_bytes
            pieces = [memoryview(header)]
            pieces += [req.payload[i : i + step] for i in range(0, len(req.payload), step)]
            nonce = secrets.token_bytes(8)
            plan.chunks = self._chunk_keys(req.kd, req.first, req.end, nonce, len(pieces))
            pending_ms = max(1, int(self.chunk_pending_s * 1000))
            if ttl_ms is not None:
                pending_ms = min(pending_ms, ttl_ms)
            for chunk_key, piece in zip(plan.chunks, pieces):
                ops.append(_Op("set", chunk_key, piece, px=pending_ms, size=len(piece)))
            plan.manifest = _MANIFEST.pack(
                MANIFEST_MAGIC, _MANIFEST_VERSION, 0, step, len(pieces) - 1, total, nonce
            )
            size = len(plan.manifest)
            ops.append(_Op("set", key, plan.manifest, nx=True, get=True, px=ttl_ms, size=size))
            plan.sent = total + size
        # The index is sent after every unit of the batch (same connection, or same
        # node: in order), so a reader that finds a range listed finds its unit unless
        # evicted since; and small commands do not sit between big values (measurably
        # slower for the server). Score = the unit's expiry: lookups skip expired ranges.
        index = self._index_key(req.kd)
        member = f"{req.first}-{req.end}".encode()
        now_ms = time.time() * 1000.0
        expiry = math.inf if ttl_ms is None else now_ms + ttl_ms
        index_ops.append(_Op("zadd", index, {member: expiry}, gt=True))
        index_ops.append(_Op("zremrangebyscore", index, "-inf", f"({now_ms:.0f}"))
        if ttl_ms is None:
            index_ops.append(_Op("persist", index))
        else:  # NX: a new index gets the TTL; GT: an existing one only ever lives longer
            index_ops.append(_Op("pexpire", index, ttl_ms, nx=True))
            index_ops.append(_Op("pexpire", index, ttl_ms, gt=True))
        return plan, scratch

    def _store_units(self, reqs: list[_StoreReq]) -> list[JobOutcome]:
        """Publish ``reqs``: one round trip, and a second one only for chunked units."""
        ttl_ms = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        ops: list[_Op] = []
        index_ops: list[_Op] = []
        single = [
            header_length(r.raw_key) + len(r.payload)
            for r in reqs
            if header_length(r.raw_key) + len(r.payload) <= self.max_value_bytes
        ]
        scratch = self._scratch(0 if self._zero_copy else sum(single))
        plans = []
        for req in reqs:
            plan, scratch = self._plan_store(req, ops, index_ops, ttl_ms, scratch)
            plans.append(plan)
        try:
            replies = self._roundtrip(ops + index_ops)
        except _Unavailable as why:
            self._count("stores_dropped", len(reqs))
            return [JobOutcome("error", detail=f"dropped: {why}") for _ in reqs]
        self._count("bytes_sent", sum(plan.sent for plan in plans))
        outcomes = [self._store_outcome(plan, replies) for plan in plans]
        if any(plan.chunks for plan in plans):
            self._settle_chunks(plans, outcomes, ttl_ms)
        for outcome in outcomes:
            if outcome.status == "ok" and outcome.nbytes:
                self._count("units_stored")
                self._count("bytes_stored", outcome.nbytes)
            elif outcome.status == "ok":
                self._count("stores_skipped")
            elif outcome.detail.startswith("dropped"):
                self._count("stores_dropped")
            else:
                self._count("stores_failed")
        return outcomes

    @staticmethod
    def _store_outcome(plan: _Publish, replies: list[Any]) -> JobOutcome:
        """What the first round trip's replies say about ``plan``."""
        at, n = plan.at, len(plan.chunks)
        mine = replies[at : at + n + 1]  # chunk SETs, then the unit's (or manifest's) SET
        error = next((r for r in mine if isinstance(r, Exception)), None)
        if error is not None:  # e.g. OOM under noeviction, NOPERM
            return JobOutcome("error", detail=f"refused by the server: {error}", error=error)
        reply = mine[-1]
        # SET NX: OK, or nil when the key exists. SET NX GET (manifests): nil when we set
        # it, or our own manifest back when redis-py retried a SET that had landed.
        won = bool(reply) if plan.manifest is None else reply is None or reply == plan.manifest
        if won:
            return JobOutcome("ok", nbytes=len(plan.req.payload))
        return JobOutcome("ok", detail="already stored (another writer first)")

    def _settle_chunks(
        self, plans: list[_Publish], outcomes: list[JobOutcome], ttl_ms: int | None
    ) -> None:
        """Keep the chunks of published manifests, delete the others (second round trip)."""
        ops: list[_Op] = []
        kept: list[tuple[int, int]] = []  # (plan index, first reply of its chunks)
        for i, (plan, outcome) in enumerate(zip(plans, outcomes)):
            if not plan.chunks:
                continue
            if outcome.status == "ok" and outcome.nbytes:
                kept.append((i, len(ops)))
                for chunk in plan.chunks:
                    if ttl_ms is None:
                        ops.append(_Op("persist", chunk))
                    else:
                        ops.append(_Op("pexpire", chunk, ttl_ms))
            else:  # a loser's (or refused writer's) chunks are of no use to anyone
                ops += _deletes(plan.chunks)
        try:
            replies = self._roundtrip(ops)
        except _Unavailable as why:
            # The manifest stays, its chunks expire: a later load sees a miss and cleans up.
            for i, _ in kept:
                outcomes[i] = JobOutcome("error", detail=f"dropped: {why}")
            return
        for i, at in kept:
            plan = plans[i]
            if all(r is True or r == 1 for r in replies[at : at + len(plan.chunks)]):
                continue
            # A chunk expired (or was evicted) before it was kept: withdraw the manifest.
            req = plan.req
            outcomes[i] = JobOutcome(
                "error", detail="dropped: a chunk expired or was evicted before publication"
            )
            unit_key = self._unit_key(req.kd, req.first, req.end)
            self._cleanup(_deletes([unit_key, *plan.chunks]), 1)

    # ------------------------------------------------------------------ load

    def _load_job(self, reqs: list[_LoadReq], single: bool) -> IOJob:
        if single:
            r = reqs[0]
            info = {"key": r.raw_key, "first": r.first, "end": r.end}
            return self.pool.make_job("load", lambda: self._load_units(reqs)[0], info)
        info = {"items": len(reqs), "keys": [r.raw_key for r in reqs]}
        return self.pool.make_job("loads", lambda: self._batch(self._load_units(reqs)), info)

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

    def _load_units(self, reqs: list[_LoadReq]) -> list[JobOutcome]:
        loads = [_Load(req) for req in reqs]
        cleanup: list[_Op] = []
        deleted = 0
        ns = self.namespace
        unavailable: str | None = None

        def exclude(
            ld: _Load, rng: tuple[int, int], why: str, delete: list[str], unindex: bool = True
        ) -> None:
            """Never use ``rng`` for this item again; forget it on the server (best effort)."""
            nonlocal deleted
            ld.excluded.add(rng)
            ld.problems.append(f"{rng[0]}-{rng[1]} {why}")
            if unindex:
                member = f"{rng[0]}-{rng[1]}".encode()
                cleanup.append(_Op("zrem", self._index_key(ld.req.kd), member))
            if delete:
                cleanup.extend(_deletes(delete))
                deleted += 1

        def place(ld: _Load, rng: tuple[int, int], parts: Sequence[memoryview]) -> None:
            """Copy the verified unit ``rng``'s layers inside the request into its destination."""
            req = ld.req
            a, b = rng
            lo, hi = max(a, req.first), min(b, req.end)
            src = ns.payload_offsets(a, b)
            dst = ns.payload_offsets(req.first, req.end)
            target = req.dest[dst[lo - req.first] : dst[hi - req.first]]
            _copy_range(parts, src[lo - a], src[hi - a], target)
            ld.done.add(rng)
            self._count("units_loaded")

        def on_value(ld: _Load, rng: tuple[int, int], value: Any) -> None:
            key = self._unit_key(ld.req.kd, *rng)
            if value is None:
                self._count("stale_removed")
                exclude(ld, rng, "vanished (evicted or expired)", [])
                return
            if isinstance(value, Exception):
                exclude(ld, rng, f"unreadable: {value}", [], unindex=False)
                return
            self._count("bytes_received", len(value))
            head = bytes(value[:8])
            try:
                if head == MAGIC:
                    _, payload = decode_and_verify(
                        value, namespace=ns, key=ld.req.raw_key, first=rng[0], end=rng[1]
                    )
                    place(ld, rng, [payload])
                    return
                if head == MANIFEST_MAGIC:
                    ld.manifests[rng] = self._parse_manifest(ld.req.raw_key, rng, value)
                    return
                raise CorruptUnit(f"unknown value (starts {head!r})")
            except CorruptUnit as bad:
                self._count("corrupt_detected")
                exclude(ld, rng, f"corrupt: {bad.reason}", [key])

        def on_chunks(ld: _Load, rng: tuple[int, int], values: list[Any]) -> None:
            manifest = ld.manifests.pop(rng)
            keys = self._chunk_keys(ld.req.kd, *rng, manifest.nonce, manifest.payload_chunks + 1)
            unit_key = self._unit_key(ld.req.kd, *rng)
            if any(v is None or isinstance(v, Exception) for v in values):
                self._count("stale_removed")
                exclude(ld, rng, "chunk vanished (evicted or expired)", [unit_key, *keys])
                return
            self._count("bytes_received", sum(len(v) for v in values))
            try:
                parts = self._verify_chunks(ld.req.raw_key, rng, manifest, values)
            except CorruptUnit as bad:
                self._count("corrupt_detected")
                exclude(ld, rng, f"corrupt: {bad.reason}", [unit_key, *keys])
                return
            place(ld, rng, parts)

        try:
            # Round 1: the exact unit (the common case: same split) and the index, per item.
            now_ms = time.time() * 1000.0
            ops = []
            for ld in loads:
                r = ld.req
                size = header_length(r.raw_key) + len(r.dest)
                ops.append(_get(self._unit_key(r.kd, r.first, r.end), size))
                ops.append(_zrange(self._index_key(r.kd), now_ms))
            replies = self._roundtrip(ops)
            for i, ld in enumerate(loads):
                exact = (ld.req.first, ld.req.end)
                value, members = replies[2 * i], replies[2 * i + 1]
                ld.ranges = self._parse_ranges(members)
                if value is not None:
                    ld.ranges.add(exact)
                    on_value(ld, exact, value)
                elif exact in ld.ranges:
                    self._count("stale_removed")
                    exclude(ld, exact, "vanished (evicted or expired)", [])
            # Later rounds: covering units of other splits, chunks of chunked units.
            for _round in range(_MAX_LOAD_ROUNDS):
                ops, handlers = [], []
                for ld in loads:
                    if ld.outcome is not None:
                        continue
                    r = ld.req
                    chain = _cover(ld.ranges - ld.excluded, r.first, r.end)
                    if chain is None:
                        ld.outcome = JobOutcome(
                            "miss", detail="; ".join(ld.problems) or "not stored"
                        )
                        continue
                    todo = [rng for rng in chain if rng not in ld.done]
                    if not todo:
                        ld.outcome = JobOutcome(
                            "ok", nbytes=len(r.dest), detail="; ".join(ld.problems)
                        )
                        continue
                    for rng in todo:
                        manifest = ld.manifests.get(rng)
                        if manifest is None:
                            size = header_length(r.raw_key) + ns.layer_bytes(*rng)
                            ops.append(_get(self._unit_key(r.kd, *rng), size))
                            handlers.append((ld, rng, "unit", 1))
                        else:
                            keys = self._chunk_keys(
                                r.kd, *rng, manifest.nonce, manifest.payload_chunks + 1
                            )
                            ops += [_get(k, manifest.chunk_bytes) for k in keys]
                            handlers.append((ld, rng, "chunks", len(keys)))
                if not ops:
                    break
                replies = self._roundtrip(ops)
                position = 0
                for ld, rng, kind, count in handlers:
                    if kind == "chunks":
                        on_chunks(ld, rng, replies[position : position + count])
                    else:
                        on_value(ld, rng, replies[position])
                    position += count
        except _Unavailable as why:
            unavailable = str(why)

        outcomes = []
        for ld in loads:
            outcome = ld.outcome
            if outcome is None:
                detail = (
                    f"unavailable: {unavailable}" if unavailable else "gave up (too many rounds)"
                )
                outcome = JobOutcome("miss", detail=detail)
                if unavailable:
                    self._count("loads_unavailable")
            if outcome.status == "ok":
                self._count("hits")
                self._count("bytes_loaded", outcome.nbytes)
            else:
                self._count("misses")
            outcomes.append(outcome)
        if unavailable is None:
            self._cleanup(cleanup, deleted)
        return outcomes

    def _parse_manifest(self, raw_key: bytes, rng: tuple[int, int], value: Any) -> _Manifest:
        """A manifest's fields, each bounded by what the namespace says the unit must be."""
        if len(value) != _MANIFEST.size:
            raise CorruptUnit(f"manifest of {len(value)} bytes, expected {_MANIFEST.size}")
        _magic, version, reserved, chunk_bytes, chunks, unit_length, nonce = _MANIFEST.unpack(value)
        if version != _MANIFEST_VERSION or reserved:
            raise CorruptUnit(f"manifest version {version} / flags {reserved} unknown")
        payload = self.namespace.layer_bytes(*rng)
        if unit_length != header_length(raw_key) + payload:
            raise CorruptUnit(f"manifest unit length {unit_length} is not this unit's")
        if not _MIN_VALUE_BYTES <= chunk_bytes <= _MAX_VALUE_LIMIT:
            raise CorruptUnit(f"manifest chunk size {chunk_bytes} out of range")
        if chunks != -(-payload // chunk_bytes) or chunks > _MAX_CHUNKS:
            raise CorruptUnit(f"manifest names {chunks} chunks for {payload} payload bytes")
        return _Manifest(nonce, chunk_bytes, chunks)

    def _verify_chunks(
        self, raw_key: bytes, rng: tuple[int, int], manifest: _Manifest, values: list[Any]
    ) -> list[memoryview]:
        """Verify a chunked unit (header chunk + payload chunks); its payload pieces."""
        head = values[0]
        if len(head) != header_length(raw_key):
            raise CorruptUnit(f"header chunk of {len(head)} bytes")
        header = decode_header(
            head, namespace=self.namespace, key=raw_key, first=rng[0], end=rng[1]
        )
        verifier = PayloadVerifier(header)
        parts = []
        remaining = header.payload_length
        for value in values[1:]:
            expected = min(manifest.chunk_bytes, remaining)
            if len(value) != expected:
                raise CorruptUnit(f"payload chunk of {len(value)} bytes, expected {expected}")
            view = memoryview(value)
            verifier.update(view)
            parts.append(view)
            remaining -= expected
        verifier.finish()
        return parts

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
        self._close_clients()

    def _close_clients(self) -> None:
        with self._client_lock:
            for client in (self._client, self._lookup_client):
                if client is not None:
                    # Closing a dead connection may fail: nothing left to do then.
                    with contextlib.suppress(Exception):
                        client.close()
            self._client = self._lookup_client = None

    def __enter__(self) -> RedisStore:
        return self

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        return f"RedisStore({self.url!r}, {kind}, namespace={self.namespace.hex[:16]}...)"
