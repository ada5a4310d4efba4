"""The Redis tier's connection: clients, start-up checks, round trips through a circuit breaker
(socket timeouts, retries with back-off; a failing server skipped, probed again later). A round
trip that did not happen is :class:`_Unavailable` (a 0 lookup, a miss, a dropped store): the
engine keeps serving. Start-up problems are one-line :class:`RedisStoreError` messages."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from layouts.cli import escape_text

from .jobs import current_job
from .redis_url import RedisURL
from .redis_wire import PACKER, READ_BUFFER, Command, _Parts, direct_exchange

_log = logging.getLogger(__package__ + ".redis_store")

ENV_PASSWORD = "CANONICAL_KV_REDIS_PASSWORD"  # the password when neither URL nor caller gives one

# Server unreachable, slow, or refusing us right now: the breaker counts these.
_UNAVAILABLE = (
    redis.exceptions.ConnectionError,  # includes AuthenticationError, BusyLoadingError
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterError,
    redis.exceptions.RedisClusterException,
    OSError,
)
COMMANDS = "GET SET EXISTS DEL PERSIST PEXPIRE ZADD ZRANGE ZREMRANGEBYSCORE ZREM"


class RedisStoreError(RuntimeError):
    """A Redis tier that cannot start: credentials, permissions, server version, or no server."""


class _Unavailable(Exception):
    """A round trip that did not happen (server down, slow, or skipped by the breaker)."""


class _Expired(Exception):
    """The job ran past its pool's deadline: it must not write or publish any more."""


@contextlib.contextmanager
def claimed() -> Any:
    """Run the body only while the current job is claimed (not expired; see :mod:`.jobs`)."""
    job = current_job()
    if not job.claim():
        raise _Expired
    try:
        yield
    finally:
        job.release()


@functools.cache
def _packing(base: type) -> type:
    """``base`` (a redis-py connection class) sending units with :data:`.redis_wire.PACKER`:
    the one way to reach a cluster's node connections too (their other options are filtered)."""

    def __init__(self: Any, **kwargs: Any) -> None:
        base.__init__(self, command_packer=PACKER, **kwargs)

    return type(f"Packing{base.__name__}", (base,), {"__init__": __init__})


def client_options(
    url: RedisURL,
    *,
    cluster: bool,
    username: str | None = None,
    password: str | None = None,
    db: int | None = None,
    ssl_files: Mapping[str, str | None] | None = None,
    client_kwargs: Mapping[str, Any] | None = None,
    connect_timeout_s: float = 5.0,
) -> dict[str, Any]:
    """redis-py keyword arguments: the URL's (credentials apart), then the explicit ones; the
    password: ``password``, else the URL's, else ``$CANONICAL_KV_REDIS_PASSWORD`` (engines log
    their configuration, URLs included: vLLM prints ``--kv-transfer-config`` at start-up)."""
    scheme = url.scheme.replace("+cluster", "")
    try:  # the address carries no credentials: redis-py's messages cannot leak them
        options = redis.connection.parse_url(scheme + url.address[len(url.scheme) :])
    except ValueError as error:
        raise ValueError(f"url: {escape_text(error)}") from None  # it may quote the URL
    tls = scheme == "rediss"
    base = redis.connection.SSLConnection if tls else redis.connection.Connection
    if scheme == "unix":
        base = redis.connection.UnixDomainSocketConnection
    options["connection_class"] = _packing(base)
    password = password or url.password or os.environ.get(ENV_PASSWORD) or None
    explicit = {"username": username or url.username, "password": password}
    options.update({k: v for k, v in explicit.items() if v is not None})
    if db is not None:
        options["db"] = db
    if cluster:
        if options.pop("db", 0) not in (0, None):
            raise ValueError("db: expected 0 (or none) with a Redis Cluster, which has one db")
        options["ssl"] = tls
    for name, value in (ssl_files or {}).items():
        if value is not None:
            if not tls:
                raise ValueError(f"{name}: TLS files need a rediss:// URL, got {url.scheme}://")
            options[name] = value
    if scheme != "unix":
        options.setdefault("host", "localhost")
        options["socket_keepalive"] = True
    options["socket_connect_timeout"] = connect_timeout_s
    options["socket_read_size"] = 1 << 20  # units are megabytes, not redis-py's 64 KiB
    options.update(client_kwargs or {})
    if options.get("decode_responses"):
        raise ValueError("client_kwargs: decode_responses must stay False (values are bytes)")
    return options


