"""One CPU memory region per engine, shared by every rank (process) of a node.

canonical-kv offloads KV-cache pages into canonical CPU rows. All ranks of a node
map the *same* region so any rank can read pages another rank stored.
:class:`SharedOffloadRegion` implements that region as a file in ``/dev/shm``
(tmpfs) mapped ``MAP_SHARED`` by every rank.

Lifecycle
---------
Create
    Every rank first tries ``open(O_CREAT | O_EXCL | O_NOFOLLOW, 0o600)`` on
    ``<shm_dir>/canonical-kv-<engine id>``. Exactly one wins: the *creator*. While
    holding ``flock(LOCK_EX)`` on the file it checks the free space of ``shm_dir``
    (before anything is allocated), writes the header (state ``INIT``, its pid),
    ``ftruncate``-s the file, maps it, prefaults every page
    (``MADV_POPULATE_WRITE``, or one write per page), optionally pins it with
    ``cudaHostRegister``, then registers itself and marks the header ``READY``.
    Any failure removes the file again.
Attach
    The other ranks open the existing file (``O_NOFOLLOW``; it must be a regular
    file owned by this user with no group/other permissions) and poll, with a
    timeout, until the header says ``READY``. They check that the geometry
    (rows, row bytes, world size, engine id) matches theirs, map and prefault it,
    optionally pin it, and register their rank in the header under ``flock``.
    ``attach_timeout_s`` must cover the creator's prefault (and pin) time, which
    grows with the region size.
Unlink after all attached
    The rank whose registration makes ``world_size`` ranks attached unlinks the
    file while still holding the lock. From then on the memory lives exactly as
    long as some rank maps it: killing every rank (even with SIGKILL) frees it and
    leaves no file behind. A rank killed *after* attaching does not block the
    unlink: it already counted.
Close
    :meth:`SharedOffloadRegion.close` unpins, drops the tensor, unmaps and closes
    the file. A rank that closes stays counted as attached, so ranks may attach
    one after another (e.g. writers that finish before readers start); it may
    attach again later. Callers must drop every view of
    :attr:`~SharedOffloadRegion.tensor` (and of :meth:`layer_views`) for the
    mapping to be released; views still alive keep the memory mapped until they
    are garbage collected.
Closed before all attached (the creator, or everyone, leaves early)
    Until every rank has attached, the region lives as long as at least one
    attached rank *holds* it (its process is alive and has not closed it). The
    creator is not special: it may close and exit while other ranks hold the
    region; ranks still to come attach to it and find the data. When the last
    holder closes before all ranks attached, the data is freed and the file is
    atomically replaced (a rename: processes still mapping the old file keep
    valid memory) by a 4096-byte *closed marker* recording which ranks had
    attached. A rank that arrives later raises :class:`RegionClosedError` (its
    data is gone) instead of creating a new, empty region; the marker is
    removed once every rank of ``world_size`` has either attached or been
    refused. The same happens when the last holder dies without closing after
    some rank closed: the next rank to arrive converts the file into the marker
    and is refused. To hand data from ranks that finish early to ranks that
    start later, keep one rank attached throughout (the demo's coordinator,
    rank 0, holds the region from before the writers start until the readers
    are done). A marker whose missing ranks never come stays behind (4 KiB);
    a later run under the same engine id is refused until it is removed
    (:meth:`SharedOffloadRegion.remove_closed_marker`).
Crash before everyone attached (the stale case)
    If every rank that attached died without closing the region before all
    ranks attached, the file stays. The next rank that finds it recognises it as
    stale and removes it (under the file's lock, after re-checking that the path
    still names the same file, so only one process removes it and at most one
    re-creates it, thanks to ``O_EXCL``); waiting ranks then attach to the new
    region. This is how a restarted run under the same engine id recovers; a
    late rank of the crashed run cannot be told apart from a restart. A file is
    stale when

    * it is ready and every rank that attached is dead, none having closed it
      (``kill(pid, 0)`` fails with ``ESRCH``, or the process is a zombie), or
    * it is not ready yet and its creator is dead (as above, or the pid was
      reused: its start time differs), or
    * its header is invalid, or it never became ready, while no process holds its
      lock, for longer than :attr:`SharedOffloadRegion.stale_grace_s` seconds.

    Ranks in different pid namespaces (containers sharing ``/dev/shm``) cannot
    check each other's pids: a rank whose pid namespace differs from the
    creator's assumes every recorded pid alive.

The file layout is a 4096-byte header (so the data area stays page-aligned)
followed by ``num_rows * row_bytes`` bytes of rows, row ``r`` at byte
``4096 + r * row_bytes``.
"""

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
import time
from collections.abc import Sequence
from types import TracebackType

