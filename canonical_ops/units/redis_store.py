"""A shared tier of canonical units on Redis or Valkey (standalone, TLS, unix socket, or Cluster).

The values are the file store's units, byte for byte (:mod:`.unit`). Keys (``P`` =
``key_prefix``; ``<ns>``: 32 hex of the namespace digest; ``<kd>``: the key digest)::

    P:v1:{<ns>:<kd>}:<first>-<end>   a unit of layers [first, end)  (SET NX: first writer wins)
    P:v1:{<ns>:<kd>}:idx             sorted set of the stored "<first>-<end>", score = expiry (ms)
    P:v1:namespace:<ns>              the namespace's description (JSON), for the store CLI

The hash tag keeps a block's keys on one cluster node. A unit above ``max_value_bytes`` is
stored as the units of consecutive layer ranges that fit (read like another pipeline
split's). Every load is verified before a byte reaches its destination; a bad value is a
counted miss and is deleted. Design notes: ``docs/redis_tier.md``.
"""

from __future__ import annotations

import functools
import hmac
import json
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..checks import check_bool, check_int, check_seconds, check_type
from .jobs import JobOutcome, JobPool
from .namespace import StoreNamespace
from .policy import cover
from .redis_connection import (
    RedisConnection,
    RedisStoreError,
    _Breaker,
    _Unavailable,
    claimed,
    client_options,
)
from .redis_url import parse_url, redact_url
from .redis_wire import Command, TooLong, _Into, _Parts
from .tier import DEFAULT_DEADLINE_S, LoadReq, StoreReq, TierMetrics, UnitStore
from .unit import (
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    CorruptUnit,
    begin_unit_check,
    encode_header,
    header_length,
    key_digest,
)

__all__ = ["DEFAULT_MAX_VALUE_BYTES", "RedisStore", "RedisStoreError", "RedisStoreMetrics"]

DEFAULT_MAX_VALUE_BYTES = 16 << 20  # a server is single threaded: big values stall it
_MAX_VALUE_LIMIT = 512 << 20  # Redis's proto-max-bulk-len
_MIN_VALUE_BYTES = 4096
_RETAIN_BYTES = 128 << 20  # per-thread scratch kept between calls (no page faults)
_MAX_LOAD_ROUNDS = 16  # exact + index, then covers; each round resolves or excludes
_RANGE = re.compile(rb"(\d{1,6})-(\d{1,6})")


@dataclass(frozen=True)
class RedisStoreMetrics(TierMetrics):
    """Counters of one :class:`RedisStore` (a snapshot), beyond :class:`.TierMetrics`:
    ``*_unavailable`` / ``stores_dropped``: the server was down, slow or skipped by the
    breaker; ``stores_failed``: the server refused (OOM, NOPERM); ``stale_removed``: index
    entries naming vanished units; ``values_deleted``: bad values deleted; ``bytes_sent`` /
    ``bytes_received``: value bytes on the wire; ``errors``: failed round trips and error
    replies; ``available``: breaker closed."""

    stores_dropped: int = 0
    loads_unavailable: int = 0
    lookups: int = 0
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


def parse_ranges(members: Any, num_layers: int) -> set[tuple[int, int]]:
    """Index members as layer ranges; anything malformed is ignored (never trusted)."""
    out = set()
    for member in members if isinstance(members, list) else ():
        match = _RANGE.fullmatch(member) if isinstance(member, bytes) else None
        if match and 0 <= int(match[1]) < int(match[2]) <= num_layers:
            out.add((int(match[1]), int(match[2])))
    return out


def _scratch(tls: threading.local, name: str, nbytes: int) -> memoryview:
    """This thread's reused buffer ``name`` of at least ``nbytes`` (fresh above the limit)."""
    buffer = getattr(tls, name, None)
    if buffer is None or len(buffer) < nbytes:
        buffer = np.empty(nbytes, dtype=np.uint8)
        if nbytes <= _RETAIN_BYTES:
            setattr(tls, name, buffer)
    return memoryview(buffer)[:nbytes]


