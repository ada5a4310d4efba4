"""SharedOffloadRegion: rank 0 creates, the others attach; unlink-after-attach, stale files, views.

Multi-rank tests use real processes (multiprocessing "forkserver" with torch
preloaded, so each rank starts in milliseconds) and the real /dev/shm.
``canonical_ops.engine.region`` is pure Python: importing it never loads the
compiled extension (a test below checks that).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from canonical_ops.units.liveness import this_process

_MODULE_NAME = "canonical_ops.engine.region"


def _load_module() -> Any:
    return importlib.import_module(_MODULE_NAME)


sr = _load_module()
SharedOffloadRegion = sr.SharedOffloadRegion
RegionSpaceError = sr.RegionSpaceError

SHM = "/dev/shm"
REPLY_TIMEOUT_S = 60.0

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="needs /dev/shm")


# --------------------------------------------------------------------- helpers


def _worker(conn: Any, kwargs: dict[str, Any], barrier: Any = None) -> None:
    """One rank: build the region, then serve commands from the parent."""
    module = _load_module()
    try:
        if barrier is not None:
            barrier.wait(REPLY_TIMEOUT_S)
        region = module.SharedOffloadRegion(**kwargs)
    except Exception as exc:
        conn.send(("error", type(exc).__name__, str(exc)))
        return
    conn.send(("attached", region.is_creator, os.getpid()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "write":
            row, col, value = args
            region.tensor[row, col] = value
            conn.send(("ok",))
        elif cmd == "read":
            row, col = args
            conn.send(("value", int(region.tensor[row, col])))
        elif cmd == "close":
            region.close()
            conn.send(("closed",))
        elif cmd == "exit":
            return


class Rank:
    """A rank running :func:`_worker` in its own process."""

    def __init__(self, ctx: Any, kwargs: dict[str, Any], barrier: Any = None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, kwargs, barrier), daemon=True)
        self.proc.start()
        child.close()

    def reply(self) -> tuple[Any, ...]:
        assert self.conn.poll(REPLY_TIMEOUT_S), "rank did not answer in time"
        return self.conn.recv()

    def call(self, *cmd: Any) -> tuple[Any, ...]:
        self.conn.send(cmd)
        return self.reply()

    def attached(self) -> bool:
        """Wait for construction; return whether this rank is the creator."""
        msg = self.reply()
        assert msg[0] == "attached", msg
        return msg[1]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


@pytest.fixture
def ctx(forkserver) -> Any:
    return forkserver


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    started: list[Rank] = []
    yield started
    for rank in started:
        rank.stop()


@pytest.fixture
def engine() -> Iterator[str]:
    engine_id = f"test-{uuid.uuid4().hex}"
    yield engine_id
    path = sr.region_path(engine_id, SHM)
    leaked = os.path.lexists(path)
    if leaked:
        os.unlink(path)
    assert not leaked, f"test left {path} behind"


@pytest.fixture
def planted(engine: str) -> Iterator[str]:
    """The region path of ``engine``, for a file the test plants there; removed afterwards."""
    path = sr.region_path(engine, SHM)
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _kwargs(engine_id: str, rank: int, world_size: int, **extra: Any) -> dict[str, Any]:
    base = dict(
        engine_id=engine_id,
        num_rows=8,
        row_bytes=4096 + 24,
        world_size=world_size,
        rank=rank,
        pin=False,
        attach_timeout_s=30.0,
    )
    base.update(extra)
    return base


def _region(engine_id: str, rank: int, world_size: int, **extra: Any) -> Any:
    return SharedOffloadRegion(**_kwargs(engine_id, rank, world_size, **extra))


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _write_header(
    path: str, *, pid: int, state: int, num_rows: int = 8, row_bytes: int = 4096 + 24
) -> int:
    """A region header as a rank 0 process ``pid`` would have written it; returns the fd."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    creator = (this_process()[0], pid, 0)
    digest = hashlib.sha256(os.path.basename(path)[len(sr.FILE_PREFIX) :].encode()).digest()
    header = sr._Header(num_rows, row_bytes, 2, creator, digest[:16], bytearray([1, 0]), state)
    header.write(fd)
    os.ftruncate(fd, sr.HEADER_BYTES + num_rows * row_bytes)
    return fd


