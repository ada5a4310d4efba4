"""FileStore across real processes: SIGKILL mid-write, racing writers, a kernel-enforced size limit."""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import time

import numpy as np
import pytest
from helpers.store import preallocates, row, run_child, small_namespace, start_child, unit_files

from canonical_ops.units import FileStore
from canonical_ops.units.cli import main as store_cli
from canonical_ops.units.unit import header_length

pytestmark = pytest.mark.slow

NS = small_namespace(32, head_size=64)  # 4 KiB pages, 128 KiB per whole-model unit

KILLED_WRITER = """
import sys, time
from helpers.store import row, small_namespace
from canonical_ops.units import FileStore
from canonical_ops.units import files

root, stage = sys.argv[1], sys.argv[2]
ns = small_namespace(32, head_size=64)
files._IO_CHUNK_BYTES = 4096  # many small writes: the kill lands inside the unit
armed = False

def hook(where, path, written):
    if armed and where == stage and (where != "write" or written >= 3 * 4096):
        print("paused", path, written, flush=True)
        time.sleep(600)

files._test_hook = hook
store = FileStore(root, ns, fsync=True)
assert store.store(0, 0, row(ns, 0), 0).ok  # a complete unit before the crash
armed = True
store.store(1, 0, row(ns, 1), 1)
print("not killed", flush=True)
"""


def read_line(proc, timeout: float = 120) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        pytest.fail(f"child gave no line in {timeout} s: {proc.stderr.read()}")
    return proc.stdout.readline()


@pytest.mark.parametrize("stage", ["write", "publish"])
def test_sigkill_of_a_writer_leaves_no_partial_unit(tmp_path, stage) -> None:
    """Killed mid-write (or written and synced, not yet linked): no visible unit, leftovers cleaned."""
    proc = start_child(KILLED_WRITER, str(tmp_path), stage)
    try:
        line = read_line(proc)
        assert line.startswith("paused"), (line, proc.stderr.read())
        _, tmp, written = line.split()
        full = header_length(1) + NS.total_bytes  # its size from the start where preallocated
        size = full if preallocates(os.path.dirname(tmp)) else int(written)
        assert os.path.exists(tmp) and os.path.getsize(tmp) == size
        assert int(written) < NS.total_bytes or stage == "publish"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    directory = os.path.join(tmp_path, NS.hex)
    names = [os.path.basename(p) for p in _units(directory)]
    assert names == ["0-32.ckv"]  # only the unit published before the crash
    assert len(os.listdir(os.path.join(directory, "tmp"))) == 1  # the dead writer's leftover
    assert store_cli(["verify", str(tmp_path)]) == 0
    with FileStore(tmp_path, NS, fsync=False) as store:
        assert store.metrics().temps_removed == 1  # its writer is dead: removed at start-up
        assert os.listdir(os.path.join(directory, "tmp")) == []
        assert store.lookup([0, 1], 0, 32) == 1
        dest = np.zeros(NS.total_bytes, np.uint8)
        assert store.load(0, 0, 32, dest).ok and np.array_equal(dest, row(NS, 0))
        assert store.load(1, 0, 32, dest).status == "miss"
        assert store.store(1, 0, row(NS, 1), 1).ok  # and the lost unit can be stored again
    assert store_cli(["verify", str(tmp_path)]) == 0


def _units(directory: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(directory):
        if os.path.relpath(dirpath, directory).split(os.sep)[0] in ("tmp", "quarantine"):
            continue
        out += [os.path.join(dirpath, n) for n in names if n.endswith(".ckv")]
    return sorted(out)


RACING_WRITER = """
import json, os, sys, time
from helpers.store import row, small_namespace
from canonical_ops.units import FileStore

root, go = sys.argv[1], sys.argv[2]
ns = small_namespace(32, head_size=64)
store = FileStore(root, ns, fsync=False, threads=2, queue_depth=256)
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
jobs = []
for k in range(40):
    for first, end in ((0, 32), (0, 16), (16, 32)):
        jobs.append(store.submit_store(k, first, row(ns, k, first, end), k))
statuses = sorted({store.wait(j, 120).status for j in jobs})
m = store.metrics()
store.close()
print(json.dumps(dict(statuses=statuses, stored=m.units_stored, skipped=m.stores_skipped)))
"""


def test_two_processes_storing_the_same_keys(tmp_path) -> None:
    go = tmp_path / "go"
    root = tmp_path / "store"
    root.mkdir()
    procs = [start_child(RACING_WRITER, str(root), str(go)) for _ in range(2)]
    for proc in procs:  # both imported and waiting: they start together
        assert read_line(proc).strip() == "ready"
    go.write_text("")
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["statuses"] == ["ok"] for r in results)
    assert sum(r["stored"] for r in results) == 120  # each unit published exactly once
    assert sum(r["skipped"] for r in results) == 120  # the other writer's copy was dropped
    with FileStore(root, NS, fsync=False) as store:
        assert len(unit_files(store)) == 120
        assert os.listdir(os.path.join(store.directory, "tmp")) == []
        assert store.lookup(list(range(40)), 0, 32) == 40
        dest = np.zeros(NS.total_bytes, np.uint8)
        for k in (0, 19, 39):
            assert store.load(k, 0, 32, dest).ok and np.array_equal(dest, row(NS, k))
    assert store_cli(["verify", str(root)]) == 0


