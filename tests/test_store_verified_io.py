"""Verified loads (issue 30 item 4): whatever path a load takes (RWF_NOWAIT pieces from the
page cache, or a device read into the batch's buffer hashed and streamed on a 4 KiB block at a
time, buffered or O_DIRECT), a byte flipped on disk, a unit rewritten or truncated by another
process, a unit read again after its page-cache pages were dropped: each is a miss
(quarantined), never a load. And the streamed copies land exactly, at any alignment."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers.store import child_env, row, small_namespace, unit_files

from canonical_ops.units import FileStore
from canonical_ops.units import files as files_mod

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
@pytest.mark.parametrize("path", ["page cache", "device", "device buffered", "O_DIRECT"])
def test_loads_land_exactly_at_any_alignment(tmp_path, monkeypatch, path, layers, shift):
    """Whole or partial ranges, into destinations at any alignment (the streamed copy's
    head and tail): exactly the stored bytes, and nothing around them. "device": a unit the
    page cache holds none of (O_DIRECT where the file system allows it); "device buffered":
    the same read through the page cache."""
    first, end = layers
    monkeypatch.setattr(files_mod, "_COLD_DIRECT", path != "device buffered")
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


def cached_pages(path: str) -> int | None:
    """Pages of ``path`` in the page cache (cachestat, Linux 6.5); None where it is missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    span = (ctypes.c_uint64 * 2)(0, os.path.getsize(path))
    stat = (ctypes.c_uint64 * 5)()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, span, stat, 0) != 0:
            return None
    finally:
        os.close(fd)
    return stat[0]


@pytest.mark.parametrize("cold_direct", [True, False], ids=["cold O_DIRECT", "buffered"])
def test_a_unit_none_of_which_is_cached_is_read_past_the_page_cache(
    tmp_path, monkeypatch, cold_direct
):
    """A unit the page cache holds none of is read with O_DIRECT (the device writes the
    aligned buffer, no page-cache page is made for it); one it holds part of, and any unit
    with ``_COLD_DIRECT`` off, through the page cache. Right bytes either way."""
    monkeypatch.setattr(files_mod, "_COLD_DIRECT", cold_direct)
    store, path = stored(tmp_path)
    with store:
        if cached_pages(path) is None:
            pytest.skip("cachestat (Linux 6.5) is missing: every unit is read buffered")
        with FileStore(tmp_path / "probe", NS, fsync=False, direct_io=True) as probe:
            if not probe.direct_io:
                pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT: read buffered")
        dest = np.zeros(NS.total_bytes, np.uint8)
        drop_cache(path)
        assert cached_pages(path) == 0
        assert store.load(7, 0, 64, dest).ok and np.array_equal(dest, row(NS, 7))
        assert (cached_pages(path) == 0) is cold_direct
        drop_cache(path)
        with open(path, "rb") as f:
            f.read(4096)  # part of it cached: read through the page cache, all of it
        dest[:] = 0
        assert store.load(7, 0, 64, dest).ok and np.array_equal(dest, row(NS, 7))
        assert cached_pages(path) == -(-os.path.getsize(path) // 4096)


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


@pytest.mark.parametrize("mode", ["buffered", "cold O_DIRECT", "O_DIRECT"])
def test_a_byte_flipped_then_read_again_from_the_device_is_a_miss(tmp_path, monkeypatch, mode):
    """The unit's pages were dropped from the page cache (after a load from it) and read
    again, a byte flipped meanwhile: the device's bytes are verified too, whichever way
    they are read (buffered, O_DIRECT as a unit none of which is cached, direct_io)."""
    monkeypatch.setattr(files_mod, "_COLD_DIRECT", mode != "buffered")
    store, path = stored(tmp_path, direct_io=mode == "O_DIRECT")
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


@pytest.mark.parametrize("mode", ["buffered", "cold O_DIRECT", "O_DIRECT"])
@pytest.mark.parametrize("keep", [0, 100, HEADER_BYTES + 5000, HEADER_BYTES + 300_000])
def test_a_unit_truncated_by_another_process_while_read_is_a_miss(
    tmp_path, monkeypatch, keep, mode
):
    """The unit shrinks between the size check and the read: a short read, a miss, and
    the next unit loads."""
    monkeypatch.setattr(files_mod, "_COLD_DIRECT", mode != "buffered")
    store, path = stored(tmp_path, direct_io=mode == "O_DIRECT")
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
