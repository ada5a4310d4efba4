"""Scheduler-side bookkeeping of canonical pages: block hash -> page, readiness, LRU, pins.

A page goes ``free -> pending -> ready``: ready once every elected writer rank reported its
store, or for a page *filled* by a tier (``allocate(..., filler=)``) once its unit verified.
A report names the generation (bumped by every allocation) it stored: an abandoned store's
late report never counts. Least recently used first eviction, a prefix's tail before its
head. Pure Python and thread-safe (design: docs/design.md)."""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from ..checks import check_int

if TYPE_CHECKING:  # pragma: no cover - typing only
    from layouts import CanonicalPageMapping

__all__ = ["PageCapacityError", "PageManager", "PageState", "PageStateError"]

PageState = Literal["free", "pending", "ready"]
FREE: PageState = "free"
PENDING: PageState = "pending"
READY: PageState = "ready"


class PageCapacityError(RuntimeError):
    """Not enough free or evictable pages for an allocation (nothing was allocated):
    ``needed`` pages, ``free`` ones and ``evictable`` ones (ready, unreferenced, not the
    request's own hashes' pages)."""

    def __init__(self, needed: int, free: int, evictable: int) -> None:
        self.needed, self.free, self.evictable = needed, free, evictable
        super().__init__(
            f"cannot allocate {needed} canonical page(s): only {free} free and {evictable} "
            f"evictable (ready, unreferenced) page(s); the other pages are pending stores or "
            f"held by loads. Nothing was allocated."
        )


class PageStateError(ValueError):
    """A page id, rank, generation or block hash that is not valid for the transition
    asked for (the manager is unchanged when it is raised)."""


class _Pending:
    """An in-flight store (writers left to report) or fill (``filler`` set, no writers)."""

    __slots__ = ("filler", "remaining", "writers")

    def __init__(self, writers: frozenset[int], filler: str | None) -> None:
        self.writers, self.remaining, self.filler = writers, set(writers), filler


