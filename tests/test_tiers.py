"""StageCache: region pages first, then persistent tiers; fills verified, write-through pinned.

Real FileStores in temporary directories and plain numpy rows as regions (the
regions' own tests are test_shared_region.py; the rank processes are in
test_store_restart.py). Unit-level file properties (atomic publication,
quarantine, eviction order, races) are the store's own tests (test_store_*.py).
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np
import pytest
from helpers.store import row, run_child, small_namespace, unit_files

from canonical_ops.engine import PageManager
from canonical_ops.engine.cache import (
    StageCache,
    TierLookup,
    pp_layer_range,
    pp_layer_ranges,
)
from canonical_ops.units import FileStore, JobOutcome
from canonical_ops.units import files as files_module

NS = small_namespace(32)  # 512-byte pages, 16 KiB per whole-model unit
KEYS = [f"block-{i}".encode() for i in range(6)]


def truth(block: int, first: int = 0, end: int = 32) -> np.ndarray:
    return row(NS, block, first, end)


class Stage:
    """One pipeline stage's scheduler side: manager, rows (a plain array) and cache."""

    def __init__(self, first: int, end: int, tiers, pages: int = 8, **kwargs) -> None:
        self.first, self.end = first, end
        self.manager = PageManager(pages)
        self.rows = np.zeros((pages, NS.layer_bytes(first, end)), np.uint8)
        self.cache = StageCache(self.manager, self.rows, (first, end), NS, tiers, **kwargs)

    def write(self, blocks: range) -> None:
        """What the stage's ranks do: store blocks into pages, report them; then persist."""
        hashes = [KEYS[b] for b in blocks]
        for block, page in zip(blocks, self.manager.allocate(hashes)):
            self.rows[page] = truth(block, self.first, self.end)
            self.manager.complete_store(page, 0, generation=self.manager.generation(page))
        self.cache.persist(hashes, positions=list(blocks))

    def ready_rows(self, count: int) -> list[np.ndarray]:
        return [self.rows[self.manager.page_of(KEYS[b])] for b in range(count)]


# ---------------------------------------------------------------------- pipeline split


def test_pp_layer_range_is_vllms_split():
    # vLLM's documented examples (get_pp_indices without VLLM_PP_LAYER_PARTITION).
    assert pp_layer_ranges(61, 2) == [(0, 31), (31, 61)]
    assert pp_layer_ranges(61, 4) == [(0, 15), (15, 30), (30, 46), (46, 61)]
    assert pp_layer_ranges(32, 3) == [(0, 11), (11, 22), (22, 32)]
    assert pp_layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for layers in range(1, 40):
        for pp in range(1, layers + 1):
            ranges = pp_layer_ranges(layers, pp)
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            sizes = [end - first for first, end in ranges]
            assert max(sizes) - min(sizes) <= 1 and sizes[-1] == min(sizes)
    with pytest.raises(ValueError, match="pp_size"):
        pp_layer_range(4, 0, 5)
    with pytest.raises(ValueError, match="pp_rank"):
        pp_layer_range(4, 4, 4)


# ---------------------------------------------------------------------- round trips


def test_write_through_then_a_fresh_engine_fills_its_region_from_files(tmp_path):
    with FileStore(tmp_path, NS, fsync=False) as files:
        writer = Stage(0, 32, [files], names=["files"])
        writer.write(range(6))
        events = writer.cache.drain(30)
        assert sorted((e.kind, e.status) for e in events) == [("store", "ok")] * 6
        assert all(writer.manager.refcount(p) == 0 for p in range(6))  # pins dropped
        [counters] = writer.cache.metrics().tiers
        assert (counters.stores_ok, counters.bytes_stored) == (6, 6 * NS.total_bytes)
        writer.cache.close()
    # A restart: another store object (index rebuilt from disk), an empty region.
    with FileStore(tmp_path, NS, fsync=False) as files:
        reader = Stage(0, 32, [files], names=["files"])
        found = reader.cache.lookup(KEYS, timeout=30)
        assert found == TierLookup(0, 6, (0,) * 6)
        result = reader.cache.fetch(KEYS, found)
        assert (result.submitted, result.present, result.refused) == (6, 0, 0)
        assert reader.manager.num_filling == 6 and reader.manager.lookup(KEYS) == 0
        events = reader.cache.drain(30)
        assert [e.status for e in events] == ["ok"] * 6
        assert reader.manager.lookup(KEYS) == 6
        for block, got in enumerate(reader.ready_rows(6)):
            assert np.array_equal(got, truth(block))
        assert reader.cache.lookup(KEYS) == TierLookup(6, 0, ())  # all in the region: no tier asked
        m = reader.cache.metrics()
        assert (m.lookup_blocks, m.region_hit_blocks, m.tier_hit_blocks) == (12, 6, 6)
        assert (m.tiers[0].fills_ok, m.tiers[0].bytes_filled) == (6, 6 * NS.total_bytes)
        # Write-through of pages that came from the files does not store them back there.
        again = reader.cache.persist(KEYS)
        assert (again.submitted, again.skipped) == (0, 6)


