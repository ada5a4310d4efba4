"""Verified loads (issue 30 item 4): whatever path a load takes (a unit the page cache holds
whole in huge folios: one pass over a mapping of it under a read lease, each 2 KiB block hashed
and streamed on; else RWF_NOWAIT pieces from the page cache, or a device read into the batch's
buffer hashed and streamed on a 4 KiB block at a time, buffered or O_DIRECT; a batch's later
units asked for ahead), a byte flipped on disk, a unit rewritten or truncated by another
process (SIGBUS inside a mapping included), a unit read again after its page-cache pages were
dropped: each is a miss (quarantined), never a load, never a crash. And the streamed copies
land exactly, at any alignment."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest
from helpers.store import child_env, row, small_namespace, unit_files

from canonical_ops.units import FileStore
from canonical_ops.units import files as files_mod
from canonical_ops.units.unit import key_digest

# 64 layers of 16 KiB: a 1 MiB payload, many 4 KiB blocks and four 256 KiB pieces.
NS = small_namespace(64, head_size=64, block_size=16)
# 64 layers of 32 KiB: a 2 MiB payload, a unit larger than a huge folio (only such are mapped).
BIG = small_namespace(64, head_size=64, block_size=32)
HEADER_BYTES = 104  # 96 + an 8-byte integer key (checked below): blocks off page bounds


def stages(monkeypatch, action=None) -> list[str]:
    """Record the native hook's stages; ``action(stage, path)`` runs at each."""
    seen: list[str] = []

    def hook(stage: str, path: str, n: int) -> None:
        seen.append(stage)
        if action is not None:
            action(stage, path)

    monkeypatch.setattr(files_mod, "_test_hook", hook)
    return seen


def warm(path: str) -> None:
    with open(path, "rb") as f:
        f.read()


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_small(path: str) -> None:
    """Put ``path`` in the page cache as buffered reads of it leave it after a drop: in
    folios smaller than huge ones."""
    drop_cache(path)
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 10):
            pass


def pmd_mapped(path: str) -> bool:
    """Whether the kernel maps the page cache of ``path``'s first 2 MiB as one PMD (smaps:
    FilePmdMapped), i.e. holds it in a huge folio: what a unit needs to be mapped."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        m[0]
        with open("/proc/self/smaps") as smaps:
            lines = smaps.read().split(os.path.basename(path), 1)[1].splitlines()
    return any(
        line.startswith("FilePmdMapped:") and int(line.split()[1]) > 0 for line in lines[:30]
    )


def warm_huge(path: str, *, check: bool = True) -> None:
    """Put ``path`` in the page cache in huge folios: dropped, then read through a mapping
    marked MADV_HUGEPAGE (the kernel reads ahead a PMD-sized folio per fault there). ``check``:
    skip the test when the kernel found no huge folio for it (memory too fragmented)."""
    drop_cache(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        m.madvise(mmap.MADV_HUGEPAGE)
        for offset in range(0, size, mmap.PAGESIZE):
            m[offset]
    if check and not pmd_mapped(path):
        pytest.skip("the page cache got no huge folio for the unit (memory fragmented?)")


def page_cache_maps_huge(directory: str) -> bool:
    """Whether a file in ``directory`` warmed by :func:`warm_huge` is held in huge folios."""
    fd, path = tempfile.mkstemp(dir=directory)
    try:
        os.write(fd, os.urandom(4 << 20))
        warm_huge(path, check=False)
        return pmd_mapped(path)
    finally:
        os.close(fd)
        os.unlink(path)


# cachestat (Linux 6.5) tells a unit the page cache holds whole; it is mapped only when the
# page cache holds it in huge folios (ext4 and XFS on Linux 6.16+, ...), mapped a PMD at a time.
MAPS = tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 5)
MAPS = MAPS and page_cache_maps_huge(tempfile.gettempdir())
NO_MAPS = "no unit is mapped here: no cachestat (Linux 6.5) or no huge folios in the page cache"


def libc():
    """libc through ctypes, for what Python does not wrap (mincore, mseal)."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.syscall.restype, lib.mmap.restype = ctypes.c_long, ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


def cached_pages(path: str) -> int:
    """Pages of ``path`` in the page cache: mincore over a mapping (which faults nothing in),
    through libc (Python has no mincore)."""
    lib = libc()
    size = os.path.getsize(path)
    vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
    fd = os.open(path, os.O_RDONLY)
    try:
        address = lib.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            assert lib.mincore(address, size, vec) == 0, ctypes.get_errno()
        finally:
            lib.munmap(address, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


def flip(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ 0x5A]), offset)
    finally:
        os.close(fd)


def in_another_process(code: str, *args: str) -> None:
    subprocess.run([sys.executable, "-c", code, *args], check=True, env=child_env(), timeout=60)


FLIP = "import os,sys; fd=os.open(sys.argv[1],os.O_RDWR); o=int(sys.argv[2]); "
FLIP += "os.pwrite(fd,bytes([os.pread(fd,1,o)[0]^0x5A]),o)"
TRUNCATE = "import os,sys; os.truncate(sys.argv[1], int(sys.argv[2]))"


