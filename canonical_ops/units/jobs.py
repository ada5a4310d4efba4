"""A bounded I/O job pool with deadlines, shared by the unit stores (files, Redis).

The engine's thread submits (never blocking: a full queue gives a finished ``"refused"``
job) and polls; worker threads do the I/O, a work function's exception becoming the job's
``error``. Loads never wait behind stores: reads (``load``, ``loads``, ``lookup`` jobs) and
writes (every other kind) have a queue each; write-priority threads take writes first,
then reads; read-priority threads take reads first, and a write only while every writer
is busy, stores run on fewer threads than the process has CPUs and another reader stays
free (vLLM's ``DualQueueThreadPool`` lets readers take writes freely: measured here,
readers running stores beyond the CPUs tripled a load's p99 while stores stream, for no
store throughput; below the CPUs they double a small pool's). On Linux the write-priority
threads run ``WRITE_NICE`` above the process's nice, so where stores keep every CPU busy
a load's thread still gets most of one. Statuses: ``queued``, ``running``, then ``ok``,
``miss``, ``corrupt``, ``error``, ``refused``, ``cancelled`` or ``expired`` (past
``deadline_s``: its thread is abandoned and replaced). A work function calls
``current_job().claim()`` right before it writes caller memory or publishes, and does
bounded work until ``release()``: an expired job never writes (claim and expiry swap one
native state word, also used by ``_unitio``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._unitio import JobState
from ..checks import check_int, check_seconds

__all__ = [
    "FINISHED",
    "IOJob",
    "JobOutcome",
    "JobPool",
    "PoolStats",
    "current_job",
    "ok_outcome",
    "run_inline",
]

FINISHED = frozenset({"ok", "miss", "corrupt", "error", "refused", "cancelled", "expired"})
READ_KINDS = frozenset({"load", "loads", "lookup"})  # the read queue's; the rest: writes
WRITE_NICE = 5  # write-priority workers' nice, above the process's
_OUTCOMES = frozenset({"ok", "miss", "corrupt", "error"})
_local = threading.local()


@dataclass(frozen=True)
class JobOutcome:
    """What a work function reports: status (ok, miss, corrupt, error), payload bytes moved,
    a human-readable ``detail``, any ``value`` and the exception behind an error."""

    status: str
    nbytes: int = 0
    detail: str = ""
    value: Any = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        if self.status not in _OUTCOMES:
            raise ValueError(f"status: expected one of {sorted(_OUTCOMES)}, got {self.status!r}")


@functools.lru_cache(maxsize=1024)  # unit sizes are few
def ok_outcome(nbytes: int) -> JobOutcome:
    """``JobOutcome("ok", nbytes)``, one shared instance per size (immutable): every unit a
    batch moves has one, and building a frozen dataclass costs about a microsecond."""
    return JobOutcome("ok", nbytes=nbytes)


Work = Callable[[], JobOutcome | None]  # a job's work function


@dataclass(eq=False)
class IOJob:
    """One submitted I/O operation (``kind``: ``"store"``, ``"loads"``, ...; ``info``: the
    tier's description of it) and, once finished, its outcome; ``*_at``: perf_counter()."""

    job_id: int
    kind: str
    info: dict = field(default_factory=dict)
    status: str = "queued"
    nbytes: int = 0
    detail: str = ""
    value: Any = None
    error: BaseException | None = None
    submitted_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    _fn: Work | None = field(default=None, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _collected: bool = field(default=False, repr=False)
    _state: JobState = field(default_factory=JobState, repr=False)  # running/claimed/expired
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def done(self) -> bool:
        """Finished (any final status)."""
        return self._done.is_set()

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def refused(self) -> bool:
        return self.status == "refused"

    @property
    def seconds(self) -> float | None:
        """Submission to finish, or None while in flight."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def claim(self) -> bool:
        """False when the job expired; else True, and the deadline waits until :meth:`release`."""
        return self._state.claim()

    def release(self) -> None:
        """End a claim: the deadline applies again."""
        self._state.release()

    def _finish(self, status: str, detail: str = "") -> None:
        self._fn, self.status, self.detail = None, status, detail
        self.finished_at = time.perf_counter()
        self._done.set()


_DETACHED = IOJob(-1, "detached")  # what current_job() gives outside a job: claim() is True


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the platform tells it)."""
    with contextlib.suppress(AttributeError, OSError):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def current_job() -> IOJob:
    """The job the calling thread is running (a detached one, never expiring, outside jobs)."""
    return getattr(_local, "job", _DETACHED)


@dataclass(frozen=True)
class PoolStats:
    """Counters of a :class:`JobPool` (a snapshot)."""

    submitted: int
    refused: int
    finished: int
    errors: int
    cancelled: int
    expired: int
    queued: int
    running: int


def run_inline(job: IOJob) -> IOJob:
    """Run an unsubmitted job in the calling thread (the stores' synchronous calls)."""
    _execute(job)
    return job


def _execute(job: IOJob) -> None:
    job.status, job.started_at = "running", time.perf_counter()
    fn, job._fn = job._fn, None  # drop the closure (and the buffers it holds) when done
    outer, _local.job = current_job(), job
    try:
        outcome = fn() if fn is not None else None
        if outcome is None:
            outcome = JobOutcome("ok")
        elif not isinstance(outcome, JobOutcome):
            raise TypeError(f"work function returned {type(outcome).__name__}, not JobOutcome")
    except BaseException as error:  # never let it escape into a worker or caller thread
        outcome = JobOutcome("error", detail=f"{type(error).__name__}: {error}", error=error)
    finally:
        _local.job = outer
    with job._lock:
        if job.status == "expired":
            return  # abandoned by the watchdog: the late result is dropped
        job.nbytes, job.value, job.error = outcome.nbytes, outcome.value, outcome.error
        job._finish(outcome.status, outcome.detail)


class JobPool:
    """``threads`` workers (>= 1) fed by at most ``queue_depth`` queued jobs (>= 1; beyond
    it submissions are refused), named ``name``-N; ``deadline_s``: seconds a job may run
    from its start before it finishes ``"expired"`` (None: no deadline). The first
    ``read_threads`` workers (default ``(threads + 1) // 2``; 1 to ``threads``) are
    read-priority, the others write-priority (see the module): with 2 readers or more, a
    read submitted while stores fill the pool starts at once on a free reader, or else after
    a read, never after a store (1 reader: it also takes writes when no read is queued, as
    vLLM's)."""

    def __init__(
        self,
        threads: int = 4,
        queue_depth: int = 64,
        *,
        name: str = "ckv-io",
        deadline_s: float | None = None,
        read_threads: int | None = None,
    ) -> None:
        self.threads = check_int("threads", threads, minimum=1)
        self.queue_depth = check_int("queue_depth", queue_depth, minimum=1)
        self.deadline_s = check_seconds("deadline_s", deadline_s, optional=True)
        self.name = name
        self.read_threads = (
            (self.threads + 1) // 2
            if read_threads is None
            else check_int("read_threads", read_threads, minimum=1, maximum=self.threads)
        )
        self._cpus = usable_cpus()  # readers lend a hand with stores below this many
        self._reads: deque[IOJob] = deque()
        self._writes: deque[IOJob] = deque()
        lock = threading.RLock()
        self._lock = threading.Condition(lock)  # the watchdog's; close() wakes everyone
        # Idle workers sleep on their priority's condition; a submission wakes ONE worker
        # that prefers its kind (else one of the others), never all of them.
        self._wake = {True: threading.Condition(lock), False: threading.Condition(lock)}
        self._sleeping = {True: 0, False: 0}  # per priority (reader: True): waiting, not woken
        self._finished: dict[int, IOJob] = {}  # not yet collected, in job id order
        self._running: dict[threading.Thread, IOJob] = {}
        self._readers: set[threading.Thread] = set()  # the read-priority workers
        self._ids, self._spawned, self._closed = itertools.count(), itertools.count(), False
        self._counts = dict.fromkeys(
            ("submitted", "refused", "finished", "errors", "cancelled", "expired"), 0
        )
        self._workers: list[threading.Thread] = []
        with self._lock:
            for i in range(self.threads):
                self._spawn_locked(reader=i < self.read_threads)
        if self.deadline_s is not None:
            threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True).start()

    def _spawn_locked(self, reader: bool) -> None:
        name = f"{self.name}-{next(self._spawned)}"
        worker = threading.Thread(target=self._run, args=(reader,), name=name, daemon=True)
        self._workers.append(worker)
        if reader:
            self._readers.add(worker)
        worker.start()

    # ------------------------------------------------------------------ submission

    def make_job(self, kind: str, fn: Work, info: dict | None = None) -> IOJob:
        """A job not yet submitted (for :meth:`submit_job` or :func:`run_inline`)."""
        return IOJob(
            next(self._ids), kind, dict(info or {}), submitted_at=time.perf_counter(), _fn=fn
        )

    def submit(self, kind: str, fn: Work, info: dict | None = None) -> IOJob:
        """Queue ``fn`` without blocking; a full queue gives a finished ``"refused"`` job
        (never returned by :meth:`poll`: the caller holds it)."""
        return self.submit_job(self.make_job(kind, fn, info))

    def submit_job(self, job: IOJob) -> IOJob:
        """Queue a job made by :meth:`make_job` (see :meth:`submit`)."""
        with self._lock:
            accepted = not self._closed and self._queued() < self.queue_depth
            if accepted:
                read = job.kind in READ_KINDS
                (self._reads if read else self._writes).append(job)
                self._wake_one_locked(reader=read)
            self._counts["submitted" if accepted else "refused"] += 1
        if not accepted:
            job._collected = True
            job._finish("refused", "pool closed" if self._closed else "queue full (back-pressure)")
        return job

    # ------------------------------------------------------------------ collection

    def poll(self) -> list[IOJob]:
        """Jobs finished since the last poll (never blocks); waited-for jobs excluded."""
        with self._lock:
            finished = list(self._finished.values())
            for job in finished:
                job._collected = True
            self._finished.clear()
        return finished

    def wait(self, job: IOJob, timeout: float | None = None) -> IOJob:
        """Block until ``job`` is finished (it is then not returned by :meth:`poll`);
        ``TimeoutError`` after ``timeout`` seconds."""
        if not isinstance(job, IOJob):
            raise TypeError(f"job: expected an IOJob, got {type(job).__name__}")
        if not job._done.wait(timeout):
            raise TimeoutError(f"job {job.job_id} ({job.kind}) not finished after {timeout} s")
        with self._lock:
            job._collected = True
            self._finished.pop(job.job_id, None)
        return job

    def stats(self) -> PoolStats:
        """Counters, consistent with each other."""
        with self._lock:
            return PoolStats(**self._counts, queued=self._queued(), running=len(self._running))

    # ------------------------------------------------------------------ workers

    def _collect_locked(self, job: IOJob) -> None:
        self._counts["finished"] += 1
        self._counts["errors"] += job.status == "error"
        if not job._collected:
            self._finished[job.job_id] = job

    def _wake_one_locked(self, reader: bool) -> None:
        """Wake one sleeping worker, of this priority if one sleeps (a write: a reader
        only if it may take one now)."""
        role = reader
        if not self._sleeping[role] and (reader or self._reader_may_write_locked()):
            role = not reader  # none of its priority sleeps: one of the others
        if self._sleeping[role]:
            self._sleeping[role] -= 1
            self._wake[role].notify()

    def _wake_all_locked(self) -> None:
        for role in (True, False):
            self._sleeping[role] = 0
            self._wake[role].notify_all()
        self._lock.notify_all()

    def _queued(self) -> int:
        return len(self._reads) + len(self._writes)

    def _take_locked(self, reader: bool) -> IOJob | None:
        """The next job for a worker of this priority, or None (nothing it may take now)."""
        first, then = (self._reads, self._writes) if reader else (self._writes, self._reads)
        if first:
            return first.popleft()
        if not then or (reader and not self._reader_may_write_locked()):
            return None
        return then.popleft()

    def _reader_may_write_locked(self) -> bool:
        """Whether a reader may take a write now: every writer is busy, stores run on
        fewer threads than the process has CPUs (beyond, a store adds no speed, only CPU
        taken from the loads) and, with 2 readers or more, another reader stays free."""
        writes = busy_readers = busy_writers = 0
        for thread, job in self._running.items():
            writes += job.kind not in READ_KINDS
            if thread in self._readers:
                busy_readers += 1
            else:
                busy_writers += 1
        readers = len(self._readers)
        return (
            busy_writers == self.threads - readers
            and writes < self._cpus
            and (readers < 2 or readers - busy_readers >= 2)
        )

    def _run(self, reader: bool) -> None:
        me = threading.current_thread()
        if not reader and WRITE_NICE:
            with contextlib.suppress(OSError, AttributeError):  # Linux: nice is per thread
                tid = threading.get_native_id()
                nice = os.getpriority(os.PRIO_PROCESS, tid) + WRITE_NICE
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        with self._lock:
            while True:
                job = self._take_locked(reader)
                if job is None:
                    if self._closed and not self._queued():
                        return
                    self._sleeping[reader] += 1
                    self._wake[reader].wait()
                    continue
                self._running[me] = job  # the watchdog wakes at least once a deadline
                if self._writes and self._sleeping[True] and self._reader_may_write_locked():
                    self._sleeping[True] -= 1  # a reader may now lend a hand with them
                    self._wake[True].notify()
                self._lock.release()
                try:
                    _execute(job)
                finally:
                    self._lock.acquire()
                if self._running.get(me) is not job:
                    return  # abandoned after its deadline: a replacement took this place
                del self._running[me]
                self._collect_locked(job)
                if self._closed:  # the last job done: idle workers stop
                    self._wake_all_locked()

    def _watch(self) -> None:
        """Expire jobs running past the deadline; replace their threads."""
        deadline_s = self.deadline_s
        assert deadline_s is not None
        with self._lock:
            while not (self._closed and not self._workers_alive()):
                now = time.perf_counter()
                wake = now + deadline_s  # idle: look again after a deadline at the latest
                for thread, job in list(self._running.items()):
                    due = (job.started_at or now) + deadline_s
                    if due > now:
                        wake = min(wake, due)
                        continue
                    with job._lock:
                        if job._done.is_set():
                            continue
                        if not job._state.expire():  # claimed: writing; look again shortly
                            wake = min(wake, now + 0.01)
                            continue
                        job._finish("expired", f"ran past the pool's deadline of {deadline_s} s")
                    del self._running[thread]
                    self._workers.remove(thread)
                    reader = thread in self._readers
                    self._readers.discard(thread)
                    self._counts["expired"] += 1
                    self._collect_locked(job)
                    self._spawn_locked(reader)
                self._lock.wait(max(0.0, wake - now))

    def _workers_alive(self) -> bool:
        return any(w.is_alive() for w in self._workers)

    # ------------------------------------------------------------------ shutdown

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting jobs, then drain (default) or cancel the queued ones (they finish
        ``"cancelled"``, returned by :meth:`poll`); running jobs finish (or expire). Threads
        are joined for at most ``timeout`` seconds. Idempotent."""
        with self._lock:
            if self._closed and not self._workers_alive():
                return
            self._closed = True
            while cancel and self._queued():
                job = (self._reads or self._writes).popleft()
                job._finish("cancelled", "cancelled by close()")
                self._counts["cancelled"] += 1
                self._finished[job.job_id] = job
            self._wake_all_locked()  # idle workers drain the queues, then stop
        end = None if timeout is None else time.monotonic() + timeout
        while end is None or time.monotonic() < end:
            with self._lock:  # abandoned threads are no longer listed: never joined
                alive = [w for w in self._workers if w.is_alive()]
            if not alive:
                break
            alive[0].join(0.05 if end is None else max(0.0, min(0.05, end - time.monotonic())))

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> JobPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