@pytest.mark.parametrize(
    ("writer_pp", "reader_pp"), [(2, 1), (1, 2), (2, 3), (4, 2)], ids=lambda n: f"pp{n}"
)
def test_any_pipeline_split_reads_any_other(tmp_path, writer_pp, reader_pp):
    """Each writer stage persists its own layers; a reader stage covers its range from any."""
    with FileStore(tmp_path, NS, fsync=False) as files:
        writers = [Stage(*pp_layer_range(32, s, writer_pp), [files]) for s in range(writer_pp)]
        for stage in writers:
            stage.write(range(4))
            stage.cache.drain(30)
        assert files.lookup(KEYS[:4], 0, 32) == 4  # complete: every layer, across the units
        readers = [Stage(*pp_layer_range(32, s, reader_pp), [files]) for s in range(reader_pp)]
        for stage in readers:
            assert stage.cache.fetch(KEYS[:4], timeout=30).submitted == 4
            stage.cache.drain(30)
            assert stage.manager.lookup(KEYS[:4]) == 4
            for block, got in enumerate(stage.ready_rows(4)):
                assert np.array_equal(got, truth(block, stage.first, stage.end))


def test_a_corrupt_unit_is_a_miss_never_a_load(tmp_path):
    with FileStore(tmp_path, NS, fsync=False) as files:
        Stage(0, 32, [files]).write(range(6))
        files.pool.close()  # drains: every unit published
    with FileStore(tmp_path, NS, fsync=False) as files:
        victim = files.directory + "/" + _unit_of(files, KEYS[2])
        with open(victim, "r+b") as f:  # one payload bit flipped: same size, bad checksum
            f.seek(os.path.getsize(victim) - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        reader = Stage(0, 32, [files])
        assert reader.cache.fetch(KEYS, timeout=30).submitted == 6
        statuses = {e.block_hash: e.status for e in reader.cache.drain(30)}
        assert statuses[KEYS[2]] == "miss" and list(statuses.values()).count("ok") == 5
        assert reader.manager.page_of(KEYS[2]) is None  # freed: nothing of it is served
        assert reader.manager.lookup(KEYS) == 2  # the prefix ends at the bad block
        for block, got in enumerate(reader.ready_rows(2)):
            assert np.array_equal(got, truth(block))
        assert files.metrics().corrupt_detected == 1 and files.metrics().quarantined == 1
        assert reader.cache.metrics().tiers[0].fills_missed == 1
        # a later lookup no longer offers it (quarantined): the tiers hold nothing more
        assert reader.cache.lookup(KEYS, timeout=30) == TierLookup(2, 0, ())


def _unit_of(files: FileStore, key: bytes) -> str:
    from canonical_ops.units.files import key_digest

    kd = key_digest(key)
    [path] = [p for p in unit_files(files) if f"/{kd}/" in p]
    return os.path.relpath(path, files.directory)


# ---------------------------------------------------------------------- several tiers


class BatchTier:
    """A unit store that records every call it gets (a FileStore underneath)."""

    def __init__(self, files: FileStore) -> None:
        self.files = files
        self.namespace = files.namespace
        self.calls: list[tuple[str, int]] = []

    def submit_lookup(self, keys, first, end):
        self.calls.append(("lookup", len(keys)))
        return self.files.submit_lookup(keys, first, end)

    def submit_loads(self, items):
        self.calls.append(("loads", len(items)))
        return self.files.submit_loads(items)

    def submit_stores(self, items):
        self.calls.append(("stores", len(items)))
        return self.files.submit_stores(items)

    def wait(self, job, timeout=None):
        return self.files.wait(job, timeout)

    @property
    def batches(self) -> list[int]:
        return [n for kind, n in self.calls if kind != "lookup"]


class GatedTier(BatchTier):
    """Its lookups answer only once ``gate`` is set (a slow disk, a far server)."""

    def __init__(self, files: FileStore, gate: threading.Event) -> None:
        super().__init__(files)
        self.gate = gate

    def submit_lookup(self, keys, first, end):
        self.calls.append(("lookup", len(keys)))

        def work():
            assert self.gate.wait(30)
            return JobOutcome("ok", value=self.files.lookup(keys, first, end))

        return self.files.pool.submit("lookup", work)


def test_lookup_never_waits_for_a_tier(tmp_path):
    """The lookup used to ask each tier on the caller's thread: a slow tier stalled the
    scheduler. Now it submits one lookup per tier and answers pending until they finish."""
    gate = threading.Event()
    with FileStore(tmp_path, NS, fsync=False) as files:
        Stage(0, 32, [files]).write(range(6))
        files.pool.close()
    with FileStore(tmp_path, NS, fsync=False) as files:
        gated = GatedTier(files, gate)
        stage = Stage(0, 32, [gated])
        start = time.monotonic()
        assert stage.cache.lookup(KEYS) == TierLookup(0, 0, (), pending=True)
        assert stage.cache.lookup(KEYS) == TierLookup(0, 0, (), pending=True)
        assert stage.cache.fetch(KEYS).submitted == 0  # nothing known yet: nothing fetched
        assert time.monotonic() - start < 5 and not gate.is_set()
        assert gated.calls == [("lookup", 6)]  # one job per tier, asked once
        gate.set()
        found = stage.cache.lookup(KEYS, timeout=30)
        assert found == TierLookup(0, 6, (0,) * 6) and gated.calls == [("lookup", 6)]
        assert stage.cache.metrics().lookup_blocks == 6  # counted once, when answered
        assert stage.cache.fetch(KEYS, found).submitted == 6
        assert gated.calls[1:] == [("loads", 6)]  # one batch for the six fills
        stage.cache.drain(30)
        assert stage.manager.lookup(KEYS) == 6


def test_a_prefix_half_in_one_tier_half_in_another(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        FileStore(tmp_path / "a", NS, fsync=False) as a,
        FileStore(tmp_path / "b", NS, fsync=False) as b,
    ):
        batch = BatchTier(b)
        Stage(0, 32, [a]).write(range(3))
        Stage(0, 32, [batch]).write(range(3, 6))  # one batch job of 3 stores
        a.pool.close()
        b.pool.close()
        assert batch.batches == [3]
    with (
        FileStore(tmp_path / "a", NS, fsync=False) as a,
        FileStore(tmp_path / "b", NS, fsync=False) as b,
    ):
        batch = BatchTier(b)
        reader = Stage(0, 32, [a, batch], names=["files-a", "batch-b"])
        found = reader.cache.lookup(KEYS, timeout=30)
        assert found == TierLookup(0, 6, (0, 0, 0, 1, 1, 1))  # a has 0-2, b continues
        assert reader.cache.fetch(KEYS, found).submitted == 6
        assert batch.batches == [3]  # the blocks only b supplies, in one job
        events = reader.cache.drain(30)
        assert sorted({(e.tier, e.status) for e in events}) == [
            ("batch-b", "ok"),
            ("files-a", "ok"),
        ]
        assert reader.manager.lookup(KEYS) == 6
        for block, got in enumerate(reader.ready_rows(6)):
            assert np.array_equal(got, truth(block))
        # Write-through goes to the other tier only: a gets 3-5, b nothing new.
        result = reader.cache.persist(KEYS)
        assert (result.submitted, result.skipped) == (6, 6)
        reader.cache.drain(30)
        assert a.lookup(KEYS, 0, 32) == 6
        per_tier = {t.name: t for t in reader.cache.metrics().tiers}
        assert per_tier["files-a"].stores_ok == 3 and per_tier["batch-b"].stores_ok == 3


def test_promote_copies_only_what_came_from_a_farther_tier_into_the_nearer_ones(tmp_path):
    for name in ("near", "far"):
        (tmp_path / name).mkdir()
    with (
        FileStore(tmp_path / "near", NS, fsync=False) as near,
        FileStore(tmp_path / "far", NS, fsync=False) as far,
    ):
        Stage(0, 32, [near]).write(range(2))
        Stage(0, 32, [far]).write(range(5))
        near.pool.close()
        far.pool.close()
    with (
        FileStore(tmp_path / "near", NS, fsync=False) as near,
        FileStore(tmp_path / "far", NS, fsync=False) as far,
    ):
        reader = Stage(0, 32, [near, far], pages=8, names=["near", "far"])
        reader.write(range(5, 6))  # block 5: stored by this engine itself, from no tier
        reader.cache.drain(30)
        before = {t.name: t.stores_ok for t in reader.cache.metrics().tiers}
        found = reader.cache.lookup(KEYS[:5], timeout=30)
        assert found == TierLookup(0, 5, (0, 0, 1, 1, 1))
        reader.cache.fetch(KEYS[:5], found)
        reader.cache.drain(30)
        result = reader.cache.promote(KEYS)
        # 2-4 go to "near"; 0-1 came from "near" (nothing nearer), 5 from no tier
        assert (result.submitted, result.not_ready) == (3, 0)
        assert result.skipped == 2 * 2 + 3 * 1 + 2
        reader.cache.drain(30)
        stored = {t.name: t.stores_ok - before[t.name] for t in reader.cache.metrics().tiers}
        assert stored == {"near": 3, "far": 0}
        assert near.lookup(KEYS, 0, 32) == 6  # 0-4 promoted or had, 5 written through above
        for block, got in enumerate(reader.ready_rows(6)):
            assert np.array_equal(got, truth(block))
    with FileStore(tmp_path / "near", NS, fsync=False) as near:  # a restart: near alone
        alone = Stage(0, 32, [near])
        alone.cache.fetch(KEYS, timeout=30)
        alone.cache.drain(30)
        assert alone.manager.lookup(KEYS) == 6
        for block, got in enumerate(alone.ready_rows(6)):
            assert np.array_equal(got, truth(block))


# ---------------------------------------------------------------------- failing tiers


class BrokenTier:
    """A tier whose every call fails (a dead server, a vanished mount)."""

    def __init__(self, namespace) -> None:
        self.namespace = namespace

    def submit_lookup(self, *args, **kwargs):
        raise ConnectionError("tier down")

    submit_loads = submit_stores = submit_lookup

    def wait(self, job, timeout=None):  # pragma: no cover - nothing is ever submitted
        return job


def test_a_failing_tier_never_stops_the_engine(tmp_path):
    with FileStore(tmp_path, NS, fsync=False) as files:
        Stage(0, 32, [files]).write(range(4))
        files.pool.close()
    with FileStore(tmp_path, NS, fsync=False) as files:
        stage = Stage(0, 32, [BrokenTier(NS), files], pages=4, names=["broken", "files"])
        found = stage.cache.lookup(KEYS, timeout=30)
        assert found == TierLookup(0, 4, (1,) * 4)  # the good tier answers
        stage.cache.fetch(KEYS, found)
        stage.cache.drain(30)
        assert stage.manager.lookup(KEYS) == 4
        result = stage.cache.persist(KEYS)  # to "broken" (raises) and not back to files
        assert (result.submitted, result.refused, result.skipped) == (0, 4, 4)
        assert all(stage.manager.refcount(p) == 0 for p in range(4))  # no pin leaked
        broken = stage.cache.metrics().tiers[0]
        assert broken.errors >= 2 and "tier down" in broken.last_error
    # A closed tier refuses: fetches become misses at once, their pages free again.
    files = FileStore(tmp_path, NS, fsync=False)
    files.close()
    stage = Stage(0, 32, [files], pages=4)
    found = TierLookup(0, 4, (0,) * 4)  # as a lookup just before the tier went away
    result = stage.cache.fetch(KEYS[:4], found)
    assert (result.submitted, result.refused) == (0, 4)
    assert stage.manager.num_free == 4 and stage.manager.num_filling == 0
    assert stage.cache.metrics().tiers[0].fills_refused == 4


def test_a_page_being_persisted_is_pinned_until_its_store_finishes(tmp_path, monkeypatch):
    release = threading.Event()
    entered = threading.Event()

    def hook(stage, path, written):
        if stage == "publish":
            entered.set()
            assert release.wait(30)

    monkeypatch.setattr(files_module, "_test_hook", hook)
    with FileStore(tmp_path, NS, fsync=False, threads=1) as files:
        stage = Stage(0, 32, [files], pages=1)
        stage.write(range(1))
        assert entered.wait(30)
        page = stage.manager.page_of(KEYS[0])
        assert stage.manager.refcount(page) == 1 and stage.cache.in_flight == 1
        assert stage.cache.poll() == []  # never blocks
        with pytest.raises(Exception, match="cannot allocate"):
            stage.manager.allocate([KEYS[1]])  # its only page is being read by the tier
        release.set()
        [event] = stage.cache.drain(30)
        assert (event.kind, event.status) == ("store", "ok")
        assert stage.manager.refcount(page) == 0
        assert stage.manager.allocate([KEYS[1]]) == [page]  # evictable again


def test_fetch_takes_the_leading_blocks_a_small_region_can_hold(tmp_path):
    with FileStore(tmp_path, NS, fsync=False) as files:
        Stage(0, 32, [files]).write(range(6))
        files.pool.close()
    with FileStore(tmp_path, NS, fsync=False) as files:
        stage = Stage(0, 32, [files], pages=4)
        result = stage.cache.fetch(KEYS, timeout=30)
        assert (result.submitted, result.refused) == (4, 2)
        assert result.pages[4:] == (None, None)
        stage.cache.drain(30)
        assert stage.manager.lookup(KEYS) == 4


def test_arguments(tmp_path):
    with FileStore(tmp_path, NS, fsync=False) as files:
        manager = PageManager(2)
        rows = np.zeros((2, NS.total_bytes), np.uint8)
        with pytest.raises(ValueError, match=r"region: expected rows of shape \(2, 16384\)"):
            StageCache(manager, np.zeros((2, 100), np.uint8), (0, 32), NS, [files])
        with pytest.raises(ValueError, match="layers"):
            StageCache(manager, rows, (0, 33), NS, [files])
        other = small_namespace(32, name="another-model")
        with pytest.raises(ValueError, match=r"tiers\[0\]: expected a tier of namespace"):
            StageCache(manager, rows, (0, 32), other, [files])
        with pytest.raises(TypeError, match=r"tiers\[0\]"):
            StageCache(manager, rows, (0, 32), NS, [object()])
        cache = StageCache(manager, rows, (0, 32), NS, [files])
        with pytest.raises(TypeError, match="hashes"):
            cache.lookup(b"single")
        with pytest.raises(TypeError, match=r"hashes\[1\]"):
            cache.lookup([b"ok", 1.5])
        with pytest.raises(ValueError, match="positions"):
            cache.persist([b"a"], positions=[0, 1])
        cache.close()
        with pytest.raises(RuntimeError, match="closed"):
            cache.poll()


# ---------------------------------------------------------------------- a full disk

FULL_DISK = """
import json, os, resource, signal, sys
import numpy as np
from helpers.store import small_namespace
from canonical_ops.engine import PageManager
from canonical_ops.units import FileStore
from canonical_ops.engine.cache import StageCache

ns = small_namespace(32)
files = FileStore(sys.argv[1], ns, fsync=True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, 8 << 10))  # kernel-enforced: < one unit
manager = PageManager(4)
rows = np.zeros((4, ns.total_bytes), np.uint8)
cache = StageCache(manager, rows, (0, 32), ns, [files])
keys = [b"k%d" % i for i in range(4)]
for block, page in enumerate(manager.allocate(keys)):
    rows[page] = block + 1
    manager.complete_store(page, 0, generation=manager.generation(page))
submitted = cache.persist(keys).submitted
events = cache.drain(60)
# The engine keeps serving from its region: lookups hit, pages load (pin, copy, unpin).
served = manager.lookup(keys)
pages = manager.acquire(keys)
copied = [int(rows[p][0]) for p in pages]
manager.release(pages)
again = cache.persist(keys)
cache.drain(60)
c = cache.metrics().tiers[0]
print(json.dumps(dict(
    submitted=submitted, statuses=sorted({e.status for e in events}),
    details=sorted({e.detail.split(":")[0] for e in events}),
    served=served, copied=copied, again=again.submitted,
    stores_failed=c.stores_failed, files_failed=files.metrics().stores_failed,
    refcounts=[manager.refcount(p) for p in range(4)],
    tmp=os.listdir(os.path.join(files.directory, "tmp")),
)))
"""


@pytest.mark.slow
def test_a_full_disk_fails_stores_cleanly_and_the_engine_keeps_serving(tmp_path):
    """RLIMIT_FSIZE in a child (as test_store_processes): every unit write gets EFBIG."""
    result = run_child(FULL_DISK, str(tmp_path))
    assert result["submitted"] == 4 and result["statuses"] == ["error"]
    assert result["details"] == ["store failed (disk full)"]
    assert result["served"] == 4 and result["copied"] == [1, 2, 3, 4]
    assert result["again"] == 4 and result["stores_failed"] == 8 == result["files_failed"]
    assert result["refcounts"] == [0] * 4 and result["tmp"] == []


def test_both_stores_are_page_tiers(tmp_path):
    from canonical_ops.units import PageTier, RedisStore

    with FileStore(tmp_path, NS, fsync=False) as files:
        assert isinstance(files, PageTier)
    assert all(
        callable(getattr(RedisStore, name, None))
        for name in ("lookup", "submit_store", "store", "submit_load", "load", "metrics")
    )
    assert all(
        callable(getattr(RedisStore, name, None)) for name in ("submit_stores", "submit_loads")
    )
    assert not isinstance(object(), PageTier)
