"""The rank processes (one writer or reader each) and the coordinator's side of a group:
spawning them, their milestones as progress lines, what each reported."""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from layouts import RankContext

from .config import DemoConfig
from .truth import allocate_kv, block_table, compare_with_truth, shard_of, truth_layer

PLAIN_COPY_CAP_BYTES = 256 << 20  # the plain-copy baseline copies at most this much


def plain_copy_seconds(num_bytes: int, device) -> float:
    """Time of one contiguous copy of the same bytes between the same memories.

    Copies at most ``PLAIN_COPY_CAP_BYTES`` and scales the time up linearly.
    """
    import torch

    sample = max(1, min(num_bytes, PLAIN_COPY_CAP_BYTES))
    if device.type == "cuda":
        src = torch.empty(sample, dtype=torch.uint8, device=device)
        dst = torch.empty(sample, dtype=torch.uint8, pin_memory=True)
    else:
        src = torch.ones(sample, dtype=torch.uint8)
        dst = torch.zeros(sample, dtype=torch.uint8)
    dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best * num_bytes / sample


@dataclass(frozen=True)
class Source:
    """Region rows a rank moves: layers ``[first, end)`` of pages ``page_ids`` of one region.

    ``area_offsets`` place those layers in the region's rows when the region
    belongs to another pipeline split (None: the rows are exactly these layers).
    """

    region_args: dict
    first: int
    end: int
    page_ids: tuple[int, ...]
    area_offsets: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RankTask:
    """One rank process: its pipeline stage's layers, its TP rank and the regions it uses."""

    stage: int
    first: int
    end: int
    tp_rank: int
    sources: tuple[Source, ...]


def writer_rank(cfg: DemoConfig, task: RankTask, workers, kv, emit) -> dict:
    """Fill this writer's caches (its stage's layers) from the truth and store the prompt."""
    import torch

    [worker] = workers
    [source] = task.sources
    device = kv[0].device
    blocks = block_table(cfg, salt=1).to(device)
    for index, layer in enumerate(range(task.first, task.end)):
        shard = shard_of(cfg, truth_layer(cfg, layer), cfg.writer_tp, task.tp_rank)
        kv[index][blocks] = shard.to(device)
    emit("started")
    pages = torch.tensor(source.page_ids, dtype=torch.int64)
    # Transfers are idempotent: the first warms page tables and caches, the second is timed.
    worker.wait(worker.store(block_ids=blocks, page_ids=pages))
    job = worker.wait(worker.store(block_ids=blocks, page_ids=pages))
    emit("stored")
    return dict(pages=len(source.page_ids), bytes=job.num_bytes, seconds=job.seconds)


def reader_rank(cfg: DemoConfig, task: RankTask, workers, kv, emit) -> dict:
    """Load the pages into this reader's caches (from every source) and check them."""
    import torch

    device = kv[0].device
    counts = {len(source.page_ids) for source in task.sources}
    if len(counts) != 1:
        raise ValueError(f"sources: expected the same page count from each, got {counts}")
    count = counts.pop()
    blocks = block_table(cfg, salt=2)[:count].to(device)
    emit("started")
    seconds = num_bytes = 0
    for _ in range(2):  # the first warms page tables and caches, the second is timed
        seconds = num_bytes = 0
        for worker, source in zip(workers, task.sources):
            pages = torch.tensor(source.page_ids, dtype=torch.int64)
            job = worker.wait(worker.load(block_ids=blocks, page_ids=pages))
            seconds += job.seconds
            num_bytes += job.num_bytes
    emit("loaded")
    check = compare_with_truth(cfg, cfg.reader_tp, task.tp_rank, kv, blocks, task.first)
    emit("verified")
    return dict(pages=count, bytes=num_bytes, seconds=seconds, **check)


