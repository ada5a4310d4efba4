"""FileStore in one process: placement, verified loads, cross-split reads, eviction, restart."""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest
import torch
from helpers.store import preallocates, row, small_namespace, unit_files
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canonical_ops.units import (
    FileStore,
    JobPool,
    LoadItem,
    ModelIdentity,
    StoreItem,
    StoreNamespace,
    StoreRootError,
)
from canonical_ops.units import files as files_mod
from canonical_ops.units.files import key_digest
from canonical_ops.units.jobs import current_job
from canonical_ops.units.liveness import this_process
from canonical_ops.units.policy import Entry, LruPolicy
from canonical_ops.units.unit import header_length
from layouts import LayerSpec, RankContext

NS = small_namespace(32)  # 32 layers x 512-byte pages: 16 KiB per whole-model unit
UNIT = header_length(0) + NS.total_bytes  # file bytes of a whole-model unit with an int key


@pytest.fixture
def store(tmp_path):
    with FileStore(tmp_path, NS, fsync=False) as s:
        yield s


def load_bytes(store, key, first, end) -> tuple[str, np.ndarray]:
    dest = np.full(NS.layer_bytes(first, end), 0xAA, np.uint8)
    job = store.load(key, first, end, dest)
    return job.status, dest


# ---------------------------------------------------------------------- start-up


def test_a_missing_root_is_created_private_and_a_bad_one_refused(tmp_path) -> None:
    missing = tmp_path / "nope" / "kv"
    FileStore(missing, NS).close()  # `--store /tmp/kv` works when it does not exist
    assert os.stat(missing).st_mode & 0o777 == 0o700
    assert os.listdir(missing) == []  # and a reader leaves nothing in it
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(StoreRootError, match=r"root: .*Not a directory") as info:
        FileStore(a_file, NS)
    assert str(a_file) in str(info.value)
    # /proc refuses new files even to root (permission bits alone would not tell).
    with pytest.raises(StoreRootError, match=r"root: expected a writable directory.*'/proc'"):
        FileStore("/proc", NS)
    with pytest.raises(TypeError, match="root"):
        FileStore(3, NS)
    with pytest.raises(TypeError, match="namespace"):
        FileStore(tmp_path, NS.digest)


def test_read_only_bind_mount_root(tmp_path) -> None:
    """A read-only mount (when this machine lets us make one) is refused at construction."""
    src, mnt = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    mnt.mkdir()
    if os.system(f"mount --bind {src} {mnt} 2>/dev/null && mount -o remount,bind,ro {mnt}") != 0:
        os.system(f"umount {mnt} 2>/dev/null")
        pytest.skip("cannot make a read-only bind mount here (needs CAP_SYS_ADMIN)")
    try:
        with pytest.raises(StoreRootError, match="Read-only file system"):
            FileStore(mnt, NS)
    finally:  # lazily when busy (a process forked meanwhile may hold it): never left mounted
        os.system(f"umount {mnt} 2>/dev/null || umount -l {mnt}")


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        (dict(capacity_bytes=-1), ValueError, "capacity_bytes: expected an int >= 0, got -1"),
        (dict(capacity_bytes=1.5), TypeError, "capacity_bytes"),
        (dict(capacity_bytes=True), TypeError, "capacity_bytes"),
        (dict(capacity_bytes="1G"), TypeError, "capacity_bytes"),
        (dict(threads=0), ValueError, "threads"),
        (dict(queue_depth=2.0), TypeError, "queue_depth"),
        (dict(fsync="yes"), TypeError, "fsync"),
        (dict(recency_granularity_s=0), ValueError, "recency_granularity_s"),
        (dict(pool=JobPool(1, 1), threads=2), ValueError, "threads"),
        (dict(pool="pool"), TypeError, "pool"),
    ],
)
def test_arguments(tmp_path, kwargs, error, name) -> None:
    with pytest.raises(error, match=name):
        FileStore(tmp_path, NS, **kwargs)


def test_layout_on_disk(store, tmp_path) -> None:
    assert store.directory == os.path.join(tmp_path, NS.hex)
    assert not os.path.exists(store.directory)  # created by the first store
    assert store.store(b"key", 0, row(NS, 1), 0).ok
    with open(os.path.join(store.directory, "namespace.json")) as f:
        described = json.load(f)
    assert described == NS.describe()
    assert StoreNamespace.from_description(described).digest == NS.digest
    kd = key_digest(b"key")
    path = os.path.join(store.directory, kd[:2], kd, "0-32.ckv")
    assert unit_files(store) == [path]
    assert os.path.getsize(path) == header_length(b"key") + NS.total_bytes
    assert os.listdir(os.path.join(store.directory, "tmp")) == []
    # A second store on the same root shares the files and leaves namespace.json alone.
    mtime = os.stat(os.path.join(store.directory, "namespace.json")).st_mtime_ns
    FileStore(tmp_path, NS).close()
    assert os.stat(os.path.join(store.directory, "namespace.json")).st_mtime_ns == mtime


