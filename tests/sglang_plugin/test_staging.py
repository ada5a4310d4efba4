"""The staging directory and the fp8 namespaces of the SGLang backend, as a hostile local user
or a careless operator would try them (issue 26).

Each case failed on the fragment-file staging this replaced (a predictable, unchecked path in
/dev/shm; plain ``open``/``mkdir``/``rmtree`` that followed symlinks and blocked on FIFOs;
bare ``"fp8"`` accepted). The tests find the staging's directories and files by walking
it after a first store, not by knowing its layout, so they hold any layout to the same bar.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from sglang_harness import (
    MODEL,
    TOKENS,
    Model,
    check_pages,
    group,
    make_backend,
    make_pool,
    sglang_keys,
    unit_files,
    write,
)

import canonical_ops.sglang.staging as staging_module
from canonical_ops.sglang import BackendSetupError

OTHER_UID = 65534  # "nobody": another local user
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another user")


def give_away(path: Path) -> None:
    """Make ``path`` (and all below it) another user's, as if that user had created it."""
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.chown(os.path.join(root, name), OTHER_UID, OTHER_UID, follow_symlinks=False)
            if name in dirs:
                os.chmod(os.path.join(root, name), 0o777)
    os.chown(path, OTHER_UID, OTHER_UID)
    os.chmod(path, 0o777)


def tree(path: Path) -> list[tuple[str, int, int, int]]:
    """Every entry below ``path`` (not following symlinks): name, inode, size, mtime."""
    out = []
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            full = os.path.join(root, name)
            st = os.lstat(full)
            out.append((os.path.relpath(full, path), st.st_ino, st.st_size, st.st_mtime_ns))
    return sorted(out)


def staged_dirs(staging: Path, level: str) -> list[Path]:
    """Directories of the staging holding this rank's shares: each share file's own directory
    (``"leaf"``) or its top directory below the namespace directory (``"top"``)."""
    found = set()
    for root, _, files in os.walk(staging):
        parts = Path(root).relative_to(staging).parts
        if len(parts) >= 2 and files:
            found.add(Path(root) if level == "leaf" else staging.joinpath(*parts[:2]))
    return sorted(found)


def rank0_shares(extra: dict) -> list[tuple[object, object]]:
    """Rank 0 of a TP=2 group stores its shares of three pages (the units stay incomplete)."""
    ranks = group(MODEL, 2, "page_first", extra)
    keys = sglang_keys()
    assert write(MODEL, ranks[:1], 2, keys) == [[True] * 3]
    return ranks


# ------------------------------------------------------------------ the staging base


@pytest.mark.parametrize("how", ["another user's", "group-writable", "sticky 1777", "symlink"])
def test_a_staging_dir_others_can_write_is_refused(tmp_path, extra, how):
    staging = Path(extra["staging_dir"])
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        staging.symlink_to(tmp_path / "elsewhere")
    else:
        staging.mkdir(mode=0o700)
    if how == "another user's":
        if os.geteuid() != 0:
            pytest.skip("needs root to chown to another user")
        os.chown(staging, OTHER_UID, OTHER_UID)
    elif how != "symlink":
        os.chmod(staging, {"group-writable": 0o770, "sticky 1777": 0o1777}[how])
    pool = make_pool(MODEL, 2, 0, "page_first")
    with pytest.raises(BackendSetupError, match="staging_dir"):
        make_backend(pool, 2, 0, extra, model_name=MODEL.name)