def stored(tmp_path, ns=NS, **options) -> tuple[FileStore, str]:
    """A store of ``ns`` holding key 7 and its unit's path; reads buffered unless
    ``direct_reads`` or ``direct_io`` is given (the default store reads a unit not all cached
    O_DIRECT)."""
    options.setdefault("direct_reads", options.get("direct_io", False))
    store = FileStore(tmp_path, ns, fsync=False, **options)
    assert store.store(7, 0, row(ns, 7), 0).ok
    (path,) = unit_files(store)
    assert os.path.getsize(path) == HEADER_BYTES + ns.total_bytes
    return store, path


def is_a_miss(store: FileStore, first: int = 0, end: int = 64) -> bool:
    """The load is a miss (not ok, not an error) and the unit was quarantined."""
    dest = np.zeros(store.namespace.layer_bytes(first, end), np.uint8)
    job = store.load(7, first, end, dest)
    return job.status == "miss" and not unit_files(store) and store.metrics().quarantined == 1


# ---------------------------------------------------------------------- the paths load right


@pytest.mark.parametrize("shift", [0, 1, 3, 60], ids=lambda s: f"dest+{s}")
@pytest.mark.parametrize("layers", [(0, 64), (1, 63), (17, 18)], ids=lambda r: f"{r[0]}-{r[1]}")
@pytest.mark.parametrize(
    "path", ["mapped", "page cache", "small folios", "device", "O_DIRECT", "direct_reads"]
)
def test_loads_land_exactly_at_any_alignment(tmp_path, monkeypatch, path, layers, shift):
    """Whole or partial ranges, into destinations at any alignment (the streamed copy's
    head and tail): exactly the stored bytes, and nothing around them."""
    if path == "mapped" and not MAPS:
        pytest.skip(NO_MAPS)
    first, end = layers
    ns = BIG if path in ("mapped", "small folios") else NS
    store, unit = stored(
        tmp_path,
        ns,
        direct_io=path == "O_DIRECT",
        direct_reads=path in ("O_DIRECT", "direct_reads"),
    )
    with store:
        warmed = {"mapped": warm_huge, "page cache": warm, "small folios": warm_small}
        warmed.get(path, drop_cache)(unit)
        seen = stages(monkeypatch)
        backing = np.full(ns.layer_bytes(first, end) + 64, 0xEE, np.uint8)
        dest = backing[shift : shift + ns.layer_bytes(first, end)]
        assert store.load(7, first, end, dest).ok
        assert np.array_equal(dest, row(ns, 7, first, end))
        assert (backing[:shift] == 0xEE).all() and (backing[shift + dest.size :] == 0xEE).all()
        # All in the page cache in huge folios: one pass over a mapping of it. In small folios
        # (buffered reads), or smaller than a huge folio: pieces from there (those partly
        # wanted through the buffer: "read"). Else read.
        if path == "mapped":
            assert seen == ["map"]
        elif path in ("page cache", "small folios"):
            assert "map" not in seen and (seen == [] or layers != (0, 64))
        else:
            assert "read" in seen and "map" not in seen


@pytest.mark.parametrize("direct_reads", [True, False])
def test_a_cold_unit_is_read_o_direct_by_default_and_a_warm_one_from_the_page_cache(
    tmp_path, monkeypatch, direct_reads
):
    """By default (``direct_reads``, as vLLM's ``fs`` reads) a unit the page cache holds
    none of is read O_DIRECT, ahead of its hashing, and stays out of the page cache; one it
    holds is read from there. ``direct_reads=False``: through the page cache. Writes stay
    buffered either way; every load right."""
    options = {} if direct_reads else {"direct_reads": False}
    with FileStore(tmp_path, NS, fsync=False, **options) as store:
        assert store.direct_reads == direct_reads and not store.direct_io
        for key in (1, 2):
            assert store.store(key, 0, row(NS, key), 0).ok
        cold, hot = unit_files(store)
        drop_cache(cold)
        warm(hot)
        assert cached_pages(cold) == 0 and cached_pages(hot) > 0
        pages = cached_pages(hot)
        seen = stages(monkeypatch)
        dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(2)]
        assert store.loads([(k, 0, 64, d) for k, d in zip((1, 2), dests)]).ok
        assert all(np.array_equal(d, row(NS, k)) for k, d in zip((1, 2), dests))
        assert (cached_pages(cold) == 0) == direct_reads and cached_pages(hot) == pages
        assert ("prefetch" in seen) != direct_reads  # buffered: WILLNEED for the cold one


