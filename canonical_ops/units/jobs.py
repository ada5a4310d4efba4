"""A bounded I/O job pool shared by the persistent tiers (files, Redis).

The engine's thread submits and polls; a fixed set of worker threads does the
I/O. The queue is bounded and :meth:`JobPool.submit` never blocks: when the
queue is full the job comes back already finished with status ``"refused"``
(back-pressure, counted), and the caller simply does not offload or load that
block now. Jobs are collected like ``OffloadWorker``'s: :meth:`JobPool.poll`
returns the jobs finished since the last poll, :meth:`JobPool.wait` blocks on
one. A worker thread never raises into the caller: every exception becomes the
job's ``error`` (status ``"error"``).

Statuses
--------
``"queued"``, ``"running"``
    Not finished.
``"ok"``
    Done; for a load, the destination holds verified bytes.
``"miss"``
    Nothing usable was found (absent, evicted meanwhile, or corrupt and
    quarantined: see ``detail``). The destination must not be used.
``"corrupt"``
    Reserved for tiers that report corruption without falling back to a miss.
``"error"``
    The I/O failed (e.g. ENOSPC); ``error`` holds the exception.
``"refused"``
    Not accepted: the queue was full, or the pool was closed.
``"cancelled"``
    Accepted but dropped by ``close(cancel=True)`` before it started.

Work functions return a :class:`JobOutcome` (or None for a plain ``"ok"``).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..checks import check_int

__all__ = ["FINISHED", "IOJob", "JobOutcome", "JobPool", "PoolStats", "run_inline"]

FINISHED = frozenset({"ok", "miss", "corrupt", "error", "refused", "cancelled"})
_OUTCOMES = frozenset({"ok", "miss", "corrupt", "error"})


@dataclass(frozen=True)
class JobOutcome:
    """What a work function reports.

    Parameters
    ----------
    status : {"ok", "miss", "corrupt", "error"}
    nbytes : int
        Payload bytes moved.
    detail : str
        Human-readable why (e.g. which file was quarantined).
    value : Any
        Anything else the tier returns.
    error : BaseException | None
        The exception behind an ``"error"``.
    """

    status: str
    nbytes: int = 0
    detail: str = ""
    value: Any = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        if self.status not in _OUTCOMES:
            raise ValueError(f"status: expected one of {sorted(_OUTCOMES)}, got {self.status!r}")


@dataclass(eq=False)
class IOJob:
    """One submitted I/O operation and, once finished, its outcome.

    Attributes
    ----------
    job_id : int
    kind : str
        What the tier does, e.g. ``"store"`` or ``"load"``.
    info : dict
        The tier's description of the job (key, layers, ...).
    status : str
        See the module docstring.
    nbytes : int
        Payload bytes moved (0 unless ``"ok"``).
    detail : str
    value : Any
    error : BaseException | None
    submitted_at, started_at, finished_at : float | None
        ``time.perf_counter()`` stamps.
    """

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
    _fn: Callable[[], JobOutcome | None] | None = field(default=None, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _collected: bool = field(default=False, repr=False)

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


@dataclass(frozen=True)
class PoolStats:
    """Counters of a :class:`JobPool` (a snapshot)."""

    submitted: int
    refused: int
    finished: int
    errors: int
    cancelled: int
    queued: int
    running: int


def run_inline(job: IOJob) -> IOJob:
    """Run an unsubmitted job in the calling thread (the tiers' synchronous calls)."""
    _execute(job)
    return job


def _execute(job: IOJob) -> None:
    job.status = "running"
    job.started_at = time.perf_counter()
    fn, job._fn = job._fn, None  # drop the closure (and the buffers it holds) when done
    try:
        outcome = fn() if fn is not None else None
        if outcome is None:
            outcome = JobOutcome("ok")
        elif not isinstance(outcome, JobOutcome):
            raise TypeError(f"work function returned {type(outcome).__name__}, not JobOutcome")
        job.nbytes, job.detail, job.value = outcome.nbytes, outcome.detail, outcome.value
        job.error = outcome.error
        job.status = outcome.status
    except BaseException as error:  # never let it escape into a worker or caller thread
        job.error = error
        job.detail = f"{type(error).__name__}: {error}"
        job.status = "error"
    job.finished_at = time.perf_counter()
    job._done.set()


class JobPool:
    """Fixed worker threads fed by a bounded queue.

    Parameters
    ----------
    threads : int
        Worker threads (>= 1).
    queue_depth : int
        Jobs that may wait for a thread (>= 1); beyond it, submissions are refused.
    name : str
        Thread name prefix.
    """

    def __init__(self, threads: int = 4, queue_depth: int = 64, *, name: str = "ckv-io") -> None:
        self.threads = check_int("threads", threads, minimum=1)
        self.queue_depth = check_int("queue_depth", queue_depth, minimum=1)
        self._queue: queue.Queue[IOJob | None] = queue.Queue(maxsize=self.queue_depth)
        self._lock = threading.Lock()
        # Finished, not yet collected by poll() or wait(); insertion-ordered by job id.
        self._finished: dict[int, IOJob] = {}
        self._ids = itertools.count()
        self._closed = False
        self._counts = dict(submitted=0, refused=0, finished=0, errors=0, cancelled=0, running=0)
        self._workers = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()

    # ------------------------------------------------------------------ submission

    def make_job(
        self, kind: str, fn: Callable[[], JobOutcome | None], info: dict | None = None
    ) -> IOJob:
        """A job not yet submitted (for :meth:`submit_job` or :func:`run_inline`)."""
        return IOJob(
            next(self._ids), kind, dict(info or {}), submitted_at=time.perf_counter(), _fn=fn
        )

    def submit(
        self, kind: str, fn: Callable[[], JobOutcome | None], info: dict | None = None
    ) -> IOJob:
        """Queue ``fn`` without blocking; a full queue gives a finished ``"refused"`` job.

        Refused jobs are never returned by :meth:`poll` (the caller holds them).
        """
        return self.submit_job(self.make_job(kind, fn, info))

    def submit_job(self, job: IOJob) -> IOJob:
        """Queue a job made by :meth:`make_job` (see :meth:`submit`)."""
        with self._lock:
            accepted = not self._closed
            if accepted:
                try:
                    self._queue.put_nowait(job)
                except queue.Full:
                    accepted = False
            self._counts["submitted" if accepted else "refused"] += 1
        if not accepted:
            job._fn = None
            job.status = "refused"
            job.detail = "pool closed" if self._closed else "queue full (back-pressure)"
            job.finished_at = time.perf_counter()
            job._collected = True
            job._done.set()
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
        """Block until ``job`` is finished; it is then not returned by :meth:`poll`.

        Raises
        ------
        TimeoutError
            ``timeout`` seconds passed first.
        """
        if not isinstance(job, IOJob):
            raise TypeError(f"job: expected an IOJob, got {type(job).__name__}")
        if not job._done.wait(timeout):
            raise TimeoutError(f"job {job.job_id} ({job.kind}) not finished after {timeout} s")
        with self._lock:
            job._collected = True
            self._finished.pop(job.job_id, None)  # waited-for jobs never pile up unpolled
        return job

    def stats(self) -> PoolStats:
        """Counters, consistent with each other."""
        with self._lock:
            c = self._counts
            return PoolStats(
                submitted=c["submitted"],
                refused=c["refused"],
                finished=c["finished"],
                errors=c["errors"],
                cancelled=c["cancelled"],
                queued=self._queue.qsize(),
                running=c["running"],
            )

    # ------------------------------------------------------------------ workers

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._counts["running"] += 1
            _execute(job)
            with self._lock:
                self._counts["running"] -= 1
                self._counts["finished"] += 1
                self._counts["errors"] += job.status == "error"
                if not job._collected:
                    self._finished[job.job_id] = job

    # ------------------------------------------------------------------ shutdown

    def close(self, *, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop accepting jobs, then drain (default) or cancel the queued ones.

        Running jobs always finish. Cancelled jobs finish with status
        ``"cancelled"`` and are returned by :meth:`poll`. Idempotent.

        Parameters
        ----------
        cancel : bool
            Drop queued jobs instead of running them.
        timeout : float | None
            Give up joining the threads after this long (they are daemons).
        """
        with self._lock:
            if self._closed and not any(w.is_alive() for w in self._workers):
                return
            self._closed = True
        if cancel:
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    continue
                with self._lock:
                    job._fn = None
                    job.status = "cancelled"
                    job.detail = "cancelled by close()"
                    job.finished_at = time.perf_counter()
                    self._counts["cancelled"] += 1
                    self._finished[job.job_id] = job
                job._done.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in self._workers:
            # Blocks only while the workers drain the queue (at most ``timeout``).
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self._queue.put(None, timeout=remaining)
            except queue.Full:
                break
        for worker in self._workers:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            worker.join(remaining)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> JobPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
