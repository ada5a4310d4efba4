"""What the run prints: the header, the JSON summary (stable names) and the human lines."""

from __future__ import annotations

from typing import TextIO

from layouts import canonical_format_id
from layouts.explain import picture

from .engine import Session
from .geometry import region_bytes
from .ranks import GroupRun
from .stores import redact
from .verdict import Verification


def transfer_stats(run: GroupRun | None) -> dict | None:
    """Bytes, seconds and aggregate GB/s (all ranks concurrently) and the plain-copy ratio."""
    if run is None or not run.ok:
        return None
    reports = list(run.reports.values())
    total = sum(r["bytes"] for r in reports)
    seconds = max(r["seconds"] for r in reports)
    rates = [r["bytes"] / r["seconds"] for r in reports if r["seconds"] > 0]
    copies = [r["bytes"] / r["copy_seconds"] for r in reports if r["copy_seconds"] > 0]
    return dict(
        ranks=len(reports),
        bytes=total,
        seconds=seconds,
        gbps=total / seconds / 1e9 if seconds > 0 else None,
        vs_plain_copy=(sum(rates) / sum(copies)) if rates and copies else None,
    )


def summarize(s: Session, result: dict) -> dict:
    """The run as one JSON-able object (the names are stable: scripts read them)."""
    cfg = s.cfg
    writers, readers = result.get("writers"), result.get("readers")
    verification: Verification = result["verification"]
    phases = {
        "spawn_writers": writers.phase_seconds.get("started") if writers else None,
        "store": writers.phase_seconds.get("stored") if writers else None,
        "persist": result["persist"]["seconds"] if result.get("persist") else None,
        "fill": result["fill"]["seconds"] if result.get("fill") else None,
        "spawn_readers": readers.phase_seconds.get("started") if readers else None,
        "load": readers.phase_seconds.get("loaded") if readers else None,
        "verify": readers.phase_seconds.get("verified") if readers else None,
        "total": s.progress.elapsed(),
    }
    if not s.stores.enabled:
        for key in ("persist", "fill"):
            del phases[key]
    tiers = s.tier_reports
    phase = s.stores.phase if s.stores.enabled else "both"
    roles = {"write": ("writer",), "read": ("reader",)}.get(phase, ("writer", "reader"))
    summary = dict(
        verdict="FAIL" if verification.failures else "PASS",
        failures=verification.failures,
        phase=s.stores.phase if s.stores.enabled else "shared-memory",
        pages_total=cfg.prompt_blocks,
        pages_ready=result.get("ready"),
        pages_loaded=verification.pages_loaded,
        pages_missed=verification.pages_missed,
        corrupt_detected=sum(t["corrupt_detected"] for t in tiers),
        bytes_wrong=verification.bytes_wrong,
        bytes_checked=verification.bytes_checked,
        model=dict(
            preset=cfg.preset,
            name=cfg.identity().name,
            revision=cfg.model_revision,
            attention=cfg.attention,
            layers=cfg.layers,
            kv_heads=cfg.total_kv_heads,
            head_size=cfg.head_size,
            dtype=cfg.dtype,
            block_size=cfg.block_size,
            packing=cfg.packing,
            order=cfg.order,
        ),
        topology=dict(
            **{
                f"{role}_{key}": (value if role in roles else None)
                for role in ("writer", "reader")
                for key, value in (
                    ("tp", cfg.tp(role)),
                    ("pp", cfg.pp(role)),
                    ("stages", [list(r) for r in cfg.stages(role)]),
                )
            },
            device=cfg.device,
            format_id=canonical_format_id(cfg.order),
            parallelism_agnostic=s.geometry.parallelism_agnostic,
        ),
        prompt_tokens=cfg.prompt_tokens,
        region_bytes=region_bytes(cfg, s.geometry),
        seed=cfg.seed,
        store=transfer_stats(writers),
        load=transfer_stats(readers),
        timings_s=phases,
    )
    if s.stores.enabled:
        summary.update(
            namespace=cfg.namespace("reader" if s.stores.phase == "read" else "writer").hex,
            stores=[redact(x) for x in s.stores.locations],
            persist=result.get("persist"),
            fill=result.get("fill"),
            promote=result.get("promote"),
            stores_failed=sum(t["stores_failed"] for t in tiers),
            tiers=tiers,
        )
    return summary


