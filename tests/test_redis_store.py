"""The Redis tier against a real redis-server: round trips, splits, races, corruption, limits.

Every test talks to a real ``redis-server`` started by ``helpers.redis_server``
(never a mock). A missing binary FAILS these tests with a message saying that
``make test`` installs it.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import redis
import torch
from helpers.redis_server import (
    MISSING_MESSAGE,
    AclUser,
    RedisBinaryMissing,
    RedisServer,
    free_port,
)
from helpers.store import row, small_namespace, start_child

from canonical_ops.units import (
    JobPool,
    LoadItem,
    RedisStore,
    RedisStoreError,
    StoreItem,
    encode_unit,
)
from canonical_ops.units.files import key_digest

NS = small_namespace(32)  # 512 B canonical pages: a whole-model unit is 16 KiB
LAYERS = NS.num_layers
PAGE = NS.layer_bytes(0, 1)


def new_server(tmp_path_factory, name: str, **kwargs) -> RedisServer:
    return RedisServer(str(tmp_path_factory.mktemp(name)), **kwargs).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RedisServer(str(tmp_path_factory.mktemp("redis"))) as srv:
        yield srv


@pytest.fixture
def admin(server) -> redis.Redis:
    client = server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def store(server, admin):
    with RedisStore(server.url, NS) as s:
        yield s


def unit_keys_on_server(admin: redis.Redis) -> list[bytes]:
    return sorted(k for k in admin.keys("ckv:v1:{*}:*-*") if not k.endswith(b":idx"))


# With 4096-byte values, an int key's 104-byte header leaves room for 7 layers of 512 B.
PIECES = [(0, 7), (7, 14), (14, 21), (21, 28), (28, 32)]


# ---------------------------------------------------------------------- the launcher


def test_missing_redis_server_fails_with_make_test_hint(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    with pytest.raises(RedisBinaryMissing, match="make test"):
        RedisServer(str(tmp_path / "r"))
    assert "make test" in MISSING_MESSAGE


# ---------------------------------------------------------------------- round trips


def test_single_round_trip_is_bit_exact(store) -> None:
    payload = row(NS, 1)
    job = store.store(b"block-1", 0, payload, position=0)
    assert job.status == "ok" and job.nbytes == payload.nbytes
    out = np.zeros_like(payload)
    job = store.load(b"block-1", 0, LAYERS, out)
    assert job.status == "ok" and job.nbytes == out.nbytes
    assert np.array_equal(out, payload)


def test_batches_are_one_round_trip_each_and_bit_exact(store) -> None:
    keys = [f"prompt-{i}".encode() for i in range(40)]
    # Mixed payload kinds: numpy rows, CPU tensors, bytes.
    payloads = [row(NS, i) for i in range(40)]
    items = [
        StoreItem(k, 0, torch.from_numpy(p) if i % 3 == 0 else p, i)
        for i, (k, p) in enumerate(zip(keys, payloads))
    ]
    items[1] = (keys[1], 0, payloads[1].tobytes(), 1)  # a plain tuple and bytes payload
    before = store.metrics().round_trips
    job = store.wait(store.submit_stores(items), timeout=30)
    assert job.status == "ok", job.detail
    assert [o.status for o in job.value] == ["ok"] * 40
    assert store.metrics().round_trips == before + 1

    assert store.lookup(keys, 0, LAYERS) == 40
    assert store.metrics().round_trips == before + 2

    outs = [np.zeros_like(p) for p in payloads]
    dests = [torch.from_numpy(o) if i % 2 else o for i, o in enumerate(outs)]  # tensors too
    job = store.wait(store.submit_loads([LoadItem(k, 0, LAYERS, d) for k, d in zip(keys, dests)]))
    assert job.status == "ok", job.detail
    assert job.nbytes == sum(p.nbytes for p in payloads)
    assert store.metrics().round_trips == before + 3
    for out, payload in zip(outs, payloads):
        assert np.array_equal(out, payload)
    m = store.metrics()
    assert (m.units_stored, m.hits, m.misses, m.corrupt_detected) == (40, 40, 0, 0)
    assert m.bytes_stored == m.bytes_loaded == sum(p.nbytes for p in payloads)
    assert m.bytes_sent > m.bytes_stored and m.bytes_received > m.bytes_loaded  # + headers


def test_lookup_is_the_stored_prefix(store) -> None:
    keys = [i * 7919 for i in range(20)]  # int block hashes
    store.stores([(k, 0, row(NS, k), i) for i, k in enumerate(keys) if i != 12])
    assert store.lookup(keys, 0, LAYERS) == 12
    assert store.lookup(keys[:5], 0, LAYERS) == 5
    assert store.lookup(keys[12:], 0, LAYERS) == 0
    assert store.lookup([], 0, LAYERS) == 0
    m = store.metrics()
    assert (m.lookups, m.lookup_blocks, m.lookup_hit_blocks) == (4, 20 + 5 + 8, 17)
    assert 0 < m.lookup_seconds_max <= m.lookup_seconds_total
    job = store.wait(store.submit_lookup(keys, 0, LAYERS), timeout=10)
    assert job.status == "ok" and job.value == 12


def test_empty_batches_are_no_round_trip(store) -> None:
    before = store.metrics().round_trips
    for job in (store.stores([]), store.loads([]), store.wait(store.submit_stores([]), 10)):
        assert job.status == "ok" and job.value == [] and job.nbytes == 0
    assert store.metrics().round_trips == before


def test_lookup_does_not_count_an_evicted_unit_still_indexed(store, admin) -> None:
    store.stores([(k, 0, row(NS, k), k) for k in range(4)])
    admin.delete(store.unit_key(2, 0, LAYERS))  # as allkeys-lru would: the index stays
    assert admin.zrange(store.index_key(2), 0, -1) == [b"0-32"]
    assert store.lookup(list(range(4)), 0, LAYERS) == 2


def test_load_misses_leave_the_destination_unreported(store) -> None:
    store.store(b"present", 0, row(NS, 1), 0)
    outs = [np.zeros(NS.total_bytes, np.uint8) for _ in range(2)]
    job = store.loads([(b"present", 0, LAYERS, outs[0]), (b"absent", 0, LAYERS, outs[1])])
    assert job.status == "miss"
    assert [o.status for o in job.value] == ["ok", "miss"]
    assert job.value[1].detail == "not stored"
    assert np.array_equal(outs[0], row(NS, 1))
    assert not outs[1].any()  # nothing was ever written into a missed destination
    assert store.metrics().misses == 1


def test_first_writer_wins_within_a_process(store, admin) -> None:
    first, second = row(NS, 1), row(NS, 2)  # two different units for one key
    assert store.store(b"k", 0, first, 0).nbytes == first.nbytes
    job = store.store(b"k", 0, second, 0)
    assert job.status == "ok" and job.nbytes == 0 and "already stored" in job.detail
    out = np.zeros_like(first)
    assert store.load(b"k", 0, LAYERS, out).ok and np.array_equal(out, first)
    m = store.metrics()
    assert (m.units_stored, m.stores_skipped) == (1, 1)


def test_values_are_the_file_store_encoding(store, admin) -> None:
    payload = row(NS, 5)
    store.store(b"same-bytes", 0, payload, position=9)
    value = admin.get(store.unit_key(b"same-bytes", 0, LAYERS))
    assert value == encode_unit(NS, b"same-bytes", 0, LAYERS, 9, payload)


def test_key_names_follow_the_documented_scheme(store) -> None:
    kd = key_digest(b"named")  # the file store's key directory name
    tag = f"ckv:v1:{{{NS.hex[:32]}:{kd}}}"
    assert store.unit_key(b"named", 2, 9) == f"{tag}:2-9"
    assert store.index_key(b"named") == f"{tag}:idx"
    store.store(b"named", 2, row(NS, 1, 2, 9), 0)
    assert store.lookup([b"named"], 2, 9) == 1  # what the store wrote is what it names


def test_units_of_another_namespace_are_invisible(server, store) -> None:
    store.store(b"shared", 0, row(NS, 1), 0)
    other_ns = small_namespace(32, name="another-model")
    with RedisStore(server.url, other_ns) as other:
        assert other.lookup([b"shared"], 0, LAYERS) == 0
        assert other.load(b"shared", 0, LAYERS, np.zeros(NS.total_bytes, np.uint8)).status == "miss"
        assert other.metrics().corrupt_detected == 0


# ---------------------------------------------------------------------- pipeline splits


def test_cross_split_reads(store) -> None:
    key = b"split"
    # PP=4 writer: four stages of 8 layers each.
    for first in range(0, LAYERS, 8):
        assert store.store(key, first, row(NS, 1, first, first + 8), 3).ok
    for first, end in [(8, 24), (0, LAYERS), (4, 28), (9, 10), (24, 32)]:
        assert store.lookup([key], first, end) == 1
        out = np.zeros(NS.layer_bytes(first, end), np.uint8)
        job = store.load(key, first, end, out)
        assert job.status == "ok", job.detail
        assert np.array_equal(out, row(NS, 1, first, end)), (first, end)
    # A PP=2 writer adds [0, 16); the exact unit is used when it exists.
    assert store.store(key, 0, row(NS, 1, 0, 16), 3).ok
    out = np.zeros(NS.layer_bytes(0, 16), np.uint8)
    assert store.load(key, 0, 16, out).ok and np.array_equal(out, row(NS, 1, 0, 16))


def test_cross_split_batch_and_gaps(store) -> None:
    store.stores(
        [
            (b"a", 0, row(NS, 1, 0, 16), 0),
            (b"a", 16, row(NS, 1, 16, 32), 0),
            (b"b", 0, row(NS, 2, 0, 8), 1),  # b lacks [8, 16)
            (b"b", 16, row(NS, 2, 16, 32), 1),
        ]
    )
    assert store.lookup([b"a", b"b"], 8, 24) == 1
    assert store.lookup([b"b"], 16, 32) == 1 and store.lookup([b"b"], 0, 8) == 1
    outs = [np.zeros(NS.layer_bytes(8, 24), np.uint8) for _ in range(2)]
    job = store.loads([(b"a", 8, 24, outs[0]), (b"b", 8, 24, outs[1])])
    assert [o.status for o in job.value] == ["ok", "miss"]
    assert np.array_equal(outs[0], row(NS, 1, 8, 24))


# ---------------------------------------------------------------------- corruption


def corrupt(admin: redis.Redis, key: str, how: str) -> None:
    value = admin.get(key)
    assert value is not None
    if how == "payload-bit":
        admin.setrange(key, len(value) - 100, bytes([value[-100] ^ 0x01]))
    elif how == "checksum":
        admin.setrange(key, 80, bytes([value[80] ^ 0xFF]))
    elif how == "truncated":
        admin.set(key, value[:-1])
    elif how == "extended":
        admin.append(key, b"\x00")
    elif how == "garbage":
        admin.set(key, b"not a unit at all")
    elif how == "layer-range":
        admin.setrange(key, 20, (1).to_bytes(4, "little"))  # first_layer 0 -> 1
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    "how", ["payload-bit", "checksum", "truncated", "extended", "garbage", "layer-range"]
)
def test_corrupt_value_is_a_counted_deleted_miss(store, admin, how) -> None:
    payload = row(NS, 1)
    store.store(b"victim", 0, payload, 0)
    unit_key = store.unit_key(b"victim", 0, LAYERS)
    corrupt(admin, unit_key, how)
    sentinel = np.full(NS.total_bytes, 0xA5, np.uint8)
    out = sentinel.copy()
    job = store.load(b"victim", 0, LAYERS, out)
    assert job.status == "miss" and "corrupt" in job.detail
    assert np.array_equal(out, sentinel)  # verified before any byte is copied: none were
    m = store.metrics()
    assert (m.corrupt_detected, m.values_deleted, m.hits) == (1, 1, 0)
    assert admin.exists(unit_key) == 0
    assert store.lookup([b"victim"], 0, LAYERS) == 0  # dropped from the index too
    # The next writer can publish a good unit again.
    assert store.store(b"victim", 0, payload, 0).nbytes == payload.nbytes
    assert store.load(b"victim", 0, LAYERS, out).ok and np.array_equal(out, payload)


# Units larger than the 1 MiB read buffer of the tier's direct replies.
BIG = small_namespace(32, head_size=128, tp=1, total_heads=8, block_size=16)  # 2 MiB units


@pytest.mark.parametrize("how", ["payload-bit", "truncated", "garbage"])
def test_big_units_in_one_batch_around_a_corrupt_one(server, admin, how) -> None:
    assert BIG.total_bytes == 2 << 20
    payloads = [row(BIG, k) for k in range(3)]
    with RedisStore(server.url, BIG) as store:
        assert store.stores([StoreItem(k, 0, p, k) for k, p in enumerate(payloads)]).ok
        corrupt(admin, store.unit_key(1, 0, BIG.num_layers), how)
        sentinel = np.full(BIG.total_bytes, 0xA5, np.uint8)
        outs = [sentinel.copy() for _ in payloads]
        job = store.loads([LoadItem(k, 0, BIG.num_layers, o) for k, o in enumerate(outs)])
        statuses = [o.status for o in job.value]
        assert statuses == ["ok", "miss", "ok"], [o.detail for o in job.value]
        assert "corrupt" in job.value[1].detail
        assert np.array_equal(outs[0], payloads[0]) and np.array_equal(outs[2], payloads[2])
        assert np.array_equal(outs[1], sentinel)  # verified before any byte is copied
        # The same connection reads the next batch in step (no reply left behind).
        outs = [np.zeros(BIG.total_bytes, np.uint8) for _ in range(2)]
        job = store.loads([LoadItem(k, 0, BIG.num_layers, o) for k, o in zip((2, 0), outs)])
        assert job.ok and np.array_equal(outs[0], payloads[2])
        assert np.array_equal(outs[1], payloads[0])
        m = store.metrics()
        assert (m.hits, m.misses, m.corrupt_detected) == (4, 1, 1)


def test_another_keys_unit_at_this_name_is_refused(store, admin) -> None:
    store.store(b"A", 0, row(NS, 1), 0)
    store.store(b"B", 0, row(NS, 2), 0)
    admin.set(store.unit_key(b"B", 0, LAYERS), admin.get(store.unit_key(b"A", 0, LAYERS)))
    out = np.zeros(NS.total_bytes, np.uint8)
    job = store.load(b"B", 0, LAYERS, out)
    assert job.status == "miss" and "another key" in job.detail
    assert store.metrics().corrupt_detected == 1


def test_a_value_far_longer_than_its_unit_is_never_held_whole(store, admin) -> None:
    """A value at a unit's name much longer than the unit (Redis allows 512 MiB) is a
    counted, deleted miss, read through in bounded pieces: never allocated whole."""
    import tracemalloc

    payloads = [row(NS, k) for k in range(3)]
    assert store.stores([StoreItem(k, 0, p, k) for k, p in enumerate(payloads)]).ok
    admin.append(store.unit_key(1, 0, LAYERS), bytes(48 << 20))
    sentinel = np.full(NS.total_bytes, 0xA5, np.uint8)
    outs = [sentinel.copy() for _ in payloads]
    tracemalloc.start()
    try:
        job = store.loads([LoadItem(k, 0, LAYERS, o) for k, o in enumerate(outs)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [o.status for o in job.value] == ["ok", "miss", "ok"], job.detail
    assert "corrupt" in job.value[1].detail
    assert np.array_equal(outs[0], payloads[0]) and np.array_equal(outs[2], payloads[2])
    assert np.array_equal(outs[1], sentinel)
    assert peak < 16 << 20, f"{peak} bytes allocated for a 48 MiB value"
    assert admin.exists(store.unit_key(1, 0, LAYERS)) == 0
    # The connection is still in step.
    out = np.zeros(NS.total_bytes, np.uint8)
    assert store.load(2, 0, LAYERS, out).ok and np.array_equal(out, payloads[2])


def test_corrupt_cover_falls_back_to_another_split(store, admin) -> None:
    key = b"fallback"
    store.stores(
        [
            (key, 0, row(NS, 1, 0, 16), 0),
            (key, 0, row(NS, 1, 0, 8), 0),
            (key, 8, row(NS, 1, 8, 16), 0),
        ]
    )
    corrupt(admin, store.unit_key(key, 0, 16), "payload-bit")
    out = np.zeros(NS.layer_bytes(4, 12), np.uint8)
    job = store.load(key, 4, 12, out)
    assert job.status == "ok" and "corrupt" in job.detail
    assert np.array_equal(out, row(NS, 1, 4, 12))
    assert store.metrics().corrupt_detected == 1


# ---------------------------------------------------------------------- units above max_value_bytes


def test_big_units_are_stored_as_units_of_layer_ranges(server, admin) -> None:
    with RedisStore(server.url, NS, max_value_bytes=4096) as store:
        payloads = {i: row(NS, i) for i in range(6)}
        job = store.stores([(i, 0, p, i) for i, p in payloads.items()])
        assert job.status == "ok" and job.nbytes == 6 * NS.total_bytes, job.detail
        assert store.metrics().units_stored == 6 * len(PIECES)
        assert len(unit_keys_on_server(admin)) == 6 * len(PIECES)
        for a, b in PIECES:  # each piece is a whole unit in the one format, at most 4096 bytes
            value = admin.get(store.unit_key(0, a, b))
            assert len(value) <= 4096
            assert value == encode_unit(NS, 0, a, b, 0, row(NS, 0, a, b))
        assert admin.zrange(store.index_key(0), 0, -1) == sorted(
            f"{a}-{b}".encode() for a, b in PIECES
        )
        assert store.lookup(list(payloads), 0, LAYERS) == 6
        outs = {i: np.zeros(NS.total_bytes, np.uint8) for i in payloads}
        assert store.loads([(i, 0, LAYERS, outs[i]) for i in payloads]).ok
        for i in payloads:
            assert np.array_equal(outs[i], payloads[i])
    # A reader with the default value limit reads them too, for any range.
    with RedisStore(server.url, NS) as reader:
        out = np.zeros(NS.layer_bytes(3, 29), np.uint8)
        assert reader.load(4, 3, 29, out).ok and np.array_equal(out, row(NS, 4, 3, 29))


@pytest.mark.parametrize("how", ["payload-bit", "garbage", "missing"])
def test_a_bad_or_missing_piece_is_a_miss_and_removed(server, admin, how) -> None:
    with RedisStore(server.url, NS, max_value_bytes=4096) as store:
        store.store(7, 0, row(NS, 7), 0)
        piece = store.unit_key(7, *PIECES[2])
        if how == "missing":
            admin.delete(piece)  # as an eviction would
        else:
            corrupt(admin, piece, how)
        sentinel = np.full(NS.total_bytes, 0x5A, np.uint8)
        out = sentinel.copy()
        job = store.load(7, 0, LAYERS, out)
        assert (
            job.status == "miss" and ("vanished" if how == "missing" else "corrupt") in job.detail
        )
        m = store.metrics()
        assert (m.stale_removed, m.corrupt_detected) == ((1, 0) if how == "missing" else (0, 1))
        assert admin.exists(piece) == 0
        assert b"14-21" not in admin.zrange(store.index_key(7), 0, -1)
        assert store.lookup([7], 0, LAYERS) == 0 and store.lookup([7], 0, 14) == 1
        # The next writer publishes the missing piece only: the others are there already.
        job = store.store(7, 0, row(NS, 7), 0)
        assert job.nbytes == NS.layer_bytes(*PIECES[2]) and "4 of 5 units" in job.detail
        assert store.load(7, 0, LAYERS, out).ok and np.array_equal(out, row(NS, 7))


# ---------------------------------------------------------------------- concurrent writers

WRITER = """
import json, os, sys, time
import numpy as np
from helpers.store import row, small_namespace
from canonical_ops.units import RedisStore

