"""Engines sharing canonical pages through one real Redis server, end to end.

Every engine here is its own ``python -m canonical_ops demo`` process: its own
process group of TP x PP ranks, its own /dev/shm regions, its own connections,
as two nodes would be. They share nothing but the server (and, for the
two-tier cases, a node's own directory). A ``--phase write`` engine persists a
prompt and exits; a ``--phase read`` engine of another topology starts with
empty regions and must get every page from the server, verified against the
unsharded truth that both derive from the preset and the seed alone.
Unit-level properties of the tier (batching, chunks, racing writers, breaker,
TLS, cluster) are tested in test_redis_*.py; these tests show what engines do
with them. The StageCache test at the end keeps one engine alive across a
server crash and restart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.demo_cli import (
    BLOCKS,
    PROMPT,
    ROOT,
    assert_usage_error,
    demo_json,
    prompt_keys,
    run_demo,
)
from helpers.redis_server import (
    RedisBinaryMissing,
    RedisClusterNodes,
    RedisServer,
    redis_binaries,
)
from helpers.store import row, small_namespace

from canonical_ops.engine import PageManager, StageCache
from canonical_ops.units import RedisStore
from canonical_ops.units.files import key_digest

pytestmark = pytest.mark.slow

MLA = ["--preset", "deepseek-v3", "--layers", "4"]


def new_server(directory, **kwargs) -> RedisServer:
    try:
        redis_binaries()
    except RedisBinaryMissing as error:  # never a skip: `make test` installs it
        pytest.fail(str(error))
    return RedisServer(str(directory), **kwargs).start()


@pytest.fixture
def server(tmp_path):
    srv = new_server(tmp_path / "redis")
    try:
        yield srv
    finally:
        srv.stop()


def url(srv: RedisServer, db: int = 0) -> str:
    return f"{srv.url}/{db}"


def engine(phase: str, *stores: str, args=(), prompt=PROMPT, expect: int | None = None) -> dict:
    flags = [item for store in stores for item in ("--store", store)]
    return demo_json(*prompt, *flags, "--phase", phase, *args, expect=expect)


def tier(summary: dict, engine_name: str, name: str) -> dict:
    [report] = [t for t in summary["tiers"] if t["engine"] == engine_name and t["name"] == name]
    return report


def assert_read_passed(summary: dict, blocks: int = BLOCKS) -> None:
    assert summary["verdict"] == "PASS", summary["failures"]
    assert summary["pages_loaded"] == blocks and summary["pages_missed"] == 0
    assert summary["corrupt_detected"] == 0 and summary["bytes_wrong"] == 0
    assert summary["fill"]["pages_filled"] == blocks and summary["fill"]["bytes"] > 0
    assert summary["bytes_checked"] > 0


def unit_keys(srv: RedisServer, prompt=PROMPT) -> dict[int, list[bytes]]:
    """Block index -> the server keys of that block's units (not its index)."""
    client = srv.client()
    out = {}
    for block, block_hash in enumerate(prompt_keys(*prompt)):
        keys = client.keys(f"*{key_digest(block_hash)}*")
        out[block] = sorted(k for k in keys if not k.endswith(b":idx"))
    return out


# ---------------------------------------------------------------------- sharing


SHARED = {
    "tp8-to-tp2": (PROMPT, ["--writer-tp", "8"], ["--reader-tp", "2"]),
    "tp2xpp2-to-tp4": (PROMPT, ["--writer-tp", "2", "--writer-pp", "2"], ["--reader-tp", "4"]),
    # MLA: the latent is replicated on every TP rank and stored once
    "mla-tp4-to-tp2xpp3": (
        [*MLA, "--prompt-tokens", "128"],
        ["--writer-tp", "4"],
        ["--reader-tp", "2", "--reader-pp", "3"],
    ),
}


