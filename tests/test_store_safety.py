"""The file store at its edges (issue 26): symlinks, FIFOs, other users, modes, the root.

Each case is a test that failed on the store before this one: a symlink planted where a
directory belongs is never followed (no write, read or delete through it), a FIFO never
blocks, another user's directory is never trusted, and what the store creates is private.
The tests run as root where they need another owner (chown); they skip otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import threading

import numpy as np
import pytest
from helpers.store import row, small_namespace, unit_files

from canonical_ops.units import FileStore, StoreRootError
from canonical_ops.units.cli import main as store_cli
from canonical_ops.units.files import key_digest

NS = small_namespace(8)
OTHER_UID = 54321
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files another owner")


def finishes(fn, timeout: float = 10.0):
    """``fn()``'s result, failing (not hanging) when it blocks: a FIFO opened for reading."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn} blocked"
    return out[0] if out else None


def populated(root, keys=range(3)) -> str:
    os.makedirs(root, exist_ok=True)
    with FileStore(root, NS, fsync=False) as store:
        for k in keys:
            assert store.store(k, 0, row(NS, k), k).ok
        return store.directory


def victim_dir(tmp_path) -> tuple[str, list[str]]:
    """A directory of someone else's files, old enough to look like stale temps."""
    target = tmp_path / "victim"
    target.mkdir()
    names = ["1-1-1-dead.tmp", "notes.txt", "0-8.ckv"]
    for name in names:
        (target / name).write_bytes(b"precious")
        os.utime(target / name, (1_000_000_000, 1_000_000_000))
    return str(target), names


# ---------------------------------------------------------------------- symlinks


def test_a_symlinked_tmp_dir_is_never_cleaned_through(tmp_path, capsys) -> None:
    root = tmp_path / "store"
    directory = populated(root)
    target, names = victim_dir(tmp_path)
    shutil.rmtree(os.path.join(directory, "tmp"))
    os.symlink(target, os.path.join(directory, "tmp"))
    with pytest.raises(StoreRootError, match="tmp: expected a directory"):
        FileStore(root, NS)  # refused at start-up: never cleaned, never written
    assert sorted(os.listdir(target)) == sorted(names)
    assert store_cli(["gc", str(root), "--capacity", "0"]) == 0
    assert sorted(os.listdir(target)) == sorted(names)
    capsys.readouterr()


def test_a_symlinked_shard_dir_is_never_written_into(tmp_path) -> None:
    root = tmp_path / "store"
    directory = populated(root, keys=[])
    os.makedirs(directory, exist_ok=True)
    target, names = victim_dir(tmp_path)
    kd = key_digest(7)
    os.symlink(target, os.path.join(directory, kd[:2]))
    with FileStore(root, NS, fsync=False) as store:
        job = store.store(7, 0, row(NS, 7), 0)
        assert job.status == "error" and "expected a directory" in job.detail
        assert store.lookup([7], 0, 8) == 0
        assert store.metrics().stores_failed == 1
    assert sorted(os.listdir(target)) == sorted(names)


def test_a_symlinked_key_dir_is_never_read_through(tmp_path) -> None:
    """A valid unit reachable only through a symlink is a miss, never a load."""
    root = tmp_path / "store"
    directory = populated(root, keys=[7])
    kd = key_digest(7)
    real = os.path.join(directory, kd[:2], kd)
    moved = tmp_path / "elsewhere"
    os.rename(real, moved)
    os.symlink(moved, real)
    with FileStore(root, NS, fsync=False) as store:
        assert store.lookup([7], 0, 8) == 0
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(7, 0, 8, dest).status == "miss" and not dest.any()
    assert os.listdir(moved) == ["0-8.ckv"]  # nothing removed through the link either


def test_a_symlinked_unit_file_is_a_miss(tmp_path) -> None:
    root = tmp_path / "store"
    directory = populated(root, keys=[7])
    (path,) = unit_files_of(directory)
    outside = tmp_path / "outside.ckv"
    os.rename(path, outside)
    os.symlink(outside, path)
    with FileStore(root, NS, fsync=False) as store:
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(7, 0, 8, dest).status == "miss" and not dest.any()
    assert outside.exists()


def test_a_symlinked_quarantine_dir_receives_nothing(tmp_path) -> None:
    root = tmp_path / "store"
    directory = populated(root, keys=[7])
    (path,) = unit_files_of(directory)
    flip_last_byte(path)
    target, names = victim_dir(tmp_path)
    shutil.rmtree(os.path.join(directory, "quarantine"), ignore_errors=True)
    os.symlink(target, os.path.join(directory, "quarantine"))
    with FileStore(root, NS, fsync=False) as store:
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(7, 0, 8, dest).status == "miss"
        assert store.metrics().corrupt_detected == 1
    assert sorted(os.listdir(target)) == sorted(names)


