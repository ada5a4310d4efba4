"""Engines: per pipeline stage a region, its PageManager and (with --store) its StageCache;
the writer and reader groups run against them; the shared-memory run (both engines at once)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from .config import DemoConfig
from .geometry import Geometry
from .ranks import GroupRun, Progress, RankTask, Source, run_group
from .stores import StorePlan
from .verdict import verify


@dataclass
class Stage:
    """One pipeline stage of an engine, scheduler side (this coordinator is rank 0 of its
    region): the region, its PageManager and, with --store, its StageCache."""

    role: str
    index: int
    first: int
    end: int
    region_args: dict  # without ``rank``
    region: Any = None
    manager: Any = None
    cache: Any = None
    page_ids: list = field(default_factory=list)  # of the prompt's blocks, writers' stores
    generations: list[int] = field(default_factory=list)  # of page_ids, read at allocate
    ready: int = 0  # leading prompt blocks ready in the region
    attached: int = 0  # ranks given a region rank so far (rank 0 is the coordinator)

    def rank_args(self) -> dict:
        """Region arguments for the next rank to attach."""
        self.attached += 1
        return dict(self.region_args, rank=self.attached)


@dataclass
class Session:
    """State shared by the phases of one demo run."""

    cfg: DemoConfig
    geometry: Geometry
    progress: Progress
    out: TextIO
    timeout_s: float
    pool: Any = None
    stores: StorePlan = field(default_factory=lambda: StorePlan((), "both", None, False))
    hashes: list = field(default_factory=list)
    run_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    first_tiers: list = field(default_factory=list)  # opened at start-up (usage checks)
    tier_reports: list[dict] = field(default_factory=list)


def open_stages(
    s: Session, role: str, extra_ranks: Sequence[int] = (), tiers: Sequence = ()
) -> list[Stage]:
    """``role``'s engine: per pipeline stage a region (rank 0 here), a PageManager and,
    with tiers, a StageCache over both. ``extra_ranks[i]``: other ranks attaching stage i."""
    from canonical_ops.engine import PageManager, SharedOffloadRegion

    from ..engine.cache import StageCache

    cfg = s.cfg
    groups = s.geometry.groups(role)
    namespace = cfg.namespace(role) if tiers else None
    stages: list[Stage] = []
    try:
        for index, (first, end) in enumerate(cfg.stages(role)):
            extra = extra_ranks[index] if extra_ranks else 0
            stage = Stage(
                role,
                index,
                first,
                end,
                dict(
                    engine_id=f"demo-{s.run_id}-{role[0]}{index}",
                    num_rows=cfg.prompt_blocks,
                    row_bytes=s.geometry.stage_row_bytes(first, end),
                    world_size=1 + cfg.tp(role) + extra,
                    pin=cfg.device == "cuda",
                ),
            )
            stage.region = SharedOffloadRegion(**stage.region_args, rank=0)
            stages.append(stage)
            stage.manager = PageManager.from_mappings(cfg.prompt_blocks, groups[first:end])
            if tiers:
                stage.cache = StageCache(
                    stage.manager,
                    stage.region,
                    (first, end),
                    namespace,
                    [tier for _, _, tier in tiers],
                    names=[name for name, _, _ in tiers],
                )
    except BaseException:
        close_stages(stages)
        raise
    return stages


def close_stages(stages: Sequence[Stage], timeout_s: float | None = None) -> None:
    """Drain the stages' tier I/O, drop every view of their rows, close the regions."""
    from canonical_ops.engine import SharedOffloadRegion

    for stage in stages:
        try:
            if stage.cache is not None:
                stage.cache.close(timeout_s)
        finally:
            stage.cache = None
            if stage.region is not None:
                stage.region.close()
            # Ranks that never attached (a failed group) leave the region's "closed before
            # every rank attached" marker: this engine id is never reused.
            SharedOffloadRegion.remove_closed_marker(stage.region_args["engine_id"])


