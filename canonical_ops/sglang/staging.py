"""Assembling whole units from the pages of several TP ranks (one file per rank's share).

A unit is one block's WHOLE canonical pages, but an SGLang rank holds only its
heads and its storage calls run in its own process, with no collective the
backend could use. So each elected writer rank publishes its share (its local
pages of the stage's layers) as a checksummed *fragment* file in a staging
directory the TP group shares, atomically (``tmp`` + ``rename``); whichever
rank then finds every writer's fragment present assembles the unit, verifies
each fragment, and stores it through the tier (first writer wins, so two
assemblers store once). A unit is never published partially: a missing or bad
fragment means no unit, and the tier never sees anything but whole units.

Fragment file (little-endian)::

    magic b"CKVFRAG1" | namespace digest (32) | key (32) | first, end, tp, rank (4 x u32)
    | payload length (u64) | XXH3-128 of the payload (16) | payload

Fragments of units that never completed (a rank crashed, or its write failed)
are removed once older than ``stale_s`` by :meth:`FragmentStaging.sweep`.
"""

from __future__ import annotations

import os
import shutil
import struct
import time
import uuid
from pathlib import Path

import numpy as np
import xxhash

__all__ = ["FRAGMENT_MAGIC", "BadFragment", "FragmentStaging"]

FRAGMENT_MAGIC = b"CKVFRAG1"
_HEADER = struct.Struct("<8s32s32sIIIIQ16s")


class BadFragment(Exception):
    """A fragment file that is missing, truncated, foreign or fails its checksum."""


class FragmentStaging:
    """One TP group's staging directory for one store namespace.

    Parameters
    ----------
    directory : str | os.PathLike
        Shared by every rank of the TP group (node-local for a one-node group,
        e.g. under /dev/shm); created if missing.
    namespace_digest : bytes
        32 bytes: the store namespace the units belong to.
    stale_s : float
        Age after which an incomplete unit's fragments are swept.
    """

    def __init__(
        self, directory: str | os.PathLike, namespace_digest: bytes, *, stale_s: float = 600.0
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"directory: expected a path, got {directory!r}")
        if not isinstance(namespace_digest, bytes) or len(namespace_digest) != 32:
            raise ValueError(f"namespace_digest: expected 32 bytes, got {namespace_digest!r:.80}")
        if not isinstance(stale_s, (int, float)) or stale_s <= 0:
            raise ValueError(f"stale_s: expected a positive number of seconds, got {stale_s!r}")
        self.digest = namespace_digest
        self.root = Path(directory) / namespace_digest.hex()[:32]
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.stale_s = float(stale_s)

    def unit_dir(self, key: bytes, first: int, end: int, tp: int) -> Path:
        return self.root / f"{key.hex()}.{first}-{end}.tp{tp}"

    def put(
        self, key: bytes, first: int, end: int, tp: int, rank: int, payload: np.ndarray
    ) -> None:
        """Publish ``rank``'s share of a unit atomically (a whole file or none)."""
        directory = self.unit_dir(key, first, end, tp)
        directory.mkdir(exist_ok=True, mode=0o700)
        data = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
        header = _HEADER.pack(
            FRAGMENT_MAGIC,
            self.digest,
            key,
            first,
            end,
            tp,
            rank,
            data.nbytes,
            xxhash.xxh3_128_digest(data),
        )
        tmp = directory / f".{rank}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(memoryview(data))
            os.replace(tmp, directory / f"r{rank}.frag")
        finally:
            tmp.unlink(missing_ok=True)

    def present(self, key: bytes, first: int, end: int, tp: int, ranks: list[int]) -> bool:
        """Whether every one of ``ranks`` published its fragment."""
        directory = self.unit_dir(key, first, end, tp)
        return all((directory / f"r{rank}.frag").exists() for rank in ranks)

    def get(self, key: bytes, first: int, end: int, tp: int, rank: int, nbytes: int) -> np.ndarray:
        """``rank``'s fragment payload, verified; :class:`BadFragment` otherwise."""
        path = self.unit_dir(key, first, end, tp) / f"r{rank}.frag"
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size != _HEADER.size + nbytes:
                    raise BadFragment(f"{path}: expected {_HEADER.size + nbytes} bytes")
                raw = f.read()
        except OSError as error:
            raise BadFragment(f"{path}: {error}") from None
        magic, digest, fkey, ffirst, fend, ftp, frank, length, checksum = _HEADER.unpack_from(raw)
        if (magic, digest, fkey, ffirst, fend, ftp, frank, length) != (
            FRAGMENT_MAGIC,
            self.digest,
            key,
            first,
            end,
            tp,
            rank,
            nbytes,
        ):
            raise BadFragment(f"{path}: header does not describe this fragment")
        payload = np.frombuffer(raw, dtype=np.uint8, offset=_HEADER.size)
        if xxhash.xxh3_128_digest(payload) != checksum:
            raise BadFragment(f"{path}: checksum mismatch")
        return payload

    def discard(self, key: bytes, first: int, end: int, tp: int) -> None:
        """Remove a unit's fragments (after it was stored, or found stored)."""
        shutil.rmtree(self.unit_dir(key, first, end, tp), ignore_errors=True)

    def sweep(self, now: float | None = None) -> int:
        """Remove incomplete units whose directory is older than ``stale_s``; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return 0
        for entry in entries:
            try:
                if entry.is_dir() and now - entry.stat().st_mtime > self.stale_s:
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed += 1
            except OSError:
                continue
        return removed