@pytest.mark.parametrize("state", ["cold", "warm", "direct_io"])
def test_a_batch_asks_for_its_later_units_ahead_of_their_reads(tmp_path, monkeypatch, state):
    """Buffered loads of units the page cache does not hold: the batch asks for the next
    16 MiB of units (WILLNEED) before it reads the first, and the rest as it goes, so the
    device reads them while earlier ones are hashed and copied; none for units all cached,
    none with direct_io (read O_DIRECT). Every unit loads right."""
    direct = state == "direct_io"
    store = FileStore(tmp_path, NS, fsync=False, direct_io=direct, direct_reads=direct)
    with store:
        for key in range(20):  # 1 MiB payloads: 16 fit the window
            assert store.store(key, 0, row(NS, key), 0).ok
        paths = unit_files(store)
        for path in paths:
            (warm if state == "warm" else drop_cache)(path)
        seen: list[tuple[str, str]] = []
        stages(monkeypatch, lambda stage, path: seen.append((stage, path)))
        dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(20)]
        job = store.loads([(key, 0, 64, dest) for key, dest in zip(range(20), dests)])
        assert job.ok and all(np.array_equal(d, row(NS, k)) for k, d in enumerate(dests))
        asked = [path for stage, path in seen if stage == "prefetch"]
        if state != "cold":
            assert asked == []
            return
        by_key = {key: store_path(store, key) for key in range(20)}
        assert sorted(by_key.values()) == sorted(paths)
        assert asked == [by_key[key] for key in range(1, 20)]  # each once, in batch order
        first_read = next(i for i, (stage, _) in enumerate(seen) if stage == "read")
        assert seen[:first_read] == [("prefetch", by_key[key]) for key in range(1, 17)]


def test_a_unit_with_holes_in_the_page_cache_loads_right(tmp_path, monkeypatch):
    """Pieces 0, 2 and 4 of a unit are in the page cache, 1 and 3 are not: the cached ones
    come from there, the others are read through the buffer (each alone, at its own piece:
    never the rest of the unit at once) or, when the unit's WILLNEED brought them in first,
    from the page cache too. Right bytes either way."""
    store, path = stored(tmp_path)
    piece = 256 << 10
    with store:
        drop_cache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead into the holes
            for k in (0, 2, 4):
                os.pread(fd, piece, k * piece)
        finally:
            os.close(fd)
        reads: list[int] = []
        monkeypatch.setattr(
            files_mod, "_test_hook", lambda stage, p, n: stage == "read" and reads.append(n)
        )
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(7, 0, 64, dest).ok and np.array_equal(dest, row(NS, 7))
        assert set(reads) <= {piece, 3 * piece} and len(reads) == len(set(reads))


def direct_units(tmp_path, count: int, **options) -> FileStore:
    """A direct_io store holding units 0..count-1, none of them in the page cache."""
    store = FileStore(tmp_path, NS, fsync=False, direct_io=True, **options)
    for key in range(count):
        assert store.store(key, 0, row(NS, key), 0).ok
    for path in unit_files(store):
        drop_cache(path)
    return store


@pytest.mark.parametrize("bounce", [None, 256 << 10, 12 << 10], ids=["4MiB", "256KiB", "12KiB"])
def test_direct_io_reads_the_next_units_while_one_is_hashed_and_copied(
    tmp_path, monkeypatch, bounce
):
    """A batch read O_DIRECT submits its pieces ahead, across units, into a ring of two
    bounces: a whole unit per read up to a bounce (so, by default, a unit's read is asked for
    before the unit ahead of it has reached its destination), even pieces of at most a bounce
    beyond, placed around the ring. Every unit loads right."""
    if bounce is not None:
        monkeypatch.setattr(files_mod, "_BOUNCE_BYTES", bounce)
        monkeypatch.setattr(files_mod, "_PIECE_BYTES", min(bounce, files_mod._PIECE_BYTES))
    with direct_units(tmp_path, 6) as store:
        dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(6)]
        by_path = {store_path(store, key): key for key in range(6)}
        reads: list[tuple[int, int, bool]] = []  # (key, position, unit before it delivered)

        def hook(stage: str, path: str, n: int) -> None:
            if stage == "read":
                key = by_path[os.path.join(store.directory, path)]
                reads.append((key, n, key > 0 and bool(dests[key - 1].any())))

        monkeypatch.setattr(files_mod, "_test_hook", hook)
        job = store.loads([(key, 0, 64, dest) for key, dest in enumerate(dests)])
        assert job.ok and all(np.array_equal(d, row(NS, k)) for k, d in enumerate(dests))
        total = HEADER_BYTES + NS.total_bytes
        parts = math.ceil(total / files_mod._BOUNCE_BYTES)  # even pieces of at most a bounce
        piece = math.ceil(math.ceil(total / parts) / 4096) * 4096
        per_unit = [(k, n) for k in range(6) for n in range(0, total, piece)]
        assert [(k, n) for k, n, _ in reads] == per_unit
        if bounce is None:  # all six (1 MiB each) fit the ring: asked for at once
            assert not any(delivered for _, _, delivered in reads)