def close_tiers(s: Session, tiers: Sequence, engine: str) -> None:
    """Finish the tiers' queued I/O, record their counters for the summary, close them."""
    for name, location, tier in tiers:
        tier.close()
        metrics = tier.metrics()
        s.tier_reports.append(dict(engine=engine, name=name, location=location, **asdict(metrics)))


def run_writers(s: Session, stages: Sequence[Stage]) -> GroupRun:
    """The writer engine's ranks: every stage's pages allocated, every writer stores its
    share of its stage's layers; pages ready once every elected writer reported."""
    cfg = s.cfg
    tasks = []
    for stage in stages:
        stage.page_ids = stage.manager.allocate(s.hashes)
        stage.generations = [stage.manager.generation(page) for page in stage.page_ids]
        for tp_rank in range(cfg.writer_tp):
            source = Source(stage.rank_args(), stage.first, stage.end, tuple(stage.page_ids))
            tasks.append(RankTask(stage.index, stage.first, stage.end, tp_rank, (source,)))
    run = run_group(
        s.pool,
        "writer",
        cfg,
        tasks,
        s.timeout_s,
        s.progress,
        {"started": "started (caches filled)", "stored": "stored their share"},
    )
    for index, task in enumerate(tasks):
        if index not in run.reports:
            continue
        stage = stages[task.stage]
        for page, generation in zip(stage.page_ids, stage.generations):
            if task.tp_rank in stage.manager.writer_ranks(page):
                stage.manager.complete_store(page, task.tp_rank, generation=generation)
    for stage in stages:
        stage.ready = stage.manager.lookup(s.hashes)
    return run


def readers_per_writer_stage(cfg: DemoConfig) -> list[int]:
    """Shared memory: reader ranks attaching each writer stage's region (their layers meet)."""
    out = []
    for w_first, w_end in cfg.stages("writer"):
        stages = sum(first < w_end and w_first < end for first, end in cfg.stages("reader"))
        out.append(stages * cfg.reader_tp)
    return out


def run_readers(s: Session, sources_of_stage, count: int) -> GroupRun:
    """The reader engine's ranks: load ``count`` prompt pages into their caches, check every
    byte. ``sources_of_stage(stage index, first, end)`` gives a rank its regions and pages."""
    cfg = s.cfg
    tasks = [
        RankTask(index, first, end, tp_rank, tuple(sources_of_stage(index, first, end)))
        for index, (first, end) in enumerate(cfg.stages("reader"))
        for tp_rank in range(cfg.reader_tp)
    ]
    return run_group(
        s.pool,
        "reader",
        cfg,
        tasks,
        s.timeout_s,
        s.progress,
        {
            "started": "started",
            "loaded": "loaded",
            "verified": "compared with the unsharded truth",
        },
    )


def run_shared_memory(s: Session) -> dict:
    """Both engines at once: readers attach the writers' regions (no files)."""
    cfg = s.cfg
    writers = open_stages(s, "writer", readers_per_writer_stage(cfg))
    readers = None
    try:
        run_w = run_writers(s, writers)
        ready = min(stage.ready for stage in writers)
        print(f"stored: {ready}/{cfg.prompt_blocks} pages ready", file=s.out, flush=True)
        if ready:
            pages = [stage.manager.acquire(s.hashes[:ready]) for stage in writers]
            page_bytes = s.geometry.canonical_page_bytes

            def sources(index: int, first: int, end: int) -> list[Source]:
                out = []
                for w, stage in enumerate(writers):
                    lo, hi = max(first, stage.first), min(end, stage.end)
                    if lo >= hi:
                        continue
                    offsets = tuple((layer - stage.first) * page_bytes for layer in range(lo, hi))
                    out.append(Source(stage.rank_args(), lo, hi, tuple(pages[w]), offsets))
                return out

            try:
                readers = run_readers(s, sources, ready)
            finally:
                for stage, held in zip(writers, pages):
                    stage.manager.release(held)
    finally:
        close_stages(writers)
    verification = verify(cfg, run_w, ready, readers)
    return dict(writers=run_w, readers=readers, ready=ready, verification=verification)
