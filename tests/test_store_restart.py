"""Restarts through the persistent store, end to end: `python -m canonical_ops demo --store`.

Every test runs the real demo in real processes (a coordinator with the stages'
regions, page managers and StageCaches, plus TP x PP rank processes) on real
files: a ``--phase write`` process persists the prompt and exits (its regions
are gone), a separate ``--phase read`` process with another topology starts
with empty regions and must get every page from the files, verified against
the unsharded truth that both derive from the preset and the seed alone.
Unit-level properties of the file store (atomic publication, every kind of
damage, eviction order, racing writers) are tested in test_store_*.py; these
tests show what the engine does with them.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.demo_cli import (
    BLOCKS,
    PROMPT,
    ROOT,
    assert_usage_error,
    demo_command,
    demo_json,
    prompt_keys,
    run_demo,
)
from helpers.store import preallocates

from canonical_ops import demo
from canonical_ops.units.cli import main as store_cli
from canonical_ops.units.files import key_digest

pytestmark = pytest.mark.slow

UNIT_FILE_BYTES = 192 + 4 * 32768  # header (96 + the 96-byte key of scheme v2) + payload


def write(root, *args: str, expect: int = 0) -> dict:
    return demo_json(*PROMPT, "--store", str(root), "--phase", "write", *args, expect=expect)


def read(root, *args: str, expect: int | None = None) -> dict:
    return demo_json(*PROMPT, "--store", str(root), "--phase", "read", *args, expect=expect)


def unit_files(root) -> list[Path]:
    return sorted(
        p for p in Path(root).glob("*/*/*/*.ckv") if p.parent.parent.parent.name != "quarantine"
    )


def tier(summary: dict, engine: str) -> dict:
    [report] = [t for t in summary["tiers"] if t["engine"] == engine]
    return report


def assert_read_passed(summary: dict) -> None:
    assert summary["verdict"] == "PASS", summary["failures"]
    assert summary["pages_loaded"] == BLOCKS and summary["pages_missed"] == 0
    assert summary["corrupt_detected"] == 0 and summary["bytes_wrong"] == 0
    assert summary["fill"]["pages_found"] == summary["fill"]["pages_filled"] == BLOCKS
    assert summary["fill"]["bytes"] > 0  # every page came from the files: the regions were new


# ---------------------------------------------------------------------- restarts

RESTARTS = {
    "tp4-to-tp2": (["--writer-tp", "4"], ["--reader-tp", "2"]),
    "tp8-to-tp1": (["--writer-tp", "8"], ["--reader-tp", "1"]),
    "tp1-to-tp8": (["--writer-tp", "1"], ["--reader-tp", "8"]),
    "pp2-to-pp1": (["--writer-tp", "1", "--writer-pp", "2"], ["--reader-tp", "1"]),
    "pp1-to-pp2": (["--writer-tp", "1"], ["--reader-tp", "1", "--reader-pp", "2"]),
    "tp2xpp2-to-tp4xpp1": (["--writer-tp", "2", "--writer-pp", "2"], ["--reader-tp", "4"]),
    # 2 KV heads: TP 4 replicates each head on 2 ranks, TP 8 on 4 (elected writers rotate)
    "gqa2-tp4-to-tp8": (
        ["--kv-heads", "2", "--writer-tp", "4"],
        ["--kv-heads", "2", "--reader-tp", "8"],
    ),
    # MLA: the latent is replicated on every TP rank; a 3-stage split over 4 layers is [1, 1, 2]
    "mla-tp4-to-tp2xpp3": (
        ["--preset", "deepseek-v3", "--layers", "4", "--writer-tp", "4"],
        ["--preset", "deepseek-v3", "--layers", "4", "--reader-tp", "2", "--reader-pp", "3"],
    ),
}


@pytest.mark.parametrize(("written", "reread"), RESTARTS.values(), ids=RESTARTS.keys())
def test_a_restart_reads_what_another_topology_wrote(tmp_path, written, reread):
    """Write at one TP x PP, exit; a new process at another TP x PP reads every page."""
    w = write(tmp_path, *written)
    assert w["verdict"] == "PASS" and w["phase"] == "write"
    stages = len(w["topology"]["writer_stages"])
    blocks = w["pages_total"]
    assert w["persist"]["units_ok"] == w["persist"]["units_expected"] == blocks * stages
    assert w["persist"]["pages_complete_in_store"] == {"files": blocks}  # all layers, any split
    assert w["pages_loaded"] is None and w["pages_missed"] is None  # nothing was read
    assert len(unit_files(tmp_path)) == blocks * stages  # one unit per block and stage
    r = read(tmp_path, *reread, expect=0)
    assert r["namespace"] == w["namespace"]  # parallelism is not part of it
    assert r["verdict"] == "PASS", r["failures"]
    assert r["pages_loaded"] == r["pages_total"] == blocks and r["pages_missed"] == 0
    assert r["corrupt_detected"] == 0 and r["bytes_wrong"] == 0
    assert r["fill"]["pages_filled"] == blocks and r["fill"]["bytes"] > 0
    # every reader stage read its own layers from units of the writers' split
    assert r["fill"]["unit_reads"] >= blocks * len(r["topology"]["reader_stages"])
    assert r["bytes_checked"] > 0
    assert store_cli(["verify", str(tmp_path)]) == 0


def test_both_phases_in_one_command_share_only_the_files(tmp_path):
    summary = demo_json(
        *PROMPT, "--store", str(tmp_path), "--writer-tp", "2", "--writer-pp", "2", expect=0
    )
    assert_read_passed(summary)
    assert summary["phase"] == "both"
    # two engines, each with its own tier object: the reader's index was rebuilt from disk
    assert [t["engine"] for t in summary["tiers"]] == ["write", "read"]
    assert tier(summary, "write")["units_stored"] == 2 * BLOCKS
    assert tier(summary, "read")["hits"] == BLOCKS and tier(summary, "read")["misses"] == 0
    lines = summary["_stderr"]
    assert "persist: 16/16 units" in lines and "fill: 8/8 pages found in the store" in lines


# ---------------------------------------------------------------------- damage and foreign units


@pytest.fixture(scope="module")
def written_store(tmp_path_factory) -> Path:
    """One write (TP 2), reused by reads that must miss without a wrong byte."""
    root = tmp_path_factory.mktemp("written")
    assert write(root, "--writer-tp", "2")["verdict"] == "PASS"
    return root


def unit_of(root: Path, block: int) -> Path:
    kd = key_digest(prompt_keys(*PROMPT)[block])
    [path] = [p for p in unit_files(root) if p.parent.name == kd]
    return path


def test_bit_flips_and_truncation_are_misses_never_loads(tmp_path, written_store):
    root = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(written_store), str(root)], check=True)
    flipped, truncated = unit_of(root, 2), unit_of(root, 5)
    data = bytearray(flipped.read_bytes())
    data[-1000] ^= 0x04  # one payload bit: same size, the checksum disagrees
    flipped.write_bytes(bytes(data))
    os.truncate(truncated, truncated.stat().st_size - 4096)
    r = read(root, "--reader-tp", "4", expect=1)
    assert r["verdict"] == "FAIL"
    assert r["corrupt_detected"] == 2  # the truncation at start-up (size), the flip at load
    assert r["bytes_wrong"] == 0  # FAIL because pages are missing, never because of bad bytes
    assert r["pages_loaded"] == 2 and r["pages_missed"] == BLOCKS - 2
    assert any("only 2/8 prompt pages were found in the store" in f for f in r["failures"])
    assert not any("differ from the unsharded truth" in f for f in r["failures"])
    assert tier(r, "read")["quarantined"] == 2
    assert store_cli(["verify", str(root)]) == 0  # the bad units are out of the way
    # Storing again repairs the store: the next reader gets everything.
    assert write(root, "--writer-tp", "8")["persist"]["units_ok"] == BLOCKS
    assert_read_passed(read(root, "--reader-tp", "1", expect=0))


FOREIGN = {
    "model-identity": ["--model-name", "another/model"],
    "dtype": ["--dtype", "bfloat16"],  # tiny's KV is float16
    "format-family": ["--order", "HND"],  # v1-hnd pages are other bytes
}


@pytest.mark.parametrize("change", FOREIGN.values(), ids=FOREIGN.keys())
def test_a_changed_identity_dtype_or_format_is_a_miss(written_store, change):
    r = read(written_store, "--reader-tp", "2", *change, expect=1)
    assert r["namespace"] != demo_json_namespace()  # another namespace: the units are invisible
    assert r["pages_loaded"] == 0 and r["pages_missed"] == BLOCKS
    assert r["corrupt_detected"] == 0 and r["bytes_wrong"] == 0
    assert r["fill"]["pages_found"] == 0
    assert "no reader ran (no page was found)" in r["failures"]
    # the units of the original namespace are untouched
    assert len(unit_files(written_store)) == BLOCKS


def demo_json_namespace() -> str:
    cfg = demo.build_config(demo.build_parser().parse_args(PROMPT), "cpu")
    return cfg.namespace("reader").hex


# ---------------------------------------------------------------------- crashes and races

KILLED_WRITE = """
import os, sys, threading, time
from canonical_ops.units import files
files._IO_CHUNK_BYTES = 4096  # many small writes: the kill lands inside a unit
marker, argv = sys.argv[1], sys.argv[2:]
lock, started = threading.Lock(), []