# ---------------------------------------------------------------------- store / load


@pytest.mark.parametrize("fsync", [True, False])
def test_the_namespace_description_is_synced_as_the_units_are(tmp_path, monkeypatch, fsync):
    """``namespace.json`` (written by a process's first store) is synced, file and directory,
    only by a store that syncs its units: without fsync the first store does not wait for a
    journal commit; a description a crash left empty is replaced by the next first store."""
    synced: list[str] = []
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append("file"))
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append("dir"))
    with FileStore(tmp_path, NS, fsync=fsync) as store:
        assert store.store(b"key", 0, row(NS, 1), 0).ok
        description = os.path.join(store.directory, "namespace.json")
    # With fsync the new directories are synced too; without it nothing is.
    assert synced.count("file") == fsync and ("dir" in synced) == fsync
    with open(description) as f:
        assert json.load(f) == NS.describe()
    open(description, "w").close()  # what a crash may leave of an unsynced one
    with FileStore(tmp_path, NS, fsync=fsync) as store:
        assert store.store(b"other", 0, row(NS, 2), 0).ok
    with open(description) as f:
        assert json.load(f) == NS.describe()


def test_round_trip_async_and_sync(store) -> None:
    jobs = [store.submit_store(k, 0, row(NS, k), position=k) for k in range(6)]
    for job in jobs:
        assert store.wait(job, timeout=30).ok, job
    assert store.lookup(list(range(8)), 0, 32) == 6
    dest = torch.zeros(NS.total_bytes, dtype=torch.uint8)
    job = store.wait(store.submit_load(3, 0, 32, dest))
    assert job.ok and job.nbytes == NS.total_bytes
    assert np.array_equal(dest.numpy(), row(NS, 3))
    status, data = load_bytes(store, 5, 0, 32)
    assert status == "ok" and np.array_equal(data, row(NS, 5))
    m = store.metrics()
    assert (m.units_stored, m.bytes_stored, m.hits, m.misses) == (6, 6 * NS.total_bytes, 2, 0)
    assert (m.units_on_disk, m.bytes_on_disk) == (6, 6 * UNIT)
    assert (m.lookup_blocks, m.lookup_hit_blocks) == (8, 6)


def test_keys_of_every_kind(store) -> None:
    for key in (b"\x00bytes", "text", 2**70, -5, np.int64(9)):
        assert store.store(key, 0, row(NS, 1), 0).ok
        assert store.lookup([key], 0, 32) == 1
        assert load_bytes(store, key, 0, 32)[0] == "ok"
    assert store.lookup(["text"], 0, 32) == store.lookup([b"text"], 0, 32) == 1  # one rule


def test_storing_twice_keeps_one_file(store) -> None:
    assert store.store(1, 0, row(NS, 1), 0).ok
    again = store.store(1, 0, row(NS, 1), 0)
    assert again.ok and again.detail == "already stored"
    assert len(unit_files(store)) == 1
    assert store.metrics().stores_skipped == 1 and store.metrics().units_stored == 1


def test_lookup_stops_at_the_first_gap(store) -> None:
    for k in (0, 1, 3):
        store.store(k, 0, row(NS, k), k)
    assert store.lookup([0, 1, 2, 3], 0, 32) == 2
    assert store.lookup([2, 3], 0, 32) == 0
    assert store.lookup([], 0, 32) == 0
    with pytest.raises(TypeError, match="keys"):
        store.lookup(b"single", 0, 32)
    with pytest.raises(ValueError, match="end"):
        store.lookup([0], 0, 33)


def test_a_miss_leaves_nothing_loaded(store) -> None:
    status, data = load_bytes(store, 99, 0, 32)
    assert status == "miss"
    assert np.all(data == 0xAA)  # nothing was read for an absent unit
    assert store.metrics().misses == 1 and store.metrics().bytes_loaded == 0


def test_store_and_load_arguments(store) -> None:
    with pytest.raises(ValueError, match="payload: 100 bytes match no layer range"):
        store.submit_store(1, 0, bytes(100), 0)
    with pytest.raises(ValueError, match="payload: expected"):
        store.submit_store(1, 0, row(NS, 1), 0, end=31)
    with pytest.raises(ValueError, match="position"):
        store.submit_store(1, 0, row(NS, 1), -1)
    with pytest.raises(TypeError, match="position"):
        store.submit_store(1, 0, row(NS, 1), 1.0)
    with pytest.raises(ValueError, match="first"):
        store.submit_store(1, 32, b"", 0)
    page = NS.layer_bytes(0, 1)
    with pytest.raises(ValueError, match=f"destination: expected {page} bytes"):
        store.submit_load(1, 0, 1, bytearray(page - 1))
    with pytest.raises(ValueError, match="destination: expected writable"):
        store.submit_load(1, 0, 1, bytes(page))
    with pytest.raises(TypeError, match="key"):
        store.submit_load(None, 0, 1, bytearray(page))
    assert store.metrics() == type(store.metrics())()  # nothing was counted