url, writer, count, max_value, go = sys.argv[1:6]
writer, count, max_value = int(writer), int(count), int(max_value)
ns = small_namespace(32)
items = [(f"race-{i}".encode(), 0, row(ns, 1000 * writer + i), i) for i in range(count)]
order = np.random.default_rng(writer).permutation(count)
with RedisStore(url, ns, max_value_bytes=max_value) as store:
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    statuses = [store.store(*items[i]).status for i in order]
    m = store.metrics()
print(json.dumps({"statuses": sorted(set(statuses)), "stored": m.units_stored,
                  "skipped": m.stores_skipped}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("max_value", [1 << 20, 4096], ids=["one-value", "pieces"])
def test_first_writer_wins_between_racing_processes(server, admin, tmp_path, max_value) -> None:
    count = 60
    go = str(tmp_path / "go")
    pieces = PIECES if max_value == 4096 else [(0, LAYERS)]
    seen = {"ok": 0, "wrong": 0, "miss": 0}
    stop = threading.Event()

    def one_writers_per_piece(i: int, out: np.ndarray) -> bool:
        """Every stored value is one writer's unit (pieces of two writers may meet)."""
        offsets = NS.payload_offsets(0, LAYERS)
        return all(
            any(np.array_equal(out[offsets[a] : offsets[b]], row(NS, w * 1000 + i, a, b))
                for w in (1, 2))
            for a, b in pieces
        )  # fmt: skip

    def read_while_they_write(store: RedisStore) -> None:
        out = np.zeros(NS.total_bytes, np.uint8)
        while not stop.is_set():
            for i in range(count):
                job = store.load(f"race-{i}".encode(), 0, LAYERS, out)
                if job.ok:
                    seen["ok"] += 1
                    seen["wrong"] += not one_writers_per_piece(i, out)
                else:
                    seen["miss"] += 1

    writers = [
        start_child(WRITER, server.url, str(w), str(count), str(max_value), go) for w in (1, 2)
    ]
    with RedisStore(server.url, NS) as reader:
        thread = threading.Thread(target=read_while_they_write, args=(reader,))
        try:
            for proc in writers:  # both connected and waiting at the barrier
                assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
            thread.start()
            open(go, "w").close()
            results = []
            for proc in writers:
                out, err = proc.communicate(timeout=120)
                assert proc.returncode == 0, err
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            stop.set()
            if thread.is_alive():
                thread.join(30)
            for proc in writers:
                if proc.poll() is None:
                    proc.kill()
        corrupt_seen = reader.metrics().corrupt_detected
    assert all(r["statuses"] == ["ok"] for r in results)
    # Exactly one writer published each value; the other found it there.
    assert sum(r["stored"] for r in results) == count * len(pieces)
    assert sum(r["skipped"] for r in results) == count * len(pieces)
    # The concurrent reader never loaded a wrong or torn unit, nor saw a corrupt one.
    assert seen["wrong"] == 0 and corrupt_seen == 0 and seen["ok"] > 0, seen
    with RedisStore(server.url, NS) as store:
        out = np.zeros(NS.total_bytes, np.uint8)
        for i in range(count):
            assert store.load(f"race-{i}".encode(), 0, LAYERS, out).ok
            assert one_writers_per_piece(i, out)
        assert store.metrics().corrupt_detected == 0
    assert len(unit_keys_on_server(admin)) == count * len(pieces)


# ---------------------------------------------------------------------- expiry, eviction


def test_ttl_expiry_is_a_miss(server, admin) -> None:
    with RedisStore(server.url, NS, ttl_s=0.6) as store:
        store.stores([(b"short", 0, row(NS, 1), 0), (b"chunky", 0, row(NS, 2), 0)])
        assert 0 < admin.pttl(store.unit_key(b"short", 0, LAYERS)) <= 600
        assert 0 < admin.pttl(store.index_key(b"short")) <= 600
        assert store.lookup([b"short", b"chunky"], 0, LAYERS) == 2
        time.sleep(0.8)
        assert store.lookup([b"short"], 0, LAYERS) == 0
        out = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(b"short", 0, LAYERS, out).status == "miss"
        assert admin.keys("ckv:*") == []  # everything expired, nothing left behind
    with RedisStore(server.url, NS, ttl_s=0.6, max_value_bytes=4096) as store:
        store.store(b"chunky", 0, row(NS, 2), 0)
        assert len(admin.keys("ckv:*")) == len(PIECES) + 2  # pieces, index, description
        assert all(0 < admin.pttl(k) <= 600 for k in admin.keys("ckv:*"))
        time.sleep(0.8)
        assert admin.keys("ckv:*") == []


def test_lookup_skips_expired_ranges_of_a_live_index(server, admin) -> None:
    with RedisStore(server.url, NS, ttl_s=0.5) as short, RedisStore(server.url, NS) as long:
        short.store(b"k", 0, row(NS, 1, 0, 16), 0)
        long.store(b"k", 16, row(NS, 1, 16, 32), 0)
        assert long.lookup([b"k"], 0, LAYERS) == 1
        time.sleep(0.7)  # [0, 16) expired; the index (no TTL) still lists it
        assert long.lookup([b"k"], 0, LAYERS) == 0
        assert long.lookup([b"k"], 16, LAYERS) == 1


@pytest.mark.slow
@pytest.mark.parametrize("max_value", [1 << 20, 16384], ids=["one-value", "pieces"])
def test_eviction_under_maxmemory_is_only_ever_a_miss(tmp_path_factory, max_value) -> None:
    ns = small_namespace(32, head_size=64)  # 4 KiB pages: 128 KiB units
    srv = new_server(tmp_path_factory, "lru", maxmemory=6 << 20)
    try:
        with RedisStore(srv.url, ns, max_value_bytes=max_value) as store:
            count = 160  # 20 MiB of units into 6 MiB
            for start in range(0, count, 16):
                if start == count - 16:  # the server's LRU clock ticks in seconds:
                    time.sleep(1.1)  # make the last batch the most recently used
                job = store.stores([(i, 0, row(ns, i), i) for i in range(start, start + 16)])
                assert job.ok and job.nbytes == 16 * ns.total_bytes, job.detail
            assert srv.client().info("stats")["evicted_keys"] > 0
            outs = [np.zeros(ns.total_bytes, np.uint8) for _ in range(count)]
            hits = 0
            for start in reversed(range(0, count, 16)):  # the most recent batch first
                batch = range(start, start + 16)
                job = store.loads([(i, 0, 32, outs[i]) for i in batch])
                for i, outcome in zip(batch, job.value):
                    assert outcome.status in ("ok", "miss"), outcome
                    if outcome.status == "ok":
                        hits += 1
                        assert np.array_equal(outs[i], row(ns, i))  # never a wrong byte
            m = store.metrics()
            assert 0 < hits < count and m.misses == count - hits
            assert m.corrupt_detected == 0
    finally:
        srv.stop()


# ---------------------------------------------------------------------- credentials


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    users = [
        AclUser("engine", "engine-pw"),
        # Exactly the commands the tier needs, on its keys only.
        AclUser(
            "minimal",
            "minimal-pw",
            "+get +set +exists +del +persist +pexpire +zadd +zrange +zremrangebyscore +zrem",
            "~ckv:*",
        ),
        AclUser("readonly", "readonly-pw", "+get +zrange", "~ckv:*"),
    ]
    srv = new_server(tmp_path_factory, "secured", password="admin-pw", users=users)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("url_auth", "kwargs"),
    [
        ((None, "admin-pw"), {}),
        (("engine", "engine-pw"), {}),
        (("minimal", "minimal-pw"), {}),
        ((None, None), {"username": "engine", "password": "engine-pw"}),
        (("engine", "wrong"), {"password": "engine-pw"}),  # arguments win over the URL
    ],
)
def test_credentials_that_work(secured, url_auth, kwargs) -> None:
    with RedisStore(secured.url_for(*url_auth), NS, **kwargs) as store:
        assert store.store(b"auth", 0, row(NS, 1), 0).ok
        out = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(b"auth", 0, LAYERS, out).ok and np.array_equal(out, row(NS, 1))


@pytest.mark.parametrize(
    ("username", "password", "match"),
    [
        (None, "wrong-pw", "authentication failed"),
        ("nobody", "whatever", "authentication failed"),
        ("engine", "admin-pw", "authentication failed"),
        (None, None, "requires a password: put it in the URL or pass password="),
        ("readonly", "readonly-pw", "may not run the commands"),
    ],
)
def test_bad_credentials_fail_at_start_up_naming_the_url(
    secured, username, password, match
) -> None:
    url = secured.url_for(username, password)
    with pytest.raises(RedisStoreError, match=match) as info:
        RedisStore(url, NS, require_server=False)  # never degraded: credentials are wrong
    message = str(info.value)
    assert f"127.0.0.1:{secured.port}" in message and "url" in message
    if password:
        assert password not in message  # redacted


def test_db_number_from_url_and_argument(server, admin) -> None:
    with RedisStore(server.url + "/3", NS) as s3, RedisStore(server.url, NS, db=4) as s4:
        s3.store(b"db", 0, row(NS, 1), 0)
        assert s4.lookup([b"db"], 0, LAYERS) == 0
        assert s3.lookup([b"db"], 0, LAYERS) == 1
        assert server.client(db=3).exists(s3.unit_key(b"db", 0, LAYERS)) == 1
    assert admin.keys("ckv:*") == []  # db 0 untouched


def test_unix_socket_url(tmp_path_factory) -> None:
    directory = tmp_path_factory.mktemp("unix")
    sock = str(directory / "redis.sock")
    srv = new_server(tmp_path_factory, "unix-srv", extra=["--unixsocket", sock])
    try:
        with RedisStore(f"unix://{sock}?db=2", NS) as store:
            assert store.store(b"u", 0, row(NS, 1), 0).nbytes > 0
            out = np.zeros(NS.total_bytes, np.uint8)
            assert store.load(b"u", 0, LAYERS, out).ok and np.array_equal(out, row(NS, 1))
        assert srv.client(db=2).exists(store.unit_key(b"u", 0, LAYERS)) == 1
    finally:
        srv.stop()


# ---------------------------------------------------------------------- back-pressure


def test_back_pressure_refuses_without_blocking(server, admin) -> None:
    pool = JobPool(threads=1, queue_depth=1)
    release = threading.Event()
    try:
        with RedisStore(server.url, NS, pool=pool) as store:
            blocker = pool.submit("block", lambda: release.wait(30) and None)
            deadline = time.monotonic() + 10
            while pool.stats().running < 1:  # the only thread is busy...
                assert time.monotonic() < deadline
                time.sleep(0.001)
            filler = pool.submit("fill", lambda: None)  # ...and the queue is full
            assert not filler.refused
            started = time.perf_counter()
            refused = [
                store.submit_store(b"x", 0, row(NS, 1), 0),
                store.submit_stores([(b"y", 0, row(NS, 2), 0), (b"z", 0, row(NS, 3), 0)]),
                store.submit_load(b"x", 0, LAYERS, np.zeros(NS.total_bytes, np.uint8)),
                store.submit_lookup([b"x"], 0, LAYERS),
            ]
            assert time.perf_counter() - started < 0.5
            assert [job.status for job in refused] == ["refused"] * 4
            m = store.metrics()
            assert (m.stores_refused, m.loads_refused, m.lookups_refused) == (3, 1, 1)
            release.set()
            pool.wait(blocker, 10)
            pool.wait(filler, 10)
            job = store.wait(store.submit_store(b"x", 0, row(NS, 1), 0), timeout=10)
            assert job.ok
    finally:
        release.set()
        pool.close()


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"url": 42}, TypeError, "url"),
        ({"url": "http://127.0.0.1:1"}, ValueError, "url: expected a URL with scheme"),
        ({"ttl_s": 0}, ValueError, "ttl_s"),
        ({"ttl_s": "1"}, TypeError, "ttl_s"),
        ({"max_value_bytes": 100}, ValueError, r"max_value_bytes: expected an int in \[4096"),
        ({"max_value_bytes": 1 << 30}, ValueError, "max_value_bytes"),
        ({"max_value_bytes": 4096.0}, TypeError, "max_value_bytes"),
        ({"max_pipeline_bytes": 4096}, ValueError, "max_pipeline_bytes"),
        ({"retries": -1}, ValueError, "retries"),
        ({"retries": True}, TypeError, "retries"),
        ({"socket_timeout_s": -1}, ValueError, "socket_timeout_s"),
        ({"breaker_failures": 0}, ValueError, "breaker_failures"),
        ({"breaker_backoff_s": 5, "breaker_max_backoff_s": 1}, ValueError, "breaker_max"),
        ({"db": -1}, ValueError, "db"),
        ({"cluster": "yes"}, TypeError, "cluster"),
        ({"key_prefix": "a{b}"}, ValueError, "key_prefix"),
        ({"key_prefix": 3}, TypeError, "key_prefix"),
        ({"url": "redis+cluster://127.0.0.1:1", "cluster": False}, ValueError, "cluster"),
        ({"client_kwargs": {"decode_responses": True}}, ValueError, "decode_responses"),
        ({"client_kwargs": [1]}, TypeError, "client_kwargs"),
        ({"ssl_ca_certs": "/ca.pem"}, ValueError, "ssl_ca_certs: TLS files need a rediss://"),
        ({"namespace": "ns"}, TypeError, "namespace"),
        ({"threads": 2, "pool": "shared"}, TypeError, "pool"),
    ],
)
def test_bad_arguments_name_themselves(server, kwargs, error, match) -> None:
    kwargs = {"url": server.url, "namespace": NS, **kwargs}
    with pytest.raises(error, match=match):
        RedisStore(kwargs.pop("url"), kwargs.pop("namespace"), **kwargs)