def flip_last_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))


def unit_files_of(directory: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(directory):
        if os.path.relpath(dirpath, directory).split(os.sep)[0] not in ("tmp", "quarantine"):
            out += [os.path.join(dirpath, n) for n in names if n.endswith(".ckv")]
    return sorted(out)


# ---------------------------------------------------------------------- FIFOs


def test_a_fifo_in_place_of_a_unit_never_blocks(tmp_path, capsys) -> None:
    root = tmp_path / "store"
    directory = populated(root, keys=[7])
    (path,) = unit_files_of(directory)
    os.unlink(path)
    os.mkfifo(path)
    store = finishes(lambda: FileStore(root, NS, fsync=False))  # start-up scan
    with store:
        assert finishes(lambda: store.lookup([7], 0, 8)) == 0
    with FileStore(root, NS, fsync=False) as store:
        os.mkfifo(path)  # the first was quarantined: plant another
        job = finishes(lambda: store.store(7, 0, row(NS, 7), 0))
        assert job.ok
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(7, 0, 8, dest).ok and np.array_equal(dest, row(NS, 7))
    assert stat.S_ISREG(os.lstat(path).st_mode)
    os.unlink(path)
    os.mkfifo(path)
    assert finishes(lambda: store_cli(["stats", str(root)])) == 0
    assert finishes(lambda: store_cli(["verify", str(root)])) == 1
    assert "not a regular file" in capsys.readouterr().out


def test_a_fifo_in_place_of_namespace_json_never_blocks(tmp_path, capsys) -> None:
    root = tmp_path / "store"
    directory = populated(root, keys=[7])
    description = os.path.join(directory, "namespace.json")
    os.unlink(description)
    os.mkfifo(description)
    with finishes(lambda: FileStore(root, NS, fsync=False)) as store:
        assert finishes(lambda: store.store(8, 0, row(NS, 8), 0)).ok
    with open(description) as f:  # replaced by the store's description
        assert json.load(f) == NS.describe()
    os.unlink(description)
    os.mkfifo(description)
    assert finishes(lambda: store_cli(["stats", str(root)])) == 0
    assert "unreadable namespace" in capsys.readouterr().out


# ---------------------------------------------------------------------- other users


@as_root
def test_another_users_namespace_dir_in_a_shared_root_is_refused(tmp_path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)  # like /tmp
    directory = populated(root, keys=[7])  # the "other user" wrote good units...
    for dirpath, dirs, files in os.walk(directory):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirs + files)]:
            os.lchown(name, OTHER_UID, OTHER_UID)  # ...and owns them
    with pytest.raises(StoreRootError, match=f"found uid {OTHER_UID}"):
        FileStore(root, NS)
    # The same directory appearing after start-up: misses and failed stores, never a load.
    os.rename(directory, tmp_path / "aside")
    with FileStore(root, NS, fsync=False) as store:
        os.rename(tmp_path / "aside", directory)
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.lookup([7], 0, 8) == 0
        assert store.load(7, 0, 8, dest).status == "miss" and not dest.any()
        assert store.store(9, 0, row(NS, 9), 0).status == "error"


@as_root
def test_directories_of_another_owner_or_writable_by_others_are_not_used(tmp_path) -> None:
    root = tmp_path / "store"
    directory = populated(root, keys=[7, 8])
    kd7, kd8 = key_digest(7), key_digest(8)
    os.chmod(os.path.join(directory, kd7[:2], kd7), 0o777)  # anyone could plant units there
    os.chown(os.path.join(directory, kd8[:2], kd8), OTHER_UID, -1)
    with FileStore(root, NS, fsync=False) as store:
        assert store.metrics().units_on_disk == 0  # neither indexed at start-up
        dest = np.zeros(NS.total_bytes, np.uint8)
        for key in (7, 8):
            assert store.load(key, 0, 8, dest).status == "miss"
        assert not dest.any()


def test_a_root_writable_by_others_must_be_sticky(tmp_path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(StoreRootError, match="not sticky"):
        FileStore(root, NS)
    os.chmod(root, 0o1777)
    FileStore(root, NS).close()


# ---------------------------------------------------------------------- modes, laziness


def modes(directory: str) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(directory):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirs + files)]:
            out[os.path.relpath(name, directory)] = stat.S_IMODE(os.lstat(name).st_mode)
    return out


