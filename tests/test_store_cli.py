"""`python -m canonical_ops store stats|verify|gc DIR`: its exit-code contract and output."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers.store import REPO, child_env, row, small_namespace, unit_files

from canonical_ops.units import FileStore
from canonical_ops.units.cli import main, parse_size

NS = small_namespace(8)
OTHER = small_namespace(8, name="second-model")


@pytest.fixture
def root(tmp_path):
    with FileStore(tmp_path, NS, fsync=False) as store:
        for k in range(4):
            store.store(k, 0, row(NS, k, 0, 4), k)
            store.store(k, 4, row(NS, k, 4, 8), k)
    with FileStore(tmp_path, OTHER, fsync=False) as store:
        store.store(b"x", 0, row(OTHER, 1), 0)
    return tmp_path


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_good_store(root, capsys) -> None:
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 0
    assert "9 unit file(s) in 2 namespace(s) checked, 0 bad" in out
    code, out, _ = run(capsys, "verify", str(root), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["checked"] == 9 and report["bad"] == []
    # a namespace directory alone works too
    code, out, _ = run(capsys, "verify", os.path.join(root, NS.hex))
    assert code == 0 and "8 unit file(s) in 1 namespace(s)" in out


def test_verify_reports_every_bad_file(root, capsys) -> None:
    with FileStore(root, NS, fsync=False) as store:
        paths = unit_files(store)
    with open(paths[0], "r+b") as f:  # same-size corruption: one bit of payload
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    os.truncate(paths[1], 100)
    os.rename(paths[2], paths[2].replace("0-4.ckv", "0-5.ckv").replace("4-8.ckv", "4-9.ckv"))
    stray = os.path.join(os.path.dirname(paths[3]), "notes.txt")
    with open(stray, "w") as f:
        f.write("hello")
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1
    assert "4 bad" in out
    bad = [line for line in out.splitlines() if line.startswith("BAD ")]
    assert len(bad) == 4
    assert any(paths[0] in line and "checksum" in line for line in bad)
    assert any(paths[1] in line and "truncated" in line for line in bad)
    assert any("do not match the file name" in line for line in bad)
    assert any(stray in line and "not a unit file name" in line for line in bad)
    code, out, _ = run(capsys, "verify", "--json", str(root))
    report = json.loads(out)
    assert code == 1 and report["bad_count"] == 4 and not report["ok"]
    assert {paths[0], paths[1], stray} <= {b["path"] for b in report["bad"]}


def test_verify_checks_namespace_json(root, capsys) -> None:
    path = os.path.join(root, OTHER.hex, "namespace.json")
    with open(path) as f:
        desc = json.load(f)
    desc["kv_quant"] = "fp8"  # now describes another namespace than its directory
    with open(path, "w") as f:
        json.dump(desc, f)
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1 and f"BAD {path}" in out and "not its directory" in out
    with open(path, "w") as f:
        f.write("{not json")
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1 and "unreadable namespace" in out
    # the units themselves still check (checksums, placement) without a namespace.json
    assert "1 bad" in out


def test_stats(root, capsys) -> None:
    code, out, _ = run(capsys, "stats", str(root))
    assert code == 0
    assert "2 namespace(s)" in out and "model=test-model" in out and "model=second-model" in out
    assert "units=8 " in out and "keys=4 " in out and "[0-4): 4, [4-8): 4" in out
    code, out, _ = run(capsys, "stats", "--json", str(root))
    report = {n["model"]: n for n in json.loads(out)["namespaces"]}
    ours = report["test-model"]
    assert ours["namespace"] == NS.hex and ours["units"] == 8 and ours["keys"] == 4
    assert ours["bytes"] == sum(os.path.getsize(p) for p in unit_files(FileStore(root, NS)))
    assert ours["layer_ranges"] == {"0-4": 4, "4-8": 4}
    assert ours["format_id"] == "v1-nhd" and ours["num_layers"] == 8
    assert report["second-model"]["units"] == 1


def test_gc(root, capsys) -> None:
    unit = os.path.getsize(unit_files(FileStore(root, NS))[0])
    code, out, _ = run(capsys, "gc", str(root), "--capacity", str(20 * unit), "--json")
    assert code == 0 and json.loads(out)["units_evicted"] == 0
    code, out, _ = run(capsys, "gc", str(root), "--capacity", "0")
    assert code == 0 and "evicted 9 unit(s)" in out
    code, out, _ = run(capsys, "stats", "--json", str(root))
    assert all(n["units"] == 0 for n in json.loads(out)["namespaces"])


def test_gc_keeps_heads(tmp_path, capsys) -> None:
    with FileStore(tmp_path, NS, fsync=False) as store:
        for position in range(6):
            store.store(position, 0, row(NS, position), position)
        paths = unit_files(store)
    unit = os.path.getsize(paths[0])
    for path in paths:  # equally recent (gc's recency is quantised to 1 s): tails go first
        os.utime(path, (1_700_000_000, 1_700_000_000))
    code, _, _ = run(capsys, "gc", str(tmp_path), "--capacity", f"{3 * unit}B")
    assert code == 0
    with FileStore(tmp_path, NS, fsync=False) as store:
        assert store.lookup(list(range(6)), 0, 8) == 3 and store.metrics().units_on_disk == 3


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate", "."],
        ["verify"],
        ["verify", "/definitely/not/here"],
        ["stats", "--bogus", "."],
        ["gc", "."],
        ["gc", ".", "--capacity", "lots"],
        ["gc", ".", "--capacity", "-5"],
        ["gc", ".", "--capacity", "1.5G"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    # the same one-line form as every CLI of the project (layouts.cli.CliParser)
    assert err.startswith("python -m canonical_ops store") and err.rstrip().endswith("(see --help)")
    if "--capacity" in argv[-2:]:
        assert "--capacity" in err and repr(argv[-1]) in err


def test_help_exits_0(capsys) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "stats" in out and "verify" in out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1048576", 1 << 20),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("512MiB", 512 << 20),
        ("3G", 3 << 30),
        ("2GiB", 2 << 30),
        ("1T", 1 << 40),
        ("100B", 100),
        (" 7 M ", 7 << 20),
    ],
)
def test_parse_size(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "1.5G", "1X", "G", "1 GB B", "1e9"])
def test_parse_size_refuses(text) -> None:
    with pytest.raises(ValueError, match="expected a byte count"):
        parse_size(text)


def test_python_dash_m_entry_point(root) -> None:
    """The real command line: `python -m canonical_ops store ...` and its exit codes."""
    cmd = [sys.executable, "-m", "canonical_ops", "store"]
    ok = subprocess.run([*cmd, "verify", str(root)], env=child_env(), cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "0 bad" in ok.stdout
    with FileStore(root, NS, fsync=False) as store:
        path = unit_files(store)[0]
    os.truncate(path, 10)
    bad = subprocess.run([*cmd, "verify", str(root)], env=child_env(), cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 1 and path in bad.stdout
    usage = subprocess.run([*cmd, "gc", str(root)], env=child_env(), cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    assert len(usage.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pa/ss#w?rd@host:6379/0",
        "rediss://user:p@ss@host",
        "unix:///tmp/r.sock?password=pw",
    ],
)
def test_redis_targets_go_to_redis_cli_and_never_echo_the_password(url, capsys, monkeypatch):
    import canonical_ops.units.redis_cli as redis_cli

    calls = []

    def run(command, target, *, as_json, dry_run, capacity):
        calls.append((command, target, as_json, dry_run, capacity))
        return 0

    monkeypatch.setattr(redis_cli, "run", run)
    assert main(["gc", url, "--capacity", "1G", "--dry-run", "--json"]) == 0
    assert calls == [("gc", url, True, True, 1 << 30)]
    assert main(["stats", url]) == 0 and calls[-1] == ("stats", url, False, False, None)
    # Without the Redis tool: one line, exit 2, no password in it.
    monkeypatch.setitem(sys.modules, "canonical_ops.units.redis_cli", None)
    code, out, err = run_capture(capsys, "verify", url)
    assert code == 2 and err.strip() == "store verify for Redis needs canonical_ops.units.redis_cli"
    assert "pa/ss" not in out + err and "p@ss" not in out + err and "pw" not in out + err


def run_capture(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_redact() -> None:
    from canonical_ops.units.redis_url import redact_url as redact  # the one redaction

    assert redact("redis://:pa/ss#w?rd@host:6379/0") == "redis://***@host:6379/0"
    assert redact("rediss://user:p@ss@host") == "rediss://user:***@host"
    assert redact("unix:///s.sock?db=1&password=pw") == "unix:///s.sock?db=1&password=***"
    assert redact("redis://host:6379") == "redis://host:6379"


def test_group_shared_flag_walks_a_group_store(tmp_path, capsys) -> None:
    with FileStore(tmp_path, NS, fsync=False, group_shared=True) as store:
        assert store.store(1, 0, row(NS, 1), 0).ok
    code, out, _ = run(capsys, "verify", str(tmp_path))
    assert code == 1 and "unsafe" in out  # 0770 directories: not private
    code, out, _ = run(capsys, "verify", "--group-shared", str(tmp_path))
    assert code == 0 and "1 unit file(s) in 1 namespace(s) checked, 0 bad" in out


def test_gc_never_unlinks_in_the_working_directory_when_a_directory_vanished(
    root, tmp_path, monkeypatch, capsys
) -> None:
    """A unit's fan-out directory removed between gc's scan and its unlink (another gc, an
    operator): the unlink must miss, not resolve the key directory against the cwd."""
    from canonical_ops.units import cli

    unit = unit_files(FileStore(root, NS))[0]
    kd, name = os.path.basename(os.path.dirname(unit)), os.path.basename(unit)
    decoy_dir = tmp_path / "cwd" / kd
    decoy_dir.mkdir(parents=True, mode=0o700)
    (decoy_dir / name).write_bytes(b"not a unit of the store")
    monkeypatch.chdir(tmp_path / "cwd")
    removed = cli._remove

    def remove_after_the_fanout_vanished(entry, perms):
        shutil.rmtree(os.path.dirname(os.path.dirname(unit)), ignore_errors=True)
        return removed(entry, perms)

    monkeypatch.setattr(cli, "_remove", remove_after_the_fanout_vanished)
    code, _, _ = run(capsys, "gc", str(root), "--capacity", "0")
    assert code == 0
    assert (decoy_dir / name).read_bytes() == b"not a unit of the store"


def test_names_and_paths_are_escaped_in_every_report_and_exact_in_json(tmp_path, capsys):
    """A model name, revision and store path holding a newline, a forged report line and
    terminal escapes: one escaped line each in ``stats``, ``verify`` and ``gc``; ``--json``
    keeps the exact text."""
    from helpers.hostile import ESCAPED, HOSTILE, assert_no_forgery, hostile_namespace

    ns, root = hostile_namespace(NS), tmp_path / f"store {HOSTILE}"
    with FileStore(root, ns, fsync=False) as store:
        for k in range(2):
            store.store(k, 0, row(ns, k), k)
        paths = unit_files(store)
    os.truncate(paths[0], 100)  # one bad unit: `verify` names its path
    for argv in (["stats"], ["verify"], ["gc", "--capacity", "0", "--dry-run"]):
        code, out, err = run(capsys, *argv, str(root))
        assert code == (1 if argv[0] == "verify" else 0), err
        assert_no_forgery(out + err)
        assert f"store {ESCAPED}" in out  # the path, escaped, not lost
        code, out, _ = run(capsys, *argv, str(root), "--json")
        report = json.loads(out)
        assert report["directory"] == str(root)
        if argv[0] == "stats":
            [item] = report["namespaces"]
            assert (item["model"], item["revision"]) == (HOSTILE, HOSTILE)
            assert item["extra"] == {"adapter": HOSTILE}
        elif argv[0] == "verify":
            assert [bad["path"] for bad in report["bad"]] == [paths[0]]
        else:
            assert sorted(report["evicted"]) == sorted(paths)
    code, out, _ = run(capsys, "stats", str(root))
    assert f"model={ESCAPED} rev={ESCAPED}" in out


def test_a_description_nested_too_deep_is_a_bad_namespace_not_a_crash(root, capsys) -> None:
    """json raises RecursionError (not ValueError) on a text nested past its depth: `store
    stats|verify|gc` died with a traceback on such a namespace.json, and so did a hybrid
    reader explaining a state miss. It is one namespace's problem, as any unreadable one."""
    from canonical_ops.engine.hybrid import explain_state_miss
    from canonical_ops.units.namespace import StateGeometry
    from layouts import RankContext
    from layouts.state import StateSpec

    path = os.path.join(root, OTHER.hex, "namespace.json")
    with open(path, "wb") as f:
        f.write(b"[" * 200_000 + b"]" * 200_000)
    code, out, err = run(capsys, "stats", str(root))
    assert code == 0, err
    assert "PROBLEM: " in out and "nested too deep to be a namespace description" in out
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1 and f"BAD {path}: " in out
    assert "unreadable namespace description (nested too deep" in out
    code, out, err = run(capsys, "gc", str(root), "--capacity", "0", "--dry-run")
    assert code == 0, err
    code, out, _ = run(capsys, "stats", str(root), "--json")
    problems = [item["problem"] for item in json.loads(out)["namespaces"]]
    assert sum("nested too deep" in (p or "") for p in problems) == 1
    ctx = RankContext(1, 8, 0)
    gdn = StateSpec.gdn(num_k_heads=2, num_v_heads=2, head_k_dim=4, head_v_dim=4, conv_kernel=4,
                        conv_dtype="bfloat16", ssm_dtype="float32")  # fmt: skip
    hybrid = dataclasses.replace(NS, states=(StateGeometry.from_spec(gdn, ctx),))
    assert explain_state_miss(root, hybrid, ctx) is None


def test_verify_of_a_namespace_directory_not_named_by_its_digest_lists_it_bad(root, capsys) -> None:
    """A namespace directory copied or renamed (here with a newline in the name) and given as
    TARGET: `verify` stopped at its name (exit 2, "non-hexadecimal number found in
    fromhex()"); it reports the namespace and each unit bad, one escaped line each."""
    from helpers.hostile import assert_no_forgery

    renamed = os.path.join(root, "backup\nFAKE: every unit verified")
    shutil.copytree(os.path.join(root, NS.hex), renamed)
    code, out, err = run(capsys, "verify", renamed)
    assert code == 1, err
    assert_no_forgery(out + err)
    assert "8 unit file(s) in 1 namespace(s) checked, 9 bad" in out
    assert "not its directory" in out and out.count(": unit of another namespace") == 8