@pytest.mark.parametrize("bounce", [None, 256 << 10], ids=["whole units", "256KiB pieces"])
def test_a_bad_unit_among_units_read_ahead_is_a_miss_and_the_rest_load(
    tmp_path, monkeypatch, bounce
):
    """Units read ahead O_DIRECT: a header flipped (found at its first piece, while later
    pieces are in flight: its own, in 256 KiB pieces), a payload byte flipped (found at its
    checksum), a unit gone, a unit truncated after it was opened: each a miss (the bad ones
    quarantined), every other unit of the batch loads right."""
    if bounce is not None:
        monkeypatch.setattr(files_mod, "_BOUNCE_BYTES", bounce)
    with direct_units(tmp_path, 7) as store:
        flip(store_path(store, 1), 7)
        flip(store_path(store, 3), HEADER_BYTES + NS.total_bytes - 10)
        os.unlink(store_path(store, 4))
        cut = store_path(store, 6)
        dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(7)]
        truncated = []

        def hook(stage: str, path: str, n: int) -> None:  # after unit 6 was opened, checked
            if os.path.join(store.directory, path) == cut and not truncated:
                truncated.append(n)
                os.truncate(cut, HEADER_BYTES + 5000)

        files_mod._test_hook, saved = hook, files_mod._test_hook
        try:
            job = store.loads([(key, 0, 64, dest) for key, dest in enumerate(dests)])
        finally:
            files_mod._test_hook = saved
        statuses = [o.status for o in job.value]
        assert statuses == ["ok", "miss", "ok", "miss", "miss", "ok", "miss"], job.detail
        for key in (0, 2, 5):
            assert np.array_equal(dests[key], row(NS, key))
        assert truncated == [0] and store.metrics().quarantined == 3


def test_units_from_the_page_cache_between_units_read_ahead_load_right(tmp_path, monkeypatch):
    """direct_io: units the page cache holds whole (0, 2, 5) are read from it, the others
    O_DIRECT ahead; the submissions stop at a cached unit and go on after it, in batch order
    (the ring never holds a read past a unit read another way). Every unit loads right."""
    with direct_units(tmp_path, 6) as store:
        for key in (0, 2, 5):
            warm(store_path(store, key))
        dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(6)]
        by_path = {store_path(store, key): key for key in range(6)}
        reads: list[tuple[int, list[bool]]] = []

        def hook(stage: str, path: str, n: int) -> None:
            if stage == "read":
                key = by_path[os.path.join(store.directory, path)]
                reads.append((key, [bool(d.any()) for d in dests]))

        monkeypatch.setattr(files_mod, "_test_hook", hook)
        job = store.loads([(key, 0, 64, dest) for key, dest in enumerate(dests)])
        assert job.ok and all(np.array_equal(d, row(NS, k)) for k, d in enumerate(dests))
        assert [key for key, _ in reads] == [1, 3, 4]
        delivered = dict(reads)
        assert delivered[1][:1] == [True]  # asked for after cached unit 0 landed
        assert delivered[3][:3] == [True, True, True]  # and 3 after 2, 4 along with 3
        assert delivered[4][:3] == [True, True, True] and not delivered[4][3]


def test_an_expired_batch_read_ahead_writes_nothing_and_the_pool_goes_on(tmp_path, monkeypatch):
    """O_DIRECT reads ahead: the job expires while unit 1's first read is being asked for
    (unit 0's pieces submitted, none consumed): nothing is written, every read it submitted
    is waited for before its buffer is given back, and the next loads are right."""
    with direct_units(tmp_path, 4, threads=1, deadline_s=0.3) as store:
        gate, entered = threading.Event(), threading.Event()
        unit1 = store_path(store, 1)

        def stuck(stage: str, path: str, n: int) -> None:
            if stage == "read" and os.path.join(store.directory, path) == unit1:
                entered.set()
                gate.wait(30)

        monkeypatch.setattr(files_mod, "_test_hook", stuck)
        dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(4)]
        job = store.submit_loads([(key, 0, 64, dest) for key, dest in enumerate(dests)])
        assert entered.wait(10)
        store.wait(job, timeout=10)
        assert job.status == "expired"
        monkeypatch.setattr(files_mod, "_test_hook", None)
        gate.set()
        time.sleep(0.3)  # the abandoned batch submits, finds its claim refused, drains
        assert not any(d.any() for d in dests)
        again = [np.zeros(NS.total_bytes, np.uint8) for _ in range(4)]
        assert store.wait(store.submit_loads([(k, 0, 64, d) for k, d in enumerate(again)]), 10).ok
        assert all(np.array_equal(d, row(NS, k)) for k, d in enumerate(again))