@pytest.mark.parametrize(
    ("group_shared", "dmode", "fmode"), [(False, 0o700, 0o600), (True, 0o770, 0o660)]
)
def test_what_the_store_creates_is_private_or_group_shared(
    tmp_path, group_shared, dmode, fmode
) -> None:
    old = os.umask(0o022)
    try:
        shared = {"group_shared": True} if group_shared else {}
        with FileStore(tmp_path, NS, fsync=False, **shared) as store:
            assert store.store(7, 0, row(NS, 7), 0).ok
            bad = bytearray(row(NS, 8))
            assert store.store(8, 0, bad, 0).ok
            (victim,) = [p for p in unit_files(store) if key_digest(8) in p]
            flip_last_byte(victim)
            assert store.load(8, 0, 8, np.zeros(NS.total_bytes, np.uint8)).status == "miss"
            found = modes(store.directory)
    finally:
        os.umask(old)
    assert (
        found.pop(".") == dmode and found.pop("tmp") == dmode and found.pop("quarantine") == dmode
    )
    dirs = {k: v for k, v in found.items() if not k.endswith((".ckv", ".json"))}
    files = {k: v for k, v in found.items() if k not in dirs}
    assert set(dirs.values()) == {dmode} and len(dirs) >= 2
    assert set(files.values()) == {fmode} and "namespace.json" in files and len(files) == 3


def test_a_read_phase_leaves_no_namespace_dir(tmp_path, capsys) -> None:
    with FileStore(tmp_path, NS, fsync=False) as store:
        assert store.lookup([1, 2], 0, 8) == 0
        assert store.load(1, 0, 8, np.zeros(NS.total_bytes, np.uint8)).status == "miss"
        store.gc()
    assert os.listdir(tmp_path) == []
    assert store_cli(["stats", str(tmp_path)]) == 0
    assert "0 namespace(s)" in capsys.readouterr().out


