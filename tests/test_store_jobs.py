"""The bounded I/O job pool: never blocks the submitter, never raises into it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from canonical_ops.units import JobOutcome, JobPool
from canonical_ops.units.jobs import current_job, run_inline


def wait_until(predicate, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_outcomes_are_reported_by_poll() -> None:
    with JobPool(threads=2, queue_depth=8) as pool:
        jobs = [
            pool.submit("a", lambda: None),
            pool.submit("b", lambda: JobOutcome("miss", detail="absent")),
            pool.submit("c", lambda: JobOutcome("ok", nbytes=5, value=42)),
            pool.submit("d", lambda: 1 / 0),
            pool.submit("e", lambda: "not an outcome"),
        ]
        seen = []
        wait_until(lambda: seen.extend(pool.poll()) or len(seen) == 5)
        assert pool.poll() == []
    assert {j.kind: j.status for j in seen} == dict(a="ok", b="miss", c="ok", d="error", e="error")
    assert jobs[2].nbytes == 5 and jobs[2].value == 42 and jobs[1].detail == "absent"
    assert isinstance(jobs[3].error, ZeroDivisionError) and "ZeroDivisionError" in jobs[3].detail
    assert isinstance(jobs[4].error, TypeError)
    assert all(j.done and j.seconds >= 0 for j in jobs)
    stats = pool.stats()
    assert (stats.submitted, stats.finished, stats.errors, stats.refused) == (5, 5, 2, 0)


def test_full_queue_refuses_without_blocking() -> None:
    gate = threading.Event()
    pool = JobPool(threads=1, queue_depth=2)
    try:
        running = pool.submit("block", lambda: gate.wait() and None)
        wait_until(lambda: running.status == "running")
        queued = [pool.submit("q", lambda: None) for _ in range(2)]
        start = time.perf_counter()
        refused = pool.submit("r", lambda: None)
        assert time.perf_counter() - start < 0.5
        assert refused.refused and refused.done and "back-pressure" in refused.detail
        assert pool.stats().refused == 1 and pool.stats().queued == 2
        gate.set()
        for job in [running, *queued]:
            assert pool.wait(job, timeout=10).ok
        assert refused not in pool.poll()  # the caller holds refused jobs; poll never reports them
    finally:
        gate.set()
        pool.close()


def test_wait_collects_and_times_out() -> None:
    gate = threading.Event()
    with JobPool(threads=1, queue_depth=4) as pool:
        job = pool.submit("x", lambda: gate.wait() and None)
        with pytest.raises(TimeoutError, match="not finished"):
            pool.wait(job, timeout=0.05)
        gate.set()
        assert pool.wait(job).ok
        time.sleep(0.05)
        assert job not in pool.poll()
        with pytest.raises(TypeError, match="job"):
            pool.wait("job")


def test_close_drains_or_cancels() -> None:
    gate = threading.Event()
    pool = JobPool(threads=1, queue_depth=4)
    first = pool.submit("first", lambda: gate.wait() and None)
    wait_until(lambda: first.status == "running")
    later = [pool.submit("later", lambda: None) for _ in range(3)]
    closer = threading.Thread(target=lambda: pool.close(cancel=True))
    closer.start()
    wait_until(lambda: all(j.status == "cancelled" for j in later))
    gate.set()
    closer.join(10)
    assert not closer.is_alive() and first.ok
    assert {j.status for j in pool.poll()} == {"ok", "cancelled"}
    assert pool.submit("after", lambda: None).refused  # closed
    assert pool.stats().cancelled == 3

    done = []
    with JobPool(threads=1, queue_depth=8) as pool:  # __exit__ drains
        for i in range(5):
            pool.submit("d", lambda i=i: done.append(i))
    assert sorted(done) == list(range(5))


def test_a_job_that_raises_baseexception_does_not_kill_its_thread() -> None:
    def boom():
        raise KeyboardInterrupt

    with JobPool(threads=1, queue_depth=2) as pool:
        bad = pool.wait(pool.submit("bad", boom))
        good = pool.wait(pool.submit("good", lambda: None))
    assert bad.status == "error" and isinstance(bad.error, KeyboardInterrupt) and good.ok


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(threads=0), ValueError),
        (dict(threads=1.0), TypeError),
        (dict(queue_depth=True), TypeError),
        (dict(queue_depth=-1), ValueError),
    ],
)
def test_arguments(kwargs, error) -> None:
    with pytest.raises(error, match=next(iter(kwargs))):
        JobPool(**kwargs)
    JobPool(threads=np.int64(1), queue_depth=np.int32(1)).close()
    with pytest.raises(ValueError, match="status"):
        JobOutcome("done")


def test_waited_jobs_do_not_pile_up_unpolled() -> None:
    with JobPool(threads=2, queue_depth=64) as pool:
        for _ in range(50):
            assert pool.wait(pool.submit("w", lambda: None)).ok
        time.sleep(0.05)
        assert pool.poll() == []
        assert pool._finished == {}


# ---------------------------------------------------------------------- deadlines


def test_a_stuck_job_expires_and_its_thread_is_replaced() -> None:
    gate = threading.Event()
    late = []

    def stuck():
        stuck_on.add(threading.current_thread().name)
        gate.wait()
        late.append(current_job().claim())  # what a load asks before writing its destination
        return JobOutcome("ok", value="late")

    stuck_on: set[str] = set()
    # Two writers and a reader (which takes no store while a writer is free).
    with JobPool(threads=3, queue_depth=8, deadline_s=0.2, read_threads=1) as pool:
        started = time.perf_counter()
        jobs = [pool.submit("stuck", stuck) for _ in range(2)]
        wait_until(lambda: all(j.done for j in jobs), timeout=5)
        assert time.perf_counter() - started < 0.2 + 1.0  # deadline + slack
        assert [j.status for j in jobs] == ["expired", "expired"]
        assert "deadline" in jobs[0].detail and jobs[0].value is None
        # Both threads are stuck, yet the pool runs new jobs on two fresh threads.
        names, both = set(), threading.Barrier(2, timeout=5)

        def quick():
            names.add(threading.current_thread().name)
            both.wait()  # two jobs at once: two threads serve the pool

        for job in [pool.submit("quick", quick) for _ in range(2)]:
            assert pool.wait(job, timeout=5).ok
        assert len(names) == 2 and len(stuck_on) == 2 and not names & stuck_on
        gate.set()  # the abandoned threads finish now: their results are dropped
        wait_until(lambda: len(late) == 2)
        time.sleep(0.05)
        assert late == [False, False] and [j.status for j in jobs] == ["expired", "expired"]
        assert jobs[0].value is None and [j.kind for j in pool.poll()] == ["stuck"] * 2
        stats = pool.stats()
        assert (stats.expired, stats.finished, stats.running) == (2, 4, 0)


def test_a_claimed_job_is_not_expired_until_released() -> None:
    claimed, gate = threading.Event(), threading.Event()

    def writer():
        assert current_job().claim()
        claimed.set()
        gate.wait()  # e.g. a copy into the caller's memory that takes long
        current_job().release()
        return JobOutcome("ok", nbytes=1)

    with JobPool(threads=1, queue_depth=2, deadline_s=0.1) as pool:
        job = pool.submit("claim", writer)
        claimed.wait(5)
        time.sleep(0.4)  # well past the deadline
        assert job.status == "running"
        gate.set()
        assert pool.wait(job, timeout=5).ok and job.nbytes == 1

    released = threading.Event()

    def release_then_hang():
        current_job().claim()
        current_job().release()
        released.wait()

    with JobPool(threads=1, queue_depth=2, deadline_s=0.1) as pool:
        job = pool.wait(pool.submit("r", release_then_hang), timeout=5)
        released.set()
    assert job.status == "expired"


def test_inline_jobs_and_plain_threads_always_claim() -> None:
    assert current_job().claim()  # no job: nothing can expire
    with JobPool(threads=1, queue_depth=2, deadline_s=0.05) as pool:
        job = pool.make_job("inline", lambda: JobOutcome("ok", value=current_job().claim()))
        time.sleep(0.1)
        assert run_inline(job).value is True
    with pytest.raises(ValueError, match="deadline_s"):
        JobPool(deadline_s=0)
    with pytest.raises(TypeError, match="deadline_s"):
        JobPool(deadline_s="1")
