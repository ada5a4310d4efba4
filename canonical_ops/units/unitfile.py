"""Unit files: found by descriptors and checked (``store verify|gc``, FileStore's index),
read and written in native batches (:mod:`canonical_ops._unitio`, without the GIL).

A batch item names a unit by its fan-out directory's descriptor, key digest and file
name, and carries the header the unit must have: the native side walks below the fan-out
with ``O_NOFOLLOW`` and owner/mode checks and reports one status per item.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from . import unit as _unit
from .fsutil import Perms, open_dir
from .namespace import StoreNamespace
from .tier import LoadReq
from .unit import MAX_HEADER_BYTES, CorruptUnit, PayloadVerifier, UnitHeader, key_digest

__all__ = ["Found", "check_unit", "header_problem", "iter_units", "load_item", "mac", "quarantine"]

UNIT_NAME = re.compile(r"(\d{1,6})-(\d{1,6})\.ckv")


class Found(NamedTuple):
    """An entry of the key directories: a unit (``first >= 0``) or a ``problem``."""

    kd: str
    dir_fd: int
    name: str
    first: int = -1
    end: int = -1
    problem: str = ""


def iter_units(ns_fd: int, perms: Perms) -> Iterator[Found]:
    """Every entry of a namespace's key directories, by descriptors (each ``dir_fd`` is
    open until the next item); what does not belong there comes with a problem."""
    for fanout in sorted(n for n in os.listdir(ns_fd) if re.fullmatch(r"[0-9a-f]{2}", n)):
        try:
            fan = open_dir(ns_fd, fanout, perms)
        except OSError:
            fan = None  # a symlink or another user's directory: never walked
        if fan is None:
            continue
        try:
            for kd in sorted(os.listdir(fan)):
                try:
                    ok = re.fullmatch(fanout + "[0-9a-f]{30}", kd)
                    fd = open_dir(fan, kd, perms) if ok else None
                except OSError:
                    fd = None
                if fd is None:
                    yield Found(kd, -1, f"{fanout}/{kd}", problem="not a key directory")
                    continue
                try:
                    for name in sorted(os.listdir(fd)):
                        m = UNIT_NAME.fullmatch(name)
                        if m is None:
                            yield Found(kd, fd, name, problem="not a unit file name")
                        else:
                            yield Found(kd, fd, name, int(m[1]), int(m[2]))
                finally:
                    os.close(fd)
        finally:
            os.close(fan)


def check_unit(
    fd: int,
    size: int,
    namespace: StoreNamespace | None,
    found: Found,
    *,
    digest: bytes = b"",
    full: bool = False,
) -> UnitHeader:
    """Check an open unit file of ``size`` bytes: header (against ``namespace``, or only
    its ``digest`` when unknown), placement, size and, if ``full``, the checksum, in
    bounded memory. ``CorruptUnit`` when it must not be used."""
    raw = os.pread(fd, MAX_HEADER_BYTES, 0)
    if namespace is not None:
        header = _unit.decode_header(raw, namespace=namespace)
    elif (header := _unit.peek_header(raw)).namespace_digest != digest:
        raise CorruptUnit("unit of another namespace")
    if (header.first_layer, header.end_layer) != (found.first, found.end):
        raise CorruptUnit(
            f"header layers [{header.first_layer}, {header.end_layer}) do not match the file "
            f"name {found.name}"
        )
    if key_digest(header.key) != found.kd:
        raise CorruptUnit("header key does not match its key directory")
    if size != header.total_length:
        what = "truncated" if size < header.total_length else "extended"
        raise CorruptUnit(f"{what}: {size} bytes, header says {header.total_length}")
    if full:
        verifier, offset = PayloadVerifier(header), header.header_length
        while offset < size:
            piece = os.pread(fd, min(8 << 20, size - offset), offset)
            if not piece:
                raise CorruptUnit("file shrank while read")
            verifier.update(piece)
            offset += len(piece)
        verifier.finish()
    return header


def mac(namespace: StoreNamespace) -> Any:
    """None (XXH3, hashed natively) or a fresh MAC of an authenticated namespace (hashed
    through Python: HMAC-SHA256 stays with OpenSSL)."""
    return _unit.new_hasher(namespace) if namespace.key_id else None


def load_item(ns: StoreNamespace, req: LoadReq, first: int, end: int, fan: int) -> tuple:
    """The native load of unit ``[first, end)`` for ``req``: where it is, the header it must
    have and which part of its payload goes to which part of the destination."""
    head = _unit.packed_header(ns, req.raw_key, first, end, 0)  # req and entry: checked
    if (req.first, req.end) == (first, end):  # the usual case: the whole unit is wanted
        lo, hi, dest = 0, len(req.dest), req.dest
    else:
        a, b = max(req.first, first), min(req.end, end)
        offsets = ns.payload_offsets(first, end)
        lo, hi = offsets[a - first], offsets[b - first]
        base = ns.layer_bytes(req.first, a) if a > req.first else 0
        dest = req.dest[base : base + hi - lo]
    return (fan, req.kd, f"{first}-{end}.ckv", head, dest, lo, hi, mac(ns))


def header_problem(head: bytes, ns: StoreNamespace, key: bytes, first: int) -> str:
    """Why a header read does not match the one expected (as :func:`decode_header` says)."""
    try:
        _unit.decode_header(head, namespace=ns, key=key, first=first)
    except CorruptUnit as error:
        return error.reason
    return "header does not match the unit's"


def quarantine(qdir: int, parent: int, found: Found, ident: Any, limit: int) -> bool:
    """Move bad unit ``found`` of directory ``parent`` into ``qdir``, only if its name still
    names it (``ident``: the bad file's (st_dev, st_ino), when known: another file there,
    a good unit published since, is linked back); removed instead when ``qdir`` holds
    ``limit`` files. Whether it is kept there."""
    target = f"{found.kd}-{time.time_ns()}-{secrets.token_hex(4)}-{found.name}"
    keep = len(os.listdir(qdir)) < limit
    os.rename(found.name, target, src_dir_fd=parent, dst_dir_fd=qdir)
    moved = os.stat(target, dir_fd=qdir, follow_symlinks=False)
    if ident is not None and (moved.st_dev, moved.st_ino) != ident:
        with contextlib.suppress(FileExistsError):
            # the file itself, never what it may point to (a symlink swapped in: linkat
            # without AT_SYMLINK_FOLLOW links the symlink, not its target)
            os.link(target, found.name, src_dir_fd=qdir, dst_dir_fd=parent, follow_symlinks=False)
        keep = False
    if not keep:  # full: the first few are kept for post-mortems
        os.unlink(target, dir_fd=qdir)
    return keep
