"""Scheduler side of one pipeline stage: its region's pages first, then persistent tiers.

:class:`StageCache` drives unit stores (FileStore, RedisStore), a region row being exactly the
stage's unit: one batch job per tier and call, nothing waits unless given a timeout, a fill is
ready only once its unit was verified (a bad one is a miss), a failing tier is counted and
skipped. Units of other token counts (another engine's) are read across (``units.across``):
split or joined into the stage's unit, each source unit verified (those stores, checked:
``stage_stores``; what it reports: ``stage_reports``). One scheduler thread drives it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from layouts.pipeline import pp_layer_range, pp_layer_ranges

from ..checks import check_int, check_seconds, check_type
from ..units.across import UnitsAcross
from ..units.jobs import IOJob
from ..units.namespace import StoreNamespace
from ..units.tier import LoadItem, StoreItem
from ..units.unit import as_byte_view
from .pages import PageCapacityError, PageManager, PageStateError
from .region import RegionTopologyError, SharedOffloadRegion, unit_row_claim
from .stage_reports import (
    FetchResult,
    PersistResult,
    StageCacheMetrics,
    TierCounters,
    TierEvent,
    TierLookup,
)
from .stage_stores import AcrossStores, check_store, checked_hashes

__all__ = ["FetchResult", "PersistResult", "StageCache", "StageCacheMetrics", "TierCounters"]
__all__ += ["TierEvent", "TierLookup", "pp_layer_range", "pp_layer_ranges"]

_MAX_SEARCHES = 1024  # lookups asked about and not asked again; the oldest are dropped


@dataclass
class _Op:  # one block's part of a submitted fill or store
    block_hash: Hashable
    page: int
    generation: int
    position: int = 0  # the block's index in its sequence


@dataclass
class _Flight:  # a submitted batch job and its blocks (none: a lookup nobody waits for)
    kind: str
    tier: int
    job: IOJob
    ops: list[_Op]
    sources: list[int] | None = None  # a fill read across: the source units it loads
    scratch: np.ndarray | None = None  # ... into these rows, one each


@dataclass
class _Search:  # a lookup past the region: blocks found so far, this round's jobs
    keys: tuple[Hashable, ...]
    offset: int = 0  # the index of keys[0] in its sequence
    across: Mapping[int, tuple[Hashable, ...]] = dataclasses.field(default_factory=dict)
    position: int = 0
    sources: list[int] = dataclasses.field(default_factory=list)
    jobs: list[IOJob | None] | None = None


class StageCache:
    """Region pages of one pipeline stage (``layers = (first, end)``), backed by tiers.
    ``region``: a region (``.tensor``) or its rows, uint8 ``(manager.num_pages, row_bytes)``
    in CPU memory, row ``p`` holding page ``p``; a :class:`SharedOffloadRegion` is claimed
    (``unit_row_claim``): units whose opaque layers another topology's workers would read
    raise ``RegionTopologyError``. ``namespace``: built from ALL layers of the
    model, the same in every tier. ``tiers``: unit stores, nearest first, never closed here.
    ``across``: {tokens per unit: unit stores, nearest first} of other engines' units read
    across when no tier holds a block (``namespace`` shared, a multiple or divisor of its
    tokens; another size is one warning line and not read); lookups and fetches then take the
    same prefix's keys in those units (``across_keys``)."""

    def __init__(
        self,
        manager: PageManager,
        region: Any,
        layers: tuple[int, int],
        namespace: StoreNamespace,
        tiers: Sequence[Any] = (),
        *,
        names: Sequence[str] | None = None,
        across: Mapping[int, Sequence[Any]] | None = None,
    ) -> None:
        check_type("manager", manager, PageManager)
        check_type("namespace", namespace, StoreNamespace)
        if not isinstance(layers, (tuple, list)) or len(layers) != 2:
            raise TypeError(f"layers: expected (first, end), got {layers!r}")
        first = check_int("layers[0]", layers[0], minimum=0, maximum=namespace.num_layers - 1)
        end = check_int("layers[1]", layers[1], minimum=first + 1, maximum=namespace.num_layers)
        self.manager, self.namespace, self.first, self.end = manager, namespace, first, end
        self.row_bytes = namespace.layer_bytes(first, end)
        self.tiers = list(tiers)
        for i, tier in enumerate(self.tiers):
            expected = f"a tier of namespace {namespace.hex[:16]}..."
            check_store(f"tiers[{i}]", tier, namespace, expected)
        self.names = [f"{i}:{type(t).__name__}" for i, t in enumerate(self.tiers)]
        if names is not None:
            self.names = list(names)
            valid = all(isinstance(n, str) and n for n in self.names)
            if not valid or len(set(self.names)) != len(self.tiers):
                raise ValueError(
                    f"names: expected {len(self.tiers)} distinct non-empty names, got {names!r}"
                )
        # Every store a job goes to: the tiers, then the stores read across (and how).
        self._read_across = AcrossStores(namespace, across)
        self._stores = self.tiers + self._read_across.stores
        self._across: list[UnitsAcross | None] = [None] * len(self.tiers)
        self._across += self._read_across.units
        self.names += self._read_across.names
        self.rows: np.ndarray | None = self._rows(region)
        if isinstance(region, SharedOffloadRegion):  # its units' opaque layers claim the rows
            try:
                region.claim_rows(*unit_row_claim(namespace, first, end))
            except RegionTopologyError as error:
                raise RegionTopologyError(f"region: {error}") from None
        self._filler = f"stage[{first},{end})"
        fields = [f.name for f in dataclasses.fields(TierCounters)][1:]  # all but the name
        self._counts = [{**dict.fromkeys(fields, 0), "last_error": ""} for _ in self._stores]
        # Blocks looked up, then of those: found in the region, in the tiers, missed.
        self._lookup_counts = np.zeros(4, dtype=np.int64)
        self._flights: list[_Flight] = []
        self._searches: dict[tuple[Hashable, ...], _Search] = {}
        # page -> (generation, tier) of pages filled from a tier: never stored back there.
        self._origin: dict[int, tuple[int, int]] = {}

    def _source_keys(self, store: int, search: _Search, unit: int) -> tuple[Hashable, ...]:
        """What store ``store`` is asked for, from block ``unit`` of the search's sequence on:
        the blocks' keys (a tier), or the keys of the source units from the first one that
        block ``unit`` is made of (read across)."""
        units = self._across[store]
        if units is None:
            return search.keys[unit - search.offset :]
        keys = search.across.get(units.tokens, ())
        return keys[units.sources(unit).start :]

    def _rows(self, region: Any) -> np.ndarray:
        tensor = getattr(region, "tensor", region)
        try:
            flat = as_byte_view(tensor, writable=True, name="region")
        except (TypeError, ValueError) as error:
            raise type(error)(f"region: expected a region or uint8 CPU rows ({error})") from None
        shape = tuple(getattr(tensor, "shape", ()))
        expected = (self.manager.num_pages, self.row_bytes)
        if shape != expected or len(flat) != expected[0] * expected[1]:
            raise ValueError(
                f"region: expected rows of shape {expected} (a page of the manager each, the "
                f"stage's layers [{self.first}, {self.end}): {self.row_bytes} bytes), got {shape}"
            )
        return np.frombuffer(flat, dtype=np.uint8).reshape(expected)

    def _failed(self, tier: int, what: str) -> None:
        self._counts[tier]["errors"] += 1
        self._counts[tier]["last_error"] = what

    def _check_open(self) -> None:
        if self.rows is None:
            raise RuntimeError("StageCache is closed")

    @staticmethod
    def _deadline(timeout: float | None) -> float | None:
        timeout = check_seconds("timeout", timeout, optional=True, zero=True)
        return None if timeout is None else time.monotonic() + timeout

    # ------------------------------------------------------------------ lookup

    def lookup(
        self,
        hashes: Sequence[Hashable],
        *,
        timeout: float | None = 0.0,
        across_keys: Mapping[int, Sequence[Hashable]] | None = None,
    ) -> TierLookup:
        """Leading blocks ready in the region, then how many more the tiers hold (each round asks
        every tier, the nearest holding the next block supplies its run, a failing tier holds
        nothing; then the stores read across, with ``across_keys``: {tokens: keys of the same
        sequence in units of that many tokens, first first}). ``pending`` until they answered
        (``timeout``: seconds, None: until then)."""
        self._check_open()
        hashes = checked_hashes(hashes)
        across = self._read_across.keys(across_keys)
        deadline = self._deadline(timeout)
        in_region = self.manager.lookup(hashes)
        rest = tuple(hashes[in_region:])
        sources: list[int] = []
        if rest and self._stores:
            key = (rest, in_region, tuple(across.items())) if across else rest
            search = self._searches.pop(key, None) or _Search(rest, in_region, across)
            if not self._advance(search, deadline):
                self._searches[key] = search  # most recent last
                while len(self._searches) > _MAX_SEARCHES:
                    self._drop(self._searches.pop(next(iter(self._searches))))
                return TierLookup(in_region, 0, (), pending=True)
            sources = search.sources
        found = len(sources)
        self._lookup_counts += (len(hashes), in_region, found, len(hashes) - in_region - found)
        return TierLookup(in_region, len(sources), tuple(sources))

    def _advance(self, search: _Search, deadline: float | None) -> bool:
        """Move ``search`` on as far as the tiers answered; True once complete."""
        while search.position < len(search.keys):
            left, unit = len(search.keys) - search.position, search.offset + search.position
            if search.jobs is None:
                search.jobs = []
                for t, store in enumerate(self._stores):
                    keys = self._source_keys(t, search, unit)
                    try:
                        job = store.submit_lookup(keys, self.first, self.end) if keys else None
                    except Exception as error:  # a failing tier holds nothing
                        self._failed(t, f"{type(error).__name__}: {error}")
                        job = None
                    search.jobs.append(job)
            for t, job in enumerate(search.jobs):
                if job is None:
                    continue
                if not self._wait(t, job, deadline):
                    return False
                search.jobs[t] = None
                if job.status in ("error", "expired"):
                    self._failed(t, f"lookup {job.status}: {job.detail}")
                asked = len(self._source_keys(t, search, unit))
                found = min(int(job.value or 0), asked) if job.status == "ok" else 0
                if self._across[t] is not None:  # source units -> the blocks made of them
                    found = self._across[t].covered(unit, found, left)
                found = min(found, left)
                if found > 0:
                    self._drop(search)  # the farther tiers' answers are not needed
                    self._counts[t]["lookup_hit_blocks"] += found
                    search.sources += [t] * found
                    search.position += found
                    break
            else:
                return True  # no tier holds the next block
        return True

    def _wait(self, tier: int, job: IOJob, deadline: float | None) -> bool:
        """Collect ``job`` from its tier once finished, waiting until ``deadline``."""
        if not job.done and deadline is not None and time.monotonic() >= deadline:
            return False
        try:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._stores[tier].wait(job, remaining if not job.done else 0)
        except TimeoutError:
            return False
        return True

    def _drop(self, search: _Search) -> None:
        """Leave the search's unanswered jobs to :meth:`poll` to collect."""
        for t, job in enumerate(search.jobs or ()):
            if job is not None:
                self._flights.append(_Flight("lookup", t, job, []))
        search.jobs = None

    # ------------------------------------------------------------------ fetch

    def fetch(
        self,
        hashes: Sequence[Hashable],
        found: TierLookup | None = None,
        *,
        timeout: float | None = 0.0,
        across_keys: Mapping[int, Sequence[Hashable]] | None = None,
    ) -> FetchResult:
        """Fill region pages from the tiers for the blocks ``found`` (default: :meth:`lookup`
        now) says only they hold, as many leading ones as the region can take; the pages turn
        ready (or free, on a miss) in :meth:`poll`. ``across_keys``: as given to the lookup
        (blocks found across are filled from their source units, split or joined)."""
        self._check_open()
        hashes = checked_hashes(hashes)
        across = self._read_across.keys(across_keys)
        if found is None:
            found = self.lookup(hashes, timeout=timeout, across_keys=across)
        else:
            check_type("found", found, TierLookup)
        if found.total > len(hashes):
            raise ValueError(
                f"found: covers {found.total} blocks, more than the {len(hashes)} hashes given"
            )
        if len(found.sources) != found.from_tiers:  # else pages beyond them stay pending
            raise ValueError(
                f"found: expected a source for each of its {found.from_tiers} blocks from the "
                f"tiers, got {len(found.sources)}"
            )
        for i, source in enumerate(found.sources):
            units = self._across[source] if 0 <= source < len(self._stores) else False
            if units is False:
                raise ValueError(f"found: sources[{i}] is {source}, not a store of this cache")
            unit = found.in_region + i
            if units is not None and len(across.get(units.tokens, ())) < units.sources(unit).stop:
                raise ValueError(
                    f"across_keys: expected the keys of the {units.tokens}-token units block "
                    f"{unit} is made of (the across_keys given to the lookup), got "
                    f"{len(across.get(units.tokens, ()))} keys"
                )
        targets = hashes[found.in_region : found.total]
        pages = self._allocate_fills(targets)
        present = 0
        by_tier: dict[int, list[_Op]] = {}
        for i, (block_hash, page, source) in enumerate(zip(targets, pages, found.sources)):
            if page is None:  # present (stored or filled) already, or no page to spare now
                present += self.manager.page_of(block_hash) is not None
                continue
            op = _Op(block_hash, page, self.manager.generation(page), found.in_region + i)
            by_tier.setdefault(source, []).append(op)
        placed = {op.page for op in self._submit("fill", by_tier, across)}
        refused = len(targets) - present - len(placed)  # no page to spare, or the tier refused
        out = tuple(p if p in placed else None for p in pages)
        return FetchResult(len(placed), present, refused, out)

    def _allocate_fills(self, targets: list[Hashable]) -> list[int | None]:
        """Fill pages for the longest prefix of ``targets`` the region can hold now."""
        count = len(targets)
        while count > 0:
            try:
                pages = self.manager.allocate(targets[:count], filler=self._filler)
            except PageCapacityError as error:
                count -= max(1, error.needed - error.free - error.evictable)
                continue
            return pages + [None] * (len(targets) - count)
        return [None] * len(targets)

    def _submit(
        self, kind: str, by_tier: dict[int, list[_Op]], across: Mapping | None = None
    ) -> list[_Op]:
        """One batch job per tier of its ops' rows (a store read across: of their source units,
        keys in ``across``, into scratch rows); the ops submitted. Those of a refused job or a
        raising tier are undone (fills freed, store pins dropped)."""
        rows, first, end = self.rows, self.first, self.end
        submitted: list[_Op] = []
        for tier, ops in by_tier.items():
            counts = self._counts[tier]
            counts[f"{kind}s_submitted"] += len(ops)
            units, sources, scratch = self._across[tier], None, None
            try:
                if units is not None:  # fills only: nothing is stored across
                    sources = sorted({s for op in ops for s in units.sources(op.position)})
                    scratch = np.empty((len(sources), units.source_bytes(first, end)), np.uint8)
                    keys = across[units.tokens]
                    items = [
                        LoadItem(keys[s], first, end, scratch[i]) for i, s in enumerate(sources)
                    ]
                    job = self._stores[tier].submit_loads(items)
                elif kind == "fill":
                    items = [LoadItem(o.block_hash, first, end, rows[o.page]) for o in ops]
                    job = self.tiers[tier].submit_loads(items)
                else:
                    items = [
                        StoreItem(o.block_hash, first, rows[o.page], o.position, end) for o in ops
                    ]
                    job = self.tiers[tier].submit_stores(items)
            except Exception as error:  # a failing tier: nothing of this is done now
                self._failed(tier, f"{type(error).__name__}: {error}")
                job = None
            if job is not None and not job.refused:
                self._flights.append(_Flight(kind, tier, job, ops, sources, scratch))
                submitted += ops
                continue
            counts[f"{kind}s_refused"] += len(ops)
            if kind == "fill":
                for op in ops:
                    self.manager.fail_fill(op.page, generation=op.generation)
            else:
                self.manager.release([op.page for op in ops])
        return submitted

    # ------------------------------------------------------------------ persist

    def persist(
        self, hashes: Sequence[Hashable], positions: Sequence[int] | None = None
    ) -> PersistResult:
        """Write-through: store the row of every ready block to every tier but the one it
        came from. ``positions``: each block's index in its sequence (tails are evicted
        first; default ``0, 1, ...``). Each page stays pinned until its stores finish."""
        return self._write_through(hashes, positions, nearer_only=False)

    def promote(
        self, hashes: Sequence[Hashable], positions: Sequence[int] | None = None
    ) -> PersistResult:
        """Store blocks filled from tier ``t`` into tiers ``0 .. t-1`` only (e.g. Redis hits
        into the local files, for the next restart); other blocks are skipped."""
        return self._write_through(hashes, positions, nearer_only=True)

    def _write_through(
        self, hashes: Sequence[Hashable], positions: Sequence[int] | None, *, nearer_only: bool
    ) -> PersistResult:
        self._check_open()
        hashes = checked_hashes(hashes)
        positions = [
            check_int(f"positions[{i}]", p, minimum=0, maximum=(1 << 63) - 1)
            for i, p in enumerate(range(len(hashes)) if positions is None else positions)
        ]
        if len(positions) != len(hashes):
            raise ValueError(
                f"positions: expected one per hash ({len(hashes)}), got {len(positions)}"
            )
        not_ready = skipped = 0
        per_tier: dict[int, list[_Op]] = {}
        for block_hash, position in zip(hashes, positions):
            page = self.manager.page_of(block_hash)
            if page is None or self.manager.state(page) != "ready":
                not_ready += 1
                continue
            generation = self.manager.generation(page)
            origin = self._origin.get(page)
            source = origin[1] if origin is not None and origin[0] == generation else None
            if nearer_only:  # a block read across: every tier is nearer
                targets = range(min(source, len(self.tiers)) if source is not None else 0)
                skipped += len(self.tiers) - len(targets)
            else:
                targets = [t for t in range(len(self.tiers)) if t != source]
                skipped += source is not None and source < len(self.tiers)
            for t in targets:
                try:
                    self.manager.acquire([block_hash])  # pinned while the tier reads the row
                except PageStateError:
                    not_ready += 1
                    break
                per_tier.setdefault(t, []).append(_Op(block_hash, page, generation, position))
        submitted = len(self._submit("store", per_tier))
        refused = sum(map(len, per_tier.values())) - submitted
        return PersistResult(submitted, not_ready, refused, skipped)

    # ------------------------------------------------------------------ completion

    def poll(self) -> list[TierEvent]:
        """Collect finished jobs (never blocks): fills turn ready or free, store pins drop.
        One event per block whose fill or store finished since the last poll."""
        self._check_open()
        events: list[TierEvent] = []
        unpin: list[_Op] = []
        still: list[_Flight] = []
        for flight in self._flights:
            if not flight.job.done:
                still.append(flight)
                continue
            # Collected from the tier's pool by its own waiter (pools may be shared).
            self._stores[flight.tier].wait(flight.job, 0)
            events += self._finish(flight, unpin)
        self._flights = still
        if unpin:  # one release: a prefix's pages equally recent, its tail evicted first
            self.manager.release([op.page for op in sorted(unpin, key=lambda op: op.position)])
        return events

    def _finish(self, flight: _Flight, unpin: list[_Op]) -> list[TierEvent]:
        job, kind, counts = flight.job, flight.kind, self._counts[flight.tier]
        if flight.sources is not None:
            outcomes = self._built(flight)
        elif isinstance(job.value, list) and len(job.value) == len(flight.ops):
            outcomes = [(o.status, o.detail, o.nbytes) for o in job.value]
        else:  # the whole job failed (expired, error) before per-item outcomes existed
            outcomes = [("error" if job.ok else job.status, job.detail, 0)] * len(flight.ops)
        events = []
        for op, (status, detail, nbytes) in zip(flight.ops, outcomes):
            if kind == "fill":
                end = self.manager.complete_fill if status == "ok" else self.manager.fail_fill
                end(op.page, generation=op.generation)
                if status == "ok":
                    self._origin[op.page] = (op.generation, flight.tier)
                nbytes = self.row_bytes
            else:
                unpin.append(op)
            if status == "ok":
                counts[f"{kind}s_ok"] += 1
                counts["bytes_filled" if kind == "fill" else "bytes_stored"] += nbytes
            else:
                counts[_FAILURES.get((kind, status), f"{kind}s_failed")] += 1
            name = self.names[flight.tier]
            events.append(TierEvent(kind, op.block_hash, op.page, name, status, detail))
        return events

    def _built(self, flight: _Flight) -> list[tuple[str, str, int]]:
        """A fill read across: each block's page written from its verified source units
        (``UnitsAcross.build``), or the status of its first source not loaded."""
        job, units = flight.job, self._across[flight.tier]
        if isinstance(job.value, list) and len(job.value) == len(flight.sources):
            status = {s: (o.status, o.detail) for s, o in zip(flight.sources, job.value)}
        else:  # the whole job failed
            status = dict.fromkeys(flight.sources, ("error" if job.ok else job.status, job.detail))
        loaded = {
            s: flight.scratch[i] for i, s in enumerate(flight.sources) if status[s][0] == "ok"
        }
        blocks = [op.position for op in flight.ops]
        out = []
        for op, payload in zip(flight.ops, units.build(loaded, blocks, self.first, self.end)):
            if payload is None:
                failed = [status[s] for s in units.sources(op.position) if status[s][0] != "ok"]
                out.append((*failed[0], 0))
                continue
            self.rows[op.page] = payload
            out.append(("ok", "", self.row_bytes))
        return out

    @property
    def in_flight(self) -> int:
        """Blocks whose fill or store :meth:`poll` has not collected yet."""
        return sum(len(flight.ops) for flight in self._flights)

    def drain(self, timeout: float | None = None) -> list[TierEvent]:
        """Wait until every submitted fill and store finished, then :meth:`poll` (shutdown
        and tools; a scheduler loop polls). TimeoutError after ``timeout`` seconds."""
        self._check_open()
        deadline = self._deadline(timeout)
        for flight in [f for f in self._flights if f.ops]:  # not the dropped lookups
            if not self._wait(flight.tier, flight.job, deadline):
                raise TimeoutError(
                    f"{self.in_flight} tier operation(s) of layers [{self.first}, {self.end}) "
                    f"still running after {timeout} s"
                )
        return self.poll()

    def close(self, timeout: float | None = None) -> None:
        """Wait for every fill and store (their I/O uses the rows), then drop the rows; the
        tiers stay open (close the region after this). Idempotent."""
        if self.rows is None:
            return
        self.drain(timeout)
        for search in self._searches.values():
            self._drop(search)
        self._searches.clear()
        self.rows = None

    def metrics(self) -> StageCacheMetrics:
        """This stage's counters, per tier (each tier's own: ``tier.metrics()``)."""
        fills = sum(len(f.ops) for f in self._flights if f.kind == "fill")
        tiers = tuple(TierCounters(n, **counts) for n, counts in zip(self.names, self._counts))
        lookups = map(int, self._lookup_counts)  # the lookup, region hit, tier hit, miss blocks
        layers, stores = (self.first, self.end), self.in_flight - fills
        return StageCacheMetrics(layers, *lookups, fills, stores, tiers)


# A status other than "ok" -> the counter it bumps ("expired": past the tier's deadline).
_FAILURES = {(k, s): f"{k}s_refused" for k in ("fill", "store") for s in ("refused", "cancelled")}
_FAILURES.update({("fill", s): "fills_missed" for s in ("miss", "corrupt", "expired")})
