"""The round trips of one batched store and one batched load of the Redis tier.

:class:`.RedisStore` mixes these in; they use its ``namespace``, ``ttl_s``,
``max_value_bytes``, ``chunk_pending_s``, ``_connection``
(:class:`.redis_connection.RedisConnection`), ``_server_keys``
(:class:`.redis_index._Keys`), ``_ranges`` (:class:`.redis_index._Ranges`),
``_tls`` and ``_count``.

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
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

from .jobs import JobOutcome
from .redis_chunks import (
    MANIFEST_MAGIC,
    _copy_range,
    _Manifest,
    _Publish,
    parse_manifest,
    plan_values,
    scratch_buffer,
    verify_chunks,
)
from .redis_connection import _Unavailable
from .redis_index import _cover, _zrange, index_ops
from .redis_records import _LoadReq, _StoreReq
from .redis_wire import _deletes, _get, _Into, _Landed, _Op
from .unit import (
    MAGIC,
    CorruptUnit,
    PayloadVerifier,
    decode_and_verify,
    decode_header,
    header_length,
)

# Rounds of one batched load: exact + index, covering units, their chunks, and
# retries around units that turn out bad; each round resolves or excludes.
_MAX_LOAD_ROUNDS = 16


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


class _Publishing:
    """The store side of :class:`.RedisStore`: one batch published in one round trip."""

    def _store_units(self, reqs: list[_StoreReq]) -> list[JobOutcome]:
        """Publish ``reqs``: one round trip, and a second one only for chunked units."""
        ttl_ms = None if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        connection = self._connection
        ops: list[_Op] = []
        # The index is sent after every unit of the batch (same connection, or same
        # node: in order), so a reader that finds a range listed finds its unit unless
        # evicted since; and small commands do not sit between big values (measurably
        # slower for the server). Score = the unit's expiry: lookups skip expired ranges.
        index: list[_Op] = []
        single = [
            header_length(r.raw_key) + len(r.payload)
            for r in reqs
            if header_length(r.raw_key) + len(r.payload) <= self.max_value_bytes
        ]
        scratch = scratch_buffer(self._tls, 0 if connection.zero_copy else sum(single))
        plans = []
        for req in reqs:
            plan, scratch = plan_values(
                req,
                ops,
                namespace=self.namespace,
                keys=self._server_keys,
                max_value_bytes=self.max_value_bytes,
                zero_copy=connection.zero_copy,
                chunk_pending_s=self.chunk_pending_s,
                ttl_ms=ttl_ms,
                scratch=scratch,
            )
            index += index_ops(self._server_keys.index(req.kd), req.first, req.end, ttl_ms)
            plans.append(plan)
        try:
            replies = connection.roundtrip(ops + index, direct=True)
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
            replies = self._connection.roundtrip(ops)
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
            unit_key = self._server_keys.unit(req.kd, req.first, req.end)
            self._connection.cleanup(_deletes([unit_key, *plan.chunks]), 1)


class _Reading:
    """The load side of :class:`.RedisStore`: one batch in as few round trips as it needs."""

    def _land(self, req: _LoadReq, header: bytes, payload: memoryview) -> _Landed:
        """Verify the exact unit of ``req`` as it arrives; only then copy it into place."""
        try:
            unit = decode_header(
                header, namespace=self.namespace, key=req.raw_key, first=req.first, end=req.end
            )
            if unit.payload_length != len(payload):
                raise CorruptUnit(
                    f"payload of {len(payload)} bytes, header says {unit.payload_length}"
                )
            verifier = PayloadVerifier(unit)
            verifier.update(payload)
            verifier.finish()
        except CorruptUnit as bad:
            return _Landed(len(header) + len(payload), bad.reason)
        req.dest[:] = payload
        return _Landed(len(header) + len(payload), None)

    def _load_units(self, reqs: list[_LoadReq]) -> list[JobOutcome]:
        loads = [_Load(req) for req in reqs]
        cleanup: list[_Op] = []
        deleted = 0
        ns = self.namespace
        keys = self._server_keys
        roundtrip = functools.partial(self._connection.roundtrip, direct=True)
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
                cleanup.append(_Op("zrem", keys.index(ld.req.kd), member))
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
            key = keys.unit(ld.req.kd, *rng)
            if value is None:
                self._count("stale_removed")
                exclude(ld, rng, "vanished (evicted or expired)", [])
                return
            if isinstance(value, Exception):
                exclude(ld, rng, f"unreadable: {value}", [], unindex=False)
                return
            if isinstance(value, _Landed):  # the exact unit: verified and placed on arrival
                self._count("bytes_received", value.nbytes)
                if value.problem is not None:
                    self._count("corrupt_detected")
                    exclude(ld, rng, f"corrupt: {value.problem}", [key])
                    return
                ld.done.add(rng)
                self._count("units_loaded")
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
                    ld.manifests[rng] = parse_manifest(ns, ld.req.raw_key, rng, value)
                    return
                raise CorruptUnit(f"unknown value (starts {head!r})")
            except CorruptUnit as bad:
                self._count("corrupt_detected")
                exclude(ld, rng, f"corrupt: {bad.reason}", [key])

        def on_chunks(ld: _Load, rng: tuple[int, int], values: list[Any]) -> None:
            manifest = ld.manifests.pop(rng)
            chunk_keys = keys.chunks(ld.req.kd, *rng, manifest.nonce, manifest.payload_chunks + 1)
            unit_key = keys.unit(ld.req.kd, *rng)
            if any(v is None or isinstance(v, Exception) for v in values):
                self._count("stale_removed")
                exclude(ld, rng, "chunk vanished (evicted or expired)", [unit_key, *chunk_keys])
                return
            self._count("bytes_received", sum(len(v) for v in values))
            try:
                parts = verify_chunks(ns, ld.req.raw_key, rng, manifest, values)
            except CorruptUnit as bad:
                self._count("corrupt_detected")
                exclude(ld, rng, f"corrupt: {bad.reason}", [unit_key, *chunk_keys])
                return
            place(ld, rng, parts)

        try:
            # Round 1: the exact unit (the common case: same split) and the index, per item.
            now_ms = time.time() * 1000.0
            ops = []
            for ld in loads:
                r = ld.req
                head = header_length(r.raw_key)
                into = _Into(head, len(r.dest), functools.partial(self._land, r))
                ops.append(_get(keys.unit(r.kd, r.first, r.end), head + len(r.dest), into))
                ops.append(_zrange(keys.index(r.kd), now_ms))
            replies = roundtrip(ops)
            for i, ld in enumerate(loads):
                exact = (ld.req.first, ld.req.end)
                value, members = replies[2 * i], replies[2 * i + 1]
                ld.ranges = self._ranges.parse(members)
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
                            ops.append(_get(keys.unit(r.kd, *rng), size))
                            handlers.append((ld, rng, "unit", 1))
                        else:
                            chunk_keys = keys.chunks(
                                r.kd, *rng, manifest.nonce, manifest.payload_chunks + 1
                            )
                            ops += [_get(k, manifest.chunk_bytes) for k in chunk_keys]
                            handlers.append((ld, rng, "chunks", len(chunk_keys)))
                if not ops:
                    break
                replies = roundtrip(ops)
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
            self._connection.cleanup(cleanup, deleted)
        return outcomes
