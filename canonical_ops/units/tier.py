"""The unit-store interface every adapter codes against, implemented once: batch-first (one
job moves many units, as vLLM's tiers do), every argument checked, refusals counted, one-unit
and inline forms. A store implements ``_lookup``, ``_store_units`` and ``_load_units``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checks import check_int, check_seconds, check_type
from .jobs import IOJob, JobOutcome, JobPool, run_inline
from .namespace import StoreNamespace
from .unit import MAX_POSITION, as_byte_view, key_digest, normalize_key, payload_view

__all__ = [
    "LoadItem",
    "LoadReq",
    "PageTier",
    "StoreItem",
    "StoreReq",
    "TierBase",
    "TierMetrics",
    "UnitStore",
    "batch_outcome",
]

DEFAULT_DEADLINE_S = 30.0


@dataclass(frozen=True)
class TierMetrics:
    """The counters every store reports (a snapshot since it started; each adds its own):
    ``stores_skipped``: the unit was already there (first writer wins); ``*_refused``:
    back-pressure or closed; ``hits``/``misses``: loads that did / did not fill their
    destination; ``corrupt_detected``: units that failed verification (each a miss)."""

    units_stored: int = 0
    bytes_stored: int = 0
    stores_skipped: int = 0
    stores_failed: int = 0
    stores_refused: int = 0
    units_loaded: int = 0
    bytes_loaded: int = 0
    loads_refused: int = 0
    lookups_refused: int = 0
    hits: int = 0
    misses: int = 0
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    corrupt_detected: int = 0


@dataclass(frozen=True)
class StoreItem:
    """One unit to store: ``payload`` (uint8 buffer, unchanged until the job finishes) holds
    layers ``[first, end)`` of ``key``; ``position`` is the block's index in its sequence
    (tails are evicted first); ``end`` defaults to what the payload's length implies."""

    key: Any
    first: int
    payload: Any
    position: int = 0
    end: int | None = None


@dataclass(frozen=True)
class LoadItem:
    """One unit to load: layers ``[first, end)`` of ``key`` into ``destination`` (writable
    uint8 buffer; it holds verified bytes only when the item's outcome is ``"ok"``)."""

    key: Any
    first: int
    end: int
    destination: Any


class StoreReq:
    """A checked :class:`StoreItem`: raw key, its digest ``kd``, range, position, payload bytes."""

    __slots__ = ("end", "first", "kd", "payload", "position", "raw_key")

    def __init__(self, raw_key: bytes, first: int, end: int, position: int, payload: memoryview):
        self.raw_key, self.first, self.end = raw_key, first, end
        self.position, self.payload, self.kd = position, payload, key_digest(raw_key)


class LoadReq:
    """A checked :class:`LoadItem`: raw key, its digest ``kd``, range, destination bytes."""

    __slots__ = ("dest", "end", "first", "kd", "raw_key")

    def __init__(self, raw_key: bytes, first: int, end: int, dest: memoryview):
        self.raw_key, self.first, self.end, self.dest = raw_key, first, end, dest
        self.kd = key_digest(raw_key)


_STATUS_ORDER = {"ok": 0, "miss": 1, "corrupt": 2, "error": 3}


def batch_outcome(outcomes: list[JobOutcome]) -> JobOutcome:
    """The outcome of a batch job: the worst status, the counts, each item's outcome."""
    counts: dict[str, int] = {}
    nbytes = 0
    for o in outcomes:  # one pass: this runs once per job on the I/O path
        counts[o.status] = counts.get(o.status, 0) + 1
        nbytes += o.nbytes
    worst = max(counts, key=_STATUS_ORDER.__getitem__, default="ok")
    detail = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    return JobOutcome(worst, nbytes=nbytes, detail=detail, value=outcomes)