def test_ambiguous_end_needs_end(tmp_path) -> None:
    spec = LayerSpec("full", 4, 1, 8, "bfloat16", "packed", "NHD")
    ns = StoreNamespace.from_specs(
        ModelIdentity("m"), [spec, None, spec], RankContext(2, 2, 0),
        fallback_page_sizes=[0, 0, 0], fallback_layouts=["x"] * 3, block_size=4,
    )  # fmt: skip
    with FileStore(tmp_path, ns, fsync=False) as s:
        page = bytes(ns.layer_bytes(0, 1))
        with pytest.raises(ValueError, match="pass end"):
            s.store(1, 0, page, 0)
        assert s.store(1, 0, page, 0, end=2).ok
        assert s.lookup([1], 0, 2) == 1 and s.lookup([1], 0, 1) == 1
        assert s.lookup([1], 0, 3) == 0


# ---------------------------------------------------------------------- other splits


def test_cross_split_reads(store) -> None:
    """Stages owning [0,16) and [16,32) wrote; readers with other splits read."""
    for k in range(3):
        assert store.store(k, 0, row(NS, k, 0, 16), k).ok
        assert store.store(k, 16, row(NS, k, 16, 32), k).ok
    assert store.store(3, 0, row(NS, 3, 0, 16), 3).ok  # only the first stage's half
    for first, end in [(0, 32), (8, 24), (0, 16), (16, 32), (15, 17), (31, 32)]:
        assert store.lookup([0, 1, 2], first, end) == 3
        for k in range(3):
            status, data = load_bytes(store, k, first, end)
            assert status == "ok", (first, end)
            assert np.array_equal(data, row(NS, k, first, end)), (k, first, end)
    assert store.lookup([0, 1, 2, 3], 0, 32) == 3
    assert store.lookup([3], 0, 16) == store.lookup([3], 4, 8) == 1
    assert load_bytes(store, 3, 8, 24)[0] == "miss"