# ------------------------------------------------------------ multi-process


def test_two_processes_see_each_others_writes(ctx: Any, ranks: list[Rank], engine: str) -> None:
    path = sr.region_path(engine, SHM)
    first = Rank(ctx, _kwargs(engine, 0, 2))
    ranks.append(first)
    assert first.attached() is True
    assert os.stat(path).st_mode & 0o777 == 0o600, "region file must be private (0600)"
    second = Rank(ctx, _kwargs(engine, 1, 2))
    ranks.append(second)
    assert second.attached() is False
    assert not os.path.exists(path), "file must be unlinked once every rank attached"

    assert first.call("write", 3, 4100, 201) == ("ok",)
    assert second.call("read", 3, 4100) == ("value", 201)
    assert second.call("write", 7, 0, 77) == ("ok",)
    assert first.call("read", 7, 0) == ("value", 77)
    assert first.call("read", 0, 0) == ("value", 0)  # fresh region is zeroed
    assert second.call("close") == ("closed",)
    assert first.call("read", 7, 0) == ("value", 77)  # others keep the memory
    assert first.call("close") == ("closed",)


def test_ranks_started_before_rank_0_wait_for_it(ctx: Any, ranks: list[Rank], engine: str) -> None:
    world = 4
    for rank in (3, 1, 2):
        ranks.append(Rank(ctx, _kwargs(engine, rank, world)))
    time.sleep(0.3)  # they poll for a file that is not there yet
    ranks.append(Rank(ctx, _kwargs(engine, 0, world)))
    assert [r.attached() for r in ranks] == [False, False, False, True]
    assert not os.path.exists(sr.region_path(engine, SHM))
    for i, r in enumerate(ranks):
        assert r.call("write", i, i, 10 + i) == ("ok",)
    for r in ranks:
        for i in range(world):
            assert r.call("read", i, i) == ("value", 10 + i)


def test_rank_sigkilled_after_attach(ctx: Any, ranks: list[Rank], engine: str) -> None:
    path = sr.region_path(engine, SHM)
    creator = Rank(ctx, _kwargs(engine, 0, 3))
    ranks.append(creator)
    assert creator.attached()
    doomed = Rank(ctx, _kwargs(engine, 1, 3))
    ranks.append(doomed)
    assert not doomed.attached()
    assert doomed.call("write", 5, 5, 55) == ("ok",)
    doomed.kill()
    assert os.path.exists(path)  # rank 2 has not attached yet
    last = Rank(ctx, _kwargs(engine, 2, 3))
    ranks.append(last)
    assert not last.attached()
    assert not os.path.exists(path), "a killed rank still counts: the last attacher unlinks"
    assert last.call("read", 5, 5) == ("value", 55)


def test_writers_leave_before_the_readers_come_while_rank_0_holds_it(
    ctx: Any, ranks: list[Rank], engine: str
) -> None:
    """The demo's pattern: rank 0 (the coordinator) holds the region, writer ranks attach,
    write and exit, reader ranks attach later and find the data."""
    path = sr.region_path(engine, SHM)
    with _region(engine, 0, 4) as coordinator:
        for rank in (1, 2):
            writer = Rank(ctx, _kwargs(engine, rank, 4))
            ranks.append(writer)
            assert writer.attached() is False
            assert writer.call("write", rank, 9, rank) == ("ok",)
            assert writer.call("close") == ("closed",)
            writer.stop()
        assert os.path.exists(path)  # rank 3 still to come
        reader = Rank(ctx, _kwargs(engine, 3, 4))
        ranks.append(reader)
        assert reader.attached() is False
        assert [reader.call("read", row, 9) for row in (1, 2)] == [("value", 1), ("value", 2)]
        assert not os.path.exists(path)
        assert int(coordinator.tensor[2, 9]) == 2


