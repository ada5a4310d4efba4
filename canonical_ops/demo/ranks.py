"""The rank processes (one writer or reader each) and the coordinator's side of a group:
spawning them, their milestones as progress lines, what each reported."""

from __future__ import annotations

import contextlib
import queue
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from layouts import RankContext
from layouts.cli import escape_text

from ..engine import OffloadWorker, SharedOffloadRegion
from ..engine.hybrid import StateWorker
from . import truth
from .config import DemoConfig


@dataclass(frozen=True)
class Source:
    """Region rows a rank moves: ``kind`` ("kv" or "state") layers ``[first, end)`` of that
    kind, pages ``page_ids`` of one region. ``area_offsets`` place KV layers in the rows of
    a region of another pipeline split (None: the rows are exactly these layers)."""

    kind: str
    region_args: dict
    first: int
    end: int
    page_ids: tuple[int, ...]
    area_offsets: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RankTask:
    """One rank process: its stage, the stage's KV layers, its TP rank and its regions."""

    stage: int
    first: int
    end: int
    tp_rank: int
    sources: tuple[Source, ...]


def _workers(cfg: DemoConfig, role: str, task: RankTask, regions: list, kv: list):
    """The rank's OffloadWorkers over its KV caches (one per KV source) and StateWorkers over
    fresh state slots (one per state source), each with its source."""
    tp, ctx = cfg.tp(role), RankContext(cfg.tp(role), cfg.total_kv_heads, task.tp_rank)
    # The caches hold int bit patterns; the worker checks dtypes, so it gets typed views.
    typed = [t.view(getattr(torch, cfg.dtype)) for t in kv]
    kv_workers, states = [], []
    for source, region in zip(task.sources, regions):
        lo, hi = source.first - task.first, source.end - task.first
        if source.kind == "kv":
            specs, offsets = [cfg.spec(tp)] * (hi - lo), source.area_offsets
            worker = OffloadWorker(typed[lo:hi], specs, ctx, region, area_offsets=offsets)
            kv_workers.append((worker, source))
        else:
            slots, specs = truth.state_slots(cfg, tp, source.first, source.end), cfg.state_specs()
            worker = StateWorker(slots, specs[source.first : source.end], ctx, region)
            states.append((worker, source))
    return kv_workers, states


def rank_main(role: str, cfg_dict: dict, index: int, task: RankTask, events) -> None:
    """One writer or reader process. A writer fills its caches (and the request's state in
    slot 1) from the truth and stores them into its stage's regions; a reader loads them
    (state into slot 0) from every source and checks every byte. Milestones and the result
    (or the traceback) go to the coordinator through ``events``."""

    def emit(event: str, payload: Any = None) -> None:
        events.put((event, index, payload))

    try:
        torch.set_num_threads(1)
        cfg, writer, rank = DemoConfig(**cfg_dict), role == "writer", task.tp_rank
        tp, device, slot = cfg.tp(role), torch.device(cfg.device), 1 if writer else 0
        if device.type == "cuda":
            torch.cuda.set_device(0)
        with contextlib.ExitStack() as closing:
            regions = []
            for source in task.sources:
                regions.append(closing.enter_context(SharedOffloadRegion(**source.region_args)))
            kv = truth.allocate_kv(cfg, tp, device, task.end - task.first)
            kv_workers, states = _workers(cfg, role, task, regions, kv)
            counts = {len(source.page_ids) for _, source in kv_workers}
            if len(counts) > 1:
                raise ValueError(f"sources: expected the same page count from each, got {counts}")
            count = counts.pop() if counts else 0
            blocks = truth.block_table(cfg, salt=1 if writer else 2)[:count].to(device)
            for i, layer in enumerate(range(task.first, task.end) if writer else ()):
                shard = truth.shard_of(cfg, truth.truth_layer(cfg, layer), tp, rank)
                kv[i][blocks] = shard.to(device)
            state = truth.state_pairs(cfg, tp, rank, states, slot)
            for got, want in state if writer else ():
                got.copy_(want)
            emit("started")
            kind = "store" if writer else "load"
            for _ in range(2):  # the first pass warms page tables and caches, the second is timed
                seconds = num_bytes = 0
                for worker, source in kv_workers:
                    pages = torch.tensor(source.page_ids, dtype=torch.int64)
                    job = worker.wait(getattr(worker, kind)(block_ids=blocks, page_ids=pages))
                    seconds, num_bytes = seconds + job.seconds, num_bytes + job.num_bytes
            for worker, source in states:
                getattr(worker, kind)(slot_ids=[slot], page_ids=list(source.page_ids))
            emit("stored" if writer else "loaded")
            report = dict(pages=count, bytes=num_bytes, seconds=seconds)
            report.update(stage=task.stage, tp_rank=rank)
            if not writer:  # the state's views now hold what was loaded
                report.update(truth.compare_with_truth(cfg, tp, rank, kv, blocks, task.first))
                report["state_bytes_wrong"] = sum(int((a != b).sum()) for a, b in state)
                report["state_bytes_checked"] = sum(a.numel() for a, _ in state)
                emit("verified")
            del kv_workers, states, kv, state
        emit("done", report)
    except BaseException:  # reported to the coordinator, which prints FAIL
        emit("error", traceback.format_exc())