import numpy as np
import torch

from ..checks import check_int

__all__ = ["RegionClosedError", "RegionSpaceError", "SharedOffloadRegion", "region_path"]

HEADER_BYTES = 4096
MAGIC = b"CKVSHMR\x00"
FORMAT_VERSION = 1
# INIT: the creator is setting it up; READY: attachable; CLOSED: a header-only marker
# left where a region was closed before all ranks attached (see the module docstring).
STATE_INIT, STATE_READY, STATE_CLOSED = 0, 1, 2
FILE_PREFIX = "canonical-kv-"
PIN_CHUNK_BYTES = 1 << 30
# cudaHostRegister flags (cuda_runtime_api.h): usable by every context, with a device address.
_HOST_REGISTER_PORTABLE = 0x1
_HOST_REGISTER_MAPPED = 0x2
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)

# magic, version, header bytes, num_rows, row_bytes, world_size, state, creator pid,
# creator start time (clock ticks after boot), creator pid namespace inode,
# attach count, engine id digest (16 bytes); rank pids (int64 each) follow at 128:
# 0 never attached, > 0 attached by that pid, _CLOSED_RANK attached then closed,
# _REFUSED_RANK arrived after the region was closed.
_HEADER = struct.Struct("<8sIIQQIIqQQI4x16s")
_RANKS_OFFSET = 128
MAX_WORLD_SIZE = (HEADER_BYTES - _RANKS_OFFSET) // 8
assert _HEADER.size <= _RANKS_OFFSET

_NAME_OK = re.compile(r"[^A-Za-z0-9._-]")
_MAX_NAME_CHARS = 200


class RegionSpaceError(OSError):
    """The shared-memory file system has too little free space for the region."""


class RegionClosedError(RuntimeError):
    """The region was closed before this rank attached: its data is gone.

    Raised to a rank that arrives after every rank that had attached closed the
    region before all ``world_size`` ranks attached (see the module docstring).

    Attributes
    ----------
    path : str
        The region file (now a header-only marker).
    attached_ranks : list[int]
        The ranks that had attached before the region was closed.
    """

    def __init__(self, message: str, path: str, attached_ranks: list[int]) -> None:
        super().__init__(message)
        self.path = path
        self.attached_ranks = attached_ranks


