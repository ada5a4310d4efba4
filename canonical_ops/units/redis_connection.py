"""The Redis tier's connection: URLs, clients, timeouts, retries, circuit breaker, packing.

Failures
--------
All I/O runs in the threads of a bounded :class:`.JobPool`; submissions
never block and a full queue is a refused job. Every socket operation has a
timeout (``socket_timeout_s``, ``connect_timeout_s``; a synchronous
:meth:`.RedisStore.lookup` uses its own connections with ``lookup_timeout_s``
and no retries); redis-py retries a failed command ``retries`` times with
exponential back-off. After ``breaker_failures`` consecutive failed round
trips a circuit breaker skips the server for ``breaker_backoff_s`` (doubling
up to ``breaker_max_backoff_s``), then lets one operation probe it; the first
success closes it. While the server is down or slow, lookups return 0, loads
are misses and stores are dropped, all counted in :class:`.RedisStoreMetrics`;
no exception reaches the caller from a job or a lookup. Wrong credentials
(or an ACL user without the needed commands) at start-up are always a
:class:`RedisStoreError` naming the URL; an unreachable server at start-up is
one too unless ``require_server=False`` (then a warning and the breaker open).
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .redis_wire import _PACKER, _READ_BUFFER, _deletes, _Op, _Parts, direct_exchange

# The tier has one logger, named after the module users know (its home before the split).
_log = logging.getLogger(__package__ + ".redis_store")

# Per thread, a value read directly lands in a reused buffer of up to this size (a
# unit is at most max_value_bytes, 16 MiB by default; a bigger one gets a fresh buffer).
_LANDING_RETAIN_BYTES = 128 << 20
_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
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


def check_url(url: Any) -> str:
    """The scheme of a Redis tier URL (lower case), or a clear error naming ``url``."""
    if not isinstance(url, str):
        raise TypeError(f"url: expected a redis://, rediss:// or unix:// URL str, got {url!r}")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in _SCHEMES:
        raise ValueError(
            f"url: expected a URL with scheme {', '.join(s + '://' for s in _SCHEMES)}; "
            f"got {redact_url(url)!r}"
        )
    return scheme


def client_options(
    url: str,
    scheme: str,
    *,
    cluster: bool,
    username: str | None,
    password: str | None,
    db: int | None,
    ssl_files: Mapping[str, str | None],
    client_kwargs: Mapping[str, Any] | None,
    connect_timeout_s: float,
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
    if cluster:
        if options.pop("db", 0) not in (0, None):
            raise ValueError("db: expected 0 (or none) with a Redis Cluster, which has one db")
        options["ssl"] = tls
    elif tls:
        options["connection_class"] = redis.connection.SSLConnection
    for name, value in ssl_files.items():
        if value is not None:
            if not tls:
                raise ValueError(f"{name}: TLS files need a rediss:// URL, got {redact_url(url)!r}")
            options[name] = value
    if scheme != "unix":
        options.setdefault("host", "localhost")
        options["socket_keepalive"] = True
    options["socket_connect_timeout"] = connect_timeout_s
    # Bigger reads than redis-py's 64 KiB: units are megabytes.
    options["socket_read_size"] = 1 << 20
    options.update(client_kwargs or {})
    if options.get("decode_responses"):
        raise ValueError("client_kwargs: decode_responses must stay False (values are bytes)")
    return options


def _chain_errors(error: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        out.append(error)
        error = error.__cause__ or error.__context__
    return out


# ---------------------------------------------------------------------- breaker


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


# ---------------------------------------------------------------------- the connection


class RedisConnection:
    """The clients of one :class:`.RedisStore` and its round trips through the breaker.

    Parameters
    ----------
    url : str
        The URL, password already redacted (for messages only).
    options : dict
        redis-py keyword arguments (:func:`client_options`).
    cluster : bool
        Use redis-py's ``RedisCluster``.
    socket_timeout_s, lookup_timeout_s : float
        Timeouts of the data client and of the (retry-free) lookup client.
    retries : int
        redis-py retries of a failed command on the data client.
    breaker : _Breaker
    max_pipeline_bytes : int
        A batch moving more value bytes is sent as several pipelines.
    count : callable
        ``count(counter, n)``: the store's counters (``round_trips``, ``errors``,
        ``values_deleted``).
    """

    def __init__(
        self,
        url: str,
        options: dict[str, Any],
        *,
        cluster: bool,
        socket_timeout_s: float,
        lookup_timeout_s: float,
        retries: int,
        breaker: _Breaker,
        max_pipeline_bytes: int,
        count: Callable[..., None],
    ) -> None:
        self.url, self.options, self.cluster = url, options, cluster
        self.socket_timeout_s, self.lookup_timeout_s = socket_timeout_s, lookup_timeout_s
        self.retries, self.breaker = retries, breaker
        self.max_pipeline_bytes = max_pipeline_bytes
        self._count = count
        # Our packer rides on the connections the store creates; a cluster client
        # creates its nodes' own, so there a unit is joined into one buffer first.
        self.zero_copy = not cluster
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._client: Any = None
        self._lookup_client: Any = None

    def _new_client(self, *, lookup: bool) -> Any:
        options = dict(self.options)
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

    def clients(self) -> tuple[Any, Any]:
        """(data client, lookup client), created on first use (a cluster connects then)."""
        with self._lock:
            if self._client is None:
                client = self._new_client(lookup=False)
                try:
                    lookup = self._new_client(lookup=True)
                except BaseException:
                    client.close()
                    raise
                self._client, self._lookup_client = client, lookup
            return self._client, self._lookup_client

    def start(self, key_base: str, require_server: bool) -> None:
        """Connect, authenticate and check the commands the tier uses (one probe pipeline)."""
        probe = f"{key_base}probe}}:{secrets.token_hex(8)}"
        # The value goes out the way units do (in two pieces, or joined) and must read back.
        value = _Parts(b"ck", memoryview(b"v-")) if self.zero_copy else b"ckv-"
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
            client, _ = self.clients()
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
                stacklevel=3,  # the caller of RedisStore(...)
            )
            self.breaker.force_open()
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
                    f"{key_base.split(':{')[0]}:*): {result}"
                )
            if isinstance(result, redis.exceptions.AuthenticationError):
                raise RedisStoreError(f"url: authentication failed at {self.url!r}: {result}")
            if isinstance(result, Exception):
                raise RedisStoreError(
                    f"url: the server at {self.url!r} refused a command this tier needs "
                    f"(Redis >= 7.0 or Valkey >= 7.2 required): {result}"
                )

    def _pipeline(self, client: Any, ops: Sequence[_Op], direct: bool = False) -> list[Any]:
        """Send ``ops`` as pipelines of at most ``max_pipeline_bytes``; replies in order.

        Error replies of single commands are returned in place; a failed round trip
        raises (the caller decides what it means). ``direct``: raw commands only
        (``execute_command``), read by :func:`.redis_wire.direct_exchange` (values
        land in their ``into`` targets) where the store made the connections.
        """
        direct = direct and self.zero_copy and all(op.name == "execute_command" for op in ops)
        results: list[Any] = []
        start = 0
        while start < len(ops):
            stop, size = start, 0
            while stop < len(ops) and (
                stop == start or size + ops[stop].size <= self.max_pipeline_bytes
            ):
                size += ops[stop].size
                stop += 1
            if direct:
                replies = self._direct(client, ops[start:stop])
            else:
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

    def _direct(self, client: Any, ops: Sequence[_Op]) -> list[Any]:
        """One pipeline on a connection of ``client``'s pool, with its retries."""
        buffer = getattr(self._tls, "read_buffer", None)
        if buffer is None:  # per thread, reused: no page faults on every round trip
            buffer = self._tls.read_buffer = bytearray(_READ_BUFFER)
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            return conn.retry.call_with_retry(
                lambda: direct_exchange(conn, ops, buffer, self._landing_buffer),
                lambda _error: conn.disconnect(),
            )
        finally:
            pool.release(conn)

    def _landing_buffer(self, nbytes: int) -> memoryview:
        """This thread's buffer for one value read directly (reused: no page faults)."""
        buffer = getattr(self._tls, "landing", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = np.empty(nbytes, dtype=np.uint8)
            if nbytes <= _LANDING_RETAIN_BYTES:
                self._tls.landing = buffer
        return memoryview(buffer)[:nbytes]

    def roundtrip(
        self, ops: Sequence[_Op], *, lookup: bool = False, direct: bool = False
    ) -> list[Any]:
        """:meth:`_pipeline` through the breaker; raises :class:`_Unavailable` on failure."""
        if not ops:
            return []
        if not self.breaker.allow():
            raise _Unavailable("server skipped (circuit breaker open after failures)")
        try:
            data, fast = self.clients()
            results = self._pipeline(fast if lookup else data, ops, direct)
        except _UNAVAILABLE as error:
            self._count("errors")
            if self.breaker.failure():
                _log.warning(
                    "RedisStore %s unavailable (%s: %s): skipping it, probing again in %.1f s "
                    "(lookups 0, loads miss, stores dropped meanwhile)",
                    self.url, type(error).__name__, error, self.breaker.backoff,
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
        if self.breaker.success():
            _log.warning("RedisStore %s reachable again", self.url)

    def cleanup(self, ops: list[_Op], deleted: int) -> None:
        """Best-effort removal of bad or stale values (one round trip, errors ignored)."""
        if not ops:
            return
        try:
            self.roundtrip(ops)
        except _Unavailable:
            return
        self._count("values_deleted", deleted)

    def close(self) -> None:
        with self._lock:
            for client in (self._client, self._lookup_client):
                if client is not None:
                    # Closing a dead connection may fail: nothing left to do then.
                    with contextlib.suppress(Exception):
                        client.close()
            self._client = self._lookup_client = None
