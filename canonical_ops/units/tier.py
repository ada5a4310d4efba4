"""What every persistent tier shares: the interface StageCache drives, and its plumbing.

:class:`PageTier` is the shape :class:`~canonical_ops.frontend.tiers.StageCache`
drives (a :class:`~.files.FileStore`, a :class:`~.redis_store.RedisStore`, or
anything written like them), documented once here. :class:`TierBase` holds what
both stores implement the same way: the checks of a unit's arguments (block key,
layer range, payload or destination, position; every one names the argument and
what was expected), the counters' lock, and the job pool's poll / wait.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..checks import check_int
from .jobs import IOJob, JobPool
from .namespace import StoreNamespace
from .unit import as_byte_view, normalize_key

__all__ = ["PageTier", "TierBase", "TierMetrics"]

MAX_POSITION = (1 << 63) - 1  # positions travel as u64 in unit headers; int64 elsewhere


@dataclass(frozen=True)
class TierMetrics:
    """The counters every tier reports (a snapshot since it started); each tier adds its own.

    Attributes
    ----------
    units_stored, bytes_stored : int
        Units this store published (payload bytes).
    stores_skipped : int
        Stores that found the unit already there (another writer won: first writer wins).
    stores_failed : int
        Stores that failed (the tier's subclass says how).
    stores_refused, loads_refused : int
        Jobs refused by back-pressure (queue full) or after close.
    units_loaded, bytes_loaded : int
        Units read, verified and copied into destinations (payload bytes).
    hits, misses : int
        Loads that did / did not fill their destination.
    lookup_blocks, lookup_hit_blocks : int
        Keys asked about by ``lookup``, and found (the prefix).
    corrupt_detected : int
        Units that failed verification: each one a miss, never a load.
    """

    units_stored: int = 0
    bytes_stored: int = 0
    stores_skipped: int = 0
    stores_failed: int = 0
    stores_refused: int = 0
    units_loaded: int = 0
    bytes_loaded: int = 0
    loads_refused: int = 0
    hits: int = 0
    misses: int = 0
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    corrupt_detected: int = 0


@runtime_checkable
class PageTier(Protocol):
    """A persistent tier of canonical units (what :class:`StageCache` needs).

    A *unit* is one block's canonical pages of the layers ``[first, end)``, in
    layer order: exactly ``namespace.layer_bytes(first, end)`` bytes, a region
    row of the pipeline stage owning those layers. Every call that does I/O
    has a ``submit_*`` form that queues a job on the tier's bounded pool and
    never blocks (a full queue: the job is ``"refused"`` at once), and a plain
    form that runs it on the calling thread and returns the finished job.
    """

    namespace: StoreNamespace

    def lookup(self, keys: Sequence[Any], first: int, end: int) -> int:
        """Length of the prefix of ``keys`` whose layers ``[first, end)`` are stored.

        Any mix of stored layer ranges that covers ``[first, end)`` counts (units
        of other pipeline splits). Nothing is verified here: a load verifies.

        Parameters
        ----------
        keys : sequence of bytes | str | int
            Block keys of consecutive blocks, first block first.
        first, end : int
            Layer range the caller needs.
        """
        ...

    def submit_store(
        self, key: Any, first: int, payload: Any, position: int, *, end: int | None = None
    ) -> IOJob:
        """Queue the store of one unit; never blocks.

        Parameters
        ----------
        key : bytes | str | int
            Block key.
        first : int
            First layer of ``payload``.
        payload : buffer
            uint8, the canonical pages of layers ``[first, end)`` in layer
            order (a region row): ``namespace.layer_bytes(first, end)`` bytes.
            It must not change until the job is finished.
        position : int
            The block's index in its sequence (kept in the unit's header; tiers
            that evict by themselves drop tails first).
        end : int, optional
            One past the last layer; inferred from the payload length (needed
            only when empty layers make it ambiguous).

        Returns
        -------
        IOJob
            ``"ok"`` once stored (or already there, first writer wins: see
            ``detail``), ``"error"`` when nothing was stored, or ``"refused"``
            at once when the queue is full.
        """
        ...

    def store(
        self, key: Any, first: int, payload: Any, position: int, *, end: int | None = None
    ) -> IOJob:
        """:meth:`submit_store`, run in the calling thread; returns the finished job."""
        ...

    def submit_load(self, key: Any, first: int, end: int, destination: Any) -> IOJob:
        """Queue the load of layers ``[first, end)`` of ``key`` into ``destination``.

        Parameters
        ----------
        key : bytes | str | int
        first, end : int
            Layer range; any stored split that covers it will do.
        destination : writable buffer
            uint8, exactly ``namespace.layer_bytes(first, end)`` bytes (a region
            row or a slice of one). It holds the layers, verified, only when the
            job finishes ``"ok"``; after any other status its bytes are
            undefined and must not be reported loaded.

        Returns
        -------
        IOJob
            ``"ok"``, ``"miss"`` (absent or corrupt: see ``detail``), ``"error"``
            or, at once, ``"refused"``.
        """
        ...

    def load(self, key: Any, first: int, end: int, destination: Any) -> IOJob:
        """:meth:`submit_load`, run in the calling thread; returns the finished job."""
        ...

    def metrics(self) -> TierMetrics:
        """A consistent snapshot of the tier's counters."""
        ...

    def poll(self) -> list[IOJob]:
        """Jobs finished since the last poll (of the pool: every tier's if it is shared)."""
        ...

    def wait(self, job: IOJob, timeout: float | None = None) -> IOJob:
        """Block until ``job`` is finished (``TimeoutError`` after ``timeout`` seconds)."""
        ...

    def close(self, *, cancel: bool = False) -> None:
        """Finish (or cancel) queued jobs of an owned pool; no new jobs afterwards."""
        ...


