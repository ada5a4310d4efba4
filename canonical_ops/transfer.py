"""The job machinery every offload worker shares (:class:`TransferQueue`: canonical stores /
loads as jobs, inline on CPU, on a side stream with pooled resources on CUDA), and host
registration (:func:`register_host_memory`) of memory the kernels address directly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .checks import check_ids, check_int
from .ops import ERROR_RECORD_WORDS, CanonicalTransferError, check_unique_ids, transfer_error

__all__ = ["HOST_REGISTER_PORTABLE_MAPPED", "CudaJobPools", "ErrorRecords", "PlanCall"]
__all__ += ["HostRegistrationError", "register_host_memory", "unregister_host_memory"]
__all__ += ["QueuedTransfer", "TransferQueue"]

# cudaHostRegister flags: portable (every context) | mapped (a device address for it).
HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2


class HostRegistrationError(RuntimeError):
    """cudaHostRegister refused a piece; every piece registered before it was rolled back."""


def _status(error) -> int:
    return int(getattr(error, "value", error))


def register_host_memory(
    base: int,
    size: int,
    *,
    chunk_bytes: int,
    cudart=None,
    flags: int = HOST_REGISTER_PORTABLE_MAPPED,
) -> list[int]:
    """Register ``[base, base + size)`` with CUDA in pieces of at most ``chunk_bytes`` (the
    driver caps one call) through ``cudart`` (default torch's, on its current device); returns
    the pieces' addresses. A failing piece rolls back the others and raises
    :class:`HostRegistrationError`: the caller decides whether that is fatal."""
    chunk_bytes = check_int("chunk_bytes", chunk_bytes, minimum=1)
    size = check_int("size", size, minimum=0)
    cudart = torch.cuda.cudart() if cudart is None else cudart
    registered: list[int] = []
    for offset in range(0, size, chunk_bytes):
        piece = min(chunk_bytes, size - offset)
        error = cudart.cudaHostRegister(base + offset, piece, flags)
        if _status(error) != 0:
            text = cudart.cudaGetErrorString(error)
            unregister_host_memory(registered, cudart=cudart)
            raise HostRegistrationError(
                f"cudaHostRegister of {piece} bytes at offset {offset} of {size} failed: "
                f"{text} ({_status(error)}); nothing stays registered. Check the memlock "
                f"limit (ulimit -l) and free host memory"
            )
        registered.append(base + offset)
    return registered


def unregister_host_memory(addresses: Sequence[int], *, cudart=None) -> None:
    """Unregister pieces from :func:`register_host_memory`, last first; tries every one,
    then raises RuntimeError naming those CUDA refused."""
    if not addresses:
        return
    cudart = torch.cuda.cudart() if cudart is None else cudart
    failures = []
    for address in reversed(addresses):
        error = cudart.cudaHostUnregister(address)
        if _status(error) != 0:
            failures.append(f"{address:#x}: {cudart.cudaGetErrorString(error)}")
    if failures:
        raise RuntimeError(f"cudaHostUnregister failed for {', '.join(failures)}")


class ErrorRecords:
    """Per-kernel device-error records in pinned mapped host memory (read with host loads once
    the job completed; never moved or freed while the pool lives: a kernel may hold their
    address). ``chunk``: records allocated at a time; ``pin=False`` for CPU tests."""

    def __init__(self, chunk: int = 64, *, pin: bool = True) -> None:
        self._chunk = check_int("chunk", chunk, minimum=1)
        self._pin = bool(pin)
        self._chunks: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []

    def acquire(self) -> torch.Tensor:
        """A zeroed record: an int64 (ERROR_RECORD_WORDS,) view of a pinned chunk."""
        if not self._free:
            shape = (self._chunk, ERROR_RECORD_WORDS)
            chunk = torch.zeros(shape, dtype=torch.int64, pin_memory=self._pin)
            self._chunks.append(chunk)
            self._free.extend(reversed(chunk.unbind(0)))
        return self._free.pop()

    def release(
        self,
        record: torch.Tensor,
        block_ids: np.ndarray | None = None,
        page_ids: np.ndarray | None = None,
    ) -> CanonicalTransferError | None:
        """Read ``record`` (its kernel completed), clear it and take it back: the error it
        holds (naming the refused pair's ids when the call's host ids are given), or None."""
        error = transfer_error(record.tolist(), block_ids, page_ids)
        record.zero_()
        self._free.append(record)
        return error


class CudaJobPools:
    """Reusable per-job CUDA resources (events, pinned id staging, error records): taken at
    submission, given back once the job completed, so a steady stream of jobs allocates
    nothing. ``timing``: events record time; ``pin=False`` for tests."""

    def __init__(self, *, timing: bool = False, pin: bool = True) -> None:
        self.timing = bool(timing)
        self.errors = ErrorRecords(pin=pin)
        self._pin = bool(pin)
        self._events: list[torch.cuda.Event] = []
        self._staging: dict[int, list[torch.Tensor]] = {}

    def event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=self.timing)

    def release_event(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self._events.append(event)

    def staging(self, count: int) -> torch.Tensor:
        """Pinned int64 (capacity,) with capacity >= ``count`` (a power of two, >= 128)."""
        capacity = max(128, 1 << max(0, int(count) - 1).bit_length())
        if free := self._staging.setdefault(capacity, []):
            return free.pop()
        return torch.empty(capacity, dtype=torch.int64, pin_memory=self._pin)

    def release_staging(self, buffer: torch.Tensor) -> None:
        self._staging.setdefault(buffer.numel(), []).append(buffer)


Ids = np.ndarray | torch.Tensor | Sequence[int]


@dataclass(frozen=True)
class PlanCall:
    """(block, page) pairs and the plans that move them: ``plans`` holds
    ``(kv_caches, plan)`` per plan (e.g. a KV-cache group split at the layer cap)."""

    plans: Sequence[tuple[Sequence[torch.Tensor], torch.Tensor]]
    block_ids: Ids
    page_ids: Ids


@dataclass(eq=False)
class QueuedTransfer:
    """One submitted job. ``seconds``: device time on a timing queue, else host time."""

    started: float
    finished: float | None = None
    error: CanonicalTransferError | None = None
    seconds: float | None = None
    _start: torch.cuda.Event | None = field(default=None, repr=False)
    _end: torch.cuda.Event | None = field(default=None, repr=False)
    _records: list[tuple] = field(default_factory=list, repr=False)
    _staging: list[torch.Tensor] = field(default_factory=list, repr=False)
    _keep_alive: tuple = field(default=(), repr=False)

    @property
    def done(self) -> bool:
        """Booked by its queue (``finished``, ``error`` and ``seconds`` are final)."""
        return self.finished is not None

    def ready(self) -> bool:
        """Whether its device work completed: one event query, no wait."""
        return self._end is None or self._end.query()

    def make_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: current) after this job without blocking the host."""
        if self._end is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._end)