def hook(stage, path, written):
    if stage != "write":
        return
    with lock:
        if path not in started:
            started.append(path)
        third = started.index(path) == 2
    if third and written >= 8192:
        with open(marker + ".tmp", "w") as f:
            f.write(f"{written} {path}")
        os.rename(marker + ".tmp", marker)
        time.sleep(600)

files._test_hook = hook
from canonical_ops.demo import main
sys.exit(main(argv))
"""


def test_sigkill_of_the_write_phase_leaves_no_partial_unit(tmp_path):
    root, marker = tmp_path / "store", tmp_path / "paused"
    root.mkdir()
    args = [*PROMPT, "--store", str(root), "--phase", "write", "--writer-tp", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITE, str(marker), *args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the write phase never reached the third unit"
            time.sleep(0.05)
        written, path = marker.read_text().split(" ", 1)
        partial = Path(path)
        assert int(written) < UNIT_FILE_BYTES  # paused inside the unit; its temp file holds
        size = UNIT_FILE_BYTES if preallocates(partial.parent) else int(written)  # all blocks
        assert partial.exists() and partial.stat().st_size == size  # where preallocated
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    assert proc.returncode == -signal.SIGKILL
    # its regions were unlinked once every rank attached: killing it leaks no memory
    assert not list(Path("/dev/shm").glob(f"canonical-kv-demo-{proc.pid}-*"))
    published = unit_files(root)
    assert len(published) < BLOCKS  # the paused unit was never published
    assert all(p.stat().st_size == UNIT_FILE_BYTES for p in published)
    assert store_cli(["verify", str(root)]) == 0  # every visible unit is whole and checks
    [namespace] = [d for d in root.iterdir() if d.is_dir()]
    # the leftovers: the paused unit's temp file, and those of the pool's other threads
    leftovers = [p.name for p in (namespace / "tmp").iterdir()]
    assert partial.name in leftovers and len(published) + len(leftovers) <= BLOCKS
    r = read(root, "--reader-tp", "1", expect=1)
    assert r["bytes_wrong"] == 0 and r["corrupt_detected"] == 0
    assert r["pages_missed"] >= 1 and r["pages_loaded"] == r["fill"]["pages_filled"]
    assert r["pages_loaded"] <= len(published)
    # their writer is dead (pid and start time): removed at the reader's start-up
    assert tier(r, "read")["temps_removed"] == len(leftovers)
    assert list((namespace / "tmp").iterdir()) == []
    # a new write completes the store; the next restart reads everything
    w = write(root, "--writer-tp", "4")
    assert tier(w, "write")["stores_skipped"] == len(published)  # first writer won
    assert_read_passed(read(root, "--reader-tp", "2", expect=0))


def test_two_engines_writing_the_same_keys_at_once(tmp_path):
    args = [*PROMPT, "--store", str(tmp_path), "--phase", "write", "--json"]
    procs = [
        subprocess.Popen(
            demo_command(*args, "--writer-tp", tp),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tp in ("2", "4")
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        results.append(json.loads(out))
    stored = [tier(r, "write")["units_stored"] for r in results]
    skipped = [tier(r, "write")["stores_skipped"] for r in results]
    assert sum(stored) == BLOCKS and sum(skipped) == BLOCKS  # each unit published exactly once
    assert all(r["persist"]["units_ok"] == BLOCKS for r in results)
    assert len(unit_files(tmp_path)) == BLOCKS
    assert store_cli(["verify", str(tmp_path)]) == 0
    assert_read_passed(read(tmp_path, "--reader-tp", "8", expect=0))


# ---------------------------------------------------------------------- capacity and full disks


def test_capacity_evicts_tails_and_a_restart_misses_exactly_those(tmp_path):
    capacity = 5 * UNIT_FILE_BYTES
    w = write(tmp_path, "--writer-tp", "2", "--store-capacity", str(capacity))
    files = tier(w, "write")
    assert files["units_stored"] == BLOCKS and files["evicted"] == BLOCKS - 5
    assert files["bytes_on_disk"] <= capacity
    kept = {p.parent.name for p in unit_files(tmp_path)}
    present = [key_digest(h) in kept for h in prompt_keys(*PROMPT)]
    assert sum(present) == 5 and present[0]  # a head is never evicted before its tail
    first_evicted = present.index(False)
    assert w["persist"]["pages_complete_in_store"] == {"files": first_evicted}
    r = read(tmp_path, "--reader-tp", "4", expect=1)
    assert r["pages_loaded"] == first_evicted and r["pages_missed"] == BLOCKS - first_evicted
    assert r["bytes_wrong"] == 0 and r["corrupt_detected"] == 0


def test_a_full_disk_fails_stores_cleanly_and_the_engine_keeps_serving(tmp_path):
    """A small tmpfs as the store (kernel-enforced ENOSPC); test_tiers.py covers EFBIG."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=320k tmpfs {mnt} 2>/dev/null") != 0:
        pytest.skip("mount -t tmpfs not permitted here; test_tiers.py covers a full disk")
    try:
        w = write(mnt, "--writer-tp", "2", expect=1)  # two units fit, not eight
        persist = w["persist"]
        assert (
            1 <= persist["units_ok"] <= 2
            and persist["units_failed"] == BLOCKS - persist["units_ok"]
        )
        assert any("disk full" in e for e in persist["errors"]), persist["errors"]
        assert w["stores_failed"] == persist["units_failed"]
        assert persist["pages_ready_after_persist"] == BLOCKS  # still serving from its region
        assert any("units were not persisted" in f for f in w["failures"])
        assert "Traceback" not in w["_stderr"]
        [namespace] = [d for d in mnt.iterdir() if d.is_dir()]
        assert list((namespace / "tmp").iterdir()) == []  # failed temps removed
        r = read(mnt, "--reader-tp", "1", expect=1)
        assert r["bytes_wrong"] == 0 and r["pages_loaded"] <= persist["units_ok"]
    finally:
        os.system(f"umount {mnt}")