def loads_right_in_a_child(store: FileStore, count: int, before=None) -> bool:
    """Whether a forked child (after ``before()``) loads keys ``range(count)`` in one batch,
    every one right."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            if before is not None:
                before()
            dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(count)]
            job = store.loads([(k, 0, 64, d) for k, d in enumerate(dests)])
            right = all(np.array_equal(d, row(NS, k)) for k, d in enumerate(dests))
            code = 0 if job.ok and right else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def test_a_forked_child_reads_ahead_with_its_own_aio_context(tmp_path):
    """The reads ahead use a per-thread AIO context, which a forked child does not inherit:
    the child sets up its own and loads right."""
    with direct_units(tmp_path, 3) as store:
        dests = [np.zeros(NS.total_bytes, np.uint8) for _ in range(3)]
        assert store.loads([(k, 0, 64, d) for k, d in enumerate(dests)]).ok  # this thread's
        for path in unit_files(store):
            drop_cache(path)
        assert loads_right_in_a_child(store, 3)


@pytest.mark.parametrize("state", ["cold", "warm"])
def test_a_batch_short_of_descriptors_opens_its_units_at_their_turn(tmp_path, state):
    """A buffered batch keeps the units it asks for ahead open for their turn (one open per
    unit); in a process with few descriptors left, the units it cannot keep open ahead are
    opened at their turn and every unit loads right (none is an error)."""
    import resource

    store = FileStore(tmp_path, NS, fsync=False, direct_reads=False)
    with store:
        for key in range(12):
            assert store.store(key, 0, row(NS, key), 0).ok
        for path in unit_files(store):
            (warm if state == "warm" else drop_cache)(path)

        def three_descriptors_left() -> None:
            highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, hard))
            taken = []  # every descriptor but three: the unit at its turn (its key
            try:  # directory and itself) and one unit ahead
                while True:
                    taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            for fd in taken[-3:]:
                os.close(fd)

        assert loads_right_in_a_child(store, 12, three_descriptors_left)


def store_path(store: FileStore, key: int) -> str:
    """The file of ``key``'s unit of every layer."""
    kd = key_digest(key)
    return os.path.join(store.directory, kd[:2], kd, "0-64.ckv")


# ---------------------------------------------------------------------- a shortcut keeps the guarantee


@pytest.mark.parametrize("how", ["mapped", "pieces"])
@pytest.mark.parametrize("where", ["header", "first block", "mid", "last byte"])
def test_a_byte_flipped_on_disk_is_a_miss_from_the_page_cache(tmp_path, monkeypatch, where, how):
    if how == "mapped" and not MAPS:
        pytest.skip(NO_MAPS)
    ns = BIG if how == "mapped" else NS
    offset = {"header": 5, "first block": HEADER_BYTES, "mid": 300_000}.get(
        where, HEADER_BYTES + ns.total_bytes - 1
    )
    store, path = stored(tmp_path, ns)
    with store:
        flip(path, offset)
        (warm_huge if how == "mapped" else warm)(path)
        seen = stages(monkeypatch)
        # from the page cache: through a mapping of its huge folios, or in pieces
        assert is_a_miss(store) and seen == (["map"] if how == "mapped" else [])


@pytest.mark.parametrize("direct", ["buffered", "direct_reads", "direct_io"])
def test_a_byte_flipped_then_read_again_from_the_device_is_a_miss(tmp_path, monkeypatch, direct):
    """The unit's pages were dropped from the page cache (after a load from it) and read
    again, a byte flipped meanwhile: the device's bytes are verified too."""
    store, path = stored(
        tmp_path, direct_io=direct == "direct_io", direct_reads=direct != "buffered"
    )
    with store:
        assert store.load(7, 0, 64, np.zeros(NS.total_bytes, np.uint8)).ok  # warm, fine
        flip(path, HEADER_BYTES + 123_457)
        drop_cache(path)
        seen = stages(monkeypatch)
        assert is_a_miss(store, 2, 5) and "read" in seen and "map" not in seen


@pytest.mark.parametrize("offset", [5, HEADER_BYTES + 400_000])
def test_a_unit_rewritten_by_another_process_while_read_is_a_miss(tmp_path, monkeypatch, offset):
    """Another process flips a byte of the unit as this one starts reading it from the
    device (after its size and ownership were checked): a miss. (Not from the page cache
    first: the unit's WILLNEED may bring all of it in before the first piece is tried, and
    then no read would start from the device.)"""
    store, path = stored(tmp_path)
    monkeypatch.setattr(files_mod, "_NOWAIT", False)
    with store:
        drop_cache(path)
        flipped = []

        def rewrite(stage: str, p: str) -> None:
            if stage == "read" and not flipped:
                flipped.append(p)
                in_another_process(FLIP, p, str(offset))

        stages(monkeypatch, rewrite)
        assert is_a_miss(store) and flipped == [path]


