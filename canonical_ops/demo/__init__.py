"""`python -m canonical_ops demo`: KV stored by one topology, read bit-exact by another.

Writer processes (TP x PP ranks; a pipeline stage owns a contiguous layer range, vLLM's
split) fill their shard of a prompt's KV from the unsharded truth and store it into their
stage's /dev/shm region in the canonical layout; a page is ready once every elected writer
reported it. Reader processes of another topology load the pages into their own caches and
compare every byte with the truth. A hybrid preset (attention + Mamba / GDN state) also
stores and reads the request's state, one unit per stage. Default: Llama-3-8B-like, 2048
tokens, TP=4 writers, TP=2 readers.

Without --store the readers attach the writers' regions (shared memory). With --store the
engines share nothing but the store: a directory (created, private to you, when missing), a
Redis / Valkey server (redis://HOST:PORT/DB, rediss://, unix://, redis+cluster://) or both
(two --store; lookup order region -> files -> Redis). --phase write: the writer engine
persists every stage's rows (a unit per block and stage) and exits; --phase read: a new
engine of the reader topology fills its empty regions from units it verified (what came from
Redis is also written to the directory unless --no-promote), loads and checks them; --phase
both (default): one, then the other. The truth and the block hashes follow from the preset
and --seed only, so a read process checks what another process wrote. A missing, corrupt or
foreign unit is a miss (FAIL with pages_missed), never a wrong byte.

Exit status: 0 PASS, 1 FAIL (every failure said), 2 a usage error (one line on stderr,
checked before any work). CUDA when a GPU is present, else CPU (hybrid presets: CPU).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from dataclasses import replace
from multiprocessing import forkserver

from layouts.cli import escape_text

# presets, cli, config: pure (answered in a blink); truth, ranks, engine, report: torch.
from .cli import PROG, build_parser
from .config import UsageError, build_config, check_resources, plan_stores, resolve_device

__all__ = ["build_config", "build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    """Flags and checks (usage errors: one line, exit 2), the header, the engines, the
    verdict; exit 0 PASS, 1 FAIL."""
    parser = build_parser(__doc__)
    args = parser.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    try:
        stores = plan_stores(args)
        cfg = build_config(args, args.device)
        # The ranks' process server, with torch and the ops preloaded (each rank starts in
        # milliseconds, spawn semantics): started now, its imports overlap the checks below.
        pool = multiprocessing.get_context("forkserver")
        pool.set_forkserver_preload(["torch", "numpy", "canonical_ops.demo.ranks"])
        forkserver.ensure_running()
        cfg = replace(cfg, device=resolve_device("cpu" if cfg.kinds else args.device))
        from .engine import Session, open_engine_tiers, run_persistent, run_shared_memory
        from .ranks import Progress  # torch and the ops: loadable now
        from .report import print_header, print_result, summarize
        from .truth import block_hashes

        check_resources(cfg, persistent=stores.enabled)  # before any O(pages) work
        session = Session(cfg, Progress(out), out, args.timeout, pool, stores)
        if stores.enabled:  # the first engine's tiers: an unusable store is a usage error, now
            role = "reader" if stores.phase == "read" else "writer"
            session.first_tiers = open_engine_tiers(session, role)
    except UsageError as error:
        parser.fail(str(error))
    print_header(session, out)
    session.hashes = block_hashes(cfg)
    try:
        run = run_persistent if stores.enabled else run_shared_memory
        summary = summarize(session, result := run(session))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except UsageError as error:  # the read engine's store became unusable after start-up
        parser.fail(str(error))
    finally:
        for opened in session.first_tiers.values():  # not handed to an engine (early failure)
            for _, _, tier in opened:
                tier.close()
    for group in (result.get("writers"), result.get("readers")):
        for index, error in sorted(group.errors.items()) if group else ():
            if "\n" in error.strip():  # tracebacks in full (the FAIL lines quote the last line),
                # every line escaped and indented: a message in it cannot forge a report line
                lines = "\n  ".join(map(escape_text, error.rstrip().splitlines()))
                print(f"{group.role} rank {index}: {lines}", file=sys.stderr, flush=True)
    print_result(summary, out, sys.stderr)
    if args.json:
        print(json.dumps(summary, indent=2), flush=True)
    return 0 if summary["verdict"] == "PASS" else 1
