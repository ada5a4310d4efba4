"""``python -m canonical_ops store stats|verify|gc URL``: inspect and maintain a Redis / Valkey store.

Every primary of a cluster is read. Sizes are server memory (``MEMORY USAGE``)
and recency ``OBJECT IDLETIME``, both read without touching the keys' LRU
clocks, so a look does not change what the server evicts next; ``verify`` reads
every value and checks it against its namespace's description (kept beside the
units by every engine; an authenticated namespace needs the engines' secret in
the environment). Exit codes as for a file store: 0; 1 when ``verify`` finds a
unit it cannot vouch for; 2 for bad arguments or an unusable server (one line on
stderr). URLs are printed redacted.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import redis

from .auth import StoreSecret
from .namespace import StoreNamespace
from .redis_connection import _UNAVAILABLE, client_options, start_error
from .redis_url import parse_url, redact_url
from .unit import CorruptUnit, decode_and_verify, key_digest

__all__ = ["run"]

_UNIT = re.compile(rb"(.*):v1:\{([0-9a-f]{32}):([0-9a-f]{32})\}:(\d{1,6})-(\d{1,6})")
_DESCRIPTION = re.compile(rb"(.*):v1:namespace:([0-9a-f]{32})")
_MAX_DESCRIPTION = 1 << 20
_BATCH = 256  # commands per pipeline
_BUCKET_S = 60  # units idle within the same minute are equally old: tails go first


class _Refused(Exception):
    """The command cannot run against this server (one line for stderr)."""


@dataclass
class _Unit:
    node: Any
    key: bytes
    kd: str
    first: int
    end: int
    nbytes: int = 0
    idle_s: int = 0


@dataclass
class _Space:
    """One namespace found under the prefix: its description (None: missing or bad)."""

    hex: str
    namespace: StoreNamespace | None = None
    problem: str | None = "namespace description missing (no engine stored here since)"
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


def _namespace(hex32: str, text: Any) -> tuple[StoreNamespace | None, str | None]:
    """A namespace description read from the server (never trusted: its digest must be
    the one its key names); authenticated with the environment's secret when it is its."""
    try:
        if not isinstance(text, bytes) or len(text) > _MAX_DESCRIPTION:
            raise ValueError("not a description")
        namespace = StoreNamespace.from_description(json.loads(text))
    except (ValueError, UnicodeDecodeError) as error:
        return None, f"namespace description unreadable ({error})"
    if namespace.hex[:32] != hex32:
        return None, f"namespace description of {namespace.hex[:16]}..., not of its key"
    secret = StoreSecret.from_env() if namespace.key_id else None
    if secret is not None and secret.key_id == namespace.key_id:
        namespace = namespace.authenticated(secret)
    return namespace, None


def _scan(
    nodes: list[redis.Redis], prefix: str, recency: bool
) -> tuple[dict[str, _Space], int, int]:
    """Namespaces (with their units' memory and, for ``recency``, idle time), index keys,
    other keys."""
    spaces: dict[str, _Space] = {}
    indexes = others = 0
    for node in nodes:
        found, described = [], []
        for key in node.scan_iter(match=f"{prefix}:v*", count=1000):
            unit, desc = _UNIT.fullmatch(key), _DESCRIPTION.fullmatch(key)
            if unit and unit[1] == prefix.encode():
                found.append((unit[2].decode(), _Unit(node, key, unit[3].decode(),
                                                      int(unit[4]), int(unit[5]))))  # fmt: skip
            elif desc and desc[1] == prefix.encode():
                described.append((desc[2].decode(), key))
            elif key.endswith(b":idx"):
                indexes += 1
            else:
                others += 1
        per = 2 if recency else 1  # OBJECT IDLETIME: only gc needs it
        commands = [c for _, u in found for c in (("MEMORY", "USAGE", u.key, "SAMPLES", "0"),
                                                   ("OBJECT", "IDLETIME", u.key))[:per]]  # fmt: skip
        replies = _replies(node, commands + [("GET", key) for _, key in described])
        for i, (hex32, unit) in enumerate(found):
            size, idle = replies[per * i], replies[per * i + per - 1] if recency else 0
            if isinstance(idle, redis.ResponseError):
                raise _Refused(
                    f"the server does not track recency ({idle}): its maxmemory-policy "
                    "owns eviction; set maxmemory there instead of running store gc"
                )
            if isinstance(size, int):  # None: evicted or expired meanwhile
                unit.nbytes, unit.idle_s = size, idle if isinstance(idle, int) else 0
                spaces.setdefault(hex32, _Space(hex32)).units.append(unit)
        for (hex32, _), text in zip(described, replies[len(commands) :]):
            space = spaces.setdefault(hex32, _Space(hex32))
            space.namespace, space.problem = _namespace(hex32, text)
    return spaces, indexes, others


