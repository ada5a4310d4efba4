"""Scheduler-side tiering of one pipeline stage: its region first, then persistent tiers.

An engine without vLLM keeps recently used canonical pages in a shared CPU
region (:class:`~.shared_region.SharedOffloadRegion`, bookkept by a
:class:`~.page_manager.PageManager`) and, behind it, any number of
*persistent tiers*: a :class:`~.store.FileStore` directory, a
:class:`~.store.RedisStore` shared by many nodes. :class:`StageCache` is the
scheduler's view of both for ONE pipeline stage (the layers ``[first, end)``
it owns; see :func:`pp_layer_range`):

``lookup(hashes)``
    How many leading blocks are ready in the region, and how many more the
    tiers can supply (nearest tier first, run by run: a prefix may be half in
    files, half in Redis).
``fetch(hashes)``
    For the blocks only the tiers hold: allocate region pages *filled by a
    tier* (``PageManager.allocate(..., filler=)``) and submit the tier loads
    straight into those rows. A page turns ready only when its unit was read
    and verified (``complete_fill``); a missing, corrupt or failed unit frees
    the page again (``fail_fill``): a bad block is a miss, never a load.
``persist(hashes)``
    Write-through: for each block ready in the region, submit a store of its
    region row (the stage's unit) to every tier (but the one it came from).
    The page is pinned until its stores finish, so it is not evicted and
    reused while a tier reads it.
``promote(hashes)``
    For blocks just filled from a farther tier, the same stores into the
    nearer tiers only (what came from Redis is kept in the local files).
``poll()``
    Never blocks: collects finished tier jobs, turns fills ready or free,
    releases the pins of finished stores, counts everything.

From there, the existing path moves region <-> KV: ranks'
:class:`~.worker.OffloadWorker` ``load`` / ``store`` by page id. I/O never
runs on the caller's thread: every tier call here submits a job to the tier's
bounded pool and returns; a full queue is a refused job (back-pressure), not
a wait. The engine keeps serving when a tier fails: a tier call that raises,
a store that fails (full disk) or a load that misses is counted and the
block is simply not persisted / not fetched.

Tiers
-----
:class:`~.store.tier.PageTier` (a :class:`~.store.FileStore`, a
:class:`~.store.RedisStore`, or anything shaped like them): ``namespace``,
``lookup(keys, first, end) -> int``, ``submit_load(key, first, end,
destination) -> IOJob``, ``submit_store(key, first, payload, position, *,
end=None) -> IOJob``, ``wait(job, timeout)``, ``metrics()``. A tier that also
has the batch forms ``submit_loads(items)`` / ``submit_stores(items)`` (items
``(key, first, end, destination)`` / ``(key, first, payload, position,
end)``, one job whose ``value`` lists one outcome per item) gets one job per
call instead of one per block. Block hashes must be keys the tiers accept
(bytes, str or int: :func:`~.store.normalize_key`).

Thread safety: a StageCache is driven by one scheduler thread (the tiers'
pool threads only touch region rows and their own jobs).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checks import check_int
from ..units.jobs import IOJob
from ..units.namespace import StoreNamespace
from ..units.unit import as_byte_view, normalize_key
from .pages import PageCapacityError, PageManager, PageStateError

__all__ = [
    "FetchResult",
    "PersistResult",
    "StageCache",
    "StageCacheMetrics",
    "TierCounters",
    "TierEvent",
    "TierLookup",
    "pp_layer_range",
    "pp_layer_ranges",
]


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[first, end)`` of pipeline stage ``pp_rank`` of ``pp_size``: vLLM's split.

    As ``vllm.distributed.utils.get_pp_indices`` without
    ``VLLM_PP_LAYER_PARTITION``: every stage gets ``num_layers // pp_size``
    layers, and the ``num_layers % pp_size`` remaining ones go one each to the
    stages before the last, from the second-to-last backwards (the first and
    last stages also hold the embedding and the LM head).

    Raises
    ------
    ValueError
        ``pp_size`` larger than ``num_layers`` (a stage without layers) or a
        rank outside ``[0, pp_size)``.
    """
    num_layers = check_int("num_layers", num_layers, minimum=1)
    pp_size = check_int("pp_size", pp_size, minimum=1, maximum=num_layers)
    pp_rank = check_int("pp_rank", pp_rank, minimum=0, maximum=pp_size - 1)
    partitions = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        partitions[-i] += 1
    first = sum(partitions[:pp_rank])
    return first, first + partitions[pp_rank]