class TierBase:
    """The parts :class:`~.files.FileStore` and :class:`~.redis_store.RedisStore` share.

    A subclass sets ``namespace``, ``pool`` (a :class:`JobPool`) and
    ``_counts`` (counter name -> number) in its ``__init__`` after calling
    :meth:`_init_base`.
    """

    namespace: StoreNamespace
    pool: JobPool
    _counts: dict[str, Any]

    def _init_base(self) -> None:
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ the job pool

    @staticmethod
    def _pool_args(pool: Any, threads: Any, queue_depth: Any) -> tuple[int, int]:
        """Checked ``(threads, queue_depth)`` of an own pool (defaults 4 and 64)."""
        if pool is not None:
            if not isinstance(pool, JobPool):
                raise TypeError(f"pool: expected a JobPool, got {type(pool).__name__}")
            if threads is not None or queue_depth is not None:
                raise ValueError(
                    "threads, queue_depth: expected None with a shared pool (it has its own)"
                )
        threads = 4 if threads is None else check_int("threads", threads, minimum=1)
        queue_depth = (
            64 if queue_depth is None else check_int("queue_depth", queue_depth, minimum=1)
        )
        return threads, queue_depth

    def _attach_pool(self, pool: JobPool | None, threads: int, queue_depth: int, name: str) -> None:
        """The shared ``pool``, or an own one (closed by :meth:`close`). Called last in
        ``__init__``: a failed start-up leaves no threads behind."""
        self._own_pool = pool is None
        self.pool = pool if pool is not None else JobPool(threads, queue_depth, name=name)

    # ------------------------------------------------------------------ argument checks

    def _range(self, first: Any, end: Any) -> tuple[int, int]:
        self.namespace.layer_bytes(first, end)  # validates, naming first / end
        return int(first), int(end)

    @staticmethod
    def _keys(keys: Any) -> list[bytes]:
        if isinstance(keys, (str, bytes, bytearray, memoryview, int, np.integer)):
            raise TypeError("keys: expected a sequence of block keys, got a single key; wrap it")
        return [normalize_key(k) for k in keys]

    def _store_args(
        self, key: Any, first: Any, payload: Any, position: Any, end: Any, name: str = ""
    ) -> tuple[bytes, int, int, int, memoryview]:
        """``(raw key, first, end, position, payload bytes)`` of one unit to store, checked.

        ``name`` prefixes the argument names in messages (``"items[3]"``).
        """
        prefix = f"{name}." if name else ""
        raw_key = normalize_key(key)
        view = as_byte_view(payload, name=f"{prefix}payload")
        if end is None:
            ends = self.namespace.unit_ends(first, len(view))
            if len(ends) != 1:
                raise ValueError(
                    f"{prefix}payload: {len(view)} bytes match no layer range starting at "
                    f"layer {first}"
                    if not ends
                    else f"{prefix}end: {len(view)} bytes from layer {first} end at any of "
                    f"{ends} (empty layers); pass end"
                )
            end = ends[0]
        first, end = self._range(first, end)
        expected = self.namespace.layer_bytes(first, end)
        if len(view) != expected:
            raise ValueError(
                f"{prefix}payload: expected {expected} bytes (layers [{first}, {end})), "
                f"got {len(view)}"
            )
        position = check_int(f"{prefix}position", position, minimum=0, maximum=MAX_POSITION)
        return raw_key, first, end, position, view

    def _load_args(
        self, key: Any, first: Any, end: Any, destination: Any, name: str = ""
    ) -> tuple[bytes, int, int, memoryview]:
        """``(raw key, first, end, destination bytes)`` of one unit to load, checked."""
        prefix = f"{name}." if name else ""
        raw_key = normalize_key(key)
        first, end = self._range(first, end)
        view = as_byte_view(destination, writable=True, name=f"{prefix}destination")
        expected = self.namespace.layer_bytes(first, end)
        if len(view) != expected:
            raise ValueError(
                f"{prefix}destination: expected {expected} bytes (layers [{first}, {end})), "
                f"got {len(view)}"
            )
        return raw_key, first, end, view

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    # ------------------------------------------------------------------ counters and jobs

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def poll(self) -> list[IOJob]:
        """Jobs finished since the last poll (of the pool: every tier's if it is shared)."""
        return self.pool.poll()

    def wait(self, job: IOJob, timeout: float | None = None) -> IOJob:
        """Block until ``job`` is finished (``TimeoutError`` after ``timeout`` seconds)."""
        return self.pool.wait(job, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, *, cancel: bool = False) -> None:  # pragma: no cover - overridden
        raise NotImplementedError