def pieces(monkeypatch, piece: int, bounce: int | None = None, *, nowait: bool = True) -> None:
    """Read in pieces of ``piece`` bytes, ``bounce`` (a multiple of 4 KiB) at a time from the
    device path; ``nowait`` False: never from the page cache straight into the destination."""
    monkeypatch.setattr(files_mod, "_PIECE_BYTES", piece)
    monkeypatch.setattr(files_mod, "_BOUNCE_BYTES", bounce or -(-piece // 4096) * 4096)
    monkeypatch.setattr(files_mod, "_NOWAIT", nowait)


@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "from-device"])
@pytest.mark.parametrize("chunk", [4096, 5000, NS.total_bytes - 1])
def test_only_reads_that_may_block_go_through_the_buffer_unclaimed(
    tmp_path, monkeypatch, chunk, cached
):
    """A unit the page cache holds is read piece by piece straight into the destination
    (RWF_NOWAIT, under the claim): no read that may block. Otherwise (buffered reads) each
    read goes into the thread's buffer, unclaimed, and the destination is written only after
    it returned: when a read starts, nothing past what was read before is in the destination
    yet."""
    with FileStore(tmp_path, NS, fsync=False, direct_reads=False) as store:
        assert store.store(7, 0, row(NS, 7), 0).ok
        dest = np.zeros(NS.total_bytes, np.uint8)
        reads = []

        def hook(stage, path, offset):
            if stage == "read":
                payload_done = max(0, offset - header_length(7))
                untouched = not dest[payload_done:].any()
                reads.append((offset, current_job()._state.value, untouched))

        pieces(monkeypatch, chunk, nowait=cached)
        monkeypatch.setattr(files_mod, "_test_hook", hook)
        assert store.load(7, 0, 32, dest).ok and np.array_equal(dest, row(NS, 7))
        bounce = -(-chunk // 4096) * 4096
        expected = [] if cached else [(o, 0, True) for o in range(0, UNIT, bounce)]
        assert reads == expected  # 0: running (not claimed) while the read may block


def test_a_load_that_expired_never_writes_its_destination(tmp_path, monkeypatch) -> None:
    """A read stuck past the deadline: the job expires (a miss), the destination is never
    written, even when the read returns later; the pool keeps serving."""
    with FileStore(tmp_path, NS, fsync=False, threads=1, deadline_s=0.3) as s:
        assert s.store(7, 0, row(NS, 7), 0).ok
        gate, entered = threading.Event(), threading.Event()

        def stuck(stage, path, offset):
            if stage == "read":
                entered.set()
                gate.wait(30)  # e.g. a hung network file system

        pieces(monkeypatch, 4096, nowait=False)  # not in the page cache (a cold unit)
        monkeypatch.setattr(files_mod, "_test_hook", stuck)
        dest = np.zeros(NS.total_bytes, np.uint8)
        job = s.submit_load(7, 0, 32, dest)
        assert entered.wait(10)
        s.wait(job, timeout=10)
        assert job.status == "expired" and not dest.any()
        monkeypatch.setattr(files_mod, "_test_hook", None)
        gate.set()
        time.sleep(0.2)  # the abandoned read returns and is dropped: nothing written
        assert not dest.any()
        other = np.zeros(NS.total_bytes, np.uint8)
        assert s.wait(s.submit_load(7, 0, 32, other), 10).ok
        assert np.array_equal(other, row(NS, 7))


def test_a_unit_that_shrinks_while_read_is_a_miss(store, monkeypatch) -> None:
    assert store.store(7, 0, row(NS, 7), 0).ok
    (path,) = unit_files(store)

    def shrink_after_first_read(stage, _path, offset):
        if stage == "read" and offset:
            os.truncate(path, 2 * 4096)

    pieces(monkeypatch, 4096, nowait=False)
    monkeypatch.setattr(files_mod, "_test_hook", shrink_after_first_read)
    status, _ = load_bytes(store, 7, 0, 32)
    m = store.metrics()
    assert status == "miss" and (m.hits, m.bytes_loaded, m.corrupt_detected) == (0, 0, 1)
    assert not os.path.exists(path)


def test_other_process_units_are_found_by_lookup(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False) as a, FileStore(tmp_path, NS, fsync=False) as b:
        assert b.store(5, 0, row(NS, 5, 0, 16), 5).ok
        assert b.store(5, 16, row(NS, 5, 16, 32), 5).ok
        assert a.metrics().units_on_disk == 0
        assert a.lookup([5], 0, 32) == 1
        assert a.metrics().units_on_disk == 2
        status, data = load_bytes(a, 5, 0, 32)
        assert status == "ok" and np.array_equal(data, row(NS, 5))
        # a load may also find them without a lookup
        assert b.store(6, 0, row(NS, 6), 6).ok
        assert load_bytes(a, 6, 0, 32)[0] == "ok"
        # and a unit evicted by the other process is a miss, not an error
        b.gc(0)
        assert load_bytes(a, 5, 0, 32)[0] == "miss"


def test_warm_restart(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False) as s:
        for k in range(4):
            s.store(k, 0, row(NS, k), k)
    with FileStore(tmp_path, NS, fsync=False) as s:
        m = s.metrics()
        assert (m.units_on_disk, m.bytes_on_disk) == (4, 4 * UNIT)
        assert s.lookup([0, 1, 2, 3], 0, 32) == 4
        assert all(np.array_equal(load_bytes(s, k, 0, 32)[1], row(NS, k)) for k in range(4))
    # another namespace on the same root sees none of it
    with FileStore(tmp_path, small_namespace(32, name="other"), fsync=False) as s:
        assert s.metrics().units_on_disk == 0 and s.lookup([0], 0, 32) == 0


# ---------------------------------------------------------------------- corruption


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize(
    "damage",
    ["payload bit", "header bit", "last byte", "truncate", "extend", "other key", "empty"],
)
@pytest.mark.parametrize("chunk", [None, 4096])
@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "from-device"])
def test_a_bad_file_is_a_miss_and_quarantined(store, damage, chunk, cached, monkeypatch) -> None:
    pieces(monkeypatch, chunk or files_mod._PIECE_BYTES, nowait=cached)
    assert store.store(1, 0, row(NS, 1), 1).ok
    assert store.store(2, 0, row(NS, 2), 2).ok
    (path,) = [p for p in unit_files(store) if key_digest(1) in p]
    size = os.path.getsize(path)
    if damage == "payload bit":
        flip(path, size // 2)
    elif damage == "header bit":
        flip(path, 40)  # payload length
    elif damage == "last byte":
        flip(path, size - 1)
    elif damage == "truncate":
        os.truncate(path, size - 1)
    elif damage == "extend":
        with open(path, "ab") as f:
            f.write(b"\0")
    elif damage == "other key":  # a valid unit of key 2 under key 1's name
        (other,) = [p for p in unit_files(store) if key_digest(2) in p]
        os.replace(other, path)
    elif damage == "empty":
        os.truncate(path, 0)
    status, data = load_bytes(store, 1, 0, 32)
    assert status == "miss"
    m = store.metrics()
    assert (m.hits, m.units_loaded, m.bytes_loaded) == (0, 0, 0)  # never reported loaded
    assert (m.corrupt_detected, m.quarantined) == (1, 1)
    assert not os.path.exists(path)
    assert len(os.listdir(os.path.join(store.directory, "quarantine"))) == 1
    assert store.lookup([1], 0, 32) == 0
    # the key can be stored again and then loads
    assert store.store(1, 0, row(NS, 1), 1).ok
    status, data = load_bytes(store, 1, 0, 32)
    assert status == "ok" and np.array_equal(data, row(NS, 1))


def test_a_corrupt_unit_falls_back_to_another_split(store) -> None:
    assert store.store(1, 0, row(NS, 1), 1).ok
    assert store.store(1, 0, row(NS, 1, 0, 16), 1).ok
    assert store.store(1, 16, row(NS, 1, 16, 32), 1).ok
    whole = next(p for p in unit_files(store) if p.endswith("0-32.ckv"))
    flip(whole, os.path.getsize(whole) - 10)
    status, data = load_bytes(store, 1, 0, 32)
    assert status == "ok" and np.array_equal(data, row(NS, 1))
    assert store.metrics().corrupt_detected == 1 and not os.path.exists(whole)


def test_corrupt_files_are_quarantined_at_start_up(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False) as s:
        for k in range(3):
            s.store(k, 0, row(NS, k), k)
        paths = unit_files(s)
    flip(paths[0], 8)  # header: caught by the start-up scan (headers only)
    os.truncate(paths[1], 50)
    with FileStore(tmp_path, NS, fsync=False) as s:
        m = s.metrics()
        assert (m.units_on_disk, m.corrupt_detected, m.quarantined) == (1, 2, 2)
        assert unit_files(s) == [paths[2]]


def test_quarantine_is_bounded(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False, quarantine_limit=1) as s:
        for k in range(3):
            s.store(k, 0, row(NS, k), k)
        for path in unit_files(s):
            flip(path, os.path.getsize(path) - 1)
        assert [load_bytes(s, k, 0, 32)[0] for k in range(3)] == ["miss"] * 3
        assert len(os.listdir(os.path.join(s.directory, "quarantine"))) == 1
        assert s.metrics().corrupt_detected == 3 and s.metrics().quarantined == 1
        assert unit_files(s) == []


# ---------------------------------------------------------------------- capacity


def test_eviction_is_tail_first_among_equally_recent(tmp_path) -> None:
    with FileStore(
        tmp_path, NS, fsync=False, capacity_bytes=5 * UNIT, recency_granularity_s=1e12
    ) as s:
        for position in range(8):
            assert s.store(position, 0, row(NS, position), position).ok
        m = s.metrics()
        assert (m.units_on_disk, m.evicted) == (5, 3) and m.bytes_on_disk <= 5 * UNIT
        # the head of the sequence survives; its tail blocks went first
        assert s.lookup(list(range(8)), 0, 32) == 4
        assert s.lookup([7], 0, 32) == 1  # the newest stored block, the last to arrive
        assert len(unit_files(s)) == 5


def test_a_batch_larger_than_the_room_keeps_its_heads(tmp_path) -> None:
    """One job of 8 units into room for 5: stored, then the batch's tails are evicted."""
    with FileStore(
        tmp_path, NS, fsync=False, capacity_bytes=5 * UNIT, recency_granularity_s=1e12
    ) as s:
        job = s.stores([StoreItem(p, 0, row(NS, p), p) for p in range(8)])
        assert job.ok and (s.metrics().units_on_disk, s.metrics().evicted) == (5, 3)
        assert s.lookup(list(range(8)), 0, 32) == 5 and len(unit_files(s)) == 5


def test_eviction_is_least_recently_used_first(tmp_path) -> None:
    with FileStore(
        tmp_path, NS, fsync=False, capacity_bytes=4 * UNIT + 64, recency_granularity_s=0.05
    ) as s:
        s.store("old-head", 0, row(NS, 1), 0)
        s.store("used-head", 0, row(NS, 2), 0)
        time.sleep(0.12)
        assert s.lookup(["used-head"], 0, 32) == 1  # touched: recent again
        time.sleep(0.12)
        for position in (1, 2, 3):
            assert s.store(f"new-{position}", 0, row(NS, position), position).ok
        # old-head (position 0!) was the least recently used, so it went first
        assert s.lookup(["old-head"], 0, 32) == 0
        assert s.lookup(["used-head"], 0, 32) == 1
        assert s.lookup(["new-1", "new-2", "new-3"], 0, 32) == 3


def test_a_unit_larger_than_the_capacity_fails_cleanly(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False, capacity_bytes=UNIT - 1) as s:
        job = s.store(1, 0, row(NS, 1), 0)
        assert job.status == "error" and "exceeds capacity" in job.detail
        assert s.metrics().stores_failed == 1 and unit_files(s) == []


def test_gc_to_a_capacity_and_of_leftover_temps(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False, recency_granularity_s=1e12) as s:
        for position in range(6):
            s.store(position, 0, row(NS, position), position)
        tmp_dir = os.path.join(s.directory, "tmp")
        ns, pid, ticks = this_process()
        dead = os.path.join(tmp_dir, f"{ns}-999999999-1-abcd.tmp")
        alive = os.path.join(tmp_dir, f"{ns}-{pid}-{ticks}-beef.tmp")  # this process: alive
        foreign = os.path.join(tmp_dir, "1-1-1-dead.tmp")  # another pid namespace: by age
        for path in (dead, alive, foreign):
            with open(path, "wb") as f:
                f.write(b"partial")
        report = s.gc(3 * UNIT)
        assert (report.units_evicted, report.bytes_evicted) == (3, 3 * UNIT)
        assert (report.units_on_disk, report.bytes_on_disk) == (3, 3 * UNIT)
        assert report.temps_removed == 1
        assert sorted(os.listdir(tmp_dir)) == sorted(os.path.basename(p) for p in (alive, foreign))
        assert s.lookup(list(range(6)), 0, 32) == 3  # heads kept
        old = time.time() - 7200
        os.utime(foreign, (old, old))
        assert s.gc().temps_removed == 1
        assert os.listdir(tmp_dir) == [os.path.basename(alive)]
    with pytest.raises(ValueError, match="capacity_bytes"):
        FileStore(tmp_path, NS).gc(-1)


# ---------------------------------------------------------------------- back-pressure


def test_back_pressure_refuses_and_counts(tmp_path, monkeypatch) -> None:
    gate, entered = threading.Event(), threading.Event()

    def hook(stage, path, written):
        entered.set()
        gate.wait(30)

    monkeypatch.setattr(files_mod, "_test_hook", hook)
    with FileStore(tmp_path, NS, fsync=False, threads=1, queue_depth=1) as s:
        first = s.submit_store(1, 0, row(NS, 1), 1)
        assert entered.wait(30)  # the only thread is inside the write
        queued = s.submit_store(2, 0, row(NS, 2), 2)
        start = time.perf_counter()
        refused = [
            s.submit_store(3, 0, row(NS, 3), 3),
            s.submit_load(1, 0, 32, np.zeros(NS.total_bytes, np.uint8)),
        ]
        assert time.perf_counter() - start < 1.0  # the engine's thread is never blocked
        assert all(j.refused and j.done for j in refused)
        m = s.metrics()
        assert (m.stores_refused, m.loads_refused) == (1, 1)
        gate.set()
        assert s.wait(first, 30).ok and s.wait(queued, 30).ok
        assert s.lookup([1, 2, 3], 0, 32) == 2


def test_shared_pool_and_close(tmp_path) -> None:
    pool = JobPool(threads=2, queue_depth=8)
    with FileStore(tmp_path, NS, fsync=False, pool=pool) as s:
        job = s.submit_store(1, 0, row(NS, 1), 0)
        assert s.wait(job).ok
    assert not pool.closed  # a shared pool outlives the store
    with pytest.raises(RuntimeError, match="closed"):
        s.submit_store(2, 0, row(NS, 2), 0)
    own = FileStore(tmp_path, NS, fsync=False)
    own.close()
    assert own.pool.closed
    pool.close()


# ---------------------------------------------------------------------- full disk


def test_full_tmpfs_fails_stores_cleanly_and_keeps_loading(tmp_path) -> None:
    """A real, kernel-enforced full file system: a small tmpfs (when mount is permitted)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=320k tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("mount -t tmpfs not permitted here; test_store_processes covers EFBIG")
    try:
        ns = small_namespace(32, head_size=64)  # 128 KiB units: two fit, not three
        with FileStore(mnt, ns, fsync=True) as s:
            results = [s.store(k, 0, row(ns, k), k) for k in range(4)]
            statuses = [j.status for j in results]
            assert statuses == ["ok", "ok", "error", "error"], [j.detail for j in results]
            failed = [j for j in results if j.status == "error"]
            assert all("disk full" in j.detail for j in failed)
            m = s.metrics()
            assert m.stores_failed == len(failed) >= 1
            assert os.listdir(os.path.join(s.directory, "tmp")) == []  # temp removed
            dest = np.zeros(ns.total_bytes, np.uint8)
            assert s.load(0, 0, 32, dest).ok and np.array_equal(dest, row(ns, 0))
            # after making room, stores work again
            s.gc(0)
            assert s.store(9, 0, row(ns, 9), 0).ok
    finally:  # lazily when busy (a process forked meanwhile may hold it): never left mounted
        os.system(f"umount {mnt} 2>/dev/null || umount -l {mnt}")


# ---------------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    splits=st.lists(
        st.lists(st.integers(1, 31), max_size=4).map(lambda cuts: sorted(set(cuts))),
        min_size=1,
        max_size=3,
    ),
    drop=st.lists(st.integers(0, 12), max_size=3),
    first=st.integers(0, 31),
    length=st.integers(1, 32),
)
def test_any_stored_splits_serve_any_covered_range(splits, drop, first, length) -> None:
    """Stages of several pipeline splits store units; a reader of any range gets exact bytes
    exactly when the stored units cover it."""
    end = min(32, first + length)
    units = set()
    for cuts in splits:
        bounds = [0, *cuts, 32]
        units |= set(itertools.pairwise(bounds))
    units = sorted(units)
    for index in sorted(set(drop), reverse=True):  # some stages never stored theirs
        if index < len(units):
            units.pop(index)
    covered, position = True, first
    while position < end:
        reach = max((e for f, e in units if f <= position < e), default=None)
        if reach is None:
            covered = False
            break
        position = reach
    with tempfile.TemporaryDirectory() as root, FileStore(root, NS, fsync=False) as store:
        for f, e in units:
            assert store.store(b"k", f, row(NS, 3, f, e), 0).ok
        assert store.lookup([b"k"], first, end) == int(covered)
        dest = np.zeros(NS.layer_bytes(first, end), np.uint8)
        job = store.load(b"k", first, end, dest)
        assert job.status == ("ok" if covered else "miss")
        if covered:
            assert np.array_equal(dest, row(NS, 3, first, end))


@given(
    entries=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 50), st.integers(1, 100)),
        min_size=1,
        max_size=40,
    ),
    need=st.integers(1, 3000),
)
def test_eviction_plan(entries, need) -> None:
    """Oldest recency bucket first; within a bucket, highest prefix position first."""
    lru = [
        Entry(b"k", f"{i:032x}", 0, 1, size, position, bucket * 10 + i % 10)
        for i, (bucket, position, size) in enumerate(sorted(entries))
    ]
    policy = LruPolicy(10e-9)
    for entry in lru:
        policy.add(entry)
    victims = policy.victims(need)
    freed = sum(v.size for v in victims)
    total = sum(e.size for e in lru)
    assert freed >= min(need, total)
    assert freed - victims[-1].size < need  # no victim beyond what was needed
    chosen = {id(v) for v in victims}
    survivors = [e for e in lru if id(e) not in chosen]
    for victim in victims:
        for survivor in survivors:
            vb, sb = victim.last_used // 10, survivor.last_used // 10
            assert vb < sb or (vb == sb and victim.position >= survivor.position)


# ---------------------------------------------------------------------- batch forms, direct I/O


def test_batch_forms_are_one_job_with_an_outcome_per_item(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False) as s:
        items = [StoreItem(k, 0, row(NS, k), k) for k in range(3)] + [(3, 0, row(NS, 3, 0, 16), 3)]
        job = s.wait(s.submit_stores(items), 30)
        assert job.kind == "stores" and job.ok and [o.status for o in job.value] == ["ok"] * 4
        lookup = s.wait(s.submit_lookup([0, 1, 2, 3], 0, 32), 30)
        assert lookup.ok and lookup.value == 3 and s.lookup([3], 0, 16) == 1
        dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(4)]
        job = s.loads([LoadItem(k, 0, 32, d) for k, d in enumerate(dests)])
        assert [o.status for o in job.value] == ["ok"] * 3 + ["miss"] and job.status == "miss"
        assert all(np.array_equal(dests[k], row(NS, k)) for k in range(3))
        with pytest.raises(ValueError, match=r"items\[1\]\.destination: expected 16384 bytes"):
            s.loads([(0, 0, 32, dests[0]), (1, 0, 32, dests[1][:5])])
        with pytest.raises(TypeError, match=r"items\[0\]: expected a StoreItem"):
            s.stores([object()])


def test_removed_units_are_reported_once(tmp_path) -> None:
    with FileStore(tmp_path, NS, fsync=False, capacity_bytes=2 * UNIT) as s:
        for k in range(3):
            assert s.store(k, 0, row(NS, k), k).ok
        # equally recent: the tail (position 1) goes before the head
        assert s.take_removed() == [(header_key(1), 0, 32)] and s.take_removed() == []
        (path,) = [p for p in unit_files(s) if key_digest(2) in p]
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 1]))
        assert s.load(2, 0, 32, np.zeros(NS.total_bytes, np.uint8)).status == "miss"
        assert s.take_removed() == [(header_key(2), 0, 32)]


def header_key(key: int) -> bytes:
    from canonical_ops.units.unit import normalize_key

    return normalize_key(key)


@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm"])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct_io"])
def test_a_unit_is_preallocated_before_its_bytes_are_written(
    tmp_path, monkeypatch, where, direct
) -> None:
    """Before its first byte is written a unit's temp file holds its blocks on ext4 (one
    extent), and only there (tmpfs: fallocate would zero the pages the write fills; XFS:
    measured slower); the unit's bytes are the same either way."""
    if where == "tmp_path" or not os.path.isdir(where):
        root = tmp_path
    else:
        root = tempfile.mkdtemp(dir=where)
    for name in ("_IO_CHUNK_BYTES", "_BOUNCE_BYTES", "_PIECE_BYTES"):  # first write: 4 KiB
        monkeypatch.setattr(files_mod, name, 4096)
    seen: list[int] = []

    def hook(stage, path, written):
        if stage == "write" and not seen:
            seen.append(os.stat(path).st_blocks * 512)

    monkeypatch.setattr(files_mod, "_test_hook", hook)
    try:
        with FileStore(root, NS, fsync=False, direct_io=direct) as s:
            assert s.store(1, 0, row(NS, 1), 0).ok
            expected = preallocates(os.path.join(s.directory, "tmp"))
            dest = np.zeros(NS.total_bytes, np.uint8)
            assert s.load(1, 0, 32, dest).ok and np.array_equal(dest, row(NS, 1))
        assert len(seen) == 1
        assert (seen[0] >= UNIT) == expected, (seen[0], UNIT, expected)
    finally:
        if root is not tmp_path:
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("chunk", [8192, 1 << 20])
@pytest.mark.parametrize("cached", [True, False], ids=["page-cache", "from-device"])
def test_direct_io_writes_the_same_units_and_reads_them(
    tmp_path, monkeypatch, chunk, cached
) -> None:
    pieces(monkeypatch, chunk, nowait=cached)
    monkeypatch.setattr(files_mod, "_IO_CHUNK_BYTES", chunk)
    odd = small_namespace(7, head_size=24)  # a unit that is no multiple of 4 KiB
    with (
        FileStore(tmp_path / "d", odd, fsync=False, direct_io=True) as direct,
        FileStore(tmp_path / "b", odd, fsync=False) as buffered,
    ):
        assert direct.direct_io and not buffered.direct_io
        for store in (direct, buffered):
            assert store.store(b"k", 0, row(odd, 1), 5).ok
            assert store.store(b"k", 2, row(odd, 2, 2, 5), 5).ok
        pairs = zip(unit_files(direct), unit_files(buffered))
        for a, b in pairs:  # the very same bytes: one format, either way
            with open(a, "rb") as fa, open(b, "rb") as fb:
                assert fa.read() == fb.read()
        for store in (direct, buffered):
            dest = np.zeros(odd.layer_bytes(1, 4), np.uint8)
            assert store.load(b"k", 1, 4, dest).ok
            assert np.array_equal(dest, row(odd, 1, 1, 4))
    with FileStore(tmp_path / "b", odd, fsync=False, direct_io=True) as reader:
        dest = np.zeros(odd.total_bytes, np.uint8)
        assert reader.load(b"k", 0, 7, dest).ok and np.array_equal(dest, row(odd, 1))