def test_gc_dry_run_lists_and_removes_nothing(tmp_path, capsys) -> None:
    directory = populated(tmp_path, keys=range(4))
    before = unit_files_of(directory)
    assert store_cli(["gc", "--dry-run", "--json", str(tmp_path), "--capacity", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["dry_run"] and report["units_evicted"] == 4 and sorted(report["evicted"]) == before
    )
    assert unit_files_of(directory) == before
    assert store_cli(["gc", "--dry-run", str(tmp_path), "--capacity", "0"]) == 0
    out = capsys.readouterr().out
    assert "would evict 4 unit(s)" in out and all(p in out for p in before)
    assert unit_files_of(directory) == before


def test_a_missing_parent_never_means_the_working_directory(tmp_path, monkeypatch) -> None:
    """``dir_fd=None`` resolves against the cwd in every ``os`` call: the safe openers take a
    missing parent descriptor as a missing entry instead."""
    from canonical_ops.units.fsutil import Perms, open_dir, open_file

    (tmp_path / "kd").mkdir(mode=0o700)
    (tmp_path / "0-32.ckv").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert open_dir(None, "kd", Perms()) is None
    with pytest.raises(FileNotFoundError):
        open_file(None, "0-32.ckv")


@pytest.mark.parametrize("group_shared", [False, True])
def test_a_missing_root_and_its_parents_are_created_private(tmp_path, group_shared) -> None:
    """``--store /tmp/a/b/kv``: every directory the store makes is 0700 (0770 group-shared),
    whatever the umask, the parents too (``os.makedirs`` gives those 0777 - umask)."""
    old = os.umask(0o002)
    try:
        root = tmp_path / "a" / "b" / "kv"
        with FileStore(root, small_namespace(8), group_shared=group_shared):
            pass
    finally:
        os.umask(old)
    want = 0o770 if group_shared else 0o700
    for directory in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(directory.stat().st_mode) == want, directory


def test_making_the_root_never_chmods_through_a_swapped_parent(tmp_path, monkeypatch) -> None:
    """``--store /shared/a/b``, ``/shared`` writable by others: between our ``mkdir a/b`` and
    the chmod of what we made, another user swaps ``a`` for a symlink to a directory that has
    a ``b`` of its own. The chmod (0700 here, 0770 group-shared) goes to what we made only."""
    from canonical_ops.units import fsutil

    shared, victim = tmp_path / "shared", tmp_path / "victim"
    shared.mkdir()
    (victim / "b").mkdir(parents=True)
    os.chmod(victim / "b", 0o755)
    real_mkdir = os.mkdir

    def mkdir_then_swap(path, mode=0o777, *, dir_fd=None):
        real_mkdir(path, mode, dir_fd=dir_fd)
        if os.fspath(path).endswith("b"):  # the other user wins the race here
            os.rename(shared / "a", shared / "aside")
            os.symlink(victim, shared / "a")

    monkeypatch.setattr(fsutil.os, "mkdir", mkdir_then_swap)
    with contextlib.suppress(OSError):
        fsutil.make_dirs(str(shared / "a" / "b"), 0o700)
    assert stat.S_IMODE(os.stat(victim / "b").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(shared / "aside" / "b").st_mode) == 0o700


@pytest.mark.parametrize("how", ["symlink", "world-writable", pytest.param("other", marks=as_root)])
def test_the_cli_refuses_a_root_that_is_a_symlink_or_others_may_swap(tmp_path, capsys, how):
    """``store gc TARGET`` deletes: a TARGET that is a symlink (another user's, pointing at
    this user's store), another user's directory or one every user may write and not sticky
    is refused with one line (exit 2), as the store's own directories are; nothing removed."""
    root = tmp_path / "store"
    directory = populated(root)
    before = unit_files_of(directory)
    target = root
    if how == "symlink":
        target = tmp_path / "planted"
        os.symlink(root, target)
    elif how == "world-writable":
        os.chmod(root, 0o777)
    else:
        os.chown(root, OTHER_UID, OTHER_UID)
    for command in (["stats"], ["verify"], ["gc", "--capacity", "0"]):
        assert store_cli([*command, str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "store" in err, err
    assert unit_files_of(directory) == before
    if how == "world-writable":
        os.chmod(root, 0o1777)  # sticky, as /tmp: the store's rule
        assert store_cli(["gc", str(target), "--capacity", "0"]) == 0
        assert unit_files_of(directory) == []
    capsys.readouterr()


@as_root
def test_group_shared_never_trusts_a_directory_writable_by_a_group_not_ours(tmp_path, capsys):
    """group_shared: a directory of ours 0770 whose group is not one of ours (inherited from
    a setgid parent another user owns) is writable by strangers: refused, as theirs would be."""
    root = tmp_path / "store"
    with FileStore(root, NS, fsync=False, group_shared=True) as store:
        assert store.store(7, 0, row(NS, 7), 0).ok
        directory = store.directory
    foreign = 54321
    assert foreign not in {os.getegid(), *os.getgroups()}
    os.chown(directory, -1, foreign)
    os.chmod(directory, 0o770)
    with pytest.raises(StoreRootError, match=f"gid {foreign}"):
        FileStore(root, NS, group_shared=True)
    assert store_cli(["verify", "--group-shared", str(root)]) == 1
    assert "unsafe" in capsys.readouterr().out


@as_root
def test_group_shared_loads_nothing_through_a_key_directory_of_a_group_not_ours(tmp_path):
    """The native path too: a key directory of ours made 0770 with a stranger's group (whose
    members could plant a unit in it) is refused: a miss, nothing delivered, nothing stored."""
    root = tmp_path / "store"
    with FileStore(root, NS, fsync=False, group_shared=True) as store:
        assert store.store(7, 0, row(NS, 7), 0).ok
        directory = store.directory
    (path,) = unit_files_of(directory)
    os.chown(os.path.dirname(path), -1, 54321)
    os.chmod(os.path.dirname(path), 0o770)
    with FileStore(root, NS, fsync=False, group_shared=True) as store:
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(7, 0, 8, dest).status == "miss" and not dest.any()
        part = row(NS, 7)[: NS.layer_bytes(0, 4)]
        assert not store.store(7, 0, part, 0, end=4).ok  # the native store checks it too
        assert unit_files_of(directory) == [path]
        os.chown(os.path.dirname(path), -1, os.getegid())  # one of ours: trusted again
        assert store.load(7, 0, 8, dest).ok and np.array_equal(dest, row(NS, 7))
        assert store.store(7, 0, part, 0, end=4).ok


def test_a_namespace_json_planted_in_a_shared_root_does_not_stop_gc(tmp_path, capsys) -> None:
    """A root every user may write (sticky, as /tmp): anyone can put a ``namespace.json`` in
    it. ``store gc ROOT`` must still take it as a root (it holds namespace directories), not
    as one unsafe namespace directory with nothing to evict."""
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)
    directory = populated(root)
    (root / "namespace.json").write_text("{}")
    assert store_cli(["gc", str(root), "--capacity", "0"]) == 0
    assert unit_files_of(directory) == []
    capsys.readouterr()


@as_root
def test_making_the_root_refuses_a_directory_another_user_put_in_its_place(tmp_path, monkeypatch):
    from canonical_ops.units import fsutil

    real_mkdir = os.mkdir

    def mkdir_then_replace(path, mode=0o777, *, dir_fd=None):
        real_mkdir(path, mode, dir_fd=dir_fd)
        if os.path.basename(os.fspath(path)) == "a":  # the other user swaps ours for theirs
            os.rename(tmp_path / "a", tmp_path / "ours")
            real_mkdir(tmp_path / "a", 0o777)
            os.chown(tmp_path / "a", OTHER_UID, OTHER_UID)

    monkeypatch.setattr(fsutil.os, "mkdir", mkdir_then_replace)
    with pytest.raises(fsutil.UnsafePath, match="replaced while being made"):
        fsutil.make_dirs(str(tmp_path / "a" / "b"), 0o700)
    assert os.listdir(tmp_path / "a") == []  # nothing made in theirs