class Progress:
    """Timestamped progress lines (seconds since the demo started)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.start = stream, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        """One line (stores' paths and errors in ``message`` escaped)."""
        print(f"[{self.elapsed():6.1f} s] {escape_text(message)}", file=self.stream, flush=True)


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


def run_group(s, role: str, tasks: Sequence[RankTask], milestones: dict[str, str]) -> GroupRun:
    """One process per task (``s``: the session); a progress line once every live rank reached
    a milestone. A rank silent past --timeout, or dead without a word, fails."""
    cfg, count = s.cfg, len(tasks)
    run, events, procs = GroupRun(role, count), s.pool.Queue(), {}
    shape = f"TP={cfg.tp(role)}" + (f" x PP={cfg.pp(role)}" if cfg.pp(role) > 1 else "")
    s.progress(f"{role}s: spawning {count} process{'es' if count > 1 else ''} ({shape})")
    reached: dict[str, set[int]] = {m: set() for m in milestones}
    dead_since: dict[int, float] = {}
    last = time.perf_counter()
    deadline = last + s.timeout_s
    try:
        for index, task in enumerate(tasks):
            args = (role, asdict(cfg), index, task, events)
            procs[index] = s.pool.Process(target=rank_main, args=args)
            procs[index].start()
        while len(run.reports) + len(run.errors) < count:
            now = time.perf_counter()
            pending = [i for i in procs if i not in run.reports and i not in run.errors]
            if now >= deadline:
                late = f"no report within --timeout {s.timeout_s:g} s"
                run.errors.update(dict.fromkeys(pending, late))
                break
            try:
                event, index, payload = events.get(timeout=min(0.5, deadline - now))
            except queue.Empty:  # look for ranks that died without a word
                for i in pending:  # (after 2 s: their last words had time to arrive)
                    code = procs[i].exitcode
                    if code is not None and now - dead_since.setdefault(i, now) > 2:
                        run.errors[i] = f"process exited with code {code} before reporting"
            else:  # a milestone, or the last word: the report or the traceback
                if event in reached:
                    reached[event].add(index)
                else:
                    (run.reports if event == "done" else run.errors)[index] = payload
            live = count - len(run.errors)
            for milestone, words in milestones.items():
                if milestone not in run.phase_seconds and live and len(reached[milestone]) >= live:
                    now = time.perf_counter()
                    run.phase_seconds[milestone], last = now - last, now
                    took = run.phase_seconds[milestone]
                    s.progress(f"{role}s: {len(reached[milestone])}/{count} {words} ({took:.1f} s)")
    finally:
        grace = time.perf_counter() + 5.0  # for all of them together, then kill the rest
        for p in procs.values():
            p.join(timeout=max(0.0, grace - time.perf_counter()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return run