class PageManager:
    """Maps block hashes to canonical pages ``0 .. num_pages - 1`` and tracks their state.
    ``writer_ranks(page_id)``: the ranks (of ``range(num_ranks)``) that must all report a
    store of the page before it is ready; default every rank (see :meth:`from_mappings`).
    Methods are atomic and leave the manager unchanged when they raise."""

    def __init__(
        self,
        num_pages: int,
        writer_ranks: Callable[[int], Iterable[int]] | None = None,
        *,
        num_ranks: int = 1,
    ) -> None:
        self._num_pages = check_int("num_pages", num_pages, minimum=1)
        self._num_ranks = check_int("num_ranks", num_ranks, minimum=1)
        if writer_ranks is not None and not callable(writer_ranks):
            got = type(writer_ranks).__name__
            raise TypeError(f"writer_ranks: expected a callable or None, got {got}")
        everyone = frozenset(range(self._num_ranks))
        self._writer_ranks = writer_ranks or (lambda _page: everyone)
        self._lock = threading.Lock()
        self._state: list[PageState] = [FREE] * self._num_pages
        self._hash_of: list[Hashable | None] = [None] * self._num_pages
        self._refcount = [0] * self._num_pages
        self._writers: list[frozenset[int]] = [frozenset()] * self._num_pages
        self._generation = [0] * self._num_pages
        self._page_of: dict[Hashable, int] = {}
        # Free pages are taken from the left; failed stores' pages return on the right, so a
        # stuck writer's late bytes are the least likely to land in a reused page.
        self._free: deque[int] = deque(range(self._num_pages))
        self._pending: dict[int, _Pending] = {}
        # A use stamps a page (tick of the call, -position in it): the smallest key is the
        # least recent, and a call's tail comes before its head. The heap holds (key, page)
        # of evictable pages; entries whose page was re-keyed, pinned or evicted are stale.
        self._tick = 0
        self._last_use: list[tuple[int, int]] = [(0, 0)] * self._num_pages
        self._evictable: dict[int, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, int]] = []
        self._num_ready = 0

    @classmethod
    def from_mappings(
        cls, num_pages: int, layer_group_mappings: Sequence[Sequence[CanonicalPageMapping]]
    ) -> PageManager:
        """A manager whose writers of page ``p`` are the ranks elected to write some layer of
        it (``layer_group_mappings[l][r]``: layer ``l``'s mapping at rank ``r``, e.g. one
        ``derive_group_mappings`` per layer; :class:`layouts.WriterElection`)."""
        from layouts.election import WriterElection

        election = WriterElection(layer_group_mappings)
        return cls(num_pages, election.writers, num_ranks=election.num_ranks)

    # Counters (each one read is consistent; use the lock for several at once).
    num_pages = property(lambda self: self._num_pages)
    num_ranks = property(lambda self: self._num_ranks)
    num_free = property(lambda self: len(self._free), doc="Pages holding nothing.")
    num_pending = property(lambda self: len(self._pending), doc="Pages being stored or filled.")
    num_ready = property(lambda self: self._num_ready)
    num_evictable = property(lambda self: len(self._evictable), doc="Ready, unpinned pages.")

    @property
    def num_filling(self) -> int:
        """Pending pages being filled by a tier."""
        with self._lock:
            return sum(p.filler is not None for p in self._pending.values())

    # ----------------------------------------------------------------- checks

    def _page(self, page_id: object, name: str = "page_id") -> int:
        last = self._num_pages - 1
        return check_int(name, page_id, minimum=0, maximum=last, error=PageStateError)

    @staticmethod
    def _generation_arg(generation: object, name: str = "generation") -> int:
        return check_int(name, generation, minimum=1, error=PageStateError)

    @staticmethod
    def _hashes(block_hashes: Iterable[Hashable]) -> list[Hashable]:
        if isinstance(block_hashes, (str, bytes)):
            kind = type(block_hashes).__name__
            raise TypeError(f"block_hashes: expected a sequence, got a single {kind}; wrap it")
        hashes = list(block_hashes)
        for i, block_hash in enumerate(hashes):
            if block_hash is None:
                raise ValueError(f"block_hashes[{i}]: None is not a block hash")
            try:
                hash(block_hash)
            except TypeError:
                kind = type(block_hash).__name__
                raise TypeError(f"block_hashes[{i}]: expected a hashable, got {kind}") from None
        return hashes

    def _writers_for(self, page_id: int) -> frozenset[int]:
        result = self._writer_ranks(page_id)
        try:
            writers = frozenset(result)
            ok = bool(writers) and all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self._num_ranks
                for r in writers
            )
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(
                f"writer_ranks({page_id}): expected a non-empty set of ranks in "
                f"[0, {self._num_ranks}), got {result!r}; the page could never be ready"
            )
        return writers

    # ----------------------------------------------------------------- recency (lock held)

    def _make_evictable(self, page: int) -> None:
        key = self._last_use[page]
        self._evictable[page] = key
        heapq.heappush(self._heap, (*key, page))

    def _use(self, pages: Iterable[int]) -> None:
        """Stamp ``pages`` as used by one call, the first the most recent."""
        self._tick += 1
        for position, page in enumerate(pages):
            self._last_use[page] = (self._tick, -position)
            if page in self._evictable:
                self._make_evictable(page)  # re-keyed: its old heap entry turns stale
        if len(self._heap) > 2 * len(self._evictable) + 64:  # amortised O(1) clean-up
            self._heap = [(*key, page) for page, key in self._evictable.items()]
            heapq.heapify(self._heap)

    def _least_recent(self, count: int, protected: set[int]) -> list[tuple[int, int, int]]:
        """Pop the heap entries of the ``count`` least recent evictable pages not protected
        (the caller checked there are enough, and commits or pushes them back)."""
        taken: list[tuple[int, int, int]] = []
        skipped: list[tuple[int, int, int]] = []
        while len(taken) < count:
            entry = heapq.heappop(self._heap)
            if self._evictable.get(entry[2]) != entry[:2]:
                continue  # stale
            (skipped if entry[2] in protected else taken).append(entry)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return taken

    def _free_locked(self, page: int) -> None:
        del self._pending[page]
        del self._page_of[self._hash_of[page]]
        self._hash_of[page] = None
        self._writers[page] = frozenset()
        self._state[page] = FREE
        self._free.append(page)

    def _ready_locked(self, page: int) -> None:
        del self._pending[page]
        self._state[page] = READY
        self._num_ready += 1
        self._make_evictable(page)  # as recent as its allocation

    # ----------------------------------------------------------------- scheduler API

    def lookup(self, block_hashes: Iterable[Hashable]) -> int:
        """Length of the longest prefix of ``block_hashes`` whose pages are ready (a pending
        page ends it); those pages are used by this call."""
        hashes = self._hashes(block_hashes)
        with self._lock:
            prefix = []
            for block_hash in hashes:
                page = self._page_of.get(block_hash)
                if page is None or self._state[page] != READY:
                    break
                prefix.append(page)
            self._use(prefix)
            return len(prefix)

    def allocate(
        self, block_hashes: Iterable[Hashable], *, filler: str | None = None
    ) -> list[int | None]:
        """Pending pages for the hashes not present yet (None for the others and repeats),
        free pages first, then the least recently used evictable ones (never one of this
        request's); read each one's :meth:`generation` for its writers now. ``filler``: the
        tier whose I/O fills them (:meth:`complete_fill` / :meth:`fail_fill` report it).
        :class:`PageCapacityError`, nothing allocated or evicted, when pages run short."""
        hashes = self._hashes(block_hashes)
        if filler is not None and (not isinstance(filler, str) or not filler):
            raise TypeError(f"filler: expected None or a tier name (non-empty str), got {filler!r}")
        with self._lock:
            seen: set[Hashable] = set()
            new = []  # indices into hashes that need a page
            for i, block_hash in enumerate(hashes):
                if block_hash not in seen and block_hash not in self._page_of:
                    new.append(i)
                seen.add(block_hash)
            if not new:
                return [None] * len(hashes)
            wanted = len(new) - len(self._free)
            victims: list[tuple[int, int, int]] = []
            if wanted > 0:
                protected = {self._page_of[h] for h in seen if h in self._page_of}
                evictable = len(self._evictable) - sum(p in self._evictable for p in protected)
                if evictable < wanted:
                    raise PageCapacityError(len(new), len(self._free), evictable)
                victims = self._least_recent(wanted, protected)
            pages = [*itertools.islice(self._free, len(new) - len(victims))]
            pages += [page for *_, page in victims]
            try:  # ask for the writers before changing anything
                writers = [frozenset() if filler else self._writers_for(p) for p in pages]
            except BaseException:
                for entry in victims:
                    heapq.heappush(self._heap, entry)
                raise
            for _ in range(len(new) - len(victims)):
                self._free.popleft()
            for *_, page in victims:
                del self._evictable[page]
                del self._page_of[self._hash_of[page]]
                self._num_ready -= 1
            out: list[int | None] = [None] * len(hashes)
            for i, page, page_writers in zip(new, pages, writers):
                self._state[page] = PENDING
                self._hash_of[page] = hashes[i]
                self._page_of[hashes[i]] = page
                self._writers[page] = page_writers
                self._generation[page] += 1
                self._pending[page] = _Pending(page_writers, filler)
                out[i] = page
            self._use(out[i] for i in new)
            return out

    def complete_store(self, page_id: int, rank: int, *, generation: int) -> bool:
        """``rank`` stored its bytes of pending page ``page_id`` at ``generation`` (read right
        after :meth:`allocate`; a late report of an abandoned store names an older one and
        is refused); True when this report made the page ready."""
        page = self._page(page_id)
        rank = check_int("rank", rank, minimum=0, maximum=self._num_ranks - 1, error=PageStateError)
        generation = self._generation_arg(generation)
        with self._lock:
            self._check_generation(page, generation, "store")
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
            self._ready_locked(page)
            return True

    def fail_store(
        self, page_ids: Iterable[int], *, generations: Iterable[int] | None = None
    ) -> list[int]:
        """Abandon the stores of ``page_ids`` (failed, or a writer rank died): pending pages
        are free again, their hashes forgotten; returns those. Ready pages and fills (their
        job may still write the row) stay; so does a page whose generation moved on from
        ``generations`` (aligned with ``page_ids``): it holds another block now."""
        pages = [self._page(p, f"page_ids[{i}]") for i, p in enumerate(page_ids)]
        if generations is not None:
            gens = [self._generation_arg(g, f"generations[{i}]") for i, g in enumerate(generations)]
            if len(gens) != len(pages):
                raise PageStateError(
                    f"generations: expected one per page id ({len(pages)}), got {len(gens)}"
                )
        with self._lock:
            if generations is not None:
                pages = [p for p, g in zip(pages, gens) if self._generation[p] == g]
            failed = []
            for page in pages:
                store = self._pending.get(page)
                if store is not None and store.filler is None:
                    self._free_locked(page)
                    failed.append(page)
            return failed

    def _check_generation(self, page: int, generation: int, kind: str) -> None:
        """PageStateError unless ``generation`` is ``page``'s current one (lock held): a late
        report of an abandoned ``kind`` ("store" or "fill") names an older one."""
        current = self._generation[page]
        if generation != current:
            why = (
                "that generation was never allocated"
                if generation > current
                else f"the {kind} of generation {generation} was abandoned and the page "
                "allocated again; its late report does not count"
            )
            raise PageStateError(
                f"generation: expected page {page}'s current generation {current}, got "
                f"{generation}: {why}"
            )

    def _fill(self, page_id: int, generation: int, what: str) -> int:
        """The page of a pending fill at ``generation`` (lock held); PageStateError else."""
        page = self._page(page_id)
        self._check_generation(page, self._generation_arg(generation), "fill")
        store = self._pending.get(page)
        if store is None or store.filler is None:
            state = "being stored by ranks" if store is not None else self._state[page]
            raise PageStateError(
                f"page_id: page {page} is {state}, not being filled by a tier; "
                f"{what} reports only fills allocated with allocate(..., filler=)"
            )
        return page

    def complete_fill(self, page_id: int, *, generation: int) -> None:
        """A tier's fill of page ``page_id`` read and verified its unit: the page is ready."""
        with self._lock:
            self._ready_locked(self._fill(page_id, generation, "complete_fill"))

    def fail_fill(self, page_id: int, *, generation: int) -> None:
        """A tier's fill failed (missing, corrupt, error, refused): the page is free again and
        its hash forgotten, so the block is a miss; whatever the job wrote is never served."""
        with self._lock:
            self._free_locked(self._fill(page_id, generation, "fail_fill"))

    def acquire(self, block_hashes: Iterable[Hashable]) -> list[int]:
        """Pin the ready pages of ``block_hashes`` for a load (refcount +1 each; never evicted
        until :meth:`release`); PageStateError, nothing pinned, if one is not ready."""
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
            return pages

    def release(self, page_ids: Iterable[int]) -> None:
        """Unpin pages :meth:`acquire` pinned (refcount -1 each). A page whose count drops to
        0 is evictable again, used by this call at its first position in ``page_ids``."""
        pages = [self._page(p, f"page_ids[{i}]") for i, p in enumerate(page_ids)]
        with self._lock:
            counts = Counter(pages)  # in order of first position
            for page, count in counts.items():
                if count > self._refcount[page]:
                    raise PageStateError(
                        f"page_ids: page {page} released {count} time(s) but held by "
                        f"{self._refcount[page]} acquire(s)"
                    )
            unpinned = []
            for page, count in counts.items():  # dict order: first positions
                self._refcount[page] -= count
                if self._refcount[page] == 0:
                    unpinned.append(page)
                    self._evictable[page] = self._last_use[page]
            self._use(unpinned)

    # ----------------------------------------------------------------- introspection

    # One item of a list or dict is read atomically: these need no lock.

    def state(self, page_id: int) -> PageState:
        return self._state[self._page(page_id)]

    def page_of(self, block_hash: Hashable) -> int | None:
        """The page holding ``block_hash`` (pending or ready), or None."""
        return self._page_of.get(block_hash)

    def hash_of(self, page_id: int) -> Hashable | None:
        """The block hash page ``page_id`` holds, or None when free."""
        return self._hash_of[self._page(page_id)]

    def refcount(self, page_id: int) -> int:
        return self._refcount[self._page(page_id)]

    def generation(self, page_id: int) -> int:
        """Allocations of page ``page_id`` so far: the generation its writers' reports name."""
        return self._generation[self._page(page_id)]

    def writer_ranks(self, page_id: int) -> frozenset[int]:
        """Ranks that must all report a store of page ``page_id`` before it is ready."""
        page = self._page(page_id)
        with self._lock:
            if self._state[page] != FREE:
                return self._writers[page]
        return self._writers_for(page)

    def pending_writers(self, page_id: int) -> frozenset[int]:
        """Writers of pending page ``page_id`` that have not reported yet."""
        page = self._page(page_id)
        with self._lock:
            store = self._pending.get(page)
            if store is None:
                raise PageStateError(f"page_id: page {page} is {self._state[page]}, not pending")
            return frozenset(store.remaining)
