"""`python -m canonical_ops store stats|verify|gc URL` against a real redis-server."""

from __future__ import annotations

import json
import time

import pytest
from helpers.redis_server import RedisServer, free_port
from helpers.store import row, small_namespace

from canonical_ops.units import RedisStore, StoreSecret, encode_unit, redis_cli
from canonical_ops.units.redis_cli import run

NS = small_namespace(8)
OTHER = small_namespace(8, name="second-model")
LAYERS = NS.num_layers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with RedisServer(str(tmp_path_factory.mktemp("cli"))) as srv:
        yield srv


@pytest.fixture
def filled(server):
    """Two namespaces: NS with 4 keys in two layer ranges, OTHER with one whole unit."""
    server.client().flushall()
    with RedisStore(server.url, NS) as store:
        store.stores([(k, a, row(NS, k, a, a + 4), k) for k in range(4) for a in (0, 4)])
    with RedisStore(server.url, OTHER) as store:
        store.store(b"x", 0, row(OTHER, 1), 0)
    return server


def cli(capsys, *args, **kwargs) -> tuple[int, str, str]:
    code = run(*args, **kwargs)
    out, err = capsys.readouterr()
    return code, out, err


def test_stats_lists_namespaces_units_bytes_and_ranges(filled, capsys) -> None:
    code, out, _ = cli(capsys, "stats", filled.url, as_json=True)
    report = json.loads(out)
    assert code == 0 and report["url"] == filled.url and report["other_keys"] == 0
    spaces = {s["namespace"]: s for s in report["namespaces"]}
    assert set(spaces) == {NS.hex, OTHER.hex}
    mine = spaces[NS.hex]
    assert (mine["model"], mine["num_layers"], mine["units"], mine["keys"]) == (
        "test-model",
        8,
        8,
        4,
    )
    assert mine["layer_ranges"] == {"0-4": 4, "4-8": 4} and mine["problem"] is None
    assert mine["bytes"] > 8 * NS.layer_bytes(0, 4)  # server memory: values and overhead
    assert spaces[OTHER.hex]["model"] == "second-model" and spaces[OTHER.hex]["units"] == 1
    code, out, _ = cli(capsys, "stats", filled.url)
    assert code == 0 and "2 namespace(s)" in out and "units=8" in out and "[0-4): 4" in out


def test_verify_passes_a_good_store_and_lists_every_bad_unit(filled, capsys) -> None:
    code, out, _ = cli(capsys, "verify", filled.url)
    assert code == 0 and "9 unit(s) in 2 namespace(s) checked, 0 bad" in out
    admin = filled.client()
    with RedisStore(filled.url, NS) as store:
        flipped, garbage, swapped = (store.unit_key(k, 0, 4) for k in range(3))
        value = admin.get(flipped)
        admin.setrange(flipped, len(value) - 1, bytes([value[-1] ^ 1]))
        admin.set(garbage, b"not a unit")
        admin.set(swapped, admin.get(store.unit_key(3, 0, 4)))  # another key's unit
    code, out, _ = cli(capsys, "verify", filled.url, as_json=True)
    report = json.loads(out)
    assert code == 1 and report["checked"] == 9 and report["bad_count"] == 3
    reasons = {item["key"]: item["reason"] for item in report["bad"]}
    assert reasons == {flipped: "checksum mismatch", garbage: reasons[garbage],
                       swapped: "unit is for another key"}  # fmt: skip
    assert "magic" in reasons[garbage] or "truncated" in reasons[garbage]
    code, out, _ = cli(capsys, "verify", filled.url)
    assert code == 1 and out.count("BAD ckv:v1:") == 3


def test_verify_without_the_namespace_description_cannot_vouch(filled, capsys) -> None:
    filled.client().delete(f"ckv:v1:namespace:{OTHER.hex[:32]}")  # as if evicted
    code, out, _ = cli(capsys, "verify", filled.url, as_json=True)
    bad = json.loads(out)["bad"]
    assert code == 1 and len(bad) == 1 and "not verifiable" in bad[0]["reason"]
    # The next store puts it back.
    with RedisStore(filled.url, OTHER) as store:
        store.store(b"y", 0, row(OTHER, 2), 0)
    assert cli(capsys, "verify", filled.url)[0] == 0


def test_verify_of_an_authenticated_namespace_needs_the_secret(server, capsys, monkeypatch) -> None:
    server.client().flushall()
    secret = StoreSecret(b"s" * 32)
    with RedisStore(server.url, NS, secret=secret) as store:
        store.store(1, 0, row(NS, 1), 0)
        key = store.unit_key(1, 0, LAYERS)
    monkeypatch.delenv("CANONICAL_KV_STORE_SECRET", raising=False)
    monkeypatch.delenv("CANONICAL_KV_STORE_SECRET_FILE", raising=False)
    code, out, _ = cli(capsys, "verify", server.url, as_json=True)
    assert code == 1 and "no secret" in json.loads(out)["bad"][0]["reason"]
    monkeypatch.setenv("CANONICAL_KV_STORE_SECRET", "s" * 32)
    assert cli(capsys, "verify", server.url)[0] == 0
    code, out, _ = cli(capsys, "stats", server.url, as_json=True)
    assert json.loads(out)["namespaces"][0]["authenticated"] is True
    # A plain unit planted under the authenticated name: caught.
    admin = server.client()
    admin.set(key, encode_unit(NS, 1, 0, LAYERS, 0, row(NS, 1)))
    code, out, _ = cli(capsys, "verify", server.url, as_json=True)
    assert code == 1 and json.loads(out)["bad"][0]["key"] == key
    monkeypatch.setenv("CANONICAL_KV_STORE_SECRET", "t" * 32)  # another key: cannot verify
    assert cli(capsys, "verify", server.url)[0] == 1


