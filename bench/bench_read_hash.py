"""Can reading and hashing a unit overlap? Warm (page-cache) reads with and without XXH3-128.

The file tier verifies every unit it loads: after the read, XXH3-128 over the payload.
On warm loads (the file in the page cache) the read is a memory copy, so the hash
is extra work on the same memory, and the tier reads at ~0.55x a plain read when
one thread does both (docs/bench/bench_store.md). This measures the ways to
overlap them, on the same files in the same run (no canonical-kv code involved):

* plain read            open, one preadv of the whole unit, close (the baseline)
* read, then hash       what FileStore does per unit (one thread)
* chunked read+hash     preadv a chunk, hash it while it is cache-hot, next chunk
* pipelined             read chunk k+1 (preadv releases the GIL) while a hashing
                        thread hashes chunk k (python-xxhash releases the GIL too)
* split                 a helper thread reads the second half while the caller
                        reads and hashes the first half
* 2 threads, per unit   two threads each read+hash whole units (the job pool's way)
* 2 threads, plain      two threads each plain-read whole units

and whether ``xxh3_128.update`` lets two threads hash at once (GIL released),
for cache-resident (256 KiB) and memory-resident (4 MiB) buffers.

Usage: python bench/bench_read_hash.py [--unit-mib 2] [--count 64] [--repeats 7]
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


def aligned(nbytes: int) -> np.ndarray:
    """Page-aligned prefaulted memory, as a region's rows are."""
    array = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    array[:] = 1
    return array


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--unit-mib", type=float, default=2.0, help="unit size (llama3-8b: 2)")
    parser.add_argument("--count", type=int, default=64, help="units per measurement")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=None, help="file system (default: $TMPDIR)")
    args = parser.parse_args(argv)
    unit = int(args.unit_mib * (1 << 20)) // 4096 * 4096
    count = args.count
    root = tempfile.mkdtemp(prefix="bench-read-hash-", dir=args.dir)
    try:
        payload = np.random.default_rng(0).integers(0, 256, unit, dtype=np.uint8)
        paths = []
        for i in range(count):
            path = os.path.join(root, f"{i}.bin")
            with open(path, "wb") as f:
                f.write(payload.tobytes())
            paths.append(path)
        dest = aligned(unit * count).reshape(count, unit)
        flags = os.O_RDONLY | getattr(os, "O_NOATIME", 0)

        def read(i: int) -> None:
            fd = os.open(paths[i], flags)
            os.preadv(fd, [dest[i]], 0)
            os.close(fd)

        def read_hash(i: int) -> None:
            read(i)
            hasher = xxhash.xxh3_128()
            hasher.update(dest[i])
            hasher.digest()

        def plain() -> None:
            for i in range(count):
                read(i)

        def serial() -> None:
            for i in range(count):
                read_hash(i)

        def chunked(chunk: int):
            def run() -> None:
                for i in range(count):
                    fd, hasher = os.open(paths[i], flags), xxhash.xxh3_128()
                    for offset in range(0, unit, chunk):
                        view = dest[i, offset : offset + chunk]
                        os.preadv(fd, [view], offset)
                        hasher.update(view)
                    os.close(fd)
                    hasher.digest()

            return run

        work: queue.SimpleQueue = queue.SimpleQueue()
        done: queue.SimpleQueue = queue.SimpleQueue()

        def hashing_thread() -> None:
            while True:
                item = work.get()
                if item is None:
                    return
                item[0].update(item[1])
                done.put(True)

        helper = threading.Thread(target=hashing_thread, daemon=True)
        helper.start()

        def pipelined(chunk: int):
            def run() -> None:
                for i in range(count):
                    fd, hasher, pending = os.open(paths[i], flags), xxhash.xxh3_128(), 0
                    for offset in range(0, unit, chunk):
                        view = dest[i, offset : offset + chunk]
                        os.preadv(fd, [view], offset)
                        if pending:
                            done.get()  # chunk k-1 hashed: the state may take chunk k
                            pending -= 1
                        work.put((hasher, view))
                        pending += 1
                    while pending:
                        done.get()
                        pending -= 1
                    os.close(fd)
                    hasher.digest()

            return run

        def split() -> None:
            half = unit // 2 // 4096 * 4096
            for i in range(count):
                fd, finished = os.open(paths[i], flags), threading.Event()

                def second(fd: int = fd, i: int = i, finished=finished) -> None:
                    os.preadv(fd, [dest[i, half:]], half)
                    finished.set()

                work.put((_Call(second), b""))
                os.preadv(fd, [dest[i, :half]], 0)
                hasher = xxhash.xxh3_128()
                hasher.update(dest[i, :half])
                finished.wait()
                done.get()
                hasher.update(dest[i, half:])
                hasher.digest()
                os.close(fd)

        def threads(body):
            def run() -> None:
                def part(k: int) -> None:
                    for i in range(k, count, 2):
                        body(i)

                pair = [threading.Thread(target=part, args=(k,)) for k in (0, 1)]
                for thread in pair:
                    thread.start()
                for thread in pair:
                    thread.join()

            return run

        plain()  # the files into the page cache, the destination faulted in
        cases = [
            ("plain read", plain),
            ("read, then hash (FileStore)", serial),
            ("chunked read+hash 64 KiB", chunked(64 << 10)),
            ("chunked read+hash 256 KiB", chunked(256 << 10)),
            ("pipelined 256 KiB", pipelined(256 << 10)),
            ("pipelined 1 MiB", pipelined(1 << 20)),
            ("split halves (helper reads 2nd)", split),
            ("2 threads, read+hash per unit", threads(read_hash)),
            ("2 threads, plain read per unit", threads(read)),
        ]
        load = os.getloadavg()[0]
        print(
            f"{count} units of {unit / 2**20:.2f} MiB, warm, best of {args.repeats}; "
            f"{os.cpu_count()} CPUs; load average {load:.2f}; xxhash {xxhash.VERSION}\n"
        )
        base = None
        print("| method | GB/s | vs plain read |\n| --- | --- | --- |")
        for name, fn in cases:
            gbps = unit * count / best(fn, args.repeats) / 1e9
            base = base or gbps
            print(f"| {name} | {gbps:.2f} | {gbps / base:.2f}x |", flush=True)
        work.put(None)
        print()
        print("| xxh3_128.update, 2 threads vs 1 | scaling (2.0 = GIL fully released) |")
        print("| --- | --- |")
        for size, rounds in ((256 << 10, 2000), (4 << 20, 150)):
            bufs = [np.ones(size, np.uint8) for _ in range(2)]

            def hash_many(buf, rounds=rounds) -> None:
                for _ in range(rounds):
                    hasher = xxhash.xxh3_128()
                    hasher.update(buf)
                    hasher.digest()

            one = best(lambda bufs=bufs: hash_many(bufs[0]), 3)

            def two(bufs=bufs) -> None:
                pair = [threading.Thread(target=hash_many, args=(b,)) for b in bufs]
                for thread in pair:
                    thread.start()
                for thread in pair:
                    thread.join()

            print(f"| {size >> 10} KiB buffers | {2 * one / best(two, 3):.2f}x |")
        print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


class _Call:
    """Lets ``split`` run a function on the hashing thread (``update`` is its entry point)."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def update(self, _data) -> None:
        self.fn()


if __name__ == "__main__":
    sys.exit(main())
