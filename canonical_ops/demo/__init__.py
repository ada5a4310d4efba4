"""`python -m canonical_ops demo`: KV stored by one topology, read bit-exact by another.

A Llama-3-8B-like model (32 layers, 8 KV heads, head 128, bf16, block 16, packed
NHD) by default. Writer processes (TP x PP ranks; pipeline stage s owns a
contiguous layer range, vLLM's split) each hold their KV-head shard of their
stage's layers of a prompt's KV (filled deterministically from the unsharded
truth) and store it into their stage's shared /dev/shm region in the canonical
layout; each stage's scheduler-side PageManager marks a page ready once every
elected writer reported it. Reader processes of another topology then load the
pages into their own (differently sharded and split) caches and compare every
byte of every head, token and layer with the unsharded truth.

Without --store (shared memory), the readers attach the writers' regions (a
reader stage spanning two writer stages reads both) while the writer engine
holds them. With --store (persistent), the engines share nothing but the store:
a directory (files), a Redis / Valkey server (``redis://HOST:PORT/DB``,
``rediss://``, ``unix://``, ``redis+cluster://``) or both, given as two
--store (lookup order region -> files -> Redis):

``--phase write``
    The writer engine stores the prompt, persists every stage's region rows
    (one unit per block and stage) into every store, and exits: its regions
    are gone.
``--phase read``
    A new engine with the reader topology and empty regions looks the prompt's
    blocks up (region, then files, then Redis), fills its regions from units it
    verified, loads them into its caches and checks them against the truth.
    With two stores, what came from Redis is also written to the directory
    (``promote`` in the JSON; --no-promote turns it off).
``--phase both`` (default)
    The write engine, closed, then a separate read engine, in this process.

The truth and the block hashes (a sha256 chain over deterministic token ids)
follow from the preset and --seed only, so a separate read process checks what
a write process stored. PASS only when every prompt page was persisted (write)
and every prompt page was loaded and is bit-exact (read); every FAIL says what
failed. A missing, corrupt or foreign unit is a miss (FAIL with pages_missed),
never a wrong byte.

Runs on CUDA when a GPU is present (pinned regions, side streams), on CPU otherwise.
Exit status: 0 PASS, 1 FAIL, 2 a usage error (one line on stderr, checked before
any work: flags, the model's possible topologies, the device, the store root,
/dev/shm and memory).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import TextIO

# The docstring above is also --help's description. The parts, one job each:
#   presets     model shapes (--preset)          config      DemoConfig from the flags
#   cli         the flags and their limits       stores      --store: plan, open the tiers
#   geometry    mappings, row and region bytes   resources   device, /dev/shm and memory
#   truth       the prompt and its KV, checks    ranks       rank processes, their groups
#   engine      stages, shared-memory run        persistent  --store write / read engines
#   verdict     PASS or FAIL and why             reporting   header, JSON summary, lines
# Every name the single demo module had is re-exported here (scripts and tests import them).
from .cli import (
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_PP,
    MAX_PROMPT_TOKENS,
    MAX_SEED,
    MAX_TIMEOUT_S,
    MAX_TP,
    PROG,
    build_parser,
)
from .config import DemoConfig, UsageError, build_config
from .engine import (
    Session,
    Stage,
    close_stages,
    close_tiers,
    open_stages,
    readers_per_writer_stage,
    run_readers,
    run_shared_memory,
    run_writers,
)
from .geometry import Geometry, plan_geometry, region_bytes
from .hybrid_presets import HYBRID_PRESETS, HybridPreset
from .persistent import (
    fill_stages,
    persist_stages,
    promote_stages,
    read_engine,
    run_persistent,
    store_totals,
    write_engine,
)
from .presets import DTYPES, PRESETS, Preset
from .ranks import (
    PLAIN_COPY_CAP_BYTES,
    GroupRun,
    Progress,
    RankTask,
    Source,
    plain_copy_seconds,
    rank_main,
    rank_pool,
    reader_rank,
    run_group,
    writer_rank,
)
from .reporting import print_header, report, summarize, transfer_stats
from .resources import (
    PROCESS_OVERHEAD_BYTES,
    SHM_DIR,
    check_resources,
    rank_tensor_bytes,
    resolve_device,
)
from .stores import (
    REDIS_SCHEMES,
    StorePlan,
    open_tiers,
    plan_stores,
    queue_depth,
    redact,
    tier_kind,
)
from .truth import (
    VOCAB,
    allocate_kv,
    block_hashes,
    block_table,
    compare_with_truth,
    from_cache_blocks,
    prompt_token_ids,
    shard_of,
    to_cache_blocks,
    truth_layer,
)
from .verdict import Verification, verify, verify_persistent

__all__ = [
    "DTYPES",
    "HYBRID_PRESETS",
    "MAX_KV_HEADS",
    "MAX_LAYERS",
    "MAX_PP",
    "MAX_PROMPT_TOKENS",
    "MAX_SEED",
    "MAX_TIMEOUT_S",
    "MAX_TP",
    "PLAIN_COPY_CAP_BYTES",
    "PRESETS",
    "PROCESS_OVERHEAD_BYTES",
    "PROG",
    "REDIS_SCHEMES",
    "SHM_DIR",
    "VOCAB",
    "DemoConfig",
    "Geometry",
    "GroupRun",
    "HybridPreset",
    "Preset",
    "Progress",
    "RankTask",
    "Session",
    "Source",
    "Stage",
    "StorePlan",
    "UsageError",
    "Verification",
    "allocate_kv",
    "block_hashes",
    "block_table",
    "build_config",
    "build_parser",
    "check_resources",
    "close_stages",
    "close_tiers",
    "compare_with_truth",
    "fill_stages",
    "from_cache_blocks",
    "main",
    "open_stages",
    "open_tiers",
    "persist_stages",
    "plain_copy_seconds",
    "plan_geometry",
    "plan_stores",
    "print_header",
    "promote_stages",
    "prompt_token_ids",
    "queue_depth",
    "rank_main",
    "rank_pool",
    "rank_tensor_bytes",
    "read_engine",
    "reader_rank",
    "readers_per_writer_stage",
    "redact",
    "region_bytes",
    "report",
    "resolve_device",
    "run_demo",
    "run_group",
    "run_persistent",
    "run_readers",
    "run_shared_memory",
    "run_writers",
    "shard_of",
    "store_totals",
    "summarize",
    "tier_kind",
    "to_cache_blocks",
    "transfer_stats",
    "truth_layer",
    "verify",
    "verify_persistent",
    "write_engine",
    "writer_rank",
]


def run_demo(s: Session, err: TextIO) -> dict:
    """Regions, page managers, writers, (tiers), readers, verification: the summary."""
    s.hashes = block_hashes(s.cfg)
    result = run_persistent(s) if s.stores.enabled else run_shared_memory(s)
    for run in (result.get("writers"), result.get("readers")):
        for index, error in sorted(run.errors.items()) if run else ():
            if "\n" in error.strip():  # tracebacks in full (the FAIL lines quote the last line)
                print(f"{run.role} rank {index}: {error.rstrip()}", file=err, flush=True)
    return summarize(s, result)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    if args.preset in HYBRID_PRESETS:  # attention pages and Mamba / GDN state: demo/hybrid.py
        from .hybrid import main_hybrid

        return main_hybrid(args, out, parser)
    tiers: list = []
    try:
        stores = plan_stores(args)
        cfg = build_config(args, args.device)  # pure checks first: answered in a blink
        geometry = plan_geometry(cfg)
        cfg = replace(cfg, device=resolve_device(args.device))  # imports torch
        check_resources(cfg, geometry, persistent=stores.enabled)  # before any O(pages) work
        if stores.enabled:  # the first engine's tiers: a bad root is a usage error, now
            role = "reader" if stores.phase == "read" else "writer"
            tiers = open_tiers(stores, cfg.namespace(role), queue_depth(cfg))
    except UsageError as error:
        parser.fail(str(error))
    pool = rank_pool()  # its server imports torch while the header is printed
    progress = Progress(out)
    session = Session(cfg, geometry, progress, out, args.timeout, pool, stores)
    session.first_tiers = tiers
    print_header(session, out)
    try:
        summary = run_demo(session, sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except UsageError as error:  # the read engine's store became unusable after start-up
        parser.fail(str(error))
    finally:
        for _, _, tier in session.first_tiers:  # not handed to an engine (an early failure)
            tier.close()
    report(summary, out, sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2), flush=True)
    return 0 if summary["verdict"] == "PASS" else 1
