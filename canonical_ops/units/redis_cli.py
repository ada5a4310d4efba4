"""``python -m canonical_ops store stats|verify|gc URL``: the Redis / Valkey side of :mod:`.cli`
(which picks it for a Redis URL; the reports are :mod:`.store_report`'s, as for files).

Every primary of a cluster is read; sizes (``MEMORY USAGE``) and recency (``OBJECT IDLETIME``)
without touching the keys' LRU clocks. ``verify`` checks every value against its namespace's
description (an authenticated one needs the engines' secret in the environment). Exit codes as
for files (2 also for an unusable server); URLs redacted."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import redis

from ..checks import check_int
from .namespace import StoreNamespace
from .redis_connection import _UNAVAILABLE, client_options, start_error
from .redis_url import parse_url, redact_url
from .store_report import (
    print_error,
    print_gc,
    print_stats,
    print_verify,
    read_namespace,
    stats_item,
)
from .unit import CorruptUnit, decode_and_verify, key_digest

__all__ = ["run"]

_UNIT = re.compile(rb"(.*):v1:\{([0-9a-f]{32}):([0-9a-f]{32})\}:(\d{1,6})-(\d{1,6})")
_DESCRIPTION = re.compile(rb"(.*):v1:namespace:([0-9a-f]{32})")
_BATCH = 256  # commands per pipeline
_BUCKET_S = 60  # units idle within the same minute are equally old: tails go first


class _Refused(Exception):
    """The command cannot run against this server (one line for stderr)."""


class _Unit(NamedTuple):
    """A unit's key digest, layers, server memory and idle time; its node and key."""

    kd: str
    first: int
    end: int
    nbytes: int
    idle_s: int
    node: Any
    key: bytes


@dataclass
class _Space:
    """One namespace found under the prefix: its description (None: missing or bad)."""

    hex: str
    namespace: StoreNamespace | None = None
    problem: str = "namespace description missing (no engine stored here since)"
    units: list[_Unit] = field(default_factory=list)


def _nodes(url: str) -> list[redis.Redis]:
    """One plain client per primary (standalone: one), each checked with a PING."""
    parsed = parse_url(url)
    options = client_options(parsed, cluster=parsed.cluster)
    options.setdefault("socket_timeout", 30.0)
    try:
        if parsed.cluster:
            cluster = redis.RedisCluster(**options)
            nodes = [cluster.get_redis_connection(n) for n in cluster.get_primaries()]
        else:
            nodes = [redis.Redis(connection_pool=redis.ConnectionPool(**options))]
        for node in nodes:
            node.ping()
    except (redis.RedisError, *_UNAVAILABLE) as error:
        has_password = options.get("password") is not None
        raise _Refused(start_error(redact_url(url), has_password, error)[0]) from None
    return nodes


def _replies(node: redis.Redis, commands: list[tuple]) -> list[Any]:
    """Replies of ``commands`` on ``node``, pipelined in batches (error replies in place)."""
    out: list[Any] = []
    for at in range(0, len(commands), _BATCH):
        pipe = node.pipeline(transaction=False)
        for args in commands[at : at + _BATCH]:
            pipe.execute_command(*args)
        out += pipe.execute(raise_on_error=False)
    return out


def _ask(units: list[_Unit], *commands: Callable[[_Unit], tuple]) -> list[Any]:
    """Per unit the reply of ``commands[0](unit)`` (each unit's ``commands`` sent in
    order), pipelined on the unit's node."""
    replies: dict[int, Any] = {}
    for node in {id(u.node): u.node for u in units}.values():
        mine = [u for u in units if u.node is node]
        got = _replies(node, [command(u) for u in mine for command in commands])
        replies.update(zip(map(id, mine), got[:: len(commands)]))
    return [replies[id(u)] for u in units]


def _scan(nodes: list[redis.Redis], prefix: str, recency: bool) -> tuple[dict[str, _Space], dict]:
    """Namespaces (with their units' memory and, for ``recency``, idle time), and the
    counts of index keys and other keys."""
    spaces: dict[str, _Space] = {}
    counts = {"index_keys": 0, "other_keys": 0}
    for node in nodes:
        found, described = [], []
        for key in node.scan_iter(match=f"{prefix}:v*", count=1000):
            unit, desc = _UNIT.fullmatch(key), _DESCRIPTION.fullmatch(key)
            if unit and unit[1] == prefix.encode():
                found.append((unit[2].decode(), unit[3].decode(), int(unit[4]), int(unit[5]), key))
            elif desc and desc[1] == prefix.encode():
                described.append((desc[2].decode(), key))
            else:
                counts["index_keys" if key.endswith(b":idx") else "other_keys"] += 1
        per = 2 if recency else 1  # OBJECT IDLETIME: only gc needs it
        commands = [
            c
            for *_, k in found
            for c in (("MEMORY", "USAGE", k, "SAMPLES", "0"), ("OBJECT", "IDLETIME", k))[:per]
        ]
        replies = _replies(node, commands + [("GET", key) for _, key in described])
        for i, (hex32, kd, first, end, key) in enumerate(found):
            size, idle = replies[per * i], replies[per * i + per - 1] if recency else 0
            if isinstance(idle, redis.ResponseError):
                raise _Refused(
                    f"the server does not track recency ({idle}): its maxmemory-policy "
                    "owns eviction; set maxmemory there instead of running store gc"
                )
            if isinstance(size, int):  # None: evicted or expired meanwhile
                idle = idle if isinstance(idle, int) else 0
                unit = _Unit(kd, first, end, size, idle, node, key)
                spaces.setdefault(hex32, _Space(hex32)).units.append(unit)
        for (hex32, _), text in zip(described, replies[len(commands) :]):
            space = spaces.setdefault(hex32, _Space(hex32))
            space.namespace, space.problem = read_namespace(text, hex32, "key")
    return spaces, counts


