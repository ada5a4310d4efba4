"""Keys of the Redis tier, and each block key's index of stored layer ranges.

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

The ``v1`` in every key is the unit format version (:data:`.encoding.FORMAT_VERSION`):
a reader of one format never sees, or deletes as corrupt, units of another.

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
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Sequence
from typing import Any

from .namespace import StoreNamespace
from .redis_wire import _Op
from .unit import FORMAT_VERSION

_RANGE = re.compile(rb"(\d{1,6})-(\d{1,6})")
# Parsed index members are remembered up to this many: the few splits a deployment uses.
_KNOWN_RANGES = 4096


def _digest(raw_key: bytes) -> str:
    """:func:`.files.key_digest` of an already normalized key (skips normalizing again)."""
    return hashlib.sha256(raw_key).hexdigest()[:32]


class _Keys:
    """The server keys of one namespace under one ``key_prefix`` (see the module docstring)."""

    def __init__(self, key_prefix: str, namespace: StoreNamespace) -> None:
        self.base = f"{key_prefix}:v{FORMAT_VERSION}:{{{namespace.hex[:32]}:"

    def tag(self, kd: str) -> str:
        return f"{self.base}{kd}}}"

    def unit(self, kd: str, first: int, end: int) -> str:
        return f"{self.base}{kd}}}:{first}-{end}"

    def chunks(self, kd: str, first: int, end: int, nonce: bytes, count: int) -> list[str]:
        base = f"{self.base}{kd}}}:{first}-{end}:{nonce.hex()}:"
        return [f"{base}{i}" for i in range(count)]

    def index(self, kd: str) -> str:
        return f"{self.base}{kd}}}:idx"


class _Ranges:
    """Index members parsed as layer ranges of a namespace (parsed once per member)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._known: dict[bytes, tuple[int, int]] = {}

    def parse(self, members: Any) -> set[tuple[int, int]]:
        """Index members as layer ranges; anything malformed is ignored (never trusted)."""
        out = set()
        if not isinstance(members, (list, tuple)):
            return out
        known = self._known
        for member in members:
            rng = known.get(member)
            if rng is None:
                if not isinstance(member, bytes):
                    continue
                match = _RANGE.fullmatch(member)
                if match is None:
                    continue
                first, end = int(match[1]), int(match[2])
                if not 0 <= first < end <= self.num_layers:
                    continue
                rng = (first, end)
                if len(known) < _KNOWN_RANGES:
                    known[member] = rng
            out.add(rng)
        return out


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


def _zrange(index: str, now_ms: float) -> _Op:
    """The index's ranges whose units have not expired (score = expiry, unix ms)."""
    return _Op("execute_command", "ZRANGE", index, f"{now_ms:.0f}", "+inf", "BYSCORE")


def index_ops(index: str, first: int, end: int, ttl_ms: int | None) -> list[_Op]:
    """The commands listing a stored unit ``[first, end)`` in ``index`` (after the unit)."""
    member = f"{first}-{end}".encode()
    now_ms = time.time() * 1000.0
    expiry = math.inf if ttl_ms is None else now_ms + ttl_ms
    # Raw commands (what redis-py's zadd, ... would send): a direct round trip takes them.
    ops = [
        _Op("execute_command", "ZADD", index, "GT", expiry, member),
        _Op("execute_command", "ZREMRANGEBYSCORE", index, "-inf", f"({now_ms:.0f}"),
    ]
    if ttl_ms is None:
        ops.append(_Op("execute_command", "PERSIST", index))
    else:  # NX: a new index gets the TTL; GT: an existing one only ever lives longer
        ops.append(_Op("execute_command", "PEXPIRE", index, ttl_ms, "NX"))
        ops.append(_Op("execute_command", "PEXPIRE", index, ttl_ms, "GT"))
    return ops


def lookup_ops(keys: _Keys, raws: Sequence[bytes], first: int, end: int) -> list[_Op]:
    """Per key: its index, and whether the exact unit is there (two commands per key).

    The index may still list a unit the server evicted; for the common case (the
    same split) the EXISTS makes the answer exact. Covers from other splits are
    not checked.
    """
    now_ms = time.time() * 1000.0
    ops = []
    for raw in raws:
        kd = _digest(raw)
        ops.append(_zrange(keys.index(kd), now_ms))
        ops.append(_Op("execute_command", "EXISTS", keys.unit(kd, first, end)))
    return ops


def covered_prefix(ranges: _Ranges, replies: Sequence[Any], first: int, end: int) -> int:
    """How many keys, from the first, :func:`lookup_ops`' replies say are covered."""
    found = 0
    for members, exists in zip(replies[0::2], replies[1::2]):
        if isinstance(members, Exception) or isinstance(exists, Exception):
            break
        stored = ranges.parse(members)
        if exists:
            stored.add((first, end))
        else:
            stored.discard((first, end))
        if _cover(stored, first, end) is None:
            break
        found += 1
    return found