def test_rank_0_sigkilled_before_all_attached_is_a_crashed_run(
    ctx: Any, ranks: list[Rank], engine: str
) -> None:
    path = sr.region_path(engine, SHM)
    creator = Rank(ctx, _kwargs(engine, 0, 2))
    ranks.append(creator)
    assert creator.attached()
    assert creator.call("write", 1, 1, 7) == ("ok",)
    creator.kill()
    assert os.path.exists(path)  # the crash case: never fully attached
    with pytest.raises(TimeoutError, match="crashed run"):
        _region(engine, 1, 2, attach_timeout_s=0.2)  # never the dead run's data
    # A restarted rank 0 (even with another geometry) replaces the file at once.
    with _region(engine, 0, 2, num_rows=3) as region:
        assert region.is_creator and int(region.tensor[1, 1]) == 0
        assert region.tensor.shape == (3, 4096 + 24)
        with _region(engine, 1, 2, num_rows=3):
            assert not os.path.exists(path)
    assert not os.path.exists(path)


# ------------------------------------------------------------- in-process


def test_rank_0_close_unlinks_and_a_late_rank_times_out(engine: str) -> None:
    """Never a new, empty region for a rank that comes after rank 0 left: it waits for rank
    0's file and times out naming that."""
    path = sr.region_path(engine, SHM)
    creator = _region(engine, 0, 3)
    attacher = _region(engine, 2, 3)
    assert creator.is_creator and not attacher.is_creator
    assert attacher.size_bytes == sr.HEADER_BYTES + 8 * (4096 + 24)
    assert os.path.getsize(path) == attacher.size_bytes
    attacher.close()
    assert attacher.closed and os.path.exists(path)  # rank 0 holds it: rank 1 may still come
    creator.close()
    creator.close()  # idempotent
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match="closed"):
        _ = creator.tensor
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0 has not created it yet \(or already closed"):
        _region(engine, 1, 3, attach_timeout_s=0.2)
    assert time.monotonic() - start < 5
    assert not os.path.exists(path)


def test_attacher_can_rejoin_after_close(engine: str) -> None:
    with _region(engine, 0, 3) as creator:
        _region(engine, 1, 3).close()
        with _region(engine, 1, 3) as again:
            assert not again.is_creator
            assert os.path.exists(creator.path)  # rank 2 still missing
            with _region(engine, 2, 3):
                assert not os.path.exists(creator.path)


def test_world_size_one_unlinks_at_once(engine: str) -> None:
    with _region(engine, 0, 1) as region:
        assert region.is_creator
        assert not os.path.exists(region.path)
        region.tensor[1, 2] = 3
        assert int(region.tensor[1, 2]) == 3


@pytest.mark.parametrize("state", [sr.STATE_READY, sr.STATE_INIT])
def test_file_of_a_dead_rank_0_is_replaced(engine: str, state: int) -> None:
    path = sr.region_path(engine, SHM)
    os.close(_write_header(path, pid=_dead_pid(), state=state, num_rows=2))
    with _region(engine, 0, 2) as region:
        assert region.is_creator
        assert os.stat(path).st_size == region.size_bytes
    assert not os.path.exists(path)


def test_headerless_file_nobody_holds_is_replaced(engine: str) -> None:
    path = sr.region_path(engine, SHM)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, b"garbage")
    os.close(fd)
    with _region(engine, 0, 2, attach_timeout_s=5.0) as region:
        assert region.is_creator and os.path.getsize(path) == region.size_bytes


def test_engine_id_of_a_live_rank_0_is_refused(engine: str, planted: str) -> None:
    with _region(engine, 0, 2) as first:
        with pytest.raises(FileExistsError, match=f"engine_id '{engine}' is in use"):
            _region(engine, 0, 2)
        assert int(first.tensor.sum()) == 0 and os.path.exists(first.path)
    os.close(_write_header(planted, pid=os.getpid(), state=sr.STATE_INIT))  # this process
    with pytest.raises(FileExistsError, match="in use"):
        _region(engine, 0, 2, attach_timeout_s=1.0)


def test_attach_timeout_while_rank_0_initialises(engine: str, planted: str) -> None:
    fd = _write_header(planted, pid=os.getpid(), state=sr.STATE_INIT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live rank 0 in the middle of its setup
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="still setting it up") as info:
            _region(engine, 1, 2, attach_timeout_s=0.3)
        assert info.value.errno == errno.ETIMEDOUT and info.value.filename == planted
        assert time.monotonic() - start < 5
        assert os.path.exists(planted)  # a live creator's file is never removed
    finally:
        os.close(fd)