# ---------------------------------------------------------------------- start-up errors


def test_a_missing_store_directory_is_created_private_to_the_user(tmp_path):
    """Issue 26: `--store /tmp/kv` failed when the directory did not exist (vLLM's fs tier and
    LMCache create theirs); now the store creates it, mode 0700, and the restart works."""
    missing = tmp_path / "kv"
    assert write(missing, "--writer-tp", "2")["verdict"] == "PASS"
    assert stat.S_IMODE(missing.stat().st_mode) == 0o700
    assert_read_passed(read(missing, "--reader-tp", "4", expect=0))
    fresh = tmp_path / "empty"  # a read phase on a directory nobody wrote: misses only
    r = read(fresh, "--reader-tp", "2", expect=1)
    assert r["pages_missed"] == BLOCKS and r["bytes_wrong"] == 0 and r["corrupt_detected"] == 0


def test_a_root_that_cannot_be_written_is_a_one_line_error_at_start_up(tmp_path):
    assert_usage_error(run_demo(*PROMPT, "--store", "/proc", "--phase", "read"), "--store /proc")
    file = tmp_path / "a-file"
    file.write_text("")
    line = assert_usage_error(run_demo(*PROMPT, "--store", str(file)), "--store", str(file))
    assert "not a directory" in line.lower()
    # (a read-only mount: test_store_files.py, at the FileStore the demo passes it through)