def test_bad_items_name_themselves(store) -> None:
    good = row(NS, 1)
    cases = [
        (lambda: store.submit_store(b"k", 0, good[:-1], 0), ValueError, "payload"),
        (lambda: store.submit_store(b"k", 0, good, -1), ValueError, "position"),
        (lambda: store.submit_store(b"k", 40, good, 0), ValueError, "first"),
        (lambda: store.submit_store(b"", 0, good, 0), ValueError, "key"),
        (lambda: store.submit_stores([(b"k", 0, good)]), TypeError, r"items\[0\]"),
        (lambda: store.submit_stores([(b"k", 0, good, 0), (b"k", 0, good, 0.5)]), TypeError,
         r"items\[1\].position"),
        (lambda: store.submit_load(b"k", 0, 8, np.zeros(10, np.uint8)), ValueError,
         "destination: expected"),
        (lambda: store.submit_load(b"k", 0, LAYERS, bytes(NS.total_bytes)), ValueError,
         "writable"),
        (lambda: store.submit_loads([LoadItem(b"k", 8, 4, good)]), ValueError, "end"),
        (lambda: store.lookup(b"k", 0, 8), TypeError, "keys"),
        (lambda: store.lookup([b"k"], 0, 33), ValueError, "end"),
    ]  # fmt: skip
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.submit_store(b"k", 0, good, 0)


def test_unreachable_server_at_start_up(tmp_path) -> None:
    port = free_port()
    with pytest.raises(RedisStoreError, match=f"url: no Redis server reachable at .*:{port}"):
        RedisStore(f"redis://:secret@127.0.0.1:{port}", NS, connect_timeout_s=0.5)
    try:
        RedisStore(f"redis://:secret@127.0.0.1:{port}", NS, connect_timeout_s=0.5)
    except RedisStoreError as error:
        assert "secret" not in str(error)
