"""The Redis tier at its edges: passwords no output shows, start-up messages that say what
to do, and the authenticated mode (issue 26). Every test runs a real redis-server."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import urllib.parse

import numpy as np
import pytest
import xxhash
from helpers.demo_cli import ROOT, TINY, assert_usage_error, run_demo
from helpers.redis_server import RedisServer, free_port
from helpers.store import child_env, row, small_namespace

from canonical_ops.units import RedisStore, RedisStoreError, StoreSecret, encode_unit
from canonical_ops.units.redis_cli import run as store_cli
from canonical_ops.units.redis_url import parse_url, redact_url

NS = small_namespace(8)
LAYERS = NS.num_layers
# Every character a URL parser could take for the end of the password, unencoded.
SECRET = "Zq7Xk/Wm3Rt#Hp9Ly?Vb2Nc@Jd4Sf"
PIECES = re.split(r"[/#?@]", SECRET)  # none of these may show anywhere


def assert_hidden(text: str) -> None:
    for piece in PIECES:
        assert piece not in text, (piece, text)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(str(tmp_path_factory.mktemp("secret")), password=SECRET).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def url(server) -> str:
    server.client().flushall()
    return f"redis://:{SECRET}@127.0.0.1:{server.port}/0"


def test_a_password_with_url_characters_connects_and_never_shows(server, url, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="canonical_ops.units.redis_store")
    with RedisStore(url, NS, socket_timeout_s=0.5, retries=0, breaker_failures=1) as store:
        assert store.store(b"k", 0, row(NS, 1), 0).ok
        out = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(b"k", 0, LAYERS, out).ok and np.array_equal(out, row(NS, 1))
        assert_hidden(repr(store) + store.url)
        server.pause()  # the unavailable warning names the server
        try:
            assert store.load(b"k", 0, LAYERS, out).status == "miss"
        finally:
            server.resume()
    assert "unavailable" in caplog.text
    assert_hidden(caplog.text)


@pytest.mark.parametrize("password", ["Wr9Kx/Ong7Y#Kx8Pq?Tz3@Mv6", "Qz1Bn/Fv2Lm#Gw3Op?Hx4Rs"])
def test_a_wrong_password_never_shows_in_the_error(server, password) -> None:
    with pytest.raises(RedisStoreError, match="authentication failed") as info:
        RedisStore(f"redis://:{password}@127.0.0.1:{server.port}", NS)
    for piece in re.split(r"[/#?@]", password):
        assert piece not in str(info.value)


def test_an_ambiguous_url_is_refused_without_the_secret(server) -> None:
    # The '@' in "x@h?a" could end the password: "h" could be the host.
    with pytest.raises(ValueError, match="url: cannot tell where the user:password part") as info:
        RedisStore(f"redis://:Kq9x@Hv7?Lm2@127.0.0.1:{server.port}", NS)
    for piece in ("Kq9x", "Hv7", "Lm2"):
        assert piece not in str(info.value)


@pytest.mark.parametrize(
    ("url", "shown", "parts"),
    [
        ("redis://:pa/ss#w?rd@host:6379/2", "redis://***@host:6379/2", (None, "pa/ss#w?rd")),
        ("rediss://user:p@ss@h:1?password=zz&db=1", "rediss://user:***@h:1?password=***&db=1",
         ("user", "p@ss")),
        ("unix://:x/y@/tmp/r.sock?db=2", "unix://***@/tmp/r.sock?db=2", (None, "x/y")),
        ("redis+cluster://u:%2Fp@[::1]:7000", "redis+cluster://u:***@[::1]:7000", ("u", "/p")),
        ("redis://h:1/0", "redis://h:1/0", (None, None)),
        ("redis://word@h", "redis://***@h", ("word", None)),
        ("/var/cache/kv@1", "/var/cache/kv@1", None),  # not a URL: unchanged
        ("redis://:a@b?c@h:1", "redis://***@h:1", None),  # ambiguous: refused by parse_url
        ("redis://user:pw", "redis://***", None),  # no host: 'pw' would be the port
        ("redis://h:1/0?pass%77ord=pw", "redis://h:1/0?pass%77ord=***", (None, None)),
        ("redis:/u:pw@h", "redis:***", None),  # a mistyped URL: not a directory
    ],
)  # fmt: skip
def test_redact_url_and_parse_url(url, shown, parts) -> None:
    assert redact_url(url) == shown
    if parts is None:
        with pytest.raises(ValueError, match="url"):
            parse_url(url)
    else:
        parsed = parse_url(url)
        assert (parsed.username, parsed.password) == parts
        assert "@" not in parsed.address and (parts[1] is None or parts[1] not in repr(parsed))


@pytest.mark.parametrize(
    "url",
    [
        f"redis://user:{SECRET.replace('@', '')}",  # the host forgotten: host 'user', port ...
        f"redis://:{PIECES[0]}",
        f"redis://[::1:{PIECES[0]}",
        f"redis:/user:{PIECES[0]}@127.0.0.1",  # '://' mistyped
        f"redis//user:{PIECES[0]}@127.0.0.1",
    ],
)
def test_a_malformed_url_never_shows_the_password(url, capsys) -> None:
    with pytest.raises(ValueError, match="url: expected") as info:
        RedisStore(url, NS)
    assert_hidden(str(info.value) + redact_url(url))
    assert store_cli("stats", url) == 2
    out, err = capsys.readouterr()
    assert_hidden(out + err)


def test_no_public_repr_shows_a_password(server, capsys) -> None:
    encoded = urllib.parse.quote(SECRET, safe="")
    query = f"redis://127.0.0.1:{server.port}/0?pass%77ord={encoded}"
    assert_hidden(repr(parse_url(query)) + redact_url(query))
    with RedisStore(query, NS) as store:  # redis-py reads 'pass%77ord' as 'password'
        assert store.store(b"q", 0, row(NS, 1), 0).ok
        assert_hidden(repr(store) + repr(store._connection) + store.url)
    with RedisStore(f"redis://:{SECRET}@127.0.0.1:{server.port}/0", NS) as store:
        assert_hidden(repr(store) + repr(store._connection))
    from canonical_ops.units.cli import main as store_main

    assert store_main(["stats", f"redisx://u:{PIECES[0]}@127.0.0.1"]) == 2
    assert_hidden("".join(capsys.readouterr()))


def test_a_missing_password_says_how_to_give_it(server) -> None:
    with pytest.raises(RedisStoreError) as info:
        RedisStore(f"redis://127.0.0.1:{server.port}", NS)
    message = str(info.value)
    assert "requires a password: put it in the URL or pass password=" in message
    assert "HELLO" not in message and "\n" not in message


def test_the_password_from_the_environment_keeps_it_out_of_every_config(
    server, monkeypatch, capsys
) -> None:
    """vLLM logs its --kv-transfer-config at start-up: a password in the URL or in
    redis_options would be printed there. CANONICAL_KV_REDIS_PASSWORD keeps it out."""
    monkeypatch.setenv("CANONICAL_KV_REDIS_PASSWORD", SECRET)
    url = f"redis://127.0.0.1:{server.port}/0"
    with RedisStore(url, NS, socket_timeout_s=0.5, retries=0) as store:
        assert store.store(b"env", 0, row(NS, 2), 0).ok
        out = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(b"env", 0, LAYERS, out).ok and np.array_equal(out, row(NS, 2))
        assert_hidden(repr(store) + store.url)
    assert store_cli("stats", url, as_json=False) == 0
    assert_hidden(capsys.readouterr().out)
    monkeypatch.setenv("CANONICAL_KV_REDIS_PASSWORD", "not-the-password")
    with pytest.raises(RedisStoreError, match="authentication failed"):
        RedisStore(url, NS)
    with RedisStore(f"redis://:{SECRET}@127.0.0.1:{server.port}/0", NS) as store:  # URL first
        assert store.lookup([b"env"], 0, LAYERS) == 1


def test_an_unreachable_server_says_what_to_do() -> None:
    port = free_port()
    with pytest.raises(RedisStoreError) as info:
        RedisStore(f"redis://:{SECRET}@127.0.0.1:{port}", NS, connect_timeout_s=0.5)
    message = str(info.value)
    assert f"no Redis server reachable at 'redis://***@127.0.0.1:{port}'" in message
    assert "start the server there or correct the URL" in message
    assert "require_server" not in message and "\n" not in message
    assert_hidden(message)


def test_store_stats_never_shows_the_password(server, url, capsys) -> None:
    with RedisStore(url, NS) as store:
        store.store(b"k", 0, row(NS, 1), 0)
    for command, kwargs in (("stats", {}), ("verify", {}), ("gc", {"capacity": 1 << 30})):
        assert store_cli(command, url, **kwargs) == 0
        out, err = capsys.readouterr()
        assert "redis://***@127.0.0.1" in out
        assert_hidden(out + err)
    wrong = url.replace("Zq7Xk", "Zq7Xj")
    assert store_cli("stats", wrong) == 2
    out, err = capsys.readouterr()
    assert "authentication failed" in err and out == ""
    assert_hidden(err.replace("Zq7Xj", ""))
    # The command line, as an operator types it.
    done = subprocess.run(
        [sys.executable, "-m", "canonical_ops", "store", "stats", url],
        capture_output=True, text=True, cwd=ROOT, env=child_env(), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "redis://***@127.0.0.1" in done.stdout
    assert_hidden(done.stdout + done.stderr)


@pytest.mark.slow
def test_the_demo_never_shows_the_password(server, url) -> None:
    done = run_demo(*TINY, "--store", url, "--phase", "write")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "redis://***@127.0.0.1" in done.stdout
    assert_hidden(done.stdout + done.stderr)
    wrong = run_demo(*TINY, "--store", url.replace("Zq7Xk", "Zq7Xj"), "--phase", "write")
    line = assert_usage_error(wrong, "--store", "authentication failed")
    assert_hidden(line.replace("Zq7Xj", ""))


# ---------------------------------------------------------------------- authenticated mode


def forged(value: bytes, *, algorithm: int | None = None, mac_key: bytes | None = None) -> bytes:
    """``value`` (a unit) re-signed: as a plain XXH3 unit, or with another MAC key."""
    head_len = int.from_bytes(value[10:12], "little")
    head = bytearray(value[:head_len])
    if algorithm is not None:
        head[12:14] = algorithm.to_bytes(2, "little")
    head[80:96] = bytes(16)
    if mac_key is None:
        tag = xxhash.xxh3_128(bytes(head) + value[head_len:]).digest()
    else:
        hasher = StoreSecret(mac_key).mac()
        hasher.update(bytes(head) + value[head_len:])
        tag = hasher.digest()
    head[80:96] = tag
    return bytes(head) + value[head_len:]


def test_authenticated_units_without_a_valid_tag_are_misses(server, url) -> None:
    secret = StoreSecret(b"k" * 32)
    admin = server.client()
    with RedisStore(url, NS) as plain, RedisStore(url, NS, secret=secret) as signed:
        assert signed.namespace.key_id == secret.key_id and signed.unit_key(
            1, 0, 8
        ) != plain.unit_key(1, 0, 8)
        assert "kkkk" not in repr(signed)
        assert plain.store(1, 0, row(NS, 1), 0).ok and signed.store(2, 0, row(NS, 2), 0).ok
        out = np.zeros(NS.total_bytes, np.uint8)
        # A plain unit is not a unit of the authenticated namespace (nor the reverse).
        assert (
            signed.lookup([1], 0, LAYERS) == 0 and signed.load(1, 0, LAYERS, out).status == "miss"
        )
        assert plain.load(2, 0, LAYERS, out).status == "miss"
        good = admin.get(signed.unit_key(2, 0, LAYERS))
        cases = {
            "plain XXH3 over the same bytes": forged(good, algorithm=1),
            "MAC with another key": forged(good, mac_key=b"m" * 32),
            "plain unit under the signed name": encode_unit(NS, 2, 0, LAYERS, 0, row(NS, 9)),
        }
        for i, (what, value) in enumerate(cases.items()):
            admin.set(signed.unit_key(2, 0, LAYERS), value)
            sentinel = np.full(NS.total_bytes, 0xA5, np.uint8)
            job = signed.load(2, 0, LAYERS, sentinel)
            assert job.status == "miss" and "corrupt" in job.detail, what
            assert np.array_equal(sentinel, np.full(NS.total_bytes, 0xA5, np.uint8)), what
            assert signed.metrics().corrupt_detected == i + 1
            assert admin.exists(signed.unit_key(2, 0, LAYERS)) == 0, what  # deleted
        # Another secret reads nothing of it.
        other = StoreSecret(b"o" * 32)
        assert signed.store(3, 0, row(NS, 3), 0).ok
        with RedisStore(url, NS, secret=other) as stranger:
            assert stranger.lookup([3], 0, LAYERS) == 0
            assert stranger.load(3, 0, LAYERS, out).status == "miss"
        assert signed.load(3, 0, LAYERS, out).ok and np.array_equal(out, row(NS, 3))
