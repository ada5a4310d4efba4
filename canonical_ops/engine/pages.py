"""Scheduler-side bookkeeping of canonical pages: block hash -> page, readiness, LRU, pins.

canonical-kv offloads KV-cache blocks into *canonical pages* of a CPU region
shared by every rank (process) of a tensor-parallel group. A :class:`PageManager`
decides which canonical page holds which block (by block hash), tracks each
page through ``free -> pending -> ready`` and evicts least-recently-used ready
pages when the region is full. It is pure Python (no torch, no I/O) and
thread-safe: workers report completed stores from other threads.

Page life cycle
---------------
``free``
    Holds nothing; no hash maps to it.
``pending``
    :meth:`PageManager.allocate` gave it to a block hash; the elected writer
    ranks are copying their bytes in. Its hash is known (so a second store of
    the same block is not started) but it is never served: :meth:`lookup`
    stops at it and :meth:`acquire` refuses it.
``ready``
    Every elected writer has reported (:meth:`PageManager.complete_store`); it
    may be loaded, and, when no load holds it (refcount 0), evicted.

Pages filled by a tier
----------------------
A page can also be *filled* by the scheduler itself from a persistent tier
(files, Redis; see :mod:`canonical_ops.frontend.tiers`): ``allocate(hashes,
filler="files")`` makes pending pages that no rank writes. The tier's I/O job
reads and verifies the unit into the page's row, then reports
:meth:`PageManager.complete_fill` (ready) or :meth:`PageManager.fail_fill`
(free again, hash forgotten: a bad or missing unit is a miss, never a load),
naming the generation read at allocation like a store's report. A fill is
never reclaimed by ``pending_timeout_s``, :meth:`~PageManager.reclaim_stale`
or :meth:`~PageManager.fail_store`: its I/O job may still write into the row,
so only the job's own report ends it (jobs of the tiers' pools always finish).

Why readiness waits for every elected writer
--------------------------------------------
A canonical page is assembled from the bytes of several ranks: with sharded
heads each rank owns a disjoint slice, and with replicated heads or MLA
latents one *elected* writer per replica set stores the shared bytes (the
election rotates with the page id, ``mapping.is_writer(page_id)``), possibly a
different rank for each layer. No single rank's report therefore says the page
is complete. If the page were served as soon as *some* rank finished, a reader
could load a page whose other slices still hold a previous block's bytes (or
garbage): silently wrong KV, with no error anywhere. So a page turns ready only
when every rank in ``writer_ranks(page_id)`` -- for :meth:`PageManager.from_mappings`
the ranks that are the elected writer of that page in *any* layer -- has
reported, and a store that fails or whose writer dies (:meth:`PageManager.fail_store`,
:meth:`PageManager.reclaim_stale`) sends the page back to ``free``: a
half-written page is never ready, hence never served.

Generations: late reports never count
-------------------------------------
Every allocation of a page increments the page's *generation*
(:meth:`PageManager.generation`, :attr:`PageInfo.generation`). A writer's
report must name the generation it stored
(``complete_store(page, rank, generation=g)``): read it right after
:meth:`~PageManager.allocate` and hand it to the writers with the page id. A
report for an earlier generation -- a slow writer whose store was reclaimed or
failed, after the page went to another block -- raises :class:`PageStateError`
instead of counting toward the new block, so a page is never reported ready
that one of its writers did not write. The generation is required: it is the
only thing that tells such a late report from a current one, and a caller who
could omit it would meet the bug only in production, after the first reclaim.
A generation cannot stop a stuck writer's *bytes* from landing late, though:
reclaimed pages are reused only after every page already free, and the
timeout must exceed any live store's duration.

Pending pages of dead writers
-----------------------------
A pending page whose writer died never gets its last report. With
``pending_timeout_s`` (default 60 s; None disables it) such pages are reclaimed
lazily by :meth:`~PageManager.allocate`: a requested hash whose store has been
pending longer than the timeout is allocated afresh (a new page and
generation), and when the free pages do not cover a request, every store
pending longer than the timeout is abandoned (its page freed, its hash
forgotten) before any ready page is evicted. :meth:`~PageManager.fail_store`
and :meth:`~PageManager.reclaim_stale` abandon stores explicitly.

Eviction order
--------------
Only ready pages with refcount 0 are eviction candidates, least recently used
first. A page is *used* by the call that allocated it, by each
:meth:`~PageManager.lookup` that finds it in a ready prefix and by the
:meth:`~PageManager.release` that drops its last load; becoming ready is not a
use (a freshly stored page is as recent as its allocation). Pages used by the
same call are equally recent, and among them the later blocks of the call go
first: a prefix loses its tail before its head (a tail block is useless
without its head, a head block still serves shorter prefixes). Bookkeeping is
a heap: allocate, lookup, acquire, release and complete_store cost O(log n)
per page of the call (plus, amortised, the stores an allocate abandons), never
a scan of all pages.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..checks import check_int

if TYPE_CHECKING:  # pragma: no cover - typing only; keeps this module import-light
    from layouts import CanonicalPageMapping

__all__ = [
    "PageCapacityError",
    "PageInfo",
    "PageManager",
    "PageState",
    "PageStateError",
]

PageState = Literal["free", "pending", "ready"]

FREE: PageState = "free"
PENDING: PageState = "pending"
READY: PageState = "ready"


class PageCapacityError(RuntimeError):
    """Not enough free or evictable pages for an allocation; nothing was allocated.

    Attributes
    ----------
    needed : int
        Pages the allocation needed (new hashes in the request).
    free : int
        Free pages at the time of the request.
    evictable : int
        Ready pages with refcount 0 that the request could have evicted (pages of
        hashes in the request itself are not counted: they are never evicted by it).
    expired : int
        Pending pages older than ``pending_timeout_s`` that the request could
        have reclaimed.
    """

    def __init__(self, needed: int, free: int, evictable: int, expired: int = 0) -> None:
        self.needed = needed
        self.free = free
        self.evictable = evictable
        self.expired = expired
        super().__init__(
            f"cannot allocate {needed} canonical page(s): only {free} free, {expired} "
            f"timed-out pending and {evictable} evictable (ready, unreferenced) page(s); the "
            f"other pages are pending stores or held by loads. Nothing was allocated."
        )


class PageStateError(ValueError):
    """A page id, rank or block hash is not valid for the requested transition.

    Raised for out-of-range page ids or ranks, completing a page that is not
    pending, a report naming another generation than the page's current one (a
    late report of an abandoned store), completing by a rank that is not an
    elected writer of the page or that already reported, acquiring a hash that
    is not ready, and releasing a page that is not acquired. The manager is
    unchanged when it is raised.
    """


@dataclass(frozen=True)
class PageInfo:
    """A consistent snapshot of one canonical page (see :meth:`PageManager.info`).

    Attributes
    ----------
    page_id : int
        The page.
    state : {"free", "pending", "ready"}
        Its life-cycle state.
    block_hash : Hashable | None
        The block it holds (pending or ready), None when free.
    refcount : int
        Loads currently holding it (only ready pages can be held).
    writers : frozenset[int]
        Ranks elected to write it (empty when free).
    pending_writers : frozenset[int]
        Writers that have not reported yet (empty unless pending).
    generation : int
        Allocations of the page so far (0: never allocated); the generation its
        writers' reports must name.
    filler : str | None
        The tier filling this pending page (``allocate(..., filler=)``); None
        for a page stored by ranks, and for ready and free pages.
    """

    page_id: int
    state: PageState
    block_hash: Hashable | None
    refcount: int
    writers: frozenset[int]
    pending_writers: frozenset[int]
    generation: int
    filler: str | None = None


def _seconds(name: str, value: object) -> float:
    """A duration as a float; TypeError for non-numbers, ValueError for NaN or < 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number of seconds, got {type(value).__name__}")
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"{name}: expected a number >= 0, got {value!r}")
    return float(value)


