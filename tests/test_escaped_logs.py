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