@as_root
def test_default_staging_dir_is_private_and_checked(tmp_path, extra, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    os.chmod(shm, 0o1777)  # like /dev/shm
    monkeypatch.setattr(staging_module, "SHM_DIR", str(shm), raising=False)
    private = {k: v for k, v in extra.items() if k != "staging_dir"}
    ranks = group(MODEL, 2, "page_first", private)
    keys = sglang_keys()
    assert write(MODEL, ranks, 2, keys) == [[True] * 3] * 2
    (base,) = shm.iterdir()
    assert base.name == f"canonical-kv-{os.geteuid()}"
    assert base.stat().st_mode & 0o777 == 0o700 and base.stat().st_uid == os.geteuid()
    # Another user who made that path first (before this user's first run) gets refused.
    shutil.rmtree(base)
    base.mkdir()
    give_away(base)
    pool = make_pool(MODEL, 2, 0, "page_first")
    with pytest.raises(BackendSetupError, match=f"staging_dir.*uid {OTHER_UID}"):
        make_backend(pool, 2, 0, private, model_name=MODEL.name)


@as_root
def test_a_share_planted_by_another_user_is_never_assembled(tmp_path, extra, store_dir):
    """Another user made the staging directory first and ran rank 1 with other bytes there:
    rank 0 must not assemble and publish that share as its unit."""
    attacker = Model(seed=99)  # the same geometry, other bytes
    (tmp_path / "theirs").mkdir()
    theirs = {**extra, "store": str(tmp_path / "theirs")}
    planted = group(attacker, 2, "page_first", theirs, ranks=[1])
    assert write(attacker, planted, 2, sglang_keys()) == [[True] * 3]
    give_away(Path(extra["staging_dir"]))
    with pytest.raises(BackendSetupError, match="staging_dir"):
        victims = group(MODEL, 2, "page_first", extra, ranks=[0])
        write(MODEL, victims, 2, sglang_keys())
    assert unit_files(store_dir) == []


# ------------------------------------------------------------------ inside the staging


def test_a_symlinked_namespace_dir_never_makes_the_sweep_delete_its_target(tmp_path, extra):
    staging = Path(extra["staging_dir"])
    rank0_shares(extra)
    victim = tmp_path / "victim"
    for entry in [p for p in staging.iterdir() if p.is_dir()]:
        shutil.copytree(entry, victim / entry.name, symlinks=True)
        shutil.rmtree(entry)
        entry.symlink_to(victim / entry.name)
    old = os.stat(victim).st_mtime - 7200  # everything there looks stale
    for root, dirs, files in os.walk(victim, topdown=False):
        for name in [*files, *dirs]:
            os.utime(os.path.join(root, name), (old, old))
    before = tree(victim)
    assert before
    with contextlib.suppress(BackendSetupError):  # refusing the staging is fine too
        write(MODEL, group(MODEL, 2, "page_first", extra, ranks=[0]), 2, sglang_keys())
    assert tree(victim) == before


@pytest.mark.parametrize("level", ["leaf", "top"])
def test_a_symlinked_share_dir_never_receives_a_share(tmp_path, extra, level):
    staging = Path(extra["staging_dir"])
    rank0_shares(extra)
    victims = []
    for i, directory in enumerate(staged_dirs(staging, level)):
        shutil.rmtree(directory)
        victims.append(tmp_path / f"victim{i}")
        victims[-1].mkdir()
        directory.symlink_to(victims[-1])
    assert victims
    with contextlib.suppress(BackendSetupError):
        write(MODEL, group(MODEL, 2, "page_first", extra, ranks=[0]), 2, sglang_keys())
    assert [list(v.iterdir()) for v in victims] == [[] for _ in victims]


def test_a_fifo_in_place_of_a_share_never_blocks_a_store(extra, store_dir):
    staging = Path(extra["staging_dir"])
    ranks = rank0_shares(extra)
    fifos = []
    for root, _, files in os.walk(staging):
        for name in files:
            path = os.path.join(root, name)
            os.unlink(path)
            os.mkfifo(path, 0o600)
            fifos.append(path)
    assert fifos
    results = []
    done = threading.Thread(
        target=lambda: results.append(write(MODEL, ranks[1:], 2, sglang_keys())), daemon=True
    )
    done.start()
    done.join(timeout=60)
    blocked = done.is_alive()
    for path in fifos:  # release a reader stuck in open() (the old staging's failure)
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    done.join(timeout=10)
    assert not blocked, "store_page blocked on a FIFO in the staging directory"
    assert unit_files(store_dir) == []  # nothing assembled from what is not a share


# ------------------------------------------------------------------ fp8


FP8 = Model(name="test/tiny-fp8", dtype=torch.uint8)  # SGLang's host pools hold fp8 as uint8


@pytest.mark.parametrize("kv_quant", ["fp8", "FP8", "fp8_e4m3fn", "none"])
def test_fp8_kv_must_name_its_format(extra, kv_quant):
    pool = make_pool(FP8, 1, 0, "page_first")
    with pytest.raises(BackendSetupError, match=r"extra_config\.kv_quant.*fp8_e4m3"):
        make_backend(pool, 1, 0, {**extra, "kv_quant": kv_quant}, model_name=FP8.name)


def test_e4m3_and_e5m2_units_are_never_shared(extra):
    extra = {**extra, "kv_scales": [1.0, 1.0]}  # the same scales: only the format differs
    keys = sglang_keys(FP8)
    writers = group(FP8, 1, "page_first", {**extra, "kv_quant": "fp8_e4m3"})
    assert write(FP8, writers, 1, sglang_keys(FP8)) == [[True] * 3]
    ((_, e5m2),) = group(FP8, 1, "page_first", {**extra, "kv_quant": "fp8_e5m2"})
    sglang_keys(FP8)
    assert e5m2.batch_exists(keys) == 0
    ((pool, e4m3),) = group(FP8, 1, "layer_first", {**extra, "kv_quant": "fp8_e4m3"})
    sglang_keys(FP8)
    slots = pool.alloc(len(TOKENS))
    assert e4m3.batch_get_v1(keys, slots) == [True] * 3
    check_pages(FP8, pool, 1, 0, slots)