class _PendingStore:
    """Mutable record of one in-flight store or fill (guarded by the manager's lock).

    A fill (``filler`` set) has no writer ranks: the tier's job reports it.
    """

    __slots__ = ("allocated_at", "filler", "remaining", "writers")

    def __init__(
        self, writers: frozenset[int], allocated_at: float, filler: str | None = None
    ) -> None:
        self.writers = writers
        self.remaining = set(writers)
        self.allocated_at = allocated_at
        self.filler = filler


class PageManager:
    """Maps block hashes to canonical pages and tracks their readiness, pins and recency.

    Parameters
    ----------
    num_pages : int
        Canonical pages in the shared region (page ids ``0 .. num_pages - 1``), >= 1.
    writer_ranks : Callable[[int], frozenset[int]] | None
        ``writer_ranks(page_id)``: the ranks that must all report a store of that
        page before it is ready. Called once per allocation; each result must be
        a non-empty subset of ``range(num_ranks)``. Default: every rank.
    num_ranks : int
        Ranks of the group (valid ``rank`` arguments are ``0 .. num_ranks - 1``), >= 1.
    clock : Callable[[], float]
        Monotonic time source stamping allocations for the pending timeout and
        :meth:`reclaim_stale` (default :func:`time.monotonic`).
    pending_timeout_s : float | None
        Seconds (> 0) after which a pending store is presumed dead and
        :meth:`allocate` may reclaim its page (see the module docstring);
        None: only :meth:`fail_store` / :meth:`reclaim_stale` free pending pages.
        Choose it well above any live store's duration.

    Notes
    -----
    All methods are atomic under one lock, and every method that raises leaves
    the manager unchanged (batch operations are all-or-nothing).
    """

    def __init__(
        self,
        num_pages: int,
        writer_ranks: Callable[[int], frozenset[int]] | None = None,
        *,
        num_ranks: int = 1,
        clock: Callable[[], float] = time.monotonic,
        pending_timeout_s: float | None = 60.0,
    ) -> None:
        self._num_pages = check_int("num_pages", num_pages, minimum=1)
        self._num_ranks = check_int("num_ranks", num_ranks, minimum=1)
        if writer_ranks is not None and not callable(writer_ranks):
            raise TypeError(
                f"writer_ranks: expected a callable or None, got {type(writer_ranks).__name__}"
            )
        if not callable(clock):
            raise TypeError(f"clock: expected a callable, got {type(clock).__name__}")
        if pending_timeout_s is not None:
            pending_timeout_s = _seconds("pending_timeout_s", pending_timeout_s)
            if not pending_timeout_s > 0:
                raise ValueError(
                    f"pending_timeout_s: expected a number > 0 or None, got {pending_timeout_s!r}"
                )
        everyone = frozenset(range(self._num_ranks))
        self._writer_ranks: Callable[[int], frozenset[int]] = (
            writer_ranks if writer_ranks is not None else (lambda _page: everyone)
        )
        self._clock = clock
        self._pending_timeout_s = pending_timeout_s
        self._lock = threading.Lock()
        self._state: list[PageState] = [FREE] * self._num_pages
        self._hash_of: list[Hashable | None] = [None] * self._num_pages
        self._refcount: list[int] = [0] * self._num_pages
        self._writers: list[frozenset[int]] = [frozenset()] * self._num_pages
        self._generation: list[int] = [0] * self._num_pages
        self._page_of: dict[Hashable, int] = {}
        # Free pages, reused from the left; abandoned stores' pages go to the right,
        # so a stuck writer's late bytes are the least likely to hit a reused page.
        self._free: deque[int] = deque(range(self._num_pages))
        # In-flight stores in allocation order, hence in order of allocated_at (the
        # clock is monotonic): the timed-out ones are a prefix.
        self._pending: OrderedDict[int, _PendingStore] = OrderedDict()
        # Recency: a use stamps a page with (tick of the call, -position in the call),
        # so the smallest key is the least recent, and the tail of a call before its head.
        self._tick = 0
        self._last_use: list[tuple[int, int]] = [(0, 0)] * self._num_pages
        # Ready pages with refcount 0 -> their key; the heap holds (key, page) entries,
        # stale ones (page gone or re-keyed) skipped when they surface.
        self._evictable: dict[int, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, int]] = []
        self._num_ready = 0

    @classmethod
    def from_mappings(
        cls,
        num_pages: int,
        layer_group_mappings: Sequence[Sequence[CanonicalPageMapping]],
        *,
        clock: Callable[[], float] = time.monotonic,
        pending_timeout_s: float | None = 60.0,
    ) -> PageManager:
        """A manager whose writers of page ``p`` are the ranks electing to write it in any layer.

        Parameters
        ----------
        num_pages : int
            Canonical pages in the shared region, >= 1.
        layer_group_mappings : Sequence[Sequence[CanonicalPageMapping]]
            ``layer_group_mappings[l][r]``: layer ``l``'s mapping at rank ``r``,
            e.g. the result of ``derive_group_mappings`` for each layer. Every
            layer must list the same number of ranks.
        clock : Callable[[], float]
            As for the constructor.
        pending_timeout_s : float | None
            As for the constructor.

        Returns
        -------
        PageManager
            With ``num_ranks = len(layer_group_mappings[0])`` and
            ``writer_ranks(p) = {r : any(layer_group_mappings[l][r].is_writer(p) for l)}``,
            precomputed over one period ``lcm(num_writers)`` of the rotation.

        Raises
        ------
        ValueError
            No layers, a layer with no ranks or a different number of ranks, or
            a layer where some page has no elected writer (its bytes would never
            be stored, so the page could never honestly be ready).
        """
        groups = [tuple(group) for group in layer_group_mappings]
        if not groups:
            raise ValueError("layer_group_mappings: expected at least one layer, got none")
        num_ranks = len(groups[0])
        if num_ranks == 0:
            raise ValueError("layer_group_mappings[0]: expected at least one rank, got none")
        for layer, group in enumerate(groups):
            if len(group) != num_ranks:
                raise ValueError(
                    f"layer_group_mappings[{layer}]: expected {num_ranks} ranks "
                    f"(as layer 0), got {len(group)}"
                )
            for rank, mapping in enumerate(group):
                writers = getattr(mapping, "num_writers", None)
                if isinstance(writers, bool) or not isinstance(writers, int) or writers < 1:
                    raise ValueError(
                        f"layer_group_mappings[{layer}][{rank}]: expected a "
                        f"CanonicalPageMapping with num_writers >= 1, got {mapping!r}"
                    )
        period = math.lcm(*(m.num_writers for group in groups for m in group))
        table: list[frozenset[int]] = []
        for residue in range(period):
            ranks: set[int] = set()
            for layer, group in enumerate(groups):
                layer_writers = {r for r, m in enumerate(group) if m.is_writer(residue)}
                if not layer_writers:
                    raise ValueError(
                        f"layer_group_mappings[{layer}]: no rank is the elected writer of "
                        f"pages {residue} mod {period}; these pages could never be complete"
                    )
                ranks |= layer_writers
            table.append(frozenset(ranks))
        table_t = tuple(table)

        def writer_ranks(page_id: int) -> frozenset[int]:
            return table_t[page_id % period]

        return cls(
            num_pages,
            writer_ranks,
            num_ranks=num_ranks,
            clock=clock,
            pending_timeout_s=pending_timeout_s,
        )

    # ----------------------------------------------------------------- properties

    @property
    def num_pages(self) -> int:
        """Canonical pages managed."""
        return self._num_pages

    @property
    def num_ranks(self) -> int:
        """Ranks of the group."""
        return self._num_ranks

    @property
    def num_free(self) -> int:
        """Pages holding nothing."""
        with self._lock:
            return len(self._free)

    @property
    def num_pending(self) -> int:
        """Pages allocated to a hash whose store is not complete yet."""
        with self._lock:
            return len(self._pending)

    @property
    def num_filling(self) -> int:
        """Pending pages being filled by a tier (a subset of :attr:`num_pending`)."""
        with self._lock:
            return sum(store.filler is not None for store in self._pending.values())

    @property
    def num_ready(self) -> int:
        """Pages fully stored by every elected writer."""
        with self._lock:
            return self._num_ready

    @property
    def num_evictable(self) -> int:
        """Ready pages with refcount 0 (eviction candidates)."""
        with self._lock:
            return len(self._evictable)

    @property
    def pending_timeout_s(self) -> float | None:
        """Seconds after which :meth:`allocate` may reclaim a pending store; None: never."""
        return self._pending_timeout_s

    # ----------------------------------------------------------------- validation

    def _check_page(self, page_id: object, name: str = "page_id") -> int:
        # TypeError for a non-int, PageStateError (a ValueError) for an unknown page.
        return check_int(
            name, page_id, minimum=0, maximum=self._num_pages - 1, error=PageStateError
        )

    def _check_rank(self, rank: object) -> int:
        return check_int("rank", rank, minimum=0, maximum=self._num_ranks - 1, error=PageStateError)

    @staticmethod
    def _hashes(block_hashes: Iterable[Hashable]) -> list[Hashable]:
        if isinstance(block_hashes, (str, bytes)):
            raise TypeError(
                "block_hashes: expected a sequence of block hashes, got a single "
                f"{type(block_hashes).__name__}; wrap it in a list"
            )
        hashes = list(block_hashes)
        for i, block_hash in enumerate(hashes):
            if block_hash is None:
                raise ValueError(f"block_hashes[{i}]: None is not a block hash")
            try:
                hash(block_hash)
            except TypeError:
                raise TypeError(
                    f"block_hashes[{i}]: expected a hashable, got {type(block_hash).__name__}"
                ) from None
        return hashes

    def _writers_for(self, page_id: int) -> frozenset[int]:
        result = self._writer_ranks(page_id)
        try:
            writers = frozenset(result)
        except TypeError:
            raise TypeError(
                f"writer_ranks({page_id}): expected a set of ranks, got {type(result).__name__}"
            ) from None
        if not writers:
            raise ValueError(
                f"writer_ranks({page_id}): returned no rank; the page could never be ready"
            )
        bad = sorted(
            (
                r
                for r in writers
                if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self._num_ranks
            ),
            key=repr,
        )
        if bad:
            raise ValueError(
                f"writer_ranks({page_id}): ranks must be ints in [0, {self._num_ranks}), "
                f"got {bad!r}"
            )
        return writers

    # Recency bookkeeping (callers hold the lock).

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _make_evictable(self, page: int) -> None:
        key = self._last_use[page]
        self._evictable[page] = key
        heapq.heappush(self._heap, (*key, page))

    def _touch(self, page: int, key: tuple[int, int]) -> None:
        self._last_use[page] = key
        if page in self._evictable:
            self._make_evictable(page)  # re-keyed: its old heap entry turns stale

    def _compact(self) -> None:
        """Rebuild the heap once stale entries outnumber live ones (amortised O(1))."""
        if len(self._heap) > 2 * len(self._evictable) + 64:
            self._heap = [(*key, page) for page, key in self._evictable.items()]
            heapq.heapify(self._heap)

    def _pop_least_recent(self, count: int, protected: set[int]) -> list[tuple[int, int, int]]:
        """Pop the heap entries of the ``count`` least recent evictable pages not protected.

        The caller made sure there are enough; the pages stay in ``_evictable``
        until the caller commits (or pushes the entries back).
        """
        taken: list[tuple[int, int, int]] = []
        skipped: list[tuple[int, int, int]] = []
        while len(taken) < count:
            entry = heapq.heappop(self._heap)
            page = entry[2]
            if self._evictable.get(page) != entry[:2]:
                continue  # stale: the page was re-keyed, pinned or evicted since
            (skipped if page in protected else taken).append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return taken

    def _expired(self, now: float, max_age_s: float) -> list[int]:
        """Pending pages allocated more than ``max_age_s`` before ``now``, oldest first."""
        out = []
        for page, store in self._pending.items():
            if not now - store.allocated_at > max_age_s:
                break  # allocation order is clock order: the rest are younger
            if store.filler is None:  # a fill ends only by its job's report
                out.append(page)
        return out

    def _is_expired(self, page: int, now: float) -> bool:
        store = self._pending.get(page)
        timeout = self._pending_timeout_s
        return (
            store is not None
            and store.filler is None
            and timeout is not None
            and now - store.allocated_at > timeout
        )

    # ----------------------------------------------------------------- scheduler API

    def lookup(self, block_hashes: Iterable[Hashable]) -> int:
        """Length of the longest prefix of ``block_hashes`` whose pages are ready.

        The pages of that prefix are used (see *Eviction order* in the module
        docstring: equally recent, the head of the prefix evicted last). Pending
        pages end the prefix: they are not loadable yet.

        Parameters
        ----------
        block_hashes : Iterable[Hashable]
            Hashes of consecutive blocks of a request, first block first.

        Returns
        -------
        int
            Number of leading hashes that are ready (0 .. len(block_hashes)).
        """
        hashes = self._hashes(block_hashes)
        with self._lock:
            prefix: list[int] = []
            for block_hash in hashes:
                page = self._page_of.get(block_hash)
                if page is None or self._state[page] != READY:
                    break
                prefix.append(page)
            if prefix:
                tick = self._next_tick()
                for position, page in enumerate(prefix):
                    self._touch(page, (tick, -position))
                self._compact()
            return len(prefix)

    def allocate(
        self, block_hashes: Iterable[Hashable], *, filler: str | None = None
    ) -> list[int | None]:
        """Pages to store ``block_hashes`` into; new pages start ``pending``.

        Parameters
        ----------
        block_hashes : Iterable[Hashable]
            Hashes of the blocks to store, first block of the sequence first.
        filler : str | None
            None: the pages are stored by the elected writer ranks
            (:meth:`complete_store`). A tier's name: the pages are filled by
            that tier's I/O (no rank writes them), reported by
            :meth:`complete_fill` or :meth:`fail_fill` only.

        Returns
        -------
        list[int | None]
            Aligned with ``block_hashes``: a fresh page id for each hash that is
            neither pending nor ready (its store should go ahead), and None for
            a hash already present -- pending or ready -- or repeated earlier in
            the same call (nothing to store). Present hashes are not touched. A
            hash whose store has been pending longer than ``pending_timeout_s``
            counts as absent: its old store is abandoned and it gets a fresh page.
            Read each new page's :meth:`generation` now, for its writers' reports.

        Raises
        ------
        PageCapacityError
            When the new hashes need more pages than there are free pages,
            timed-out pending pages and evictable ones (ready, refcount 0, and not
            holding a hash of this request). Nothing is allocated, abandoned or
            evicted then.

        Notes
        -----
        Free pages are used first; when they do not suffice, every store
        pending longer than ``pending_timeout_s`` is abandoned and its page
        used next; then least-recently-used evictable pages are evicted (their
        hashes forgotten), tails of equally recent prefixes first. Pinned
        (acquired) and live pending pages are never taken. The new pages are
        used by this call, the first hash the most recent. Costs O(log n) per
        hash and per page taken (plus the timed-out stores it abandons).
        """
        hashes = self._hashes(block_hashes)
        if filler is not None and (not isinstance(filler, str) or not filler):
            raise TypeError(f"filler: expected None or a tier name (non-empty str), got {filler!r}")
        with self._lock:
            now = self._clock()
            new: list[int] = []  # indices into hashes that need a page
            restored: list[int] = []  # timed-out pending pages of requested hashes
            seen: set[Hashable] = set()
            for i, block_hash in enumerate(hashes):
                if block_hash in seen:
                    continue
                seen.add(block_hash)
                page = self._page_of.get(block_hash)
                if page is not None:
                    if not self._is_expired(page, now):
                        continue
                    restored.append(page)
                new.append(i)
            if not new:
                return [None] * len(hashes)
            reclaimed = restored
            timeout = self._pending_timeout_s
            if timeout is not None and len(new) > len(self._free) + len(restored):
                reclaimed = self._expired(now, timeout)  # every timed-out store, restored too
            protected = {self._page_of[h] for h in hashes if h in self._page_of}
            protected.difference_update(reclaimed)
            wanted = len(new) - len(self._free) - len(reclaimed)
            victims: list[tuple[int, int, int]] = []
            if wanted > 0:
                evictable = len(self._evictable) - sum(p in self._evictable for p in protected)
                if evictable < wanted:
                    raise PageCapacityError(len(new), len(self._free), evictable, len(reclaimed))
                victims = self._pop_least_recent(wanted, protected)
            num_free = min(len(new), len(self._free))
            num_reclaimed = min(len(new) - num_free, len(reclaimed))
            pages = list(itertools.islice(self._free, num_free))
            pages += reclaimed[:num_reclaimed]
            pages += [page for *_, page in victims]
            try:
                # Ask for the writers before changing anything: a bad writer_ranks result
                # raises with the manager untouched.
                no_ranks: frozenset[int] = frozenset()
                writers = [
                    no_ranks if filler is not None else self._writers_for(page) for page in pages
                ]
            except BaseException:
                for entry in victims:
                    heapq.heappush(self._heap, entry)
                raise
            # Reclaimed pages join the free ones on the right: when they are used, every
            # free page before them already is.
            self._fail_locked(reclaimed)
            for _ in range(num_free + num_reclaimed):
                self._free.popleft()
            for *_, page in victims:
                del self._evictable[page]
                del self._page_of[self._hash_of[page]]
                self._num_ready -= 1
            tick = self._next_tick()
            out: list[int | None] = [None] * len(hashes)
            for i, page, page_writers in zip(new, pages, writers):
                block_hash = hashes[i]
                self._state[page] = PENDING
                self._hash_of[page] = block_hash
                self._page_of[block_hash] = page
                self._writers[page] = page_writers
                self._generation[page] += 1
                self._last_use[page] = (tick, -i)
                self._pending[page] = _PendingStore(page_writers, now, filler)
                out[i] = page
            self._compact()
            return out

    def complete_store(self, page_id: int, rank: int, *, generation: int) -> bool:
        """Record that ``rank`` finished storing its bytes of pending page ``page_id``.

        Parameters
        ----------
        page_id : int
            A pending page.
        rank : int
            The reporting rank; must be one of the page's elected writers that
            has not reported yet.
        generation : int
            The page's generation when its store was allocated
            (:meth:`generation` right after :meth:`allocate`). Required: a
            report of an abandoned store (failed, or reclaimed after
            ``pending_timeout_s`` or by :meth:`reclaim_stale`) names an older
            generation and is refused, so it never counts toward the block the
            page holds since.

        Returns
        -------
        bool
            True when this report made the page ready (every writer has reported).

        Raises
        ------
        PageStateError
            Unknown page id or rank, a generation other than the page's current
            one, page not pending (free, ready, or failed meanwhile), rank not an
            elected writer of the page, or a second report by the same rank.
        """
        page = self._check_page(page_id)
        rank = self._check_rank(rank)
        generation = check_int("generation", generation, minimum=1, error=PageStateError)
        with self._lock:
            current = self._generation[page]
            if generation != current:
                if generation > current:
                    why = "that generation was never allocated"
                else:
                    why = (
                        f"the store of generation {generation} was abandoned (failed or "
                        "reclaimed) and the page allocated again; its late report does not count"
                    )
                raise PageStateError(
                    f"generation: expected page {page}'s current generation {current}, "
                    f"got {generation}: {why}"
                )
            store = self._pending.get(page)
            if store is None:
                raise PageStateError(
                    f"page_id: page {page} is {self._state[page]}, not pending; "
                    "its store was never allocated, already completed, or failed"
                )
            if store.filler is not None:
                raise PageStateError(
                    f"page_id: page {page} is being filled by tier {store.filler!r}, not "
                    "stored by ranks; its fill is reported by complete_fill / fail_fill"
                )
            if rank not in store.writers:
                raise PageStateError(
                    f"rank: rank {rank} is not an elected writer of page {page} "
                    f"(writers: {sorted(store.writers)})"
                )
            if rank not in store.remaining:
                raise PageStateError(f"rank: rank {rank} already reported page {page}")
            store.remaining.discard(rank)
            if store.remaining:
                return False
            del self._pending[page]
            self._state[page] = READY
            self._num_ready += 1
            self._make_evictable(page)  # as recent as its allocation
            return True

    def fail_store(
        self, page_ids: Iterable[int], *, generations: Iterable[int] | None = None
    ) -> list[int]:
        """Abandon the stores of ``page_ids``: pending ones go back to free, hashes forgotten.

        For a store that failed or whose writer rank died. Pages that are not
        pending (free, or ready because every writer had already reported) are
        left as they are, so reporting every in-flight page of a dead rank is safe.
        Pages being filled by a tier are left alone too (:meth:`fail_fill`
        ends those: their I/O may still write into the row).

        Parameters
        ----------
        page_ids : Iterable[int]
            Pages whose store failed; every id must be in range.
        generations : Iterable[int] | None
            Aligned with ``page_ids``: the generation of each failed store. A
            page whose current generation differs is left alone (that store was
            abandoned already and the page holds another block now). Without
            it, the pages' current stores are failed.

        Returns
        -------
        list[int]
            The pages that were pending and are now free, in the given order.

        Raises
        ------
        PageStateError
            A page id out of range, or ``generations`` not aligned with
            ``page_ids`` (nothing is failed then).
        """
        pages = [self._check_page(p, f"page_ids[{i}]") for i, p in enumerate(page_ids)]
        if generations is not None:
            gens = [
                check_int(f"generations[{i}]", g, minimum=1, error=PageStateError)
                for i, g in enumerate(generations)
            ]
            if len(gens) != len(pages):
                raise PageStateError(
                    f"generations: expected one per page id ({len(pages)}), got {len(gens)}"
                )
        with self._lock:
            if generations is not None:
                pages = [p for p, g in zip(pages, gens) if self._generation[p] == g]
            fills = self._pending
            return self._fail_locked(p for p in pages if p not in fills or fills[p].filler is None)

    def _fail_locked(self, pages: Iterable[int]) -> list[int]:
        failed = []
        for page in pages:
            if self._pending.pop(page, None) is None:
                continue
            del self._page_of[self._hash_of[page]]
            self._hash_of[page] = None
            self._writers[page] = frozenset()
            self._state[page] = FREE
            self._free.append(page)
            failed.append(page)
        return failed

    def _fill_locked(self, page: int, generation: int, what: str) -> _PendingStore:
        """The pending fill of ``page`` at ``generation``; PageStateError otherwise."""
        current = self._generation[page]
        if generation != current:
            raise PageStateError(
                f"generation: expected page {page}'s current generation {current}, got "
                f"{generation}: a {what} names the generation read right after allocate"
            )
        store = self._pending.get(page)
        if store is None or store.filler is None:
            state = "being stored by ranks" if store is not None else self._state[page]
            raise PageStateError(
                f"page_id: page {page} is {state}, not being filled by a tier; "
                f"{what} reports only fills allocated with allocate(..., filler=)"
            )
        return store

    def complete_fill(self, page_id: int, *, generation: int) -> None:
        """A tier's fill of page ``page_id`` read and verified its unit: the page is ready.

        Parameters
        ----------
        page_id : int
            A page allocated with ``allocate(..., filler=)``.
        generation : int
            The page's generation read right after that allocation.

        Raises
        ------
        PageStateError
            Unknown page, another generation, or the page is not being filled.
        """
        page = self._check_page(page_id)
        generation = check_int("generation", generation, minimum=1, error=PageStateError)
        with self._lock:
            self._fill_locked(page, generation, "complete_fill")
            del self._pending[page]
            self._state[page] = READY
            self._num_ready += 1
            self._make_evictable(page)  # as recent as its allocation

    def fail_fill(self, page_id: int, *, generation: int) -> None:
        """A tier's fill of page ``page_id`` failed (missing, corrupt, I/O error, refused).

        The page goes back to free and its hash is forgotten: the block is a
        miss and may be fetched or stored again. Whatever the job wrote into
        the row is never served.

        Raises
        ------
        PageStateError
            Unknown page, another generation, or the page is not being filled.
        """
        page = self._check_page(page_id)
        generation = check_int("generation", generation, minimum=1, error=PageStateError)
        with self._lock:
            self._fill_locked(page, generation, "fail_fill")
            del self._pending[page]
            del self._page_of[self._hash_of[page]]
            self._hash_of[page] = None
            self._writers[page] = frozenset()
            self._state[page] = FREE
            self._free.append(page)

    def reclaim_stale(self, max_age_s: float | None = None, now: float | None = None) -> list[int]:
        """Fail every pending page allocated more than ``max_age_s`` seconds ago.

        A page whose writer was killed mid-store never gets its last report;
        this frees it (it never becomes ready, so it is never served). Ready,
        free and younger pending pages are not affected. A report of a
        reclaimed store arriving later is refused (its generation is stale).

        Parameters
        ----------
        max_age_s : float | None
            Age (seconds, >= 0) beyond which a pending store is presumed dead;
            default ``pending_timeout_s``. Choose it well above any live store's
            duration: the generation refuses a slow writer's late report, but
            cannot stop its bytes from landing in the page after it was reused.
        now : float | None
            Current time on the manager's clock; default ``clock()``.

        Returns
        -------
        list[int]
            The reclaimed (now free) pages, ascending.
        """
        if max_age_s is None:
            if self._pending_timeout_s is None:
                raise ValueError(
                    "max_age_s: expected a number of seconds (this manager has no "
                    "pending_timeout_s to default to), got None"
                )
            max_age_s = self._pending_timeout_s
        max_age_s = _seconds("max_age_s", max_age_s)
        with self._lock:
            t = self._clock() if now is None else float(now)
            return sorted(self._fail_locked(self._expired(t, max_age_s)))

    def acquire(self, block_hashes: Iterable[Hashable]) -> list[int]:
        """Pin the ready pages of ``block_hashes`` for a load (refcount +1 each).

        Pinned pages are never evicted until :meth:`release`.

        Returns
        -------
        list[int]
            Page ids aligned with ``block_hashes``.

        Raises
        ------
        PageStateError
            If any hash is unknown or its page is still pending (nothing is pinned).
        """
        hashes = self._hashes(block_hashes)
        with self._lock:
            pages = []
            for i, block_hash in enumerate(hashes):
                page = self._page_of.get(block_hash)
                if page is None or self._state[page] != READY:
                    state = "unknown" if page is None else f"pending (page {page})"
                    raise PageStateError(
                        f"block_hashes[{i}]: block {block_hash!r} is {state}, not ready; "
                        "acquire only a prefix reported by lookup()"
                    )
                pages.append(page)
            for page in pages:
                self._refcount[page] += 1
                self._evictable.pop(page, None)  # its heap entry turns stale
            self._compact()
            return pages

    def release(self, page_ids: Iterable[int]) -> None:
        """Unpin pages acquired by :meth:`acquire` (refcount -1 each).

        A page whose refcount drops to 0 becomes evictable, used by this call
        at the position of its first occurrence in ``page_ids`` (the first page
        the most recent, as for :meth:`lookup`).

        Raises
        ------
        PageStateError
            A page id out of range, or released more often than acquired
            (counting repeats in ``page_ids``); nothing is released then.
        """
        pages = [self._check_page(p, f"page_ids[{i}]") for i, p in enumerate(page_ids)]
        with self._lock:
            counts: dict[int, int] = {}
            for page in pages:
                counts[page] = counts.get(page, 0) + 1
            for page, count in counts.items():
                if count > self._refcount[page]:
                    raise PageStateError(
                        f"page_ids: page {page} released {count} time(s) but held by "
                        f"{self._refcount[page]} acquire(s)"
                    )
            tick = self._next_tick()
            first: dict[int, int] = {}
            for position, page in enumerate(pages):
                first.setdefault(page, position)
            for page, count in counts.items():
                self._refcount[page] -= count
                if self._refcount[page] == 0:
                    self._last_use[page] = (tick, -first[page])
                    self._make_evictable(page)
            self._compact()

    # ----------------------------------------------------------------- introspection

    def state(self, page_id: int) -> PageState:
        """``"free"``, ``"pending"`` or ``"ready"``."""
        page = self._check_page(page_id)
        with self._lock:
            return self._state[page]

    def page_of(self, block_hash: Hashable) -> int | None:
        """The page holding ``block_hash`` (pending or ready), or None."""
        with self._lock:
            return self._page_of.get(block_hash)

    def hash_of(self, page_id: int) -> Hashable | None:
        """The block hash page ``page_id`` holds (pending or ready), or None when free."""
        page = self._check_page(page_id)
        with self._lock:
            return self._hash_of[page]

    def refcount(self, page_id: int) -> int:
        """Loads currently holding page ``page_id``."""
        page = self._check_page(page_id)
        with self._lock:
            return self._refcount[page]

    def writer_ranks(self, page_id: int) -> frozenset[int]:
        """Ranks that must all report a store of page ``page_id`` before it is ready."""
        page = self._check_page(page_id)
        with self._lock:
            if self._state[page] != FREE:
                return self._writers[page]
        return self._writers_for(page)

    def pending_writers(self, page_id: int) -> frozenset[int]:
        """Ranks that still have to report the store of pending page ``page_id``.

        Raises
        ------
        PageStateError
            If the page is not pending.
        """
        page = self._check_page(page_id)
        with self._lock:
            store = self._pending.get(page)
            if store is None:
                raise PageStateError(f"page_id: page {page} is {self._state[page]}, not pending")
            return frozenset(store.remaining)

    def info(self, page_id: int) -> PageInfo:
        """A consistent snapshot of page ``page_id``."""
        page = self._check_page(page_id)
        with self._lock:
            store = self._pending.get(page)
            return PageInfo(
                page_id=page,
                state=self._state[page],
                block_hash=self._hash_of[page],
                refcount=self._refcount[page],
                writers=self._writers[page],
                pending_writers=frozenset(store.remaining) if store else frozenset(),
                generation=self._generation[page],
                filler=store.filler if store else None,
            )

    def generation(self, page_id: int) -> int:
        """Allocations of page ``page_id`` so far: the generation its writers' reports name.

        Read it right after :meth:`allocate` returned the page and hand it to the
        writers with the page id. It changes only when the page is allocated
        again, which needs its store to be abandoned first (by
        :meth:`fail_store`, :meth:`reclaim_stale`, or ``pending_timeout_s``
        seconds later by :meth:`allocate`).
        """
        page = self._check_page(page_id)
        with self._lock:
            return self._generation[page]

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal bookkeeping is inconsistent (for tests)."""
        with self._lock:
            states = self._state
            n_free = sum(s == FREE for s in states)
            n_pending = sum(s == PENDING for s in states)
            n_ready = sum(s == READY for s in states)
            assert n_free + n_pending + n_ready == self._num_pages
            assert n_free == len(self._free) == len(set(self._free))
            assert n_pending == len(self._pending)
            assert n_ready == self._num_ready
            assert len(self._page_of) == n_pending + n_ready
            for block_hash, page in self._page_of.items():
                assert self._hash_of[page] == block_hash and states[page] != FREE
            for page in range(self._num_pages):
                state = states[page]
                assert (self._hash_of[page] is None) == (state == FREE)
                assert (page in self._pending) == (state == PENDING)
                assert (page in self._evictable) == (state == READY and not self._refcount[page])
                assert self._refcount[page] >= 0
                assert state == READY or self._refcount[page] == 0
            for page in self._free:
                assert states[page] == FREE
            for page, store in self._pending.items():
                assert store.filler is None or (not store.writers and not store.remaining)
                assert self._writers[page] == store.writers
            stamps = [store.allocated_at for store in self._pending.values()]
            assert stamps == sorted(stamps), "pending stores out of allocation order"
            live = {page for *key, page in self._heap if self._evictable.get(page) == tuple(key)}
            assert live == set(self._evictable), "an evictable page has no live heap entry"
            for page, key in self._evictable.items():
                assert key == self._last_use[page]
            assert all(self._generation[page] >= 1 for page in self._page_of.values())
