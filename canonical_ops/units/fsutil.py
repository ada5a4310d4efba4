"""Directories and files that no symlink, FIFO or other local user can turn against us.

Below the operator's root every path component is opened relative to its parent's
descriptor with ``O_NOFOLLOW`` (``openat``), and every directory is checked before use:
owned by this user (or, with ``group_shared``, by one of its groups) and writable by no
one else. Files are opened ``O_NONBLOCK`` and checked to be regular by ``fstat`` before a
byte is read, so a FIFO never blocks. What the package creates is private (0700 / 0600)
unless the store is group-shared (0770 / 0660). :func:`publish` is THE atomic publish.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .jobs import current_job
from .liveness import process_alive, this_process

__all__ = [
    "Perms",
    "UnsafePath",
    "clean_temps",
    "open_dir",
    "open_file",
    "open_root",
    "probe",
    "publish",
    "write_all",
]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_EUID = os.geteuid()  # a process that changes it later is checked the slow way


class UnsafePath(OSError):
    """A path the package must not use: a symlink, not the expected file type, or owned or
    writable by another user."""


@dataclass(frozen=True)
class Perms:
    """Who may own and write what the package uses: this user (default) or its groups."""

    group_shared: bool = False

    @property
    def dir_mode(self) -> int:
        return 0o770 if self.group_shared else 0o700

    @property
    def file_mode(self) -> int:
        return 0o660 if self.group_shared else 0o600

    def check(self, st: os.stat_result, what: str) -> None:
        """:class:`UnsafePath` unless ``st`` is a directory this store may trust."""
        if st.st_uid == _EUID and not st.st_mode & (0o002 if self.group_shared else 0o022):
            return  # the common case, without a system call
        mine = st.st_uid == os.geteuid()
        ours = self.group_shared and st.st_gid in {os.getegid(), *os.getgroups()}
        if not (mine or ours) or st.st_mode & (0o002 if self.group_shared else 0o022):
            raise UnsafePath(
                errno.EPERM,
                f"{what}: expected a directory owned by uid {os.geteuid()}"
                f"{' or its groups' if self.group_shared else ''} and writable by no one else, "
                f"found uid {st.st_uid} gid {st.st_gid} mode {stat.S_IMODE(st.st_mode):04o}",
            )


def open_root(path: str, perms: Perms) -> int:
    """The operator's root directory (symlinks in its path followed), created 0700 when
    missing. One that others may write must be sticky (as /tmp), so that no one else can
    rename or remove what the store creates in it."""
    with contextlib.suppress(FileExistsError):
        os.makedirs(path, perms.dir_mode)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if mode & 0o002 and not mode & stat.S_ISVTX:
        os.close(fd)
        raise UnsafePath(
            errno.EPERM,
            f"root: {path!r} is writable by every user and not sticky (mode "
            f"{stat.S_IMODE(mode):04o}); expected a private directory or chmod +t",
        )
    return fd


def probe(root: int, direct: bool) -> bool:
    """Prove ``root`` writable (a probe file made and removed): ``OSError`` if not; whether
    an aligned O_DIRECT write works there (the file system may refuse it: then False)."""
    name = f".ckv-probe-{os.getpid()}-{secrets.token_hex(6)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags | (_O_DIRECT if direct else 0), 0o600, dir_fd=root)
    except OSError as error:
        if direct and error.errno == errno.EINVAL:  # no O_DIRECT here: buffered
            return probe(root, False)
        raise OSError(error.errno, f"expected a writable directory; {error.strerror}") from None
    try:
        if direct:
            os.pwrite(fd, mmap.mmap(-1, 4096), 0)  # page aligned, as every direct write is
        return direct
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(name, dir_fd=root)


def open_dir(
    parent: int,
    name: str,
    perms: Perms,
    *,
    create: bool = False,
    sync: bool = False,
    what: str = "",
) -> int | None:
    """Directory ``name`` of ``parent`` (a descriptor), never through a symlink, checked;
    None when missing, unless ``create`` (then ``sync`` makes the new entry durable)."""
    what, created = what or name, False
    try:
        try:
            fd = os.open(name, _DIR, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return None
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, perms.dir_mode, dir_fd=parent)
                created = True
            fd = os.open(name, _DIR, dir_fd=parent)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise UnsafePath(
            error.errno, f"{what}: expected a directory, found a symlink or file"
        ) from None
    try:
        if created and perms.group_shared:
            os.fchmod(fd, perms.dir_mode)  # the umask would drop group write
        perms.check(os.fstat(fd), what)
        if created and sync:
            os.fsync(parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(parent: int, name: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """A regular file of ``parent`` and its stat: no symlink followed, no FIFO waited for
    (``O_NONBLOCK``), :class:`UnsafePath` for anything but a regular file."""
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags | getattr(os, "O_NOATIME", 0), dir_fd=parent)
    except PermissionError:  # O_NOATIME needs ownership
        fd = os.open(name, flags, dir_fd=parent)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise UnsafePath(error.errno, f"{name}: a symlink") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePath(errno.EINVAL, f"{name}: not a regular file")
    return fd, st


def write_all(
    fd: int, parts: Sequence[Any], hook: Callable[[int], None] | None = None, chunk: int = 64 << 20
) -> int:
    """Write ``parts`` (buffers) with ``writev``, at most ``chunk`` bytes a call (a stuck
    syscall stays bounded); ``hook(bytes written)`` after each call."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    written = 0
    while views:
        batch, size = [], 0
        for view in views:
            if size < chunk:
                batch.append(view[: chunk - size])
                size += len(batch[-1])
        n = os.writev(fd, batch)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        written += n
        while n:
            head = len(views[0])
            views[0:1] = [] if n >= head else [views[0][n:]]
            n = max(0, n - head)
        if hook is not None:
            hook(written)
    return written


