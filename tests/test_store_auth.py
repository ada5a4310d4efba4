"""Authenticated stores (issue 26, trust boundary): units MAC-ed with a shared secret.

A checksum proves a unit intact, not who wrote it; with a secret, a unit anyone else
wrote (valid XXH3, or a MAC under another key) is a miss, and the secret is never shown.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from helpers.store import row, small_namespace, unit_files

from canonical_ops.units import FileStore, StoreSecret
from canonical_ops.units.cli import main as store_cli
from canonical_ops.units.unit import (
    CHECKSUM_HMAC_SHA256,
    CorruptUnit,
    decode_and_verify,
    encode_unit,
    peek_header,
)

NS = small_namespace(8)
KEY = b"k" * 24 + b"secret!!"
SECRET, OTHER = StoreSecret(KEY), StoreSecret(b"another key of 32 bytes........")


def test_a_secret_never_shows_its_key(tmp_path) -> None:
    assert KEY.decode() not in repr(SECRET) and SECRET.key_id in repr(SECRET)
    ns = NS.authenticated(SECRET)
    assert KEY.decode() not in repr(ns) and KEY.decode() not in str(ns.describe())
    assert ns.describe()["key_id"] == SECRET.key_id and len(SECRET.key_id) == 32
    with FileStore(tmp_path, NS, secret=SECRET) as store:
        assert KEY.decode() not in repr(store)
    for bad in (b"short", "x" * 5000):
        with pytest.raises(ValueError, match="key: expected 16 to 4096 bytes") as info:
            StoreSecret(bad)
        assert str(bad)[:5] not in str(info.value)
    with pytest.raises(TypeError, match="key"):
        StoreSecret(123)
    with pytest.raises(TypeError, match="secret: expected a StoreSecret"):
        NS.authenticated(KEY)


def test_secret_from_env_and_key_file(tmp_path) -> None:
    assert StoreSecret.from_env({}) is None
    assert StoreSecret.from_env({"CANONICAL_KV_STORE_SECRET": KEY.decode()}) == SECRET
    path = tmp_path / "key"
    path.write_bytes(KEY + b"\n")
    os.chmod(path, 0o600)
    env = {"CANONICAL_KV_STORE_SECRET_FILE": str(path)}
    assert StoreSecret.from_env(env) == SECRET
    with pytest.raises(ValueError, match="expected one of them, got both"):
        StoreSecret.from_env(env | {"CANONICAL_KV_STORE_SECRET": KEY.decode()})
    with pytest.raises(ValueError, match="CANONICAL_KV_STORE_SECRET: key: expected 16"):
        StoreSecret.from_env({"CANONICAL_KV_STORE_SECRET": "short"})
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match=r"mode 0600 or stricter.*mode 0640") as info:
        StoreSecret.from_file(path)
    assert KEY.decode() not in str(info.value)
    os.chmod(path, 0o600)
    link = tmp_path / "link"
    os.symlink(path, link)
    with pytest.raises(ValueError, match="cannot open"):
        StoreSecret.from_file(link)  # never through a symlink
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="expected a regular file"):
        StoreSecret.from_file(fifo)  # and never blocks on a FIFO
    if os.geteuid() == 0:
        os.chown(path, 54321, -1)
        with pytest.raises(ValueError, match="owned by uid 0"):
            StoreSecret.from_file(path)


def test_units_carry_a_mac_that_only_the_key_makes() -> None:
    ns = NS.authenticated(SECRET)
    payload = row(NS, 1)
    unit = encode_unit(ns, b"block", 0, 8, 0, payload)
    header = peek_header(unit)
    assert header.checksum_algorithm == CHECKSUM_HMAC_SHA256
    assert header.namespace_digest == ns.digest != NS.digest
    assert bytes(decode_and_verify(unit, namespace=ns)[1]) == payload.tobytes()
    # Another key: another namespace (its key id), so never even compared.
    with pytest.raises(CorruptUnit, match="namespace"):
        decode_and_verify(unit, namespace=NS.authenticated(OTHER))
    with pytest.raises(CorruptUnit, match="namespace"):
        decode_and_verify(unit, namespace=NS)
    # A forger knows the key id (it is public) but not the key: a valid XXH3 unit of the
    # authenticated namespace, or a MAC made with another key, is refused.
    keyless = NS.authenticated(SECRET)
    object.__setattr__(keyless, "key_id", "")  # encodes as a plain unit ...
    plain = bytearray(encode_unit(keyless, b"block", 0, 8, 0, payload))
    plain[48:80] = ns.digest  # ... under the authenticated namespace's digest
    with pytest.raises(CorruptUnit, match="checksum algorithm 1"):
        decode_and_verify(bytes(plain), namespace=ns)
    forged = bytearray(unit)
    forged[-1] ^= 1
    with pytest.raises(CorruptUnit, match="checksum mismatch"):
        decode_and_verify(bytes(forged), namespace=ns)


def test_authenticated_and_plain_stores_never_read_each_other(tmp_path) -> None:
    with (
        FileStore(tmp_path, NS, secret=SECRET, fsync=False) as auth,
        FileStore(tmp_path, NS, fsync=False) as plain,
    ):
        assert auth.directory != plain.directory
        assert auth.store(1, 0, row(NS, 1), 0).ok and plain.store(2, 0, row(NS, 2), 0).ok
        assert auth.lookup([1], 0, 8) == 1 and auth.lookup([2], 0, 8) == 0
        assert plain.lookup([1], 0, 8) == 0 and plain.lookup([2], 0, 8) == 1
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert auth.load(1, 0, 8, dest).ok and np.array_equal(dest, row(NS, 1))
        with FileStore(tmp_path, NS, secret=OTHER, fsync=False) as other:
            assert other.lookup([1], 0, 8) == 0
        # A plain unit planted in the authenticated directory: a miss, quarantined.
        (planted,) = unit_files(plain)
        kd_dir = os.path.dirname(planted).replace(plain.directory, auth.directory)
        os.makedirs(kd_dir, exist_ok=True)
        shutil.copy(planted, kd_dir)
        os.chmod(os.path.join(kd_dir, os.path.basename(planted)), 0o600)
        dest[:] = 0
        assert auth.load(2, 0, 8, dest).status == "miss" and auth.metrics().corrupt_detected == 1
        assert auth.lookup([2], 0, 8) == 0


def test_store_verify_needs_the_secret(tmp_path, capsys, monkeypatch) -> None:
    with FileStore(tmp_path, NS, secret=SECRET, fsync=False) as store:
        assert store.store(1, 0, row(NS, 1), 0).ok
    monkeypatch.delenv("CANONICAL_KV_STORE_SECRET", raising=False)
    monkeypatch.delenv("CANONICAL_KV_STORE_SECRET_FILE", raising=False)
    assert store_cli(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "authenticated; set CANONICAL_KV_STORE_SECRET" in out and KEY.decode() not in out
    monkeypatch.setenv("CANONICAL_KV_STORE_SECRET", KEY.decode())
    assert store_cli(["verify", str(tmp_path)]) == 0
    assert "1 unit file(s) in 1 namespace(s) checked, 0 bad" in capsys.readouterr().out
    with open(unit_files(store)[0], "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    assert store_cli(["verify", str(tmp_path)]) == 1
    assert "checksum mismatch" in capsys.readouterr().out


def test_macs_are_compared_in_constant_time(tmp_path, monkeypatch) -> None:
    """Readers compare ``digest()`` with the stored tag by hmac.compare_digest (a
    byte-by-byte compare that stops early leaks how much of a forged tag was right)."""
    import hmac

    calls = []

    def spy(a, b):
        calls.append(len(a))
        return real(a, b)

    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", spy)
    ns = NS.authenticated(SECRET)
    unit = encode_unit(ns, b"block", 0, 8, 0, row(NS, 1))
    decode_and_verify(unit, namespace=ns)
    assert calls == [16]
    forged = bytearray(unit)
    forged[-1] ^= 1
    with pytest.raises(CorruptUnit, match="checksum mismatch"):
        decode_and_verify(bytes(forged), namespace=ns)
    assert calls == [16, 16]
    digest = SECRET.mac().digest()
    assert digest == bytes(digest) and bytes(digest) == digest
    assert (digest != bytes(digest)) is False
    assert digest != b"x" * 16 and digest != "text" and hash(digest) == hash(bytes(digest))


def test_an_authenticated_namespace_without_its_secret_is_refused(tmp_path) -> None:
    """A store given an authenticated namespace (its key id) but no secret could verify no
    unit: every one would read as corrupt, and stores drop corrupt units (a Redis reader
    without the secret deleted the fleet's units). Refused at construction; nothing made."""
    import dataclasses

    from canonical_ops.units import RedisStore

    keyless = dataclasses.replace(NS.authenticated(SECRET), secret=None)
    with pytest.raises(ValueError, match=f"key_id {SECRET.key_id}.* without its secret"):
        FileStore(tmp_path / "files", keyless)
    assert not (tmp_path / "files").exists()
    with pytest.raises(ValueError, match="without its secret"):
        RedisStore("redis://127.0.0.1:1/0", keyless, require_server=False)
    with FileStore(tmp_path / "files", keyless, secret=SECRET) as store:  # with it: fine
        assert store.namespace.key_id == SECRET.key_id
        assert store.store(1, 0, row(NS, 1), 0).ok
