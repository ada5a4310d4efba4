"""``--store``: the write engine (store, persist to the tiers) and the read engine (fill its
empty regions from verified units, promote, load, verify), sharing nothing but the store."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .engine import (
    Session,
    Source,
    Stage,
    close_stages,
    close_tiers,
    open_stages,
    run_readers,
    run_writers,
)
from .stores import open_tiers, queue_depth
from .verdict import verify_persistent


def store_totals(stages: Sequence[Stage]) -> dict:
    """Tier stores of the stages so far (every tier, every stage): ok, failed, refused, bytes."""
    counters = [t for stage in stages for t in stage.cache.metrics().tiers]
    return dict(
        units_ok=sum(t.stores_ok for t in counters),
        units_failed=sum(t.stores_failed for t in counters),
        units_refused=sum(t.stores_refused for t in counters),
        bytes=sum(t.bytes_stored for t in counters),
    )


def persist_stages(s: Session, stages: Sequence[Stage], tiers: Sequence) -> dict:
    """Write-through of every stage's ready prompt pages to the tiers; waits for the I/O."""
    cfg = s.cfg
    start = time.perf_counter()
    submitted = 0
    for stage in stages:
        submitted += stage.cache.persist(s.hashes).submitted
    events = [event for stage in stages for event in stage.cache.drain(s.timeout_s)]
    seconds = time.perf_counter() - start
    counters = [t for stage in stages for t in stage.cache.metrics().tiers]
    totals = store_totals(stages)
    nbytes = totals["bytes"]
    # One example of each kind of failure ("store failed (disk full): [Errno 28] ...").
    problems: dict[str, str] = {}
    for event in events:
        if event.status != "ok":
            problems.setdefault(event.detail.split(": ", 1)[0], event.detail)
    problems.update({t.last_error: t.last_error for t in counters if t.last_error})
    return dict(
        units_expected=cfg.prompt_blocks * len(stages) * len(tiers),
        units_submitted=submitted,
        **totals,
        seconds=seconds,
        gbps=nbytes / seconds / 1e9 if seconds > 0 and nbytes else None,
        # Every layer of the model, across the stages' units: what any later split can read.
        pages_complete_in_store={
            name: tier.lookup(s.hashes, 0, cfg.layers) for name, _, tier in tiers
        },
        # The engine keeps serving from its regions whatever the tiers did.
        pages_ready_after_persist=min(stage.manager.lookup(s.hashes) for stage in stages),
        errors=list(problems.values()),
    )


def fill_stages(s: Session, stages: Sequence[Stage], tiers: Sequence) -> dict:
    """Look every stage's prompt blocks up (region, then tiers) and fill the region from
    verified units; the prefix every stage holds is what the readers load."""
    start = time.perf_counter()
    found = []
    for stage in stages:
        lookup = stage.cache.lookup(s.hashes)
        found.append(lookup.total)
        stage.cache.fetch(s.hashes, lookup)
    for stage in stages:
        stage.cache.drain(s.timeout_s)
        stage.ready = stage.manager.lookup(s.hashes)
    seconds = time.perf_counter() - start
    counters = [t for stage in stages for t in stage.cache.metrics().tiers]
    nbytes = sum(t.bytes_filled for t in counters)
    by_tier = {name: 0 for name, _, _ in tiers}
    for t in counters:
        by_tier[t.name] += t.fills_ok
    return dict(
        pages_found=min(found),
        pages_filled=min(stage.ready for stage in stages),
        pages_loaded_by_stages=sum(t.fills_ok for t in counters),
        pages_by_tier=by_tier,  # stage pages filled from each tier (files, redis)
        # Units read and verified (a stage of another split reads each unit it overlaps).
        unit_reads=sum(getattr(tier.metrics(), "units_loaded", 0) for _, _, tier in tiers),
        units_missed=sum(t.fills_missed for t in counters),
        units_failed=sum(t.fills_failed for t in counters),
        units_refused=sum(t.fills_refused for t in counters),
        bytes=nbytes,
        seconds=seconds,
        gbps=nbytes / seconds / 1e9 if seconds > 0 and nbytes else None,
    )


