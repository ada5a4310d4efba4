"""Verified loads (issue 30 item 4): whatever path a load takes (RWF_NOWAIT pieces from the
page cache, or a device read into the batch's buffer hashed and streamed on a 4 KiB block at a
time, buffered or O_DIRECT; a batch's later units asked for ahead), a byte flipped on disk, a unit rewritten or truncated by another
process, a unit read again after its page-cache pages were dropped: each is a miss
(quarantined), never a load. And the streamed copies land exactly, at any alignment."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers.store import child_env, row, small_namespace, unit_files

from canonical_ops.units import FileStore
from canonical_ops.units import files as files_mod
from canonical_ops.units.unit import key_digest

# 64 layers of 16 KiB: a 1 MiB payload, many 4 KiB blocks and four 256 KiB pieces.
NS = small_namespace(64, head_size=64, block_size=16)
HEADER_BYTES = 104  # 96 + an 8-byte integer key (checked below): blocks off page bounds


def stages(monkeypatch, action=None) -> list[str]:
    """Record the native hook's stages; ``action(stage, path)`` runs at each."""
    seen: list[str] = []

    def hook(stage: str, path: str, n: int) -> None:
        seen.append(stage)
        if action is not None:
            action(stage, path)

    monkeypatch.setattr(files_mod, "_test_hook", hook)
    return seen


def warm(path: str) -> None:
    with open(path, "rb") as f:
        f.read()


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def flip(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ 0x5A]), offset)
    finally:
        os.close(fd)


def in_another_process(code: str, *args: str) -> None:
    subprocess.run([sys.executable, "-c", code, *args], check=True, env=child_env(), timeout=60)


FLIP = "import os,sys; fd=os.open(sys.argv[1],os.O_RDWR); o=int(sys.argv[2]); "
FLIP += "os.pwrite(fd,bytes([os.pread(fd,1,o)[0]^0x5A]),o)"
TRUNCATE = "import os,sys; os.truncate(sys.argv[1], int(sys.argv[2]))"


def stored(tmp_path, **options) -> tuple[FileStore, str]:
    store = FileStore(tmp_path, NS, fsync=False, **options)
    assert store.store(7, 0, row(NS, 7), 0).ok
    (path,) = unit_files(store)
    assert os.path.getsize(path) == HEADER_BYTES + NS.total_bytes
    return store, path


def is_a_miss(store: FileStore, first: int = 0, end: int = 64) -> bool:
    """The load is a miss (not ok, not an error) and the unit was quarantined."""
    dest = np.zeros(NS.layer_bytes(first, end), np.uint8)
    job = store.load(7, first, end, dest)
    return job.status == "miss" and not unit_files(store) and store.metrics().quarantined == 1


# ---------------------------------------------------------------------- the paths load right


@pytest.mark.parametrize("shift", [0, 1, 3, 60], ids=lambda s: f"dest+{s}")
@pytest.mark.parametrize("layers", [(0, 64), (1, 63), (17, 18)], ids=lambda r: f"{r[0]}-{r[1]}")
@pytest.mark.parametrize("path", ["page cache", "device", "O_DIRECT"])
def test_loads_land_exactly_at_any_alignment(tmp_path, monkeypatch, path, layers, shift):
    """Whole or partial ranges, into destinations at any alignment (the streamed copy's
    head and tail): exactly the stored bytes, and nothing around them."""
    first, end = layers
    store, unit = stored(tmp_path, direct_io=path == "O_DIRECT")
    with store:
        (warm if path == "page cache" else drop_cache)(unit)
        seen = stages(monkeypatch)
        backing = np.full(NS.layer_bytes(first, end) + 64, 0xEE, np.uint8)
        dest = backing[shift : shift + NS.layer_bytes(first, end)]
        assert store.load(7, first, end, dest).ok
        assert np.array_equal(dest, row(NS, 7, first, end))
        assert (backing[:shift] == 0xEE).all() and (backing[shift + dest.size :] == 0xEE).all()
        # From the page cache a piece not wanted whole goes through the buffer too.
        assert "read" in seen if path != "page cache" else layers != (0, 64) or seen == []


@pytest.mark.parametrize("state", ["cold", "warm", "direct_io"])
def test_a_batch_asks_for_its_later_units_ahead_of_their_reads(tmp_path, monkeypatch, state):
    """Buffered loads of units the page cache does not hold: the batch asks for the next
    16 MiB of units (WILLNEED) before it reads the first, and the rest as it goes, so the
    device reads them while earlier ones are hashed and copied; none for units all cached,
    none with direct_io (read O_DIRECT). Every unit loads right."""
    store = FileStore(tmp_path, NS, fsync=False, direct_io=state == "direct_io")
    with store:
        for key in range(20):  # 1 MiB payloads: 16 fit the window
            assert store.store(key, 0, row(NS, key), 0).ok
        paths = unit_files(store)
        for path in paths:
            (warm if state == "warm" else drop_cache)(path)
        seen: list[tuple[str, str]] = []
        stages(monkeypatch, lambda stage, path: seen.append((stage, path)))
        dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(20)]
        job = store.loads([(key, 0, 64, dest) for key, dest in zip(range(20), dests)])
        assert job.ok and all(np.array_equal(d, row(NS, k)) for k, d in enumerate(dests))
        asked = [path for stage, path in seen if stage == "prefetch"]
        if state != "cold":
            assert asked == []
            return
        by_key = {key: store_path(store, key) for key in range(20)}
        assert sorted(by_key.values()) == sorted(paths)
        assert asked == [by_key[key] for key in range(1, 20)]  # each once, in batch order
        first_read = next(i for i, (stage, _) in enumerate(seen) if stage == "read")
        assert seen[:first_read] == [("prefetch", by_key[key]) for key in range(1, 17)]


