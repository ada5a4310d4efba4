"""The verdict (what the groups and store phases reported against what PASS requires) and
what the run prints: the header, the JSON summary (stable names) and the human lines (each
through ``escape_text``: a model name, store path or error cannot forge a line)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from layouts import canonical_format_id
from layouts.cli import escape_text
from layouts.explain import picture

from .config import DemoConfig, redact, region_bytes, state_bytes
from .engine import Session
from .presets import PRESETS
from .ranks import GroupRun

# The model in the JSON, after its preset, name and revision (total_kv_heads as kv_heads).
MODEL = ("attention", "layers", "total_kv_heads", "head_size", "dtype", "block_size", "packing")
MODEL += ("order",)


@dataclass
class Verification:
    failures: list[str]
    pages_loaded: int | None
    pages_missed: int | None
    bytes_wrong: int
    bytes_checked: int


def _failed(run: GroupRun | None) -> list[str]:
    """Each failed rank with the last line of why (a traceback's exception)."""
    out = []
    for index, error in sorted(run.errors.items()) if run else ():
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        out.append(f"{run.role} rank {index} failed: {lines[-1] if lines else 'unknown error'}")
    return out


def _not_ready(cfg: DemoConfig, ready: int) -> list[str]:
    total, words = cfg.prompt_blocks, "a writer did not store its share"
    return [f"only {ready}/{total} prompt pages became ready ({words})"] if ready < total else []


def verify(cfg: DemoConfig, writers, ready: int, readers, *, from_store=False) -> Verification:
    """The verdict against the unsharded truth: every prompt page loaded, every KV layer,
    block, token and head (and a hybrid model's state) checked by some reader, no byte
    different. ``ready``: the leading pages given to the readers (``from_store``: verified)."""
    total = cfg.prompt_blocks
    failures = _failed(writers) + ([] if from_store else _not_ready(cfg, ready))
    if from_store and ready < total:
        failures.append(
            f"only {ready}/{total} prompt pages were found in the store and verified; the "
            f"other {total - ready} are missing (never stored, evicted, corrupt or of another "
            "namespace: each a miss, none loaded)"
        )
    failures += _failed(readers)
    if readers is None:
        failures.append("no reader ran (no page was " + ("found)" if from_store else "ready)"))
        return Verification(failures, 0, total, 0, 0)
    with_kv = [r for r in readers.reports.values() if r["layers"]]
    loaded = min((r["pages"] for r in with_kv), default=0) if readers.ok else 0
    if loaded < ready and readers.ok:
        failures.append(f"the readers loaded {loaded} of the {ready} ready pages")
    wrong_total = checked = 0
    stages = [kv for kv, _ in cfg.stage_parts("reader") if kv[1] > kv[0]]
    covered: dict[tuple[int, int], set[int]] = {stage: set() for stage in stages}
    for index, r in sorted(readers.reports.items()):
        layers, slots = (r["first_layer"], r["end_layer"]), r["local_head_slots"]
        wrong = {int(k): v for k, v in r["bytes_wrong_by_layer"].items()}
        checked += r["bytes_checked"] + r["state_bytes_checked"]
        wrong_total += sum(wrong.values()) + r["state_bytes_wrong"]
        kv = layers in covered or layers[0] != layers[1]  # not a stage of state layers only
        fits = r["layers"] == layers[1] - layers[0] and r["blocks"] == r["pages"]
        fits = fits and layers in covered
        if fits:
            covered[layers].update(r["heads"])
        for bad, text in (
            (
                kv and not fits,
                f" checked layers [{layers[0]}, {layers[1]}) ({r['layers']} layers) "
                f"of {r['blocks']}/{r['pages']} loaded blocks; expected one of the stages {stages}",
            ),
            (
                kv and slots != [len(r["heads"])],
                f" holds {slots} head slots but {len(r['heads'])} heads were checked",
            ),
            (
                wrong,
                f": layers {sorted(wrong)} differ from the unsharded truth ({sum(wrong.values())} bytes)",
            ),
            (
                r["state_bytes_wrong"],
                f": the request's state differs from the unsharded truth "
                f"({r['state_bytes_wrong']} bytes)",
            ),
        ):
            failures += [f"reader rank {index}{text}"] if bad else []
    heads = set(range(1 if cfg.attention == "mla" else cfg.total_kv_heads))
    for (first, end), held in covered.items() if readers.reports else ():
        if heads - held:
            where = f" for layers [{first}, {end})" if len(stages) > 1 else ""
            failures.append(
                f"KV heads {sorted(heads - held)} were held by no reader rank{where}: never verified"
            )
    return Verification(failures, loaded, total - loaded, wrong_total, checked)


def _state(s: Session, result: dict) -> dict:
    """A hybrid model's request state: its geometry, what the phases did and were to do."""
    cfg, specs, readers = s.cfg, s.cfg.state_specs(), result.get("readers")
    reports = readers.reports.values() if readers else ()
    namespace = cfg.namespace("reader" if s.stores.phase == "read" else "writer").state_units()
    return dict(
        layers=len(specs),
        kinds=sorted({spec.kind for spec in specs}),
        unit_bytes=state_bytes(cfg, 0, len(specs)),
        namespace=namespace.hex,
        **result["state"],
        bytes_checked=sum(r["state_bytes_checked"] for r in reports),
        bytes_wrong=sum(r["state_bytes_wrong"] for r in reports),
    )


def verdict(s: Session, result: dict, state: dict | None) -> Verification:
    """PASS requires: (writers) every page ready and, with --store, every unit persisted;
    (readers) every page and the request's state loaded and bit-exact."""
    cfg, phase, persist = s.cfg, s.stores.phase, result.get("persist")
    if not s.stores.enabled:
        return verify(cfg, result["writers"], result["ready"], result["readers"])
    failures: list[str] = []
    if phase != "read":
        failures += _failed(result["writers"]) + _not_ready(cfg, result.get("ready", 0))
        if persist is not None and persist["units_ok"] < persist["units_expected"]:
            why = "".join(f": {e}" for e in ["; ".join(persist["errors"][:2])] if e)
            failures.append(
                f"{persist['units_expected'] - persist['units_ok']} of "
                f"{persist['units_expected']} units were not persisted ({persist['units_failed']} "
                f"failed, {persist['units_refused']} refused{why})"
            )
    for done, words in (("persisted", "persisted"), ("filled", "found in the store and verified")):
        got, want = (state or {}).get(f"units_{done}"), (state or {}).get(f"units_expected_{done}")
        if got is not None and got < want:
            failures.append(
                f"only {got}/{want} state units of the request were {words} (a missing, corrupt "
                "or foreign unit is a miss)"
            )
    if phase == "write":
        return Verification(failures, None, None, 0, 0)
    read = verify(cfg, None, result["fill"]["pages_filled"], result["readers"], from_store=True)
    read.failures = failures + read.failures
    return read


def transfer_stats(run: GroupRun | None) -> dict | None:
    """Bytes, seconds (the slowest rank) and GB/s of the timed transfer of all ranks at
    once (one pass each: a demo figure, not a benchmark)."""
    if run is None or not run.ok:
        return None
    total = sum(r["bytes"] for r in run.reports.values())
    seconds = max(r["seconds"] for r in run.reports.values())
    gbps = total / seconds / 1e9 if seconds > 0 else None
    return dict(ranks=len(run.reports), bytes=total, seconds=seconds, gbps=gbps)


def summarize(s: Session, result: dict) -> dict:
    """The run as one JSON-able object (the names are stable: scripts read them)."""
    cfg, tiers, stored = s.cfg, s.tier_reports, s.stores.enabled
    writers, readers = result.get("writers"), result.get("readers")
    state = _state(s, result) if cfg.kinds else None
    v = verdict(s, result, state)

    w, r = (run.phase_seconds if run else {} for run in (writers, readers))  # milestone -> s
    timings = dict(spawn_writers=w.get("started"), store=w.get("stored"))
    for key in ("persist", "fill") if stored else ():
        timings[key] = result[key]["seconds"] if result.get(key) else None
    timings.update(spawn_readers=r.get("started"), load=r.get("loaded"), verify=r.get("verified"))
    timings["total"] = s.progress.elapsed()
    phase = s.stores.phase if stored else "both"
    roles = {"write": ("writer",), "read": ("reader",)}.get(phase, ("writer", "reader"))
    topology = {}
    for role in ("writer", "reader"):
        shape = (cfg.tp(role), cfg.pp(role), [list(stage) for stage in cfg.stages(role)])
        shape = shape if role in roles else (None, None, None)
        topology.update(zip((f"{role}_tp", f"{role}_pp", f"{role}_stages"), shape))
    topology.update(device=cfg.device, format_id=canonical_format_id(cfg.order))
    topology["parallelism_agnostic"] = cfg.parallelism_agnostic
    model = dict(preset=cfg.preset, name=cfg.identity().name, revision=cfg.model_revision)
    model.update({key.replace("total_", ""): getattr(cfg, key) for key in MODEL})
    summary = dict(
        verdict="FAIL" if v.failures else "PASS",
        failures=v.failures,
        phase=phase if stored else "shared-memory",
        pages_total=cfg.prompt_blocks,
        pages_ready=result.get("ready"),
        pages_loaded=v.pages_loaded,
        pages_missed=v.pages_missed,
        corrupt_detected=sum(t["corrupt_detected"] for t in tiers),
        bytes_wrong=v.bytes_wrong,
        bytes_checked=v.bytes_checked,
        model=model,
        topology=topology,
        prompt_tokens=cfg.prompt_tokens,
        region_bytes=region_bytes(cfg),
        seed=cfg.seed,
        store=transfer_stats(writers),
        load=transfer_stats(readers),
        timings_s=timings,
    )
    if stored:
        summary["namespace"] = cfg.namespace("reader" if phase == "read" else "writer").hex
        summary["stores"] = [redact(location) for location in s.stores.locations]
        summary.update({key: result.get(key) for key in ("persist", "fill", "promote")})
        summary.update(stores_failed=sum(t["stores_failed"] for t in tiers), tiers=tiers)
    return dict(summary, state=state) if state else summary  # hybrid: its state beside


def print_result(summary: dict, out: TextIO, err: TextIO) -> None:
    """Human lines of the result on ``out``, each failure on ``err``, then PASS or FAIL."""
    total, state, lines = summary["pages_total"], summary.get("state"), []
    for kind in ("store", "load"):
        if (x := summary[kind]) and x["gbps"] is not None:
            lines.append(
                f"{kind + ':':<6} {x['bytes'] / 2**20:.1f} MiB by {x['ranks']} ranks at once: "
                f"{x['gbps']:.2f} GB/s together (one timed pass; not a benchmark: `make bench` "
                "measures the ops)"
            )
    m, loaded = summary["model"], summary["pages_loaded"]
    if summary["verdict"] == "PASS" and loaded is None:
        also = " (and the request's state)" if state else ""
        pages = f"every layer of all {total} prompt pages{also}"
        lines.append(f"complete: {pages} is in the store, readable by any TP x PP")
    elif summary["verdict"] == "PASS":
        heads = "the latent" if m["attention"] == "mla" else f"all {m['kv_heads']} KV heads"
        layers = f"{m['layers'] - state['layers']} attention" if state else m["layers"]
        also = f" and the request's state ({state['bytes_checked']} bytes)" if state else ""
        lines.append(
            f"verified: {loaded}/{total} pages loaded by every reader; {heads} x "
            f"{summary['prompt_tokens']} tokens x {layers} layers{also} bit-exact against the "
            "unsharded truth"
        )
    else:
        failures = (f"FAIL: {escape_text(line)}" for line in summary["failures"])
        print("\n".join(failures), file=err, flush=True)
        pages = f"pages loaded {loaded}/{total}, " if loaded is not None else ""
        count, wrong = len(summary["failures"]), summary["bytes_wrong"]
        lines.append(f"FAIL: {count} problem(s): {pages}{wrong} bytes wrong")
    lines += ["PASS"] if summary["verdict"] == "PASS" else []
    print("\n".join(lines), file=out, flush=True)


def print_header(s: Session, out: TextIO) -> None:
    """The model, both topologies, the prompt and regions, the store, who writes page 0."""
    cfg, phase = s.cfg, s.stores.phase if s.stores.enabled else "both"
    model = (
        PRESETS[cfg.preset].describe()
        if cfg.kinds
        else (
            f"{cfg.attention} attention, {cfg.layers} layers, {cfg.total_kv_heads} KV heads x "
            f"{cfg.head_size}, {cfg.dtype}, block {cfg.block_size}, {cfg.packing} {cfg.order}"
        )
    )

    def shape(role: str) -> str:
        stages = cfg.stages(role)
        return f"TP={cfg.tp(role)}" + (f" x PP={len(stages)} {stages}" if len(stages) > 1 else "")

    topology = {
        "write": f"topology: writers {shape('writer')} (any topology may read the store)",
        "read": f"topology: readers {shape('reader')} (whatever topology wrote the store)",
    }.get(phase, f"topologies: writers {shape('writer')} -> readers {shape('reader')}")
    lines = [
        f"model: {cfg.preset} ({model}); device: {cfg.device}",
        f"{topology}; format id: {canonical_format_id(cfg.order)}; parallelism agnostic: "
        f"{cfg.parallelism_agnostic}",
        f"prompt: {cfg.prompt_tokens} tokens = {cfg.prompt_blocks} pages; canonical page "
        f"{cfg.page_bytes} B per layer, regions {region_bytes(cfg) / 2**20:.1f} MiB",
    ]
    if s.stores.enabled:
        where = ", ".join(redact(x) for x in s.stores.locations)
        namespace = cfg.namespace("reader" if phase == "read" else "writer").hex[:16]
        revision = f"@{cfg.model_revision}" if cfg.model_revision else ""
        model = f"{cfg.identity().name}{revision}"
        lines.append(f"store: {where}; phase {phase}; namespace {namespace}... ({model})")
    lines = [escape_text(line) for line in lines]  # the model's name, the stores' paths
    if phase != "read":
        lines += ["writers of layer 0, page 0:", picture(cfg.mappings("writer"), 0, width=64)]
    print("\n".join(lines), file=out, flush=True)