def promote_stages(s: Session, stages: Sequence[Stage], tiers: Sequence) -> dict:
    """Two tiers: store what the fill got from Redis into the directory (waits for it)."""
    start = time.perf_counter()
    before = store_totals(stages)
    submitted = sum(stage.cache.promote(s.hashes).submitted for stage in stages)
    for stage in stages:
        stage.cache.drain(s.timeout_s)
    seconds = time.perf_counter() - start
    after = store_totals(stages)
    return dict(
        to=tiers[0][0],
        units_submitted=submitted,
        **{key: after[key] - before[key] for key in after},
        seconds=seconds,
    )


def write_engine(s: Session, tiers: Sequence) -> dict:
    """Writer ranks store the prompt into the stages' regions; the stages persist every
    ready page to the tiers; then everything is closed (the regions are gone)."""
    cfg = s.cfg
    stages = []
    try:
        stages = open_stages(s, "writer", tiers=tiers)
        run_w = run_writers(s, stages)
        ready = min(stage.ready for stage in stages)
        print(f"stored: {ready}/{cfg.prompt_blocks} pages ready", file=s.out, flush=True)
        persist = persist_stages(s, stages, tiers)
        where = ", ".join(f"{name} {location}" for name, location, _ in tiers)
        s.progress(
            f"persist: {persist['units_ok']}/{persist['units_expected']} units "
            f"({cfg.prompt_blocks} pages x {len(stages)} stage(s)) to {where}; "
            f"{persist['units_failed']} failed, {persist['units_refused']} refused "
            f"({persist['seconds']:.1f} s)"
        )
    finally:
        try:
            close_stages(stages, s.timeout_s)
        finally:
            close_tiers(s, tiers, "write")
    return dict(writers=run_w, ready=ready, persist=persist)


def read_engine(s: Session, tiers: Sequence) -> dict:
    """A new engine, empty regions: fill them from the tiers, readers load and verify."""
    cfg = s.cfg
    stages = []
    readers = promote = None
    try:
        stages = open_stages(s, "reader", tiers=tiers)
        fill = fill_stages(s, stages, tiers)
        loaded = fill["pages_filled"]
        s.progress(
            f"fill: {fill['pages_found']}/{cfg.prompt_blocks} pages found in the store, "
            f"{loaded} filled from {fill['unit_reads']} verified unit reads "
            f"({fill['units_missed']} missed, {fill['units_failed']} failed) "
            f"({fill['seconds']:.1f} s)"
        )
        if s.stores.promote:
            promote = promote_stages(s, stages, tiers)
            s.progress(
                f"promote: {promote['units_ok']}/{promote['units_submitted']} units from "
                f"{tiers[-1][0]} written to {tiers[0][0]} {tiers[0][1]} "
                f"({promote['units_failed']} failed, {promote['units_refused']} refused)"
            )
        if loaded:
            pages = [stage.manager.acquire(s.hashes[:loaded]) for stage in stages]

            def sources(index: int, first: int, end: int) -> list[Source]:
                stage = stages[index]
                return [Source(stage.rank_args(), first, end, tuple(pages[index]))]

            try:
                readers = run_readers(s, sources, loaded)
            finally:
                for stage, held in zip(stages, pages):
                    stage.manager.release(held)
    finally:
        try:
            close_stages(stages, s.timeout_s)
        finally:
            close_tiers(s, tiers, "read")
    return dict(readers=readers, loaded=loaded, fill=fill, promote=promote)


def run_persistent(s: Session) -> dict:
    """--store: the write engine, the read engine, or one then the other (sharing only files)."""
    cfg = s.cfg
    phase = s.stores.phase
    out: dict[str, Any] = dict(writers=None, readers=None, persist=None, fill=None)
    tiers, s.first_tiers = s.first_tiers, []  # handed to the first engine, which closes them
    if phase in ("write", "both"):
        out.update(write_engine(s, tiers))
        # The read engine shares nothing with the write engine but the files: its own
        # tier objects (indexes rebuilt from disk), its own empty regions.
        tiers = []
        if phase == "both":
            tiers = open_tiers(s.stores, cfg.namespace("reader"), queue_depth(cfg))
    if phase in ("read", "both"):
        out.update(read_engine(s, tiers))
    out["verification"] = verify_persistent(cfg, phase, out)
    return out
