"""Warm (page-cache) reads with XXH3-128 verification: which way of hashing costs least?

The file tier verifies every unit it loads. A warm load is a memory copy (page
cache -> destination), so the hash is extra work over the same bytes. This
measures the ways to do it on the same files in the same run, round-robin, no
canonical-kv code involved, on 1 thread and on ``--threads`` threads (each
taking every Nth unit, as the tier's job pool does), against plain reads of
the same files into the same kind of memory with the same threads:

* plain read          open, one preadv of the whole unit, close (the baseline)
* read, then hash     one preadv of the unit, then XXH3-128 over it (a second pass
                      over memory: a unit is larger than a core's L2)
* chunked C           preadv a piece of C bytes, hash it at once while it is in the
                      core's cache, next piece (what FileStore does, C = 1 MiB)
* helper thread       (1 thread only) the reading thread hands each piece to a
                      hashing thread and reads on (a second core; python-xxhash
                      releases the GIL): what it would take to hide the hash

Then, to explain the figures: the speed of XXH3-128 over a piece just read vs
the same piece from memory; how a header that is not a multiple of 64 bytes
slows the copy (a unit's payload starts at byte ``96 + key bytes rounded up to
8``: 104 for an 8-byte key, 128 for a 32-byte one); and whether
``xxh3_128.update`` lets two threads hash at once.

Usage: python bench/bench_read_hash.py [--unit-mib 2] [--mib 256] [--repeats 9] [--threads 4]
"""

from __future__ import annotations

import argparse
import mmap
import os
import queue
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import xxhash

READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
CHUNKS = (64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20)


def aligned(nbytes: int) -> np.ndarray:
    """Page-aligned prefaulted memory, as a region's rows are."""
    array = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    array[:] = 1
    return array


def on_threads(threads: int, count: int, body):
    """A timed function: ``threads`` started threads run ``body`` over every Nth unit."""

    def run() -> float:
        go, ready = threading.Event(), threading.Barrier(threads + 1)

        def worker(k: int) -> None:
            ready.wait()
            go.wait()
            body(range(k, count, threads))

        pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for thread in pool:
            thread.start()
        ready.wait()
        start = time.perf_counter()
        go.set()
        for thread in pool:
            thread.join()
        return time.perf_counter() - start

    return run


def timed(body, count: int):
    def run() -> float:
        start = time.perf_counter()
        body(range(count))
        return time.perf_counter() - start

    return run


class Files:
    """``count`` unit files of ``unit`` payload bytes after ``head`` header bytes."""

    def __init__(self, root: str, count: int, unit: int, head: int) -> None:
        payload = np.random.default_rng(0).integers(0, 256, head + unit, dtype=np.uint8)
        self.paths = []
        for i in range(count):
            path = os.path.join(root, f"{head}-{i}.bin")
            with open(path, "wb") as f:
                f.write(payload.tobytes())
            self.paths.append(path)
        self.unit, self.head = unit, head
        self.dest = aligned(unit * count).reshape(count, unit)
        self.views = [memoryview(row) for row in self.dest]

    def plain(self, units) -> None:
        head = bytearray(self.head)
        for i in units:
            fd = os.open(self.paths[i], READ_FLAGS)
            os.preadv(fd, [head, self.views[i]] if self.head else [self.views[i]], 0)
            os.close(fd)

    def serial(self, units) -> None:
        for i in units:
            fd = os.open(self.paths[i], READ_FLAGS)
            os.preadv(fd, [self.views[i]], self.head)
            os.close(fd)
            xxhash.xxh3_128(self.views[i]).digest()

    def chunked(self, chunk: int):
        def run(units) -> None:
            for i in units:
                fd, hasher, view = (
                    os.open(self.paths[i], READ_FLAGS),
                    xxhash.xxh3_128(),
                    self.views[i],
                )
                for offset in range(0, self.unit, chunk):
                    part = view[offset : offset + chunk]
                    os.preadv(fd, [part], self.head + offset)
                    hasher.update(part)
                os.close(fd)
                hasher.digest()

        return run

    def helper(self, chunk: int):
        """Reads on this thread, hashes on a helper thread that never makes it wait."""
        work: queue.SimpleQueue = queue.SimpleQueue()

        def hashing() -> None:
            while (item := work.get()) is not None:
                hasher, part, done = item
                if part is None:
                    done.put(hasher.digest())
                else:
                    hasher.update(part)

        def run(units) -> None:
            thread = threading.Thread(target=hashing, daemon=True)
            thread.start()
            done: queue.SimpleQueue = queue.SimpleQueue()
            for i in units:
                fd, hasher, view = (
                    os.open(self.paths[i], READ_FLAGS),
                    xxhash.xxh3_128(),
                    self.views[i],
                )
                for offset in range(0, self.unit, chunk):
                    part = view[offset : offset + chunk]
                    os.preadv(fd, [part], self.head + offset)
                    work.put((hasher, part, None))
                os.close(fd)
                work.put((hasher, None, done))
                done.get()  # the unit counts as loaded once verified
            work.put(None)
            thread.join()

        return run


