"""vLLM 0.33's ``fs`` secondary tier vs ``canonical_fs``: same chunks, same jobs, same file
system, one run. Runs in the vLLM venv (``make bench-vllm``).

Both tiers are driven through vLLM's ``SecondaryTierManager`` interface as its
``TieringOffloadingManager`` drives them: ``TransferJob(keys, chunk_ids)`` over one primary
region (an mmap: page-aligned rows, as vLLM's region in /dev/shm), ``submit_store`` /
``submit_load``, ``get_finished_jobs`` polled, the same thread counts. vLLM's ``fs`` runs as
vLLM runs it: its C batch path (``vllm.fs_io_C``, shipped in the wheel) with O_DIRECT
(probed at start-up, as vLLM does), and again buffered. ``canonical_fs`` runs with its
defaults (judged) and again with ``direct_io`` (for reference): every load is verified
(xxh3-128 over header and payload) before the row counts.

Timed per (model, mode), modes shuffled each round, best of ``--repeats`` and their median:
  store      every chunk, in jobs of ``--job-chunks``, into a fresh directory (then its files
             are written back, untimed, so no mode is throttled by another's dirty pages);
  load warm  the chunks back into other rows, their files in the page cache (read once,
             untimed, first; vLLM's O_DIRECT loads bypass the cache whatever it holds);
  load cold  the same after fdatasync + posix_fadvise(DONTNEED) of exactly those files
             (untimed; nothing global is dropped; a virtual disk may still be cached by its
             host).
Then, per mode (shuffled), the mixed workload: ``--mixed-loads`` one-chunk loads of warm
chunks, one after the other, each timed from submission to finish, while store jobs stream
(twice the write threads in flight, each replaced when it finishes): p50 and p99.
Every load is compared byte for byte with the stored rows (untimed): a mode that loads wrong
bytes fails the run instead of giving a figure. GB/s = row bytes / seconds; CPU ms/GB = the
process's CPU time over a round (every thread), median, per GB moved. Where the
installed vLLM has its fs tier's opt-in ``checksum_blocks``, a "vllm fs checksum" mode is
added (verified against verified); the goals stay against the better unverified mode.

Goals (issue 30; best-of-N times; canonical_fs vs the better of vLLM's O_DIRECT and
buffered modes per operation): store >= 1.0x, load cold >= 1.0x, load warm >= 0.95x, and a
load's p50 and p99 latency while stores stream no worse than vLLM's (ratio >= 1.0). A warm
load is a copy from the page cache plus, verified, an XXH3 pass over what was copied:
bench/verified_io_candidates.cpp measures what one pass can cost on this CPU.

Usage: python bench/bench_vllm_tiers.py [--quick] [--out DIR] [--dir PATH] [--mib N]
       [--repeats N] [--threads N] [--job-chunks N] [--models a,b] [--modes a,b]
       [--mixed-loads N]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import itertools
import mmap
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _machine import free_page_reporting, reporting_note
from _results import goal_row
from bench_store import write_report
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from canonical_ops.vllm.tiers import CanonicalFileTier

# Row bytes of one chunk (one block per chunk): layers x canonical page.
MODELS = {
    "llama3-8b-like": dict(layers=32, page=8 * 16 * 2 * 128 * 2, tokens=16),  # 2 MiB
    "deepseek-v3-like-mla": dict(layers=61, page=64 * 576 * 2, tokens=64),  # 4.29 MiB
}
# canonical_fs with its defaults (judged), then with direct_io (for reference); --modes may
# add the others (e.g. fewer pool threads on a small machine).
MODES = {
    "vllm fs O_DIRECT": {},
    "vllm fs buffered": {},
    "canonical_fs": {},
    "canonical_fs O_DIRECT": {"direct_io": True},
}
# vLLM's opt-in per-block checksum of its fs tier (its main branch, after 0.33; off by default):
# where the installed vLLM has it, a mode of its own, so verified is compared with verified too.
# The goals stay against the better unverified mode (UNVERIFIED).
UNVERIFIED = ("vllm fs O_DIRECT", "vllm fs buffered")
if "checksum_blocks" in inspect.signature(FileSystemTierManager.__init__).parameters:
    MODES["vllm fs checksum"] = {"checksum_blocks": True}
EXTRA_MODES = {
    "canonical_fs 4+4 threads": {"n_read_threads": 4, "n_write_threads": 4},
    "canonical_fs 1+1 threads": {"n_read_threads": 1, "n_write_threads": 1},
}
OPS = ("store", "load warm", "load cold")
TARGETS = {"store": 1.0, "load cold": 1.0, "load warm": 0.95}  # issue 30
MIXED_TARGET = 1.0  # a load's latency while stores stream: no worse than vLLM fs's


def offloading_spec(name: str, model: dict) -> TieringOffloadingSpec:
    """vLLM's spec of a TP=1 engine of ``model`` with the canonical layout (no region yet)."""
    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(model["layers"]))
    row = model["layers"] * model["page"]
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(model["tokens"], layers, 0),),
        worker_kv_bytes_per_block=row,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": row, "canonical_layout": True},
        engine_id=f"bench-{name}",
        model=OffloadingModelConfig(f"bench/{name}", "bfloat16"),
        cache=OffloadingCacheConfig(model["tokens"], 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        canonical_layout=True,
        kv_cache_layout="LBNHC",
    )
    return TieringOffloadingSpec(config)