def _stats(shown: str, spaces: dict[str, _Space], counts: tuple, as_json: bool) -> int:
    report = []
    for hex32, space in sorted(spaces.items()):
        ns = space.namespace
        ranges = Counter(f"{u.first}-{u.end}" for u in space.units)
        report.append({
            "namespace": ns.hex if ns else hex32,
            "model": ns.model.name if ns else None,
            "revision": ns.model.revision if ns else None,
            "format_id": ns.format_id if ns else None,
            "kv_quant": ns.kv_quant if ns else None,
            "num_layers": ns.num_layers if ns else None,
            "authenticated": bool(ns.key_id) if ns else None,
            "units": len(space.units),
            "bytes": sum(u.nbytes for u in space.units),
            "keys": len({u.kd for u in space.units}),
            "layer_ranges": dict(sorted(ranges.items())),
            "problem": space.problem,
        })  # fmt: skip
    if as_json:
        print(json.dumps({"url": shown, "namespaces": report, "index_keys": counts[0],
                          "other_keys": counts[1]}, indent=1))  # fmt: skip
        return 0
    print(f"{shown}: {len(report)} namespace(s), {counts[1]} other key(s)")
    for item in report:
        print(f"  {item['namespace'][:16]}  model={item['model'] or '?'} "
              f"rev={item['revision'] or '-'} format={item['format_id'] or '?'} "
              f"layers={item['num_layers'] or '?'}"
              f"{' authenticated' if item['authenticated'] else ''}")  # fmt: skip
        print(f"    units={item['units']} bytes={item['bytes']} keys={item['keys']}")
        if item["layer_ranges"]:
            ranges = ", ".join(f"[{r}): {n}" for r, n in item["layer_ranges"].items())
            print(f"    layer ranges: {ranges}")
        if item["problem"]:
            print(f"    PROBLEM: {item['problem']}")
    return 0


def _problem(space: _Space, unit: _Unit, value: Any) -> str | None:
    """Why ``value`` is not the unit its key names (None: it is)."""
    if isinstance(value, Exception):
        return f"unreadable: {value}"
    if space.namespace is None:
        return f"not verifiable: {space.problem}"
    try:
        header, _ = decode_and_verify(
            value, namespace=space.namespace, first=unit.first, end=unit.end
        )
    except CorruptUnit as bad:
        return bad.reason
    return None if key_digest(header.key) == unit.kd else "unit is for another key"


