"""Loads never wait behind stores (issue 30 item 3): the JobPool's read and write queues, its
read-priority and write-priority threads, and a FileStore whose stores are stuck in I/O."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from helpers.store import row, small_namespace

from canonical_ops.units import FileStore, JobPool
from canonical_ops.units import files as files_mod
from canonical_ops.units import jobs as jobs_mod

NS = small_namespace(8)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


@pytest.mark.parametrize("cpus", [1, 64])
@pytest.mark.parametrize("threads", [3, 4, 32])
def test_a_load_starts_while_stores_fill_every_thread_they_may_have(
    threads, cpus, monkeypatch
) -> None:
    """Stores stuck in I/O on every thread they may take, more queued: a load submitted
    now runs to completion before any store moves (no timing: the stores never move).
    They may take: the writers, and readers while stores run on fewer threads than the
    CPUs and another reader stays free."""
    monkeypatch.setattr(jobs_mod, "usable_cpus", lambda: cpus)
    gate = threading.Event()
    stuck = lambda: gate.wait() and None  # noqa: E731
    with JobPool(threads=threads, queue_depth=4 * threads) as pool:
        expected = max(threads - pool.read_threads, min(cpus, threads - 1))
        try:
            stores = [pool.submit("stores", stuck) for _ in range(2 * threads)]
            wait_until(lambda: pool.stats().running == expected)
            load = pool.wait(pool.submit("loads", lambda: None), timeout=10)
            lookup = pool.wait(pool.submit("lookup", lambda: None), timeout=10)
            assert load.ok and lookup.ok and not any(job.done for job in stores)
            time.sleep(0.05)  # a reader that took one store too many would show now
            assert pool.stats().running == expected
        finally:
            gate.set()
        assert all(pool.wait(job, timeout=10).ok for job in stores)


@pytest.mark.parametrize(
    ("threads", "read_threads", "cpus"), [(2, 1, 1), (4, 2, 1), (4, 2, 2), (16, 8, 8), (4, 3, 1)]
)
def test_readers_take_no_store_while_stores_fill_the_cpus(
    threads, read_threads, cpus, monkeypatch
) -> None:
    """With as many writers as CPUs, a store never runs on a reader, however many readers
    are idle: it would add no speed, only compete with the loads for the CPU."""
    monkeypatch.setattr(jobs_mod, "usable_cpus", lambda: cpus)
    stored_on: set[threading.Thread] = set()

    def store() -> None:
        stored_on.add(threading.current_thread())
        time.sleep(0.001)

    with JobPool(threads=threads, queue_depth=256, read_threads=read_threads) as pool:
        jobs = [pool.submit("store", store) for _ in range(4 * threads)]
        jobs += [pool.submit("load", lambda: time.sleep(0.001)) for _ in range(threads)]
        assert all(pool.wait(job, timeout=10).ok for job in jobs)
        assert stored_on and not stored_on & pool._readers
        assert len(stored_on) <= threads - read_threads


@pytest.mark.parametrize("read_threads", [1, 2])
def test_readers_lend_a_hand_with_stores_below_the_cpus(read_threads, monkeypatch) -> None:
    """Fewer writers than CPUs: the readers run stores too (a 1 + 1 pool stores on both,
    as vLLM's), keeping one reader free where there are two or more."""
    monkeypatch.setattr(jobs_mod, "usable_cpus", lambda: 8)
    gate = threading.Event()
    with JobPool(threads=1 + read_threads, queue_depth=16, read_threads=read_threads) as pool:
        try:
            stores = [pool.submit("store", lambda: gate.wait() and None) for _ in range(6)]
            wait_until(lambda: pool.stats().running == 2)
            time.sleep(0.05)
            assert pool.stats().running == 2
        finally:
            gate.set()
        assert all(pool.wait(job, timeout=10).ok for job in stores)


def test_a_pool_of_readers_only_still_runs_stores() -> None:
    """read_threads == threads: no writer to run them, so the readers take stores when no
    read is queued (vLLM's rule)."""
    with JobPool(threads=3, queue_depth=16, read_threads=3) as pool:
        jobs = [pool.submit("store", lambda: time.sleep(0.001)) for _ in range(6)]
        assert all(pool.wait(job, timeout=10).ok for job in jobs)


def test_queued_reads_go_first_and_writes_are_not_starved() -> None:
    """One thread (a reader): queued loads run before queued stores; then the stores run."""
    gate, order = threading.Event(), []
    with JobPool(threads=1, queue_depth=16) as pool:
        first = pool.submit("store", lambda: gate.wait() and None)
        wait_until(lambda: first.status == "running")
        for name in ("w1", "r1", "w2", "r2"):
            kind = "load" if name[0] == "r" else "store"
            pool.submit(kind, lambda name=name: order.append(name))
        gate.set()
        wait_until(lambda: len(order) == 4)
    assert order == ["r1", "r2", "w1", "w2"]


def test_a_file_store_load_is_not_queued_behind_its_stores(tmp_path, monkeypatch) -> None:
    """FileStore knows loads from stores by itself (submit_loads vs submit_stores): stores
    stuck writing on every thread they may take, a load of a stored unit still finishes."""
    gate, stuck = threading.Event(), []

    def hook(stage: str, path: str, n: int) -> None:
        if stage == "write" and threading.current_thread().name.startswith("ckv-files"):
            stuck.append(path)
            gate.wait()

    monkeypatch.setattr(jobs_mod, "usable_cpus", lambda: 64)  # readers lend a hand
    with FileStore(tmp_path, NS, fsync=False, threads=4) as store:
        assert store.store(1, 0, row(NS, 1), 0).ok  # inline: before the hook
        monkeypatch.setattr(files_mod, "_test_hook", hook)
        try:
            stores = [store.submit_stores([(10 + i, 0, row(NS, 10 + i), 0)]) for i in range(6)]
            wait_until(lambda: len(stuck) == 3)  # 2 writers + 1 of the 2 readers
            dest = np.zeros(NS.total_bytes, np.uint8)
            load = store.pool.wait(store.submit_loads([(1, 0, 8, dest)]), timeout=10)
            assert load.ok and np.array_equal(dest, row(NS, 1))
            assert not any(job.done for job in stores)
        finally:
            gate.set()
        assert all(store.pool.wait(job, timeout=10).ok for job in stores)


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice: Linux")
def test_write_priority_threads_yield_the_cpu_to_readers() -> None:
    """Where stores keep every CPU busy, a load's thread still gets CPU time: the
    write-priority workers run at a higher nice than the process, the readers at its own."""
    base = os.getpriority(os.PRIO_PROCESS, 0)

    def nice(thread: threading.Thread) -> int:
        return os.getpriority(os.PRIO_PROCESS, thread.native_id)

    with JobPool(threads=4, queue_depth=4) as pool:
        writers = [w for w in pool._workers if w not in pool._readers]
        wait_until(lambda: all(nice(w) == min(19, base + jobs_mod.WRITE_NICE) for w in writers))
        assert len(writers) == 2 and all(nice(r) == base for r in pool._readers)


def test_read_threads_is_checked_and_sets_the_readers() -> None:
    for bad, error in ((0, ValueError), (5, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="read_threads"):
            JobPool(threads=4, read_threads=bad)
    with JobPool(threads=4, read_threads=3) as pool:
        assert pool.read_threads == 3 and len(pool._readers) == 3