class RedisStore(UnitStore):
    """Canonical units on a Redis / Valkey server or cluster, for one :class:`StoreNamespace`.

    ``url``: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS),
    ``unix://[[user]:password@]/path.sock[?db=N]``, ``redis+cluster://`` or
    ``rediss+cluster://`` (any node of a cluster; or ``cluster=True``); query arguments
    go to redis-py. ``username``, ``password``, ``db`` override the URL's. ``secret``
    (a :class:`~.auth.StoreSecret`): units carry its MAC, and units without a valid
    tag are misses (deleted). ``ttl_s``: units expire (None: the server evicts them).
    ``max_value_bytes`` (16 MiB): a bigger unit goes out as units of consecutive layer
    ranges that fit. ``max_pipeline_bytes`` (256 MiB): bigger batches take several
    pipelines. Timeouts: ``socket_timeout_s`` (5 s) per socket operation,
    ``connect_timeout_s`` (2 s), ``lookup_timeout_s`` (0.5 s, no retries) for
    :meth:`lookup` on the caller's thread; ``retries`` (2, back-off 50 ms .. 0.5 s).
    Breaker: ``breaker_failures`` (2) failed round trips skip the server for
    ``breaker_backoff_s`` (1 s), doubling up to ``breaker_max_backoff_s`` (30 s).
    ``require_server=False``: no server at start-up is a warning (probed later), not an
    error. ``ssl_*``: TLS files; ``client_kwargs``: more redis-py arguments (they win);
    ``key_prefix`` (``"ckv"``). ``threads``, ``queue_depth``, ``deadline_s``: the own
    :class:`JobPool` (4, 64, 30 s), or ``pool``: a shared one.

    Raises :class:`RedisStoreError` (one line, URL redacted) for wrong or missing
    credentials, missing ACL permissions, a server too old, or no server.
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
        secret: Any = None,
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
        require_server: bool = True,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
        key_prefix: str = "ckv",
        threads: int | None = None,
        queue_depth: int | None = None,
        pool: JobPool | None = None,
        deadline_s: float | None = DEFAULT_DEADLINE_S,
    ) -> None:
        check_type("namespace", namespace, StoreNamespace)
        self.namespace = namespace.for_store(secret)
        parsed = parse_url(url)
        self.url = redact_url(url)
        if cluster is not None and not isinstance(cluster, (bool, np.bool_)):
            raise TypeError(f"cluster: expected a bool or None, got {cluster!r}")
        if cluster is not None and not cluster and parsed.cluster:
            raise ValueError(f"cluster: expected True or None with a {parsed.scheme}:// URL")
        self.cluster = parsed.cluster if cluster is None else bool(cluster)
        if self.cluster and parsed.scheme == "unix":
            raise ValueError("url: expected a redis:// or rediss:// URL with cluster=True")
        ssl_files = {
            "ssl_ca_certs": ssl_ca_certs,
            "ssl_certfile": ssl_certfile,
            "ssl_keyfile": ssl_keyfile,
        }
        for name, value in {"username": username, "password": password, **ssl_files}.items():
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{name}: expected a str or None, got {type(value).__name__}")
        db = None if db is None else check_int("db", db, minimum=0)
        self.ttl_s = check_seconds("ttl_s", ttl_s, optional=True)
        self._ttl_ms = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        self._px = () if self._ttl_ms is None else ("PX", self._ttl_ms)  # SET's expiry
        self.max_value_bytes = check_int(
            "max_value_bytes", max_value_bytes, minimum=_MIN_VALUE_BYTES, maximum=_MAX_VALUE_LIMIT
        )
        layer = max(namespace.layer_bytes(i, i + 1) for i in range(namespace.num_layers))
        if MAX_HEADER_BYTES + layer > self.max_value_bytes:
            raise ValueError(
                f"max_value_bytes: expected at least {MAX_HEADER_BYTES + layer} (a header and "
                f"the largest layer: a value holds whole layers), got {max_value_bytes}"
            )
        self.max_pipeline_bytes = check_int(
            "max_pipeline_bytes", max_pipeline_bytes, minimum=self.max_value_bytes
        )
        seconds = {
            name: check_seconds(name, value)
            for name, value in (
                ("socket_timeout_s", socket_timeout_s),
                ("connect_timeout_s", connect_timeout_s),
                ("lookup_timeout_s", lookup_timeout_s),
                ("breaker_backoff_s", breaker_backoff_s),
                ("breaker_max_backoff_s", breaker_max_backoff_s),
            )
        }
        retries = check_int("retries", retries, minimum=0, maximum=10)
        breaker_failures = check_int("breaker_failures", breaker_failures, minimum=1)
        backoff, max_backoff = seconds["breaker_backoff_s"], seconds["breaker_max_backoff_s"]
        if max_backoff < backoff:
            raise ValueError(
                f"breaker_max_backoff_s: expected >= breaker_backoff_s={backoff}, got {max_backoff}"
            )
        require_server = check_bool("require_server", require_server)
        if client_kwargs is not None and not isinstance(client_kwargs, Mapping):
            raise TypeError(f"client_kwargs: expected a mapping or None, got {client_kwargs!r}")
        if not isinstance(key_prefix, str) or not key_prefix or set("{}") & set(key_prefix):
            kind = TypeError if not isinstance(key_prefix, str) else ValueError
            raise kind(f"key_prefix: expected a non-empty str without braces, got {key_prefix!r}")
        threads, queue_depth, deadline_s = self._pool_args(pool, threads, queue_depth, deadline_s)
        options = client_options(
            parsed,
            cluster=self.cluster,
            username=username,
            password=password,
            db=db,
            ssl_files=ssl_files,
            client_kwargs=client_kwargs,
            connect_timeout_s=seconds["connect_timeout_s"],
        )
        tag = f"{key_prefix}:v{FORMAT_VERSION}:"
        self._base = f"{tag}{{{self.namespace.hex[:32]}:"  # + kd}:first-end, + kd}:idx
        self._description = f"{tag}namespace:{self.namespace.hex[:32]}"
        text = json.dumps(self.namespace.describe(), sort_keys=True, separators=(",", ":"))
        self._description_json = text.encode()
        self._init_base(_COUNTERS)
        self._breaker = _Breaker(breaker_failures, backoff, max_backoff)
        self._tls = threading.local()
        self._connection = RedisConnection(
            self.url,
            options,
            cluster=self.cluster,
            retries=retries,
            breaker=self._breaker,
            timeouts=(seconds["socket_timeout_s"], seconds["lookup_timeout_s"]),
            max_pipeline_bytes=self.max_pipeline_bytes,
            count=self._count,
        )
        try:
            self._connection.start(self._base, require_server, self._describe())
        except BaseException:
            self._connection.close()
            raise
        self._attach_pool(pool, threads, queue_depth, "ckv-redis", deadline_s)

    # ------------------------------------------------------------------ keys

    def unit_key(self, key: Any, first: int, end: int) -> str:
        """The server key of ``key``'s unit of layers ``[first, end)``."""
        first, end = self.namespace.layer_range(first, end)
        return self._unit(key_digest(key), first, end)

    def index_key(self, key: Any) -> str:
        """The server key of ``key``'s index of stored layer ranges (a sorted set)."""
        return self._index(key_digest(key))

    def _unit(self, kd: str, first: int, end: int) -> str:
        return f"{self._base}{kd}}}:{first}-{end}"

    def _index(self, kd: str) -> str:
        return f"{self._base}{kd}}}:idx"

    def _describe(self) -> Command:
        """The namespace's description, kept beside its units for ``store verify|stats``
        (refreshed by every store: a restarted server gets it back)."""
        return Command("SET", self._description, self._description_json, *self._px)

    def _pieces(self, first: int, end: int, head: int) -> list[tuple[int, int]]:
        """``[first, end)`` as consecutive ranges whose units fit ``max_value_bytes``."""
        ns, limit = self.namespace, self.max_value_bytes - head
        if ns.layer_bytes(first, end) <= limit:
            return [(first, end)]
        pieces, a = [], first
        while a < end:
            b = a + 1
            while b < end and ns.layer_bytes(a, b + 1) <= limit:
                b += 1
            pieces.append((a, b))
            a = b
        return pieces

    # ------------------------------------------------------------------ lookup

    def _lookup(self, raws: list[bytes], first: int, end: int, *, inline: bool) -> int:
        """One round trip: per key its index and whether the exact unit exists (so the
        common same-split answer is exact; covers from other splits are the index's word)."""
        started, found, unavailable = time.perf_counter(), 0, False
        if raws:
            now_ms = f"{time.time() * 1000.0:.0f}"
            ops = []
            for raw in raws:
                kd = key_digest(raw)
                ops.append(Command("ZRANGE", self._index(kd), now_ms, "+inf", "BYSCORE"))
                ops.append(Command("EXISTS", self._unit(kd, first, end)))
            try:
                replies = self._connection.roundtrip(ops, lookup=inline, direct=True)
            except _Unavailable:
                unavailable, replies = True, []
            for members, exists in zip(replies[0::2], replies[1::2]):
                stored = parse_ranges(members, self.namespace.num_layers)
                (stored.add if exists == 1 else stored.discard)((first, end))
                if isinstance(exists, Exception) or cover(stored, first, end) is None:
                    break
                found += 1
        elapsed = time.perf_counter() - started
        self._count(
            "lookups",
            lookup_blocks=len(raws),
            lookup_hit_blocks=found,
            lookups_unavailable=unavailable,
            lookup_seconds_total=elapsed,
        )
        with self._lock:
            self._counts["lookup_seconds_max"] = max(self._counts["lookup_seconds_max"], elapsed)
        return found

    # ------------------------------------------------------------------ store

    def _store_units(self, reqs: list[StoreReq]) -> list[JobOutcome]:
        """Publish ``reqs`` in one round trip: each unit (or piece) with ``SET NX``, then
        the indexes (after every unit: a reader finding a range listed finds its unit
        unless evicted since; score = the unit's expiry, so lookups skip expired ones)."""
        if not reqs:
            return []
        ns, plans, ops, index = self.namespace, [], [], []
        for req in reqs:
            head = header_length(req.raw_key)
            pieces = self._pieces(req.first, req.end, head)
            offsets = ns.payload_offsets(req.first, req.end)
            plans.append((req, len(ops), pieces))
            for a, b in pieces:
                payload = req.payload[offsets[a - req.first] : offsets[b - req.first]]
                # Header and payload leave unjoined; the header is made (hashed) as it is sent.
                unit = (ns, req.raw_key, a, b, req.position, payload)
                value = _Parts((head, functools.partial(encode_header, *unit)), payload)
                key, size = self._unit(req.kd, a, b), head + len(payload)
                ops.append(Command("SET", key, value, *self._px, "NX", size=size))
            index += self._index_ops(self._index(req.kd), pieces)
        index.append(self._describe())
        try:  # claimed while sending: an expired job neither reads the payloads nor publishes
            replies = self._connection.roundtrip(ops + index, direct=True, guard=claimed)
        except _Unavailable as why:
            self._count("stores_dropped", len(reqs))
            return [JobOutcome("error", detail=f"dropped: {why}") for _ in reqs]
        self._count("bytes_sent", sum(op.size for op in ops))
        return [
            self._store_outcome(req, pieces, replies[at : at + len(pieces)])
            for req, at, pieces in plans
        ]

    def _store_outcome(self, req: StoreReq, pieces: list, replies: list) -> JobOutcome:
        """What the ``SET NX`` replies of one request's units say (OK: won; nil: there)."""
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is not None:  # e.g. OOM under noeviction, NOPERM
            self._count("stores_failed")
            return JobOutcome("error", detail=f"refused by the server: {error}", error=error)
        won = [rng for rng, reply in zip(pieces, replies) if reply is not None]
        nbytes = sum(self.namespace.layer_bytes(*rng) for rng in won)
        skipped = len(pieces) - len(won)
        self._count("units_stored", len(won), bytes_stored=nbytes, stores_skipped=skipped)
        if not skipped:
            return JobOutcome("ok", nbytes=nbytes)
        there = f"{skipped} of {len(pieces)} units" if won else "already stored"
        return JobOutcome("ok", nbytes=nbytes, detail=f"{there} (another writer first)")

    def _index_ops(self, index: str, ranges: Sequence[tuple[int, int]]) -> list:
        ttl_ms, now_ms = self._ttl_ms, time.time() * 1000.0
        expiry = math.inf if ttl_ms is None else now_ms + ttl_ms
        members = [x for a, b in ranges for x in (expiry, f"{a}-{b}".encode())]
        # PERSIST, or PEXPIRE NX (a new index gets the TTL) and GT (an old one only grows).
        expiry_ops = (
            [("PERSIST", index)]
            if ttl_ms is None
            else [("PEXPIRE", index, ttl_ms, "NX"), ("PEXPIRE", index, ttl_ms, "GT")]
        )
        return [
            Command("ZADD", index, "GT", *members),
            Command("ZREMRANGEBYSCORE", index, "-inf", f"({now_ms:.0f}"),
            *(Command(*args) for args in expiry_ops),
        ]

    # ------------------------------------------------------------------ load

    def _land(self, ld: _Load, rng: tuple[int, int], header: Any, payload: Any) -> tuple:
        """A unit read (straight into scratch, or whole): verified, then placed; the reply
        becomes ``(bytes read, None or why it is corrupt)``."""
        try:
            hasher, checksum = begin_unit_check(
                header, namespace=self.namespace, key=ld.req.raw_key, first=rng[0], end=rng[1]
            )
            if len(payload) != self.namespace.layer_bytes(*rng):
                raise CorruptUnit(f"payload of {len(payload)} bytes")
            hasher.update(payload)
            same = hmac.compare_digest(hasher.digest(), checksum)  # constant time: a MAC's too
            problem = None if same else "checksum mismatch"
        except CorruptUnit as bad:
            problem = bad.reason
        if problem is None:
            self._place(ld, rng, payload)
        return len(header) + len(payload), problem

    def _place(self, ld: _Load, rng: tuple[int, int], payload: Any) -> None:
        """Copy the verified unit ``rng``'s layers inside the request into its destination."""
        req, (a, b) = ld.req, rng
        lo, hi = max(a, req.first), min(b, req.end)
        src = self.namespace.payload_offsets(a, b)
        dst = self.namespace.payload_offsets(req.first, req.end)
        with claimed():  # an expired job never writes caller memory
            req.dest[dst[lo - req.first] : dst[hi - req.first]] = payload[src[lo - a] : src[hi - a]]
        ld.done.add(rng)
        self._count("units_loaded")

    def _get(self, ld: _Load, rng: tuple[int, int]) -> Command:
        head = header_length(ld.req.raw_key)
        into = _Into(head, self.namespace.layer_bytes(*rng), functools.partial(self._land, ld, rng))
        return Command("GET", self._unit(ld.req.kd, *rng), size=head + into.size, into=into)

    def _load_units(self, reqs: list[LoadReq]) -> list[JobOutcome]:
        """Each unit read once into this thread's scratch, verified there, then copied into
        its destination: the exact unit and the index first, covering units after."""
        loads = [_Load(req) for req in reqs]
        cleanup: list[Command] = []
        deleted = 0
        scratch = functools.partial(_scratch, self._tls, "load")
        roundtrip = functools.partial(self._connection.roundtrip, direct=True, scratch=scratch)

        def exclude(ld: _Load, rng: tuple[int, int], why: str, delete: bool = False) -> None:
            """Never use ``rng`` for this item again; forget it on the server (best effort)."""
            nonlocal deleted
            ld.excluded.add(rng)
            ld.problems.append(f"{rng[0]}-{rng[1]} {why}")
            cleanup.append(Command("ZREM", self._index(ld.req.kd), f"{rng[0]}-{rng[1]}"))
            if delete:
                cleanup.append(Command("DEL", self._unit(ld.req.kd, *rng)))
                deleted += 1

        def on_value(ld: _Load, rng: tuple[int, int], value: Any) -> None:
            if value is None:
                self._count("stale_removed")
                return exclude(ld, rng, "vanished (evicted or expired)")
            if isinstance(value, Exception):
                ld.excluded.add(rng)
                ld.problems.append(f"{rng[0]}-{rng[1]} unreadable: {value}")
                return None
            if isinstance(value, TooLong):  # read through, never held
                unit = header_length(ld.req.raw_key) + self.namespace.layer_bytes(*rng)
                value = (int(value), f"value of {int(value)} bytes, the unit has {unit}")
            elif not isinstance(value, tuple):  # not the unit's size, or a cluster's reply
                head, view = header_length(ld.req.raw_key), memoryview(value)
                value = self._land(ld, rng, view[:head], view[head:])
            nbytes, problem = value
            self._count("bytes_received", nbytes)
            if problem is not None:
                self._count("corrupt_detected")
                exclude(ld, rng, f"corrupt: {problem}", delete=True)
            return None

        unavailable = None
        try:
            now_ms = f"{time.time() * 1000.0:.0f}"
            ops = []
            for ld in loads:
                ops.append(self._get(ld, ld.span))
                ops.append(Command("ZRANGE", self._index(ld.req.kd), now_ms, "+inf", "BYSCORE"))
            replies = roundtrip(ops)
            for ld, value, members in zip(loads, replies[0::2], replies[1::2]):
                ld.ranges = parse_ranges(members, self.namespace.num_layers)
                if value is not None or ld.span in ld.ranges:  # neither there nor listed: no unit
                    ld.ranges.add(ld.span)
                    on_value(ld, ld.span, value)
            for _round in range(_MAX_LOAD_ROUNDS):
                wanted = []
                for ld in (ld for ld in loads if ld.outcome is None):
                    chain = cover(ld.ranges - ld.excluded, *ld.span)
                    todo = [] if chain is None else [r for r in chain if r not in ld.done]
                    detail = "; ".join(ld.problems)
                    if chain is None:
                        ld.outcome = JobOutcome("miss", detail=detail or "not stored")
                    elif not todo:
                        ld.outcome = JobOutcome("ok", nbytes=len(ld.req.dest), detail=detail)
                    wanted += [(ld, rng) for rng in todo]
                if not wanted:
                    break
                for (ld, rng), value in zip(wanted, roundtrip([self._get(*w) for w in wanted])):
                    on_value(ld, rng, value)
        except _Unavailable as why:
            unavailable = f"unavailable: {why}"
        missed = JobOutcome("miss", detail=unavailable or "gave up (too many rounds)")
        outcomes = [ld.outcome or missed for ld in loads]
        hits = sum(outcome.status == "ok" for outcome in outcomes)
        dropped = sum(ld.outcome is None for ld in loads) if unavailable else 0
        self._count(
            "hits",
            hits,
            misses=len(loads) - hits,
            loads_unavailable=dropped,
            bytes_loaded=sum(outcome.nbytes for outcome in outcomes),
        )
        if unavailable is None:
            self._connection.cleanup(cleanup, deleted)
        return outcomes

    # ------------------------------------------------------------------ upkeep

    def metrics(self) -> RedisStoreMetrics:
        """A consistent snapshot of the counters."""
        breaker = self._breaker
        with self._lock:
            counts = dict(self._counts, breaker_opens=breaker.opens, breaker_skips=breaker.skips)
        return RedisStoreMetrics(**counts, available=breaker.closed)

    @property
    def available(self) -> bool:
        """False while the circuit breaker skips the server."""
        return self._breaker.closed

    def _close_resources(self) -> None:
        self._connection.close()

    def __repr__(self) -> str:
        kind = "cluster" if self.cluster else "server"
        return f"RedisStore({self.url!r}, {kind}, namespace={self.namespace.hex[:16]}...)"


class _Load:
    """One item of a batched load while its rounds run."""

    __slots__ = ("done", "excluded", "outcome", "problems", "ranges", "req", "span")

    def __init__(self, req: LoadReq) -> None:
        self.req, self.span = req, (req.first, req.end)
        self.ranges, self.excluded, self.done = set(), set(), set()  # of (first, end)
        self.problems: list[str] = []
        self.outcome: JobOutcome | None = None
