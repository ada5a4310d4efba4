"""canonical_redis inside vLLM 0.33's tiering manager: two engines ("two nodes") sharing one
real redis-server, a server killed and restarted mid-run, a hung server.

Each engine is vLLM's own scheduler-side connector and manager with its own primary region
(tiering.py); the only thing the two share is the server.
"""

from __future__ import annotations

import time

import pytest
from helpers.redis_server import RedisClusterNodes, RedisServer
from tiering import chunk_keys, engine_factory

from canonical_ops.vllm.tiers import EXPIRED_JOBS, CanonicalRedisTier

engines = pytest.fixture(engine_factory)


@pytest.fixture
def server(tmp_path):
    server = RedisServer(str(tmp_path / "redis")).start()
    try:
        yield server
    finally:
        server.stop()


def redis_tier(server: RedisServer, **options) -> dict:
    return {"type": "canonical_redis", "url": server.url, **options}


def test_two_nodes_share_through_one_server(plugin_registered, models, engines, server, tmp_path):
    keys = chunk_keys(6, "nodes")
    node_a = engines(models["llama8"], [redis_tier(server)], tp=8)
    assert isinstance(node_a.tiers[0], CanonicalRedisTier)
    rows = node_a.random_rows(keys, seed=21)
    node_a.store(rows)
    # Node B: another engine at TP=2 with its own files in front of the shared server.
    tiers = [{"type": "canonical_fs", "root_dir": str(tmp_path / "b")}, redis_tier(server)]
    node_b = engines(models["llama8"], tiers, tp=2)
    assert node_b.tiers[0].namespace == node_b.tiers[1].namespace == node_a.tiers[0].namespace
    assert node_b.load(keys) == rows


def test_two_nodes_share_through_a_redis_cluster(plugin_registered, models, engines, tmp_path):
    keys = chunk_keys(6, "cluster")  # spread over the cluster's hash slots
    with RedisClusterNodes(str(tmp_path / "cluster")) as cluster:
        tier = {
            "type": "canonical_redis",
            "url": cluster.url.replace("redis://", "redis+cluster://"),
        }
        node_a = engines(models["llama8"], [tier], tp=4)
        rows = node_a.random_rows(keys, seed=25)
        node_a.store(rows)
        assert engines(models["llama8"], [tier], tp=1).load(keys) == rows


def test_a_killed_server_is_misses_and_failed_stores_then_recovers(
    plugin_registered, models, engines, server
):
    keys = chunk_keys(8, "killed")
    options = {"deadline_s": 2.0, "redis_options": {"socket_timeout_s": 1.0}}
    node_a = engines(models["llama8"], [redis_tier(server, **options)])
    node_b = engines(models["llama8"], [redis_tier(server, **options)])
    rows = node_a.random_rows(keys, seed=22)
    node_a.store({k: rows[k] for k in keys[:3]})
    assert node_b.load(keys[:3]) == {k: rows[k] for k in keys[:3]}

    server.kill()
    started = time.monotonic()
    node_a.store({k: rows[k] for k in keys[3:6]})  # the engine keeps going: failed stores
    failures = [v for k, v in node_a.stats().items() if "cascade_job_failures" in k]
    assert failures and failures[0] >= 1
    with pytest.warns(RuntimeWarning, match="no server reachable"):  # starts anyway
        node_c = engines(models["llama8"], [redis_tier(server, **options)])  # an empty engine
    assert node_c.load(keys[:6]) == dict.fromkeys(keys[:6])  # misses, never an exception
    assert time.monotonic() - started < 20

    server.start()  # back, empty (no persistence): stores and loads work again
    end = time.monotonic() + 15
    while True:
        node_a.store({k: rows[k] for k in keys[6:]})
        loaded = node_b.load(keys[6:])
        if loaded == {k: rows[k] for k in keys[6:]} or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert loaded == {k: rows[k] for k in keys[6:]}


# Only the deadline can end a stuck call here: the store's own timeouts are far longer.
HUNG = {"deadline_s": 0.5, "redis_options": {"socket_timeout_s": 60.0, "lookup_timeout_s": 60.0}}


@pytest.mark.parametrize("hang_at", ["lookup", "load"])
def test_a_hung_server_is_a_miss_within_the_deadline_and_never_writes_a_row(
    plugin_registered, models, engines, server, hang_at
):
    keys = chunk_keys(2, f"hung-{hang_at}")
    node_a = engines(models["llama8"], [redis_tier(server)])
    rows = node_a.random_rows(keys, seed=23)
    node_a.store(rows)
    node_b = engines(models["llama8"], [redis_tier(server, **HUNG)])
    tier = node_b.tiers[0]
    real_submit = tier.submit_load

    def submit_then_hang(job):  # the server hangs right as the promotion is submitted
        server.pause()
        real_submit(job)

    if hang_at == "load":
        tier.submit_load = submit_then_hang
    else:
        server.pause()  # accepts connections, answers nothing
    node_b.rows[:] = 0xAB
    try:
        started = time.monotonic()
        assert node_b.load(keys) == dict.fromkeys(keys)
        elapsed = time.monotonic() - started
    finally:
        server.resume()
    assert elapsed < 5, elapsed  # far below the store's own 60 s timeouts
    time.sleep(0.5)  # an abandoned read gets its reply now: it must not write the rows
    assert (node_b.rows == 0xAB).all()
    assert node_b.stats()[f"{EXPIRED_JOBS}:('canonical_redis',)"] >= 1
    tier.submit_load = real_submit
    assert node_b.load(keys) == rows
