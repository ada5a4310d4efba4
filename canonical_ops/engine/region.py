"""One /dev/shm region of canonical rows, shared by every rank (process) of a node: rank 0
creates ``<shm_dir>/canonical-kv-<engine id>``, the others attach; the rank completing the
count of attached ranks unlinks it, and so does rank 0's close (protocol: docs/design.md).
Layout: a 4096-byte header, then row ``r`` at ``4096 + r * row_bytes``. The header also
records the workers' claims on the rows (:meth:`SharedOffloadRegion.claim_rows`; the record:
``claims``): opaque pages are readable only by the topology that stored them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..checks import check_int, check_seconds
from ..units.liveness import ProcessId, process_alive, this_process
from .claims import (
    RECORD_BYTES,
    TABLES_BYTES,
    RegionTopologyError,
    RowArea,
    RowClaims,
    Topology,
    unit_row_claim,
)

__all__ = ["RegionSpaceError", "RegionTopologyError", "RowArea", "SharedOffloadRegion"]
__all__ += ["region_path", "unit_row_claim"]

HEADER_BYTES = 4096
MAGIC = b"CKVSHMR\x00"
FORMAT_VERSION = 4  # 3: the row claims; 4: their canonical table (a version-3 rank lacks it)
STATE_INIT, STATE_READY = 0, 1
FILE_PREFIX = "canonical-kv-"
PIN_CHUNK_BYTES = 1 << 30
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)

# magic, version, state, num_rows, row_bytes, world_size, creator (pid namespace, pid,
# start ticks), engine id digest; after it the claims' record (engine/claims.py); from
# _RANKS_OFFSET one byte per rank (1: attached); the claims' range tables end the header.
_HEADER = struct.Struct("<8sIIQQI4xQqQ16s")
_RANKS_OFFSET = 128
_OPAQUE_OFFSET = HEADER_BYTES - TABLES_BYTES  # the range tables, the opaque one first
MAX_WORLD_SIZE = _OPAQUE_OFFSET - _RANKS_OFFSET
assert _HEADER.size + RECORD_BYTES <= _RANKS_OFFSET
_NAME_OK = re.compile(r"[^A-Za-z0-9._-]")
_UNLINK_WAIT_S = 5.0


class RegionSpaceError(OSError):
    """The shared-memory file system has too little free space for the region."""


def region_path(engine_id: str, shm_dir: str = "/dev/shm") -> str:
    """``<shm_dir>/canonical-kv-<engine_id>``; characters outside ``[A-Za-z0-9._-]`` become
    ``_``, and a digest of the id is appended when that (or length) changed it, so distinct
    ids never share a file."""
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError(f"engine_id: expected a non-empty str, got {engine_id!r}")
    name = _NAME_OK.sub("_", engine_id)
    if name != engine_id or len(name) > 200:
        digest = hashlib.sha256(engine_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        name = f"{name[:200]}-{digest}"
    return os.path.join(shm_dir, FILE_PREFIX + name)


@dataclass
class _Header:
    num_rows: int
    row_bytes: int
    world_size: int
    creator: ProcessId
    digest: bytes
    ranks: bytearray
    state: int = STATE_INIT
    version: int = FORMAT_VERSION
    claims: RowClaims = field(default_factory=RowClaims)

    @classmethod
    def read(cls, fd: int) -> _Header | None:
        """The file's header; None when it is short or lacks the magic."""
        raw = os.pread(fd, HEADER_BYTES, 0)
        if len(raw) < HEADER_BYTES or raw[: len(MAGIC)] != MAGIC:
            return None
        _, version, state, rows, row_bytes, world, ns, pid, start, digest = _HEADER.unpack_from(raw)
        ranks = bytearray(raw[_RANKS_OFFSET : _RANKS_OFFSET + min(world, MAX_WORLD_SIZE)])
        claims = RowClaims.parse(raw[_HEADER.size : _RANKS_OFFSET], raw[_OPAQUE_OFFSET:], row_bytes)
        return cls(rows, row_bytes, world, (ns, pid, start), digest, ranks, state, version, claims)

    def write(self, fd: int) -> None:
        fields = (self.version, self.state, self.num_rows, self.row_bytes, self.world_size)
        raw = bytearray(HEADER_BYTES)
        _HEADER.pack_into(raw, 0, MAGIC, *fields, *self.creator, self.digest)
        raw[_RANKS_OFFSET : _RANKS_OFFSET + len(self.ranks)] = self.ranks
        view = memoryview(raw)
        self.claims.pack_into(view[_HEADER.size : _RANKS_OFFSET], view[_OPAQUE_OFFSET:])
        if os.pwrite(fd, raw, 0) != HEADER_BYTES:
            raise OSError(errno.EIO, "short write of the region header")


