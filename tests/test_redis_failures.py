"""The Redis tier when the server dies, hangs or is not there: bounded, counted, recovering.

The engine must keep serving: every call returns within its timeouts (misses,
dropped stores, lookups of 0), nothing raises into the caller, the circuit
breaker then skips the server cheaply, and the tier comes back by itself once
the server answers again on the same port.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from helpers.redis_server import RedisServer, free_port
from helpers.store import row, small_namespace

from canonical_ops.units import JobPool, RedisStore
from canonical_ops.units.redis_store import _Breaker

NS = small_namespace(32)
LAYERS = NS.num_layers

# Tight timeouts so that "bounded" is seconds, not minutes.
FAST = dict(
    socket_timeout_s=0.5,
    connect_timeout_s=0.5,
    lookup_timeout_s=0.3,
    retries=1,
    breaker_failures=2,
    breaker_backoff_s=1.0,
    breaker_max_backoff_s=2.0,
)
# One job: at most (retries + 1) socket timeouts and the back-off between them.
JOB_BOUND_S = (FAST["retries"] + 1) * FAST["socket_timeout_s"] + 0.5 + 1.0  # + slack


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(str(tmp_path / "redis")).start()
    try:
        yield srv
    finally:
        srv.stop()


def timed(call):
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def wait_until_stored(store: RedisStore, key: bytes, timeout: float = 15.0) -> float:
    """Store until it succeeds (the breaker probing the server); seconds it took."""
    started = time.perf_counter()
    while True:
        job = store.store(key, 0, row(NS, 99), 0)
        assert job.status in ("ok", "error") and job.error is None, job
        if job.ok:
            return time.perf_counter() - started
        assert time.perf_counter() - started < timeout, f"never recovered: {job.detail}"
        time.sleep(0.05)


def test_server_killed_mid_run_is_misses_and_drops_then_recovers(server, caplog) -> None:
    caplog.set_level("WARNING", logger="canonical_ops.units.redis_store")
    store = RedisStore(server.url, NS, **FAST)
    try:
        keys = [f"before-{i}".encode() for i in range(8)]
        assert store.stores([(k, 0, row(NS, i), i) for i, k in enumerate(keys)]).ok
        assert store.lookup(keys, 0, LAYERS) == 8

        # Jobs in flight while the server dies: each finishes, none with an exception.
        outs = [np.zeros(NS.total_bytes, np.uint8) for _ in keys]
        jobs = [
            store.submit_loads([(k, 0, LAYERS, o) for k, o in zip(keys, outs)]),
            store.submit_stores([(f"during-{i}".encode(), 0, row(NS, i), i) for i in range(8)]),
        ]
        server.kill()
        jobs += [
            store.submit_load(keys[0], 0, LAYERS, np.zeros(NS.total_bytes, np.uint8)),
            store.submit_store(b"after", 0, row(NS, 1), 0),
            store.submit_lookup(keys, 0, LAYERS),
        ]
        for job in jobs:
            store.wait(job, timeout=JOB_BOUND_S * 3)
            assert job.error is None and job.status in ("ok", "miss", "error"), job
        if jobs[0].value is not None:  # per item; None when the batch never ran
            for i, (outcome, out) in enumerate(zip(jobs[0].value, outs)):
                if outcome.status == "ok":  # loaded before the kill: then it is right
                    assert np.array_equal(out, row(NS, i))

        # Synchronous calls are bounded, and cheap once the breaker is open.
        found, seconds = timed(lambda: store.lookup(keys, 0, LAYERS))
        assert found == 0 and seconds < FAST["lookup_timeout_s"] + 0.5
        job, seconds = timed(lambda: store.store(b"x", 0, row(NS, 1), 0))
        assert job.status == "error" and job.detail.startswith("dropped") and seconds < JOB_BOUND_S
        job, seconds = timed(lambda: store.load(keys[1], 0, LAYERS, outs[1]))
        assert job.status == "miss" and "unavailable" in job.detail and seconds < JOB_BOUND_S
        assert not store.available
        _, seconds = timed(lambda: store.loads([(k, 0, LAYERS, o) for k, o in zip(keys, outs)]))
        assert seconds < 0.25  # skipped by the breaker: no connection attempt
        m = store.metrics()
        assert m.breaker_opens >= 1 and m.breaker_skips >= 1 and not m.available
        assert m.stores_dropped >= 2 and m.loads_unavailable >= 2 and m.lookups_unavailable >= 1
        assert m.errors >= 2

        # The server comes back on the same port (empty: it saved nothing).
        server.start()
        assert wait_until_stored(store, b"after-restart") < FAST["breaker_max_backoff_s"] + 5
        assert store.available
        out = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(b"after-restart", 0, LAYERS, out).ok
        assert np.array_equal(out, row(NS, 99))
        assert store.lookup(keys, 0, LAYERS) == 0  # what it held before is gone: misses
        assert store.lookup([b"after-restart"], 0, LAYERS) == 1
        # Operators see both transitions in the log, once each per outage.
        messages = [r.getMessage() for r in caplog.records]
        assert sum("unavailable" in m and "skipping it" in m for m in messages) == 1
        assert sum("reachable again" in m for m in messages) == 1
    finally:
        store.close()


def test_hung_server_is_bounded_by_the_timeouts(server) -> None:
    store = RedisStore(server.url, NS, **FAST)
    try:
        assert store.store(b"k", 0, row(NS, 1), 0).ok
        server.pause()  # accepts connections (kernel), never answers
        found, seconds = timed(lambda: store.lookup([b"k"], 0, LAYERS))
        assert found == 0 and seconds < FAST["lookup_timeout_s"] + 0.5
        out = np.zeros(NS.total_bytes, np.uint8)
        job, seconds = timed(lambda: store.load(b"k", 0, LAYERS, out))
        assert job.status == "miss" and seconds < JOB_BOUND_S
        job, seconds = timed(lambda: store.store(b"j", 0, row(NS, 2), 0))
        assert job.status == "error" and seconds < JOB_BOUND_S
        assert not store.available
        _, seconds = timed(lambda: store.store(b"j", 0, row(NS, 2), 0))
        assert seconds < 0.25
        server.resume()
        wait_until_stored(store, b"j")
        assert store.load(b"k", 0, LAYERS, out).ok and np.array_equal(out, row(NS, 1))
    finally:
        server.resume()
        store.close()


def test_unreachable_at_start_up_can_start_degraded_and_recover(tmp_path) -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    with pytest.warns(RuntimeWarning, match=f"no server reachable at .*:{port}"):
        store = RedisStore(url, NS, require_server=False, **FAST)
    srv = RedisServer(str(tmp_path / "late"), port=port)
    try:
        assert not store.available
        job, seconds = timed(lambda: store.store(b"k", 0, row(NS, 1), 0))
        assert job.status == "error" and seconds < 0.25
        assert store.lookup([b"k"], 0, LAYERS) == 0
        srv.start()
        wait_until_stored(store, b"k")
        assert store.lookup([b"k"], 0, LAYERS) == 1
    finally:
        store.close()
        srv.stop()


def test_breaker_opens_backs_off_probes_once_and_closes() -> None:
    breaker = _Breaker(threshold=2, backoff_s=0.2, max_backoff_s=0.4)
    assert breaker.allow()
    breaker.failure()
    assert breaker.allow() and breaker.closed  # one failure is not enough
    breaker.failure()
    assert not breaker.closed and not breaker.allow() and breaker.opens == 1
    time.sleep(0.25)
    assert breaker.allow()  # the probe...
    assert not breaker.allow()  # ...and only one at a time
    breaker.failure()  # the probe failed: back-off doubles (0.4 s)
    time.sleep(0.25)
    assert not breaker.allow()
    time.sleep(0.2)
    assert breaker.allow()
    breaker.success()
    assert breaker.closed and breaker.allow() and breaker.allow()
    assert breaker.skips == 3 and breaker.opens == 1


# ---------------------------------------------------------------------- the pool's deadline


def wait_thread_gone(name: str, timeout: float = 10.0) -> None:
    """Until the pool thread ``name`` (abandoned by the watchdog) has run to its end."""
    deadline = time.monotonic() + timeout
    while any(t.name == name for t in threading.enumerate()):
        assert time.monotonic() < deadline, f"{name} still running"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["load", "store"])
def test_a_stuck_job_expires_at_the_deadline_and_never_writes_late(server, kind) -> None:
    pool = JobPool(1, 4, name="ckv-dl", deadline_s=0.4)
    admin = server.client()
    try:
        # Socket timeouts far longer than the deadline: only the deadline ends the job.
        with RedisStore(server.url, NS, pool=pool, socket_timeout_s=10, retries=0) as store:
            assert store.store(b"k", 0, row(NS, 1), 0).ok
            sentinel = np.full(NS.total_bytes, 0xA5, np.uint8)
            out = sentinel.copy()
            server.pause()
            store._connection.close()  # a fresh connection: its handshake waits too
            started = time.perf_counter()
            if kind == "load":
                job = store.submit_load(b"k", 0, LAYERS, out)
            else:
                job = store.submit_store(b"late", 0, row(NS, 2), 0)
            store.wait(job, timeout=5)
            assert job.status == "expired" and time.perf_counter() - started < 0.4 + 1.0
            server.resume()  # the abandoned thread gets its replies now, and must stop there
            wait_thread_gone("ckv-dl-0")
            assert np.array_equal(out, sentinel)  # no byte written after the job expired
            assert admin.exists(store.unit_key(b"late", 0, LAYERS)) == 0  # nothing published
            assert pool.stats().expired == 1
            job = store.wait(store.submit_load(b"k", 0, LAYERS, out), timeout=10)
            assert job.ok and np.array_equal(out, row(NS, 1))  # the new thread serves
    finally:
        server.resume()
        pool.close()
