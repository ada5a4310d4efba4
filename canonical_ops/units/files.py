"""FileStore: canonical units in plain files, shared by processes and engines on one host.

``root/<namespace hex>/`` holds ``namespace.json`` (for tools), ``tmp/`` (files being
written), ``quarantine/`` (units that failed verification) and one file per unit at
``<kd[:2]>/<kd>/<first>-<end>.ckv`` (``kd = key_digest(key)``). Directories are made on
the first store (a reader leaves nothing behind) and walked by :mod:`.fsutil`; units are
published by :func:`.fsutil.publish` (first writer wins, crash safe) and read by
:func:`.unitfile.read_unit` (verified; an expired load never writes its destination). A
bad unit is quarantined and is a miss. Each process indexes what it knows (:mod:`.policy`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..checks import check_int, check_seconds
from . import unitfile
from .fsutil import Perms, UnsafePath, clean_temps, open_dir, open_file, open_root, probe, publish
from .fsutil import write_all as _write_all
from .jobs import JobOutcome, JobPool
from .namespace import StoreNamespace
from .policy import Entry, LruPolicy
from .tier import DEFAULT_DEADLINE_S, LoadReq, StoreReq, TierMetrics, UnitStore
from .unit import CorruptUnit, encode_header, header_length, key_digest
from .unitfile import O_DIRECT, UNIT_NAME, Found, check_unit, iter_units

__all__ = [
    "NAMESPACE_FILE",
    "FileStore",
    "GcReport",
    "StoreMetrics",
    "StoreRootError",
    "key_digest",
]

NAMESPACE_FILE, TMP_DIR, QUARANTINE_DIR = "namespace.json", "tmp", "quarantine"
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_IO_CHUNK_BYTES = 64 << 20  # largest write syscall (crash tests make it small)
# Test hook(stage, temp path, bytes written): after each write ("write"), before the link
# ("publish"); crash tests stop a writer there.
_test_hook: Callable[[str, str, int], None] | None = None


class StoreRootError(OSError):
    """The root or a directory in it is not a writable directory, or is unsafe."""


def unit_path(namespace_dir: str, kd: str, first: int, end: int) -> str:
    """Path of the unit of key digest ``kd`` and layers ``[first, end)`` (for tools)."""
    return f"{namespace_dir}/{kd[:2]}/{kd}/{first}-{end}.ckv"


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
    torn unit is a miss, never a load). ``direct_io``: O_DIRECT through aligned buffers,
    where the file system allows it (``store.direct_io`` says what is used).
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
        group_shared: bool = False,
        secret: Any = None,
        recency_granularity_s: float = 1.0,
        stale_tmp_s: float = 3600.0,
        quarantine_limit: int = 64,
    ) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root: expected a path (str or os.PathLike), got {root!r}")
        if not isinstance(namespace, StoreNamespace):
            raise TypeError(f"namespace: expected a StoreNamespace, got {type(namespace).__name__}")
        for name, flag in (
            ("fsync", fsync),
            ("direct_io", direct_io),
            ("group_shared", group_shared),
        ):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name}: expected a bool, got {flag!r}")
        if capacity_bytes is not None:
            capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=0)
        self.stale_tmp_s = check_seconds("stale_tmp_s", stale_tmp_s)
        self.quarantine_limit = check_int("quarantine_limit", quarantine_limit, minimum=0)
        self._policy = LruPolicy(check_seconds("recency_granularity_s", recency_granularity_s))
        threads, queue_depth, deadline_s = self._pool_args(pool, threads, queue_depth, deadline_s)
        self.namespace = namespace if secret is None else namespace.authenticated(secret)
        self.capacity_bytes, self.fsync = capacity_bytes, bool(fsync)
        self.root = os.path.abspath(os.fspath(root))
        self.directory = os.path.join(self.root, self.namespace.hex)
        self._perms = Perms(bool(group_shared))
        self._init_base()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._reserved, self._running, self._described = 0, 0, False
        self._removed: list[tuple[bytes, int, int]] = []
        self._fds: dict[str, int] = {}
        self._dir_lock, self._scratch = threading.Lock(), threading.local()
        try:
            try:
                self._fds["root"] = open_root(self.root, self._perms)
                self.direct_io = probe(self._fds["root"], bool(direct_io))
            except OSError as error:
                raise StoreRootError(
                    error.errno, f"root: {error.strerror or error}: {self.root!r}"
                ) from None
            if self._dir("ns") is not None:
                self._rescan()
        except BaseException:
            self._close_resources()
            raise
        self._attach_pool(pool, threads, queue_depth, "ckv-files", deadline_s)

    # ------------------------------------------------------------------ directories

    def _dir(self, name: str, *, create: bool = False) -> int | None:
        """Directory "ns", "tmp", "quarantine" or a fan-out ("3f"), opened safely once and
        kept; None when missing (made only with ``create``)."""
        if (fd := self._fds.get(name)) is not None:
            return fd
        parent = self._fds["root"] if name == "ns" else self._dir("ns", create=create)
        with self._dir_lock:
            if parent is None or name in self._fds:
                return self._fds.get(name)
            sub, what = (
                (self.namespace.hex, self.directory)
                if name == "ns"
                else (name, f"{self.directory}/{name}")
            )
            try:
                fd = open_dir(parent, sub, self._perms, create=create, sync=self.fsync, what=what)
            except UnsafePath as error:
                raise StoreRootError(error.errno, str(error)) from None
            if fd is not None:
                self._fds[name] = fd
            return fd

    def _keydir(self, kd: str, *, create: bool = False) -> int | None:
        """A key's directory (the caller closes it); None when missing."""
        fanout = self._dir(kd[:2], create=create)
        return (
            None
            if fanout is None
            else open_dir(fanout, kd, self._perms, create=create, sync=self.fsync)
        )

    def _close_resources(self) -> None:
        """Close the directories once no job runs (a job abandoned past its deadline may never
        return: they then stay open, so no descriptor is reused under it)."""
        with self._lock:
            if self._running:
                return
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)

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
            self._quarantine(found, st, error.reason)
            return None
        finally:
            os.close(fd)
        used = max(st.st_atime_ns, st.st_mtime_ns)
        return Entry(
            header.key, found.kd, found.first, found.end, st.st_size, header.position, used
        )

    def _rescan(self) -> int:
        """Rebuild the index from disk (headers only), clean stale temps; corrupt found."""
        tmp = self._dir("tmp")
        removed = 0 if tmp is None else clean_temps(tmp, self.stale_tmp_s)
        corrupt, start = self._counts["corrupt_detected"], time.time_ns()
        found = [
            e
            for f in iter_units(self._dir("ns"), self._perms)
            if not f.problem and (e := self._index_file(f))
        ]
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
            fd = self._keydir(kd)
            if fd is None:
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
            self._counts["lookup_blocks"] += len(digests)
            self._counts["lookup_hit_blocks"] += found
        return found

    # ------------------------------------------------------------------ store

    @_running(lambda reqs: [_CLOSED] * len(reqs))
    def _store_units(self, reqs: list[StoreReq]) -> list[JobOutcome]:
        return [self._store_one(req) for req in reqs]

    def _store_one(self, req: StoreReq) -> JobOutcome:
        name, size = f"{req.first}-{req.end}.ckv", header_length(req.raw_key) + len(req.payload)
        try:
            for _attempt in range(3):
                keydir = self._keydir(req.kd, create=True)
                try:
                    entry = self._index_file(Found(req.kd, keydir, name, req.first, req.end))
                    if entry is not None:
                        if entry.ident not in self._policy:
                            self._add(entry)
                        self._count("stores_skipped")
                        return JobOutcome("ok", detail="already stored")
                    self._drop((req.kd, req.first, req.end))  # evicted by another process
                    self._reserve(size)
                    try:
                        won = self._publish(keydir, name, req)
                    finally:
                        with self._lock:
                            self._reserved -= size
                    break
                except FileNotFoundError:
                    continue  # the key directory was just removed by an eviction: again
                finally:
                    os.close(keydir)
            else:
                raise OSError(errno.ENOENT, "key directory keeps vanishing", name)
        except OSError as error:
            self._count("stores_failed")
            full = " (disk full)" if error.errno in _DISK_FULL else ""
            return JobOutcome("error", detail=f"store failed{full}: {error}", error=error)
        if not won:
            self._count("stores_skipped")
            self._refresh_key(req.kd)
            return JobOutcome("ok", detail="another writer stored it first")
        unit = (req.raw_key, req.kd, req.first, req.end, size, req.position)
        self._add(Entry(*unit, time.time_ns()))
        with self._lock:
            self._counts["units_stored"] += 1
            self._counts["bytes_stored"] += len(req.payload)
        return JobOutcome("ok", nbytes=len(req.payload))

    def _reserve(self, size: int) -> None:
        """Count ``size`` bytes as being written, evicting first when over capacity."""
        with self._lock:
            victims, cap, policy = [], self.capacity_bytes, self._policy
            if cap is not None:
                if size > cap:
                    raise OSError(errno.EFBIG, f"unit of {size} bytes exceeds capacity_bytes={cap}")
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
            keydir = self._keydir(kd)
            if keydir is not None:
                try:
                    os.unlink(f"{first}-{end}.ckv", dir_fd=keydir)
                finally:
                    os.close(keydir)
                with contextlib.suppress(OSError):  # unless not empty
                    os.rmdir(kd, dir_fd=self._dir(kd[:2]))
                return True
        return False

    @_running(lambda keys: 0)
    def remove(self, keys: Any, first: int, end: int) -> int:
        """Remove units ``[first, end)`` of ``keys`` (any process's); how many there were.
        Not an eviction: not counted as one, not reported by :meth:`take_removed`."""
        first, end = self._range(first, end)
        return sum(self._unlink(key_digest(raw), first, end) for raw in self._keys(keys))

    def _publish(self, keydir: int, name: str, req: StoreReq) -> bool:
        tmp = self._dir("tmp", create=True)
        if not self._described:
            self._describe(tmp)

        def hook(stage: str, temp: str, written: int) -> None:
            if _test_hook is not None:
                _test_hook(stage, f"{self.directory}/{TMP_DIR}/{temp}", written)

        def write(fd: int, temp: str) -> None:
            wrote = lambda n: hook("write", temp, n)  # noqa: E731
            if self.direct_io:
                unitfile.write_direct(fd, self.namespace, req, self._buffers(), wrote)
            else:
                unit = (req.raw_key, req.first, req.end, req.position, req.payload)
                parts = [encode_header(self.namespace, *unit), req.payload]
                _write_all(fd, parts, wrote, _IO_CHUNK_BYTES)
            hook("publish", temp, header_length(req.raw_key) + len(req.payload))

        return publish(keydir, name, write, tmp=tmp, perms=self._perms, fsync=self.fsync)

    def _describe(self, tmp: int) -> None:
        """``namespace.json``, once per process: replaced (a FIFO or link too) unless right."""
        self._described, ns = True, self._dir("ns")
        text = (json.dumps(self.namespace.describe(), indent=1, sort_keys=True) + "\n").encode()
        with contextlib.suppress(OSError):
            fd, _ = open_file(ns, NAMESPACE_FILE)
            try:
                if os.pread(fd, len(text) + 1, 0) == text:
                    return
            finally:
                os.close(fd)
        publish(ns, NAMESPACE_FILE, [text], tmp=tmp, perms=self._perms, replace=True)

    # ------------------------------------------------------------------ load

    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """This thread's aligned buffers (a piece, a first block), made on first use."""
        local = self._scratch
        if getattr(local, "size", 0) != unitfile._LOAD_CHUNK_BYTES:
            local.buffers, local.size = unitfile.aligned_buffers(), unitfile._LOAD_CHUNK_BYTES
        return local.buffers

    @_running(lambda reqs: [_CLOSED] * len(reqs))
    def _load_units(self, reqs: list[LoadReq]) -> list[JobOutcome]:
        return [self._load_one(req) for req in reqs]

    def _load_one(self, req: LoadReq) -> JobOutcome:
        excluded, problems, refreshed = set(), [], False
        while True:
            chain = self._policy.cover(req.kd, req.first, req.end, excluded)
            if chain is None and not refreshed:
                refreshed = True
                self._refresh_key(req.kd)
                continue
            if chain is None:
                self._count("misses")
                return JobOutcome("miss", detail="; ".join(problems) or "not stored")
            try:
                for entry in chain:
                    self._read_into(req, entry)
            except _UnitBad as bad:
                self._drop(bad.entry.ident)
                excluded.add(bad.entry.ident)
                problems.append(f"{bad.entry.first}-{bad.entry.end} {bad.reason}")
                continue
            except OSError as error:
                self._count("misses")
                return JobOutcome("error", detail=f"read failed: {error}", error=error)
            with self._lock:
                self._counts["hits"] += 1
                self._counts["units_loaded"] += len(chain)
                self._counts["bytes_loaded"] += len(req.dest)
            return JobOutcome("ok", nbytes=len(req.dest), detail="; ".join(problems))

    def _read_into(self, req: LoadReq, entry: Entry) -> None:
        """Read and verify ``entry`` piece by piece through this thread's buffer, copying
        the part the request wants into its destination under the job's claim."""
        name, keydir = f"{entry.first}-{entry.end}.ckv", None
        try:
            keydir = self._keydir(entry.kd)
            if keydir is None:
                raise FileNotFoundError(name)
            fd, st = open_file(keydir, name, os.O_RDONLY | (O_DIRECT if self.direct_io else 0))
        except FileNotFoundError:
            keydir is None or os.close(keydir)
            raise _UnitBad(entry, "vanished") from None
        except (UnsafePath, StoreRootError) as error:  # a symlink, FIFO, foreign directory
            if keydir is not None:
                self._quarantine(
                    Found(entry.kd, keydir, name, entry.first, entry.end), None, error.strerror
                )
                os.close(keydir)
            raise _UnitBad(entry, f"unsafe: {error.strerror or error}") from None
        found = Found(entry.kd, keydir, name, entry.first, entry.end)
        try:
            unitfile.read_unit(
                fd, st, self.namespace, req, entry.first, entry.end, self._buffers(), self.direct_io
            )
            now = time.time_ns()  # recency for other processes: once per recency bucket
            if now - max(st.st_atime_ns, st.st_mtime_ns) >= self._policy.granularity_ns:
                with contextlib.suppress(OSError):
                    os.utime(fd, ns=(now, st.st_mtime_ns))
        except CorruptUnit as error:
            self._quarantine(found, st, error.reason, entry.key)
            raise _UnitBad(entry, f"corrupt: {error.reason}") from None
        finally:
            os.close(fd)
            os.close(keydir)
        with self._lock:
            self._policy.touch(entry, time.time_ns())

    def _quarantine(
        self, found: Found, st: os.stat_result | None, reason: str, key: bytes = b""
    ) -> None:
        """Move a bad unit out of the way (or remove it), only if its name still names it."""
        with self._lock:
            self._counts["corrupt_detected"] += 1
            if key:
                self._removed.append((key, found.first, found.end))
        target = f"{found.kd}-{time.time_ns()}-{secrets.token_hex(4)}-{found.name}"
        try:
            quarantine = self._dir(QUARANTINE_DIR, create=True)
            keep = len(os.listdir(quarantine)) < self.quarantine_limit
            os.rename(found.name, target, src_dir_fd=found.dir_fd, dst_dir_fd=quarantine)
            moved = os.stat(target, dir_fd=quarantine, follow_symlinks=False)
        except OSError:
            return  # already moved or removed by someone else, or no safe quarantine
        if st is not None and (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino):
            # A good unit was published under this name since we read the bad one: back.
            with contextlib.suppress(FileExistsError):
                os.link(target, found.name, src_dir_fd=quarantine, dst_dir_fd=found.dir_fd)
            keep = False
        if keep:
            self._count("quarantined")
        else:  # full: the first few are kept for post-mortems
            os.unlink(target, dir_fd=quarantine)

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
        corrupt = self._rescan() if self._dir("ns") is not None else 0
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


class _UnitBad(Exception):
    def __init__(self, entry: Entry, reason: str) -> None:
        self.entry, self.reason = entry, reason