def report(summary: dict, out: TextIO, err: TextIO) -> None:
    """Human lines of the result on ``out``, each failure on ``err``, then PASS or FAIL."""
    for kind, stats in (("store", summary["store"]), ("load", summary["load"])):
        if stats and stats["gbps"] is not None:
            ratio = stats["vs_plain_copy"]
            versus = f" ({ratio:.2f}x a plain copy of the same bytes)" if ratio else ""
            print(
                f"{kind + ':':<6} {stats['bytes'] / 2**20:.1f} MiB by {stats['ranks']} ranks at "
                f"{stats['gbps']:.2f} GB/s{versus}",
                file=out,
            )
    persist, fill = summary.get("persist"), summary.get("fill")
    if persist:
        rate = f" at {persist['gbps']:.2f} GB/s" if persist["gbps"] else ""
        complete = ", ".join(
            f"{name} {n}/{summary['pages_total']}"
            for name, n in persist["pages_complete_in_store"].items()
        )
        print(
            f"persisted: {persist['units_ok']}/{persist['units_expected']} units "
            f"({persist['bytes'] / 2**20:.1f} MiB written{rate}); pages complete in the store "
            f"(every layer): {complete}; still served from the region: "
            f"{persist['pages_ready_after_persist']}/{summary['pages_total']}",
            file=out,
        )
    if fill:
        rate = f" at {fill['gbps']:.2f} GB/s" if fill["gbps"] else ""
        print(
            f"filled: {fill['pages_filled']}/{summary['pages_total']} pages from "
            f"{fill['unit_reads']} verified unit reads ({fill['bytes'] / 2**20:.1f} MiB{rate}); "
            f"corrupt units detected: {summary['corrupt_detected']}",
            file=out,
        )
    m = summary["model"]
    if summary["verdict"] == "PASS":
        if summary["pages_loaded"] is None:
            print(
                f"complete: every layer of all {summary['pages_total']} prompt pages is in the "
                "store, readable by any TP x PP",
                file=out,
            )
        else:
            heads = "the latent" if m["attention"] == "mla" else f"all {m['kv_heads']} KV heads"
            print(
                f"verified: {summary['pages_loaded']}/{summary['pages_total']} pages loaded by "
                f"every reader; {heads} x {summary['prompt_tokens']} tokens x {m['layers']} "
                "layers bit-exact against the unsharded truth",
                file=out,
            )
        print("PASS", file=out, flush=True)
        return
    for failure in summary["failures"]:
        print(f"FAIL: {failure}", file=err, flush=True)
    loaded = summary["pages_loaded"]
    pages = f"pages loaded {loaded}/{summary['pages_total']}, " if loaded is not None else ""
    print(
        f"FAIL: {len(summary['failures'])} problem(s): {pages}{summary['bytes_wrong']} bytes wrong",
        file=out,
        flush=True,
    )


def print_header(s: Session, out: TextIO) -> None:
    cfg, geometry = s.cfg, s.geometry
    print(
        f"model: {cfg.preset} ({cfg.attention} attention, {cfg.layers} layers, "
        f"{cfg.total_kv_heads} KV heads x {cfg.head_size}, {cfg.dtype}, block {cfg.block_size}, "
        f"{cfg.packing} {cfg.order}); device: {cfg.device}",
        file=out,
    )

    def shape(role: str) -> str:
        stages = cfg.stages(role)
        split = f" x PP={len(stages)} {stages}" if len(stages) > 1 else ""
        return f"TP={cfg.tp(role)}{split}"

    phase = s.stores.phase if s.stores.enabled else "both"
    if phase == "write":
        topology = f"topology: writers {shape('writer')} (any topology may read the store)"
    elif phase == "read":
        topology = f"topology: readers {shape('reader')} (whatever topology wrote the store)"
    else:
        topology = f"topologies: writers {shape('writer')} -> readers {shape('reader')}"
    print(
        f"{topology}; format id: {canonical_format_id(cfg.order)}; parallelism agnostic: "
        f"{geometry.parallelism_agnostic}",
        file=out,
    )
    print(
        f"prompt: {cfg.prompt_tokens} tokens = {cfg.prompt_blocks} pages; canonical page "
        f"{geometry.canonical_page_bytes} B per layer, regions "
        f"{cfg.prompt_blocks * geometry.row_bytes / 2**20:.1f} MiB",
        file=out,
    )
    if s.stores.enabled:
        role = "reader" if s.stores.phase == "read" else "writer"
        where = ", ".join(redact(x) for x in s.stores.locations)
        print(
            f"store: {where}; phase {s.stores.phase}; namespace "
            f"{cfg.namespace(role).hex[:16]}... ({cfg.identity().name}"
            f"{'@' + cfg.model_revision if cfg.model_revision else ''})",
            file=out,
        )
    if s.stores.phase != "read":
        print("writers of layer 0, page 0:", file=out)
        print(picture(geometry.writer_groups[0], page_id=0, width=64), file=out, flush=True)