def test_gc_dry_run_lists_and_gc_evicts_tails_first(filled, capsys) -> None:
    admin = filled.client()
    before = set(admin.keys("ckv:*"))
    units = admin.keys("ckv:v1:{*}:*-*")
    with RedisStore(filled.url, NS) as store:
        tail = {store.unit_key(3, 0, 4), store.unit_key(3, 4, 8)}  # position 3: the last block
    # Room for all but the two units of the last block.
    capacity = sum(admin.memory_usage(k, samples=0) for k in units)
    capacity -= sum(admin.memory_usage(k, samples=0) for k in tail)
    code, out, _ = cli(capsys, "gc", filled.url, capacity=capacity, dry_run=True, as_json=True)
    report = json.loads(out)
    assert code == 0 and report["dry_run"] and set(report["evicted"]) == tail
    assert set(admin.keys("ckv:*")) == before  # nothing removed
    code, out, _ = cli(capsys, "gc", filled.url, capacity=capacity)
    assert code == 0 and "evicted 2 unit(s)" in out
    with RedisStore(filled.url, NS) as store:  # the block's index went with its last unit
        assert {k.decode() for k in before - set(admin.keys("ckv:*"))} == {
            *tail,
            store.index_key(3),
        }
    with RedisStore(filled.url, NS) as store:  # the index no longer lists them
        assert store.lookup([0, 1, 2, 3], 0, LAYERS) == 3 and store.lookup([3], 0, 4) == 0


def test_gc_evicts_the_least_recently_used_first(filled, capsys, monkeypatch) -> None:
    monkeypatch.setattr(redis_cli, "_BUCKET_S", 1)  # recency in seconds, not minutes
    time.sleep(1.5)
    with RedisStore(filled.url, NS) as store:  # key 0 (the head) used recently
        store.loads([(0, a, a + 4, row(NS, 0, a, a + 4).copy()) for a in (0, 4)])
    admin = filled.client()
    units = [k for k in admin.keys("ckv:v1:{*}:*-*")]
    total = sum(admin.memory_usage(k, samples=0) for k in units)
    code, out, _ = cli(capsys, "gc", filled.url, capacity=total // 2, dry_run=True, as_json=True)
    evicted = json.loads(out)["evicted"]
    with RedisStore(filled.url, NS) as store:
        recent = {store.unit_key(0, 0, 4), store.unit_key(0, 4, 8)}
    assert code == 0 and evicted and not recent & set(evicted)


def test_gc_refuses_where_the_server_does_not_track_recency(tmp_path, capsys) -> None:
    lfu = ["--maxmemory-policy", "allkeys-lfu"]
    with RedisServer(str(tmp_path), extra=lfu) as srv, RedisStore(srv.url, NS) as store:
        store.store(1, 0, row(NS, 1), 0)
        code, out, err = cli(capsys, "gc", srv.url, capacity=0)
        assert code == 2 and out == "" and "maxmemory-policy owns eviction" in err
        assert len(err.splitlines()) == 1
        assert cli(capsys, "stats", srv.url)[0] == 0  # a look still works


@pytest.mark.parametrize(
    ("args", "kwargs", "words"),
    [
        (("gc", "redis://127.0.0.1:1"), {}, "--capacity"),
        (("stats", "redis://127.0.0.1:1"), {"capacity": 5}, "--capacity"),
        (("verify", "redis://127.0.0.1:1"), {"dry_run": True}, "--dry-run"),
        (("gc", "redis://127.0.0.1:1"), {"capacity": -1}, "--capacity"),
        (("stats", "http://127.0.0.1:1"), {}, "url: expected a URL with scheme"),
        (("stats", f"redis://:s3cr3t@127.0.0.1:{free_port()}"), {}, "no Redis server reachable"),
    ],
)
def test_usage_and_server_errors_are_one_line(capsys, args, kwargs, words) -> None:
    code, out, err = cli(capsys, *args, **kwargs)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and words in err
    assert "s3cr3t" not in err


def test_names_from_the_server_are_escaped_in_every_report_and_exact_in_json(server, capsys):
    """A model name and revision holding a newline, a forged report line and terminal
    escapes (a namespace description on the server): one escaped line in ``stats``; every
    report holds no raw control character; ``--json`` keeps the exact text."""
    from helpers.hostile import ESCAPED, HOSTILE, assert_no_forgery, hostile_namespace

    ns = hostile_namespace(NS)
    server.client().flushall()
    with RedisStore(server.url, ns) as store:
        assert store.store(b"k", 0, row(ns, 1), 0).ok
    for args, kwargs in (
        (("stats",), {}),
        (("verify",), {}),
        (("gc",), {"capacity": 0, "dry_run": True}),
    ):
        code, out, err = cli(capsys, *args, server.url, **kwargs)
        assert code == 0, err
        assert_no_forgery(out + err)
        code, out, _ = cli(capsys, *args, server.url, as_json=True, **kwargs)
        assert code == 0 and json.loads(out)["url"] == server.url
    code, out, _ = cli(capsys, "stats", server.url)
    assert f"model={ESCAPED} rev={ESCAPED}" in out
    code, out, _ = cli(capsys, "stats", server.url, as_json=True)
    [item] = json.loads(out)["namespaces"]
    assert (item["model"], item["revision"], item["extra"]) == (
        HOSTILE,
        HOSTILE,
        {"adapter": HOSTILE},
    )


def test_a_server_error_naming_the_target_is_one_escaped_line(tmp_path, capsys) -> None:
    """redis-py's message quotes the socket path raw: stderr shows it escaped, one line."""
    from helpers.hostile import HOSTILE, assert_no_forgery

    code, out, err = cli(capsys, "stats", f"unix://{tmp_path}/{HOSTILE}.sock")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert_no_forgery(err)