STREAMING_WRITER = """
import json, sys
from helpers.store import row, small_namespace
from canonical_ops.units import FileStore

ns = small_namespace(32, head_size=64)
store = FileStore(sys.argv[1], ns, fsync=False)
for k in range(60):
    assert store.store(k, 0, row(ns, k), k).ok
print(json.dumps(dict(done=True)))
"""


def test_a_reader_never_sees_a_partial_unit_of_a_concurrent_writer(tmp_path) -> None:
    proc = start_child(STREAMING_WRITER, str(tmp_path))
    loaded = set()
    dest = np.zeros(NS.total_bytes, np.uint8)
    deadline = time.monotonic() + 300
    with FileStore(tmp_path, NS, fsync=False) as reader:
        while time.monotonic() < deadline:
            writer_done = proc.poll() is not None  # then one last pass sees everything
            found = reader.lookup(list(range(60)), 0, 32)
            for k in range(found):
                if k not in loaded:
                    job = reader.load(k, 0, 32, dest)
                    assert job.ok, job.detail
                    assert np.array_equal(dest, row(NS, k))
                    loaded.add(k)
            if writer_done:
                break
        assert reader.metrics().corrupt_detected == 0
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert len(loaded) == 60


SIZE_LIMITED_WRITER = """
import json, os, resource, signal, sys
import numpy as np
from helpers.store import row, small_namespace
from canonical_ops.units import FileStore

root = sys.argv[1]
ns = small_namespace(32, head_size=64)
store = FileStore(root, ns, fsync=True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))  # kernel-enforced file size
small = store.store(1, 0, row(ns, 1, 0, 4), 1)  # 16 KiB: fits
big = store.store(2, 0, row(ns, 2), 2)  # 128 KiB: the kernel refuses past 64 KiB
submitted = store.wait(store.submit_store(3, 0, row(ns, 3), 3), 60)  # same, in a worker thread
after = store.store(4, 0, row(ns, 4, 0, 4), 4)
dest = np.zeros(ns.layer_bytes(0, 4), np.uint8)
loaded = store.load(1, 0, 4, dest)
m = store.metrics()
print(json.dumps(dict(
    statuses=[small.status, big.status, submitted.status, after.status],
    errno=[getattr(j.error, "errno", None) for j in (big, submitted)],
    detail=big.detail,
    loaded=loaded.ok and bool(np.array_equal(dest, row(ns, 1, 0, 4))),
    failed=m.stores_failed,
    stored=m.units_stored,
    tmp=os.listdir(os.path.join(store.directory, "tmp")),
)))
"""


def test_a_kernel_enforced_size_limit_fails_stores_cleanly(tmp_path) -> None:
    """RLIMIT_FSIZE in a child (SIGXFSZ ignored): writes past it get EFBIG from the kernel."""
    result = run_child(SIZE_LIMITED_WRITER, str(tmp_path))
    assert result["statuses"] == ["ok", "error", "error", "ok"], result
    assert result["errno"] == [errno.EFBIG, errno.EFBIG]
    assert "disk full" in result["detail"]
    assert result["loaded"] and result["failed"] == 2 and result["stored"] == 2
    assert result["tmp"] == []  # the partial temp files were removed
    with FileStore(tmp_path, NS, fsync=False) as store:
        assert store.lookup([1], 0, 4) == 1 and store.lookup([2], 0, 1) == 0
        assert store.lookup([3], 0, 1) == 0 and store.lookup([4], 0, 4) == 1
    assert store_cli(["verify", str(tmp_path)]) == 0