def _open_shm_dir(path: str) -> int:
    """``shm_dir`` as a descriptor: a directory of this user or root, writable by others only
    with the sticky bit (else another user could swap the region file under us)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid not in (0, os.geteuid()) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        os.close(fd)
        raise PermissionError(
            errno.EPERM,
            f"shm_dir: expected a directory of this user or root, writable by others only with "
            f"the sticky bit (as /dev/shm); got uid {st.st_uid}, mode {stat.filemode(st.st_mode)}",
            path,
        )
    return fd


class SharedOffloadRegion:
    """A ``(num_rows, row_bytes)`` uint8 CPU region shared by the ranks of a node. Every rank
    passes the same ``engine_id`` and geometry; rank 0 must hold the region until every rank
    attached, the others wait for it up to ``attach_timeout_s`` (rank 0's prefault and pin
    time). ``pin``: ``cudaHostRegister`` it (None: with CUDA; set the device first).
    ``free_bytes``: free space of ``shm_dir`` to assume (tests). Errors: RegionSpaceError,
    TimeoutError, FileExistsError (rank 0: the id is in use by a live process),
    PermissionError (a symlink, FIFO, not this user's private regular file, or an unsafe
    ``shm_dir``), ValueError (arguments, geometry, format)."""

    #: Seconds between polls while waiting for rank 0 or a lock.
    poll_interval_s: float = 0.01

    def __init__(
        self,
        engine_id: str,
        num_rows: int,
        row_bytes: int,
        *,
        world_size: int,
        rank: int,
        shm_dir: str = "/dev/shm",
        pin: bool | None = None,
        attach_timeout_s: float = 60.0,
        free_bytes: int | None = None,
    ) -> None:
        self.closed, self._unlinked = True, False  # closed until set up: __del__ stays harmless
        self._fd = self._dir = -1
        self._mmap = self._tensor = self._stat = None  # mmap, its tensor, the file's stat
        self._pinned: list[int] = []
        self._claim_lock = threading.Lock()
        self.path = region_path(engine_id, shm_dir)
        self.engine_id, self.shm_dir, self._name = engine_id, shm_dir, os.path.basename(self.path)
        self.num_rows = check_int("num_rows", num_rows, minimum=1)
        self.row_bytes = check_int("row_bytes", row_bytes, minimum=1)
        self.world_size = check_int("world_size", world_size, minimum=1, maximum=MAX_WORLD_SIZE)
        self.rank = check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        self._timeout = check_seconds("attach_timeout_s", attach_timeout_s, zero=True)
        if free_bytes is not None:
            free_bytes = check_int("free_bytes", free_bytes, minimum=0)
        if pin and not torch.cuda.is_available():
            raise RuntimeError(
                "SharedOffloadRegion(pin=True): CUDA is not available, cannot "
                "cudaHostRegister the region (pass pin=False or pin=None)"
            )
        self._pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._free_bytes = free_bytes
        self.data_bytes = self.num_rows * self.row_bytes
        self.size_bytes = HEADER_BYTES + self.data_bytes
        self.is_creator = self.rank == 0
        self._digest = hashlib.sha256(engine_id.encode("utf-8", "surrogatepass")).digest()[:16]
        self._dir = _open_shm_dir(shm_dir)
        try:
            deadline = time.monotonic() + self._timeout
            self._create(deadline) if self.is_creator else self._attach(deadline)
        except BaseException:
            self._teardown()
            raise
        self.closed = False

    @property
    def tensor(self) -> torch.Tensor:
        """``torch.uint8`` tensor ``(num_rows, row_bytes)`` over the shared data area."""
        if self.closed or self._tensor is None:
            raise ValueError(f"SharedOffloadRegion({self.path}) is closed")
        return self._tensor

    @property
    def pinned(self) -> bool:
        """Whether this rank page-locked the data area with CUDA."""
        return bool(self._pinned)

    def claim_rows(self, topology: Topology | None, areas: Sequence[RowArea]) -> None:
        """Record that a worker at ``topology`` (tp, dcp, pcp, interleave; None: a mover of
        certified pages only, e.g. a StageCache of a namespace without opaque layers) moves
        ``areas`` of every row, or raise :class:`RegionTopologyError` (naming the area, its
        fallback reason and both topologies; nothing recorded) when opaque pages are in areas
        it takes as canonical pages (another topology's, or its own topology's laid out
        otherwise), or its opaque pages would land where another worker reads canonical
        pages or another topology owns the rows. The first claimant with a topology owns the
        rows' opaque pages; a worker of another topology may only move canonical pages,
        outside them. Atomic across the ranks (the file's lock) and this process's threads;
        :class:`OffloadWorker`, ``StateWorker`` and ``StageCache`` call it when built on a
        region."""
        if self.closed:
            raise ValueError(f"SharedOffloadRegion({self.path}) is closed")
        if topology is not None and not (isinstance(topology, tuple) and len(topology) == 4):
            raise ValueError(
                f"topology: expected (tp, dcp, pcp, interleave) or None, got {topology!r}"
            )
        for i, value in enumerate(topology or ()):
            check_int(f"topology[{i}]", value, minimum=1)
        areas = list(areas)
        for i, area in enumerate(areas):
            if not isinstance(area, RowArea):
                raise TypeError(f"areas[{i}]: expected a RowArea, got {type(area).__name__}")
            check_int(f"areas[{i}].start", area.start, minimum=0, maximum=self.row_bytes)
            check_int(f"areas[{i}].end", area.end, minimum=area.start, maximum=self.row_bytes)
            if topology is None and area.opaque:
                raise ValueError(
                    f"areas[{i}]: expected a canonical area (opaque=None) without a topology, "
                    f"got opaque {area.name!r} (opaque pages are readable at one topology only)"
                )
        areas = [area for area in areas if area.end > area.start]  # an empty one moves nothing
        # flock excludes other open files of the region, not this file's other threads
        with self._claim_lock:
            self._claim_locked(topology, areas)

    def _claim_locked(self, topology: Topology | None, areas: list[RowArea]) -> None:
        self._lock(self._fd, time.monotonic() + self._timeout)
        try:
            header = _Header.read(self._fd)
            if header is None:
                raise OSError(errno.EIO, "the region header is gone", self.path)
            problem = header.claims.refusal(topology, areas)
            if problem is not None:
                raise RegionTopologyError(
                    f"shared offload region {self.path}: {problem}. An opaque page is readable "
                    f"only by the topology that stored it: give each topology its own region "
                    f"(another engine_id); nothing was loaded or recorded"
                )
            header.claims.add(topology, areas)
            header.write(self._fd)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unpin, unmap and close; rank 0 also unlinks the file. Idempotent. Views of
        :attr:`tensor` still alive keep the memory mapped until they are collected."""
        if not self.closed:
            self.closed = True
            self._teardown()

    def __enter__(self) -> SharedOffloadRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105  (contextlib may already be gone at interpreter exit)
            self._teardown()
        except Exception:
            pass

    def __repr__(self) -> str:
        where = f"rank={self.rank}/{self.world_size}, pinned={self.pinned}, closed={self.closed}"
        return f"SharedOffloadRegion({self.path!r}, {self.num_rows} x {self.row_bytes}, {where})"

    # ------------------------------------------------------------------ rank 0

    def _create(self, deadline: float) -> None:
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        while self._fd < 0:
            try:
                self._fd = os.open(self._name, flags, 0o600, dir_fd=self._dir)
            except FileExistsError:
                self._remove_stale(deadline)
                if time.monotonic() >= deadline:
                    raise TimeoutError(errno.ETIMEDOUT, "cannot create region", self.path) from None
        fd = self._fd
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new rank 0 waits for it; attachers wait for READY
        self._stat = os.fstat(fd)
        try:
            os.fchmod(fd, 0o600)
            self._check_space()
            geometry = (self.num_rows, self.row_bytes, self.world_size)
            header = _Header(*geometry, this_process(), self._digest, bytearray(self.world_size))
            header.write(fd)
            os.ftruncate(fd, self.size_bytes)
            self._map(creator=True)
            header.ranks[0], header.state = 1, STATE_READY
            header.write(fd)
            if self.world_size == 1:
                self._unlink_locked()
        except BaseException:
            self._unlink_locked()  # never leave a half-made region behind
            raise
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _remove_stale(self, deadline: float) -> None:
        """Remove the file at the path if its rank 0 is dead; else say who uses the id."""
        try:
            fd = self._open_existing()
        except FileNotFoundError:
            return
        try:
            self._lock(fd, deadline)
            header = _Header.read(fd)
            if header is not None and header.version != FORMAT_VERSION:
                owner = f"format version {header.version} (this code: {FORMAT_VERSION})"
            elif header is not None and process_alive(header.creator) is not False:
                owner = f"process {header.creator[1]}, alive (or not known to be dead)"
            else:  # no header, or its rank 0 died: a crashed run's
                if self._names(os.fstat(fd)):
                    os.unlink(self._name, dir_fd=self._dir)
                return
            raise FileExistsError(
                errno.EEXIST,
                f"engine_id {self.engine_id!r} is in use: its region file belongs to {owner}. "
                f"Use another engine_id, or end that process (remove the file if none uses it)",
                self.path,
            )
        finally:
            os.close(fd)  # drops the lock

    def _check_space(self) -> None:
        available = self._free_bytes
        if available is None:
            vfs = os.statvfs(self._dir)
            available = vfs.f_bavail * vfs.f_frsize
        if self.size_bytes > available:
            need, gib = self.size_bytes, 1 << 30
            raise RegionSpaceError(
                errno.ENOSPC,
                f"shared offload region needs {need} bytes ({need / gib:.2f} GiB) but "
                f"{self.shm_dir} has only {available} bytes ({available / gib:.2f} GiB) free: "
                f"{self.shm_dir} is too small. Enlarge it (docker: --shm-size="
                f"{-(-need // gib) + 1}g; Kubernetes: an emptyDir with medium: Memory) or "
                "offload fewer rows",
                self.path,
            )

    # ------------------------------------------------------------------ other ranks

    def _attach(self, deadline: float) -> None:
        reason = "no region file: rank 0 has not created it yet (or already closed it)"
        while True:
            try:
                fd = self._open_existing()
            except FileNotFoundError:
                pass
            else:
                reason = self._try_attach(fd, deadline)
                if reason is None:
                    return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    errno.ETIMEDOUT,
                    f"timed out after {self._timeout:g} s waiting for rank 0's shared offload "
                    f"region to become ready ({reason})",
                    self.path,
                )
            time.sleep(self.poll_interval_s)

    def _try_attach(self, fd: int, deadline: float) -> str | None:
        """Attach through ``fd`` (which it then owns); None once attached, else why not yet."""
        try:
            header = _Header.read(fd)
            st = os.fstat(fd)
            if header is None or header.state != STATE_READY:
                reason = "rank 0 is still setting it up"
            elif header.version == FORMAT_VERSION and process_alive(header.creator) is False:
                gone = f"its rank 0 (pid {header.creator[1]}) is gone"
                reason = f"the file is left by a crashed run: {gone}; this run's rank 0 replaces it"
            else:
                self._check_header(header, st)
                self._fd, self._stat = fd, st
                self._map(creator=False)
                self._lock(fd, deadline)
                header = _Header.read(fd)
                if header is None or not self._names(st):
                    self._release()  # closes fd: the lock goes with it
                    return "the file was replaced while attaching"
                header.ranks[self.rank] = 1
                header.write(fd)
                if sum(header.ranks) >= self.world_size:
                    self._unlink_locked()
                fcntl.flock(fd, fcntl.LOCK_UN)
                return None
        except BaseException:
            if self._fd != fd:
                os.close(fd)
            raise
        os.close(fd)
        return reason

    def _check_header(self, header: _Header, st: os.stat_result) -> None:
        problems = [
            f"{name}={theirs} (this rank expects {ours})"
            for name, theirs, ours in (
                ("format version", header.version, FORMAT_VERSION),
                ("num_rows", header.num_rows, self.num_rows),
                ("row_bytes", header.row_bytes, self.row_bytes),
                ("world_size", header.world_size, self.world_size),
            )
            if theirs != ours
        ]
        if not problems and header.digest != self._digest:
            problems.append("another engine id (a name collision)")
        if not problems and st.st_size != self.size_bytes:
            problems.append(f"file size {st.st_size} != {self.size_bytes}")
        if problems:
            raise ValueError(
                f"shared offload region {self.path} (created by pid {header.creator[1]}) does "
                f"not match this rank: " + "; ".join(problems)
            )

    # ------------------------------------------------------------------ files

    def _open_existing(self) -> int:
        """The file at the path, opened without following a symlink or blocking on a FIFO,
        checked to be this user's private regular file (PermissionError otherwise)."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self._name, flags, dir_fd=self._dir)
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO):
                raise
            why = "it is a symlink" if error.errno == errno.ELOOP else "not this user's file"
            raise PermissionError(error.errno, f"refusing region path: {why}", self.path) from None
        st = os.fstat(fd)
        mode = stat.filemode(st.st_mode)
        problem = None if stat.S_ISREG(st.st_mode) else f"it is not a regular file ({mode})"
        if not problem and (st.st_uid != os.geteuid() or st.st_mode & 0o077):
            problem = f"it is not private to this user (uid {st.st_uid}, mode {mode})"
        if problem:
            os.close(fd)
            raise PermissionError(errno.EPERM, f"refusing region path: {problem}", self.path)
        return fd

    def _lock(self, fd: int, deadline: float) -> None:
        """``flock(LOCK_EX)`` on ``fd``, waiting at most until ``deadline``."""
        while True:
            try:
                return fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        errno.ETIMEDOUT, "another process holds the region file's lock", self.path
                    ) from None
                time.sleep(self.poll_interval_s)

    def _names(self, st: os.stat_result) -> bool:
        """Whether the path still names the file ``st`` describes."""
        try:
            now = os.stat(self._name, dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)

    def _unlink_locked(self) -> None:
        """Unlink the path if it still names this region's file (its lock held)."""
        if not self._unlinked and self._stat is not None and self._names(self._stat):
            os.unlink(self._name, dir_fd=self._dir)
        self._unlinked = True

    # ------------------------------------------------------------------ memory

    def _map(self, *, creator: bool) -> None:
        self._mmap = mm = mmap.mmap(self._fd, self.size_bytes)  # shared, read and write
        # Before the first fault: a TP rank's fragments are scattered over the rows, and
        # 2 MiB pages save a page walk per fragment where shmem_enabled allows them.
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(MADV_HUGEPAGE)
        self._prefault(mm, creator=creator)
        # numpy holds a buffer export of the mapping while any tensor derived from it lives,
        # so mm.close() cannot unmap memory still in use (it raises BufferError instead).
        base = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        self._tensor = base[HEADER_BYTES:].view(self.num_rows, self.row_bytes)
        if self._pin:
            from ..transfer import register_host_memory

            address, size = self._tensor.data_ptr(), self.data_bytes
            self._pinned = register_host_memory(address, size, chunk_bytes=PIN_CHUNK_BYTES)

    def _prefault(self, mm: mmap.mmap, *, creator: bool) -> None:
        """Fault every page in now, not in the first transfers. ``MADV_POPULATE_WRITE`` keeps
        the contents and reports a full tmpfs as an error, not a SIGBUS; without it (Linux <
        5.14) rank 0 zeroes a byte per page of its fresh file and the others read one."""
        try:
            return mm.madvise(MADV_POPULATE_WRITE)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                why = f"{os.strerror(e.errno)}; {self.shm_dir} too small? (docker: --shm-size)"
                raise RegionSpaceError(e.errno, f"cannot populate region: {why}", self.path) from e
        pages = np.frombuffer(mm, dtype=np.uint8)[:: mmap.PAGESIZE]
        if creator:
            pages[:] = 0
        else:
            int(pages.max())
        del pages

    def _release(self) -> None:
        """Unpin, drop the tensor, unmap (views still alive keep it mapped) and close."""
        pinned, self._pinned = self._pinned, []
        try:
            if pinned:
                from ..transfer import unregister_host_memory

                unregister_host_memory(pinned)
        finally:
            self._tensor = None
            mm, self._mmap = self._mmap, None
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()
            fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)

    def _teardown(self) -> None:
        """Rank 0 unlinks its file (unless every rank attached already); all is released."""
        try:
            if self.is_creator and self._fd >= 0 and not self._unlinked:
                with contextlib.suppress(TimeoutError):  # a process of ours holds the lock:
                    self._lock(self._fd, time.monotonic() + _UNLINK_WAIT_S)  # leave the file
                    self._unlink_locked()
        finally:
            try:
                self._release()
            finally:
                fd, self._dir = self._dir, -1
                if fd >= 0:
                    os.close(fd)