@pytest.mark.parametrize(
    ("password", "pieces"),
    [("secret", ["secret"]), ("se/cr#et?x", ["cr#et", "et?x"]), ("p@ss/w#rd", ["p@ss", "w#rd"])],
)
def test_an_unreachable_redis_url_beside_a_directory_is_a_one_line_start_up_error(
    tmp_path, password, pieces
):
    """Issue 26: a password with an unencoded `/`, `#` or `?` was printed whole (the demo's
    own redaction stopped at the `/`); every --store is printed through the tier's one
    redact_url, and the message says what to do instead of naming a Python argument."""
    url = f"redis://user:{password}@127.0.0.1:1/0"
    result = run_demo(*PROMPT, "--store", str(tmp_path), "--store", url)
    line = assert_usage_error(result, "--store redis://user:***@127.0.0.1:1/0")
    for piece in [password, *pieces]:
        assert piece not in line, piece  # no piece of the password is printed
    assert "require_server" not in line and "start the server" in line
    assert not list(tmp_path.iterdir())  # nothing was written: checked before any work


def test_mla_has_no_kv_head_override():
    assert_usage_error(
        run_demo("--preset", "deepseek-v3", "--kv-heads", "2"), "--kv-heads 2", "MLA"
    )


# ---------------------------------------------------------------------- hybrid models

