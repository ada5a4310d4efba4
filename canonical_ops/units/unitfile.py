"""One unit file: found by descriptors, checked, read verified, written direct.

The byte-level half of :class:`~.files.FileStore`, also used by ``store verify|gc``.
A read goes piece by piece through an aligned per-thread buffer: each piece is hashed
while in cache and copied into the destination only under the job's claim, so a load
that expired never writes caller memory.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from .fsutil import Perms, open_dir
from .jobs import current_job
from .namespace import StoreNamespace
from .tier import LoadReq, StoreReq
from .unit import (
    MAX_HEADER_BYTES,
    CorruptUnit,
    PayloadVerifier,
    UnitHeader,
    begin_unit_check,
    decode_header,
    header_length,
    key_digest,
    peek_header,
    start_unit,
)

__all__ = ["Found", "aligned_buffers", "check_unit", "iter_units", "read_unit", "write_direct"]

UNIT_NAME = re.compile(r"(\d{1,6})-(\d{1,6})\.ckv")
O_DIRECT = getattr(os, "O_DIRECT", 0)
_LOAD_CHUNK_BYTES = 1 << 20  # read, hashed and copied per piece (bench/bench_read_hash.py)
_ALIGN = 4096  # O_DIRECT offsets, lengths and buffers
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


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
    header = peek_header(raw) if namespace is None else decode_header(raw, namespace=namespace)
    if namespace is None and header.namespace_digest != digest:
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


def aligned_buffers() -> tuple[np.ndarray, np.ndarray]:
    """A page-aligned piece buffer and first-block buffer (anonymous mmaps), as O_DIRECT
    needs. Copies go through numpy, which releases the GIL (a memoryview copy holds it)."""
    size = -(-_LOAD_CHUNK_BYTES // _ALIGN) * _ALIGN
    return (
        np.frombuffer(mmap.mmap(-1, size), np.uint8),
        np.frombuffer(mmap.mmap(-1, _ALIGN), np.uint8),
    )


def read_unit(
    fd: int,
    st: os.stat_result,
    namespace: StoreNamespace,
    req: LoadReq,
    first: int,
    end: int,
    buffers: tuple[np.ndarray, np.ndarray],
    direct: bool,
) -> None:
    """Read unit ``[first, end)`` of ``req``'s key piece by piece into ``buffers``, hash
    each piece while it is in cache and copy what ``req`` wants of it into its destination
    under the job's claim. ``CorruptUnit`` unless intact: the size is checked before a
    byte is read (no length from disk sizes anything), the header with the first piece."""
    head_len = header_length(req.raw_key)
    total = head_len + namespace.layer_bytes(first, end)
    if st.st_size != total:
        raise CorruptUnit(f"size {st.st_size} != {total} bytes expected")
    if (req.first, req.end) == (first, end):  # the usual case: the whole unit is wanted
        want_lo, want_hi, base = 0, total - head_len, 0
    else:
        lo, hi = max(req.first, first), min(req.end, end)
        offsets = namespace.payload_offsets(first, end)
        want_lo, want_hi = offsets[lo - first], offsets[hi - first]  # in this unit's payload
        base = (namespace.layer_bytes(req.first, lo) if lo > req.first else 0) - want_lo
    array, head = buffers
    buf, step = memoryview(array), len(array) if direct else _LOAD_CHUNK_BYTES
    job, dest, offset = current_job(), np.frombuffer(req.dest, np.uint8), 0
    nowait = 0 if direct else _RWF_NOWAIT
    while offset < total:
        n = min(step, total - offset)
        start, at = (head_len, 0) if offset == 0 else (0, offset - head_len)
        a, b = max(want_lo, at), min(want_hi, at + n - start)
        if (
            nowait
            and (a, b) == (at, at + n - start)
            and _cached(fd, head, req.dest, start, base + a, base + b, offset, job)
        ):
            if offset == 0:  # page cache hit: read straight into the destination
                hasher, checksum = _begin(head, head_len, namespace, req, first, end)
            hasher.update(req.dest[base + a : base + b])
            offset += n
            continue
        _read_exactly(fd, buf[: step if direct else n], offset, n)  # may block: never into dest
        if offset == 0:
            hasher, checksum = _begin(buf, head_len, namespace, req, first, end)
        hasher.update(buf[start:n])
        if a < b:
            if not job.claim():
                raise RuntimeError("load expired: its destination is not written")
            dest[base + a : base + b] = array[start + a - at : start + b - at]
            job.release()
        offset += n
    if hasher.digest() != checksum:
        raise CorruptUnit("checksum mismatch")


def _begin(buf, head_len, namespace, req, first, end):
    return begin_unit_check(
        memoryview(buf)[:head_len], namespace=namespace, key=req.raw_key, first=first, end=end
    )


def _cached(fd, head, dest, head_len, lo, hi, offset, job) -> bool:
    """Read one piece straight into the destination (and its header into ``head``) when
    the page cache holds it all: ``RWF_NOWAIT`` never waits for I/O, so this bounded copy
    runs under the job's claim. False (nothing trusted) when it would have to wait."""
    parts = [memoryview(head)[:head_len], dest[lo:hi]] if head_len else [dest[lo:hi]]
    if not job.claim():
        raise RuntimeError("load expired: its destination is not written")
    try:
        return os.preadv(fd, parts, offset, _RWF_NOWAIT) == head_len + hi - lo
    except OSError:  # EAGAIN: not all in the page cache; EOPNOTSUPP: no RWF_NOWAIT here
        return False
    finally:
        job.release()


def write_direct(
    fd: int,
    namespace: StoreNamespace,
    req: StoreReq,
    buffers: tuple[np.ndarray, np.ndarray],
    hook: Callable[[int], None],
) -> None:
    """Write unit ``req`` with O_DIRECT through aligned ``buffers``: each piece copied in,
    hashed while in cache and written; the first block again once the checksum is known."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | O_DIRECT)
    head, hasher = start_unit(namespace, req.raw_key, req.first, req.end, req.position)
    buf, first = buffers
    payload, hl = np.frombuffer(req.payload, np.uint8), len(head)
    total, offset = hl + len(payload), 0
    while offset < total:
        n = min(len(buf), total - offset)
        start = 0 if offset else hl  # the header's place in the first piece
        if offset == 0:
            buf[:hl] = np.frombuffer(head, np.uint8)
        buf[start:n] = payload[offset + start - hl : offset + n - hl]
        hasher.update(buf[start:n])
        padded = -(-n // _ALIGN) * _ALIGN
        buf[n:padded] = 0
        if offset == 0:
            first[:] = buf[:_ALIGN]
        _pwrite_all(fd, memoryview(buf[:padded]), offset)
        offset += n
        hook(offset)
    first[80:96] = np.frombuffer(hasher.digest(), np.uint8)
    _pwrite_all(fd, memoryview(first), 0)
    os.ftruncate(fd, total)


def _read_exactly(fd: int, view: memoryview, offset: int, need: int) -> None:
    got = os.preadv(fd, [view], offset)
    while got < need:  # a regular file reads short only at its end
        if (n := os.preadv(fd, [view[got:]], offset + got)) == 0:
            raise CorruptUnit("short read: the file shrank")
        got += n


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        if (n := os.pwritev(fd, [view], offset)) <= 0:
            raise OSError(5, "write made no progress")  # EIO
        view, offset = view[n:], offset + n
