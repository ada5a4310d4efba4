"""The CUDA job bookkeeping of canonical_ops.transfer, run on the CPU.

``EmulatedCuda(monkeypatch).attach(queue)`` turns a CPU :class:`TransferQueue` into one
that takes its CUDA path (pinned-id staging, ``wait_stream``, one error record per
kernel, pooled events, keep-alive) with a stand-in side stream: kernels are the CPU
reporting ops, deferred until the test completes the stream (``stream.run()``) or a
``synchronize`` reaches them, so jobs really are in flight between submit and finish.
What this cannot cover (the device, the real stream and event semantics) needs a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from canonical_ops.transfer import CudaJobPools, TransferQueue


class FakeStream:
    """A side stream: work queued in order, run when the test (or a sync) says so."""

    def __init__(self) -> None:
        self.work: list = []  # callables; events are markers (run = mark complete)
        self.done = 0
        self.waited_on: list = []

    def wait_stream(self, other) -> None:
        self.waited_on.append(other)

    def run(self, upto: int | None = None) -> None:
        """Run queued work up to position ``upto`` (default: everything)."""
        end = len(self.work) if upto is None else upto
        while self.done < end:
            self.work[self.done]()
            self.done += 1


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.stream: FakeStream | None = None
        self.position = 0

    def record(self, stream: FakeStream) -> None:
        stream.work.append(lambda: None)
        self.stream, self.position = stream, len(stream.work)

    def query(self) -> bool:
        return self.stream.done >= self.position

    def synchronize(self) -> None:
        self.stream.run(self.position)

    def elapsed_time(self, end: FakeEvent) -> float:
        return float(end.position - self.position)  # "ms": one per queued item


class EmulatedCuda:
    """torch.cuda stand-ins for the test's duration (``monkeypatch``); :meth:`attach` gives
    a CPU-built queue a fake side stream. ``fail["pair"] = i`` makes the next kernel
    launched refuse pair ``i`` as the device would (record: block-id flag, pair + 1)."""

    def __init__(self, monkeypatch, fail: dict | None = None) -> None:
        self.fail = {} if fail is None else fail
        self.current: FakeStream | None = None
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
        monkeypatch.setattr(torch.cuda, "stream", self._use)
        for name in ("_canonical_store_reporting", "_canonical_load_reporting"):
            real = getattr(torch.ops.canonical, name)
            monkeypatch.setattr(torch.ops.canonical, name, functools.partial(self._launch, real))

    @contextlib.contextmanager
    def _use(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def _launch(self, real, kv_caches, cpu_pages, plan, blocks, pages, record) -> None:
        refused = self.fail.pop("pair", None)

        def kernel() -> None:
            if refused is not None:
                record[0], record[2] = 1, refused + 1
            else:
                real(kv_caches, cpu_pages, plan, blocks, pages, record)

        self.current.work.append(kernel)

    def attach(self, queue: TransferQueue, *, timing: bool = False) -> FakeStream:
        """Put ``queue`` on a fake side stream (``timing`` as its own: OffloadWorker off,
        the vLLM worker on); returns the stream."""
        stream = FakeStream()
        queue.stream = stream
        queue.pools = CudaJobPools(timing=timing, pin=False)
        return stream