@pytest.mark.parametrize(("prompt", "written", "reread"), SHARED.values(), ids=SHARED.keys())
def test_two_engines_share_pages_through_one_server(server, prompt, written, reread):
    blocks = BLOCKS if prompt is PROMPT else 2  # deepseek-v3 blocks are 64 tokens
    w = engine("write", url(server, 3), args=written, prompt=prompt, expect=0)
    stages = len(w["topology"]["writer_stages"])
    assert w["persist"]["units_ok"] == w["persist"]["units_expected"] == blocks * stages
    assert w["persist"]["pages_complete_in_store"] == {"redis": blocks}
    assert w["stores"] == [url(server, 3)]
    assert server.client(db=3).dbsize() > 0 and server.client(db=0).dbsize() == 0  # its DB
    r = engine("read", url(server, 3), args=reread, prompt=prompt, expect=0)
    assert r["namespace"] == w["namespace"]  # parallelism is not part of it
    assert_read_passed(r, blocks)
    assert r["fill"]["pages_by_tier"] == {"redis": blocks * len(r["topology"]["reader_stages"])}
    assert tier(r, "read", "redis")["hits"] >= blocks and tier(r, "read", "redis")["misses"] == 0


def test_two_engines_share_pages_through_a_redis_cluster(tmp_path):
    """A TP=8 engine's units land on every node of a 3-node cluster; a TP=2 x PP=2 engine
    reads them all (a block's unit and index share a hash tag, hence a node)."""
    try:
        redis_binaries()
    except RedisBinaryMissing as error:
        pytest.fail(str(error))
    nodes = RedisClusterNodes(str(tmp_path / "cluster"), password="cluster-pw").start()
    try:
        address = f"redis+cluster://:cluster-pw@127.0.0.1:{nodes.nodes[0].port}"
        w = engine("write", address, args=["--writer-tp", "8"], expect=0)
        assert w["persist"]["units_ok"] == BLOCKS
        assert "cluster-pw" not in json.dumps(w) + w["_stderr"]  # redacted everywhere
        per_node = [node.client().dbsize() for node in nodes.nodes]
        # units + indexes; the demo's block hashes are deterministic and reach every node
        assert sum(per_node) >= 2 * BLOCKS and all(per_node), per_node
        r = engine("read", address, args=["--reader-tp", "2", "--reader-pp", "2"], expect=0)
        assert_read_passed(r)
    finally:
        nodes.stop()


def test_both_phases_and_the_demo_report_through_redis(server):
    summary = engine("both", url(server), args=["--writer-tp", "4", "--reader-tp", "2"], expect=0)
    assert_read_passed(summary)
    assert [t["engine"] for t in summary["tiers"]] == ["write", "read"]
    lines = summary["_stderr"]
    assert "persist: 8/8 units" in lines and "fill: 8/8 pages found in the store" in lines


def test_two_tiers_read_redis_then_keep_the_pages_in_local_files(server, tmp_path):
    """Node A persists to the server only; node B (files + server) gets everything from the
    server and keeps it in its directory; after the server is gone B's restart reads files."""
    local = tmp_path / "node-b"
    local.mkdir()
    engine("write", url(server), args=["--writer-tp", "8"], expect=0)
    # flag order does not matter: the directory is always looked up first
    r = engine("read", url(server), str(local), args=["--reader-tp", "2"], expect=0)
    assert_read_passed(r)
    assert r["stores"] == [str(local), url(server)]
    assert r["fill"]["pages_by_tier"] == {"files": 0, "redis": BLOCKS}
    assert r["promote"]["to"] == "files" and r["promote"]["units_ok"] == BLOCKS
    assert r["promote"]["units_failed"] == r["promote"]["units_refused"] == 0
    # Local hits first: a second read on node B touches the server for nothing.
    again = engine("read", str(local), url(server), args=["--reader-tp", "4"], expect=0)
    assert_read_passed(again)
    assert again["fill"]["pages_by_tier"] == {"files": BLOCKS, "redis": 0}
    assert again["promote"]["units_submitted"] == 0  # nothing came from the server
    server.kill()
    alone = engine("read", str(local), args=["--reader-tp", "1", "--reader-pp", "2"], expect=0)
    assert_read_passed(alone)
    # --no-promote: pages still come from the server, the directory is left alone
    server.start()
    engine("write", url(server), args=["--writer-tp", "2"], expect=0)
    other = tmp_path / "node-c"
    other.mkdir()
    r = engine("read", str(other), url(server), args=["--no-promote"], expect=0)
    assert_read_passed(r)
    assert r["promote"] is None and not list(other.rglob("*.ckv"))


