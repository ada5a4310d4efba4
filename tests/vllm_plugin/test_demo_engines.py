"""The demo's one-prefix phase, vLLM's side, end to end as `make demo-engines` runs it: each
engine a process of its own (``python -m canonical_ops.demo.fleet``), one store. A vLLM engine
at TP=4 (its own scheduler and worker connectors, keys from vLLM's own hashing) stores a
prompt's first units; the standalone engine at TP=2 and a new vLLM engine at TP=1 load them
bit-exact. What breaks sharing (another hash seed) and a corrupt unit are misses, never bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.fleet_cli import MODEL, run_fleet, store_location

from canonical_ops.demo import fleet, truth
from canonical_ops.demo.one_prefix import demo_config
from canonical_ops.units.unit import key_digest


@pytest.fixture(params=["files", "redis"])
def location(request, tmp_path):
    with store_location(request.param, tmp_path) as where:
        yield where


def _env(**over) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    return {**env, **over}


def test_vllm_tp4_stores_the_standalone_engine_and_vllm_tp1_load(location, tmp_path):
    work = str(tmp_path / "work")
    stored = run_fleet(
        "vllm", "--store", location, "--tp", "4", "--write", "0:3", "--work-dir", work
    )
    assert stored["returncode"] == 0, stored["stderr"][-4000:]
    assert (stored["stored"], stored["store_asked"]) == (3, 3)
    assert "keys vLLM's own block hashes" in stored["line"]
    engine = run_fleet("standalone", "--store", location, "--tp", "2", "--load", "3")
    assert (engine["returncode"], engine["loaded"], engine["wrong"]) == (0, 3, 0)
    assert engine["checked"] == 3 * 2 * 16 * 8 * 64 * 2 * 2
    back = run_fleet("vllm", "--store", location, "--tp", "1", "--load", "3", "--work-dir", work)
    assert (back["returncode"], back["loaded"], back["wrong"]) == (0, 3, 0), back["stderr"][-4000:]
    assert back["checked"] == engine["checked"]


def test_another_hash_seed_is_a_miss_and_a_corrupt_unit_too(tmp_path):
    store, work = str(tmp_path / "store"), str(tmp_path / "work")
    seeded = _env(PYTHONHASHSEED="7")
    stored = run_fleet(
        "vllm", "--store", store, "--tp", "2", "--write", "0:3", "--work-dir", work, env=seeded
    )
    assert (stored["returncode"], stored["stored"]) == (0, 3), stored["stderr"][-4000:]
    same = run_fleet("standalone", "--store", store, "--load", "3", env=seeded)
    assert (same["returncode"], same["loaded"], same["wrong"]) == (0, 3, 0)
    # vLLM's default seed: other block hashes, so other keys: every unit a miss.
    other = run_fleet("standalone", "--store", store, "--load", "3", env=_env())
    assert (other["returncode"], other["loaded"], other["missed"]) == (1, 0, 3)
    # One payload bit of unit 1 flipped: the prefix ends before it, in both engines.
    args = fleet.build_parser().parse_args(["vllm", "--store", store, *MODEL])
    os.environ["PYTHONHASHSEED"] = "7"
    try:
        key = truth.block_hashes(demo_config(args, 3))[1]
    finally:
        del os.environ["PYTHONHASHSEED"]
    (path,) = [p for p in Path(store).rglob("*") if p.is_file() and key_digest(key) in str(p)]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    engine = run_fleet("standalone", "--store", store, "--load", "3", env=seeded)
    assert (engine["returncode"], engine["loaded"], engine["wrong"]) == (1, 1, 0)
    vllm = run_fleet("vllm", "--store", store, "--load", "3", "--work-dir", work, env=seeded)
    assert (vllm["returncode"], vllm["loaded"], vllm["wrong"]) == (1, 1, 0), vllm["stderr"][-4000:]