def best_of(cases: dict, repeats: int) -> dict[str, float]:
    """Best seconds of each case, run round-robin (each round starting one case later)."""
    names, times = list(cases), {name: [] for name in cases}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(cases[name]())
    return {name: min(t) for name, t in times.items()}


def table(title: str, seconds: dict[str, float], nbytes: int, baselines: dict[str, str]) -> None:
    print(f"\n| {title} | GB/s | vs {', '.join(sorted(set(baselines.values())))} |")
    print("| --- | --- | --- |")
    for name, s in seconds.items():
        base = seconds[baselines[name]]
        print(f"| {name} | {nbytes / s / 1e9:.2f} | {base / s:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--unit-mib", type=float, default=2.0, help="unit size (llama3-8b: 2)")
    parser.add_argument("--mib", type=int, default=256, help="MiB read per measurement")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=4, help="threads of the pool cases")
    parser.add_argument("--dir", default=None, help="file system (default: $TMPDIR)")
    args = parser.parse_args(argv)
    unit = int(args.unit_mib * (1 << 20)) // 4096 * 4096
    count = max(4, (args.mib << 20) // unit)
    nbytes = unit * count
    n = args.threads
    root = tempfile.mkdtemp(prefix="bench-read-hash-", dir=args.dir)
    try:
        files = Files(root, count, unit, 128)  # a 32-byte key's header: the payload 64-aligned
        files.plain(range(count))  # the files into the page cache
        print(
            f"{count} units of {unit / 2**20:.2f} MiB, warm, best of {args.repeats}, "
            f"round-robin; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; "
            f"xxhash {xxhash.VERSION} (libxxhash {xxhash.XXHASH_VERSION})"
        )
        one = {
            "plain read": timed(files.plain, count),
            "read, then hash": timed(files.serial, count),
        }
        one |= {f"chunked {c >> 10} KiB": timed(files.chunked(c), count) for c in CHUNKS}
        one[f"helper thread, {1 << 10} KiB"] = timed(files.helper(1 << 20), count)
        pool = {f"{n} threads, plain read": on_threads(n, count, files.plain)}
        pool[f"{n} threads, read, then hash"] = on_threads(n, count, files.serial)
        pool |= {
            f"{n} threads, chunked {c >> 10} KiB": on_threads(n, count, files.chunked(c))
            for c in CHUNKS
        }
        seconds = best_of(one | pool, args.repeats)
        table(
            "1 thread",
            {k: seconds[k] for k in one},
            nbytes,
            dict.fromkeys(one, "plain read"),
        )
        table(
            f"{n} threads",
            {k: seconds[k] for k in pool},
            nbytes,
            dict.fromkeys(pool, f"{n} threads, plain read"),
        )

        # XXH3-128 over a piece just read (cached) vs the same bytes from memory.
        print("\n| XXH3-128 over | GB/s |\n| --- | --- |")
        chunk, dest = 1 << 20, files.dest.reshape(-1)
        fd = os.open(files.paths[0], READ_FLAGS)
        hot = cold = 0.0
        for offset in range(0, nbytes, chunk):
            part = dest[offset : offset + chunk]
            os.preadv(fd, [part], files.head + offset % unit)
            start = time.perf_counter()
            xxhash.xxh3_128(part).digest()
            hot += time.perf_counter() - start
        os.close(fd)
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            xxhash.xxh3_128(dest[offset : offset + chunk]).digest()
        cold = time.perf_counter() - start
        print(f"| 1 MiB pieces right after their read | {nbytes / hot / 1e9:.2f} |")
        print(f"| the same {nbytes >> 20} MiB from memory | {nbytes / cold / 1e9:.2f} |")

        # Where the payload starts in the file: a copy from the page cache is slower when
        # source and destination are not equally aligned (to 64 bytes).
        heads = {"payload at byte 0 (plain file)": 0, "at 104 (8-byte key)": 104}
        heads["at 128 (32-byte key)"] = 128
        aligns = {}
        for name, head in heads.items():
            other = files if head == 128 else Files(root, count, unit, head)
            other.plain(range(count))
            aligns[name] = timed(other.plain, count)
        seconds = best_of(aligns, args.repeats)
        table(
            "plain read, 1 thread",
            seconds,
            nbytes,
            dict.fromkeys(aligns, "payload at byte 0 (plain file)"),
        )

        print("\n| xxh3_128.update, 2 threads vs 1 | scaling (2.0 = GIL fully released) |")
        print("| --- | --- |")
        for size, rounds in ((256 << 10, 2000), (4 << 20, 150)):
            bufs = [np.ones(size, np.uint8) for _ in range(2)]

            def hash_many(buf, rounds=rounds) -> None:
                for _ in range(rounds):
                    xxhash.xxh3_128(buf).digest()

            alone = best_of({"1": timed(lambda _u, b=bufs[0]: hash_many(b), 1)}, 3)["1"]
            both = on_threads(2, 2, lambda units, b=bufs: [hash_many(b[i]) for i in units])
            pair = best_of({"2": both}, 3)["2"]
            print(f"| {size >> 10} KiB buffers | {2 * alone / pair:.2f}x |")
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
