"""SharedOffloadRegion: create/attach races, unlink-after-attach, stale files, views.

Multi-rank tests use real processes (multiprocessing "forkserver" with torch
preloaded, so each rank starts in milliseconds) and the real /dev/shm.
``canonical_ops.engine.region`` is pure Python: importing it never loads the
compiled extension (a test below checks that).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib
import os
import struct
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

_MODULE_NAME = "canonical_ops.engine.region"


def _load_module() -> Any:
    return importlib.import_module(_MODULE_NAME)


sr = _load_module()
SharedOffloadRegion = sr.SharedOffloadRegion
RegionSpaceError = sr.RegionSpaceError
RegionClosedError = sr.RegionClosedError

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
    """A region header as a creator would have written it; returns the fd (0600)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    raw = struct.pack(
        "<8sIIQQIIqQQI4x16s",
        sr.MAGIC,
        sr.FORMAT_VERSION,
        sr.HEADER_BYTES,
        num_rows,
        row_bytes,
        2,
        state,
        pid,
        0,
        0,
        1,
        b"\0" * 16,
    )
    os.pwrite(fd, raw.ljust(sr.HEADER_BYTES, b"\0"), 0)
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


def test_four_concurrent_ranks_one_creator(ctx: Any, ranks: list[Rank], engine: str) -> None:
    world = 4
    barrier = ctx.Barrier(world)
    for rank in range(world):
        ranks.append(Rank(ctx, _kwargs(engine, rank, world), barrier))
    creators = [r.attached() for r in ranks]
    assert creators.count(True) == 1, creators
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


def test_creator_sigkilled_before_all_attached_is_stale(
    ctx: Any, ranks: list[Rank], engine: str
) -> None:
    path = sr.region_path(engine, SHM)
    creator = Rank(ctx, _kwargs(engine, 0, 2))
    ranks.append(creator)
    assert creator.attached()
    creator.kill()
    assert os.path.exists(path)  # the crash case: never fully attached
    # A restarted run (even with another geometry) replaces the stale file.
    with _region(engine, 1, 2, num_rows=3) as region:
        assert region.is_creator
        assert region.tensor.shape == (3, 4096 + 24)
        assert os.path.exists(path)
    # Closed before rank 0 came: a closed marker is left for it.
    assert os.path.getsize(path) == sr.HEADER_BYTES
    assert SharedOffloadRegion.remove_closed_marker(engine)
    assert not os.path.exists(path)


def test_region_outlives_its_creator_while_a_rank_holds_it(
    ctx: Any, ranks: list[Rank], engine: str
) -> None:
    """The creator's close used to unlink the file: rank 2, arriving after the creator
    exited, became the creator of a new, empty region and rank 0's data was gone."""
    path = sr.region_path(engine, SHM)
    creator = Rank(ctx, _kwargs(engine, 0, 3))
    ranks.append(creator)
    assert creator.attached()
    assert creator.call("write", 1, 7, 42) == ("ok",)
    holder = Rank(ctx, _kwargs(engine, 1, 3))
    ranks.append(holder)
    assert not holder.attached()
    assert creator.call("close") == ("closed",)
    creator.stop()
    assert creator.proc.exitcode == 0 and os.path.exists(path)  # rank 1 holds it
    late = Rank(ctx, _kwargs(engine, 2, 3))
    ranks.append(late)
    assert not late.attached()  # the same region, not a new one
    assert late.call("read", 1, 7) == ("value", 42)
    assert not os.path.exists(path)  # all three attached: unlinked


def _refused(rank: Rank) -> str:
    msg = rank.reply()
    assert msg[:2] == ("error", "RegionClosedError"), msg
    return msg[2]


def test_late_rank_is_refused_once_every_attached_rank_closed(
    ctx: Any, ranks: list[Rank], engine: str
) -> None:
    """Writers closing before the reader attached used to leave it a new, empty region."""
    path = sr.region_path(engine, SHM)
    writers = []
    for rank in (0, 1):  # one after the other: rank 0 is the creator
        writers.append(Rank(ctx, _kwargs(engine, rank, 3)))
        ranks.append(writers[-1])
        assert writers[-1].attached() == (rank == 0)
    assert writers[0].call("write", 2, 2, 9) == ("ok",)
    for writer in writers:
        assert writer.call("close") == ("closed",)
        writer.stop()
    assert os.path.getsize(path) == sr.HEADER_BYTES  # data freed; the closed marker stays
    reader = Rank(ctx, _kwargs(engine, 2, 3))
    ranks.append(reader)
    message = _refused(reader)
    assert "closed before all 3 ranks attached: rank(s) [0, 1] attached" in message
    assert "data is gone" in message
    assert not os.path.exists(path)  # every rank attached or was told: nothing left


