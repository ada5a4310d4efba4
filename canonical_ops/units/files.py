"""A persistent, checksummed store of canonical units in plain files.

One file per unit (see :mod:`.encoding`), shared by any number of processes
and engines on one file system, under ``root``::

    root/
      <namespace hex>/                 one directory per StoreNamespace digest
        namespace.json                 StoreNamespace.describe(), for humans and tools
        tmp/                           files being written (never read)
        quarantine/                    units that failed verification
        <kd[:2]>/<kd>/<first>-<end>.ckv
                                       kd = key digest: 32 hex chars of sha256(key bytes)

A reader with another pipeline split lists one key directory to find the layer
ranges stored for that key and covers its own range with any of them.

Publication (crash safe)
------------------------
A unit is written to ``tmp/<pidns>-<pid>-<start ticks>-<random>.tmp``, synced
(``fdatasync``, when ``fsync=True``), then ``link()``-ed to its final name and
the temp name removed; the key directory (and any directory just created) is
then synced. ``link`` fails with EEXIST when the name exists: the first writer
wins and the loser's file is dropped, so two writers of the same unit leave
exactly one file, and a final name only ever names a complete unit, even after
SIGKILL or a power loss (with ``fsync=False``, a power loss may lose units or
leave torn ones; those fail verification and are quarantined, never loaded).
Temp files whose writer is dead (pid gone or reused) or that are older than
``stale_tmp_s`` are removed at start-up and by :meth:`FileStore.gc`.

Reading
-------
Every read verifies the whole unit (size, header, namespace, key, layer
range, checksum) before the load is reported; a unit that fails is moved to
``quarantine/`` (or removed once the quarantine holds ``quarantine_limit``
files), counted, and the load is a miss (``"miss"``: the destination's bytes
are then undefined and must not be used). When one unit covers the requested
layers exactly, it is read straight into the destination (no extra copy), in
pieces of 1 MiB, each hashed while it is still in the core's cache: the
header with the first piece, checked against the bytes the unit must have
before any payload byte is hashed.

Index and capacity
------------------
Each process keeps an index of the units it knows: rebuilt at start-up by a
scan that reads headers only (one ``pread`` of at most 1120 bytes per file),
kept current by its own stores and by lookups, which list a key's directory on
disk when the index does not cover a key (units of other processes). With
``capacity_bytes``, a store first evicts units: the least recently used first
(recency quantised to ``recency_granularity_s``), and among equally recent
ones the tails (higher prefix position) before the heads, since a tail is
useless without its head. Capacity is enforced on this process's view; several
processes sharing a root should share one capacity through :meth:`gc` (or
``python -m canonical_ops store gc``), which rescans the disk.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..checks import check_int
from .jobs import IOJob, JobOutcome, JobPool, run_inline
from .namespace import StoreNamespace
from .tier import TierBase, TierMetrics
from .unit import (
    FIXED_HEADER_BYTES,
    MAX_HEADER_BYTES,
    CorruptUnit,
    PayloadVerifier,
    UnitHeader,
    as_byte_view,
    begin_unit_check,
    decode_header,
    encode_header,
    header_length,
    normalize_key,
    peek_header,
)

__all__ = [
    "NAMESPACE_FILE",
    "FileStore",
    "GcReport",
    "StoreMetrics",
    "StoreRootError",
    "UnitFile",
    "check_unit_file",
    "clean_stale_temps",
    "gc_directories",
    "iter_unit_files",
    "key_digest",
    "unit_path",
]

NAMESPACE_FILE = "namespace.json"
TMP_DIR = "tmp"
QUARANTINE_DIR = "quarantine"
UNIT_SUFFIX = ".ckv"
_UNIT_NAME = re.compile(r"(\d{1,6})-(\d{1,6})\.ckv")
_KEY_DIR = re.compile(r"[0-9a-f]{32}")
_FANOUT_DIR = re.compile(r"[0-9a-f]{2}")
_TMP_NAME = re.compile(r"(\d+)-(\d+)-(\d+)-[0-9a-f]+\.tmp")
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# Largest single read or write syscall: bounds a stuck syscall and lets the
# crash tests stop a writer in the middle of a unit.
_IO_CHUNK_BYTES = 64 << 20
# Loads read and hash a unit in pieces of this size: each piece is hashed while it
# is still in the core's cache, and is large enough that a syscall per piece costs
# little (bench/bench_read_hash.py measures the sizes).
_LOAD_CHUNK_BYTES = 1 << 20
# Verification of a whole file (tools) hashes it in pieces of this size.
_VERIFY_CHUNK_BYTES = 8 << 20
_NS_PER_S = 1_000_000_000

# Test hook: called as hook(stage, tmp_path, bytes_written) after each write
# syscall (stage "write") and before the link (stage "publish"). Crash tests
# set it in a child process to stop a writer at a chosen point.
_test_hook: Callable[[str, str, int], None] | None = None


class StoreRootError(OSError):
    """``root`` is missing, not a directory, or not writable (checked by a probe file)."""


# ---------------------------------------------------------------------- helpers


def key_digest(key: Any) -> str:
    """Directory name of a key: 32 hex chars of sha256 of its bytes (``normalize_key``)."""
    return hashlib.sha256(normalize_key(key)).hexdigest()[:32]


def unit_path(namespace_dir: str, kd: str, first: int, end: int) -> str:
    """Path of the unit of key digest ``kd`` and layers ``[first, end)``."""
    return f"{namespace_dir}/{kd[:2]}/{kd}/{first}-{end}{UNIT_SUFFIX}"


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name}: expected a number of seconds > 0, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name}: expected a number of seconds > 0, got {value!r}")
    return float(value)


def _proc_start_ticks(pid: int | str) -> int | None:
    """Start time of ``pid`` (clock ticks after boot), or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields_ = data[data.rindex(b")") + 2 :].split()
        if fields_[0] in (b"Z", b"X"):  # a zombie wrote its last byte long ago
            return None
        return int(fields_[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _writer_alive(pidns: int, pid: int, start: int) -> bool | None:
    """Whether the temp file's writer may still run; None when unknowable (other pid ns)."""
    if pidns != _pid_namespace() or _proc_start_ticks("self") is None:
        return None  # another pid namespace, or no /proc: only age can tell
    ticks = _proc_start_ticks(pid)
    return ticks is not None and ticks == start


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_read(path: str) -> int:
    """Open a unit for reading without following a symlink; no atime update when allowed."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags | getattr(os, "O_NOATIME", 0))
    except PermissionError:  # O_NOATIME needs ownership (or CAP_FOWNER)
        return os.open(path, flags)


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The parts of ``views`` left after the first ``n`` bytes."""
    out = []
    for view in views:
        if n >= len(view):
            n -= len(view)
            continue
        out.append(view[n:] if n else view)
        n = 0
    return out


def _take(views: list[memoryview], limit: int) -> list[memoryview]:
    """Leading parts of ``views`` holding at most ``limit`` bytes (at least one byte)."""
    out, size = [], 0
    for view in views:
        if size >= limit:
            break
        part = view[: limit - size]
        out.append(part)
        size += len(part)
    return out


def _write_all(fd: int, parts: Sequence[Any], path: str, *, hook: bool = False) -> int:
    views = [v for v in (as_byte_view(p) for p in parts) if len(v)]
    written = 0
    while views:
        n = os.writev(fd, _take(views, _IO_CHUNK_BYTES))
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress", path)
        written += n
        views = _advance(views, n)
        if hook and _test_hook is not None:
            _test_hook("write", path, written)
    return written


def _read_all(fd: int, parts: Sequence[memoryview], offset: int) -> int:
    """``preadv`` into ``parts`` until full or end of file; bytes read."""
    views = [v for v in parts if len(v)]
    total = 0
    while views:
        n = os.preadv(fd, _take(views, _IO_CHUNK_BYTES), offset + total)
        if n == 0:
            break
        total += n
        views = _advance(views, n)
    return total


def _read_exactly(fd: int, parts: list[memoryview], offset: int, size: int) -> None:
    """``preadv`` ``size`` bytes at ``offset`` into ``parts``; CorruptUnit when the file is short."""
    got = os.preadv(fd, parts, offset)
    if got < size:  # a regular file reads short only at its end (or past 2 GiB)
        got += _read_all(fd, _advance(parts, got), offset + got)
        if got != size:
            raise CorruptUnit("short read")


def _read_verified(
    fd: int,
    namespace: StoreNamespace,
    raw_key: bytes,
    first: int,
    end: int,
    head_len: int,
    body: memoryview,
) -> None:
    """Read a unit (header, then ``body``) and verify it; CorruptUnit unless it is intact.

    The payload is read in chunks of :data:`_LOAD_CHUNK_BYTES`, each hashed
    right after the read, while it is still in this core's cache: one pass
    over memory instead of a copy and then a second full pass to hash.
    The header comes with the first chunk (one syscall) and is checked before
    any payload byte is hashed. ``body``'s bytes are undefined unless this returns.
    """
    step = _LOAD_CHUNK_BYTES
    head = memoryview(bytearray(head_len))
    part = body[:step]
    _read_exactly(fd, [head, part], 0, head_len + len(part))
    hasher, checksum = begin_unit_check(
        head, namespace=namespace, key=raw_key, first=first, end=end
    )
    update, done, size = hasher.update, 0, len(body)
    while True:
        update(part)
        done += len(part)
        if done >= size:
            break
        part = body[done : done + step]
        _read_exactly(fd, [part], head_len + done, len(part))
    if hasher.digest() != checksum:
        raise CorruptUnit("checksum mismatch")


# ---------------------------------------------------------------------- records


@dataclass(frozen=True)
class StoreMetrics(TierMetrics):
    """Counters of one :class:`FileStore` since it started (a snapshot).

    Attributes
    ----------
    (those of :class:`~.tier.TierMetrics`, and:)
    stores_failed : int
        Stores that failed (ENOSPC, EDQUOT, EFBIG, EIO, larger than capacity...).
    corrupt_detected : int
        Units that failed verification (by loads, scans or lookups).
    quarantined : int
        Of those, moved to ``quarantine/`` (the others were removed).
    evicted, bytes_evicted : int
        Units removed for capacity (file bytes).
    temps_removed : int
        Leftover temp files of dead writers removed.
    units_on_disk, bytes_on_disk : int
        Units in this process's index, and their file bytes.
    """

    quarantined: int = 0
    evicted: int = 0
    bytes_evicted: int = 0
    temps_removed: int = 0
    units_on_disk: int = 0
    bytes_on_disk: int = 0


_COUNTERS = tuple(
    f.name for f in fields(StoreMetrics) if f.name not in ("units_on_disk", "bytes_on_disk")
)


@dataclass(frozen=True)
class GcReport:
    """What :meth:`FileStore.gc` did."""

    units_evicted: int
    bytes_evicted: int
    temps_removed: int
    corrupt_found: int
    units_on_disk: int
    bytes_on_disk: int


@dataclass(frozen=True)
class UnitFile:
    """A file found in a namespace directory: a unit by its name, or something unexpected.

    ``first``/``end`` are -1 and ``kd`` may be "" when the name is not a unit's.
    """

    path: str
    kd: str
    first: int
    end: int

    @property
    def well_named(self) -> bool:
        return self.first >= 0


class _Entry:
    """One indexed unit."""

    __slots__ = ("end", "first", "kd", "last_used", "position", "size")

    def __init__(self, kd: str, first: int, end: int, size: int, position: int, last_used: int):
        self.kd, self.first, self.end = kd, first, end
        self.size, self.position, self.last_used = size, position, last_used

    @property
    def ident(self) -> tuple[str, int, int]:
        return (self.kd, self.first, self.end)


# ---------------------------------------------------------------------- offline helpers


def iter_unit_files(namespace_dir: str) -> Iterator[UnitFile]:
    """Every file under a namespace's key directories (not tmp/ nor quarantine/).

    Files whose name is not a unit's are yielded with ``first == -1``: nothing
    but units belongs there.
    """
    try:
        fanouts = sorted(os.scandir(namespace_dir), key=lambda e: e.name)
    except FileNotFoundError:
        return
    for fanout in fanouts:
        if not _FANOUT_DIR.fullmatch(fanout.name) or not fanout.is_dir(follow_symlinks=False):
            continue
        for keydir in sorted(os.scandir(fanout.path), key=lambda e: e.name):
            if not keydir.is_dir(follow_symlinks=False) or not _KEY_DIR.fullmatch(keydir.name):
                yield UnitFile(keydir.path, "", -1, -1)
                continue
            for unit in sorted(os.scandir(keydir.path), key=lambda e: e.name):
                match = _UNIT_NAME.fullmatch(unit.name)
                if match is None or not unit.is_file(follow_symlinks=False):
                    yield UnitFile(unit.path, keydir.name, -1, -1)
                    continue
                first, end = int(match[1]), int(match[2])
                yield UnitFile(unit.path, keydir.name, first, end)


def _check_placement(header: UnitHeader, kd: str, first: int, end: int) -> None:
    if (header.first_layer, header.end_layer) != (first, end):
        raise CorruptUnit(
            f"header layers [{header.first_layer}, {header.end_layer}) do not match the "
            f"file name {first}-{end}"
        )
    if hashlib.sha256(header.key).hexdigest()[:32] != kd:
        raise CorruptUnit("header key does not match its key directory")


def _read_header(fd: int) -> bytes:
    return os.pread(fd, MAX_HEADER_BYTES, 0)


def check_unit_file(
    path: str,
    namespace: StoreNamespace | None,
    *,
    namespace_digest: bytes | None = None,
    kd: str | None = None,
    first: int | None = None,
    end: int | None = None,
) -> UnitHeader:
    """Fully verify one unit file (header, placement, size, checksum); bounded memory.

    Parameters
    ----------
    namespace : StoreNamespace | None
        The namespace of its directory. None when it is unknown (a damaged
        ``namespace.json``): then ``namespace_digest`` must be given and the
        layer sizes cannot be checked, everything else is.
    kd, first, end : optional
        Where the file lies (its key directory and name); checked against the header.

    Raises
    ------
    CorruptUnit
        The file must not be used.
    OSError
        It could not be read.
    """
    fd = _open_read(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptUnit("not a regular file")
        raw = _read_header(fd)
        if namespace is not None:
            header = decode_header(raw, namespace=namespace)
        else:
            header = peek_header(raw)
            if header.namespace_digest != namespace_digest:
                raise CorruptUnit("unit of another namespace")
        if kd is not None and first is not None and end is not None:
            _check_placement(header, kd, first, end)
        if st.st_size != header.total_length:
            what = "truncated" if st.st_size < header.total_length else "extended"
            raise CorruptUnit(f"{what}: {st.st_size} bytes, header says {header.total_length}")
        verifier = PayloadVerifier(header)
        buffer = memoryview(bytearray(min(_VERIFY_CHUNK_BYTES, max(1, header.payload_length))))
        offset = header.header_length
        while offset < st.st_size:
            n = os.preadv(fd, [buffer[: st.st_size - offset]], offset)
            if n == 0:
                raise CorruptUnit("file shrank while read")
            verifier.update(buffer[:n])
            offset += n
        verifier.finish()
        return header
    finally:
        os.close(fd)


def clean_stale_temps(namespace_dir: str, stale_tmp_s: float = 3600.0) -> int:
    """Remove temp files of dead writers, or older than ``stale_tmp_s``; count removed.

    A writer is dead when its pid does not exist or started at another time
    (pid reuse). Writers in another pid namespace cannot be checked: only age
    removes theirs.
    """
    tmp_dir = os.path.join(namespace_dir, TMP_DIR)
    removed = 0
    now = time.time()
    try:
        entries = list(os.scandir(tmp_dir))
    except FileNotFoundError:
        return 0
    for entry in entries:
        match = _TMP_NAME.fullmatch(entry.name)
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        alive = _writer_alive(int(match[1]), int(match[2]), int(match[3])) if match else False
        if alive is False or age > stale_tmp_s:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed


def _plan_eviction(
    candidates: Iterator[_Entry], need_bytes: int, granularity_ns: int
) -> list[_Entry]:
    """Victims freeing ``need_bytes``: oldest recency bucket first, tails before heads in it.

    ``candidates`` are in least-recently-used-first order; only as many
    buckets as needed are read.
    """
    chosen: list[_Entry] = []
    bucket_entries: list[_Entry] = []
    current = None
    freed = 0

    def flush() -> bool:
        nonlocal freed
        # Within one bucket: highest prefix position first, older first on ties.
        for entry in sorted(bucket_entries, key=lambda e: (-e.position, e.last_used)):
            if freed >= need_bytes:
                return True
            chosen.append(entry)
            freed += entry.size
        bucket_entries.clear()
        return freed >= need_bytes

    for entry in candidates:
        bucket = entry.last_used // granularity_ns
        if current is not None and bucket != current and flush():
            return chosen
        current = bucket
        bucket_entries.append(entry)
    flush()
    return chosen


def gc_directories(
    namespace_dirs: Sequence[str],
    capacity_bytes: int,
    *,
    recency_granularity_s: float = 1.0,
    stale_tmp_s: float = 3600.0,
) -> GcReport:
    """Offline gc of namespace directories together (what ``store gc`` runs).

    Removes dead writers' temp files, then evicts units of all the given
    namespaces together, least recently used first and tails first among
    equally recent ones, until their files take at most ``capacity_bytes``.
    Safe while stores run: a unit evicted under a reader is a miss for it.
    """
    capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=0)
    granularity_ns = max(
        1, int(_check_seconds("recency_granularity_s", recency_granularity_s) * _NS_PER_S)
    )
    temps = sum(clean_stale_temps(d, stale_tmp_s) for d in namespace_dirs)
    entries: list[tuple[str, _Entry]] = []
    for directory in namespace_dirs:
        for unit in iter_unit_files(directory):
            if not unit.well_named:
                continue
            try:
                fd = _open_read(unit.path)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                try:
                    position = peek_header(_read_header(fd)).position
                except CorruptUnit:
                    position = 0  # `store verify` reports it; gc only needs an order
            finally:
                os.close(fd)
            last_used = max(st.st_atime_ns, st.st_mtime_ns)
            entry = _Entry(unit.kd, unit.first, unit.end, st.st_size, position, last_used)
            entries.append((directory, entry))
    total = sum(e.size for _, e in entries)
    entries.sort(key=lambda item: item[1].last_used)
    where = {id(e): d for d, e in entries}
    victims = []
    if total > capacity_bytes:
        victims = _plan_eviction(
            iter(e for _, e in entries), total - capacity_bytes, granularity_ns
        )
    freed = 0
    for victim in victims:
        path = unit_path(where[id(victim)], victim.kd, victim.first, victim.end)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            freed += victim.size
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))
    return GcReport(
        units_evicted=len(victims),
        bytes_evicted=freed,
        temps_removed=temps,
        corrupt_found=0,
        units_on_disk=len(entries) - len(victims),
        bytes_on_disk=total - freed,
    )


