"""Log and warning lines that quote untrusted text (a store's path or URL, a server's error,
a unit's problem) show it escaped: one line each, no terminal control, no forged line."""

from __future__ import annotations

import logging
import types

import pytest
from helpers.hostile import FORGED, HOSTILE, assert_no_forgery
from helpers.store import small_namespace

from canonical_ops.units import RedisStore

NS = small_namespace(8)


def test_redis_start_up_warning_escapes_the_servers_error(tmp_path) -> None:
    """redis-py's error quotes the socket path as given: the warning shows it escaped."""
    url = f"unix://{tmp_path}/{HOSTILE}.sock"
    with pytest.warns(RuntimeWarning, match="no server reachable") as warned:
        store = RedisStore(url, NS, require_server=False)
    store.close()
    [message] = [str(w.message) for w in warned if "no server reachable" in str(w.message)]
    assert FORGED in message
    assert_no_forgery(message)


def test_sglang_backend_failure_log_escapes_the_outcome(caplog) -> None:
    """A failed store or load is logged with its detail (a path, a server's message)."""
    from canonical_ops.sglang import backend

    outcome = types.SimpleNamespace(status="error", detail=f"unreadable: {HOSTILE}")
    with caplog.at_level(logging.WARNING, logger=backend.__name__):
        assert not backend._ok(outcome, "store")
    [record] = caplog.records
    assert FORGED in record.getMessage()
    assert_no_forgery(record.getMessage())


@pytest.mark.parametrize("kind", ["auth", "permission", "unavailable", "other"])
def test_a_servers_words_in_a_start_up_error_are_escaped(kind) -> None:
    """RedisStoreError messages reach vLLM's and SGLang's own logs, which do not escape: the
    server's (or the socket's) text is escaped where the message is made."""
    import redis

    from canonical_ops.units.redis_connection import start_error

    error = {
        "auth": redis.exceptions.AuthenticationError,
        "permission": redis.exceptions.NoPermissionError,
        "unavailable": redis.exceptions.ConnectionError,
        "other": redis.exceptions.ResponseError,
    }[kind](f"server says {HOSTILE}")
    message, _ = start_error("redis://127.0.0.1:1", True, error)
    assert FORGED in message
    assert_no_forgery(message)


def test_a_url_quoted_by_the_url_parser_is_escaped() -> None:
    """urllib's ValueError quotes the netloc as given (one that NFKC normalisation changes):
    RedisStore's message, which engines log as is, shows it escaped."""
    # no "\n" (urllib drops it before parsing), no "[" (an IPv6 address): ESC c resets a terminal
    url = "redis://evil\x1bc\u202e\u2100:6379"
    with pytest.raises(ValueError, match="invalid characters") as raised:
        RedisStore(url, NS, require_server=False)
    assert "evil\\x1bc\\u202e" in str(raised.value)
    assert_no_forgery(str(raised.value))


def _hostile_store(tmp_path):
    """A FileStore root whose path holds a newline, a forged line and terminal escapes, with
    one unit stored; its namespace directory."""
    from helpers.store import row

    from canonical_ops.units import FileStore

    root = tmp_path / f"store {HOSTILE}"
    with FileStore(root, NS, fsync=False) as store:
        assert store.store(1, 0, row(NS, 1), 0).ok
    return root, root / NS.hex


def test_an_unsafe_store_directory_error_escapes_the_root(tmp_path) -> None:
    """StoreRootError (a symlinked tmp/: FileStore refuses to start) reaches vLLM's and
    SGLang's logs as is: the operator's root path in it is escaped."""
    from canonical_ops.units import FileStore, StoreRootError

    root, directory = _hostile_store(tmp_path)
    (directory / "tmp").rmdir()
    (directory / "tmp").symlink_to(tmp_path)
    with pytest.raises(StoreRootError, match="tmp: expected a directory") as raised:
        FileStore(root, NS)
    assert FORGED in str(raised.value)
    assert_no_forgery(str(raised.value))


@pytest.mark.parametrize("level", ["fan-out", "key"])
def test_a_store_refused_by_an_unsafe_directory_escapes_the_root(tmp_path, level) -> None:
    """A store into a fan-out or key directory others may write fails; its error (the job's
    exception and detail) names the directory with the root escaped."""
    import os

    from helpers.store import row

    from canonical_ops.units import FileStore
    from canonical_ops.units.unit import key_digest

    root, directory = _hostile_store(tmp_path)
    kd = key_digest(1)
    unsafe = directory / kd[:2] if level == "fan-out" else directory / kd[:2] / kd
    for name in os.listdir(directory / kd[:2] / kd):  # stored again, not already there
        os.unlink(directory / kd[:2] / kd / name)
    os.chmod(unsafe, 0o777)
    with FileStore(root, NS, fsync=False) as store:
        job = store.store(1, 0, row(NS, 1), 0)
    assert job.status == "error" and "writable by no one else" in job.detail
    for text in (job.detail, str(job.error)):
        assert FORGED in text
        assert_no_forgery(text)