def _host_array(ids: np.ndarray | torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids)


def _host_tensor(ids: np.ndarray | torch.Tensor) -> torch.Tensor:
    return ids.cpu() if isinstance(ids, torch.Tensor) else torch.from_numpy(ids)


class TransferQueue:
    """Canonical store / load jobs of one worker direction. ``cpu_pages``: the uint8 (rows,
    row_bytes) tensor every plan addresses, ``pages_per_row`` canonical pages of each layer
    per row (to range-check host ids); ``timing``: CUDA jobs measure their device time."""

    def __init__(
        self,
        device: torch.device,
        cpu_pages: torch.Tensor,
        pages_per_row: int,
        *,
        timing: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.cpu_pages = cpu_pages
        self.pages_per_row = check_int("pages_per_row", pages_per_row, minimum=1)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.pools = CudaJobPools(timing=timing) if cuda else None

    def submit(self, store: bool, calls: Sequence[PlanCall]) -> QueuedTransfer:
        """Run (CPU) or queue (CUDA) the calls' kernels as one job; bad host ids raise
        before anything runs (IndexError out of range, ValueError repeated destination)."""
        job = QueuedTransfer(started=time.perf_counter())
        calls = [
            PlanCall(
                call.plans,
                check_ids("block_ids", call.block_ids),
                check_ids("page_ids", call.page_ids),
            )
            for call in calls
            if call.plans  # a call without plans moves nothing
        ]
        if self.stream is None:
            ops = torch.ops.canonical
            op = ops.canonical_store if store else ops.canonical_load
            for call in calls:
                blocks, pages = map(_host_tensor, (call.block_ids, call.page_ids))
                for kv_caches, plan in call.plans:
                    op(list(kv_caches), self.cpu_pages, plan, blocks, pages)
            return self.finish(job)
        prepared = [self._host_ids(store, call) for call in calls]  # all checked first
        self._launch(job, store, calls, prepared)
        return job

    def _host_ids(self, store: bool, call: PlanCall) -> tuple[np.ndarray, np.ndarray] | None:
        """Host ids checked as the op checks them; None when the call has device ids
        (unchecked without a sync: the kernel refuses out-of-range ones into the record)."""
        ids = (call.block_ids, call.page_ids)
        if any(isinstance(i, torch.Tensor) and i.is_cuda for i in ids):
            return None
        blocks, pages = (_host_array(i) for i in ids)
        if len(blocks) != len(pages):
            raise ValueError(
                f"page_ids: expected as many ids as block_ids ({len(blocks)}), got {len(pages)}"
            )
        num_blocks = min(int(kv.size(0)) for kvs, _ in call.plans for kv in kvs)
        num_pages = int(self.cpu_pages.size(0)) * self.pages_per_row
        for name, array, limit in (
            ("block_ids", blocks, num_blocks),
            ("page_ids", pages, num_pages),
        ):
            bad = np.flatnonzero((array < 0) | (array >= limit))
            if bad.size:
                raise IndexError(
                    f"{name}[{int(bad[0])}] = {int(array[bad[0]])}: expected 0 <= id < {limit}"
                )
        if store:
            check_unique_ids("page_ids", pages, "page ids in a store (destinations)")
        else:
            check_unique_ids("block_ids", blocks, "block ids in a load (destinations)")
        return blocks, pages

    def _device_ids(self, ids: np.ndarray | torch.Tensor) -> torch.Tensor:
        if isinstance(ids, torch.Tensor) and ids.device == self.device:
            return ids
        return _host_tensor(ids).pin_memory().to(self.device, non_blocking=True)

    def _launch(self, job: QueuedTransfer, store: bool, calls, prepared) -> None:
        pools, stream, ops = self.pools, self.stream, torch.ops.canonical
        reporting = ops._canonical_store_reporting if store else ops._canonical_load_reporting
        keep = []
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if pools.timing:
                job._start = pools.event()
                job._start.record(stream)
            for call, host in zip(calls, prepared):
                if host is not None:  # one pinned buffer, one H2D copy for both id arrays
                    count = len(host[0])
                    buffer = pools.staging(2 * count)
                    buffer[:count] = torch.from_numpy(host[0])
                    buffer[count : 2 * count] = torch.from_numpy(host[1])
                    job._staging.append(buffer)
                    ids = buffer[: 2 * count].to(self.device, non_blocking=True)
                    blocks, pages = ids[:count], ids[count:]
                else:
                    blocks, pages = (self._device_ids(i) for i in (call.block_ids, call.page_ids))
                keep += [blocks, pages]
                for kv_caches, plan in call.plans:
                    record = pools.errors.acquire()
                    try:
                        reporting(list(kv_caches), self.cpu_pages, plan, blocks, pages, record)
                    except BaseException:
                        pools.errors.release(record)  # refused before launch: never handed out
                        raise
                    job._records.append((record, *(host or (None, None))))
            job._end = pools.event()
            job._end.record(stream)
        job._keep_alive = tuple(keep)  # device ids must outlive the kernels

    def finish(self, job: QueuedTransfer) -> QueuedTransfer:
        """Book a job whose device work completed (:meth:`QueuedTransfer.ready`): read its
        error records (host loads), time it, give its pooled resources back. Idempotent."""
        if job.done:
            return job
        job.finished = time.perf_counter()
        job.seconds = job.finished - job.started
        if job._end is not None:
            pools = self.pools
            if job._start is not None:
                job.seconds = job._start.elapsed_time(job._end) * 1e-3
            for record, blocks, pages in job._records:
                error = pools.errors.release(record, blocks, pages)
                job.error = job.error or error
            for buffer in job._staging:
                pools.release_staging(buffer)
            pools.release_event(job._start)
            pools.release_event(job._end)
            job._records, job._staging, job._start, job._end = [], [], None, None
        job._keep_alive = ()
        return job

    def synchronize(self, job: QueuedTransfer) -> QueuedTransfer:
        """Block until ``job``'s device work completed (its own event only), then book it."""
        if job._end is not None:
            job._end.synchronize()
        return self.finish(job)