# ---------------------------------------------------------------------- damage and loss


def test_a_value_corrupted_in_the_server_is_a_miss_never_a_load(server):
    engine("write", url(server), args=["--writer-tp", "4"], expect=0)
    keys = unit_keys(server)
    assert all(len(keys[b]) == 1 for b in range(BLOCKS))  # one value per unit here
    client = server.client()
    victim = keys[3][0]
    value = client.get(victim)
    client.setrange(victim, len(value) - 100, bytes([value[-100] ^ 0x10]))  # one payload bit
    r = engine("read", url(server), args=["--reader-tp", "2"], expect=1)
    assert r["verdict"] == "FAIL"
    assert r["corrupt_detected"] == 1 and r["bytes_wrong"] == 0
    assert r["pages_loaded"] == 3 and r["pages_missed"] == BLOCKS - 3  # the prefix before it
    assert any("only 3/8 prompt pages were found in the store" in f for f in r["failures"])
    assert not any("differ from the unsharded truth" in f for f in r["failures"])
    assert client.exists(victim) == 0  # the bad value was deleted, not served again
    # The next writer repairs it (first writer wins only among good values).
    engine("write", url(server), args=["--writer-tp", "8"], expect=0)
    assert_read_passed(engine("read", url(server), args=["--reader-tp", "1"], expect=0))


def test_small_maxmemory_evicts_into_misses_only(tmp_path):
    srv = new_server(tmp_path / "redis")
    try:
        admin = srv.client()
        baseline = admin.info("memory")["used_memory"]
        # room for about 3 of the 8 units (128 KiB payload each) above the server's own use
        admin.config_set("maxmemory", baseline + 3 * 140_000)
        admin.config_set("maxmemory-policy", "allkeys-lru")
        w = engine("write", url(srv), args=["--writer-tp", "4"])
        assert w["pages_ready"] == BLOCKS and "Traceback" not in w["_stderr"]
        assert srv.client().info("stats")["evicted_keys"] > 0
        r = engine("read", url(srv), args=["--reader-tp", "2"], expect=1)
        assert r["corrupt_detected"] == 0 and r["bytes_wrong"] == 0  # misses only
        assert r["pages_loaded"] < BLOCKS and r["pages_missed"] == BLOCKS - r["pages_loaded"]
        assert r["pages_loaded"] == r["fill"]["pages_filled"]
        assert not any("differ from the unsharded truth" in f for f in r["failures"])
    finally:
        srv.stop()


KILL_DURING_PERSIST = """
import os, signal, sys
from canonical_ops.engine import cache as tiers
pid, argv, calls = int(sys.argv[1]), sys.argv[2:], []
original = tiers.StageCache.persist

def persist(self, *args, **kwargs):
    calls.append(self)
    if len(calls) == 2:  # the second pipeline stage, once the first one's units are stored
        calls[0].drain(60)
        os.kill(pid, signal.SIGKILL)
    return original(self, *args, **kwargs)

tiers.StageCache.persist = persist
from canonical_ops.demo import main
sys.exit(main(argv))
"""


def test_server_killed_mid_run_the_engine_goes_on_then_recovers(server):
    args = [*PROMPT, "--store", url(server), "--phase", "write", "--writer-pp", "2", "--json"]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", KILL_DURING_PERSIST, str(server.proc.pid), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert time.monotonic() - started < 120  # no hang on the dead server
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    w = json.loads(done.stdout)
    persist = w["persist"]
    assert persist["units_ok"] == BLOCKS  # the first stage's, before the crash
    assert persist["units_failed"] + persist["units_refused"] == BLOCKS  # dropped, counted
    assert persist["pages_ready_after_persist"] == BLOCKS  # the engine kept serving
    assert any("were not persisted" in f for f in w["failures"])
    assert not server.running
    server.start()  # same port, empty (no persistence): every page is a miss now
    r = engine("read", url(server), args=["--reader-tp", "2"], expect=1)
    assert r["pages_loaded"] == 0 and r["pages_missed"] == BLOCKS and r["bytes_wrong"] == 0
    engine("write", url(server), args=["--writer-tp", "2", "--writer-pp", "2"], expect=0)
    assert_read_passed(engine("read", url(server), args=["--reader-tp", "4"], expect=0))


