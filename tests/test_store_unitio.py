"""canonical_ops._unitio, FileStore's native batch I/O: the claim word, the hash, the statuses
a batch reports, races between writers, and what a hook (a stuck syscall) may and may not see."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import xxhash
from helpers.store import row, small_namespace, unit_files

from canonical_ops import _unitio
from canonical_ops.units import FileStore, StoreSecret
from canonical_ops.units import files as files_mod
from canonical_ops.units.files import key_digest
from canonical_ops.units.fsutil import Perms
from canonical_ops.units.unit import CorruptUnit, decode_and_verify, start_unit

NS = small_namespace(8)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files another owner")


# ---------------------------------------------------------------------- the hash, the claim word


@pytest.mark.parametrize("size", [0, 1, 240, 4096 + 7, (1 << 20) + 3])
def test_xxh3_128_is_the_unit_formats_checksum(size) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert _unitio.xxh3_128(data) == xxhash.xxh3_128(data).digest()


def test_the_state_word_never_lets_a_claim_and_an_expiry_both_win() -> None:
    """A worker claiming in a tight loop, the watchdog expiring: once expire() succeeds no
    claim ever does, and expire() fails while a claim is held."""

    def worker(state, claims, stop) -> None:
        while not stop.is_set():
            if state.claim():
                claims[0] += 1  # "writing caller memory"
                state.release()

    for _ in range(20):
        state, claims, stop = _unitio.JobState(), [0], threading.Event()
        thread = threading.Thread(target=worker, args=(state, claims, stop))
        thread.start()
        time.sleep(0.002)
        while not state.expire():
            pass
        seen = claims[0]
        time.sleep(0.005)
        stop.set()
        thread.join()
        assert claims[0] == seen and state.value == 2 and not state.claim()
    held = _unitio.JobState()
    assert held.claim() and held.claim()  # claimed twice (a detached job's threads): still held
    assert not held.expire() and held.value == 1
    held.release()
    assert held.expire() and held.expire() and not held.claim()


# ---------------------------------------------------------------------- statuses of a load


def native_load(store: FileStore, key, *, fan: int | None = None, header: bytes | None = None):
    """One item through _unitio.load as FileStore builds it; (result, destination)."""
    kd = key_digest(key)
    dest = np.zeros(NS.total_bytes, np.uint8)
    head = header or start_unit(NS, key, 0, 8, 0)[0]
    fan = store._dirs.fan(kd) if fan is None else fan
    item = (fan, kd, "0-8.ckv", head, memoryview(dest), 0, NS.total_bytes, None)
    args = (store._perms.native(), 4096, 4096, True, False, time.time_ns(), 10**18, None)
    [result] = _unitio.load(_unitio.JobState(), [item], *args)
    return result, dest


def test_load_statuses(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False) as store:
        assert store.store(7, 0, row(NS, 7), 3).ok
        (path,) = unit_files(store)
        result, dest = native_load(store, 7)
        assert result[0] == _unitio.OK and np.array_equal(dest, row(NS, 7))
        assert native_load(store, 7, fan=-1)[0][0] == _unitio.MISSING  # no fan-out directory
        assert native_load(store, 8)[0][0] == _unitio.MISSING  # no key directory
        # A unit of another key under this key's name: the header read comes back, with
        # everything after it untouched (nothing trusted from a header that differs).
        wrong = bytearray(start_unit(NS, 7, 0, 8, 0)[0])
        wrong[-1] ^= 1
        (status, _, reason, head, dev, ino), dest = native_load(store, 7, header=bytes(wrong))
        assert status == _unitio.CORRUPT and "header" in reason
        with open(path, "rb") as f:
            assert head == f.read(len(wrong)) and (dev, ino) != (0, 0)
        os.truncate(path, os.path.getsize(path) - 1)
        (status, _, reason, *_), _ = native_load(store, 7)
        assert status == _unitio.CORRUPT and reason.startswith("size ")
        os.unlink(path)
        os.mkfifo(path)
        (status, _, reason, *_), _ = native_load(store, 7)  # never blocks on the FIFO
        assert (status, reason) == (_unitio.UNSAFE_FILE, "not a regular file")
        os.unlink(path)
        os.symlink("/etc/passwd", path)
        (status, _, reason, *_), _ = native_load(store, 7)
        assert (status, reason) == (_unitio.UNSAFE_FILE, "a symlink")


def test_every_forged_header_byte_is_judged_natively_as_decode_header_judges_it(tmp_path):
    """Each header byte changed, its checksum recomputed (so only the field comparisons can
    refuse it): the native load is OK exactly when decode_and_verify accepts the unit (only
    the position may differ: loads do not know it) and never reports another unit loaded."""
    with FileStore(tmp_path, NS, fsync=False) as store:
        assert store.store(7, 0, row(NS, 7), 3).ok
        (path,) = unit_files(store)
        with open(path, "rb") as f:
            good = f.read()
        for offset in range(len(start_unit(NS, 7, 0, 8, 0)[0])):
            if 80 <= offset < 96:
                continue  # the checksum itself
            for value in {good[offset] ^ 1, good[offset] ^ 0x80}:
                forged = bytearray(good)
                forged[offset] = value
                forged[80:96] = bytes(16)
                forged[80:96] = xxhash.xxh3_128(bytes(forged)).digest()
                with open(path, "wb") as f:
                    f.write(forged)
                try:
                    decode_and_verify(bytes(forged), namespace=NS, key=7, first=0, end=8)
                    accepted = True
                except CorruptUnit:
                    accepted = False
                (status, *_), dest = native_load(store, 7)
                assert status == (_unitio.OK if accepted else _unitio.CORRUPT), (offset, value)
                assert accepted == (32 <= offset < 39 or (offset == 39 and value < 0x80))
                assert not accepted or np.array_equal(dest, row(NS, 7))


@as_root
def test_a_key_directory_of_another_owner_is_never_read_or_written(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False) as store:
        assert store.store(7, 0, row(NS, 7), 0).ok
        keydir = os.path.dirname(unit_files(store)[0])
        os.chown(keydir, 54321, -1)
        (status, *_), dest = native_load(store, 7)
        assert status == _unitio.UNSAFE_DIR and not dest.any()
        job = store.store(7, 0, row(NS, 7), 0)  # as if another user planted the unit
        assert job.status == "error" and "writable by no one else" in job.detail


def test_arguments_are_checked_before_any_io(tmp_path) -> None:
    perms = Perms().native()
    with pytest.raises(TypeError, match="state: expected a JobState"):
        _unitio.load(object(), [], perms, 4096, 4096, True, False, 0, 1, None)
    with pytest.raises(ValueError, match="bounce a multiple of 4096"):
        _unitio.load(_unitio.JobState(), [], perms, 4096, 5000, True, False, 0, 1, None)
    with pytest.raises(TypeError, match="items: expected"):
        _unitio.load(_unitio.JobState(), [(1, 2)], perms, 4096, 4096, True, False, 0, 1, None)
    bad = (-1, "kd", "0-8.ckv", b"short", bytearray(1), 0, 1, None)
    with pytest.raises(ValueError, match=r"header of 96\.\.1120 bytes"):
        _unitio.load(_unitio.JobState(), [bad], perms, 4096, 4096, True, False, 0, 1, None)
    with pytest.raises(TypeError, match="perms"):
        _unitio.store(_unitio.JobState(), [], (0,), -1, "p-", 4096, False, False, None)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------- stores


def test_first_writer_wins_when_another_links_the_unit_while_we_write(tmp_path, monkeypatch):
    """Writer A is about to publish when writer B (another process's store) publishes the
    same unit: A's rename never replaces B's unit; A reports it as stored by another."""
    other = FileStore(tmp_path, NS, fsync=False)
    done = []

    def hook(stage, path, written):
        if stage == "publish" and not done:
            done.append(None)
            done[0] = other.store(5, 0, row(NS, 55), 9)  # B, first

    monkeypatch.setattr(files_mod, "_test_hook", hook)
    with FileStore(tmp_path, NS, fsync=False) as store, other:
        job = store.store(5, 0, row(NS, 5), 1)  # A
        assert done[0].ok and done[0].detail == ""
        assert job.ok and job.detail == "another writer stored it first"
        (path,) = unit_files(store)
        with open(path, "rb") as f:
            header, payload = decode_and_verify(f.read(), namespace=NS, key=5)
        assert header.position == 9 and np.array_equal(
            np.frombuffer(payload, np.uint8), row(NS, 55)
        )
        assert os.listdir(os.path.join(store.directory, "tmp")) == []
        assert (store.metrics().units_stored, store.metrics().stores_skipped) == (0, 1)


def test_a_failing_writer_leaves_no_temp_file_and_the_error_is_raised(tmp_path, monkeypatch):
    def hook(stage, path, written):
        if stage == "write":
            assert os.path.exists(path)  # the temp file being written
            raise OSError(28, "No space left on device (from the test)")

    monkeypatch.setattr(files_mod, "_IO_CHUNK_BYTES", 4096)
    monkeypatch.setattr(files_mod, "_test_hook", hook)
    with FileStore(tmp_path, NS, fsync=False) as store:
        job = store.store(5, 0, row(NS, 5), 1)
        assert job.status == "error" and "from the test" in job.detail
        assert unit_files(store) == [] and os.listdir(os.path.join(store.directory, "tmp")) == []


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
@pytest.mark.parametrize("secret", [None, StoreSecret(b"k" * 32)], ids=["xxh3", "hmac"])
@pytest.mark.parametrize("chunk", [4096, 5000, 1 << 20])
def test_written_units_are_the_unit_format(tmp_path, monkeypatch, direct, secret, chunk):
    """Whatever the chunking, direct or buffered, XXH3 (native) or HMAC (through Python):
    the file is exactly the unit the format's Python encoder makes."""
    from canonical_ops.units.unit import encode_unit

    monkeypatch.setattr(files_mod, "_IO_CHUNK_BYTES", chunk)
    monkeypatch.setattr(files_mod, "_BOUNCE_BYTES", -(-chunk // 4096) * 4096)  # O_DIRECT's
    monkeypatch.setattr(files_mod, "_PIECE_BYTES", 4096)
    with FileStore(tmp_path, NS, fsync=True, direct_io=direct, secret=secret) as store:
        assert store.store(b"k" * 36, 2, row(NS, 3, 2, 7), 11).ok
        (path,) = unit_files(store)
        with open(path, "rb") as f:
            expected = encode_unit(store.namespace, b"k" * 36, 2, 7, 11, row(NS, 3, 2, 7))
            assert f.read() == expected
        dest = np.zeros(NS.layer_bytes(3, 6), np.uint8)
        assert store.load(b"k" * 36, 3, 6, dest).ok and np.array_equal(dest, row(NS, 3, 3, 6))


# ---------------------------------------------------------------------- direct reads


@pytest.mark.skipif(
    tuple(int(x) for x in os.uname().release.split(".")[:2]) < (6, 5),
    reason="cachestat (Linux 6.5) tells whether the page cache holds a unit",
)
def test_with_direct_reads_only_a_unit_the_page_cache_lacks_goes_to_the_device(
    tmp_path, monkeypatch
):
    reads = []
    monkeypatch.setattr(files_mod, "_test_hook", lambda stage, path, n: reads.append(stage))
    with FileStore(tmp_path, NS, fsync=False, direct_io=True) as store:
        if not store.direct_io:
            pytest.skip("this file system refuses O_DIRECT")
        assert store.store(7, 0, row(NS, 7), 0).ok
        (path,) = unit_files(store)
        with open(path, "rb") as f:  # written with O_DIRECT: in the page cache once read
            f.read()
        dest = np.zeros(NS.total_bytes, np.uint8)
        reads.clear()
        assert store.load(7, 0, 8, dest).ok and "read" not in reads  # all cached: no device read
        fd = os.open(path, os.O_RDONLY)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        dest[:] = 0
        reads.clear()
        assert store.load(7, 0, 8, dest).ok and reads == ["read"]  # O_DIRECT, one read
        assert np.array_equal(dest, row(NS, 7))
