"""The demo's one-prefix phase, SGLang's side, end to end as `make demo-engines` runs it: each
engine a process of its own (``python -m canonical_ops.demo.fleet``), one store. SGLang at TP=2
(its storage factory, host pools and page hashing) stores a prompt's first units; the
standalone engine at TP=1 loads them bit-exact; SGLang at TP=1 loads them and stores the next
unit; the standalone engine at TP=2 loads all of it. Files, then a Redis server."""

from __future__ import annotations

import pytest
from helpers.fleet_cli import run_fleet, store_location


@pytest.fixture(params=["files", "redis"])
def location(request, tmp_path):
    with store_location(request.param, tmp_path) as where:
        yield where


def test_sglang_and_the_standalone_engine_share_one_prefix(location, tmp_path):
    work = str(tmp_path / "work")
    unit = 2 * 16 * 8 * 64 * 2 * 2  # layers x tokens x heads x head size x (K, V) x fp16
    first = run_fleet(
        "sglang", "--store", location, "--tp", "2", "--write", "0:3", "--work-dir", work
    )
    assert (first["returncode"], first["stored"]) == (0, 3), first["stderr"][-4000:]
    assert "keys SGLang's own page hashes" in first["line"]
    engine = run_fleet("standalone", "--store", location, "--tp", "1", "--load", "3")
    assert (engine["returncode"], engine["loaded"], engine["wrong"]) == (0, 3, 0)
    assert engine["checked"] == 3 * unit
    more = run_fleet(
        "sglang", "--store", location, "--tp", "1", "--load", "3", "--write", "3:4",
        "--work-dir", work,
    )  # fmt: skip
    assert (more["returncode"], more["loaded"], more["wrong"]) == (0, 3, 0), more["stderr"][-4000:]
    assert more["checked"] == 3 * unit and more["stored"] == 1
    whole = run_fleet("standalone", "--store", location, "--tp", "2", "--load", "4")
    assert (whole["returncode"], whole["loaded"], whole["wrong"]) == (0, 4, 0)
    beyond = run_fleet(
        "sglang", "--store", location, "--tp", "2", "--load", "5", "--work-dir", work
    )
    assert (beyond["returncode"], beyond["loaded"], beyond["missed"]) == (1, 4, 1)