def test_attach_timeout_on_fresh_empty_file(engine: str, planted: str) -> None:
    os.close(os.open(planted, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    with pytest.raises(TimeoutError, match="become ready"):
        _region(engine, 1, 2, attach_timeout_s=0.2)


def test_too_small_shm_injected_free_bytes(engine: str) -> None:
    path = sr.region_path(engine, SHM)
    with pytest.raises(RegionSpaceError) as info:
        _region(engine, 0, 2, free_bytes=10_000)
    err = info.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    message = str(err)
    assert str(sr.HEADER_BYTES + 8 * (4096 + 24)) in message and "10000" in message
    assert "too small" in message and "--shm-size" in message
    assert not os.path.exists(path), "nothing may stay allocated"


def test_too_small_shm_statvfs(engine: str) -> None:
    vfs = os.statvfs(SHM)
    rows = vfs.f_bavail * vfs.f_frsize // 4096 + 16
    with pytest.raises(RegionSpaceError, match="too small"):
        _region(engine, 0, 2, num_rows=rows, row_bytes=4096)
    assert not os.path.exists(sr.region_path(engine, SHM))


def test_geometry_mismatch_on_attach(engine: str) -> None:
    with _region(engine, 0, 2) as creator:
        with pytest.raises(ValueError, match="num_rows=8 \\(this rank expects 9\\)"):
            _region(engine, 1, 2, num_rows=9)
        with pytest.raises(ValueError, match="world_size=2"):
            _region(engine, 1, 3)
        assert os.path.exists(creator.path)  # the live region is left alone


# ------------------------------------------------------------ hostile paths (issue 26)


def _in_thread(fn: Any) -> BaseException | None:
    """Run ``fn`` in a thread: the error it raised, after checking it did not block."""
    out: list[BaseException | None] = [None]

    def body() -> None:
        try:
            fn()
        except BaseException as error:
            out[0] = error

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "blocked on the planted path"
    return out[0]


def test_refuses_symlink_fifo_and_shared_files(engine: str, planted: str, tmp_path: Path) -> None:
    os.symlink(tmp_path / "target", planted)
    for rank in (0, 1):
        with pytest.raises(PermissionError, match="symlink"):
            _region(engine, rank, 2)
    assert not (tmp_path / "target").exists()
    os.unlink(planted)
    os.mkfifo(planted, 0o600)
    for rank in (0, 1):
        error = _in_thread(lambda rank=rank: _region(engine, rank, 2, attach_timeout_s=1))
        assert isinstance(error, PermissionError) and "not a regular file" in str(error)
    os.unlink(planted)
    os.close(os.open(planted, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    os.chmod(planted, 0o644)
    with pytest.raises(PermissionError, match="not private"):
        _region(engine, 1, 2)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root")
def test_a_file_planted_by_another_user_is_refused(engine: str, planted: str) -> None:
    """Even a perfect-looking region (right header, 0600) is never mapped, nor removed."""
    os.close(_write_header(planted, pid=_dead_pid(), state=sr.STATE_READY))
    os.chown(planted, 4242, 4242)
    for rank in (0, 1):
        with pytest.raises(PermissionError, match="uid 4242"):
            _region(engine, rank, 2)
    assert os.stat(planted).st_uid == 4242


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another user needs root")
def test_shm_dir_another_user_may_write_is_refused(engine: str, tmp_path: Path) -> None:
    """A directory of another user, or one every user may write without the sticky bit, lets
    others swap the region file: refused before anything is created in it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(PermissionError, match="shm_dir: expected a directory of this user"):
        _region(engine, 0, 1, shm_dir=str(shared))
    os.chmod(shared, 0o1777)  # sticky, as /dev/shm: fine
    with _region(engine, 0, 1, shm_dir=str(shared)) as region:
        assert region.tensor.shape == (8, 4096 + 24)
    os.chmod(shared, 0o700)
    os.chown(shared, 4242, 4242)
    with pytest.raises(PermissionError, match="uid 4242"):
        _region(engine, 0, 1, shm_dir=str(shared))
    assert list(shared.iterdir()) == []


def test_prefault_fallback_without_populate_write(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sr, "MADV_POPULATE_WRITE", 0x7FFF)  # unknown advice: EINVAL
    with _region(engine, 0, 2) as creator, _region(engine, 1, 2) as attacher:
        creator.tensor[6, 4097] = 9
        assert int(attacher.tensor[6, 4097]) == 9
        assert int(attacher.tensor.sum()) == 9


def test_close_with_live_views_does_not_raise(engine: str) -> None:
    region = _region(engine, 0, 1)
    view = region.tensor[2]
    region.close()
    assert region.closed
    view[0] = 5  # the mapping lives on while views reference it
    assert int(view[0]) == 5
    del view


def test_tensor_geometry(engine: str) -> None:
    with _region(engine, 0, 1, num_rows=5, row_bytes=1000) as region:
        t = region.tensor
        assert t.dtype == torch.uint8 and t.shape == (5, 1000) and t.stride() == (1000, 1)
        assert t.data_ptr() % 4096 == 0, "data area must be page-aligned"
        assert region.size_bytes == 4096 + 5000 and not region.pinned


def test_region_path_sanitised() -> None:
    assert sr.region_path("eng-1.a_b", "/x") == "/x/canonical-kv-eng-1.a_b"
    odd = os.path.basename(sr.region_path("a/b c:../", "/x"))
    assert odd.startswith("canonical-kv-a_b_c_.._-")
    assert all(c.isalnum() or c in "._-" for c in odd)
    assert sr.region_path("a/b", "/x") != sr.region_path("a_b", "/x")
    assert len(os.path.basename(sr.region_path("e" * 1000, "/x"))) < 255
    with pytest.raises(ValueError):
        sr.region_path("", "/x")


def test_invalid_arguments(engine: str) -> None:
    for bad in (
        dict(num_rows=0),
        dict(row_bytes=-1),
        dict(rank=2),
        dict(rank=-1),
        dict(world_size=0),
        dict(attach_timeout_s=-1.0),
        dict(free_bytes=-5),
    ):
        kwargs = _kwargs(engine, 0, 2)
        kwargs.update(bad)
        with pytest.raises(ValueError):
            SharedOffloadRegion(**kwargs)
    assert not os.path.exists(sr.region_path(engine, SHM))


# -------------------------------------------------------------------- pinning


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pin_true_without_cuda_is_an_error(engine: str) -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        _region(engine, 0, 1, pin=True)
    assert not os.path.exists(sr.region_path(engine, SHM))
    with _region(engine, 0, 1, pin=None) as region:
        assert not region.pinned


@pytest.mark.cuda
def test_pinned_region(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cuda.bindings import runtime as cudart

    monkeypatch.setattr(sr, "PIN_CHUNK_BYTES", 1 << 20)  # several chunks
    rows, row_bytes = 5, (1 << 20) - 4096 + 123  # data not a multiple of a page
    with _region(engine, 0, 2, pin=True, num_rows=rows, row_bytes=row_bytes) as creator:
        with _region(engine, 1, 2, pin=True, num_rows=rows, row_bytes=row_bytes) as attacher:
            assert creator.pinned and attacher.pinned
            err, _ = cudart.cudaHostGetFlags(attacher.tensor.data_ptr())
            assert err == cudart.cudaError_t.cudaSuccess
            creator.tensor.copy_(
                torch.arange(rows * row_bytes, dtype=torch.int64)
                .remainder(251)
                .to(torch.uint8)
                .view(rows, row_bytes)
            )
            device = attacher.tensor.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(device.cpu(), creator.tensor)
            ptr = attacher.tensor.data_ptr()
        err, _ = cudart.cudaHostGetFlags(ptr)
        assert err != cudart.cudaError_t.cudaSuccess, "close() must unregister"


def _vm_flags_of_mapping(path: str) -> list[str] | None:
    """The VmFlags of this process's mapping of ``path`` (/proc/self/smaps), or None."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
                inside = len(fields) >= 6 and fields[5] == path
            elif inside and line.startswith("VmFlags:"):
                return fields[1:]
    return None


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage"), reason="kernel without THP"
)
def test_region_mapping_asks_for_huge_pages(engine: str) -> None:
    """The mapping is madvise(MADV_HUGEPAGE)'d ("hg"): sparse TP transfers walk fewer pages
    where shmem huge pages are allowed (whether they are is the system's setting)."""
    with _region(engine, 0, 2) as region:
        flags = _vm_flags_of_mapping(region.path)
    assert flags is not None, f"no mapping of {region.path} in /proc/self/smaps"
    assert "hg" in flags, flags