def test_late_rank_is_refused_when_the_last_holder_died_after_a_close(
    ctx: Any, ranks: list[Rank], engine: str
) -> None:
    path = sr.region_path(engine, SHM)
    creator = Rank(ctx, _kwargs(engine, 0, 3))
    ranks.append(creator)
    assert creator.attached()
    holder = Rank(ctx, _kwargs(engine, 1, 3))
    ranks.append(holder)
    assert not holder.attached()
    assert creator.call("close") == ("closed",)
    creator.stop()
    holder.kill()  # SIGKILL: it never closes
    assert os.path.getsize(path) > sr.HEADER_BYTES  # nobody left to replace it
    late = Rank(ctx, _kwargs(engine, 2, 3))
    ranks.append(late)
    assert "rank(s) [0, 1] attached" in _refused(late)
    assert not os.path.exists(path)


# ------------------------------------------------------------- in-process


def test_last_holder_close_leaves_a_marker_until_every_rank_is_told(engine: str) -> None:
    path = sr.region_path(engine, SHM)
    creator = _region(engine, 0, 3)
    attacher = _region(engine, 2, 3)
    assert creator.is_creator and not attacher.is_creator
    assert attacher.size_bytes == sr.HEADER_BYTES + 8 * (4096 + 24)
    assert os.path.getsize(path) == attacher.size_bytes
    attacher.close()
    assert attacher.closed and os.path.exists(path)  # creator holds it: rank 1 may still come
    creator.close()
    assert os.path.getsize(path) == sr.HEADER_BYTES  # the data is freed, a marker stays
    creator.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        _ = creator.tensor
    with pytest.raises(RegionClosedError, match=r"closed before all 3 ranks attached") as info:
        _region(engine, 2, 3)  # an attached rank coming back: told, not counted again
    assert info.value.attached_ranks == [0, 2] and os.path.exists(path)
    with pytest.raises(RegionClosedError, match=r"rank\(s\) \[0, 2\] attached") as info:
        _region(engine, 1, 3)
    assert info.value.path == path
    assert not os.path.exists(path)  # every rank attached or was told: nothing left


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


def test_stale_file_with_dead_pid_is_replaced(engine: str) -> None:
    path = sr.region_path(engine, SHM)
    fd = _write_header(path, pid=_dead_pid(), state=sr.STATE_READY, num_rows=2)
    os.close(fd)
    with _region(engine, 0, 2) as region:
        assert region.is_creator
        assert os.stat(path).st_size == region.size_bytes
    assert SharedOffloadRegion.remove_closed_marker(engine)  # rank 1 never came


def test_stale_invalid_header_is_replaced_after_grace(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = sr.region_path(engine, SHM)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, b"garbage")
    os.close(fd)
    monkeypatch.setattr(SharedOffloadRegion, "stale_grace_s", 0.2)
    time.sleep(0.3)
    with _region(engine, 0, 2, attach_timeout_s=5.0) as region:
        assert region.is_creator
    assert SharedOffloadRegion.remove_closed_marker(engine)