def primary_region(rows: int, row_bytes: int) -> tuple[np.ndarray, memoryview]:
    """Page-aligned rows in anonymous mmap memory, prefaulted, and vLLM's (rows, row) view."""
    memory = mmap.mmap(-1, rows * row_bytes)
    array = np.frombuffer(memory, np.uint8).reshape(rows, row_bytes)
    array[:] = 1
    return array, memoryview(memory).cast("b", (rows, row_bytes))


def tier_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]


def write_back(paths: list[str], *, evict: bool = False, read: bool = False) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            if evict:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while read and os.read(fd, 1 << 20):
                pass
        finally:
            os.close(fd)


class Case:
    """One model: its chunks, the primary region, and a timed operation per (mode, op)."""

    def __init__(self, name: str, model: dict, args) -> None:
        self.name, self.args = name, args
        self.spec = offloading_spec(name, model)
        self.row = model["layers"] * model["page"]
        self.count = max(args.job_chunks, (args.mib << 20) // self.row)
        self.rows, self.view = primary_region(2 * self.count, self.row)
        self.rows[: self.count] = np.random.default_rng(0).integers(
            0, 256, (self.count, self.row), dtype=np.uint8
        )
        self.keys = [
            make_offload_key(hashlib.sha256(f"{name}/{i}".encode()).digest(), 0)
            for i in range(self.count)
        ]
        self.base = tempfile.mkdtemp(prefix=f"vllm-tiers-{name}-", dir=args.dir)
        self.tiers: dict[str, tuple[object, str]] = {}
        self._rounds = 0

    def _tier(self, mode: str, root: str):
        threads = dict(n_read_threads=self.args.threads, n_write_threads=self.args.threads)
        if mode.startswith("canonical_fs"):
            options = {**threads, **{**MODES, **EXTRA_MODES}[mode]}
            return CanonicalFileTier(self.spec, self.view, "canonical_fs", root_dir=root, **options)
        options = {**threads, **MODES.get(mode, {})}
        tier = FileSystemTierManager(self.spec, self.view, "fs", root_dir=root, **options)
        if mode == "vllm fs buffered":
            tier._use_o_direct = False
        elif mode == "vllm fs O_DIRECT" and not tier._use_o_direct:
            raise RuntimeError(f"O_DIRECT is refused on {root}: no 'vllm fs O_DIRECT' figure")
        return tier

    def _jobs(self, first_chunk: int, promotion: bool) -> list[TransferJob]:
        n = self.args.job_chunks
        return [
            TransferJob(
                job_id=i,
                keys=self.keys[start : start + n],
                chunk_ids=np.arange(first_chunk + start, first_chunk + min(start + n, self.count)),
                is_promotion=promotion,
                req_context=ReqContext(req_id=f"bench-{i}"),
            )
            for i, start in enumerate(range(0, self.count, n))
        ]

    @staticmethod
    def _run(mode: str, tier, submit, jobs: list[TransferJob]) -> tuple[float, float]:
        """Seconds from the first submission to the last result, and the process's CPU
        seconds over them (every thread: the tier's pool, vLLM's poll loop here)."""
        start, cpu = time.perf_counter(), time.process_time()
        for job in jobs:
            submit(job)
        results: list = []
        while len(results) < len(jobs):
            got = list(tier.get_finished_jobs())
            results += got
            if not got:
                time.sleep(0.0001)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        failed = [r.job_id for r in results if not r.success]
        if failed:
            raise RuntimeError(f"{mode}: jobs {sorted(failed)} of {len(jobs)} failed")
        return seconds, cpu

    def store(self, mode: str) -> tuple[float, float]:
        old = self.tiers.pop(mode, None)
        if old is not None:
            old[0].shutdown()
        self._rounds += 1
        root = os.path.join(self.base, f"{mode.replace(' ', '_')}-{self._rounds}")
        tier = self._tier(mode, root)
        self.tiers[mode] = (tier, root)
        timed = self._run(mode, tier, tier.submit_store, self._jobs(0, False))
        write_back(tier_files(root))
        return timed

    def load(self, mode: str, cold: bool) -> tuple[float, float]:
        tier, root = self.tiers[mode]
        write_back(tier_files(root), evict=cold, read=not cold)
        self.rows[self.count :] = 0
        timed = self._run(mode, tier, tier.submit_load, self._jobs(self.count, True))
        if not np.array_equal(self.rows[self.count :], self.rows[: self.count]):
            raise RuntimeError(f"{mode} loaded other bytes than it stored")
        return timed

    def mixed(self, mode: str, loads: int) -> list[float]:
        """Seconds from submission to finish of ``loads`` one-chunk loads (warm chunks),
        one after the other, while store jobs stream: twice as many as the tier has write
        threads kept in flight, each finished one replaced at once (new keys, same rows)."""
        tier, root = self.tiers[mode]
        write_back(tier_files(root), read=True)
        n, ids, stored = self.args.job_chunks, itertools.count(1 << 20), itertools.count()
        streaming: set[int] = set()

        def submit_store() -> None:
            job_id = next(ids)
            keys = [
                make_offload_key(
                    hashlib.sha256(f"{self.name}/mixed/{mode}/{next(stored)}".encode()).digest(), 0
                )
                for _ in range(n)
            ]
            chunks = np.arange(n) % self.count
            context = ReqContext(req_id=f"mixed-{job_id}")
            tier.submit_store(TransferJob(job_id, keys, chunks, False, context))
            streaming.add(job_id)

        def collect(wanted: int | None = None) -> bool:
            found = False
            for result in tier.get_finished_jobs():
                if result.job_id in streaming:
                    streaming.discard(result.job_id)
                    if wanted is not None:
                        submit_store()  # the stream goes on while loads are measured
                elif result.job_id == wanted:
                    if not result.success:
                        raise RuntimeError(f"{mode}: a load failed while stores streamed")
                    found = True
            return found

        for _ in range(2 * self.args.threads):
            submit_store()
        self.rows[self.count :] = 0
        latencies = []
        for i in range(loads):
            chunk, job_id = i % self.count, next(ids)
            context = ReqContext(req_id=f"mixed-load-{job_id}")
            job = TransferJob(
                job_id, [self.keys[chunk]], np.array([self.count + chunk]), True, context
            )
            start = time.perf_counter()
            tier.submit_load(job)
            while not collect(job_id):
                time.sleep(0.0001)
            latencies.append(time.perf_counter() - start)
        while streaming:
            collect()
            time.sleep(0.001)
        loaded = min(loads, self.count)
        if not np.array_equal(self.rows[self.count : self.count + loaded], self.rows[:loaded]):
            raise RuntimeError(f"{mode} loaded other bytes than it stored while stores streamed")
        return latencies

    def close(self) -> None:
        for tier, _root in self.tiers.values():
            tier.shutdown()
        shutil.rmtree(self.base, ignore_errors=True)


def run(args) -> dict:
    load_before, reporting_before = os.getloadavg()[0], free_page_reporting()
    results = []
    shuffle = random.Random(30)
    for name in args.models:
        case = Case(name, MODELS[name], args)
        times: dict[str, dict[str, list[float]]] = {m: {op: [] for op in OPS} for m in args.modes}
        cpus: dict[str, dict[str, list[float]]] = {m: {op: [] for op in OPS} for m in args.modes}
        try:
            order = list(args.modes)
            for _ in range(args.repeats):
                shuffle.shuffle(order)  # each repetition runs every mode once, shuffled
                for mode in order:
                    for op, timed in (
                        ("store", case.store(mode)),
                        ("load warm", case.load(mode, cold=False)),
                        ("load cold", case.load(mode, cold=True)),
                    ):
                        times[mode][op].append(timed[0])
                        cpus[mode][op].append(timed[1])
            shuffle.shuffle(order)
            mixed = {mode: case.mixed(mode, args.mixed_loads) for mode in order}
        finally:
            case.close()
        nbytes = case.count * case.row
        row = {"model": name, "row_bytes": case.row, "chunks": case.count, "modes": {}}
        for mode in args.modes:
            row["modes"][mode] = {
                op: {
                    "best_s": min(t),
                    "median_s": statistics.median(t),
                    "best_gbps": nbytes / min(t) / 1e9,
                    "median_gbps": nbytes / statistics.median(t) / 1e9,
                    "cpu_ms_per_gb": statistics.median(cpus[mode][op]) / (nbytes / 1e9) * 1e3,
                }
                for op, t in times[mode].items()
            }
            print(
                f"{name:<22}{mode:<23}"
                + "".join(
                    f"{op} {row['modes'][mode][op]['best_gbps']:.2f} "
                    f"({row['modes'][mode][op]['median_gbps']:.2f}; "
                    f"{row['modes'][mode][op]['cpu_ms_per_gb']:.0f} CPU ms/GB)  "
                    for op in OPS
                ),
                flush=True,
            )
        row["mixed"] = {
            mode: {
                "loads": len(t),
                "p50_ms": float(np.percentile(t, 50)) * 1e3,
                "p99_ms": float(np.percentile(t, 99)) * 1e3,
            }
            for mode, t in mixed.items()
        }
        for mode in args.modes:
            m = row["mixed"][mode]
            print(
                f"{name:<22}{mode:<23}load while stores stream: p50 {m['p50_ms']:.2f} ms, "
                f"p99 {m['p99_ms']:.2f} ms ({m['loads']} loads)",
                flush=True,
            )
        results.append(row)
    report = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "directory": args.dir or tempfile.gettempdir(),
        "repeats": args.repeats,
        "threads": args.threads,
        "job_chunks": args.job_chunks,
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "free_page_reporting_before_after": [reporting_before, free_page_reporting()],
        "results": results,
    }
    report["goals"] = goals(report)
    return report


