"""The engines: per pipeline stage a region of KV rows (hybrid: and one of request state), each
with its PageManager and, with --store, its StageCache: both at once in shared memory, or a
write engine and a read engine that share nothing but the store."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from layouts import RankContext

from ..engine import PageManager, SharedOffloadRegion, StageCache
from ..engine.hybrid import state_group_mappings, state_page_manager
from .config import DemoConfig, StorePlan, UsageError, redact, state_bytes, tier_kind
from .ranks import GroupRun, Progress, RankTask, Source, run_group


@dataclass
class Part:
    """One kind of rows of a pipeline stage ("kv": a page per prompt block; "state": one
    row, the request's state) over layers ``[first, end)`` of that kind, coordinator side."""

    kind: str
    first: int
    end: int
    keys: list  # the block hashes its rows hold (state: the prompt's last block)
    positions: list  # each key's block index in the prompt (tail-first eviction)
    region_args: dict  # without ``rank``
    region: Any = None
    manager: Any = None
    cache: Any = None
    page_ids: list = field(default_factory=list)  # the writers' pages
    generations: list[int] = field(default_factory=list)  # of page_ids, read at allocate
    ready: int = 0  # leading keys ready in the region
    attached: int = 0  # ranks given a region rank so far (rank 0 is the coordinator)

    def source(self, page_ids, span=None, offsets=None) -> Source:
        """The rows the next rank to attach moves (with its own region rank)."""
        self.attached += 1
        first, end = span or (self.first, self.end)
        args = dict(self.region_args, rank=self.attached)
        return Source(self.kind, args, first, end, tuple(page_ids), offsets)


@dataclass
class Session:
    """State shared by the phases of one demo run."""

    cfg: DemoConfig
    progress: Progress
    out: TextIO
    timeout_s: float
    pool: Any = None
    stores: StorePlan = field(default_factory=lambda: StorePlan((), "both", None, False))
    hashes: list = field(default_factory=list)
    run_id: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    first_tiers: dict = field(default_factory=dict)  # opened at start-up (usage checks)
    tier_reports: list[dict] = field(default_factory=list)


Stages = list[list[Part]]  # per pipeline stage, its parts


def _all(stages: Stages, kind: str | None = None) -> list[Part]:
    return [part for parts in stages for part in parts if kind in (None, part.kind)]


def open_engine_tiers(s: Session, role: str) -> dict[str, list]:
    """Every --store for ``role``'s namespaces, {"kv": [(kind, shown, tier)], "state": ...},
    files first; UsageError (one line, URL redacted) for an unusable one. Servers are opened
    first: a refused password leaves no directory created (FileStore creates a missing one)."""
    from ..units import FileStore

    cfg, kv = s.cfg, s.cfg.namespace(role)
    namespaces = {"kv": kv, "state": kv.state_units()} if cfg.kinds else {"kv": kv}
    # Room for one prompt of every stage at once: no back-pressure refusals in the demo.
    depth = dict(kv=max(64, cfg.prompt_blocks * max(cfg.writer_pp, cfg.reader_pp) + 16), state=16)
    tiers: dict[str, list] = {units: [] for units in namespaces}
    try:
        for location in sorted(s.stores.locations, key=lambda loc: tier_kind(loc) == "files"):
            kind, shown = tier_kind(location), redact(location)
            for units, namespace in namespaces.items():
                try:
                    if kind == "files":
                        limits = dict(capacity_bytes=s.stores.capacity_bytes)
                        tier = FileStore(location, namespace, queue_depth=depth[units], **limits)
                    else:
                        from ..units import RedisStore

                        tier = RedisStore(location, namespace, queue_depth=depth[units])
                except ImportError as error:
                    why = f"needs the redis package (pip install redis): {error}"
                    raise UsageError(f"--store {shown}: {why}") from None
                except (OSError, ValueError, RuntimeError) as error:
                    raise UsageError(f"--store {shown}: {error}") from None
                where = len(tiers[units]) if kind == "redis" else 0  # files first
                tiers[units].insert(where, (kind, shown, tier))
    except BaseException:
        close_tiers(s, tiers, None)
        raise
    return tiers


def close_tiers(s: Session, tiers: dict, engine: str | None) -> None:
    """Finish the tiers' queued I/O, record their counters for the summary, close them."""
    for units, opened in tiers.items():
        for name, location, tier in opened:
            tier.close()
            if engine is not None:
                report = dict(engine=engine, name=name, location=location, units=units)
                s.tier_reports.append(dict(report, **asdict(tier.metrics())))


@contextlib.contextmanager
def engine(s: Session, role: str, tiers=None, extra: Sequence[int] = ()) -> Iterator[Stages]:
    """``role``'s engine: per stage its parts' regions (rank 0 here), PageManagers and, with
    tiers, StageCaches (``extra[i]``: other ranks attaching stage i's KV region); on exit the
    tiers' I/O drained, the regions closed (rank 0's close unlinks them), the tiers closed."""
    cfg, tp, blocks, stages = s.cfg, s.cfg.tp(role), s.cfg.prompt_blocks, []
    namespace = cfg.namespace(role) if tiers else None
    with contextlib.ExitStack() as closing:  # closed in reverse: caches, regions, the tiers
        closing.callback(close_tiers, s, tiers or {}, "write" if role == "writer" else "read")
        for index, ((a0, a1), (s0, s1)) in enumerate(cfg.stage_parts(role)):
            stages.append(parts := [])
            args = dict(engine_id=f"demo-{s.run_id}-{role[0]}{index}", world_size=1 + tp)
            args.update(pin=cfg.device == "cuda", num_rows=blocks)
            if a1 > a0:
                kv = dict(args, row_bytes=(a1 - a0) * s.cfg.page_bytes)
                kv["world_size"] += extra[index] if extra else 0
                parts.append(Part("kv", a0, a1, s.hashes, list(range(blocks)), kv))
            if s1 > s0:
                one = dict(args, engine_id=args["engine_id"] + "s", num_rows=1)
                one["row_bytes"] = state_bytes(cfg, s0, s1)
                parts.append(Part("state", s0, s1, s.hashes[-1:], [blocks - 1], one))
            for part in parts:
                part.region = closing.enter_context(SharedOffloadRegion(**part.region_args, rank=0))
                if part.kind == "kv":
                    groups = [cfg.mappings(role)] * (a1 - a0)
                    part.manager = PageManager.from_mappings(blocks, groups)
                else:
                    ctx = RankContext(tp, cfg.total_kv_heads, 0)
                    groups = state_group_mappings(cfg.state_specs()[s0:s1], ctx)
                    part.manager = state_page_manager(1, groups)
                if tiers:  # a stage's unit is its row: the layers of its kind's namespace
                    units = namespace if part.kind == "kv" else namespace.state_units()
                    names, opened = zip(*((name, tier) for name, _, tier in tiers[part.kind]))
                    span, manager = (part.first, part.end), part.manager
                    part.cache = StageCache(manager, part.region, span, units, opened, names=names)
                    closing.callback(part.cache.close, s.timeout_s)
        yield stages


def run_writers(s: Session, stages: Stages) -> tuple[GroupRun, int]:
    """The writer ranks store their share of their stage's pages; a page is ready once every
    elected writer reported it. (The group, the ready KV prefix.)"""
    tasks = []
    for index, ((kv, _), parts) in enumerate(zip(s.cfg.stage_parts("writer"), stages)):
        for part in parts:
            part.page_ids = part.manager.allocate(part.keys)
            part.generations = [part.manager.generation(page) for page in part.page_ids]
        for rank in range(s.cfg.writer_tp):
            sources = tuple(part.source(part.page_ids) for part in parts)
            tasks.append(RankTask(index, *kv, rank, sources))
    words = {"started": "started (caches filled)", "stored": "stored their share"}
    run = run_group(s, "writer", tasks, words)
    for index, task in enumerate(tasks):
        for part in stages[task.stage] if index in run.reports else ():
            for page, generation in zip(part.page_ids, part.generations):
                if task.tp_rank in part.manager.writer_ranks(page):
                    part.manager.complete_store(page, task.tp_rank, generation=generation)
    for part in _all(stages):
        part.ready = part.manager.lookup(part.keys)
    ready = min(part.ready for part in _all(stages, "kv"))
    print(f"stored: {ready}/{s.cfg.prompt_blocks} pages ready", file=s.out, flush=True)
    return run, ready


def run_readers(s: Session, held: dict, sources) -> GroupRun:
    """The reader ranks load and check every byte; ``sources(stage, its KV layers)`` gives a
    rank its rows. ``held`` (id -> (part, pages)): pinned until they are done."""
    tasks = [
        RankTask(index, *kv, rank, tuple(sources(index, kv)))
        for index, (kv, _) in enumerate(s.cfg.stage_parts("reader"))
        for rank in range(s.cfg.reader_tp)
    ]
    words = dict(started="started", loaded="loaded", verified="compared with the unsharded truth")
    try:
        return run_group(s, "reader", tasks, words)
    finally:
        for part, pages in held.values():
            part.manager.release(pages)


def run_shared_memory(s: Session) -> dict:
    """Both engines at once: readers attach the writers' regions (no store); a reader stage
    reads every writer stage its layers meet, at those layers' offsets in their rows."""
    cfg, page, readers = s.cfg, s.cfg.page_bytes, None
    reading = [kv for kv, _ in cfg.stage_parts("reader")]
    extra = [
        cfg.reader_tp * sum(a < w1 and w0 < b for a, b in reading)
        for (w0, w1), _ in cfg.stage_parts("writer")
    ]
    with engine(s, "writer", extra=extra) as writers:
        run_w, ready = run_writers(s, writers)
        held = {id(p): (p, p.manager.acquire(s.hashes[:ready])) for p in _all(writers, "kv")}

        def sources(index: int, kv: tuple[int, int]) -> list[Source]:
            out = []
            for part, pages in held.values():
                lo, hi = max(kv[0], part.first), min(kv[1], part.end)
                offsets = tuple((layer - part.first) * page for layer in range(lo, hi))
                out += [part.source(pages, (lo, hi), offsets)] if lo < hi else []
            return out

        readers = run_readers(s, held, sources) if ready else None
    return dict(writers=run_w, readers=readers, ready=ready)


def _tier_sums(parts: Sequence[Part], **fields: str) -> dict:
    """Per output name, the sum of a TierCounters field over every tier of ``parts``."""
    counters = [t for part in parts for t in part.cache.metrics().tiers]
    return {name: sum(getattr(t, key) for t in counters) for name, key in fields.items()}


def _drain(s: Session, stages: Stages) -> list:
    return [event for part in _all(stages) for event in part.cache.drain(s.timeout_s)]


def _write_through(s: Session, stages: Stages, kind: str) -> tuple[dict, int, list]:
    """``kind`` (persist, or promote: from a farther tier into the nearer) every part's rows
    and wait: (the KV stores' counts, the state units stored, the events)."""
    kv, state = _all(stages, "kv"), _all(stages, "state")
    stored = dict(units_ok="stores_ok", units_failed="stores_failed")
    stored.update(units_refused="stores_refused", bytes="bytes_stored")
    before, state_before = _tier_sums(kv, **stored), _tier_sums(state, ok="stores_ok")["ok"]
    start = time.perf_counter()
    submitted = [getattr(p.cache, kind)(p.keys, p.positions).submitted for p in kv + state]
    events, after = _drain(s, stages), _tier_sums(kv, **stored)
    seconds = time.perf_counter() - start
    totals = dict(units_submitted=sum(submitted[: len(kv)]))
    totals.update({key: after[key] - before[key] for key in after}, seconds=seconds)
    totals["gbps"] = totals["bytes"] / seconds / 1e9 if seconds > 0 and totals["bytes"] else None
    return totals, _tier_sums(state, ok="stores_ok")["ok"] - state_before, events


def write_engine(s: Session, tiers: dict) -> dict:
    """Writer ranks store the prompt (and the request's state) into the stages' regions;
    write-through of every ready row to the tiers; then everything is closed."""
    cfg = s.cfg
    with engine(s, "writer", tiers) as stages:
        run_w, ready = run_writers(s, stages)
        persist, state_units, events = _write_through(s, stages, "persist")
        kv, state = _all(stages, "kv"), _all(stages, "state")
        problems = {}  # one example of each kind of failure ("store failed (disk full): ...")
        errors = [t.last_error for p in kv for t in p.cache.metrics().tiers if t.last_error]
        for detail in [e.detail for e in events if e.status != "ok"] + errors:
            problems.setdefault(detail.split(": ", 1)[0], detail)
        persist = dict(units_expected=cfg.prompt_blocks * len(kv) * len(tiers["kv"]), **persist)
        # Every layer of the model, across the stages' units: what any later split can read.
        complete = {name: tier.lookup(s.hashes, 0, cfg.kv_layers) for name, _, tier in tiers["kv"]}
        # The engine keeps serving from its regions whatever the tiers did.
        serving = min(p.manager.lookup(s.hashes) for p in kv)
        persist.update(pages_complete_in_store=complete, pages_ready_after_persist=serving)
        persist["errors"] = list(problems.values())
        units = dict(units_expected_persisted=len(state) * len(tiers["kv"]))
        units.update(units_ready=sum(p.ready for p in state), units_persisted=state_units)
        where = ", ".join(f"{name} {location}" for name, location, _ in tiers["kv"])
        also = f" and {state_units} state unit(s)" if cfg.kinds else ""
        rate = f" at {persist['gbps']:.2f} GB/s" if persist["gbps"] else ""
        complete = ", ".join(f"{name} {n}/{cfg.prompt_blocks}" for name, n in complete.items())
        s.progress(
            f"persist: {persist['units_ok']}/{persist['units_expected']} units "
            f"({cfg.prompt_blocks} pages x {len(kv)} stage(s)){also} to {where}: "
            f"{persist['bytes'] / 2**20:.1f} MiB{rate}, {persist['units_failed']} failed, "
            f"{persist['units_refused']} refused; pages complete in the store (every layer): "
            f"{complete}; still served from the region: {serving}/{cfg.prompt_blocks} "
            f"({persist['seconds']:.1f} s)"
        )
    return dict(writers=run_w, ready=ready, persist=persist, state=units)


def _fill(s: Session, stages: Stages, tiers: dict) -> dict:
    """Look every part's keys up (region, then tiers) and fill its region from verified
    units; the summary of the KV fill."""
    start, found = time.perf_counter(), []
    for part in _all(stages):
        lookup = part.cache.lookup(part.keys, timeout=s.timeout_s)
        found += [lookup.total] if part.kind == "kv" else []
        part.cache.fetch(part.keys, lookup)
    # A unit that reads as missing or corrupt was never found (a miss, whatever the lookup said).
    missed = {e.block_hash for e in _drain(s, stages) if e.status in ("miss", "corrupt")}
    found = next((i for i, key in enumerate(s.hashes[: min(found)]) if key in missed), min(found))
    for part in _all(stages):
        part.ready = part.manager.lookup(part.keys)
    seconds, kv = time.perf_counter() - start, _all(stages, "kv")
    counters = [t for part in kv for t in part.cache.metrics().tiers]  # pages filled, verified:
    by_tier = {n: sum(t.fills_ok for t in counters if t.name == n) for n, *_ in tiers["kv"]}
    sums = _tier_sums(kv, loaded="fills_ok", missed="fills_missed", failed="fills_failed")
    sums.update(_tier_sums(kv, refused="fills_refused", bytes="bytes_filled"))
    # unit_reads: units read and verified (a stage of another split reads each it overlaps).
    return dict(
        pages_found=found,
        pages_filled=min(part.ready for part in kv),
        pages_loaded_by_stages=sums["loaded"],
        pages_by_tier=by_tier,
        unit_reads=sum(getattr(tier.metrics(), "units_loaded", 0) for _, _, tier in tiers["kv"]),
        units_missed=sums["missed"],
        units_failed=sums["failed"],
        units_refused=sums["refused"],
        bytes=sums["bytes"],
        seconds=seconds,
        gbps=sums["bytes"] / seconds / 1e9 if seconds > 0 and sums["bytes"] else None,
    )


def read_engine(s: Session, tiers: dict) -> dict:
    """A new engine, empty regions: fill them from the tiers (promote what came from the
    farther one into the nearer one), then the readers load and verify."""
    cfg, readers, promoted = s.cfg, None, None
    with engine(s, "reader", tiers) as stages:
        filled, state = _fill(s, stages, tiers), _all(stages, "state")
        loaded = filled["pages_filled"]
        units = dict(units_expected_filled=len(state), units_filled=sum(p.ready for p in state))
        also = f"; the request's state: {units['units_filled']}/{len(state)} unit(s)"
        also = also if state else ""
        rate = f" at {filled['gbps']:.2f} GB/s" if filled["gbps"] else ""
        corrupt = sum(t.metrics().corrupt_detected for opened in tiers.values() for *_, t in opened)
        s.progress(
            f"fill: {filled['pages_found']}/{cfg.prompt_blocks} pages found in the store, "
            f"{loaded} filled from {filled['unit_reads']} verified unit reads "
            f"({filled['bytes'] / 2**20:.1f} MiB{rate}; {filled['units_missed']} missed, "
            f"{filled['units_failed']} failed; corrupt units detected: {corrupt}){also} "
            f"({filled['seconds']:.1f} s)"
        )
        if s.stores.promote:
            promoted = dict(to=tiers["kv"][0][0], **_write_through(s, stages, "promote")[0])
            del promoted["gbps"]
            (near, where, _), far = tiers["kv"][0], tiers["kv"][-1][0]
            s.progress(
                f"promote: {promoted['units_ok']}/{promoted['units_submitted']} units from {far} "
                f"written to {near} {where} ({promoted['units_failed']} failed, "
                f"{promoted['units_refused']} refused)"
            )
        if loaded:  # the KV prefix every stage holds; a state row only once verified
            held = {}
            for p in _all(stages):
                keys = p.keys[: loaded if p.kind == "kv" else p.ready]
                held[id(p)] = (p, p.manager.acquire(keys))

            def sources(index: int, kv: tuple[int, int]) -> list[Source]:
                return [p.source(held[id(p)][1]) for p in stages[index] if held[id(p)][1]]

            readers = run_readers(s, held, sources)
    return dict(readers=readers, fill=filled, promote=promoted, state=units)


def run_persistent(s: Session) -> dict:
    """--store: the write engine, the read engine, or one then the other (sharing the store)."""
    phase = s.stores.phase
    out: dict[str, Any] = dict(writers=None, readers=None, persist=None, fill=None, state={})
    tiers, s.first_tiers = s.first_tiers, {}  # handed to the first engine, which closes them
    if phase in ("write", "both"):
        out.update(write_engine(s, tiers))
        # The read engine shares nothing with the write engine but the store: its own
        # tier objects (indexes rebuilt from disk), its own empty regions.
        tiers = open_engine_tiers(s, "reader") if phase == "both" else {}
    if phase in ("read", "both"):
        state = out["state"]
        out.update(read_engine(s, tiers))
        out["state"] = {**state, **out["state"]}
    return out