def test_direct_io_falls_back_where_the_file_system_refuses_it(tmp_path, monkeypatch) -> None:
    real = os.open

    def no_direct(path, flags, *args, **kwargs):  # as tmpfs before Linux 6.6, or FUSE
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    with FileStore(tmp_path, NS, fsync=False, direct_io=True) as s:
        assert not s.direct_io and not s.direct_reads  # buffered, and it works
        assert s.store(1, 0, row(NS, 1), 0).ok
        assert s.load(1, 0, 32, np.zeros(NS.total_bytes, np.uint8)).ok
    with FileStore(tmp_path, NS, fsync=False) as s:  # the default's direct reads, too
        assert not s.direct_reads
        assert s.load(1, 0, 32, np.zeros(NS.total_bytes, np.uint8)).ok


def test_a_store_that_expired_publishes_nothing(tmp_path, monkeypatch) -> None:
    """A write stuck past the deadline: the job expires (a failed store); when the write
    returns later its unit is not linked (the publish claims first)."""
    gate, entered = threading.Event(), threading.Event()

    def hook(stage, path, written):
        if stage == "publish":
            entered.set()
            gate.wait(30)

    monkeypatch.setattr(files_mod, "_test_hook", hook)
    with FileStore(tmp_path, NS, fsync=False, threads=1, deadline_s=0.3) as s:
        job = s.submit_store(7, 0, row(NS, 7), 0)
        assert entered.wait(10)
        assert s.wait(job, timeout=10).status == "expired"
        gate.set()
        time.sleep(0.3)  # the abandoned writer resumes: its claim fails, nothing is linked
        assert unit_files(s) == [] and os.listdir(os.path.join(s.directory, "tmp")) == []
        monkeypatch.setattr(files_mod, "_test_hook", None)
        assert s.wait(s.submit_store(8, 0, row(NS, 8), 0), 10).ok  # the pool goes on