def test_one_engine_keeps_serving_across_a_server_crash_and_recovers(server):
    """A StageCache over a RedisStore, alive through kill and restart: fills miss and free
    their pages, stores drop and unpin, nothing raises; then both work again by themselves."""
    ns = small_namespace(4)
    hashes = [f"block-{i}".encode() for i in range(6)]
    manager = PageManager(12)
    rows = np.zeros((12, ns.total_bytes), np.uint8)
    fast = dict(
        socket_timeout_s=0.5, connect_timeout_s=0.5, lookup_timeout_s=0.3, retries=1,
        breaker_failures=2, breaker_backoff_s=0.5, breaker_max_backoff_s=1.0,
    )  # fmt: skip
    with RedisStore(url(server), ns, **fast) as store:
        cache = StageCache(manager, rows, (0, ns.num_layers), ns, [store], names=["redis"])
        pages = manager.allocate(hashes)
        for i, page in enumerate(pages):
            rows[page] = row(ns, i)
            manager.complete_store(page, 0, generation=manager.generation(page))
        assert cache.persist(hashes[:3]).submitted == 3
        cache.drain(10)
        assert cache.metrics().tiers[0].stores_ok == 3
        server.kill()
        started = time.monotonic()
        persisted = cache.persist(hashes[3:])
        cache.drain(10)
        stored = cache.metrics().tiers[0]
        assert persisted.submitted + persisted.refused == 3
        assert stored.stores_ok == 3 and stored.stores_failed + stored.stores_refused == 3
        assert all(manager.state(p) == "ready" for p in pages)  # still served from the region
        # A second engine (empty region) asks for the prefix while the server is down.
        other_manager = PageManager(12)
        other_rows = np.full((12, ns.total_bytes), 0xA5, np.uint8)
        other = StageCache(
            other_manager, other_rows, (0, ns.num_layers), ns, [store], names=["redis"]
        )
        lookup = other.lookup(hashes, timeout=10)
        assert lookup.in_region == 0 and lookup.from_tiers == 0  # down: nothing, no raise
        other.fetch(hashes[:3], timeout=10)  # forced: the loads fail, pages freed again
        other.drain(10)
        assert other_manager.lookup(hashes) == 0 and other_manager.num_filling == 0
        assert (other_rows == 0xA5).all() or other.metrics().tiers[0].fills_ok == 0
        assert time.monotonic() - started < 15  # bounded by the timeouts and the breaker
        server.start()
        deadline = time.monotonic() + 20
        while True:  # the breaker probes the server again by itself
            before = cache.metrics().tiers[0].stores_ok
            cache.persist(hashes)
            cache.drain(10)
            if cache.metrics().tiers[0].stores_ok - before == len(hashes):
                break
            assert time.monotonic() < deadline, cache.metrics()
            time.sleep(0.2)
        lookup = other.lookup(hashes, timeout=10)
        assert lookup.from_tiers == len(hashes)
        other.fetch(hashes, lookup)
        other.drain(10)
        assert other_manager.lookup(hashes) == len(hashes)
        for i, h in enumerate(hashes):
            assert np.array_equal(other_rows[other_manager.page_of(h)], row(ns, i))
        cache.close(10)
        other.close(10)


# ---------------------------------------------------------------------- start-up errors