class UnitStore:
    """Base of the unit stores: checked, batch-first jobs over three primitives.

    A subclass sets ``namespace``, calls :meth:`_init_base` (its counters' names) and, last
    in ``__init__``, :meth:`_attach_pool`; it implements ``_lookup(raw_keys, first, end, *,
    inline) -> int`` (``inline``: on the caller's thread), ``_store_units(reqs)`` and
    ``_load_units(reqs)`` (-> one JobOutcome per req) and ``metrics()``, and may override
    ``_close_resources()``."""

    namespace: StoreNamespace
    pool: JobPool
    _counts: dict[str, Any]

    def _init_base(self, counters: Sequence[str]) -> None:
        self._lock, self._closed = threading.Lock(), False
        self._counts = dict.fromkeys(counters, 0)

    # ------------------------------------------------------------------ the job pool

    @staticmethod
    def _pool_args(
        pool: Any, threads: Any, queue_depth: Any, deadline_s: Any = DEFAULT_DEADLINE_S
    ) -> tuple[int, int, float | None]:
        """Checked ``(threads, queue_depth, deadline_s)`` of an own pool (4, 64, 30 s)."""
        if pool is not None:
            check_type("pool", pool, JobPool)
            if threads is not None or queue_depth is not None:
                raise ValueError("threads, queue_depth: expected None (a shared pool has its own)")
            if deadline_s not in (DEFAULT_DEADLINE_S, pool.deadline_s):
                expected = f"the shared pool's ({pool.deadline_s})"
                raise ValueError(f"deadline_s: expected {expected}, got {deadline_s}")
        threads = 4 if threads is None else check_int("threads", threads, minimum=1)
        depth = 64 if queue_depth is None else check_int("queue_depth", queue_depth, minimum=1)
        return threads, depth, check_seconds("deadline_s", deadline_s, optional=True)

    def _attach_pool(
        self, pool: JobPool | None, threads: int, depth: int, name: str, deadline_s: float | None
    ) -> None:
        """The shared ``pool``, or an own one (closed by :meth:`close`). Called last in
        ``__init__``: a failed start-up leaves no threads behind."""
        self._own_pool = pool is None
        self.pool = pool or JobPool(threads, depth, name=name, deadline_s=deadline_s)

    # ------------------------------------------------------------------ argument checks

    @staticmethod
    def _keys(keys: Any) -> list[bytes]:
        if isinstance(keys, (str, bytes, bytearray, memoryview, int, np.integer)):
            raise TypeError("keys: expected a sequence of block keys, got a single key; wrap it")
        return [normalize_key(k) for k in keys]

    def _store_req(self, item: Any, name: str) -> StoreReq:
        if not isinstance(item, StoreItem):
            if not isinstance(item, (tuple, list)) or not 4 <= len(item) <= 5:
                raise TypeError(
                    f"{name}: expected a StoreItem or (key, first, payload, position[, end]), "
                    f"got {type(item).__name__}"
                )
            item = StoreItem(*item)
        raw_key = normalize_key(item.key)
        view = as_byte_view(item.payload, name=f"{name}.payload")
        first, end = item.first, item.end
        if end is None:
            ends = self.namespace.unit_ends(first, len(view))
            if len(ends) != 1:
                raise ValueError(
                    f"{name}.payload: {len(view)} bytes match no layer range starting at "
                    f"layer {first}"
                    if not ends
                    else f"{name}.end: {len(view)} bytes from layer {first} end at any of "
                    f"{ends} (empty layers); pass end"
                )
            end = ends[0]
        first, end = self.namespace.layer_range(first, end)
        view = payload_view(self.namespace, view, first, end, f"{name}.payload")
        position = check_int(f"{name}.position", item.position, minimum=0, maximum=MAX_POSITION)
        return StoreReq(raw_key, first, end, position, view)

    def _load_req(self, item: Any, name: str) -> LoadReq:
        if isinstance(item, LoadItem):
            key, first, end, destination = item.key, item.first, item.end, item.destination
        elif isinstance(item, (tuple, list)) and len(item) == 4:
            key, first, end, destination = item  # the adapters' form: no dataclass per unit
        else:
            raise TypeError(
                f"{name}: expected a LoadItem or (key, first, end, destination), "
                f"got {type(item).__name__}"
            )
        raw_key = normalize_key(key)
        first, end = self.namespace.layer_range(first, end)
        what = f"{name}.destination"
        dest = payload_view(self.namespace, destination, first, end, what, writable=True)
        return LoadReq(raw_key, first, end, dest)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    # ------------------------------------------------------------------ jobs

    def _batch(self, kind: str, items: Sequence[Any], single: bool, submit: bool) -> IOJob:
        """ONE job storing or loading ``items`` (``kind``), queued (``submit``) or run
        inline; ``single``: one item, and the job is its outcome."""
        self._check_open()
        name = "item" if single else "items[{}]"
        checked = self._store_req if kind == "store" else self._load_req
        work = self._store_units if kind == "store" else self._load_units
        reqs = [checked(item, name.format(i)) for i, item in enumerate(items)]
        if single:
            r = reqs[0]
            info = {"key": r.raw_key, "first": r.first, "end": r.end}
            job = self.pool.make_job(kind, lambda: work(reqs)[0], info)
        else:
            info = {"items": len(reqs), "keys": [r.raw_key for r in reqs]}
            job = self.pool.make_job(f"{kind}s", lambda: batch_outcome(work(reqs)), info)
        if not submit:
            return run_inline(job)
        job = self.pool.submit_job(job)
        if job.refused:
            self._count(f"{kind}s_refused", len(reqs))
        return job

    def lookup(self, keys: Sequence[Any], first: int, end: int) -> int:
        """Length of the prefix of ``keys`` (consecutive blocks) whose layers ``[first, end)``
        are stored, in any mix of layer ranges that covers them. Nothing is verified here:
        a load verifies. May touch disk or network on the caller's thread."""
        self._check_open()
        first, end = self.namespace.layer_range(first, end)
        return self._lookup(self._keys(keys), first, end, inline=True)

    def submit_lookup(self, keys: Sequence[Any], first: int, end: int) -> IOJob:
        """:meth:`lookup` on a pool thread; the job's ``value`` is the prefix length."""
        self._check_open()
        first, end = self.namespace.layer_range(first, end)
        raws = self._keys(keys)
        job = self.pool.submit(
            "lookup",
            lambda: JobOutcome("ok", value=self._lookup(raws, first, end, inline=False)),
            {"keys": raws, "first": first, "end": end},
        )
        if job.refused:
            self._count("lookups_refused")
        return job

    def submit_stores(self, items: Sequence[StoreItem | tuple]) -> IOJob:
        """Queue the store of several units as ONE job; never blocks. Its ``value``: one
        :class:`JobOutcome` per item, in order: ``"ok"`` once stored or already there (first
        writer wins, see ``detail``), ``"error"`` when nothing was stored. Its status is the
        worst of them, or at once ``"refused"`` (queue full) or later ``"expired"`` (deadline:
        count every item failed)."""
        return self._batch("store", items, False, True)

    def stores(self, items: Sequence[StoreItem | tuple]) -> IOJob:
        """:meth:`submit_stores`, run in the calling thread; returns the finished job."""
        return self._batch("store", items, False, False)

    def submit_loads(self, items: Sequence[LoadItem | tuple]) -> IOJob:
        """Queue the load of several units as ONE job; never blocks. Its ``value``: one
        :class:`JobOutcome` per item: ``"ok"`` (the destination holds the verified layers),
        ``"miss"`` (absent, or corrupt and quarantined: see ``detail``) or ``"error"``; on any
        other status the destination is undefined."""
        return self._batch("load", items, False, True)

    def loads(self, items: Sequence[LoadItem | tuple]) -> IOJob:
        """:meth:`submit_loads`, run in the calling thread; returns the finished job."""
        return self._batch("load", items, False, False)

    def submit_store(
        self, key: Any, first: int, payload: Any, position: int = 0, *, end: int | None = None
    ) -> IOJob:
        """Queue the store of one unit (:class:`StoreItem`); the job is its outcome."""
        return self._batch("store", [StoreItem(key, first, payload, position, end)], True, True)

    def store(
        self, key: Any, first: int, payload: Any, position: int = 0, *, end: int | None = None
    ) -> IOJob:
        """:meth:`submit_store`, run in the calling thread; returns the finished job."""
        return self._batch("store", [StoreItem(key, first, payload, position, end)], True, False)

    def submit_load(self, key: Any, first: int, end: int, destination: Any) -> IOJob:
        """Queue the load of one unit (:class:`LoadItem`); the job is its outcome."""
        return self._batch("load", [LoadItem(key, first, end, destination)], True, True)

    def load(self, key: Any, first: int, end: int, destination: Any) -> IOJob:
        """:meth:`submit_load`, run in the calling thread; returns the finished job."""
        return self._batch("load", [LoadItem(key, first, end, destination)], True, False)

    # ------------------------------------------------------------------ counters and upkeep

    def _count(self, name: str, n: float = 1, **more: float) -> None:
        """Add ``n`` to counter ``name`` and each of ``more`` (name=amount), under one lock."""
        with self._lock:
            self._counts[name] += n
            for key, amount in more.items():
                self._counts[key] += amount

    def poll(self) -> list[IOJob]:
        """Jobs finished since the last poll (of the pool: every store's if it is shared)."""
        return self.pool.poll()

    def wait(self, job: IOJob, timeout: float | None = None) -> IOJob:
        """Block until ``job`` is finished (``TimeoutError`` after ``timeout`` seconds)."""
        return self.pool.wait(job, timeout)

    def metrics(self) -> TierMetrics:  # pragma: no cover - every store overrides it
        raise NotImplementedError

    def _close_resources(self) -> None:
        """Release what the store holds (connections, descriptors); called once by close."""

    def close(self, *, cancel: bool = False) -> None:
        """Finish (or cancel) the queued jobs of an owned pool; no new jobs afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._own_pool:
            self.pool.close(cancel=cancel)
        self._close_resources()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


TierBase = PageTier = UnitStore  # the names of earlier releases