def region_path(engine_id: str, shm_dir: str = "/dev/shm") -> str:
    """Path of the region file for ``engine_id`` in ``shm_dir``.

    Characters outside ``[A-Za-z0-9._-]`` become ``_``; when that changes the id
    (or it is very long) a digest of the original id is appended so that distinct
    ids never share a file.

    Parameters
    ----------
    engine_id : str
        Non-empty engine identifier.
    shm_dir : str
        Directory holding the region files.

    Returns
    -------
    str
        ``<shm_dir>/canonical-kv-<sanitised id>``.
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise ValueError(f"engine_id: expected a non-empty str, got {engine_id!r}")
    name = _NAME_OK.sub("_", engine_id)
    if name != engine_id or len(name) > _MAX_NAME_CHARS:
        digest = hashlib.sha256(engine_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        name = f"{name[:_MAX_NAME_CHARS]}-{digest}"
    return os.path.join(shm_dir, FILE_PREFIX + name)


def _ask_for_huge_pages(mm: mmap.mmap) -> None:
    """Ask the kernel to back the region with transparent huge pages, where it will.

    A TP rank's fragments are scattered over the region's rows (1/8 of each
    canonical page at TP=8): with 4 KiB pages nearly every fragment costs a page
    walk, with 2 MiB pages almost none. Measured on anonymous memory here
    (``bench/bench_transfer.py --quick --sections fragments --only TP8`` with and
    without ``--huge-pages``, alternated): sparse TP=8 stores / loads of 256 B
    fragments 14.7-14.9 / 13.0-13.1 -> 14.8-17.2 / 14.2-15.0 GB/s, of 4 KiB
    16.9-17.2 / 16.7-17.6 -> 18.7-19.2 / 18.7-19.3 GB/s. A shared-memory file gets
    them only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is
    ``advise`` (or ``within_size`` / ``always``); elsewhere, or without THP, this
    asks nothing and nothing fails. (This VM's is ``never``: the region itself has
    not run on huge pages here.) Must come before the pages are faulted in.
    """
    with contextlib.suppress(OSError, ValueError):
        mm.madvise(MADV_HUGEPAGE)


def _engine_digest(engine_id: str) -> bytes:
    return hashlib.sha256(engine_id.encode("utf-8", "surrogatepass")).digest()[:16]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2 :].split()
        return fields[0].decode(), int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _own_pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _process_alive(pid: int, start_ticks: int, pid_namespace: int) -> bool:
    """Whether the process that wrote ``pid`` may still be alive.

    Unknowable cases (another pid namespace) count as alive.
    """
    if pid <= 0:
        return False
    own_ns = _own_pid_namespace()
    if pid_namespace and own_ns and pid_namespace != own_ns:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    info = _proc_stat(pid)
    if info is None:
        return True
    state, ticks = info
    if state in ("Z", "X"):
        return False
    return not (start_ticks and ticks != start_ticks)


def _same_file(path: str, st: os.stat_result) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


# Fields of ``_HEADER``, in packing order.
_HEADER_FIELDS = (
    "magic",
    "version",
    "header_bytes",
    "num_rows",
    "row_bytes",
    "world_size",
    "state",
    "creator_pid",
    "creator_start",
    "creator_pidns",
    "attach_count",
    "engine_digest",
)


class _Header:
    """Decoded region header (see ``_HEADER``)."""

    __slots__ = (*_HEADER_FIELDS, "rank_pids")

    def __init__(self, raw: bytes) -> None:
        for name, value in zip(_HEADER_FIELDS, _HEADER.unpack_from(raw, 0), strict=True):
            setattr(self, name, value)
        count = min(self.world_size, MAX_WORLD_SIZE)
        self.rank_pids = list(struct.unpack_from(f"<{count}q", raw, _RANKS_OFFSET))

    @classmethod
    def read(cls, fd: int) -> _Header | None:
        """Header of the file, or None when it is too short or lacks the magic."""
        raw = os.pread(fd, HEADER_BYTES, 0)
        if len(raw) < HEADER_BYTES or raw[: len(MAGIC)] != MAGIC:
            return None
        return cls(raw)

    def write(self, fd: int) -> None:
        raw = _HEADER.pack(*(getattr(self, name) for name in _HEADER_FIELDS))
        raw += bytes(_RANKS_OFFSET - len(raw))
        raw += struct.pack(f"<{len(self.rank_pids)}q", *self.rank_pids)
        raw += bytes(HEADER_BYTES - len(raw))
        if os.pwrite(fd, raw, 0) != HEADER_BYTES:
            raise OSError(errno.EIO, "short write of the region header")

    def creator_alive(self) -> bool:
        return _process_alive(self.creator_pid, self.creator_start, self.creator_pidns)

    def live_holders(self) -> list[int]:
        """Ranks attached by a process that is alive and has not closed the region."""
        return [
            rank
            for rank, pid in enumerate(self.rank_pids)
            if pid > 0 and _process_alive(pid, 0, self.creator_pidns)
        ]

    def attached_ranks(self) -> list[int]:
        """Ranks that attached at some point (alive, dead or closed)."""
        return [rank for rank, pid in enumerate(self.rank_pids) if pid > 0 or pid == _CLOSED_RANK]

    def num_refused(self) -> int:
        return sum(pid == _REFUSED_RANK for pid in self.rank_pids)


class SharedOffloadRegion:
    """A ``(num_rows, row_bytes)`` uint8 CPU region shared by all ranks of a node.

    Every rank constructs it with the same ``engine_id`` and geometry; one becomes
    the creator, the others attach (see the module docstring for the lifecycle).

    Parameters
    ----------
    engine_id : str
        Identifies the engine; names the file (``canonical-kv-<sanitised id>``).
    num_rows : int
        Number of canonical rows.
    row_bytes : int
        Bytes per row.
    world_size : int
        Number of ranks that will attach; the file is unlinked once all did.
    rank : int
        This rank, in ``[0, world_size)``; a rank may be attached only once at a
        time (a rank whose previous process died may attach again).
    shm_dir : str
        Directory of the backing file; a tmpfs such as ``/dev/shm``.
    pin : bool or None
        Page-lock the data area with ``cudaHostRegister`` (in 1 GiB chunks).
        ``None``: pin when ``torch.cuda.is_available()``. ``True`` without CUDA
        raises ``RuntimeError``.
    attach_timeout_s : float
        How long to wait for the creator to make the region ready.
    free_bytes : int or None
        Free space of ``shm_dir`` to assume instead of asking ``os.statvfs``
        (for tests).

    Raises
    ------
    RegionSpaceError
        ``shm_dir`` has less free space than the region needs (nothing is left
        allocated).
    RegionClosedError
        Every rank that had attached closed (or left) the region before all
        ranks attached: its data is gone (see the module docstring).
    TimeoutError
        The region did not become ready within ``attach_timeout_s``.
    ValueError
        Invalid arguments, or the existing region (whose creator is alive) has a
        different geometry, format or engine id, or this rank is already attached.
    PermissionError
        The path is a symlink, not a regular file, or not private to this user.
    RuntimeError
        ``pin=True`` without CUDA, or pinning failed.

    Attributes
    ----------
    path : str
        The backing file (unlinked once all ranks attached).
    size_bytes : int
        Size of the backing file: header (4096 bytes) plus ``data_bytes``.
    data_bytes : int
        ``num_rows * row_bytes``.
    is_creator : bool
        Whether this rank created the region.
    closed : bool
        Whether :meth:`close` ran.
    pinned : bool
        Whether this rank registered the data area with CUDA.
    """

    #: Seconds a header-less or never-ready file, whose lock nobody holds, may
    #: exist before it counts as stale.
    stale_grace_s: float = 5.0
    #: Seconds between polls while waiting for the creator.
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
        self.closed = True  # until fully set up, so __del__/close stay harmless
        self._fd = -1
        self._mmap: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self._tensor: torch.Tensor | None = None
        self._pinned_chunks: list[int] = []
        self._stat: os.stat_result | None = None
        self._unlinked = False

        self.engine_id = engine_id
        self.path = region_path(engine_id, shm_dir)
        self.shm_dir = shm_dir
        self.num_rows = check_int("num_rows", num_rows, minimum=1)
        self.row_bytes = check_int("row_bytes", row_bytes, minimum=1)
        self.world_size = check_int("world_size", world_size, minimum=1, maximum=MAX_WORLD_SIZE)
        self.rank = check_int("rank", rank, minimum=0, maximum=self.world_size - 1)
        if not attach_timeout_s >= 0:
            raise ValueError(f"attach_timeout_s: expected >= 0, got {attach_timeout_s!r}")
        if free_bytes is not None:
            free_bytes = check_int("free_bytes", free_bytes, minimum=0)
        if pin is None:
            pin = torch.cuda.is_available()
        elif pin and not torch.cuda.is_available():
            raise RuntimeError(
                "SharedOffloadRegion(pin=True): CUDA is not available, cannot "
                "cudaHostRegister the region (pass pin=False or pin=None)"
            )
        self._pin = bool(pin)
        self._free_bytes = free_bytes
        self.data_bytes = self.num_rows * self.row_bytes
        self.size_bytes = HEADER_BYTES + self.data_bytes
        self.data_offset = HEADER_BYTES
        self.is_creator = False
        self._digest = _engine_digest(engine_id)
        self._open(float(attach_timeout_s))
        self.closed = False

    # ------------------------------------------------------------------ public

    @property
    def tensor(self) -> torch.Tensor:
        """``torch.uint8`` tensor ``(num_rows, row_bytes)`` over the shared data area."""
        if self.closed or self._tensor is None:
            raise ValueError(f"SharedOffloadRegion({self.path}) is closed")
        return self._tensor

    @property
    def pinned(self) -> bool:
        """Whether this rank page-locked the data area with CUDA."""
        return bool(self._pinned_chunks)

    def layer_views(
        self,
        page_sizes: Sequence[int],
        pages_per_row: int,
        area_offsets: Sequence[int] | None = None,
    ) -> list[torch.Tensor]:
        """Per-layer canonical page views of the rows.

        Layer ``l``'s view has shape ``(num_rows, pages_per_row, page_sizes[l])``,
        strides ``(row_bytes, page_sizes[l], 1)`` and starts at byte
        ``area_offsets[l]`` of each row. The views alias :attr:`tensor`; the same
        inputs give the same views on every rank.

        Parameters
        ----------
        page_sizes : sequence of int
            Canonical page size in bytes of each layer (positive).
        pages_per_row : int
            Pages of each layer per row.
        area_offsets : sequence of int, optional
            Byte offset of each layer's area within a row. Default: consecutive
            areas of ``pages_per_row * page_sizes[l]`` bytes, layer 0 first.

        Returns
        -------
        list of torch.Tensor
            One uint8 view per layer.

        Raises
        ------
        ValueError
            Bad sizes, a negative offset, overlapping areas, or an area that does
            not fit in ``row_bytes``.
        """
        base = self.tensor
        pages_per_row = check_int("pages_per_row", pages_per_row, minimum=1)
        if isinstance(page_sizes, (str, bytes)) or not len(page_sizes):
            raise ValueError("page_sizes: expected a non-empty sequence of positive ints")
        sizes = [check_int(f"page_sizes[{i}]", s, minimum=1) for i, s in enumerate(page_sizes)]
        if area_offsets is None:
            offsets, position = [], 0
            for size in sizes:
                offsets.append(position)
                position += pages_per_row * size
        else:
            if len(area_offsets) != len(sizes):
                raise ValueError(
                    f"area_offsets: expected {len(sizes)} offsets (one per layer), "
                    f"got {len(area_offsets)}"
                )
            offsets = []
            for layer, offset in enumerate(area_offsets):
                offsets.append(check_int(f"area_offsets[{layer}]", offset, minimum=0))
        areas = sorted(
            (offset, offset + pages_per_row * size, layer)
            for layer, (offset, size) in enumerate(zip(offsets, sizes))
        )
        for (begin, end, layer), nxt in zip(areas, [*areas[1:], None]):
            if end > self.row_bytes:
                raise ValueError(
                    f"layer {layer}: its area [{begin}, {end}) ({pages_per_row} pages of "
                    f"{sizes[layer]} bytes at offset {begin}) overflows the row of "
                    f"{self.row_bytes} bytes"
                )
            if nxt is not None and end > nxt[0]:
                raise ValueError(
                    f"layer {layer}: its area [{begin}, {end}) overlaps layer {nxt[2]}'s "
                    f"at {nxt[0]}"
                )
        start = base.storage_offset()
        return [
            base.as_strided(
                (self.num_rows, pages_per_row, size), (self.row_bytes, size, 1), start + offset
            )
            for offset, size in zip(offsets, sizes)
        ]

    def close(self) -> None:
        """Unpin, unmap and close the file; idempotent.

        Before all ranks attached, the last rank holding the region replaces it by
        the closed marker (see the module docstring), so that ranks still to come
        are refused instead of handed an empty region.

        Views of :attr:`tensor` that callers still hold keep the memory mapped
        until they are garbage collected (the mapping cannot be closed while they
        exist); drop them before closing to free the memory at once.
        """
        if self.closed:
            return
        self.closed = True
        try:
            self._unpin()
        finally:
            try:
                if self._fd >= 0 and self._stat is not None and not self._unlinked:
                    self._leave()
            finally:
                self._release_mapping()
                self._close_fd()

    @staticmethod
    def remove_closed_marker(engine_id: str, shm_dir: str = "/dev/shm") -> bool:
        """Remove the closed marker of ``engine_id``, so that a new run may create the region.

        Only a closed marker (a region closed before all its ranks attached; see
        the module docstring) is removed, never a live region or anything else.

        Returns
        -------
        bool
            Whether a marker was removed.
        """
        path = region_path(engine_id, shm_dir)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # missing, or a symlink (O_NOFOLLOW)
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                return False
            fcntl.flock(fd, fcntl.LOCK_EX)
            header = _Header.read(fd)
            if header is None or header.state != STATE_CLOSED or not _same_file(path, st):
                return False
            os.unlink(path)
            return True
        finally:
            os.close(fd)

    def __enter__(self) -> SharedOffloadRegion:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105  (contextlib may already be gone at interpreter exit)
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        role = "creator" if self.is_creator else "attacher"
        return (
            f"SharedOffloadRegion(path={self.path!r}, num_rows={self.num_rows}, "
            f"row_bytes={self.row_bytes}, rank={self.rank}/{self.world_size}, {role}, "
            f"pinned={self.pinned}, closed={self.closed})"
        )

    # ------------------------------------------------------------ create/attach

    def _open(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last_reason = "the file did not appear"
        while True:
            try:
                fd = os.open(
                    self.path,
                    os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC,
                    0o600,
                )
            except FileExistsError:
                pass
            else:
                self._create(fd)
                return
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # removed in between: try to create it
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise PermissionError(
                        errno.ELOOP, "refusing to follow a symlink at the region path", self.path
                    ) from e
                raise
            try:
                outcome = self._try_attach(fd)
            except BaseException:
                self._release_mapping()
                os.close(fd)
                raise
            if outcome is None:
                return
            os.close(fd)
            last_reason = outcome
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    errno.ETIMEDOUT,
                    f"timed out after {timeout_s:g} s waiting for the shared offload region "
                    f"to become ready ({last_reason})",
                    self.path,
                )
            if outcome != "stale file removed":
                time.sleep(self.poll_interval_s)

    def _create(self, fd: int) -> None:
        """Initialise the file this process just created with O_EXCL."""
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = os.fstat(fd)
        try:
            os.fchmod(fd, 0o600)
            self._check_space()
            info = _proc_stat(os.getpid())
            header = _Header.__new__(_Header)
            header.magic = MAGIC
            header.version = FORMAT_VERSION
            header.header_bytes = HEADER_BYTES
            header.num_rows = self.num_rows
            header.row_bytes = self.row_bytes
            header.world_size = self.world_size
            header.state = STATE_INIT
            header.creator_pid = os.getpid()
            header.creator_start = info[1] if info else 0
            header.creator_pidns = _own_pid_namespace()
            header.attach_count = 0
            header.engine_digest = self._digest
            header.rank_pids = [0] * self.world_size
            header.write(fd)
            os.ftruncate(fd, self.size_bytes)
            self._map(fd, creator=True)
            if self._pin:
                self._pin_data()
            header.rank_pids[self.rank] = os.getpid()
            header.attach_count = 1
            header.state = STATE_READY
            header.write(fd)
            self._fd, self._stat, self.is_creator = fd, st, True
            if self.world_size == 1:
                os.unlink(self.path)
                self._unlinked = True
        except BaseException:
            try:
                self._unpin()
                self._release_mapping()
                if _same_file(self.path, st):
                    os.unlink(self.path)
            finally:
                self._fd = -1
                os.close(fd)
            raise
        finally:
            if self._fd == fd:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _check_space(self) -> None:
        if self._free_bytes is not None:
            available = int(self._free_bytes)
        else:
            vfs = os.statvfs(self.shm_dir)
            available = vfs.f_bavail * vfs.f_frsize
        if self.size_bytes > available:
            gib = 1 << 30
            raise RegionSpaceError(
                errno.ENOSPC,
                f"shared offload region needs {self.size_bytes} bytes "
                f"({self.size_bytes / gib:.2f} GiB) but {self.shm_dir} has only {available} "
                f"bytes ({available / gib:.2f} GiB) free: {self.shm_dir} is too small. "
                f"Enlarge it (docker: --shm-size=<size>, e.g. --shm-size="
                f"{-(-self.size_bytes // gib) + 1}g; Kubernetes: an emptyDir with medium: "
                f"Memory) or offload fewer rows",
                self.path,
            )

    def _try_attach(self, fd: int) -> str | None:
        """Attach through ``fd``; None when attached, else why to retry."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(errno.EPERM, "region path is not a regular file", self.path)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(
                errno.EPERM,
                f"region file is not private to this user (uid {st.st_uid}, mode "
                f"{stat.filemode(st.st_mode)}); refusing to map it",
                self.path,
            )
        header = _Header.read(fd)
        if header is not None and header.version == FORMAT_VERSION:
            if header.state == STATE_CLOSED:
                return self._refuse_closed(fd, st)
            if header.state == STATE_READY and _abandoned(header):
                return self._close_abandoned(fd, st)
        stale = self._stale_reason(header, st)
        if stale is not None:
            return self._remove_stale(fd, st, stale)
        if header is None:
            return "the creator has not written the header yet"
        if header.version != FORMAT_VERSION:
            raise ValueError(
                f"shared offload region {self.path} (created by live pid {header.creator_pid}) "
                f"has format version {header.version}; this code reads {FORMAT_VERSION}"
            )
        if header.state != STATE_READY:
            return f"creator pid {header.creator_pid} is still initialising it"
        self._check_geometry(header, st)
        self._map(fd, creator=False)
        if self._pin:
            self._pin_data()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if not _same_file(self.path, st):
                    raise _Retry("the file was replaced while attaching")
                header = _Header.read(fd)
                if header is None or header.state != STATE_READY:
                    raise _Retry("the file was replaced while attaching")
                if _abandoned(header):
                    raise _Retry("every rank left the region while attaching")
                previous = header.rank_pids[self.rank]
                if previous > 0 and _process_alive(previous, 0, header.creator_pidns):
                    raise ValueError(
                        f"rank {self.rank} is already attached to {self.path} by pid {previous}"
                    )
                if not previous:
                    header.attach_count += 1
                header.rank_pids[self.rank] = os.getpid()
                header.write(fd)
                self._fd, self._stat = fd, st
                if header.attach_count >= self.world_size:
                    os.unlink(self.path)
                    self._unlinked = True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except _Retry as retry:
            self._unpin()
            self._release_mapping()
            return str(retry)
        except BaseException:
            self._fd = -1
            self._unpin()
            raise
        return None

    def _stale_reason(self, header: _Header | None, st: os.stat_result) -> str | None:
        """Why the file is stale, or None if it may still be (becoming) a live region."""
        age = time.time() - max(st.st_mtime, st.st_ctime)
        if header is None:
            return f"no valid header after {age:.1f} s" if age > self.stale_grace_s else None
        if header.version == FORMAT_VERSION and header.state == STATE_CLOSED:
            return None  # a closed marker: late ranks are refused, never handed a new region
        if header.version == FORMAT_VERSION and header.state == STATE_READY:
            # A ready region lives while some attached rank holds it (its creator may have
            # closed and exited); abandoned after a clean close is not stale either.
            if header.live_holders() or _abandoned(header):
                return None
            return (
                f"no attached rank is alive and none closed it (ranks attached: "
                f"{header.attached_ranks()}; creator pid {header.creator_pid})"
            )
        if not header.creator_alive():
            return f"creator pid {header.creator_pid} is dead"
        if (
            header.version == FORMAT_VERSION
            and header.state != STATE_READY
            and age > self.stale_grace_s
        ):
            return f"not ready after {age:.1f} s"
        return None

    def _remove_stale(self, fd: int, st: os.stat_result, reason: str) -> str:
        """Unlink the stale file behind ``fd`` unless someone holds its lock."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f"stale-looking file ({reason}) is locked by a live process"
        try:
            if not _same_file(self.path, st):
                return "stale file removed"
            st = os.fstat(fd)
            if self._stale_reason(_Header.read(fd), st) is None:
                return "file became valid"
            os.unlink(self.path)
            return "stale file removed"
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _close_abandoned(self, fd: int, st: os.stat_result) -> str:
        """Replace a ready region that no rank holds, but one closed, by the closed marker."""
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if not _same_file(self.path, st):
                return "the file was replaced"
            header = _Header.read(fd)
            if header is None or header.state != STATE_READY or not _abandoned(header):
                return "the region is held again"
            self._write_closed_marker(header)
            return "marked a region its ranks left as closed"
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _refuse_closed(self, fd: int, st: os.stat_result) -> str:
        """Tell this rank the region is closed (raise); count it; unlink once all ranks know."""
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if not _same_file(self.path, st):
                return "the closed marker was replaced"
            header = _Header.read(fd)
            if header is None or header.state != STATE_CLOSED:
                return "the closed marker was replaced"
            attached = header.attached_ranks()
            if self.rank < len(header.rank_pids) and header.rank_pids[self.rank] == 0:
                header.rank_pids[self.rank] = _REFUSED_RANK
                header.write(fd)
            if header.attach_count + header.num_refused() >= header.world_size:
                os.unlink(self.path)  # every rank has attached or been told: nothing to keep
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        raise RegionClosedError(
            f"shared offload region {self.path} was closed before all {header.world_size} "
            f"ranks attached: rank(s) {attached} attached and every one of them closed or "
            f"exited, so its data is gone and rank {self.rank} attaches too late. Keep one "
            f"rank attached until every rank has attached (e.g. the coordinator holds the "
            f"region open). To start over, use another engine_id or remove the marker "
            f"(SharedOffloadRegion.remove_closed_marker({self.engine_id!r}, "
            f"{self.shm_dir!r}))",
            self.path,
            attached,
        )

    def _write_closed_marker(self, header: _Header) -> None:
        """Atomically replace the region file by a header-only CLOSED marker (lock held).

        A rename, not a truncation: processes that still map the old file (views
        kept after close) keep valid memory, freed when they unmap it.
        """
        header.state = STATE_CLOSED
        tmp = f"{self.path}.closing-{os.getpid()}-{os.urandom(4).hex()}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            header.write(fd)
            os.rename(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)

    def _check_geometry(self, header: _Header, st: os.stat_result) -> None:
        problems = []
        if header.header_bytes != HEADER_BYTES:
            problems.append(f"header bytes {header.header_bytes} != {HEADER_BYTES}")
        if header.engine_digest != self._digest:
            problems.append("a different engine id (name collision)")
        for name in ("num_rows", "row_bytes", "world_size"):
            theirs, ours = getattr(header, name), getattr(self, name)
            if theirs != ours:
                problems.append(f"{name}={theirs} (this rank expects {ours})")
        if not problems and st.st_size != self.size_bytes:
            problems.append(f"file size {st.st_size} != {self.size_bytes}")
        if problems:
            raise ValueError(
                f"shared offload region {self.path} (created by pid {header.creator_pid}) "
                f"does not match this rank: " + "; ".join(problems)
            )

    # ------------------------------------------------------------------ memory

    def _map(self, fd: int, *, creator: bool) -> None:
        mm = mmap.mmap(fd, self.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._mmap = mm
        _ask_for_huge_pages(mm)
        self._prefault(mm, creator=creator)
        # numpy holds a buffer export of the mapping for as long as any tensor
        # derived from it lives, so ``mm.close()`` cannot unmap memory still in
        # use (it raises BufferError instead). torch.frombuffer would not.
        base = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        self._base = base
        self._tensor = base[HEADER_BYTES:].view(self.num_rows, self.row_bytes)

    def _prefault(self, mm: mmap.mmap, *, creator: bool) -> None:
        """Fault in every page now, so the first transfers do not pay for it.

        ``MADV_POPULATE_WRITE`` allocates without changing contents and reports
        a full tmpfs as an error instead of a SIGBUS. Without it the creator writes
        one zero per page (the file is fresh) and attachers read one byte per page.
        """
        try:
            mm.madvise(MADV_POPULATE_WRITE)
            return
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise RegionSpaceError(
                    e.errno,
                    f"could not populate the {self.size_bytes}-byte shared offload region "
                    f"({os.strerror(e.errno)}); {self.shm_dir} is probably too small "
                    f"(docker: --shm-size)",
                    self.path,
                ) from e
        if not creator:
            # Pages were allocated by the creator; reading maps them in.
            pages = np.frombuffer(mm, dtype=np.uint8)[:: mmap.PAGESIZE]
            int(pages.max())
            del pages
            return
        vfs_free = None
        if self._free_bytes is None:
            vfs = os.statvfs(self.shm_dir)
            vfs_free = vfs.f_bavail * vfs.f_frsize
        if vfs_free is not None and vfs_free < self.size_bytes - HEADER_BYTES:
            # Writing into a full tmpfs through a mapping raises SIGBUS: refuse instead.
            raise RegionSpaceError(
                errno.ENOSPC,
                f"{self.shm_dir} ran out of space while the region was being created "
                f"({vfs_free} bytes free, {self.size_bytes} needed)",
                self.path,
            )
        pages = np.frombuffer(mm, dtype=np.uint8)[:: mmap.PAGESIZE]
        pages[:] = 0
        del pages

    def _pin_data(self) -> None:
        """Page-lock the data area (portable | mapped) in PIN_CHUNK_BYTES chunks.

        Uses torch's own CUDA runtime (``torch.cuda.cudart()``, no extra dependency), so
        the registration happens in torch's context on torch's current device: set the
        device (``torch.cuda.set_device``) before creating the region, or the call
        creates a context on device 0. Portable registrations serve every device.
        """
        assert self._mmap is not None
        cudart = torch.cuda.cudart()
        view = np.frombuffer(self._mmap, dtype=np.uint8)
        base = view.ctypes.data + HEADER_BYTES
        del view
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
        for offset in range(0, self.data_bytes, PIN_CHUNK_BYTES):
            size = min(PIN_CHUNK_BYTES, self.data_bytes - offset)
            err = cudart.cudaHostRegister(base + offset, size, flags)
            if int(getattr(err, "value", err)) != 0:
                text = cudart.cudaGetErrorString(err)
                self._unpin()
                raise RuntimeError(
                    f"cudaHostRegister of {size} bytes at offset {offset} of {self.path} "
                    f"on cuda:{torch.cuda.current_device()} failed: {text} ({int(err)})"
                )
            self._pinned_chunks.append(base + offset)

    def _unpin(self) -> None:
        if not self._pinned_chunks:
            return
        cudart = torch.cuda.cudart()
        failures = []
        while self._pinned_chunks:
            ptr = self._pinned_chunks.pop()
            err = cudart.cudaHostUnregister(ptr)
            if int(getattr(err, "value", err)) != 0:
                failures.append(f"{ptr:#x}: {cudart.cudaGetErrorString(err)}")
        if failures:
            raise RuntimeError(f"cudaHostUnregister failed for {', '.join(failures)}")

    def _release_mapping(self) -> None:
        self._tensor = None
        self._base = None
        mm, self._mmap = self._mmap, None
        if mm is not None:
            # Views still referencing the mapping keep it alive; it is unmapped when they die.
            with contextlib.suppress(BufferError):
                mm.close()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def _leave(self) -> None:
        """On close of a not-yet-fully-attached region: withdraw; the last holder closes it."""
        fd, st = self._fd, self._stat
        assert st is not None
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if not _same_file(self.path, st):
                return  # unlinked once all attached, or replaced
            header = _Header.read(fd)
            if header is None or header.state != STATE_READY:
                os.unlink(self.path)  # not a region anyone can attach: nothing to keep
                self._unlinked = True
                return
            if header.rank_pids[self.rank] == os.getpid():
                # Still counted as attached (a group may run its ranks one after
                # another); -1 marks "attached, now closed" so a re-attach of the
                # same rank is not counted twice.
                header.rank_pids[self.rank] = _CLOSED_RANK
            if header.live_holders():
                header.write(fd)  # others hold it: it stays until every rank attached
                return
            # The last holder leaves before all ranks attached: free the data, but leave
            # a marker so that ranks still to come are told instead of starting afresh.
            self._write_closed_marker(header)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def _abandoned(header: _Header) -> bool:
    """A ready region that no live rank holds, after at least one rank closed it."""
    return any(pid == _CLOSED_RANK for pid in header.rank_pids) and not header.live_holders()


_CLOSED_RANK = -1
_REFUSED_RANK = -2


class _Retry(Exception):
    """Internal: the file changed under us; start over."""