@pytest.mark.skipif(not MAPS, reason=NO_MAPS)
def test_a_batch_maps_its_units_side_by_side_and_one_too_large_alone(tmp_path, monkeypatch):
    """A batch's units are mapped at 2 MiB boundaries into one reserved 64 MiB range: 20
    units of 2 MiB + a header (4 MiB each there) outgrow it, so it is let go and reserved again
    midway; a 64 MiB unit is larger than the range and is mapped on its own. Every unit is
    mapped (its huge folios) and loads the stored bytes, twice (nothing left mapped between)."""
    with FileStore(tmp_path / "many", BIG, fsync=False, direct_reads=False) as store:
        for key in range(20):
            assert store.store(key, 0, row(BIG, key), 0).ok
        for unit in unit_files(store):
            warm_huge(unit)
        seen = stages(monkeypatch)
        for _ in range(2):
            dests = [np.zeros(BIG.total_bytes, np.uint8) for _ in range(20)]
            assert store.loads([(k, 0, 64, d) for k, d in enumerate(dests)]).ok
            assert all(np.array_equal(d, row(BIG, k)) for k, d in enumerate(dests))
        assert seen == ["map"] * 40
    large = small_namespace(64, head_size=64, block_size=1024)  # 64 MiB
    with FileStore(tmp_path / "large", large, fsync=False, direct_reads=False) as store:
        assert store.store(3, 0, row(large, 3), 0).ok
        (unit,) = unit_files(store)
        warm_huge(unit)
        seen = stages(monkeypatch)
        dest = np.zeros(large.total_bytes, np.uint8)
        assert store.load(3, 0, 64, dest).ok and np.array_equal(dest, row(large, 3))
        assert seen == ["map"]


def seal(address: int, length: int) -> int:
    """mseal(2) (Linux 6.10; syscall 462 on x86-64 and the generic table): the range can no
    longer be unmapped or mapped over. 0, or the errno."""
    args = (ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_ulong(0))
    return 0 if libc().syscall(ctypes.c_long(462), *args) == 0 else ctypes.get_errno()


def can_seal() -> bool:
    """Whether mseal works here (on a page of its own, left sealed: it can never be unmapped)."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        return False
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    page = libc().mmap(None, mmap.PAGESIZE, 0, flags, -1, 0)  # PROT_NONE
    return page not in (None, ctypes.c_void_p(-1).value) and seal(page, mmap.PAGESIZE) == 0


def mapped_at(path: str) -> int:
    """Where this process maps ``path`` from its first byte (/proc/self/maps)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real and int(fields[2], 16) == 0:
                return int(fields[0].split("-")[0], 16)
    raise AssertionError(f"{path} is not mapped")


@pytest.mark.skipif(not MAPS, reason=NO_MAPS)
@pytest.mark.skipif(
    not can_seal(), reason="no mseal(2) here (Linux 6.10): no MAP_FIXED can be made to fail"
)
def test_a_failed_map_fixed_leaves_its_slot_and_the_batch_maps_alone(tmp_path, monkeypatch):
    """A batch's next slot is sealed while its first unit is mapped (mseal: a MAP_FIXED over it
    fails, as a kernel out of map entries would make it): that unit is read in pieces, the
    range around the slot is let go, the slot left as it is, the batch's later units are
    mapped alone; every unit loads its stored bytes, and the next batch maps in a new range."""
    with FileStore(tmp_path, BIG, fsync=False, direct_reads=False) as store:
        for key in range(4):
            assert store.store(key, 0, row(BIG, key), 0).ok
        for unit in unit_files(store):
            warm_huge(unit)
        slot = math.ceil(os.path.getsize(unit_files(store)[0]) / (2 << 20)) * (2 << 20)
        sealed: list[int] = []

        def seal_next_slot(stage: str, path: str) -> None:
            if stage == "map" and not sealed:
                sealed.append(seal(mapped_at(path) + slot, slot))

        seen = stages(monkeypatch, seal_next_slot)
        for _ in range(2):
            dests = [np.zeros(BIG.total_bytes, np.uint8) for _ in range(4)]
            assert store.loads([(k, 0, 64, d) for k, d in enumerate(dests)]).ok
            assert all(np.array_equal(d, row(BIG, k)) for k, d in enumerate(dests))
        assert sealed == [0]
        assert seen == ["map"] * 3 + ["map"] * 4  # the first batch, then the next


@pytest.mark.skipif(not MAPS, reason=NO_MAPS)
def test_an_expired_job_writes_nothing_through_the_mapping(tmp_path, monkeypatch):
    """The worker is stuck after mapping (a slow page walk): the deadline passes, the job
    expires, and the destination is never written, even when the worker goes on."""
    with FileStore(tmp_path, BIG, fsync=False, direct_reads=False, deadline_s=0.2) as store:
        assert store.store(7, 0, row(BIG, 7), 0).ok
        warm_huge(unit_files(store)[0])
        stages(monkeypatch, lambda stage, path: time.sleep(0.6) if stage == "map" else None)
        dest = np.zeros(BIG.total_bytes, np.uint8)
        job = store.pool.wait(store.submit_load(7, 0, 64, dest), timeout=10)
        assert job.status == "expired"
        time.sleep(0.8)  # the abandoned worker wakes up and finds its claim refused
        assert not dest.any()


def lease_breaking(path: str, timeout: float = 10.0) -> bool:
    """Whether a lease on ``path`` is being broken (a writer waits for it), within
    ``timeout`` seconds: /proc/locks names the file by device and inode."""
    st = os.stat(path)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/locks") as locks:
            if any("LEASE" in line and "BREAK" in line and ident in line for line in locks):
                return True
        time.sleep(0.01)
    return False