def test_a_wrong_or_missing_password_is_a_one_line_error_at_start_up(tmp_path):
    """A wrong password names authentication; a missing one (issue 26: Redis's raw `HELLO
    must be called ...`) says the server requires one and where to put it."""
    srv = new_server(tmp_path / "redis", password="right-pw")
    try:
        for user in (None, "nobody"):
            result = run_demo(*PROMPT, "--store", f"{srv.url_for(user, 'wrong-pw')}/0")
            shown = f"--store redis://{user + ':' if user else ''}***@127.0.0.1"
            line = assert_usage_error(result, shown, "authentication")
            assert "wrong-pw" not in line  # the password is never printed
        result = run_demo(*PROMPT, "--store", url(srv), "--phase", "read")
        line = assert_usage_error(result, "--store redis://127.0.0.1", "requires a password")
        assert "HELLO" not in line and "put it in the URL" in line
        # the right one works
        assert_read_passed(engine("both", f"{srv.url_for(None, 'right-pw')}/0", expect=0))
    finally:
        srv.stop()


def test_a_password_with_url_characters_is_never_printed(tmp_path):
    """Issue 26: an unencoded `/`, `#` or `?` in the password printed it whole (the demo's
    own redaction stopped at the `/`) in the header, the JSON and the errors."""
    password = "se/cr#et?x"
    srv = new_server(tmp_path / "redis", password=password)
    try:
        address = f"redis://:{password}@127.0.0.1:{srv.port}/0"
        summary = engine("both", address, expect=0)
        assert_read_passed(summary)
        assert summary["stores"] == [f"redis://***@127.0.0.1:{srv.port}/0"]
        text = json.dumps(summary) + summary["_stderr"]
        for piece in (password, "cr#et", "et?x"):
            assert piece not in text, piece
        human = run_demo(*PROMPT, "--store", address, "--phase", "read")
        assert human.returncode == 0 and "cr#et" not in human.stdout + human.stderr
    finally:
        srv.stop()


def test_an_unreachable_server_is_a_one_line_error_at_start_up(tmp_path):
    """Issue 26: the message recommended `require_server=False`, a Python argument no flag
    sets; it says what to do instead."""
    srv = new_server(tmp_path / "redis")
    address = url(srv)
    srv.stop()
    result = run_demo(*PROMPT, "--store", address, "--phase", "read")
    line = assert_usage_error(result, f"--store {address}", "start the server")
    assert "require_server" not in line


def test_a_hybrid_model_shares_kv_and_state_through_one_server(server, tmp_path):
    """Issue 24: the hybrid presets refused Redis (one directory only); through the same
    engines they share attention pages AND the request's state through a server, and the
    two-tier read keeps both in the node's files."""
    hybrid = ["--preset", "tiny-hybrid", "--prompt-tokens", "40"]  # 3 blocks
    w = engine("write", url(server), args=["--writer-tp", "4"], prompt=hybrid, expect=0)
    assert w["persist"]["units_ok"] == 3 and w["state"]["units_persisted"] == 1
    local = tmp_path / "node-b"
    r = engine("read", str(local), url(server), args=["--reader-tp", "2"], prompt=hybrid, expect=0)
    assert_read_passed(r, 3)
    assert r["fill"]["pages_by_tier"] == {"files": 0, "redis": 3}
    assert r["state"]["units_filled"] == 1 and r["state"]["bytes_wrong"] == 0
    assert r["promote"]["units_ok"] == 3
    again = engine("read", str(local), args=["--reader-tp", "1"], prompt=hybrid, expect=0)
    assert again["fill"]["pages_by_tier"] == {"files": 3}  # KV and state promoted to the files
    assert again["state"]["units_filled"] == 1 and again["state"]["bytes_checked"] > 0


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--store", "http://x/0"], ["expected a directory or a redis:// URL", "http://"]),
        (["--store", "redis://127.0.0.1:1/0", "--store", "redis://127.0.0.1:2/0"], ["at most"]),
        (["--store", "redis://127.0.0.1:1/0", "--store-capacity", "1M"], ["--store-capacity"]),
        (["--store", "redis://127.0.0.1:1/0", "--no-promote"], ["--no-promote"]),
    ],
)
def test_store_flag_errors(args, words):
    assert_usage_error(run_demo(*PROMPT, *args), *words)
