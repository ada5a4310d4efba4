"""The Redis tier on a real 3-node Redis Cluster (redis-py's RedisCluster client).

Block keys hash to slots all over the cluster; one block's units and
index share a hash tag, hence a node. A batch is one cluster pipeline (one
round trip per node, sent together) however many slots it touches.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis
from helpers.redis_server import RedisClusterNodes
from helpers.store import row, small_namespace

from canonical_ops.units import RedisStore, RedisStoreError

NS = small_namespace(32)
LAYERS = NS.num_layers


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nodes = RedisClusterNodes(str(tmp_path_factory.mktemp("cluster")), password="cluster-pw")
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def flushed(cluster):
    for node in cluster.nodes:
        with node.client() as client:
            client.flushall()
    return cluster


def url(cluster, scheme: str = "redis+cluster") -> str:
    return f"{scheme}://:cluster-pw@127.0.0.1:{cluster.nodes[0].port}"


def keys_per_node(cluster) -> list[int]:
    counts = []
    for node in cluster.nodes:
        with node.client() as client:
            counts.append(client.dbsize())
    return counts


@pytest.mark.slow
def test_cluster_batches_spread_over_nodes_bit_exact(flushed) -> None:
    with RedisStore(url(flushed), NS) as store:
        assert store.cluster
        keys = [f"cluster-block-{i}".encode() for i in range(48)]
        payloads = [row(NS, i) for i in range(48)]
        before = store.metrics().round_trips
        job = store.stores([(k, 0, p, i) for i, (k, p) in enumerate(zip(keys, payloads))])
        assert job.ok, job.detail
        assert store.metrics().round_trips == before + 1
        counts = keys_per_node(flushed)
        # unit + index each, and the namespace's description
        assert all(c > 0 for c in counts) and sum(counts) == 2 * 48 + 1
        assert store.lookup(keys, 0, LAYERS) == 48
        outs = [np.zeros(NS.total_bytes, np.uint8) for _ in keys]
        job = store.loads([(k, 0, LAYERS, o) for k, o in zip(keys, outs)])
        assert job.ok, job.detail
        for out, payload in zip(outs, payloads):
            assert np.array_equal(out, payload)
        # Every key of one block lives on one node (the hash tag).
        slots = {
            redis.cluster.key_slot(k.encode())
            for k in (store.unit_key(keys[0], 0, LAYERS), store.index_key(keys[0]))
        }
        assert len(slots) == 1


@pytest.mark.slow
def test_cluster_cross_split_and_units_above_max_value_bytes(flushed) -> None:
    with RedisStore(url(flushed, "redis"), NS, cluster=True, max_value_bytes=4096) as store:
        items = []
        for i in range(12):
            items += [(i, 0, row(NS, i, 0, 16), i), (i, 16, row(NS, i, 16, 32), i)]
        assert store.stores(items).ok
        assert store.lookup(list(range(12)), 8, 24) == 12
        outs = [np.zeros(NS.layer_bytes(8, 24), np.uint8) for _ in range(12)]
        job = store.loads([(i, 8, 24, outs[i]) for i in range(12)])
        assert job.ok, job.detail
        for i in range(12):
            assert np.array_equal(outs[i], row(NS, i, 8, 24))
        # [0, 16) went out as [0, 7), [7, 14), [14, 16) (4096-byte values); one of them
        # damaged on whatever node holds it: a miss, counted, removed.
        target = store.unit_key(3, 7, 14)
        node = next(n for n in flushed.nodes if n.client().exists(target))
        node.client().setrange(target, 200, b"\x00\x01")
        out = np.zeros(NS.layer_bytes(0, 16), np.uint8)
        job = store.load(3, 0, 16, out)
        assert job.status == "miss" and "corrupt" in job.detail
        assert store.metrics().corrupt_detected == 1 and not node.client().exists(target)


def test_cluster_wrong_password_and_db(cluster) -> None:
    bad = f"redis+cluster://:nope@127.0.0.1:{cluster.nodes[0].port}"
    with pytest.raises(RedisStoreError, match="authentication failed") as info:
        RedisStore(bad, NS)
    assert "nope" not in str(info.value)
    with pytest.raises(ValueError, match="db: expected 0"):
        RedisStore(url(cluster) + "/2", NS)
