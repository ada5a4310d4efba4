"""Directories and files that no symlink, FIFO or other local user can turn against us.

Below the operator's root every path component is opened relative to its parent's
descriptor with ``O_NOFOLLOW`` (``openat``) and every directory checked before use: owned by
this user (or, ``group_shared``, one of its groups) and writable by no one else. Files are
opened ``O_NONBLOCK`` and checked regular by ``fstat`` before a byte is read (a FIFO never
blocks). What the package creates is 0700 / 0600 (group-shared: 0770 / 0660).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass

from layouts.cli import escape_text

from .jobs import current_job
from .liveness import process_alive, this_process

__all__ = [
    "Dirs",
    "Perms",
    "StoreRootError",
    "UnsafePath",
    "clean_temps",
    "make_dirs",
    "open_dir",
    "open_file",
    "open_root",
    "open_tree",
    "probe",
    "replace_file",
    "temp_prefix",
]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_EUID = os.geteuid()  # a process that changes it later is checked the slow way


class UnsafePath(OSError):
    """A path the package must not use: a symlink, not the expected file type, or owned or
    writable by another user."""


class StoreRootError(OSError):
    """The root or a directory in it is not a writable directory, or is unsafe."""


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

    @property
    def forbidden(self) -> int:
        """Mode bits no one else may have on a directory the store trusts."""
        return 0o002 if self.group_shared else 0o022

    def native(self) -> tuple:
        """What :mod:`canonical_ops._unitio` checks directories and creates with."""
        groups = tuple({os.getegid(), *os.getgroups()}) if self.group_shared else ()
        shared = self.group_shared
        return os.geteuid(), self.forbidden, groups, self.dir_mode, self.file_mode, shared

    def check(self, st: os.stat_result, what: str) -> None:
        """:class:`UnsafePath` unless ``st`` is a directory this store may trust."""
        if st.st_uid == _EUID and not st.st_mode & (self.forbidden | 0o020):
            return  # the common case, without a system call
        mine = st.st_uid == os.geteuid()
        ours = self.group_shared and st.st_gid in {os.getegid(), *os.getgroups()}
        # group_shared: group write is trusted only for one of our groups, not any group
        strangers = st.st_mode & self.forbidden or (st.st_mode & 0o020 and not ours)
        if not (mine or ours) or strangers:
            raise UnsafePath(
                errno.EPERM,
                f"{what}: expected a directory owned by uid {os.geteuid()}"
                f"{' or its groups' if self.group_shared else ''} and writable by no one else, "
                f"found uid {st.st_uid} gid {st.st_gid} mode {stat.S_IMODE(st.st_mode):04o}",
            )


def make_dirs(path: str, mode: int) -> None:
    """Create ``path`` and its missing parents, each with exactly ``mode`` (past the umask:
    ``os.makedirs`` would leave the parents it makes readable by everyone)."""
    missing, parent = [], os.path.abspath(path)
    while not os.path.lexists(parent):
        missing.append(os.path.basename(parent))
        parent = os.path.dirname(parent)
    if not missing:
        return
    # The existing part is the operator's path (followed); each directory made is made and
    # chmod-ed through its parent's descriptor, so no swapped parent redirects the chmod.
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in reversed(missing):
            made = True
            try:
                os.mkdir(name, mode, dir_fd=fd)
            except FileExistsError:
                made = False
            sub = os.open(name, _DIR, dir_fd=fd)
            os.close(fd)
            fd = sub
            if made:
                if os.fstat(fd).st_uid != os.geteuid():  # swapped since made
                    raise UnsafePath(errno.EPERM, f"{path!r}: {name!r} replaced while being made")
                os.fchmod(fd, mode)
    finally:
        os.close(fd)


def open_root(path: str, perms: Perms) -> int:
    """The operator's root directory (symlinks in its path followed), created with its
    missing parents 0700 (group_shared: 0770) when missing. One that others may write must
    be sticky (as /tmp), so that no one else can rename or remove what the store creates."""
    make_dirs(path, perms.dir_mode)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return _checked_root(fd, path, perms, owner=False)


def open_tree(path: str, perms: Perms) -> int:
    """An existing root for a tool that walks and cleans it (``store gc``): as
    :func:`open_root`, and neither a symlink itself (the parents are followed) nor another
    user's (this user's or root's; group_shared: or one of its groups')."""
    try:
        fd = os.open(path, _DIR)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise UnsafePath(error.errno, f"root: {path!r} is a symlink or not a directory") from None
    return _checked_root(fd, path, perms, owner=True)


def _checked_root(fd: int, path: str, perms: Perms, *, owner: bool) -> int:
    """``fd`` once its directory passes :func:`_check_root` (closed, and the error raised,
    when it does not)."""
    try:
        _check_root(os.fstat(fd), path, perms, owner=owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_root(st: os.stat_result, path: str, perms: Perms, *, owner: bool) -> None:
    mode, groups = st.st_mode, {os.getegid(), *os.getgroups()} if perms.group_shared else ()
    if owner and st.st_uid not in (0, os.geteuid()) and st.st_gid not in groups:
        raise UnsafePath(
            errno.EPERM, f"root: {path!r} is another user's directory (uid {st.st_uid})"
        )
    if mode & 0o002 and not mode & stat.S_ISVTX:
        raise UnsafePath(
            errno.EPERM,
            f"root: {path!r} is writable by every user and not sticky (mode "
            f"{stat.S_IMODE(mode):04o}); expected a private directory or chmod +t",
        )


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
    parent: int | None,
    name: str,
    perms: Perms,
    *,
    create: bool = False,
    sync: bool = False,
    what: str = "",
) -> int | None:
    """Directory ``name`` of ``parent`` (a descriptor), never through a symlink, checked;
    None when missing (or ``parent`` is: never the working directory), unless ``create``
    (then ``sync`` makes the new entry durable)."""
    if parent is None:
        return None
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


class Dirs:
    """A store's directories by descriptor: the root (``root_fd``), the namespace directory
    ``name`` in it ("ns") and its subdirectories ("tmp", "quarantine", fan-outs "3f"),
    each opened (or made, ``sync``: durably) safely once and kept until :meth:`close`."""

    def __init__(self, root_fd: int, path: str, name: str, perms: Perms, sync: bool) -> None:
        self.path, self.perms, self.sync = path, perms, sync
        self._name, self._fds, self._lock = name, {"root": root_fd}, threading.Lock()

    def get(self, name: str, *, create: bool = False) -> int | None:
        """Directory ``name``; None when missing (made only with ``create``);
        :class:`StoreRootError` when unsafe."""
        if (fd := self._fds.get(name)) is not None:
            return fd
        parent = self._fds["root"] if name == "ns" else self.get("ns", create=create)
        with self._lock:
            if parent is None or name in self._fds:
                return self._fds.get(name)
            sub, what = (self._name, self.path) if name == "ns" else (name, f"{self.path}/{name}")
            what = escape_text(what)  # the root is the operator's: never raw in a message
            try:
                fd = open_dir(parent, sub, self.perms, create=create, sync=self.sync, what=what)
            except UnsafePath as error:
                raise StoreRootError(error.errno, error.strerror) from None
            if fd is not None:
                self._fds[name] = fd
            return fd

    def fan(self, kd: str) -> int:
        """Key digest ``kd``'s fan-out directory, or -1 when missing or unsafe."""
        if (fd := self._fds.get(kd[:2])) is not None:  # the hot path: opened before
            return fd
        try:
            fd = self.get(kd[:2])
        except StoreRootError:
            return -1
        return -1 if fd is None else fd

    def keydir(self, kd: str, *, create: bool = False) -> int | None:
        """A key's directory (the caller closes it); None when missing."""
        if (fan := self.get(kd[:2], create=create)) is None:
            return None
        return open_dir(fan, kd, self.perms, create=create, sync=self.sync)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def open_file(
    parent: int | None, name: str, flags: int = os.O_RDONLY
) -> tuple[int, os.stat_result]:
    """A regular file of ``parent`` and its stat: no symlink followed, no FIFO waited for
    (``O_NONBLOCK``), :class:`UnsafePath` for anything but a regular file; a missing
    ``parent`` is a missing file (never one of the working directory)."""
    if parent is None:
        raise FileNotFoundError(errno.ENOENT, f"{name}: its directory is missing")
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