# tiny-hybrid: layers [gdn, mamba2, gdn, attn] x 2 (2 attention layers of 4 KV heads x 32, 6
# state layers); 40 tokens = 3 blocks. One KV unit per block and stage, one state unit per
# stage (the request's state after its last block).
HYBRID = ["--preset", "tiny-hybrid", "--prompt-tokens", "40"]
CONTRACT = {
    "verdict", "failures", "phase", "pages_total", "pages_ready", "pages_loaded", "pages_missed",
    "corrupt_detected", "bytes_wrong", "bytes_checked", "model", "topology", "store", "load",
    "timings_s", "namespace", "stores", "persist", "fill", "promote", "stores_failed", "tiers",
}  # fmt: skip


def hybrid(root, phase: str, *args: str, expect: int | None = None) -> dict:
    return demo_json(*HYBRID, "--store", str(root), "--phase", phase, *args, expect=expect)


def test_hybrid_presets_use_the_one_json_contract(tmp_path):
    """Issue 24: the hybrid presets moved attention KV with raw plans and printed their own
    schema; they now run through the same engines (rank processes, regions, StageCaches)
    and print the same fields, their state beside them."""
    w = hybrid(tmp_path, "write", "--writer-tp", "4", expect=0)
    assert set(w) >= CONTRACT and w["phase"] == "write"
    assert w["persist"]["units_ok"] == w["persist"]["units_expected"] == 3
    assert w["pages_ready"] == 3 and w["pages_loaded"] is None and w["stores_failed"] == 0
    assert w["state"]["units_persisted"] == w["state"]["units_expected_persisted"] == 1
    # a reader split whose first stage holds state layers only: [gdn, mamba2, gdn]
    r = hybrid(tmp_path, "read", "--reader-tp", "2", "--reader-pp", "3", expect=0)
    assert set(r) >= CONTRACT and r["verdict"] == "PASS", r["failures"]
    assert r["namespace"] == w["namespace"] and r["state"]["namespace"] == w["state"]["namespace"]
    assert (r["pages_loaded"], r["pages_missed"], r["bytes_wrong"]) == (3, 0, 0)
    assert r["fill"]["pages_found"] == r["fill"]["pages_filled"] == 3
    assert r["fill"]["pages_by_tier"] == {"files": 2 * 3}  # two stages hold attention layers
    assert r["state"]["units_filled"] == r["state"]["units_expected_filled"] == 3
    assert r["state"]["bytes_checked"] > 0 and r["state"]["bytes_wrong"] == 0
    assert r["bytes_checked"] > r["state"]["bytes_checked"]  # KV and state, every byte
    assert {(t["engine"], t["units"]) for t in r["tiers"]} == {("read", "kv"), ("read", "state")}
    assert "readers: 6/6 compared with the unsharded truth" in r["_stderr"]
    assert store_cli(["verify", str(tmp_path)]) == 0


def test_hybrid_corrupt_units_are_misses_never_found_or_loaded(tmp_path):
    """Issue 26: the hybrid summary counted a corrupt KV unit as found
    (`kv_blocks_from_files`). A flipped bit in block 1's KV unit and in the state unit: each
    a miss (corrupt_detected), never found, filled or loaded; no wrong byte."""
    hybrid(tmp_path, "write", "--writer-tp", "4", expect=0)
    namespaces = {
        json.loads((d / "namespace.json").read_text()).get("unit_kind", "kv"): d
        for d in tmp_path.iterdir()
        if (d / "namespace.json").exists()
    }
    kd = key_digest(prompt_keys(*HYBRID, "--store", "x")[1])
    [kv_unit] = [p for p in namespaces["kv"].glob("*/*/*.ckv") if p.parent.name == kd]
    [state_unit] = list(namespaces["state"].glob("*/*/*.ckv"))
    for unit in (kv_unit, state_unit):
        data = bytearray(unit.read_bytes())
        data[-1] ^= 0x01
        unit.write_bytes(bytes(data))
    r = hybrid(tmp_path, "read", "--reader-tp", "1", expect=1)
    assert r["corrupt_detected"] == 2 and r["bytes_wrong"] == 0
    assert (r["pages_loaded"], r["pages_missed"]) == (1, 2)  # the prefix before block 1
    assert r["fill"]["pages_found"] == r["fill"]["pages_filled"] == 1
    assert r["fill"]["pages_by_tier"] == {"files": 2}  # blocks 0 and 2 verified, not 1
    assert r["state"]["units_filled"] == 0 and r["state"]["bytes_checked"] == 0
    assert any("state units of the request were found" in f for f in r["failures"])
    assert not any("differ from the unsharded truth" in f for f in r["failures"])