class _Breaker:
    """Consecutive-failure circuit breaker with exponential back-off and single probes."""

    def __init__(self, threshold: int, backoff_s: float, max_backoff_s: float) -> None:
        self.threshold, self.base, self.cap = threshold, backoff_s, max_backoff_s
        self.backoff, self._until, self._failures, self._open = backoff_s, 0.0, 0, False
        self._lock = threading.Lock()
        self._probe_since: float | None = None
        self.opens = self.skips = 0

    def allow(self) -> bool:
        """Whether a round trip may go to the server now (one probe at a time when open)."""
        with self._lock:
            if not self._open:
                return True
            now = time.monotonic()
            # A probe that never reported back (its job abandoned) frees the slot later.
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
            self._failures, self._open, self._probe_since, self.backoff = 0, False, None, self.base
            return was_open

    def failure(self) -> bool:
        """A round trip failed; True when this opens the breaker."""
        with self._lock:
            self._failures += 1
            probing = self._probe_since is not None
            if not (probing or self._failures >= self.threshold):
                return False
            if probing:  # the server is still away: wait longer before the next probe
                self.backoff = min(self.backoff * 2, self.cap)
            opened = not self._open
            self.opens += opened
            self._open, self._probe_since = True, None
            self._until = time.monotonic() + self.backoff
            return opened

    @property
    def closed(self) -> bool:
        with self._lock:
            return not self._open


def start_error(url: str, has_password: bool, error: BaseException) -> tuple[str, bool]:
    """The one-line message of a start-up failure, and whether the server simply did not answer."""
    chain = [error, error.__cause__, error.__context__]
    text = " ".join(str(e) for e in chain if e is not None)
    said = escape_text(str(error))  # the server's words: never raw in a message
    if any(isinstance(e, redis.exceptions.AuthenticationError) for e in chain) or any(
        marker in text for marker in ("NOAUTH", "HELLO must be called", "Authentication required")
    ):
        if not has_password:
            why = f"requires a password: put it in the URL or pass password=... (or {ENV_PASSWORD})"
            return f"url: the server at {url!r} {why}", False
        why = "(wrong password or unknown user)"
        return f"url: authentication failed at {url!r} {why}: {said}", False
    if isinstance(error, redis.exceptions.NoPermissionError):
        why = f"may not run the commands this tier needs ({COMMANDS} on its keys)"
        return f"url: the user of {url!r} {why}: {said}", False
    if isinstance(error, _UNAVAILABLE):
        why = "start the server there or correct the URL"
        return f"url: no Redis server reachable at {url!r} ({said}): {why}", True
    why = "refused a command this tier needs (Redis >= 7.0 or Valkey >= 7.2 required)"
    return f"url: the server at {url!r} {why}: {said}", False