def _problem(space: _Space, unit: _Unit, value: Any) -> str | None:
    """Why ``value`` is not the unit its key names (None: it is)."""
    if isinstance(value, Exception):
        return f"unreadable: {value}"
    if (namespace := space.namespace) is None:
        return f"not verifiable: {space.problem}"
    try:
        header, _ = decode_and_verify(value, namespace=namespace, first=unit.first, end=unit.end)
    except CorruptUnit as bad:
        return bad.reason
    return None if key_digest(header.key) == unit.kd else "unit is for another key"


def _verify(where: dict, spaces: dict[str, _Space], as_json: bool) -> int:
    bad, checked = [], 0
    for space in spaces.values():
        for unit, value in zip(space.units, _ask(space.units, lambda u: ("GET", u.key))):
            if value is None:  # evicted or expired while we looked: not a bad unit
                continue
            checked += 1
            if (why := _problem(space, unit, value)) is not None:
                bad.append({"key": unit.key.decode(), "reason": why})
    return print_verify(where, len(spaces), checked, bad, as_json)


def _victims(units: list[_Unit], capacity: int) -> list[_Unit]:
    """Least recently used first (by the minute); within a minute, tails (highest
    positions) first. Positions are read only for the minute that straddles the cut."""
    excess = sum(u.nbytes for u in units) - capacity
    victims: list[_Unit] = []
    buckets: dict[int, list[_Unit]] = defaultdict(list)
    for unit in units:
        buckets[unit.idle_s // _BUCKET_S].append(unit)
    for age in sorted(buckets, reverse=True):
        bucket = buckets[age]
        if 0 < excess < sum(u.nbytes for u in bucket):  # the cut: read positions (GETRANGE)
            raw = dict(zip(map(id, bucket), _ask(bucket, lambda u: ("GETRANGE", u.key, 32, 39))))
            bucket.sort(key=lambda u: _position(raw[id(u)]), reverse=True)
        for unit in bucket:
            if excess <= 0:
                return victims
            victims.append(unit)
            excess -= unit.nbytes
    return victims


def _position(raw: Any) -> int:
    """A unit's position from its header's bytes 32..39 (unreadable: it goes first)."""
    return int.from_bytes(raw, "little") if isinstance(raw, bytes) and len(raw) == 8 else 1 << 63


def _unlisted(unit: _Unit) -> tuple:
    """The command taking ``unit``'s range out of its key's index."""
    return ("ZREM", unit.key.rsplit(b":", 1)[0] + b":idx", b"%d-%d" % (unit.first, unit.end))


def _gc(where: dict, spaces: dict[str, _Space], capacity: int, dry_run: bool, as_json) -> int:
    units = [u for space in spaces.values() for u in space.units]
    victims = _victims(units, capacity)
    if not dry_run:
        _ask(victims, lambda u: ("DEL", u.key), _unlisted)
    evicted = sum(u.nbytes for u in victims)
    left = (len(units) - len(victims), sum(u.nbytes for u in units) - evicted)
    report = {
        "capacity_bytes": capacity,
        "dry_run": dry_run,
        "units_evicted": len(victims),
        "bytes_evicted": evicted,
        "units_left": left[0],
        "bytes_left": left[1],
        "evicted": [u.key.decode() for u in victims],
    }
    listing = [f"{u.key.decode()}  {u.nbytes} bytes, idle {u.idle_s} s" for u in victims]
    return print_gc(where, report, left, listing if dry_run else [], as_json)


def run(
    command: str,
    url: str,
    *,
    as_json: bool = False,
    dry_run: bool = False,
    capacity: int | None = None,
    key_prefix: str = "ckv",
) -> int:
    """Run ``store stats|verify|gc`` against the Redis store at ``url``; the exit code. ``gc``
    evicts least recently used units (tails first) until the units' server memory is at most
    ``capacity`` bytes; ``dry_run`` only lists them."""
    shown = redact_url(url)

    def fail(message: str) -> int:
        return print_error(f"store {command}: {message}")

    if command not in ("stats", "verify", "gc"):
        return fail("expected a command: stats, verify or gc")
    if (capacity is None) == (command == "gc"):
        return fail("--capacity: expected with gc (bytes), and only with gc")
    if dry_run and command != "gc":
        return fail("--dry-run: only gc has it")
    try:
        if capacity is not None:
            check_int("--capacity", capacity, minimum=0)
        spaces, counts = _scan(_nodes(url), key_prefix, command == "gc")
        if command == "stats":
            items = [
                stats_item(h, s.namespace, s.problem, s.units) for h, s in sorted(spaces.items())
            ]
            note = f", {counts['other_keys']} other key(s)"
            return print_stats({"url": shown, **counts}, items, as_json, note)
        if command == "verify":
            return _verify({"url": shown}, spaces, as_json)
        return _gc({"url": shown}, spaces, capacity, dry_run, as_json)
    except (TypeError, ValueError, _Refused) as error:
        return fail(str(error))
    except (redis.RedisError, *_UNAVAILABLE) as error:
        return fail(f"{shown}: {type(error).__name__}: {error}")
