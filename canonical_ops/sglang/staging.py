"""Assembling a unit from the shares of several TP ranks: each writer rank stores its share as
a *fragment unit* in a private :class:`~canonical_ops.units.FileStore`; the rank that finds every
share loads them (verified), places them with the kernel and publishes the unit."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from layouts import RankContext

from ..checks import check_seconds
from ..units import FileStore, ModelIdentity, StoreNamespace
from ..units.fsutil import Perms, make_dirs
from .pages import HostPageCodec

__all__ = ["FragmentStaging", "default_staging_dir", "private_directory"]

_FRAGMENT_MODEL = "canonical-kv.sglang.fragment"
SHM_DIR = "/dev/shm"


def default_staging_dir() -> str:
    """``/dev/shm/canonical-kv-<uid>`` (in the temp directory where there is no /dev/shm)."""
    base = SHM_DIR if os.path.isdir(SHM_DIR) else tempfile.gettempdir()
    return os.path.join(base, f"canonical-kv-{os.geteuid()}")


def private_directory(path: str) -> str:
    """``path`` as a directory only this user can write (created 0700 when missing): refused
    (:class:`~canonical_ops.units.fsutil.UnsafePath`) when a symlink, not a directory, another
    user's or writable by group or others, as someone who made it first could plant shares."""
    make_dirs(path, 0o700)
    Perms().check(os.lstat(path), repr(path))
    return path


class FragmentStaging:
    """One TP group's shares of the units of ``namespace``, in ``directory`` (shared by the
    group's ranks: node-local for a one-node group; checked by :func:`private_directory`).
    ``codec`` is the rank's pages; shares unused for ``stale_s`` go at :meth:`sweep`."""

    def __init__(
        self,
        directory: str,
        namespace: StoreNamespace,
        codec: HostPageCodec,
        *,
        stale_s: float = 600,
    ) -> None:
        self.stale_s, self.ranks = check_seconds("stale_s", stale_s), codec.writer_ranks()
        directory = private_directory(os.path.abspath(directory))
        tp, layers = codec.tp_size, namespace.num_layers
        identity = ModelIdentity(_FRAGMENT_MODEL, "", {"units": namespace.hex, "tp": tp})
        self.namespace = StoreNamespace.from_specs(
            identity,
            [None] * layers,
            RankContext(1, 1, 0),
            fallback_page_sizes=[codec.local_page_bytes] * layers,
            fallback_layouts=["a writer rank's share of a page of the 'units' namespace"] * layers,
            block_size=codec.page_size,
        )
        # Fragments live seconds and are re-made by the next store: no fsync.
        self.store = FileStore(directory, self.namespace, fsync=False, threads=1)

    @staticmethod
    def key(key: bytes, rank: int) -> bytes:
        """The fragment key of ``rank``'s share of unit ``key``."""
        return hashlib.sha256(b"%s:%d" % (key, rank)).digest()

    def put(self, items: Sequence[tuple[bytes, int, int, int, Any]]) -> list[bool]:
        """Store shares ``(key, rank, first, end, payload)``; whether each was stored."""
        batch = [(self.key(k, r), first, p, 0, end) for k, r, first, end, p in items]
        job = self.store.stores(batch)
        return [o.status == "ok" for o in job.value or [job] * len(batch)]

    def complete(self, key: bytes, first: int, end: int) -> bool:
        """Whether every writer rank stored its share of the unit."""
        shares = [self.key(key, rank) for rank in self.ranks]
        return self.store.lookup(shares, first, end) == len(shares)

    def get(self, key: bytes, rank: int, first: int, end: int, destination: Any) -> str:
        """Load ``rank``'s share into ``destination``; the load's status (``"ok"``: verified)."""
        return self.store.load(self.key(key, rank), first, end, destination).status

    def discard(self, keys: Sequence[bytes], first: int, end: int) -> None:
        """Remove every writer's shares of these units (published)."""
        self.store.remove([self.key(k, rank) for k in keys for rank in self.ranks], first, end)

    def sweep(self) -> int:
        """Remove fragments unused for ``stale_s`` (of units that never completed)."""
        return self.store.gc(idle_s=self.stale_s).units_evicted

    def close(self) -> None:
        self.store.close()