def _verify(shown: str, spaces: dict[str, _Space], as_json: bool) -> int:
    bad, checked = [], 0
    for space in spaces.values():
        for node in {id(u.node): u.node for u in space.units}.values():
            mine = [u for u in space.units if u.node is node]
            for unit, value in zip(mine, _replies(node, [("GET", u.key) for u in mine])):
                if value is None:  # evicted or expired while we looked: not a bad unit
                    continue
                checked += 1
                why = _problem(space, unit, value)
                if why is not None:
                    bad.append({"key": unit.key.decode(), "reason": why})
    if as_json:
        print(json.dumps({"url": shown, "namespaces": len(spaces), "checked": checked,
                          "bad_count": len(bad), "bad": bad, "ok": not bad}, indent=1))  # fmt: skip
    else:
        print(f"{shown}: {checked} unit(s) in {len(spaces)} namespace(s) checked, {len(bad)} bad")
        for item in bad:
            print(f"BAD {item['key']}: {item['reason']}")
    return 1 if bad else 0


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
            positions = {}
            for node in {id(u.node): u.node for u in bucket}.values():
                mine = [u for u in bucket if u.node is node]
                got = _replies(node, [("GETRANGE", u.key, 32, 39) for u in mine])
                for unit, raw in zip(mine, got):
                    ok = isinstance(raw, bytes) and len(raw) == 8
                    positions[id(unit)] = int.from_bytes(raw, "little") if ok else 1 << 63
            bucket.sort(key=lambda u: positions[id(u)], reverse=True)
        for unit in bucket:
            if excess <= 0:
                return victims
            victims.append(unit)
            excess -= unit.nbytes
    return victims


def _gc(shown: str, spaces: dict[str, _Space], capacity: int, dry_run: bool, as_json: bool) -> int:
    units = [u for space in spaces.values() for u in space.units]
    victims = _victims(units, capacity)
    for node in {id(u.node): u.node for u in victims}.values() if not dry_run else ():
        mine = [u for u in victims if u.node is node]
        _replies(node, [c for u in mine for c in (
            ("DEL", u.key), ("ZREM", u.key.rsplit(b":", 1)[0] + b":idx", b"%d-%d" % (u.first, u.end))
        )])  # fmt: skip
    evicted = sum(u.nbytes for u in victims)
    left = sum(u.nbytes for u in units) - evicted
    if as_json:
        print(json.dumps({"url": shown, "capacity_bytes": capacity, "dry_run": dry_run,
                          "units_evicted": len(victims), "bytes_evicted": evicted,
                          "units_left": len(units) - len(victims), "bytes_left": left,
                          "evicted": [u.key.decode() for u in victims]}, indent=1))  # fmt: skip
        return 0
    print(f"{shown}: {'would evict' if dry_run else 'evicted'} {len(victims)} unit(s) "
          f"({evicted} bytes); {len(units) - len(victims)} unit(s), {left} bytes left "
          f"(capacity {capacity})")  # fmt: skip
    for unit in victims if dry_run else ():
        print(f"  {unit.key.decode()}  {unit.nbytes} bytes, idle {unit.idle_s} s")
    return 0


def run(
    command: str,
    url: str,
    *,
    as_json: bool = False,
    dry_run: bool = False,
    capacity: int | None = None,
    key_prefix: str = "ckv",
) -> int:
    """Run ``store stats|verify|gc`` against the Redis store at ``url``; the exit code.

    ``gc`` evicts least recently used units (tails first) until the units' server
    memory is at most ``capacity`` bytes; ``dry_run`` only lists them.
    """
    shown = redact_url(url)

    def fail(message: str) -> int:
        print(f"store {command}: {message}", file=sys.stderr)
        return 2

    if command not in ("stats", "verify", "gc"):
        return fail("expected a command: stats, verify or gc")
    if (capacity is None) == (command == "gc"):
        return fail("--capacity: expected with gc (bytes), and only with gc")
    if dry_run and command != "gc":
        return fail("--dry-run: only gc has it")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity < 0):  # fmt: skip
        return fail(f"--capacity: expected bytes >= 0, got {capacity!r}")
    try:
        spaces, indexes, others = _scan(_nodes(url), key_prefix, command == "gc")
        if command == "stats":
            return _stats(shown, spaces, (indexes, others), as_json)
        if command == "verify":
            return _verify(shown, spaces, as_json)
        return _gc(shown, spaces, capacity, dry_run, as_json)
    except (TypeError, ValueError, _Refused) as error:
        return fail(str(error))
    except (redis.RedisError, *_UNAVAILABLE) as error:
        return fail(f"{shown}: {type(error).__name__}: {error}")