def replace_file(
    parent: int, name: str, data: bytes, *, tmp: int, perms: Perms, sync: bool = True
) -> bool:
    """Atomically make ``name`` in ``parent`` hold ``data`` (a small file such as
    ``namespace.json``; a FIFO or link there too): a temp in ``tmp`` renamed over it under
    the job's claim, so it only ever holds a whole file; ``sync``: the temp synced before
    and ``parent`` after (a store without fsync skips both: a crash may leave it empty, and
    the next writer replaces it). False if not done (expired)."""
    temp = f"{temp_prefix()}{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, perms.file_mode, dir_fd=tmp)
    try:
        try:
            if perms.group_shared:
                os.fchmod(fd, perms.file_mode)  # the umask would drop group write
            view = memoryview(data)
            while view:  # a short write is followed by the one that says why (EFBIG, ...)
                view = view[os.write(fd, view) :]
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        job = current_job()
        if not job.claim():
            return False
        try:
            os.rename(temp, name, src_dir_fd=tmp, dst_dir_fd=parent)
        finally:
            job.release()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=tmp)
    if sync:
        os.fsync(parent)
    return True


_prefix: tuple[int, str] = (-1, "")


def temp_prefix() -> str:
    """``<pid ns>-<pid>-<start ticks>-``: how a temp file names its writer (+ random, .tmp)."""
    global _prefix
    if _prefix[0] != os.getpid():
        _prefix = (os.getpid(), "{}-{}-{}-".format(*this_process()))
    return _prefix[1]


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
