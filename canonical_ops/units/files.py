"""FileStore: canonical units in plain files, shared by processes and engines on one host.

``root/<namespace hex>/`` holds ``namespace.json`` (for tools), ``tmp/`` (files being
written), ``quarantine/`` (units that failed verification) and one file per unit at
``<kd[:2]>/<kd>/<first>-<end>.ckv`` (``kd = key_digest(key)``), made on the first store
(a reader leaves nothing behind). A job's units are written or read and verified in one
native call (:mod:`.unitfile`), without the GIL. A bad unit is quarantined and is a miss.
Each process indexes what it knows (:mod:`.policy`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import canonical_ops._unitio as _unitio
from layouts.cli import escape_text

from ..checks import check_bool, check_int, check_seconds, check_type
from . import fsutil, unitfile
from .fsutil import Dirs, Perms, StoreRootError, UnsafePath, open_file
from .jobs import JobOutcome, JobPool, current_job, ok_outcome
from .namespace import StoreNamespace
from .policy import Entry, LruPolicy
from .tier import DEFAULT_DEADLINE_S, LoadReq, StoreReq, TierMetrics, UnitStore
from .unit import CorruptUnit, header_length, key_digest, packed_header
from .unitfile import UNIT_NAME, Found, check_unit, iter_units

__all__ = ["NAMESPACE_FILE", "FileStore", "GcReport", "StoreMetrics", "StoreRootError"]

NAMESPACE_FILE, TMP_DIR, QUARANTINE_DIR = "namespace.json", "tmp", "quarantine"
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_VANISHING = "key directory keeps vanishing"
_UNSAFE_DIR = "expected a directory of this user (or its groups) writable by no one else"
# Native I/O in pieces that stay in L2 between hash and write (or read and hash): measured in
# bench/verified_io_candidates.cpp and bench_vllm_tiers.py (docs/design.md, "Native unit I/O").
_IO_CHUNK_BYTES = 8 << 20  # bytes hashed then written per write: a unit up to this is ONE
# write with its checksum in place (its second read from the L3; crash tests make it small)
_PIECE_BYTES = 256 << 10  # bytes read and hashed per step (from the page cache: in place)
# Bytes written at once with O_DIRECT (an aligned buffer); O_DIRECT loads read up to this per
# request into a ring of two (Linux AIO): the next units read while one is hashed and copied.
_BOUNCE_BYTES = 4 << 20
_NOWAIT = True  # try the page cache first (RWF_NOWAIT); tests turn it off
# Test hook(stage, path, bytes): after each write ("write"), before the rename ("publish"),
# before each read that may block ("read"): tests stop or slow a worker there.
_test_hook: Callable[[str, str, int], None] | None = None


@dataclass(frozen=True)
class StoreMetrics(TierMetrics):
    """A :class:`FileStore`'s counters: :class:`TierMetrics`' and its own (and its index)."""

    quarantined: int = 0
    evicted: int = 0
    bytes_evicted: int = 0
    temps_removed: int = 0
    units_on_disk: int = 0
    bytes_on_disk: int = 0


_COUNTERS = tuple(f.name for f in fields(StoreMetrics) if not f.name.endswith("_on_disk"))


@dataclass(frozen=True)
class GcReport:
    """What a gc did (dry: would do); ``evicted``: the paths, for a dry run."""

    units_evicted: int
    bytes_evicted: int
    temps_removed: int
    corrupt_found: int
    units_on_disk: int
    bytes_on_disk: int
    evicted: tuple[str, ...] = ()


def _running(closed: Callable[[Any], Any]) -> Callable:
    """A primitive that keeps the store's descriptors open while it runs; after close it
    does nothing and returns ``closed(first argument)``."""

    def wrap(work: Callable) -> Callable:
        def run(self: FileStore, arg: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                if self._closed and not self._running:
                    return closed(arg)
                self._running += 1
            try:
                return work(self, arg, *args, **kwargs)
            finally:
                with self._lock:
                    self._running -= 1
                    last = self._closed and not self._running
                if last:
                    self._close_resources()

        return run

    return wrap


class FileStore(UnitStore):
    """Canonical units in files under ``root``, for one :class:`StoreNamespace`.

    ``root`` is created 0700 when missing (one others may write must be sticky).
    ``capacity_bytes``: unit bytes this store keeps (its view; None: unbounded).
    ``threads``/``queue_depth``/``deadline_s``: its own :class:`JobPool` (4, 64, 30 s;
    None: no deadline), or a shared ``pool`` (whose deadline applies). ``fsync``: sync
    data and directories before a unit counts (False: crash safe, not power-loss safe; a
    torn unit is a miss, never a load). ``direct_reads``: a unit the page cache does not
    hold whole is read O_DIRECT, its reads ahead of its hashing (one it holds is read from
    the cache; vLLM's ``fs`` reads O_DIRECT too); ``direct_io``: O_DIRECT writes as well.
    Either only where the file system allows O_DIRECT (``store.direct_reads`` and
    ``store.direct_io`` say what is used).
    ``group_shared``: dirs 0770 / files 0660 and group-owned dirs trusted (default 0700 /
    0600, this user's only). ``secret``: authenticated units (:mod:`.auth`).
    ``recency_granularity_s``: eviction's recency buckets; ``stale_tmp_s``: age after
    which a temp file of an unknown writer goes; ``quarantine_limit``: bad units kept.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        namespace: StoreNamespace,
        *,
        capacity_bytes: int | None = None,
        threads: int | None = None,
        queue_depth: int | None = None,
        fsync: bool = True,
        pool: JobPool | None = None,
        deadline_s: float | None = DEFAULT_DEADLINE_S,
        direct_io: bool = False,
        direct_reads: bool = True,
        group_shared: bool = False,
        secret: Any = None,
        recency_granularity_s: float = 1.0,
        stale_tmp_s: float = 3600.0,
        quarantine_limit: int = 64,
    ) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root: expected a path (str or os.PathLike), got {root!r}")
        check_type("namespace", namespace, StoreNamespace)
        fsync, direct_io = check_bool("fsync", fsync), check_bool("direct_io", direct_io)
        direct_reads = check_bool("direct_reads", direct_reads) or direct_io
        group_shared = check_bool("group_shared", group_shared)
        if capacity_bytes is not None:
            capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=0)
        self.stale_tmp_s = check_seconds("stale_tmp_s", stale_tmp_s)
        self.quarantine_limit = check_int("quarantine_limit", quarantine_limit, minimum=0)
        self._policy = LruPolicy(check_seconds("recency_granularity_s", recency_granularity_s))
        threads, queue_depth, deadline_s = self._pool_args(pool, threads, queue_depth, deadline_s)
        self.namespace = namespace.for_store(secret)
        self.capacity_bytes, self.fsync = capacity_bytes, fsync
        self.root = os.path.abspath(os.fspath(root))
        self.directory = os.path.join(self.root, self.namespace.hex)
        self._perms = Perms(group_shared)
        self._init_base(_COUNTERS)
        self._reserved, self._running, self._described = 0, 0, False
        self._removed: list[tuple[bytes, int, int]] = []
        try:  # a root that cannot be opened, or written (the probe)
            root_fd = fsutil.open_root(self.root, self._perms)
            try:
                self.direct_reads = fsutil.probe(root_fd, direct_reads)
                self.direct_io = direct_io and self.direct_reads
            except BaseException:
                os.close(root_fd)
                raise
        except OSError as error:
            raise StoreRootError(error.errno, f"root: {error.strerror}: {self.root!r}") from None
        self._dirs = Dirs(root_fd, self.directory, self.namespace.hex, self._perms, self.fsync)
        try:
            if self._dirs.get("ns") is not None:
                self._rescan()
        except BaseException:
            self._close_resources()
            raise
        self._attach_pool(pool, threads, queue_depth, "ckv-files", deadline_s)

    def _close_resources(self) -> None:
        """Close the directories once no job runs (a job abandoned past its deadline may never
        return: they then stay open, so no descriptor is reused under it)."""
        with self._lock:
            if self._running:
                return
        self._dirs.close()

    # ------------------------------------------------------------------ index

    def _add(self, entry: Entry) -> None:
        with self._lock:
            self._policy.add(entry)

    def _drop(self, ident: tuple[str, int, int]) -> None:
        with self._lock:
            self._policy.drop(ident)

    def _index_file(self, found: Found) -> Entry | None:
        """An entry for a unit file from its header; None when gone or bad (quarantined)."""
        try:
            fd, st = open_file(found.dir_fd, found.name)
        except UnsafePath as error:  # a FIFO, a symlink, ... where a unit belongs
            self._quarantine(found, None, error.strerror)
            return None
        except OSError:
            return None
        try:
            header = check_unit(fd, st.st_size, self.namespace, found)
        except CorruptUnit as error:
            self._quarantine(found, (st.st_dev, st.st_ino), error.reason)
            return None
        finally:
            os.close(fd)
        unit = (header.key, found.kd, found.first, found.end, st.st_size, header.position)
        return Entry(*unit, max(st.st_atime_ns, st.st_mtime_ns))

    def _rescan(self) -> int:
        """Rebuild the index from disk (headers only), clean stale temps; corrupt found."""
        tmp = self._dirs.get("tmp")
        removed = 0 if tmp is None else fsutil.clean_temps(tmp, self.stale_tmp_s)
        corrupt, start = self._counts["corrupt_detected"], time.time_ns()
        units = iter_units(self._dirs.get("ns"), self._perms)
        found = [e for f in units if not f.problem and (e := self._index_file(f))]
        with self._lock:
            seen = {e.ident for e in found}  # units stored meanwhile: the scan may miss them
            found += [e for e in self._policy if e.last_used >= start and e.ident not in seen]
            self._policy.clear()
            self._counts["temps_removed"] += removed
        for entry in sorted(found, key=lambda e: e.last_used):
            self._add(entry)
        return self._counts["corrupt_detected"] - corrupt

    def _refresh_key(self, kd: str) -> None:
        """Index the units of ``kd`` other processes wrote (one directory listing)."""
        with contextlib.suppress(OSError):
            if (fd := self._dirs.keydir(kd)) is None:
                return
            try:
                known = self._policy.ranges(kd)
                for name in os.listdir(fd):
                    m = UNIT_NAME.fullmatch(name)
                    found = m and Found(kd, fd, name, int(m[1]), int(m[2]))
                    if found and found[3:5] not in known and (entry := self._index_file(found)):
                        self._add(entry)
            finally:
                os.close(fd)

    # ------------------------------------------------------------------ lookup

    @_running(lambda keys: 0)
    def _lookup(self, raw_keys: list[bytes], first: int, end: int, *, inline: bool) -> int:
        """The prefix found on disk, touched tail first (so its head is the most recent)."""
        digests, found, cover = [key_digest(k) for k in raw_keys], 0, self._policy.cover
        for kd in digests:
            if cover(kd, first, end) is None:
                self._refresh_key(kd)
                if cover(kd, first, end) is None:
                    break
            found += 1
        now = time.time_ns()
        with self._lock:
            for kd in reversed(digests[:found]):
                for entry in cover(kd, first, end) or ():
                    self._policy.touch(entry, now)
        self._count("lookup_blocks", len(digests), lookup_hit_blocks=found)
        return found

    # ------------------------------------------------------------------ store

    def _hook(self) -> Callable[[str, str, int], None] | None:
        hook, top = _test_hook, self.directory
        return hook and (lambda stage, rel, n: hook(stage, f"{top}/{rel}", n))

    @_running(lambda reqs, *_: [_CLOSED] * len(reqs))
    def _store_units(self, reqs: list[StoreReq], attempt: int = 0) -> list[JobOutcome]:
        """Write the batch natively (each unit hashed as written, published first writer
        wins under the job's claim); a file already there is checked, a bad one replaced."""
        if attempt > 2:  # each time, its key directory vanished or a bad unit was in the way
            return [self._store_failed(OSError(errno.ENOENT, _VANISHING)) for _ in reqs]
        out: list[Any] = [None] * len(reqs)
        items, batch, reserve, cap = [], [], 0, self.capacity_bytes
        for i, req in enumerate(reqs):
            size = header_length(req.raw_key) + len(req.payload)
            try:
                if cap is not None and size > cap:
                    raise OSError(errno.EFBIG, f"unit of {size} bytes exceeds capacity_bytes={cap}")
                head = packed_header(self.namespace, req.raw_key, req.first, req.end, req.position)
                fan = self._dirs.get(req.kd[:2], create=True)
                tmp = self._dirs.get("tmp", create=True)
                if not self._described:
                    self._describe(tmp)
            except OSError as error:
                out[i] = self._store_failed(error)
                continue
            name, mac = f"{req.first}-{req.end}.ckv", unitfile.mac(self.namespace)
            items.append((fan, req.kd, name, head, req.payload, mac))
            batch.append(i)
            reserve += 0 if (req.kd, req.first, req.end) in self._policy else size
        if not batch:
            return out
        self._reserve(reserve)
        direct = self.direct_io  # O_DIRECT writes of a whole unit (up to a bounce) at once
        try:
            results = _unitio.store(
                current_job()._state,
                items,
                self._perms.native(),
                tmp,
                fsutil.temp_prefix(),
                _BOUNCE_BYTES if direct else _IO_CHUNK_BYTES,
                self.fsync,
                direct,
                self._hook(),
            )
            stored, nbytes, now = [], 0, time.time_ns()
            try:
                for i, result in zip(batch, results):
                    if result[0] == _unitio.OK:  # the usual case: indexed and counted at once
                        req = reqs[i]
                        ident = (req.kd, req.first, req.end)
                        size = header_length(req.raw_key) + len(req.payload)
                        stored.append(Entry(req.raw_key, *ident, size, req.position, now))
                        nbytes += len(req.payload)
                        out[i] = ok_outcome(len(req.payload))
                    else:
                        out[i] = self._stored(reqs[i], result)
            finally:
                if stored:
                    with self._lock:
                        for entry in stored:
                            self._policy.add(entry)
                    self._count("units_stored", len(stored), bytes_stored=nbytes)
        finally:  # written: a batch larger than the room there was loses its oldest tails
            self._reserve(-reserve)
        if again := [i for i in batch if out[i] is None]:  # vanished meanwhile, or bad
            for i, outcome in zip(again, self._store_units([reqs[i] for i in again], attempt + 1)):
                out[i] = outcome
        return out

    def _stored(self, req: StoreReq, result: tuple) -> JobOutcome | None:
        """The outcome of a native store that did not publish (OK is handled by the batch);
        None: to be tried again."""
        status, err = result[:2]
        ident = (req.kd, req.first, req.end)
        if status in (_unitio.EXPIRED, _unitio.SKIPPED):
            raise RuntimeError("store expired: nothing published")
        if status in (_unitio.LOST, _unitio.EXISTS):  # index (check) what is there
            self._drop(ident)
            self._refresh_key(req.kd)
            if ident not in self._policy:
                return None
            self._count("stores_skipped")
            lost = status == _unitio.LOST
            return JobOutcome(
                "ok", detail="another writer stored it first" if lost else "already stored"
            )
        if status == _unitio.MISSING:
            return None
        if status == _unitio.UNSAFE_DIR:
            what = f"{escape_text(self.directory)}/{req.kd[:2]}/{req.kd}: {_UNSAFE_DIR}"
            return self._store_failed(UnsafePath(err, what))
        return self._store_failed(OSError(err, os.strerror(err)))

    def _store_failed(self, error: OSError) -> JobOutcome:
        self._count("stores_failed")
        full = " (disk full)" if error.errno in _DISK_FULL else ""
        return JobOutcome("error", detail=f"store failed{full}: {error}", error=error)

    def _reserve(self, size: int) -> None:
        """Count ``size`` bytes as being written (negative: written now and indexed),
        evicting least recently used units while over capacity."""
        with self._lock:
            victims, cap, policy = [], self.capacity_bytes, self._policy
            if cap is not None and policy.bytes + self._reserved + size > cap:
                victims = policy.victims(policy.bytes + self._reserved + size - cap)
            self._reserved += size
        self._evict(victims)

    def _evict(self, victims: list[Entry]) -> None:
        for victim in victims:
            self._unlink(victim.kd, victim.first, victim.end)
            with self._lock:
                self._counts["evicted"] += 1
                self._counts["bytes_evicted"] += victim.size
                self._removed.append((victim.key, victim.first, victim.end))

    def _unlink(self, kd: str, first: int, end: int) -> bool:
        """Drop a unit from the index and the disk; whether its file was there."""
        self._drop((kd, first, end))
        with contextlib.suppress(OSError):
            if (keydir := self._dirs.keydir(kd)) is not None:
                try:
                    os.unlink(f"{first}-{end}.ckv", dir_fd=keydir)
                finally:
                    os.close(keydir)
                with contextlib.suppress(OSError):  # unless not empty
                    os.rmdir(kd, dir_fd=self._dirs.fan(kd))  # -1: EBADF
                return True
        return False

    @_running(lambda keys: 0)
    def remove(self, keys: Any, first: int, end: int) -> int:
        """Remove units ``[first, end)`` of ``keys`` (any process's); how many there were.
        Not an eviction: not counted as one, not reported by :meth:`take_removed`."""
        first, end = self.namespace.layer_range(first, end)
        return sum(self._unlink(key_digest(raw), first, end) for raw in self._keys(keys))

    def _describe(self, tmp: int) -> None:
        """``namespace.json``, once per process: replaced (a FIFO or link too) unless right;
        synced only with ``fsync`` (otherwise the first store of every process would wait for
        a journal commit: 1-2 ms on an idle ext4, far more behind writeback)."""
        self._described, ns = True, self._dirs.get("ns")
        text = (json.dumps(self.namespace.describe(), indent=1, sort_keys=True) + "\n").encode()
        with contextlib.suppress(OSError):
            fd, _ = open_file(ns, NAMESPACE_FILE)
            try:
                if os.pread(fd, len(text) + 1, 0) == text:
                    return
            finally:
                os.close(fd)
        fsutil.replace_file(ns, NAMESPACE_FILE, text, tmp=tmp, perms=self._perms, sync=self.fsync)

    # ------------------------------------------------------------------ load

    @_running(lambda reqs: [_CLOSED] * len(reqs))
    def _load_units(self, reqs: list[LoadReq]) -> list[JobOutcome]:
        """Read and verify the units covering each request, all in one native call; a bad
        unit is quarantined and its request tries another cover, else it is a miss."""
        out: list[Any] = [None] * len(reqs)
        bad: dict[int, set] = {}  # units that failed, per request (few: built when needed)
        why: dict[int, list[str]] = {}
        todo, refreshed, ns = range(len(reqs)), set(), self.namespace
        cover, fan, load_item = self._policy.cover, self._dirs.fan, unitfile.load_item
        while todo:
            plan, items, units = [], [], {}  # (request, unit), its native item; units per request
            for i in todo:
                req = reqs[i]
                chain = cover(req.kd, req.first, req.end, bad.get(i, ()))
                if chain is None and i not in refreshed:
                    refreshed.add(i)
                    self._refresh_key(req.kd)
                    chain = cover(req.kd, req.first, req.end, bad.get(i, ()))
                if chain is None:
                    self._count("misses")
                    out[i] = JobOutcome("miss", detail="; ".join(why.get(i, ())) or "not stored")
                    continue
                units[i] = len(chain)
                for e in chain:
                    plan.append((i, e))
                    items.append(load_item(ns, req, e.first, e.end, fan(e.kd)))
            results, retry, used = self._native_load(items) if items else [], set(), []
            for (i, e), result in zip(plan, results):
                if i in retry or out[i] is not None:
                    continue
                if result[0] == _unitio.OK:
                    used.append(e)
                    continue
                try:
                    problem = self._loaded(reqs[i], e, result)
                except OSError as error:
                    self._count("misses")
                    out[i] = JobOutcome("error", detail=f"read failed: {error}", error=error)
                    continue
                bad.setdefault(i, set()).add(e.ident)
                why.setdefault(i, []).append(f"{e.first}-{e.end} {problem}")
                retry.add(i)
            now = time.time_ns()
            with self._lock:  # recency of the units read, at once
                for e in used:
                    self._policy.touch(e, now)
            hits = loaded = nbytes = 0
            for i, n in units.items():
                if i not in retry and out[i] is None:
                    size = len(reqs[i].dest)
                    hits, loaded, nbytes = hits + 1, loaded + n, nbytes + size
                    out[i] = (
                        JobOutcome("ok", nbytes=size, detail="; ".join(why[i]))
                        if i in why
                        else ok_outcome(size)
                    )
            if hits:
                self._count("hits", hits, units_loaded=loaded, bytes_loaded=nbytes)
            todo = sorted(retry)
        return out

    def _native_load(self, items: list[tuple]) -> list[tuple]:
        return _unitio.load(
            current_job()._state,
            items,
            self._perms.native(),
            _PIECE_BYTES,
            _BOUNCE_BYTES,
            _NOWAIT,
            self.direct_reads,
            time.time_ns(),
            self._policy.granularity_ns,
            self._hook(),
        )

    def _loaded(self, req: LoadReq, entry: Entry, result: tuple) -> str:
        """Why ``entry`` was not read and verified (a bad unit quarantined). ``OSError`` on
        an I/O error; ``RuntimeError`` when the job expired."""
        status, err, reason, head, dev, ino = result
        if status in (_unitio.EXPIRED, _unitio.SKIPPED):
            raise RuntimeError("load expired: its destination is not written")
        if status == _unitio.ERROR:
            raise OSError(err, os.strerror(err))
        self._drop(entry.ident)
        if status == _unitio.MISSING:
            return "vanished"
        if status == _unitio.UNSAFE_DIR:
            return f"unsafe: {_UNSAFE_DIR}"
        if head is not None:  # the header differs: say how
            reason = unitfile.header_problem(head, self.namespace, req.raw_key, entry.first)
        corrupt = status == _unitio.CORRUPT
        found = Found(entry.kd, -1, f"{entry.first}-{entry.end}.ckv", entry.first, entry.end)
        key = entry.key if corrupt else b""
        self._quarantine(found, (dev, ino) if corrupt else None, reason, key)
        return f"{'corrupt' if corrupt else 'unsafe'}: {reason}"

    def _quarantine(self, found: Found, ident: tuple | None, reason: str, key: bytes = b"") -> None:
        """Move a bad unit out of the way (or remove it), only if its name still names it
        (the file ``ident``, (st_dev, st_ino), when known); ``found.dir_fd`` -1: open it."""
        with self._lock:
            self._counts["corrupt_detected"] += 1
            if key:
                self._removed.append((key, found.first, found.end))
        keydir = None
        try:
            qdir = self._dirs.get(QUARANTINE_DIR, create=True)
            parent = found.dir_fd if found.dir_fd >= 0 else (keydir := self._dirs.keydir(found.kd))
            if None not in (qdir, parent) and unitfile.quarantine(
                qdir, parent, found, ident, self.quarantine_limit
            ):
                self._count("quarantined")
        except OSError:
            pass  # already moved or removed by someone else, or no safe quarantine
        finally:
            if keydir is not None:
                os.close(keydir)

    # ------------------------------------------------------------------ upkeep

    def take_removed(self) -> list[tuple[bytes, int, int]]:
        """``(raw key, first, end)`` of the units this store removed (evicted, quarantined)
        since the last call: what an engine announces as removed."""
        with self._lock:
            removed, self._removed = self._removed, []
        return removed

    def gc(self, capacity_bytes: int | None = None, *, idle_s: float | None = None) -> GcReport:
        """Rescan, remove dead writers' temps, evict down to a capacity (default: the
        store's) and every unit unused for ``idle_s`` seconds (default: none)."""
        if capacity_bytes is not None:
            capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=0)
        idle_s = check_seconds("idle_s", idle_s, optional=True)
        capacity = self.capacity_bytes if capacity_bytes is None else capacity_bytes
        before = self.metrics()
        corrupt = self._rescan() if self._dirs.get("ns") is not None else 0
        with self._lock:
            over = 0 if capacity is None else self._policy.bytes - capacity
            victims = self._policy.victims(over) if over > 0 else []
            if idle_s is not None:
                cutoff, chosen = time.time_ns() - int(idle_s * 1e9), {v.ident for v in victims}
                victims += [
                    e for e in self._policy if e.last_used < cutoff and e.ident not in chosen
                ]
        self._evict(victims)
        a, b = self.metrics(), before
        moved = (a.evicted - b.evicted, a.bytes_evicted - b.bytes_evicted)
        left = (a.units_on_disk, a.bytes_on_disk)
        return GcReport(*moved, a.temps_removed - b.temps_removed, corrupt, *left)

    def metrics(self) -> StoreMetrics:
        """A consistent snapshot of the counters."""
        with self._lock:
            return StoreMetrics(
                **self._counts, units_on_disk=len(self._policy), bytes_on_disk=self._policy.bytes
            )

    def __repr__(self) -> str:
        return (
            f"FileStore({self.directory!r}, units={len(self._policy)}, "
            f"bytes={self._policy.bytes}, capacity_bytes={self.capacity_bytes})"
        )


_CLOSED = JobOutcome("error", detail="store closed")