WRITERS = [(FLIP, 5), (FLIP, HEADER_BYTES + 4096), (FLIP, HEADER_BYTES + 400_000)]
WRITERS += [(TRUNCATE, 0), (TRUNCATE, HEADER_BYTES + 300_000)]


@pytest.mark.skipif(not MAPS, reason=NO_MAPS)
@pytest.mark.parametrize(("code", "arg"), WRITERS, ids=["flip"] * 3 + ["truncate"] * 2)
def test_a_writer_arriving_while_mapped_sends_the_unit_to_the_pieces(
    tmp_path, monkeypatch, code, arg
):
    """A unit is mapped under a read lease: another process that opens it to write (or
    truncates it) meanwhile waits, which breaks the lease; the blocks hashed and delivered
    from the mapping are then not trusted, the unit is read again in pieces (hashed as
    delivered, racing the writer), so the load is the stored bytes or a miss, never other
    bytes; once the writer is through, the unit is a miss."""
    store, path = stored(tmp_path, BIG)
    with store:
        warm_huge(path)
        writers: list[subprocess.Popen] = []

        def arrive(stage: str, p: str) -> None:
            if stage == "map":
                command = [sys.executable, "-c", code, p, str(arg)]
                writers.append(subprocess.Popen(command, env=child_env()))
                assert lease_breaking(p), "the writer did not wait for the lease"

        seen = stages(monkeypatch, arrive)
        dest = np.zeros(BIG.total_bytes, np.uint8)
        job = store.load(7, 0, 64, dest)
        assert seen[:2] == ["map", "lease broken"] and len(writers) == 1
        assert writers[0].wait(timeout=60) == 0
        assert job.status in ("ok", "miss"), job.detail
        if job.ok:  # read before the writer got through: the stored bytes, verified
            assert np.array_equal(dest, row(BIG, 7))
            assert is_a_miss(store)
        else:
            assert unit_files(store) == [] and store.metrics().quarantined == 1


@pytest.mark.skipif(not MAPS, reason=NO_MAPS)
def test_a_unit_open_for_writing_elsewhere_is_read_in_pieces_not_mapped(tmp_path, monkeypatch):
    """A read lease is refused while any open file may write the unit (a writer could change
    a block between its hash and its copy): the unit is read in pieces, hashed as delivered;
    once the writer has closed it, it is mapped again."""
    store, path = stored(tmp_path, BIG)
    with store:
        warm_huge(path)
        seen = stages(monkeypatch)
        dest = np.zeros(BIG.total_bytes, np.uint8)
        writer = os.open(path, os.O_RDWR)
        try:
            assert store.load(7, 0, 64, dest).ok and np.array_equal(dest, row(BIG, 7))
            assert "map" not in seen
        finally:
            os.close(writer)
        dest[:] = 0
        assert store.load(7, 0, 64, dest).ok and np.array_equal(dest, row(BIG, 7))
        assert seen == ["map"]


@pytest.mark.skipif(not MAPS, reason=NO_MAPS)
@pytest.mark.skipif(
    not os.access("/proc/sys/fs/lease-break-time", os.W_OK),
    reason="the kernel's lease-break-time is not writable here (root on the host: CI)",
)
@pytest.mark.parametrize("keep", [0, 100, HEADER_BYTES + 5000, HEADER_BYTES + 300_000])
def test_a_unit_truncated_past_its_broken_lease_is_a_miss(tmp_path, monkeypatch, keep):
    """A lease held past the kernel's lease-break-time (made 1 s here) is broken and the
    truncation goes through while the unit is mapped: pages past the new end fault (SIGBUS)
    inside the mapped read, the unit is a miss, the process lives on, and the next unit
    loads (through its mapping too)."""
    knob = "/proc/sys/fs/lease-break-time"
    with open(knob) as f:
        before = f.read()
    store, path = stored(tmp_path, BIG)
    try:
        with open(knob, "w") as f:
            f.write("1")
        with store:
            assert store.store(8, 0, row(BIG, 8), 0).ok
            for unit in unit_files(store):
                warm_huge(unit)
            cut = lambda stage, p: p == path and in_another_process(TRUNCATE, p, str(keep))  # noqa: E731
            seen = stages(monkeypatch, cut)
            dest = np.zeros(BIG.total_bytes, np.uint8)
            job = store.load(7, 0, 64, dest)
            assert job.status == "miss" and seen[0] == "map"
            # A cut inside the first page leaves it mapped, zeroed past the end: a bad header.
            assert ("SIGBUS" if keep >= 4096 or keep == 0 else "another key") in job.detail
            # Warmed again: the seconds the cut took may have cost the unit its huge folio
            # (memory pressure on a busy machine), and only a huge folio is mapped.
            (other,) = [unit for unit in unit_files(store) if unit != path]
            warm_huge(other)
            seen.clear()
            assert store.load(8, 0, 64, dest).ok and np.array_equal(dest, row(BIG, 8))
            assert seen == ["map"]
    finally:
        with open(knob, "w") as f:
            f.write(before)