def pp_layer_ranges(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Every stage's :func:`pp_layer_range`, stage 0 first."""
    return [pp_layer_range(num_layers, rank, pp_size) for rank in range(pp_size)]


# ---------------------------------------------------------------------- records


@dataclass(frozen=True)
class TierLookup:
    """Where the leading blocks of a request are.

    Attributes
    ----------
    in_region : int
        Leading blocks ready in the region.
    from_tiers : int
        Blocks right after those that the tiers can supply (not verified yet:
        a fetch verifies).
    sources : tuple[int, ...]
        For each of those ``from_tiers`` blocks, the index of the tier that has it.
    """

    in_region: int
    from_tiers: int
    sources: tuple[int, ...]

    @property
    def total(self) -> int:
        """Leading blocks available from the region or the tiers."""
        return self.in_region + self.from_tiers


@dataclass(frozen=True)
class FetchResult:
    """What :meth:`StageCache.fetch` started.

    Attributes
    ----------
    submitted : int
        Tier loads submitted into newly allocated region pages.
    present : int
        Blocks already in the region (ready, being stored or being filled).
    refused : int
        Blocks not fetched now: the tier refused the job (queue full, closed,
        failing) or the region had no page to spare.
    pages : tuple[int | None, ...]
        Aligned with the fetched blocks (``hashes[in_region:total]``): the
        region page each is being filled into, None when not submitted.
    """

    submitted: int
    present: int
    refused: int
    pages: tuple[int | None, ...]


@dataclass(frozen=True)
class PersistResult:
    """What :meth:`StageCache.persist` started.

    Attributes
    ----------
    submitted : int
        Tier stores submitted (one per block and tier).
    not_ready : int
        Blocks skipped because they are not ready in the region.
    refused : int
        Stores refused by a tier (queue full, closed, failing).
    skipped : int
        Stores not submitted because the block came from that very tier (for
        :meth:`StageCache.promote`: per block, the tiers not nearer than its source).
    """

    submitted: int
    not_ready: int
    refused: int
    skipped: int


@dataclass(frozen=True)
class TierEvent:
    """One block's finished tier operation, as :meth:`StageCache.poll` reports it.

    ``kind`` is ``"fill"`` or ``"store"``; ``status`` is the tier's
    (``"ok"``, ``"miss"``, ``"error"``, ``"refused"``, ``"cancelled"``).
    """

    kind: str
    block_hash: Hashable
    page_id: int
    tier: str
    status: str
    detail: str = ""


@dataclass(frozen=True)
class TierCounters:
    """What one stage did with one tier (a snapshot; the tier's own counters are apart).

    Attributes
    ----------
    name : str
    lookup_hit_blocks : int
        Blocks this tier was chosen to supply by :meth:`StageCache.lookup`.
    fills_submitted, fills_ok, fills_missed, fills_failed, fills_refused : int
        Region pages filled from this tier: submitted, verified and ready
        (hits), absent or corrupt (misses), I/O errors, refused.
    bytes_filled : int
    stores_submitted, stores_ok, stores_failed, stores_refused : int
        Region rows persisted to this tier (ok includes "already stored").
    bytes_stored : int
    errors : int
        Tier calls that raised (the tier is failing; the engine went on).
    last_error : str
    """

    name: str
    lookup_hit_blocks: int = 0
    fills_submitted: int = 0
    fills_ok: int = 0
    fills_missed: int = 0
    fills_failed: int = 0
    fills_refused: int = 0
    bytes_filled: int = 0
    stores_submitted: int = 0
    stores_ok: int = 0
    stores_failed: int = 0
    stores_refused: int = 0
    bytes_stored: int = 0
    errors: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class StageCacheMetrics:
    """A snapshot of a :class:`StageCache`.

    Attributes
    ----------
    layers : tuple[int, int]
    lookup_blocks : int
        Blocks asked about by :meth:`StageCache.lookup`.
    region_hit_blocks, tier_hit_blocks, miss_blocks : int
        Of those: ready in the region, suppliable by a tier, neither.
    fills_in_flight, stores_in_flight : int
    tiers : tuple[TierCounters, ...]
        This stage's counters per tier, in tier order.
    """

    layers: tuple[int, int]
    lookup_blocks: int
    region_hit_blocks: int
    tier_hit_blocks: int
    miss_blocks: int
    fills_in_flight: int
    stores_in_flight: int
    tiers: tuple[TierCounters, ...]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Op:
    """One block's part of a submitted tier job."""

    __slots__ = ("block_hash", "generation", "nbytes", "page", "position")

    def __init__(
        self, block_hash: Hashable, page: int, generation: int, nbytes: int, position: int = 0
    ) -> None:
        self.block_hash, self.page, self.generation = block_hash, page, generation
        self.nbytes, self.position = nbytes, position


class _Flight:
    """A submitted tier job and the blocks it carries (one, or a batch)."""

    __slots__ = ("batch", "job", "kind", "ops", "tier")

    def __init__(self, kind: str, tier: int, job: IOJob, ops: list[_Op], batch: bool) -> None:
        self.kind, self.tier, self.job, self.ops, self.batch = kind, tier, job, ops, batch


def _tier_name(tier: Any, index: int) -> str:
    return f"{index}:{type(tier).__name__}"


# ---------------------------------------------------------------------- the cache


class StageCache:
    """Region pages of one pipeline stage, backed by persistent tiers (see the module docstring).

    Parameters
    ----------
    manager : PageManager
        The stage's page bookkeeping; page ``p`` is region row ``p``.
    region : SharedOffloadRegion | torch.Tensor | numpy.ndarray
        The stage's region (an object with ``.tensor``), or its rows: uint8,
        ``(manager.num_pages, row_bytes)``, C-contiguous, in CPU memory
        (pinned is fine). A row is exactly the stage's unit:
        ``namespace.layer_bytes(first, end)`` bytes.
    layers : tuple[int, int]
        ``(first, end)``: the stage's layers (:func:`pp_layer_range`).
    namespace : StoreNamespace
        Built from ALL layers of the model (every stage builds the same one);
        every tier must use it.
    tiers : sequence of tiers
        Persistent tiers, looked up in order (e.g. a FileStore, then Redis).
        The cache never closes them (several stages may share one tier).
    names : sequence of str, optional
        Tier names for metrics and events (default ``"<index>:<class>"``).
    """

    def __init__(
        self,
        manager: PageManager,
        region: Any,
        layers: tuple[int, int],
        namespace: StoreNamespace,
        tiers: Sequence[Any] = (),
        *,
        names: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(manager, PageManager):
            raise TypeError(f"manager: expected a PageManager, got {type(manager).__name__}")
        if not isinstance(namespace, StoreNamespace):
            raise TypeError(f"namespace: expected a StoreNamespace, got {type(namespace).__name__}")
        if not isinstance(layers, (tuple, list)) or len(layers) != 2:
            raise TypeError(f"layers: expected (first, end), got {layers!r}")
        first = check_int("layers[0]", layers[0], minimum=0, maximum=namespace.num_layers - 1)
        end = check_int("layers[1]", layers[1], minimum=first + 1, maximum=namespace.num_layers)
        self.manager = manager
        self.namespace = namespace
        self.first, self.end = first, end
        self.row_bytes = namespace.layer_bytes(first, end)
        self.tiers = list(tiers)
        for i, tier in enumerate(self.tiers):
            missing = [
                m for m in ("lookup", "submit_load", "submit_store", "wait") if not hasattr(tier, m)
            ]
            if missing:
                raise TypeError(f"tiers[{i}]: expected a tier (FileStore-like), lacks {missing}")
            tier_ns = getattr(tier, "namespace", None)
            if not isinstance(tier_ns, StoreNamespace) or tier_ns.digest != namespace.digest:
                raise ValueError(
                    f"tiers[{i}]: expected a tier of namespace {namespace.hex[:16]}..., got "
                    f"{tier_ns.hex[:16] + '...' if isinstance(tier_ns, StoreNamespace) else tier_ns!r}"
                )
        if names is None:
            names = [_tier_name(tier, i) for i, tier in enumerate(self.tiers)]
        names = list(names)
        if len(names) != len(self.tiers) or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"names: expected {len(self.tiers)} non-empty names, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"names: expected distinct names, got {names!r}")
        self.names = names
        self.rows = self._rows(region)
        self._filler = f"stage[{first},{end})"
        self._counts = [dict.fromkeys(self._counter_names(), 0) for _ in self.tiers]
        self._last_error = [""] * len(self.tiers)
        self._lookup = dict(blocks=0, region=0, tiers=0, misses=0)
        self._flights: list[_Flight] = []
        # page -> (generation, tier index) of pages filled from a tier: never stored back there.
        self._origin: dict[int, tuple[int, int]] = {}

    @staticmethod
    def _counter_names() -> list[str]:
        return [
            f.name for f in dataclasses.fields(TierCounters) if f.name not in ("name", "last_error")
        ]

    def _rows(self, region: Any) -> np.ndarray:
        tensor = getattr(region, "tensor", region)
        try:
            flat = as_byte_view(tensor, writable=True, name="region")
        except (TypeError, ValueError) as error:
            raise type(error)(
                f"region: expected a region or its uint8 rows in CPU memory ({error})"
            ) from None
        shape = tuple(getattr(tensor, "shape", ()))
        expected = (self.manager.num_pages, self.row_bytes)
        if shape != expected or len(flat) != expected[0] * expected[1]:
            raise ValueError(
                f"region: expected rows of shape {expected} (one per page of the manager, each "
                f"the stage's layers [{self.first}, {self.end}): {self.row_bytes} bytes), got "
                f"{shape}"
            )
        return np.frombuffer(flat, dtype=np.uint8).reshape(expected)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _hashes(hashes: Any) -> list[Hashable]:
        if isinstance(hashes, (str, bytes, bytearray, memoryview, int)):
            raise TypeError("hashes: expected a sequence of block hashes, got a single one")
        out = list(hashes)
        for i, h in enumerate(out):
            try:
                normalize_key(h)
            except (TypeError, ValueError) as error:
                raise type(error)(f"hashes[{i}]: {error}") from None
        return out

    def _failed_call(self, tier: int, error: BaseException) -> None:
        self._counts[tier]["errors"] += 1
        self._last_error[tier] = f"{type(error).__name__}: {error}"

    # ------------------------------------------------------------------ lookup

    def lookup(self, hashes: Sequence[Hashable]) -> TierLookup:
        """Leading blocks ready in the region, then how many more the tiers hold.

        Region pages of the ready prefix are touched (recency), as
        :meth:`PageManager.lookup` does. Past it, each tier is asked for the
        prefix it holds of the stage's layers; the longest answer wins, and
        the search goes on after it (tiers may hold different stretches). A
        tier whose lookup raises counts as holding nothing.

        Parameters
        ----------
        hashes : sequence of bytes | str | int
            Block hashes of consecutive blocks, first block first.
        """
        self._check_open()
        hashes = self._hashes(hashes)
        in_region = self.manager.lookup(hashes)
        position, sources = in_region, []
        while position < len(hashes) and self.tiers:
            # Nearest tier first (local files before a shared server): a farther tier is
            # asked only where every nearer one stops.
            run, source = 0, -1
            rest = hashes[position:]
            for t, tier in enumerate(self.tiers):
                try:
                    found = int(tier.lookup(rest, self.first, self.end))
                except Exception as error:  # a failing tier holds nothing; the engine goes on
                    self._failed_call(t, error)
                    continue
                if found > 0:
                    run, source = min(found, len(rest)), t
                    break
            if run == 0:
                break
            self._counts[source]["lookup_hit_blocks"] += run
            sources += [source] * run
            position += run
        self._lookup["blocks"] += len(hashes)
        self._lookup["region"] += in_region
        self._lookup["tiers"] += len(sources)
        self._lookup["misses"] += len(hashes) - in_region - len(sources)
        return TierLookup(in_region, len(sources), tuple(sources))

    # ------------------------------------------------------------------ fetch

    def _allocate_fills(self, targets: list[Hashable]) -> list[int | None]:
        """Fill pages for the longest prefix of ``targets`` the region can hold now."""
        count = len(targets)
        while count > 0:
            try:
                pages = self.manager.allocate(targets[:count], filler=self._filler)
            except PageCapacityError as error:
                available = error.free + error.expired + error.evictable
                count -= max(1, error.needed - available)
                continue
            return pages + [None] * (len(targets) - count)
        return [None] * len(targets)

    def fetch(self, hashes: Sequence[Hashable], found: TierLookup | None = None) -> FetchResult:
        """Start filling region pages from the tiers for the blocks only the tiers hold.

        Parameters
        ----------
        hashes : sequence of bytes | str | int
            Block hashes of consecutive blocks, first block first (as for
            :meth:`lookup`).
        found : TierLookup, optional
            This call's :meth:`lookup` result, to avoid asking the tiers twice;
            default: look up now.

        Returns
        -------
        FetchResult
            The pages turn ready (or free, on a miss) in later :meth:`poll`
            calls; ``PageManager.lookup`` then reports the ready prefix.

        Notes
        -----
        Pages are allocated like any other (free first, then least recently
        used ready pages); when the region cannot hold every block, the
        leading ones are fetched. A block already present in the region
        (ready, being stored or filled) is not fetched again.
        """
        self._check_open()
        hashes = self._hashes(hashes)
        if found is None:
            found = self.lookup(hashes)
        elif not isinstance(found, TierLookup):
            raise TypeError(f"found: expected a TierLookup, got {type(found).__name__}")
        if found.total > len(hashes):
            raise ValueError(
                f"found: covers {found.total} blocks, more than the {len(hashes)} hashes given"
            )
        targets = hashes[found.in_region : found.total]
        pages = self._allocate_fills(targets)
        present = refused = submitted = 0
        by_tier: dict[int, list[_Op]] = {}
        for block_hash, page, source in zip(targets, pages, found.sources):
            if page is None:
                if self.manager.page_of(block_hash) is not None:
                    present += 1
                else:
                    refused += 1  # no page to spare now
                continue
            op = _Op(block_hash, page, self.manager.generation(page), self.row_bytes)
            by_tier.setdefault(source, []).append(op)
        placed: set[int] = set()
        for tier_index, ops in by_tier.items():
            accepted = self._submit_fills(tier_index, ops)
            submitted += len(accepted)
            refused += len(ops) - len(accepted)
            placed.update(op.page for op in accepted)
        pages_out = tuple(p if p is not None and p in placed else None for p in pages)
        return FetchResult(submitted, present, refused, pages_out)

    def _submit_fills(self, tier_index: int, ops: list[_Op]) -> list[_Op]:
        """Submit loads of ``ops`` into their rows; pages of refused ones are freed at once."""
        tier = self.tiers[tier_index]
        counts = self._counts[tier_index]
        counts["fills_submitted"] += len(ops)
        items = [(op.block_hash, self.first, self.end, self.rows[op.page]) for op in ops]
        flights: list[_Flight] = []
        try:
            if hasattr(tier, "submit_loads") and len(ops) > 1:
                flights.append(_Flight("fill", tier_index, tier.submit_loads(items), ops, True))
            else:
                for op, item in zip(ops, items):
                    flights.append(
                        _Flight("fill", tier_index, tier.submit_load(*item), [op], False)
                    )
        except Exception as error:  # a failing tier: what was not submitted is a miss now
            self._failed_call(tier_index, error)
        accepted: list[_Op] = []
        for flight in flights:
            if flight.job.status == "refused":
                for op in flight.ops:
                    self._end_fill(tier_index, op, ok=False)
                counts["fills_refused"] += len(flight.ops)
                continue
            self._flights.append(flight)
            accepted += flight.ops
        submitted = {id(op) for flight in flights for op in flight.ops}
        for op in ops:
            if id(op) not in submitted:  # the call raised before this one was submitted
                self._end_fill(tier_index, op, ok=False)
                counts["fills_refused"] += 1
        return accepted

    def _end_fill(self, tier_index: int, op: _Op, *, ok: bool) -> None:
        # Fills end only here, exactly once: a PageStateError would be a bug, let it out.
        if ok:
            self.manager.complete_fill(op.page, generation=op.generation)
            self._origin[op.page] = (op.generation, tier_index)
        else:
            self.manager.fail_fill(op.page, generation=op.generation)

    # ------------------------------------------------------------------ persist

    def persist(
        self, hashes: Sequence[Hashable], positions: Sequence[int] | None = None
    ) -> PersistResult:
        """Write-through: store the region row of every ready block to every tier.

        Parameters
        ----------
        hashes : sequence of bytes | str | int
            Block hashes (any blocks; those not ready in the region are skipped).
        positions : sequence of int, optional
            Each block's index in its sequence (tail-first eviction in the
            tiers); default ``0, 1, ...``: ``hashes`` is a request's prefix.

        Returns
        -------
        PersistResult
            The stores finish in later :meth:`poll` calls; until then each
            page is pinned (not evicted, not reused).
        """
        return self._write_through(hashes, positions, nearer_only=False)

    def promote(
        self, hashes: Sequence[Hashable], positions: Sequence[int] | None = None
    ) -> PersistResult:
        """Copy blocks filled from a farther tier into the nearer ones (e.g. Redis hits into
        the local files), so that the next restart of this node finds them without the network.

        Only pages filled by :meth:`fetch` from tier ``t`` (and not reused since) are
        stored, and only to tiers ``0 .. t-1``; every other block counts as ``skipped``
        (nothing to promote) or ``not_ready``. Parameters and result as :meth:`persist`.
        """
        return self._write_through(hashes, positions, nearer_only=True)

    def _write_through(
        self, hashes: Sequence[Hashable], positions: Sequence[int] | None, *, nearer_only: bool
    ) -> PersistResult:
        self._check_open()
        hashes = self._hashes(hashes)
        if positions is None:
            positions = range(len(hashes))
        positions = [
            check_int(f"positions[{i}]", p, minimum=0, maximum=(1 << 63) - 1)
            for i, p in enumerate(positions)
        ]
        if len(positions) != len(hashes):
            raise ValueError(
                f"positions: expected one per hash ({len(hashes)}), got {len(positions)}"
            )
        not_ready = refused = skipped = submitted = 0
        per_tier: dict[int, list[tuple[_Op, int]]] = {}
        for block_hash, position in zip(hashes, positions):
            page = self.manager.page_of(block_hash)
            if page is None or self.manager.state(page) != "ready":
                not_ready += 1
                continue
            generation = self.manager.generation(page)
            origin = self._origin.get(page)
            source = origin[1] if origin is not None and origin[0] == generation else None
            if nearer_only:
                targets = range(source if source is not None else 0)
                skipped += len(self.tiers) - len(targets)
            else:
                targets = [t for t in range(len(self.tiers)) if t != source]
                skipped += source is not None  # it came from there
            for t in targets:
                try:
                    self.manager.acquire([block_hash])  # pinned while the tier reads the row
                except PageStateError:
                    not_ready += 1
                    break
                op = _Op(block_hash, page, generation, self.row_bytes, position)
                per_tier.setdefault(t, []).append((op, position))
        for t, entries in per_tier.items():
            accepted = self._submit_stores(t, entries)
            submitted += accepted
            refused += len(entries) - accepted
        return PersistResult(submitted, not_ready, refused, skipped)

    def _submit_stores(self, tier_index: int, entries: list[tuple[_Op, int]]) -> int:
        tier = self.tiers[tier_index]
        counts = self._counts[tier_index]
        counts["stores_submitted"] += len(entries)
        flights: list[_Flight] = []
        try:
            if hasattr(tier, "submit_stores") and len(entries) > 1:
                items = [
                    (op.block_hash, self.first, self.rows[op.page], pos, self.end)
                    for op, pos in entries
                ]
                job = tier.submit_stores(items)
                flights.append(_Flight("store", tier_index, job, [op for op, _ in entries], True))
            else:
                for op, pos in entries:
                    job = tier.submit_store(
                        op.block_hash, self.first, self.rows[op.page], pos, end=self.end
                    )
                    flights.append(_Flight("store", tier_index, job, [op], False))
        except Exception as error:  # a failing tier: the rest is not persisted now
            self._failed_call(tier_index, error)
        accepted = 0
        submitted = {id(op) for flight in flights for op in flight.ops}
        for flight in flights:
            if flight.job.status == "refused":
                self.manager.release([op.page for op in flight.ops])
                counts["stores_refused"] += len(flight.ops)
                continue
            self._flights.append(flight)
            accepted += len(flight.ops)
        unsent = [op.page for op, _ in entries if id(op) not in submitted]
        if unsent:
            self.manager.release(unsent)
            counts["stores_refused"] += len(unsent)
        return accepted

    # ------------------------------------------------------------------ completion

    def poll(self) -> list[TierEvent]:
        """Collect finished tier jobs (never blocks): fills turn ready or free, pins drop.

        Returns
        -------
        list[TierEvent]
            One per block whose fill or store finished since the last poll.
        """
        self._check_open()
        events: list[TierEvent] = []
        still: list[_Flight] = []
        unpin: list[_Op] = []
        for flight in self._flights:
            if not flight.job.done:
                still.append(flight)
                continue
            # Collect it from the tier's pool (a pool shared by several stages or tiers
            # returns every job from its own poll(): each stage waits for exactly its own).
            self.tiers[flight.tier].wait(flight.job, 0)
            events += self._finish(flight, unpin)
        self._flights = still
        if unpin:
            # One release for all: pages of a prefix equally recent, its tail evicted first.
            self.manager.release([op.page for op in sorted(unpin, key=lambda op: op.position)])
        return events

    def _outcomes(self, flight: _Flight) -> list[tuple[str, str, int]]:
        """(status, detail, nbytes) per block of a finished job."""
        job = flight.job
        if flight.batch and isinstance(job.value, list) and len(job.value) == len(flight.ops):
            return [
                (getattr(o, "status", "error"), getattr(o, "detail", ""), getattr(o, "nbytes", 0))
                for o in job.value
            ]
        if flight.batch:  # the whole batch failed before per-item outcomes existed
            status = job.status if job.status != "ok" else "error"
            return [(status, job.detail, 0)] * len(flight.ops)
        return [(job.status, job.detail, job.nbytes)]

    def _finish(self, flight: _Flight, unpin: list[_Op]) -> list[TierEvent]:
        counts = self._counts[flight.tier]
        name = self.names[flight.tier]
        events = []
        for op, (status, detail, nbytes) in zip(flight.ops, self._outcomes(flight)):
            if flight.kind == "fill":
                ok = status == "ok"
                self._end_fill(flight.tier, op, ok=ok)
                if ok:
                    counts["fills_ok"] += 1
                    counts["bytes_filled"] += op.nbytes
                elif status == "miss":
                    counts["fills_missed"] += 1
                elif status in ("refused", "cancelled"):
                    counts["fills_refused"] += 1
                else:
                    counts["fills_failed"] += 1
            else:
                unpin.append(op)
                if status == "ok":
                    counts["stores_ok"] += 1
                    counts["bytes_stored"] += nbytes
                elif status in ("refused", "cancelled"):
                    counts["stores_refused"] += 1
                else:
                    counts["stores_failed"] += 1
            events.append(TierEvent(flight.kind, op.block_hash, op.page, name, status, detail))
        return events

    @property
    def in_flight(self) -> int:
        """Blocks whose tier fill or store has not been collected by :meth:`poll` yet."""
        return sum(len(flight.ops) for flight in self._flights)

    def drain(self, timeout: float | None = None) -> list[TierEvent]:
        """Block until every submitted tier job finished, then :meth:`poll`.

        For shutdown and tools (a scheduler loop calls :meth:`poll`).

        Raises
        ------
        TimeoutError
            Jobs still running after ``timeout`` seconds (they stay in flight).
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        for flight in list(self._flights):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self.tiers[flight.tier].wait(flight.job, remaining)
            except TimeoutError:
                raise TimeoutError(
                    f"{self.in_flight} tier operation(s) of layers [{self.first}, {self.end}) "
                    f"still running after {timeout} s"
                ) from None
        return self.poll()

    def close(self, timeout: float | None = None) -> None:
        """Wait for every tier job (their I/O reads or writes the rows), then drop the rows.

        The tiers are not closed (they may be shared); close the region after
        this. Idempotent.
        """
        if self.rows is None:
            return
        self.drain(timeout)
        self.rows = None

    def _check_open(self) -> None:
        if self.rows is None:
            raise RuntimeError("StageCache is closed")

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> StageCacheMetrics:
        """This stage's counters (per tier); the tiers' own counters: ``tier.metrics()``."""
        fills = sum(len(f.ops) for f in self._flights if f.kind == "fill")
        return StageCacheMetrics(
            layers=(self.first, self.end),
            lookup_blocks=self._lookup["blocks"],
            region_hit_blocks=self._lookup["region"],
            tier_hit_blocks=self._lookup["tiers"],
            miss_blocks=self._lookup["misses"],
            fills_in_flight=fills,
            stores_in_flight=self.in_flight - fills,
            tiers=tuple(
                TierCounters(name=name, last_error=error, **counts)
                for name, error, counts in zip(self.names, self._last_error, self._counts)
            ),
        )

    def __repr__(self) -> str:
        return (
            f"StageCache(layers=[{self.first}, {self.end}), pages={self.manager.num_pages}, "
            f"tiers={self.names}, in_flight={self.in_flight})"
        )