def rank_main(role: str, cfg_dict: dict, index: int, task: RankTask, events) -> None:
    """One writer or reader process; reports milestones and its result through ``events``."""

    def emit(event: str, payload: Any = None) -> None:
        events.put((event, index, payload))

    try:
        import torch

        from canonical_ops.engine import OffloadWorker, SharedOffloadRegion

        torch.set_num_threads(1)
        cfg = DemoConfig(**cfg_dict)
        tp = cfg.tp(role)
        device = torch.device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)
        regions = []
        try:
            for source in task.sources:
                regions.append(SharedOffloadRegion(**source.region_args))
            kv = allocate_kv(cfg, tp, device, task.end - task.first)
            ctx = RankContext(tp, cfg.total_kv_heads, task.tp_rank)
            # The caches hold int bit patterns; the worker checks dtypes, so it gets typed views.
            typed = [t.view(getattr(torch, cfg.dtype)) for t in kv]
            workers = []
            for source, region in zip(task.sources, regions):
                lo, hi = source.first - task.first, source.end - task.first
                workers.append(
                    OffloadWorker(
                        typed[lo:hi],
                        [cfg.spec(tp)] * (hi - lo),
                        ctx,
                        region,
                        area_offsets=source.area_offsets,
                    )
                )
            body = writer_rank if role == "writer" else reader_rank
            report = body(cfg, task, workers, kv, emit)
            report.update(stage=task.stage, tp_rank=task.tp_rank)
            report["copy_seconds"] = plain_copy_seconds(max(report["bytes"], 1), device)
            del workers, kv, typed
        finally:
            for region in regions:
                region.close()
        emit("done", report)
    except BaseException:  # reported to the coordinator, which prints FAIL
        emit("error", traceback.format_exc())


class Progress:
    """Timestamped progress lines (seconds since the demo started)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", file=self.stream, flush=True)


@dataclass
class GroupRun:
    """What one process group reported (processes numbered 0 .. ranks - 1)."""

    role: str
    ranks: int  # processes: TP x PP
    reports: dict[int, dict] = field(default_factory=dict)  # process -> final report
    errors: dict[int, str] = field(default_factory=dict)  # process -> why it failed
    phase_seconds: dict[str, float] = field(default_factory=dict)  # milestone -> since previous

    @property
    def ok(self) -> bool:
        return not self.errors and len(self.reports) == self.ranks


def run_group(
    pool,
    role: str,
    cfg: DemoConfig,
    tasks: Sequence[RankTask],
    timeout_s: float,
    progress: Progress,
    milestones: dict[str, str],
) -> GroupRun:
    """Run one process per task; print a line when all live ranks reach each milestone."""
    count = len(tasks)
    run = GroupRun(role, count)
    events = pool.Queue()
    procs = {}
    plural = f"{role}s"
    shape = f"TP={cfg.tp(role)}" + (f" x PP={cfg.pp(role)}" if cfg.pp(role) > 1 else "")
    progress(f"{plural}: spawning {count} process{'es' if count > 1 else ''} ({shape})")
    start = last = time.perf_counter()
    reached: dict[str, set[int]] = {m: set() for m in milestones}
    announced: set[str] = set()
    dead_since: dict[int, float] = {}
    try:
        for index, task in enumerate(tasks):
            p = pool.Process(target=rank_main, args=(role, asdict(cfg), index, task, events))
            p.start()
            procs[index] = p
        deadline = start + timeout_s
        while len(run.reports) + len(run.errors) < count:
            now = time.perf_counter()
            if now >= deadline:
                for index in procs:
                    if index not in run.reports and index not in run.errors:
                        run.errors[index] = f"no report within --timeout {timeout_s:g} s"
                break
            try:
                event, index, payload = events.get(timeout=min(0.5, deadline - now))
            except Exception:  # queue.Empty: look for ranks that died without a word
                for index, p in procs.items():
                    if index in run.reports or index in run.errors or p.exitcode is None:
                        continue
                    first = dead_since.setdefault(index, now)
                    if now - first > 2.0:  # its last words had time to arrive
                        run.errors[index] = (
                            f"process exited with code {p.exitcode} before reporting"
                        )
            else:
                if event == "done":
                    run.reports[index] = payload
                elif event == "error":
                    run.errors[index] = payload
                elif event in reached:
                    reached[event].add(index)
            live = count - len(run.errors)
            for milestone, words in milestones.items():
                if milestone not in announced and live and len(reached[milestone]) >= live:
                    announced.add(milestone)
                    now = time.perf_counter()
                    run.phase_seconds[milestone] = now - last
                    progress(
                        f"{plural}: {len(reached[milestone])}/{count} {words} ({now - last:.1f} s)"
                    )
                    last = now
    finally:
        grace = time.perf_counter() + 5.0  # for all of them together, then kill the rest
        for p in procs.values():
            p.join(timeout=max(0.0, grace - time.perf_counter()))
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return run


def rank_pool():
    """Process context of the ranks: a forkserver with torch and the ops preloaded, so that
    each rank starts in milliseconds instead of importing torch anew (spawn semantics).

    Started at once, so that the server's imports overlap the coordinator's set-up.
    """
    from multiprocessing import forkserver

    pool = mp.get_context("forkserver")
    pool.set_forkserver_preload(
        ["torch", "numpy", "canonical_ops.ops", "canonical_ops.engine.worker", __name__]
    )
    forkserver.ensure_running()
    return pool