def test_a_unit_with_holes_in_the_page_cache_loads_right(tmp_path, monkeypatch):
    """Pieces 0, 2 and 4 of a unit are in the page cache, 1 and 3 are not: the cached ones
    come from there, the others are read through the buffer (each alone, at its own piece:
    never the rest of the unit at once) or, when the unit's WILLNEED brought them in first,
    from the page cache too. Right bytes either way."""
    store, path = stored(tmp_path)
    piece = 256 << 10
    with store:
        drop_cache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead into the holes
            for k in (0, 2, 4):
                os.pread(fd, piece, k * piece)
        finally:
            os.close(fd)
        reads: list[int] = []
        monkeypatch.setattr(
            files_mod, "_test_hook", lambda stage, p, n: stage == "read" and reads.append(n)
        )
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(7, 0, 64, dest).ok and np.array_equal(dest, row(NS, 7))
        assert set(reads) <= {piece, 3 * piece} and len(reads) == len(set(reads))


def store_path(store: FileStore, key: int) -> str:
    """The file of ``key``'s unit of every layer."""
    kd = key_digest(key)
    return os.path.join(store.directory, kd[:2], kd, "0-64.ckv")


# ---------------------------------------------------------------------- a shortcut keeps the guarantee


@pytest.mark.parametrize("where", ["header", "first block", "mid", "last byte"])
def test_a_byte_flipped_on_disk_is_a_miss_from_the_page_cache(tmp_path, monkeypatch, where):
    offset = {"header": 5, "first block": HEADER_BYTES, "mid": 300_000}.get(
        where, HEADER_BYTES + NS.total_bytes - 1
    )
    store, path = stored(tmp_path)
    with store:
        flip(path, offset)
        warm(path)
        seen = stages(monkeypatch)
        assert is_a_miss(store) and seen == []  # RWF_NOWAIT: from the page cache


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
def test_a_byte_flipped_then_read_again_from_the_device_is_a_miss(tmp_path, monkeypatch, direct):
    """The unit's pages were dropped from the page cache (after a load from it) and read
    again, a byte flipped meanwhile: the device's bytes are verified too."""
    store, path = stored(tmp_path, direct_io=direct)
    with store:
        assert store.load(7, 0, 64, np.zeros(NS.total_bytes, np.uint8)).ok  # warm, fine
        flip(path, HEADER_BYTES + 123_457)
        drop_cache(path)
        seen = stages(monkeypatch)
        assert is_a_miss(store, 2, 5) and "read" in seen


@pytest.mark.parametrize("offset", [5, HEADER_BYTES + 400_000])
def test_a_unit_rewritten_by_another_process_while_read_is_a_miss(tmp_path, monkeypatch, offset):
    """Another process flips a byte of the unit as this one starts reading it from the
    device (after its size and ownership were checked): a miss."""
    store, path = stored(tmp_path)
    with store:
        drop_cache(path)
        flipped = []

        def rewrite(stage: str, p: str) -> None:
            if stage == "read" and not flipped:
                flipped.append(p)
                in_another_process(FLIP, p, str(offset))

        stages(monkeypatch, rewrite)
        assert is_a_miss(store) and flipped == [path]


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
@pytest.mark.parametrize("keep", [0, 100, HEADER_BYTES + 5000, HEADER_BYTES + 300_000])
def test_a_unit_truncated_by_another_process_while_read_is_a_miss(
    tmp_path, monkeypatch, keep, direct
):
    """The unit shrinks between the size check and the read: a short read, a miss, and
    the next unit loads."""
    store, path = stored(tmp_path, direct_io=direct)
    with store:
        assert store.store(8, 0, row(NS, 8), 0).ok
        drop_cache(path)
        cut = lambda stage, p: p == path and in_another_process(TRUNCATE, p, str(keep))  # noqa: E731
        stages(monkeypatch, cut)
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(7, 0, 64, dest).status == "miss"
        assert store.load(8, 0, 64, dest).ok and np.array_equal(dest, row(NS, 8))


def test_loads_racing_a_truncating_process_load_right_or_miss(tmp_path):
    """Another process truncates the unit and writes it back, over and over, while this one
    loads it: every load is the stored bytes or a miss; nothing crashes."""
    expected = row(NS, 7)
    with FileStore(tmp_path, NS, fsync=False) as store:
        assert store.store(7, 0, expected, 0).ok
        (path,) = unit_files(store)
        with open(path, "rb") as f:
            original = f.read()
        copy = tmp_path / "original.bin"
        copy.write_bytes(original)
        racer = subprocess.Popen(
            [sys.executable, "-c", RACER, path, str(copy), "2.0"], env=child_env()
        )
        ok = missed = 0
        dest = np.zeros(NS.total_bytes, np.uint8)
        try:
            while racer.poll() is None:
                dest[:] = 0
                job = store.load(7, 0, 64, dest)
                if job.ok:
                    assert np.array_equal(dest, expected)
                    ok += 1
                else:
                    assert job.status == "miss", job.detail
                    missed += 1
                    if not unit_files(store):  # quarantined: put it back for the racer
                        store.store(7, 0, expected, 0)
        finally:
            racer.wait(timeout=30)
        assert racer.returncode == 0 and ok + missed > 20


RACER = """
import os, sys, time
path, original, seconds = sys.argv[1], open(sys.argv[2], "rb").read(), float(sys.argv[3])
end = time.monotonic() + seconds
while time.monotonic() < end:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        time.sleep(0.001)
        continue
    os.ftruncate(fd, len(original) // 3)
    time.sleep(0.0005)
    os.pwrite(fd, original, 0)
    os.close(fd)
    time.sleep(0.0005)
"""