def test_never_ready_unlocked_file_is_replaced_after_grace(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = sr.region_path(engine, SHM)
    os.close(_write_header(path, pid=os.getpid(), state=sr.STATE_INIT))
    monkeypatch.setattr(SharedOffloadRegion, "stale_grace_s", 0.2)
    time.sleep(0.3)
    with _region(engine, 1, 2, attach_timeout_s=5.0) as region:
        assert region.is_creator
    assert SharedOffloadRegion.remove_closed_marker(engine)


def test_attach_timeout_while_creator_initialises(engine: str) -> None:
    path = sr.region_path(engine, SHM)
    fd = _write_header(path, pid=os.getpid(), state=sr.STATE_INIT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a live creator in the middle of its setup
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=path) as info:
            _region(engine, 1, 2, attach_timeout_s=0.3)
        assert info.value.errno == errno.ETIMEDOUT
        assert time.monotonic() - start < 5
        assert os.path.exists(path)  # a live creator's file is never removed
    finally:
        os.close(fd)
        os.unlink(path)


def test_attach_timeout_on_fresh_empty_file(engine: str) -> None:
    path = sr.region_path(engine, SHM)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        with pytest.raises(TimeoutError, match="become ready"):
            _region(engine, 0, 2, attach_timeout_s=0.2)
    finally:
        os.unlink(path)


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
    assert SharedOffloadRegion.remove_closed_marker(engine)


def test_duplicate_rank_rejected(engine: str) -> None:
    with _region(engine, 0, 3) as creator:
        with _region(engine, 1, 3), pytest.raises(ValueError, match="already attached"):
            _region(engine, 1, 3)
        assert os.path.exists(creator.path)
        assert not SharedOffloadRegion.remove_closed_marker(engine)  # a live region: kept
    assert SharedOffloadRegion.remove_closed_marker(engine)
    assert not SharedOffloadRegion.remove_closed_marker(engine)  # nothing left to remove


def test_refuses_symlink_and_shared_files(engine: str, tmp_path: Path) -> None:
    path = sr.region_path(engine, SHM)
    os.symlink(tmp_path / "target", path)
    try:
        with pytest.raises(PermissionError, match="symlink"):
            _region(engine, 0, 2)
        assert not (tmp_path / "target").exists()
    finally:
        os.unlink(path)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.fchmod(fd, 0o644)
    os.close(fd)
    try:
        with pytest.raises(PermissionError, match="not private"):
            _region(engine, 0, 2)
    finally:
        os.unlink(path)


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
    views = region.layer_views([16], 4)
    region.close()
    assert region.closed
    view[0] = 5  # the mapping lives on while views reference it
    assert int(view[0]) == 5
    del view, views


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


# -------------------------------------------------------------- layer views


def test_layer_views_default_offsets(engine: str) -> None:
    with _region(engine, 0, 1, num_rows=3, row_bytes=1024) as region:
        views = region.layer_views([64, 128, 32], pages_per_row=2)
        assert [tuple(v.shape) for v in views] == [(3, 2, 64), (3, 2, 128), (3, 2, 32)]
        assert [v.stride() for v in views] == [(1024, 64, 1), (1024, 128, 1), (1024, 32, 1)]
        base = region.tensor.data_ptr()
        assert [v.data_ptr() - base for v in views] == [0, 128, 384]
        for layer, view in enumerate(views):
            view[2, 1] = layer + 1
        row = region.tensor[2].numpy()
        assert (row[64:128] == 1).all() and (row[128 + 128 : 384] == 2).all()
        assert (row[384 + 32 : 448] == 3).all()
        assert (row[:64] == 0).all() and (row[448:] == 0).all()
        assert int(region.tensor[:2].sum()) == 0


def test_layer_views_custom_offsets(engine: str) -> None:
    with _region(engine, 0, 1, num_rows=2, row_bytes=1000) as region:
        views = region.layer_views([100, 50], 3, area_offsets=[600, 100])
        base = region.tensor.data_ptr()
        assert [v.data_ptr() - base for v in views] == [600, 100]
        views[0][1, 2, 99] = 7
        assert int(region.tensor[1, 600 + 2 * 100 + 99]) == 7
        np.testing.assert_array_equal(
            views[1].numpy(), region.tensor[:, 100:250].reshape(2, 3, 50).numpy()
        )
        # Same inputs give the same views.
        again = region.layer_views([100, 50], 3, area_offsets=[600, 100])
        assert [v.data_ptr() for v in again] == [v.data_ptr() for v in views]


def test_layer_views_refuse_bad_areas(engine: str) -> None:
    with _region(engine, 0, 1, num_rows=2, row_bytes=1000) as region:
        region.layer_views([500, 500], 1)  # exactly fills the row
        with pytest.raises(ValueError, match="overflows the row of 1000 bytes"):
            region.layer_views([500, 501], 1)
        with pytest.raises(ValueError, match="overflows"):
            region.layer_views([100], 2, area_offsets=[801])
        with pytest.raises(ValueError, match="overlaps"):
            region.layer_views([100, 100], 2, area_offsets=[0, 199])
        with pytest.raises(ValueError, match=">= 0"):
            region.layer_views([100], 1, area_offsets=[-1])
        with pytest.raises(ValueError, match="one per layer"):
            region.layer_views([100, 100], 1, area_offsets=[0])
        with pytest.raises(ValueError, match="pages_per_row"):
            region.layer_views([100], 0)
        with pytest.raises(ValueError, match="page_sizes"):
            region.layer_views([0], 1)
        with pytest.raises(ValueError, match="page_sizes"):
            region.layer_views([], 1)


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
    assert SharedOffloadRegion.remove_closed_marker(engine)  # rank 1 never came
    assert flags is not None, f"no mapping of {region.path} in /proc/self/smaps"
    assert "hg" in flags, flags