def publish(
    parent: int,
    name: str,
    parts: Sequence[Any] | Callable[[int, str], None],
    *,
    tmp: int,
    perms: Perms,
    replace: bool = False,
    fsync: bool = True,
) -> bool:
    """Atomically make ``name`` in directory ``parent`` hold ``parts``; False if not done.

    The bytes go to a temp file in ``tmp`` (a directory of the same file system; its
    name says who writes it, for :func:`clean_temps`), are synced (``fsync``), then
    linked to ``name``: ``link`` when not ``replace`` (the first writer wins, a loser gets
    False), else ``rename``; ``parent`` is synced after. A name so only ever holds a whole
    file, even after SIGKILL or power loss. ``parts`` may be a writer ``write(fd, temp
    name)``. Inside a job the link is claimed (:mod:`.jobs`): an expired job publishes
    nothing. Descriptors only: nothing follows a symlink.
    """
    pidns, pid, ticks = this_process()
    temp = f"{pidns}-{pid}-{ticks}-{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, perms.file_mode, dir_fd=tmp)
    try:
        try:
            if perms.group_shared:
                os.fchmod(fd, perms.file_mode)  # the umask would drop group write
            parts(fd, temp) if callable(parts) else write_all(fd, parts)
            if fsync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        job = current_job()
        if not job.claim():
            return False
        try:
            if replace:
                os.rename(temp, name, src_dir_fd=tmp, dst_dir_fd=parent)
            else:
                os.link(temp, name, src_dir_fd=tmp, dst_dir_fd=parent, follow_symlinks=False)
        except FileExistsError:
            return False
        finally:
            job.release()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=tmp)
    if fsync:
        os.fsync(parent)
    return True


def clean_temps(tmp: int, stale_s: float, *, dry_run: bool = False) -> int:
    """Remove the files in ``tmp`` whose writer is dead, or unknown (another pid
    namespace) and older than ``stale_s``; the count. Never follows a symlink."""
    removed, now = 0, time.time()
    for entry in os.scandir(tmp):
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(entry.name, dir_fd=tmp, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                continue
            try:  # <pid ns>-<pid>-<start ticks>-<random>.tmp; anything else is not ours
                pidns, pid, ticks, _ = entry.name.removesuffix(".tmp").split("-")
                alive = process_alive((int(pidns), int(pid), int(ticks)))
            except ValueError:
                alive = False
            if alive is False or (alive is None and now - st.st_mtime > stale_s):
                if not dry_run:
                    os.unlink(entry.name, dir_fd=tmp)
                removed += 1
    return removed