# A process that has loaded through a mapping (so the SIGBUS handler is installed), then runs
# ``code``: it must die of SIGBUS after printing ``marker``, never print "survived".
HANDLER_INSTALLED = """
    import mmap, os, signal, sys, faulthandler
    import numpy as np
    faulthandler.disable()
    from helpers.store import row, small_namespace
    from canonical_ops.units import FileStore
    ns = small_namespace(64, head_size=64, block_size=32)  # larger than a huge folio
    with FileStore(sys.argv[1], ns, fsync=False, direct_reads=False) as store:
        assert store.store(1, 0, row(ns, 1), 0).ok
        assert store.load(1, 0, 64, np.zeros(ns.total_bytes, np.uint8)).ok  # installs it
"""


def assert_sigbus_ends_it(tmp_path, code: str, marker: str) -> None:
    script = textwrap.dedent(HANDLER_INSTALLED) + textwrap.dedent(code)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert proc.returncode == -signal.SIGBUS, proc.stderr
    assert marker in proc.stdout and "survived" not in proc.stdout


@pytest.mark.skipif(not MAPS, reason=NO_MAPS)
def test_a_sigbus_outside_a_mapped_read_still_ends_the_process(tmp_path):
    """The handler takes only faults inside the span a reader maps: any other SIGBUS ends
    the process as before (a bug elsewhere is never swallowed)."""
    code = """
        path = os.path.join(sys.argv[1], "victim")
        with open(path, "wb") as f:
            f.write(b"x" * 8192)
        fd = os.open(path, os.O_RDWR)
        m = mmap.mmap(fd, 8192)
        os.ftruncate(fd, 0)
        print("touching", flush=True)
        m[5000]
        print("survived", flush=True)
    """
    assert_sigbus_ends_it(tmp_path, code, "touching")


@pytest.mark.skipif(not MAPS, reason=NO_MAPS)
def test_a_sigbus_sent_to_the_process_still_ends_it(tmp_path):
    """A SIGBUS sent by kill (no fault to repeat) after the handler is installed ends the
    process as the default action would, instead of being swallowed."""
    code = """
        print("sending", flush=True)
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived", flush=True)
    """
    assert_sigbus_ends_it(tmp_path, code, "sending")


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
@pytest.mark.parametrize("keep", [0, 100, HEADER_BYTES + 5000, HEADER_BYTES + 300_000])
def test_a_unit_truncated_by_another_process_while_read_is_a_miss(
    tmp_path, monkeypatch, keep, direct
):
    """The unit shrinks between the size check and the read: a short read, a miss, and
    the next unit loads. (Every piece read through the buffer, as in the rewrite test: the
    unit's WILLNEED may bring all of it in before the first piece is tried, and then no
    device read, the stage that cuts it, would start: the load would rightly be ok.)"""
    store, path = stored(tmp_path, direct_io=direct)
    monkeypatch.setattr(files_mod, "_NOWAIT", False)
    with store:
        assert store.store(8, 0, row(NS, 8), 0).ok
        drop_cache(path)
        cut = lambda stage, p: p == path and in_another_process(TRUNCATE, p, str(keep))  # noqa: E731
        stages(monkeypatch, cut)
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(7, 0, 64, dest).status == "miss"
        assert store.load(8, 0, 64, dest).ok and np.array_equal(dest, row(NS, 8))


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
def test_loads_racing_a_truncating_process_load_right_or_miss(tmp_path, direct):
    """Another process truncates the unit and writes it back, over and over, while this one
    loads it (O_DIRECT: its pieces read ahead): every load is the stored bytes or a miss;
    nothing crashes."""
    expected = row(NS, 7)
    with FileStore(tmp_path, NS, fsync=False, direct_io=direct) as store:
        assert store.store(7, 0, expected, 0).ok
        (path,) = unit_files(store)
        with open(path, "rb") as f:
            original = f.read()
        copy = tmp_path / "original.bin"
        copy.write_bytes(original)
        racer = subprocess.Popen(
            [sys.executable, "-c", RACER, path, str(copy), "2.0"], env=child_env()
        )
        ok = missed = 0
        dest = np.zeros(NS.total_bytes, np.uint8)
        try:
            while racer.poll() is None:
                dest[:] = 0
                job = store.load(7, 0, 64, dest)
                if job.ok:
                    assert np.array_equal(dest, expected)
                    ok += 1
                else:
                    assert job.status == "miss", job.detail
                    missed += 1
                    if not unit_files(store):  # quarantined: put it back for the racer
                        store.store(7, 0, expected, 0)
        finally:
            racer.wait(timeout=30)
        assert racer.returncode == 0 and ok + missed > 20


RACER = """
import os, sys, time
path, original, seconds = sys.argv[1], open(sys.argv[2], "rb").read(), float(sys.argv[3])
end = time.monotonic() + seconds
while time.monotonic() < end:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        time.sleep(0.001)
        continue
    os.ftruncate(fd, len(original) // 3)
    time.sleep(0.0005)
    os.pwrite(fd, original, 0)
    os.close(fd)
    time.sleep(0.0005)
"""