@dataclass(eq=False)
class RedisConnection:
    """The clients of one :class:`.RedisStore` and its round trips through the breaker."""

    url: str  # redacted, for messages
    options: dict[str, Any] = field(repr=False)  # client_options(): the password too
    cluster: bool
    timeouts: tuple[float, float]  # socket, lookup (indexed by ``lookup``)
    retries: int
    breaker: _Breaker
    max_pipeline_bytes: int
    count: Callable[..., None]  # the store's counters round_trips, errors, values_deleted

    def __post_init__(self) -> None:
        self._lock, self._tls = threading.Lock(), threading.local()
        self._clients: tuple[Any, Any] | None = None

    def _new_client(self, lookup: bool) -> Any:
        options = dict(self.options)
        options.setdefault("socket_timeout", self.timeouts[lookup])
        retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), 0 if lookup else self.retries)
        if self.cluster:
            return redis.RedisCluster(retry=retry, require_full_coverage=True, **options)
        return redis.Redis(connection_pool=redis.ConnectionPool(retry=retry, **options))

    def clients(self) -> tuple[Any, Any]:
        """(data client, lookup client: no retries, ``lookup_timeout_s``), made on first use."""
        with self._lock:
            if self._clients is None:
                data = self._new_client(False)
                try:
                    self._clients = (data, self._new_client(True))
                except BaseException:
                    data.close()
                    raise
            return self._clients

    def start(self, key_base: str, require_server: bool, publish: Command) -> None:
        """Connect, authenticate and run every command the tier uses once, with ``publish``
        (one pipeline)."""
        probe = f"{key_base}probe}}:{secrets.token_hex(8)}"
        index = probe + ":idx"
        value = _Parts(b"ck", memoryview(b"v-"))
        ops = [
            Command("SET", probe, value, "PX", 10_000, "NX", size=4),
            Command("GET", probe),
            Command("EXISTS", probe),
            Command("PERSIST", probe),
            Command("ZADD", index, "GT", math.inf, b"0-1"),
            Command("ZRANGE", index, 0, "+inf", "BYSCORE"),
            Command("ZREMRANGEBYSCORE", index, "-inf", "(0"),
            Command("PEXPIRE", index, 10_000, "NX"),
            Command("ZREM", index, b"0-1"),
            Command("DEL", probe),
            Command("DEL", index),
            publish,
        ]
        has_password = self.options.get("password") is not None
        try:
            results = self._pipeline(self.clients()[0], ops)
        except (redis.RedisError, *_UNAVAILABLE) as error:
            message, away = start_error(self.url, has_password, error)
            if not away or require_server:
                raise RedisStoreError(message) from error
            off = "starting with the tier off (misses, dropped stores) and probing it again later"
            message = (
                f"RedisStore: no server reachable at {self.url!r} ({escape_text(error)}); {off}"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            for _ in range(self.breaker.threshold):  # open: probe later
                self.breaker.failure()
            return
        if errors := [r for r in results if isinstance(r, Exception)]:
            raise RedisStoreError(start_error(self.url, has_password, errors[0])[0])
        if results[1] != b"ckv-":  # a redis-py that packs commands differently
            raise RedisStoreError(f"url: a value written to {self.url!r} read back wrong")

    def _pipeline(self, client: Any, ops: Sequence[Command], **how: Any) -> list[Any]:
        """Send ``ops`` as pipelines of at most ``max_pipeline_bytes``; replies in order (error
        replies in place; a failed round trip raises). ``how``: ``guard`` (context manager
        around each send), ``direct`` (:func:`.redis_wire.direct_exchange`), ``scratch``."""
        guard = how.get("guard") or contextlib.nullcontext
        results: list[Any] = []
        start = 0
        while start < len(ops):
            stop, size = start + 1, ops[start].size
            while stop < len(ops) and size + ops[stop].size <= self.max_pipeline_bytes:
                size += ops[stop].size
                stop += 1
            if how.get("direct") and not self.cluster:  # a cluster's pipelines span nodes
                replies = self._direct(client, ops[start:stop], how.get("scratch"), guard)
            else:
                pipe = client.pipeline(transaction=False)
                for op in ops[start:stop]:
                    pipe.execute_command(*op.args)
                with guard():
                    replies = pipe.execute(raise_on_error=False)
            self.count("round_trips")
            if unavailable := [r for r in replies if isinstance(r, _UNAVAILABLE)]:
                raise unavailable[0]
            results.extend(replies)
            start = stop
        return results

    def _direct(self, client: Any, ops: Sequence[Command], scratch: Any, guard: Any) -> list[Any]:
        """One pipeline on a connection of ``client``'s pool, with its retries."""
        buffer = getattr(self._tls, "read_buffer", None)
        if buffer is None:  # per thread, reused: no page faults on every round trip
            buffer = self._tls.read_buffer = bytearray(READ_BUFFER)
        scratch = scratch or (lambda n: memoryview(np.empty(n, np.uint8)))
        pool = client.connection_pool
        conn = pool.get_connection()
        try:
            return conn.retry.call_with_retry(
                lambda: direct_exchange(conn, ops, buffer, scratch, guard),
                lambda _error: conn.disconnect(),
            )
        finally:
            pool.release(conn)

    def roundtrip(self, ops: Sequence[Command], *, lookup: bool = False, **how: Any) -> list[Any]:
        """:meth:`_pipeline` through the breaker (``lookup``: on the retry-free lookup
        client); raises :class:`_Unavailable` when the round trip did not happen."""
        if not ops:
            return []
        if not self.breaker.allow():
            raise _Unavailable("server skipped (circuit breaker open after failures)")
        try:
            results = self._pipeline(self.clients()[lookup], ops, **how)
        except (*_UNAVAILABLE, redis.RedisError) as error:
            self.count("errors")
            if not isinstance(error, _UNAVAILABLE):  # a reply unusable for the whole pipeline
                self._recovered()  # the server answered
            elif self.breaker.failure():
                _log.warning(
                    "RedisStore %s unavailable (%s: %s): skipping it, probing again in %.1f s "
                    "(lookups 0, loads miss, stores dropped meanwhile)",
                    escape_text(self.url),  # a log line each: the server's text escaped
                    type(error).__name__,
                    escape_text(error),
                    self.breaker.backoff,
                )
            raise _Unavailable(f"{type(error).__name__}: {error}") from error
        self._recovered()
        self.count("errors", sum(isinstance(r, Exception) for r in results))
        return results

    def _recovered(self) -> None:
        if self.breaker.success():
            _log.warning("RedisStore %s reachable again", escape_text(self.url))

    def cleanup(self, ops: list[Command], deleted: int) -> None:
        """Best-effort removal of bad or stale values (one round trip, errors ignored)."""
        with contextlib.suppress(_Unavailable):
            if ops:
                self.roundtrip(ops)
                self.count("values_deleted", deleted)

    def close(self) -> None:
        with self._lock:
            for client in self._clients or ():
                with contextlib.suppress(Exception):  # a dead connection may fail to close
                    client.close()
            self._clients = None
