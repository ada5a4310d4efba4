"""Throughput of the file tier (FileStore) vs plain file I/O of the same bytes.

Goals, as ratios plain time / tier time, measured in the same run:
  * issue #13: stores and cold loads >= 0.9x a plain write / read of the same
    bytes on the same file system, with the checksum <= 10% of the tier's time;
  * issue #18: warm (page-cache) loads >= 0.95x plain reads of the same bytes,
    on one thread (tier 1T vs plain files) and through the pool (tier pool vs
    plain files xN: as many threads as the pool).
The JSON's ``goals`` lists each one per case: ``{goal, measured, target, met}``.

Unit sizes (one region row = one unit):
  * llama3-8b-like: 32 layers x 64 KiB canonical pages (8 KV heads, head 128,
    bf16, 16 tokens) = 2 MiB per unit;
  * deepseek-v3-like MLA: 61 layers x 72 KiB pages (576-wide latent, bf16,
    64 tokens) = 4.3 MiB per unit.

What is timed, per (model, fsync on/off), side by side and round-robin, best
of ``--repeats`` (each write is followed, untimed, by a write-back of its
files, so no writer is throttled for another's dirty pages; every write goes
to a new directory and nothing is deleted within a case, since freeing blocks
stalls the next journal commits):
  * plain files   one file per unit: open, write (or read) the payload, [fdatasync], close;
  * plain files xN  the same, by ``--threads`` threads each taking every Nth unit
                  (started before the clock, as the pool's are);
  * plain stream  one big file: the same bytes as one sequential write/read, [one
                  fdatasync at the end];
  * tier 1T       FileStore.store()/load() inline, one unit after the other (native:
                  temp file xxh3-hashed whole then written in one call (8 MiB pieces
                  beyond), [fdatasync], rename-no-replace, [directory fsync]; load:
                  256 KiB RWF_NOWAIT pieces hashed in place from the page cache, else
                  each piece read and hashed in a buffer);
  * tier pool     FileStore.submit_store()/submit_load() through its job pool
                  (``--threads``), all units queued then waited for;
  * checksum      xxh3-128 alone over the same payloads (one thread): from memory
                  (stores), in 256 KiB pieces already in the cache (loads).

Rows (sources and destinations) are page aligned, as a region in /dev/shm is. Keys
are 32 bytes (``--key-bytes``), as engines' sha256 block hashes: a unit's payload then
starts at byte 128 of its file, as aligned as the plain files' (see ``block_key``).

Page cache, said plainly: writes go to the page cache; with fsync they also
reach the device before a unit counts. "warm" loads read files still in the
page cache (memory copies: the CPU cost, where a checksum weighs most). "cold"
loads first evict exactly our files from the page cache (fdatasync then
posix_fadvise DONTNEED, untimed; nothing global is dropped) so they come from
the device; a virtual disk may still be cached by its host. GB/s = payload
bytes / seconds (headers, < 0.1% of a unit, are not counted).

Usage: python bench/bench_store.py [--quick] [--out DIR] [--dir PATH] [--mib N]
       [--repeats N] [--threads N] [--ops "store,load warm,load cold"] [--fsync both|on|off]
       [--key-bytes 32|8]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import mmap
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import goal_row
from bench_read_hash import on_threads

from canonical_ops.units import FileStore, ModelIdentity, StoreNamespace
from canonical_ops.units.files import _PIECE_BYTES
from layouts import LayerSpec, RankContext

MODELS = {
    "llama3-8b-like": dict(
        spec=LayerSpec("full", 16, 8, 128, "bfloat16", "packed", "NHD"),
        ctx=RankContext(1, 8, 0),
        layers=32,
    ),
    "deepseek-v3-like (MLA)": dict(
        spec=LayerSpec("mla", 64, 1, 576, "bfloat16", "packed", "NHD"),
        ctx=RankContext(1, 1, 0),
        layers=61,
    ),
}
METHODS = ("plain files", "plain files xN", "plain stream", "tier 1T", "tier pool")
# Each goal: (op, tier method, plain baseline, target ratio). A ratio is plain time /
# tier time (>= target is met); the baseline runs on as many threads as the tier.
RATIO_GOALS = (
    ("load warm", "tier 1T", "plain files", 0.95),
    ("load warm", "tier pool", "plain files xN", 0.95),
    ("store", "tier pool", "plain files", 0.9),
    ("store", "tier 1T", "plain files", 0.9),
    ("load cold", "tier pool", "plain files", 0.9),
    ("load cold", "tier 1T", "plain files", 0.9),
)
CHECKSUM_SHARE_TARGET = 0.10
LOAD_PIECE_BYTES = _PIECE_BYTES  # FileStore's loads read and hash a unit in pieces of this size
# The tier opens units with O_NOATIME (no inode update per read); so does the baseline.
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOATIME", 0)


def block_key(i: int, key_bytes: int) -> bytes | int:
    """Block ``i``'s key: 32 bytes as engines' sha256 block hashes, or the int ``i`` (8 bytes).

    The key's size sets where a unit's payload starts in its file (byte 96 + key
    bytes rounded up to 8): 128 for a 32-byte key, 64-byte aligned as the plain
    files' payloads are; 104 for an int key, which slows every copy from the page
    cache (bench/bench_read_hash.py measures it).
    """
    return hashlib.sha256(i.to_bytes(8, "little")).digest() if key_bytes == 32 else i


def _aligned(rows: int, row_bytes: int) -> np.ndarray:
    """A (rows, row_bytes) uint8 array in anonymous mmap memory, prefaulted."""
    memory = mmap.mmap(-1, rows * row_bytes)
    array = np.frombuffer(memory, np.uint8).reshape(rows, row_bytes)
    array[:] = 1  # fault every page in now, not inside a timed section
    return array


def _sync_files(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def _evict_from_page_cache(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _list_files(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        out += [os.path.join(dirpath, n) for n in names]
    return out


class Case:
    """One model x fsync setting: its payload rows, directories and timed operations."""

    def __init__(
        self, name: str, model: dict, fsync: bool, mib: int, base: str, threads: int, key_bytes: int
    ):
        self.name, self.fsync, self.threads = name, fsync, threads
        self.ns = StoreNamespace.from_specs(
            ModelIdentity(name), [model["spec"]] * model["layers"], model["ctx"]
        )
        self.unit = self.ns.total_bytes
        self.count = max(4, (mib << 20) // self.unit)
        self.keys = [block_key(i, key_bytes) for i in range(self.count)]
        # Page-aligned rows, as a real region (an mmap) has them: copy speed depends on
        # the alignment of source and destination, and numpy's own allocations are not.
        self.rows = _aligned(self.count, self.unit)
        self.rows[:] = np.random.default_rng(0).integers(0, 256, self.rows.shape, dtype=np.uint8)
        self.dest = _aligned(self.count, self.unit)
        self.base = base
        self.dirs: dict[str, str] = {}  # the latest directory written by each method
        self._rounds = 0

    @property
    def nbytes(self) -> int:
        return self.count * self.unit

    def _fresh(self, method: str) -> str:
        # A new directory each time, nothing deleted until the case ends: freeing extents
        # (with online discard) stalls the next journal commits, i.e. the next writer.
        self._rounds += 1
        path = os.path.join(self.base, f"{method.replace(' ', '_')}-{self._rounds}")
        os.makedirs(path)
        self.dirs[method] = path
        return path

    def _store(self, root: str, threads: int) -> FileStore:
        return FileStore(
            root, self.ns, fsync=self.fsync, threads=threads, queue_depth=self.count + 1
        )

    def _tier(self, method: str, root: str, cold: bool, rows: np.ndarray) -> float:
        """Seconds to store ``rows`` (``rows is self.rows``) or load them, unit by unit
        inline ("tier 1T") or all queued then waited for ("tier pool")."""
        store = self._store(root, self.threads if method == "tier pool" else 1)
        n, pool, storing = self.ns.num_layers, method == "tier pool", rows is self.rows
        try:
            if cold:  # the start-up scan read headers: drop them again
                _evict_from_page_cache(_list_files(root))
            start = time.perf_counter()
            jobs = [
                (store.submit_store if pool else store.store)(self.keys[i], 0, rows[i], i)
                if storing
                else (store.submit_load if pool else store.load)(self.keys[i], 0, n, rows[i])
                for i in range(self.count)
            ]
            jobs = [store.wait(j) for j in jobs] if pool else jobs
            elapsed = time.perf_counter() - start
        finally:
            store.close()
        bad = [j for j in jobs if not j.ok]
        assert not bad, bad[0].detail
        return elapsed

    # ----------------------------------------------------------------- writes

    def write(self, method: str) -> float:
        root = self._fresh(method)
        if method.startswith("tier"):
            return self._tier(method, root, False, self.rows)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC

        def write_files(units: range) -> None:
            for i in units:
                fd = os.open(os.path.join(root, f"{i}.bin"), flags, 0o644)
                os.write(fd, self.rows[i])
                if self.fsync:
                    os.fdatasync(fd)
                os.close(fd)

        if method == "plain files xN":
            return on_threads(self.threads, self.count, write_files)()
        start = time.perf_counter()
        if method == "plain files":
            write_files(range(self.count))
        else:
            fd = os.open(os.path.join(root, "stream.bin"), flags, 0o644)
            for i in range(self.count):
                os.write(fd, self.rows[i])
            if self.fsync:
                os.fdatasync(fd)
            os.close(fd)
        return time.perf_counter() - start

    # ----------------------------------------------------------------- reads

    def read(self, method: str, cold: bool) -> float:
        root = self.dirs[method]
        if cold:
            _evict_from_page_cache(_list_files(root))
        self.dest[:] = 0
        if method.startswith("tier"):
            elapsed = self._tier(method, root, cold, self.dest)
        else:

            def read_files(units: range) -> None:
                for i in units:
                    fd = os.open(os.path.join(root, f"{i}.bin"), READ_FLAGS)
                    n = os.preadv(fd, [self.dest[i]], 0)
                    os.close(fd)
                    assert n == self.unit

            start = time.perf_counter()
            if method == "plain files xN":
                elapsed = on_threads(self.threads, self.count, read_files)()
            elif method == "plain files":
                read_files(range(self.count))
            else:
                fd = os.open(os.path.join(root, "stream.bin"), READ_FLAGS)
                for i in range(self.count):
                    assert os.preadv(fd, [self.dest[i]], i * self.unit) == self.unit
                os.close(fd)
            if method != "plain files xN":
                elapsed = time.perf_counter() - start
        assert np.array_equal(self.dest[-1], self.rows[-1])
        return elapsed

    def checksum(self) -> float:
        """xxh3-128 over the payloads in memory: what a store pays (it hashes the row)."""
        start = time.perf_counter()
        for i in range(self.count):
            xxhash.xxh3_128(self.rows[i]).digest()
        return time.perf_counter() - start

    def checksum_cached(self) -> float:
        """xxh3-128 over the payloads in ``LOAD_PIECE_BYTES`` pieces, each brought into the cache first
        (untimed): what a load pays, hashing each piece it has just read."""
        piece = memoryview(bytearray(LOAD_PIECE_BYTES))
        elapsed = 0.0
        for i in range(self.count):
            hasher = xxhash.xxh3_128()
            row = memoryview(self.rows[i])
            for offset in range(0, self.unit, LOAD_PIECE_BYTES):
                part = piece[: min(LOAD_PIECE_BYTES, self.unit - offset)]
                part[:] = row[offset : offset + len(part)]
                start = time.perf_counter()
                hasher.update(part)
                elapsed += time.perf_counter() - start
            hasher.digest()
        return elapsed


def run(args) -> dict:
    base = tempfile.mkdtemp(prefix="bench-store-", dir=args.dir)
    load_before = os.getloadavg()
    os.sync()  # untimed: start without anyone's pending write-back
    results = []
    fsyncs = {"both": (False, True), "off": (False,), "on": (True,)}[args.fsync]
    try:
        for name, model in MODELS.items():
            for fsync in fsyncs:
                case = Case(
                    name,
                    model,
                    fsync,
                    args.mib,
                    os.path.join(base, "c"),
                    args.threads,
                    args.key_bytes,
                )
                times = {f"{op} {m}": [] for op in args.ops for m in METHODS}
                times["checksum"], times["checksum cached"] = [], []
                for r in range(args.repeats):
                    # Round-robin, each round starting one method later: no method always
                    # runs first (or last) in a round.
                    for method in METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]:
                        elapsed = case.write(method)  # the files to read, timed or not
                        if "store" in args.ops:
                            times[f"store {method}"].append(elapsed)
                        # Untimed: write our dirty pages back now, so that the next writer
                        # is not throttled for this one's (the kernel's dirty limits).
                        _sync_files(_list_files(case.dirs[method]))
                        if "load warm" in args.ops:
                            times[f"load warm {method}"].append(case.read(method, cold=False))
                        if "load cold" in args.ops:
                            times[f"load cold {method}"].append(case.read(method, cold=True))
                    times["checksum"].append(case.checksum())
                    times["checksum cached"].append(case.checksum_cached())
                best = {k: min(v) for k, v in times.items()}
                gbps = {k: case.nbytes / v / 1e9 for k, v in best.items()}
                row = dict(
                    model=name,
                    fsync=fsync,
                    unit_bytes=case.unit,
                    layers=case.ns.num_layers,
                    units=case.count,
                    bytes=case.nbytes,
                    best_s=best,
                    gbps=gbps,
                    all_s=times,
                )
                for op in args.ops:
                    for tier, plain in (
                        ("tier 1T", "plain files"),
                        ("tier pool", "plain files"),
                        ("tier pool", "plain files xN"),
                        ("tier pool", "plain stream"),
                    ):
                        row[f"{op} ratio {tier} / {plain}"] = (
                            best[f"{op} {plain}"] / best[f"{op} {tier}"]
                        )
                    checksum = best["checksum" if op == "store" else "checksum cached"]
                    row[f"{op} checksum share (tier 1T)"] = checksum / best[f"{op} tier 1T"]
                results.append(row)
                shutil.rmtree(case.base, ignore_errors=True)
                os.sync()  # untimed: the deletions' journal work is done before the next case
                print_row(row, args.ops)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report = dict(
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        python=platform.python_version(),
        xxhash=xxhash.VERSION,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        command="python bench/bench_store.py " + " ".join(sys.argv[1:]),
        directory_fs=_fs_of(args.dir or tempfile.gettempdir()),
        repeats=args.repeats,
        threads=args.threads,
        key_bytes=args.key_bytes,
        ops=list(args.ops),
        # Other users of the machine: a busy machine makes every figure noisier.
        load_average_before_after=[round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        results=results,
    )
    report["goals"] = goals(report)
    return report


def _fs_of(path: str) -> str:
    path = os.path.realpath(path)
    best = ("?", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if path.startswith(mnt) and len(mnt) >= len(best[2]):
                    best = (dev, fstype, mnt)
    except OSError:
        pass
    return f"{best[1]} on {best[0]} (mounted at {best[2]})"


HEADER = (
    f"{'model':<24}{'fsync':<6}{'op':<10}{'files':>7}{'files xN':>9}{'stream':>7}"
    f"{'tier 1T':>8}{'pool':>6}{'1T/files':>9}{'pool/xN':>8}{'cksum':>7}"
)


def print_row(row: dict, ops) -> None:
    if not getattr(print_row, "printed", False):
        print(HEADER)
        print_row.printed = True
    for op in ops:
        g = row["gbps"]
        print(
            f"{row['model'][:23]:<24}{'on' if row['fsync'] else 'off':<6}{op:<10}"
            + "".join(f"{g[f'{op} {m}']:>{w}.2f}" for m, w in zip(METHODS, (7, 9, 7, 8, 6)))
            + f"{row[f'{op} ratio tier 1T / plain files']:>8.2f}x"
            + f"{row[f'{op} ratio tier pool / plain files xN']:>7.2f}x"
            + f"{100 * row[f'{op} checksum share (tier 1T)']:>6.1f}%",
            flush=True,
        )


def goals(report: dict) -> list[dict]:
    """The goals, one per (goal, model, fsync) measured: ``{goal, measured, target, met}``.

    Ratios are plain time / tier time (met when >= target); the checksum share is
    xxh3-128 alone / the one-thread tier's time (met when <= target).
    """
    out = []
    for row in report["results"]:
        case = f"{row['model']}, fsync {'on' if row['fsync'] else 'off'}"
        for op, tier, plain, target in RATIO_GOALS:
            key = f"{op} ratio {tier} / {plain}"
            if key in row:
                threads = f" ({report['threads']} threads each)" if plain.endswith("xN") else ""
                measured = row[key]
                out.append(
                    goal_row(
                        f"{op}: {tier} >= {target}x {plain}{threads}; {case}", measured, target
                    )
                )
        for op in report["ops"]:
            share = row[f"{op} checksum share (tier 1T)"]
            goal = f"checksum <= {CHECKSUM_SHARE_TARGET:.0%} of {op} (tier 1T); {case}"
            out.append(goal_row(goal, share, CHECKSUM_SHARE_TARGET, at_most=True))
    return out


def markdown(report: dict) -> str:
    lines = [
        "# canonical-kv file tier (FileStore) vs plain file I/O",
        "",
        f"{report['machine']}, Python {report['python']}, xxhash {report['xxhash']}, "
        f"{report['date']}; `{report['command']}`; files on {report['directory_fs']}; "
        f"best of {report['repeats']}, round-robin; pool of {report['threads']} threads; "
        f"{report['key_bytes']}-byte block keys; "
        f"1-min load average before/after: {report['load_average_before_after']} "
        "(other users of the machine).",
        "",
        "GB/s of payload. `files` = one plain file per unit, written or read by one thread; "
        f"`files xN` = the same by {report['threads']} threads (as many as the tier's pool), "
        "each taking every Nth unit; `stream` = one plain sequential stream (no per-unit file "
        "at all). `1T/files` = the tier inline on one thread vs `files` (the same work shape); "
        "`pool/xN` = the tier through its job pool (what an engine uses) vs `files xN` (the "
        "same threads); `pool/files` = that pool vs the one-thread loop. checksum share = "
        "xxh3-128 alone as a share of the one-thread tier's time, hashed as the tier hashes: "
        "for stores, the payloads from memory (an upper bound: the tier hashes each piece "
        f"right after writing it, from the cache); for loads, {LOAD_PIECE_BYTES >> 10} KiB "
        "pieces already in the cache (a load hashes each piece right after reading it). warm = from the page cache "
        "(memory copies), cold = our files evicted from it first (device reads).",
        "",
        "## Goals",
        "",
        "| goal | measured | target | met |",
        "| --- | --- | --- | --- |",
        *(
            f"| {g['goal']} | {g['measured']:.2f} | {g['target']} | "
            f"{'yes' if g['met'] else '**no**'} |"
            for g in report["goals"]
        ),
        "",
        "| model | unit | fsync | op | files | files xN | stream | tier 1T | tier pool "
        "| 1T/files | pool/xN | pool/files | pool/stream | checksum share |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["results"]:
        for op in report["ops"]:
            g = row["gbps"]
            lines.append(
                f"| {row['model']} | {row['unit_bytes'] / 2**20:.2f} MiB x {row['units']} "
                f"| {'on' if row['fsync'] else 'off'} | {op} | "
                + " | ".join(f"{g[f'{op} {m}']:.2f}" for m in METHODS)
                + f" | {row[f'{op} ratio tier 1T / plain files']:.2f}x"
                + f" | {row[f'{op} ratio tier pool / plain files xN']:.2f}x"
                + f" | {row[f'{op} ratio tier pool / plain files']:.2f}x"
                + f" | {row[f'{op} ratio tier pool / plain stream']:.2f}x"
                + f" | {100 * row[f'{op} checksum share (tier 1T)']:.1f}% |"
            )
    return "\n".join(lines) + "\n"


OPS = ("store", "load warm", "load cold")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB moved per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=4, help="tier pool threads")
    parser.add_argument("--dir", default=None, help="file system to measure (default: $TMPDIR)")
    parser.add_argument("--out", default=None, help="write bench_store.json and .md here")
    parser.add_argument("--quick", action="store_true", help="64 MiB, 2 repeats")
    parser.add_argument(
        "--ops",
        default=",".join(OPS),
        help=f"comma-separated operations to time, of {','.join(OPS)} (default: all)",
    )
    parser.add_argument(
        "--fsync", choices=("both", "off", "on"), default="both", help="cases to run"
    )
    parser.add_argument(
        "--key-bytes",
        type=int,
        choices=(8, 32),
        default=32,
        help="block key size: 32 (sha256 block hashes: vLLM's, token_keys) or 8 (int keys)",
    )
    args = parser.parse_args(argv)
    ops = tuple(op.strip() for op in args.ops.split(","))
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        parser.error(
            f"--ops: expected a comma-separated subset of {','.join(OPS)}, got {args.ops!r}"
        )
    args.ops = tuple(op for op in OPS if op in ops)
    if args.quick:
        args.mib, args.repeats = 64, 2
    write_report(run(args), args.out, "bench_store", markdown)
    return 0


def write_report(report: dict, out: str | None, stem: str, markdown) -> None:
    """``out/stem.json`` and ``out/stem.md`` (``markdown(report)``), when ``out`` is given."""
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{stem}.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(out, f"{stem}.md"), "w") as f:
            f.write(markdown(report))


if __name__ == "__main__":
    sys.exit(main())