# ---------------------------------------------------------------------- the store


class FileStore(TierBase):
    """Canonical units in files under ``root``, for one :class:`StoreNamespace`.

    Parameters
    ----------
    root : str | os.PathLike
        An existing, writable directory (proven by creating and removing a
        probe file). Units go to ``root/<namespace.hex>/``.
    namespace : StoreNamespace
    capacity_bytes : int | None
        Bytes of unit files this store keeps (its view); None = unbounded.
    threads : int | None
        Worker threads of the store's own job pool (default 4).
    queue_depth : int | None
        Jobs that may wait for a thread (default 64); more are refused.
    fsync : bool
        Sync data and directories before a unit counts as stored (crash and
        power-loss safe). False: crash safe (SIGKILL), not power-loss safe.
    pool : JobPool | None
        A pool shared with other tiers (then ``threads``/``queue_depth`` must
        be None, and :meth:`poll` returns every tier's jobs). The store does
        not close a shared pool.
    recency_granularity_s : float
        Units used within this many seconds of each other count as equally
        recent for eviction (tails first among them).
    stale_tmp_s : float
        Temp files older than this are removed even if their writer cannot be
        proven dead.
    quarantine_limit : int
        Files kept in ``quarantine/``; beyond, bad units are removed.

    Raises
    ------
    StoreRootError
        ``root`` is missing, not a directory, or not writable.
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
        recency_granularity_s: float = 1.0,
        stale_tmp_s: float = 3600.0,
        quarantine_limit: int = 64,
    ) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise TypeError(f"root: expected a path (str or os.PathLike), got {root!r}")
        if not isinstance(namespace, StoreNamespace):
            raise TypeError(f"namespace: expected a StoreNamespace, got {type(namespace).__name__}")
        if capacity_bytes is not None:
            capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=0)
        if not isinstance(fsync, (bool, np.bool_)):
            raise TypeError(f"fsync: expected a bool, got {fsync!r}")
        self.capacity_bytes = capacity_bytes
        self.fsync = bool(fsync)
        granularity = _check_seconds("recency_granularity_s", recency_granularity_s)
        self._granularity_ns = max(1, int(granularity * _NS_PER_S))
        self.stale_tmp_s = _check_seconds("stale_tmp_s", stale_tmp_s)
        self.quarantine_limit = check_int("quarantine_limit", quarantine_limit, minimum=0)
        threads, queue_depth = self._pool_args(pool, threads, queue_depth)
        self.namespace = namespace
        self.root = os.path.abspath(os.fspath(root))
        self.directory = os.path.join(self.root, namespace.hex)
        self._tmp_dir = os.path.join(self.directory, TMP_DIR)
        self._quarantine_dir = os.path.join(self.directory, QUARANTINE_DIR)
        self._init_base()
        self._lru: OrderedDict[tuple[str, int, int], _Entry] = OrderedDict()
        self._by_key: dict[str, dict[tuple[int, int], _Entry]] = {}
        self._bytes = 0
        self._reserved = 0
        self._counts = dict.fromkeys(_COUNTERS, 0)
        pidns, pid = _pid_namespace(), os.getpid()
        self._tmp_prefix = f"{pidns}-{pid}-{_proc_start_ticks(pid) or 0}-"
        self._check_root()
        self._prepare_directory()
        self._rescan()
        # The pool last: a failed start-up leaves no threads behind.
        self._attach_pool(pool, threads, queue_depth, "ckv-files")

    # ------------------------------------------------------------------ start-up

    def _check_root(self) -> None:
        root = self.root
        if not os.path.isdir(root):
            why = "does not exist" if not os.path.lexists(root) else "is not a directory"
            raise StoreRootError(
                errno.ENOENT, f"root: expected an existing writable directory; {root!r} {why}"
            )
        probe = os.path.join(root, f".ckv-probe-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as error:
            raise StoreRootError(
                error.errno,
                f"root: expected a writable directory; creating a file in {root!r} failed: "
                f"{error.strerror}",
            ) from None

    def _prepare_directory(self) -> None:
        try:
            for path in (self.directory, self._tmp_dir, self._quarantine_dir):
                os.makedirs(path, exist_ok=True)
            self._write_namespace_file()
        except OSError as error:
            raise StoreRootError(
                error.errno,
                f"root: cannot prepare {self.directory!r} in {self.root!r}: {error.strerror}",
            ) from None

    def _write_namespace_file(self) -> None:
        """``namespace.json``, atomically (temp + rename), unless already identical."""
        text = (json.dumps(self.namespace.describe(), indent=1, sort_keys=True) + "\n").encode()
        path = os.path.join(self.directory, NAMESPACE_FILE)
        try:
            with open(path, "rb") as f:
                if f.read(len(text) + 1) == text:
                    return
        except FileNotFoundError:
            pass
        tmp = os.path.join(self._tmp_dir, f"{self._tmp_prefix}{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                _write_all(fd, [text], tmp)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(self.directory)

    def _rescan(self) -> int:
        """Rebuild the index from disk (headers only) and clean leftovers; corrupt found."""
        removed = clean_stale_temps(self.directory, self.stale_tmp_s)
        corrupt_before = self.metrics().corrupt_detected
        scan_start = time.time_ns()
        found: list[_Entry] = []
        for unit in iter_unit_files(self.directory):
            if not unit.well_named:
                continue  # not ours to judge at start-up; `store verify` reports it
            entry = self._index_file(unit.path, unit.kd, unit.first, unit.end)
            if entry is not None:
                found.append(entry)
        found.sort(key=lambda e: e.last_used)
        with self._lock:
            # Units this process stored while the scan ran may have been missed by it.
            seen = {entry.ident for entry in found}
            found += [
                e for e in self._lru.values() if e.last_used >= scan_start and e.ident not in seen
            ]
            self._lru.clear()
            self._by_key.clear()
            self._bytes = 0
            for entry in found:
                self._add_locked(entry)
            self._counts["temps_removed"] += removed
            return self._counts["corrupt_detected"] - corrupt_before

    def _index_file(self, path: str, kd: str, first: int, end: int) -> _Entry | None:
        """An entry for a unit file from its header; None when gone or bad (quarantined)."""
        try:
            fd = _open_read(path)
        except OSError:  # gone (evicted meanwhile), or a symlink planted there
            return None
        try:
            st = os.fstat(fd)
            try:
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptUnit("not a regular file")
                header = decode_header(_read_header(fd), namespace=self.namespace)
                _check_placement(header, kd, first, end)
                if st.st_size != header.total_length:
                    raise CorruptUnit(
                        f"size {st.st_size} != {header.total_length} bytes of its header"
                    )
            except CorruptUnit as error:
                self._quarantine(path, st, error.reason)
                return None
        finally:
            os.close(fd)
        return _Entry(
            kd, first, end, st.st_size, header.position, max(st.st_atime_ns, st.st_mtime_ns)
        )

    # ------------------------------------------------------------------ index

    def _add_locked(self, entry: _Entry) -> None:
        old = self._lru.pop(entry.ident, None)
        if old is not None:
            self._bytes -= old.size
        self._lru[entry.ident] = entry
        self._by_key.setdefault(entry.kd, {})[(entry.first, entry.end)] = entry
        self._bytes += entry.size

    def _drop_locked(self, ident: tuple[str, int, int]) -> _Entry | None:
        entry = self._lru.pop(ident, None)
        if entry is None:
            return None
        self._bytes -= entry.size
        ranges = self._by_key.get(entry.kd)
        if ranges is not None:
            ranges.pop((entry.first, entry.end), None)
            if not ranges:
                del self._by_key[entry.kd]
        return entry

    def _cover_locked(
        self, kd: str, first: int, end: int, excluded: set[tuple[str, int, int]] = frozenset()
    ) -> list[_Entry] | None:
        """Units covering layers [first, end) of ``kd``: an exact unit if any, else greedy."""
        ranges = self._by_key.get(kd)
        if not ranges:
            return None
        exact = ranges.get((first, end))
        if exact is not None and exact.ident not in excluded:
            return [exact]
        chain, position = [], first
        while position < end:
            best = None
            for entry in ranges.values():
                usable = entry.first <= position < entry.end and entry.ident not in excluded
                if usable and (best is None or entry.end > best.end):
                    best = entry
            if best is None:
                return None
            chain.append(best)
            position = best.end
        return chain

    def _refresh_key(self, kd: str) -> None:
        """Index the units of ``kd`` that other processes wrote (one directory listing)."""
        key_dir = os.path.join(self.directory, kd[:2], kd)
        try:
            names = os.listdir(key_dir)
        except (FileNotFoundError, NotADirectoryError):
            return
        with self._lock:
            known = set(self._by_key.get(kd, {}))
        for name in names:
            match = _UNIT_NAME.fullmatch(name)
            if match is None:
                continue
            first, end = int(match[1]), int(match[2])
            if (first, end) in known:
                continue
            entry = self._index_file(os.path.join(key_dir, name), kd, first, end)
            if entry is not None:
                with self._lock:
                    self._add_locked(entry)

    # ------------------------------------------------------------------ lookup

    def lookup(self, keys: Sequence[Any], first: int, end: int) -> int:
        """Length of the prefix of ``keys`` whose layers ``[first, end)`` are on disk
        (:meth:`.PageTier.lookup`).

        The prefix found is touched, its tail first, so its head is the most
        recent. A key not in the index is looked for on disk (units of other
        processes).
        """
        first, end = self._range(first, end)
        digests = [hashlib.sha256(k).hexdigest()[:32] for k in self._keys(keys)]
        found = 0
        for kd in digests:
            with self._lock:
                covered = self._cover_locked(kd, first, end) is not None
            if not covered:
                self._refresh_key(kd)
                with self._lock:
                    covered = self._cover_locked(kd, first, end) is not None
            if not covered:
                break
            found += 1
        now = time.time_ns()
        with self._lock:
            for kd in reversed(digests[:found]):
                for entry in self._cover_locked(kd, first, end) or ():
                    entry.last_used = now
                    self._lru.move_to_end(entry.ident)
            self._counts["lookup_blocks"] += len(digests)
            self._counts["lookup_hit_blocks"] += found
        return found

    # ------------------------------------------------------------------ store

    def _store_job(self, key: Any, first: Any, payload: Any, position: Any, end: Any) -> IOJob:
        self._check_open()
        raw_key, first, end, position, view = self._store_args(key, first, payload, position, end)
        info = {"key": raw_key, "first": first, "end": end, "position": position}
        return self.pool.make_job(
            "store", lambda: self._store_unit(raw_key, first, end, position, view), info
        )

    def submit_store(
        self, key: Any, first: int, payload: Any, position: int, *, end: int | None = None
    ) -> IOJob:
        """Queue the store of one unit; never blocks (:meth:`.PageTier.submit_store`).

        Returns
        -------
        IOJob
            ``"ok"`` once published (or already present, see ``detail``),
            ``"error"`` when the write failed (nothing published), or
            ``"refused"`` at once when the queue is full.
        """
        job = self.pool.submit_job(self._store_job(key, first, payload, position, end))
        if job.refused:
            self._count("stores_refused")
        return job

    def store(
        self, key: Any, first: int, payload: Any, position: int, *, end: int | None = None
    ) -> IOJob:
        """:meth:`submit_store`, run in the calling thread; returns the finished job."""
        return run_inline(self._store_job(key, first, payload, position, end))

    def _store_unit(
        self, raw_key: bytes, first: int, end: int, position: int, payload: memoryview
    ) -> JobOutcome:
        kd = hashlib.sha256(raw_key).hexdigest()[:32]
        final = unit_path(self.directory, kd, first, end)
        ident = (kd, first, end)
        if os.path.lexists(final):
            entry = self._index_file(final, kd, first, end)
            if entry is not None:
                with self._lock:
                    if ident not in self._lru:
                        self._add_locked(entry)
                self._count("stores_skipped")
                return JobOutcome("ok", detail="already stored")
        else:
            with self._lock:
                self._drop_locked(ident)  # evicted by another process
        size = header_length(raw_key) + len(payload)
        try:
            self._reserve(size)
        except OSError as error:
            self._count("stores_failed")
            return JobOutcome("error", detail=str(error), error=error)
        try:
            header = encode_header(self.namespace, raw_key, first, end, position, payload)
            won = self._publish(kd, final, header, payload)
        except OSError as error:
            self._count("stores_failed")
            full = " (disk full)" if error.errno in _DISK_FULL else ""
            return JobOutcome("error", detail=f"store failed{full}: {error}", error=error)
        finally:
            with self._lock:
                self._reserved -= size
        if not won:
            self._count("stores_skipped")
            self._refresh_key(kd)
            return JobOutcome("ok", detail="another writer stored it first")
        now = time.time_ns()
        with self._lock:
            self._add_locked(_Entry(kd, first, end, size, position, now))
            self._counts["units_stored"] += 1
            self._counts["bytes_stored"] += len(payload)
        return JobOutcome("ok", nbytes=len(payload))

    def _reserve(self, size: int) -> None:
        """Count ``size`` bytes as being written, evicting first when over capacity."""
        victims: list[_Entry] = []
        with self._lock:
            capacity = self.capacity_bytes
            if capacity is not None:
                if size > capacity:
                    raise OSError(
                        errno.EFBIG, f"unit of {size} bytes exceeds capacity_bytes={capacity}"
                    )
                over = self._bytes + self._reserved + size - capacity
                if over > 0:
                    victims = _plan_eviction(iter(self._lru.values()), over, self._granularity_ns)
                    for victim in victims:
                        self._drop_locked(victim.ident)
            self._reserved += size
        self._remove_units(victims)

    def _remove_units(self, victims: Sequence[_Entry]) -> None:
        for victim in victims:
            path = unit_path(self.directory, victim.kd, victim.first, victim.end)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            with contextlib.suppress(OSError):  # not empty, or gone: both fine
                os.rmdir(os.path.dirname(path))
            with self._lock:
                self._counts["evicted"] += 1
                self._counts["bytes_evicted"] += victim.size

    def _make_dirs(self, kd: str) -> list[str]:
        """Create the key directory; the parents whose entries changed (to sync)."""
        fanout = os.path.join(self.directory, kd[:2])
        key_dir = os.path.join(fanout, kd)
        changed = []
        for path, parent in ((fanout, self.directory), (key_dir, fanout)):
            try:
                os.mkdir(path, 0o755)
                changed.append(parent)
            except FileExistsError:
                pass
        return changed

    def _publish(self, kd: str, final: str, header: bytes, payload: memoryview) -> bool:
        """Write a temp file, sync it, link it to ``final``; False when another writer won."""
        tmp = os.path.join(self._tmp_dir, f"{self._tmp_prefix}{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                _write_all(fd, [header, payload], tmp, hook=True)
                if self.fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            if _test_hook is not None:
                _test_hook("publish", tmp, len(header) + len(payload))
            changed: list[str] = []
            for _attempt in range(3):
                changed += self._make_dirs(kd)
                try:
                    os.link(tmp, final)
                    break
                except FileExistsError:
                    return False
                except FileNotFoundError:
                    continue  # the key directory was just removed by an eviction: again
            else:
                raise OSError(errno.ENOENT, "key directory keeps vanishing", final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if self.fsync:
            for path in [os.path.dirname(final), *reversed(changed)]:
                _fsync_dir(path)
        return True

    # ------------------------------------------------------------------ load

    def _load_job(self, key: Any, first: Any, end: Any, destination: Any) -> IOJob:
        self._check_open()
        raw_key, first, end, view = self._load_args(key, first, end, destination)
        info = {"key": raw_key, "first": first, "end": end}
        return self.pool.make_job("load", lambda: self._load_unit(raw_key, first, end, view), info)

    def submit_load(self, key: Any, first: int, end: int, destination: Any) -> IOJob:
        """Queue the load of layers ``[first, end)`` of ``key`` into ``destination``
        (:meth:`.PageTier.submit_load`).

        Returns
        -------
        IOJob
            ``"ok"``, ``"miss"`` (absent or corrupt: see ``detail``),
            ``"error"`` (I/O error) or, at once, ``"refused"``.
        """
        job = self.pool.submit_job(self._load_job(key, first, end, destination))
        if job.refused:
            self._count("loads_refused")
        return job

    def load(self, key: Any, first: int, end: int, destination: Any) -> IOJob:
        """:meth:`submit_load`, run in the calling thread; returns the finished job."""
        return run_inline(self._load_job(key, first, end, destination))

    def _load_unit(self, raw_key: bytes, first: int, end: int, dest: memoryview) -> JobOutcome:
        kd = hashlib.sha256(raw_key).hexdigest()[:32]
        offsets: tuple[int, ...] | None = None  # only for units of another split
        excluded: set[tuple[str, int, int]] = set()
        refreshed = False
        problems: list[str] = []
        while True:
            with self._lock:
                chain = self._cover_locked(kd, first, end, excluded)
            if chain is None and not refreshed:
                refreshed = True
                self._refresh_key(kd)
                continue
            if chain is None:
                self._count("misses")
                detail = "; ".join(problems) or "not stored"
                return JobOutcome("miss", detail=detail)
            try:
                if offsets is None and [(e.first, e.end) for e in chain] != [(first, end)]:
                    offsets = self.namespace.payload_offsets(first, end)
                for entry in chain:
                    self._read_into(raw_key, entry, first, end, dest, offsets)
            except _UnitGone as gone:
                with self._lock:
                    self._drop_locked(gone.entry.ident)
                excluded.add(gone.entry.ident)
                problems.append(f"{gone.entry.first}-{gone.entry.end} vanished")
                continue
            except _UnitBad as bad:
                with self._lock:
                    self._drop_locked(bad.entry.ident)
                excluded.add(bad.entry.ident)
                problems.append(f"{bad.entry.first}-{bad.entry.end} corrupt: {bad.reason}")
                continue
            except OSError as error:
                self._count("misses")
                return JobOutcome("error", detail=f"read failed: {error}", error=error)
            with self._lock:
                self._counts["hits"] += 1
                self._counts["units_loaded"] += len(chain)
                self._counts["bytes_loaded"] += len(dest)
            return JobOutcome("ok", nbytes=len(dest), detail="; ".join(problems))

    def _read_into(
        self,
        raw_key: bytes,
        entry: _Entry,
        first: int,
        end: int,
        dest: memoryview,
        offsets: tuple[int, ...] | None,
    ) -> None:
        """Read, verify and place the part of ``entry`` inside [first, end) into ``dest``.

        ``offsets`` (:meth:`StoreNamespace.payload_offsets` of [first, end)) may be
        None when ``entry`` is exactly [first, end): the common case, which costs no
        O(layers) work.
        """
        path = unit_path(self.directory, entry.kd, entry.first, entry.end)
        try:
            fd = _open_read(path)
        except FileNotFoundError:
            raise _UnitGone(entry) from None
        try:
            st = os.fstat(fd)
            head_len = FIXED_HEADER_BYTES + ((len(raw_key) + 7) & ~7)  # header_length(raw_key)
            payload_len = self.namespace.layer_bytes(entry.first, entry.end)
            try:
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptUnit("not a regular file")
                # The size is checked before any byte is read: truncated or extended files
                # never reach the destination, and no length read from disk sizes a buffer.
                if st.st_size != head_len + payload_len:
                    raise CorruptUnit(
                        f"size {st.st_size} != {head_len + payload_len} bytes expected"
                    )
                lo, hi = max(first, entry.first), min(end, entry.end)
                # offsets is None only when the unit is exactly the range
                target = (
                    dest if offsets is None else dest[offsets[lo - first] : offsets[hi - first]]
                )
                whole = (lo, hi) == (entry.first, entry.end)
                # A unit inside the range is read straight into the destination;
                # one that sticks out goes through a scratch buffer.
                body = target if whole else memoryview(bytearray(payload_len))
                _read_verified(fd, self.namespace, raw_key, entry.first, entry.end, head_len, body)
            except CorruptUnit as error:
                self._quarantine(path, st, error.reason)
                raise _UnitBad(entry, error.reason) from None
            if not whole:
                start = self.namespace.payload_offsets(entry.first, entry.end)[lo - entry.first]
                target[:] = body[start : start + len(target)]
            now = time.time_ns()
            # Recency for other processes and restarts, quantised like the eviction order:
            # a unit already stamped within the granularity keeps its stamp (no inode write
            # per load of a hot unit).
            if now - max(st.st_atime_ns, st.st_mtime_ns) >= self._granularity_ns:
                with contextlib.suppress(OSError):
                    os.utime(fd, ns=(now, st.st_mtime_ns))
            with self._lock:
                entry.last_used = now
                if entry.ident in self._lru:
                    self._lru.move_to_end(entry.ident)
        finally:
            os.close(fd)

    def _quarantine(self, path: str, st: os.stat_result, reason: str) -> None:
        """Move a bad unit out of the way (or remove it), only if ``path`` still names it."""
        with self._lock:
            self._counts["corrupt_detected"] += 1
        name = f"{time.time_ns()}-{secrets.token_hex(4)}-{os.path.basename(path)}"
        kd = os.path.basename(os.path.dirname(path))
        target = os.path.join(self._quarantine_dir, f"{kd}-{name}")
        try:
            keep = len(os.listdir(self._quarantine_dir)) < self.quarantine_limit
        except OSError:
            keep = False
        try:
            os.rename(path, target)
        except OSError:
            return  # already moved or removed by someone else
        moved = os.lstat(target)
        if (moved.st_dev, moved.st_ino) != (st.st_dev, st.st_ino):
            # A good unit was published under this name since we read the bad one: put it back.
            with contextlib.suppress(FileExistsError):
                os.link(target, path)
            os.unlink(target)
            return
        if not keep:
            os.unlink(target)  # the quarantine is full: keep the first few for post-mortems
            return
        with self._lock:
            self._counts["quarantined"] += 1

    # ------------------------------------------------------------------ upkeep

    def gc(self, capacity_bytes: int | None = None) -> GcReport:
        """Rescan the disk, remove dead writers' temp files, evict down to a capacity.

        Parameters
        ----------
        capacity_bytes : int | None
            Target bytes of unit files; default: the store's ``capacity_bytes``
            (None: only the rescan and clean-up).
        """
        if capacity_bytes is not None:
            capacity_bytes = check_int("capacity_bytes", capacity_bytes, minimum=0)
        else:
            capacity_bytes = self.capacity_bytes
        before = self.metrics()
        corrupt = self._rescan()
        victims: list[_Entry] = []
        with self._lock:
            if capacity_bytes is not None and self._bytes > capacity_bytes:
                victims = _plan_eviction(
                    iter(self._lru.values()), self._bytes - capacity_bytes, self._granularity_ns
                )
                for victim in victims:
                    self._drop_locked(victim.ident)
        self._remove_units(victims)
        after = self.metrics()
        return GcReport(
            units_evicted=len(victims),
            bytes_evicted=sum(v.size for v in victims),
            temps_removed=after.temps_removed - before.temps_removed,
            corrupt_found=corrupt,
            units_on_disk=after.units_on_disk,
            bytes_on_disk=after.bytes_on_disk,
        )

    def metrics(self) -> StoreMetrics:
        """A consistent snapshot of the counters."""
        with self._lock:
            return StoreMetrics(
                **self._counts | {"units_on_disk": len(self._lru), "bytes_on_disk": self._bytes}
            )

    def close(self, *, cancel: bool = False) -> None:
        """Finish (or cancel) queued jobs of an owned pool; no new jobs afterwards."""
        self._closed = True
        if self._own_pool:
            self.pool.close(cancel=cancel)

    def __enter__(self) -> FileStore:
        return self

    def __repr__(self) -> str:
        return (
            f"FileStore({self.directory!r}, units={len(self._lru)}, bytes={self._bytes}, "
            f"capacity_bytes={self.capacity_bytes})"
        )


class _UnitGone(Exception):
    def __init__(self, entry: _Entry) -> None:
        self.entry = entry


class _UnitBad(Exception):
    def __init__(self, entry: _Entry, reason: str) -> None:
        self.entry = entry
        self.reason = reason