def goals(report: dict) -> list[dict]:
    """canonical_fs vs the better vLLM mode, per (operation, model): ``{goal, measured, ...}``."""
    out = []
    for row in report["results"]:
        modes = row["modes"]
        for op, target in TARGETS.items():
            vllm_best = min(modes[m][op]["best_s"] for m in UNVERIFIED)
            ratio = vllm_best / modes["canonical_fs"][op]["best_s"]
            goal = f"{op}: canonical_fs >= {target}x vLLM fs (better of O_DIRECT, buffered)"
            out.append(goal_row(f"{goal}; {row['model']}", ratio, target))
        mixed = row["mixed"]
        for stat in ("p50_ms", "p99_ms"):
            vllm_best = min(mixed[m][stat] for m in UNVERIFIED)
            goal = (
                f"load {stat[:3]} latency while stores stream: vLLM fs (better mode) / "
                f"canonical_fs >= {MIXED_TARGET}"
            )
            ratio = vllm_best / mixed["canonical_fs"][stat]
            out.append(goal_row(f"{goal}; {row['model']}", ratio, MIXED_TARGET))
    return out


def markdown(report: dict) -> str:
    lines = [
        "# vLLM's `fs` tier vs `canonical_fs` (same chunks, jobs and file system; one run)",
        "",
        f"{report['machine']}, Python {report['python']}, {report['date']}; "
        f"`{report['command']}`; files under {report['directory']}; best of "
        f"{report['repeats']} (median in parentheses), modes shuffled each round; "
        f"{report['threads']} read + {report['threads']} write threads each; jobs of "
        f"{report['job_chunks']} chunks; 1-min load average before/after: "
        f"{report['load_average_before_after']}. GB/s of row bytes; every load checked "
        "byte for byte.",
        "",
        reporting_note(*report.get("free_page_reporting_before_after", (None, None))),
        "",
        "| goal | measured | target | met |",
        "| --- | --- | --- | --- |",
        *(
            f"| {g['goal']} | {g['measured']:.2f}x | {g['target']}x | "
            f"{'yes' if g['met'] else '**no**'} |"
            for g in report["goals"]
        ),
        "",
        "| model | row | mode | " + " | ".join(OPS) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in OPS) + " |",
    ]
    for row in report["results"]:
        for mode, ops in row["modes"].items():
            figures = " | ".join(
                f"{ops[op]['best_gbps']:.2f} ({ops[op]['median_gbps']:.2f})" for op in OPS
            )
            lines.append(
                f"| {row['model']} | {row['row_bytes'] / 2**20:.2f} MiB x {row['chunks']} "
                f"| {mode} | {figures} |"
            )
    lines += [
        "",
        "Process CPU per GB moved (median round; every thread: the pool and this poll loop), "
        "ms: what the verification costs where the CPUs, not the disk, bound a tier.",
        "",
        "| model | mode | " + " | ".join(OPS) + " |",
        "| --- | --- | " + " | ".join("---" for _ in OPS) + " |",
        *(
            f"| {row['model']} | {mode} | "
            + " | ".join(f"{ops[op]['cpu_ms_per_gb']:.0f}" for op in OPS)
            + " |"
            for row in report["results"]
            for mode, ops in row["modes"].items()
        ),
    ]
    lines += [
        "",
        "A one-chunk load of a warm chunk, timed from submission to finish, one after the "
        "other, while store jobs stream (twice the write threads in flight, each replaced "
        "when it finishes); p99 of fewer than 100 loads is about their worst.",
        "",
        "| model | mode | loads | p50 ms | p99 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in report["results"]:
        for mode, m in row.get("mixed", {}).items():
            lines.append(
                f"| {row['model']} | {mode} | {m['loads']} | {m['p50_ms']:.2f} | "
                f"{m['p99_ms']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=192, help="MiB moved per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=16, help="read and write threads each")
    parser.add_argument("--job-chunks", type=int, default=8, help="chunks per transfer job")
    parser.add_argument("--dir", default=None, help="file system to measure (default: $TMPDIR)")
    parser.add_argument("--out", default=None, help="write vllm_tiers.json and .md here")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument(
        "--mixed-loads", type=int, default=60, help="loads timed while stores stream"
    )
    parser.add_argument("--quick", action="store_true", help="96 MiB, 3 repeats, 30 loads")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",")]
    if not args.models or any(m not in MODELS for m in args.models):
        parser.error(f"--models: expected a subset of {','.join(MODELS)}, got {args.models}")
    args.modes = [m.strip() for m in args.modes.split(",")]
    needed = {"vllm fs O_DIRECT", "vllm fs buffered", "canonical_fs"}
    known = [*MODES, *EXTRA_MODES]
    if any(m not in known for m in args.modes) or not needed <= set(args.modes):
        parser.error(f"--modes: expected a subset of {','.join(known)} with {sorted(needed)}")
    for name in ("mib", "repeats", "threads", "job_chunks", "mixed_loads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1")
    if args.quick:
        args.mib, args.repeats, args.mixed_loads = 96, 3, 30
    write_report(run(args), args.out, "vllm_tiers", markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
