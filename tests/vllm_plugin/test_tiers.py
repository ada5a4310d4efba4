"""canonical_fs inside vLLM 0.33's tiering manager (scheduler side, CPU, no model download).

Every engine here is vLLM's own ``OffloadingConnector`` scheduler with its
``TieringOffloadingManager``, CPU primary tier and the configured secondary tiers; the
tests play the worker's part by writing and reading primary rows (tiering.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
from tiering import STEP, SchedulerEngine, chunk_keys, engine_factory
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import LookupResult, Medium
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from canonical_ops.units import files as files_module
from canonical_ops.units.unit import key_digest
from canonical_ops.vllm import CanonicalOffloadingSpec
from canonical_ops.vllm.tiers import (
    CORRUPT_UNITS,
    EXPIRED_JOBS,
    REMOVED_UNITS,
    CanonicalFileTier,
    unit_key,
)

engines = pytest.fixture(engine_factory)


def fs_tier(root, **options) -> dict:
    return {"type": "canonical_fs", "root_dir": str(root), **options}


def vllm_fs_tier(root) -> dict:
    return {"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}


def unit_file(tier: CanonicalFileTier, key: bytes) -> str:
    """The file of ``key``'s unit (the file store's layout, found by the unit key's digest)."""
    kd = key_digest(unit_key(key))
    for folder, _dirs, files in os.walk(tier.store.directory):
        if kd in folder and files:
            return os.path.join(folder, files[0])
    raise AssertionError(f"no unit file for key {kd}")


def flip_bit(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x10]), offset)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- registration


def test_the_plugin_registers_both_tiers_and_module_path_finds_them(plugin_registered):
    for name, cls in (
        ("canonical_fs", "CanonicalFileTier"),
        ("canonical_redis", "CanonicalRedisTier"),
    ):
        assert SecondaryTierFactory.get_tier_class({"type": name}).__name__ == cls
        # Without the plugin: vLLM's out-of-tree path, by class name and module.
        by_module = {"type": cls, "module_path": "canonical_ops.vllm.tiers"}
        assert SecondaryTierFactory.get_tier_class(by_module).__name__ == cls
    # The tier's counters reach vLLM's Prometheus definitions through the spec.
    extra = {"secondary_tiers": [{"type": "canonical_fs", "root_dir": "/unused"}]}
    for spec in (TieringOffloadingSpec, CanonicalOffloadingSpec):
        assert CORRUPT_UNITS in spec.build_metric_definitions(extra)


def test_module_path_config_builds_the_tier_without_the_plugin(models, engines, tmp_path):
    tier = {"type": "CanonicalFileTier", "module_path": "canonical_ops.vllm.tiers"}
    saved = SecondaryTierFactory._registry.pop("canonical_fs", None)
    try:
        engine = engines(models["llama8"], [{**tier, "root_dir": str(tmp_path)}])
        assert isinstance(engine.tiers[0], CanonicalFileTier)
    finally:
        if saved is not None:
            SecondaryTierFactory._registry["canonical_fs"] = saved


# --------------------------------------------------------------------------- namespace


def test_namespace_is_shared_across_tp_and_pinned_where_vllm_does_not_certify(
    plugin_registered, models, engines, tmp_path
):
    tier = [fs_tier(tmp_path)]
    tp8, tp2 = (engines(models["llama8"], tier, tp=tp).tiers[0] for tp in (8, 2))
    assert tp8.namespace.hex == tp2.namespace.hex
    described = json.dumps(tp8.namespace.describe())
    extra = tp8.namespace.model.extra
    assert extra["tokens_per_hash"] == 16 and extra["blocks_per_chunk"] == 1
    assert (
        extra["groups"][0]["tokens_per_block"] == 16 and len(extra["groups"][0]["layer_names"]) == 6
    )
    assert tp8.namespace.format_id == "v1-nhd" and extra["dtype"] == "bfloat16"
    assert "topology" not in extra and described == json.dumps(tp2.namespace.describe())
    # PP=2: vLLM does not certify the config parallelism-agnostic -> a namespace of its own.
    pp2 = engines(models["llama8"], tier, tp=1, pp=2).tiers[0]
    assert pp2.namespace.hex != tp2.namespace.hex
    assert pp2.namespace.model.extra["topology"] == {
        "tp": 1,
        "pp": 2,
        "pcp": 1,
        "dcp": 1,
        "world_size": 2,
    }


def test_direct_layout_is_refused(plugin_registered, models, tmp_path):
    with pytest.raises(ValueError, match="canonical_layout"):
        SchedulerEngine(models["llama8"], [fs_tier(tmp_path)], extra={"canonical_layout": False})


# --------------------------------------------------------------------------- store and load


@pytest.mark.parametrize("spec", ["TieringOffloadingSpec", "CanonicalOffloadingSpec"])
def test_a_restart_at_another_tp_loads_bit_exact(
    plugin_registered, models, engines, tmp_path, spec
):
    keys = chunk_keys(6, "restart")
    writer = engines(models["llama8"], [fs_tier(tmp_path)], tp=8, spec=spec)
    rows = writer.random_rows(keys, seed=1)
    writer.store(rows)
    writer.shutdown()
    # A fresh engine (empty primary tier) at TP=2 reads every chunk from the files.
    reader = engines(models["llama8"], [fs_tier(tmp_path)], tp=2, spec=spec)
    assert reader.load(keys) == rows
    # Lookups answer per chunk, not per prefix (sliding-window groups look up after a gap).
    gap = chunk_keys(1, "never stored")[0]
    fresh = engines(models["llama8"], [fs_tier(tmp_path)], tp=2, spec=spec)
    assert fresh.load([keys[0], gap, keys[5]]) == {
        keys[0]: rows[keys[0]],
        gap: None,
        keys[5]: rows[keys[5]],
    }
    # The files are units `python -m canonical_ops store` reads and verifies.
    from canonical_ops.units import cli

    assert cli.main(["verify", str(tmp_path)]) == 0


def test_fs_and_canonical_fs_leave_identical_primary_rows(
    plugin_registered, models, engines, tmp_path
):
    jobs = [chunk_keys(4, "a"), chunk_keys(3, "b"), chunk_keys(4, "a")[2:] + chunk_keys(2, "c")]
    loads = [chunk_keys(4, "a"), chunk_keys(3, "b")[1:], chunk_keys(2, "c") + chunk_keys(1, "x")]
    seen = {}
    for name, tier in (
        ("fs", vllm_fs_tier(tmp_path / "fs")),
        ("canonical_fs", fs_tier(tmp_path / "ours")),
    ):
        writer = engines(models["llama8"], [tier], tp=4)
        rows = {}
        for i, job in enumerate(jobs):
            fresh = writer.random_rows([k for k in job if k not in rows], seed=10 + i)
            rows.update(fresh)
            writer.store({k: rows[k] for k in job})
        writer.shutdown()
        reader = engines(models["llama8"], [tier], tp=2)
        seen[name] = [reader.load(keys) for keys in loads]
    assert seen["fs"] == seen["canonical_fs"]
    assert seen["fs"][2][chunk_keys(1, "x")[0]] is None  # never stored: a miss in both
    assert sum(v is not None for load in seen["fs"] for v in load.values()) == 8


def test_a_flipped_bit_loads_wrong_bytes_through_fs_and_misses_through_canonical_fs(
    plugin_registered, models, engines, tmp_path
):
    keys = chunk_keys(3, "flip")
    fs_writer = engines(models["llama8"], [vllm_fs_tier(tmp_path / "fs")])
    rows = fs_writer.random_rows(keys, seed=3)
    fs_writer.store(rows)
    flip_bit(fs_writer.tiers[0].file_mapper.get_file_name(keys[1]), 1000)
    fs_reader = engines(models["llama8"], [vllm_fs_tier(tmp_path / "fs")])
    wrong = fs_reader.load(keys)
    assert wrong[keys[1]] is not None and wrong[keys[1]] != rows[keys[1]]  # loaded, silently wrong

    ours = engines(models["llama8"], [fs_tier(tmp_path / "ours")])
    ours.store(rows)
    path = unit_file(ours.tiers[0], keys[1])
    flip_bit(path, os.path.getsize(path) - ours.row_bytes + 1000)
    reader = engines(models["llama8"], [fs_tier(tmp_path / "ours")])
    tier, results = reader.tiers[0], []
    real_finished = tier.get_finished_jobs

    def spy():
        out = list(real_finished())
        results.extend(out)
        return out

    tier.get_finished_jobs = spy
    loaded = reader.load(keys)
    # One promotion job of three chunks: the verified two are kept, the bad one is a miss.
    (job,) = [r for r in results if not r.success]
    assert set(job.successful_keys) == {keys[0], keys[2]}
    assert loaded == {keys[0]: rows[keys[0]], keys[1]: None, keys[2]: rows[keys[2]]}
    assert not os.path.exists(path)
    assert len(os.listdir(os.path.join(tier.store.directory, "quarantine"))) == 1
    assert reader.stats()[f"{CORRUPT_UNITS}:('canonical_fs',)"] == 1
    assert reader.load(keys[1:2]) == {keys[1]: None}  # and stays a miss


def test_cold_units_are_read_o_direct_unless_direct_reads_is_off(
    plugin_registered, models, engines, tmp_path
):
    """``direct_reads`` (default on, where the file system allows O_DIRECT) reaches the store;
    writes stay buffered unless ``direct_io``. Both settings load the same rows."""
    from canonical_ops.units import fsutil

    root_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        o_direct_here = fsutil.probe(root_fd, True)
    finally:
        os.close(root_fd)
    keys = chunk_keys(2, "direct")
    writer = engines(models["llama8"], [fs_tier(tmp_path)])
    rows = writer.random_rows(keys, seed=5)
    writer.store(rows)
    for options, direct in (({}, o_direct_here), ({"direct_reads": False}, False)):
        reader = engines(models["llama8"], [fs_tier(tmp_path, **options)])
        store = reader.tiers[0].store
        assert (store.direct_reads, store.direct_io) == (direct, False)
        for path in (os.path.join(d, n) for d, _, ns in os.walk(store.directory) for n in ns):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: from the device
            os.close(fd)
        assert reader.load(keys) == rows


# --------------------------------------------------------------------------- capacity, events


def test_capacity_evicts_least_recently_used_with_removal_events(
    plugin_registered, models, engines, tmp_path
):
    keys = chunk_keys(5, "lru")
    probe = engines(models["llama8"], [fs_tier(tmp_path / "probe")])
    unit_bytes = os.path.getsize(unit_file_of_one(probe, keys[0]))
    tier = fs_tier(tmp_path / "lru", capacity_bytes=3 * unit_bytes, enable_kv_events=True)
    engine = engines(models["llama8"], [tier], events=True)
    rows = engine.random_rows(keys, seed=5)
    engine.store({k: rows[k] for k in keys[:3]})
    time.sleep(1.1)  # recency is tracked per second (the store's recency_granularity_s)
    assert engine.load(keys[:1]) == {keys[0]: rows[keys[0]]}  # keys[0] is now recent
    time.sleep(1.1)
    engine.store({k: rows[k] for k in keys[3:]})
    events = engine.events()
    stored = [k for e in events if e.medium is Medium.STORAGE and not e.removed for k in e.keys]
    removed = [k for e in events if e.medium is Medium.STORAGE and e.removed for k in e.keys]
    assert set(stored) == set(keys)
    assert set(removed) == {keys[1], keys[2]}
    assert engine.stats()[f"{REMOVED_UNITS}:('canonical_fs',)"] == 2
    fresh = engines(models["llama8"], [fs_tier(tmp_path / "lru")])
    assert [v is not None for v in fresh.load(keys).values()] == [True, False, False, True, True]


def unit_file_of_one(engine: SchedulerEngine, key: bytes) -> str:
    engine.store(engine.random_rows([key]))
    return unit_file(engine.tiers[0], key)


# --------------------------------------------------------------------------- deadlines


def test_a_stuck_read_is_a_miss_within_the_deadline_and_never_writes_the_row(
    plugin_registered, models, engines, tmp_path, monkeypatch
):
    keys = chunk_keys(2, "stuck")
    writer = engines(models["llama8"], [fs_tier(tmp_path)])
    rows = writer.random_rows(keys, seed=7)
    writer.store(rows)
    reader = engines(models["llama8"], [fs_tier(tmp_path, deadline_s=0.5)])
    release, entered, returned = threading.Event(), threading.Event(), threading.Event()

    def stuck_read(stage, path, offset):  # before a device read: it hangs until released
        if stage == "read":
            entered.set()
            release.wait()
            returned.set()  # the native read goes on: it must not write the rows

    monkeypatch.setattr(files_module, "_NOWAIT", False)  # a cold unit: from the device
    monkeypatch.setattr(files_module, "_test_hook", stuck_read)
    reader.rows[:] = 0xAB
    ctx = reader._request_locked()
    seen, slowest, started = [], 0.0, time.monotonic()
    try:
        while time.monotonic() - started < 10:
            t = time.monotonic()
            with reader.manager.lock:
                results = [reader.manager.lookup(k, ctx) for k in keys]
                reader.manager.on_schedule_end(STEP)
            slowest = max(slowest, time.monotonic() - t)
            seen.append(results)
            if results == [LookupResult.MISS] * 2:
                break
            time.sleep(0.02)
        elapsed = time.monotonic() - started
    finally:
        release.set()  # never leave a thread stuck, whatever happened
    # Looked up, promoted, stuck in the read, expired at the deadline: a miss; no call blocked.
    assert entered.is_set() and [LookupResult.HIT_PENDING] * 2 in seen
    assert seen[-1] == [LookupResult.MISS] * 2 and elapsed < 3, (elapsed, seen[-1])
    assert slowest < 0.3  # a call waiting on the read would take the deadline (0.5 s)
    with reader.manager.lock:
        reader.manager.on_request_finished(ctx)
    assert returned.wait(5)  # the abandoned read returned late: it must not write the rows
    time.sleep(0.2)
    assert (reader.rows == 0xAB).all()
    assert reader.stats()[f"{EXPIRED_JOBS}:('canonical_fs',)"] >= 1
    monkeypatch.setattr(files_module, "_test_hook", None)
    assert reader.load(keys) == rows  # and the tier recovers


# --------------------------------------------------------------------------- hash seed


def test_a_random_hash_seed_is_said_once_at_startup(
    plugin_registered, models, engines, tmp_path, monkeypatch, caplog
):
    from vllm.utils.hashing import sha256, xxhash

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    try:
        # As in vLLM's engine core: the scheduler (and its tiers) first, then the seed.
        monkeypatch.delattr(kv_cache_utils, "NONE_HASH", raising=False)
        with caplog.at_level(logging.WARNING, logger="canonical_ops.vllm.tiers"):
            engine = engines(models["llama8"], [fs_tier(tmp_path)])
            kv_cache_utils.init_none_hash(xxhash)
            engine.step()
            engine.step()
        lines = [r.getMessage() for r in caplog.records if r.name == "canonical_ops.vllm.tiers"]
        assert len(lines) == 1 and "canonical_fs" in lines[0] and "PYTHONHASHSEED" in lines[0]
        caplog.clear()
        kv_cache_utils.init_none_hash(sha256)
        with caplog.at_level(logging.WARNING, logger="canonical_ops.vllm.tiers"):
            engines(models["llama8"], [fs_tier(tmp_path)])
        assert not [r for r in caplog.records if r.name == "canonical_ops.vllm.tiers"]
    finally:
        kv_cache_utils.init_none_hash(sha256)


# --------------------------------------------------------------------------- options


def test_authenticated_units_are_read_only_with_the_same_secret(
    plugin_registered, models, engines, tmp_path, monkeypatch
):
    keys = chunk_keys(2, "auth")
    monkeypatch.setenv("CANONICAL_KV_STORE_SECRET", "a" * 32)
    writer = engines(models["llama8"], [fs_tier(tmp_path, authenticated=True)])
    rows = writer.random_rows(keys, seed=9)
    writer.store(rows)
    assert engines(models["llama8"], [fs_tier(tmp_path, authenticated=True)]).load(keys) == rows
    # Another key, or no key at all: other namespaces, never the writer's units.
    assert engines(models["llama8"], [fs_tier(tmp_path)]).load(keys) == dict.fromkeys(keys)
    monkeypatch.setenv("CANONICAL_KV_STORE_SECRET", "b" * 32)
    other = engines(models["llama8"], [fs_tier(tmp_path, authenticated=True)])
    assert other.load(keys) == dict.fromkeys(keys)
    monkeypatch.delenv("CANONICAL_KV_STORE_SECRET")
    with pytest.raises(ValueError, match="authenticated: expected CANONICAL_KV_STORE_SECRET"):
        SchedulerEngine(models["llama8"], [fs_tier(tmp_path, authenticated=True)])


@pytest.mark.parametrize(
    "tier, error, match",
    [
        ({"type": "canonical_fs", "n_read_threads": 0}, ValueError, "n_read_threads"),
        ({"type": "canonical_fs", "deadline_s": -1}, ValueError, "deadline_s"),
        ({"type": "canonical_fs", "model_name": ""}, TypeError, "model_name"),
        ({"type": "canonical_fs", "root_dir": 5}, TypeError, "root_dir"),
        ({"type": "canonical_fs", "authenticated": "yes"}, TypeError, "authenticated"),
        ({"type": "canonical_fs", "direct_reads": "yes"}, TypeError, "direct_reads"),
        ({"type": "canonical_redis", "url": "localhost"}, TypeError, "url"),
        (
            {"type": "canonical_redis", "url": "redis://127.0.0.1:1", "redis_options": {"pool": 1}},
            ValueError,
            "redis_options",
        ),
    ],
)
def test_bad_options_are_refused_naming_the_option(
    plugin_registered, models, tmp_path, tier, error, match
):
    tier = {"root_dir": str(tmp_path), **tier} if tier["type"] == "canonical_fs" else tier
    with pytest.raises(error, match=match):
        SchedulerEngine(models["llama8"], [tier])


@pytest.mark.parametrize("length", [8, 12, 36, 95, 96, 200])
def test_unit_keys_put_the_payload_on_a_cache_line_and_give_the_offload_key_back(length):
    from canonical_ops.units.unit import header_length
    from canonical_ops.vllm.tiers import offload_key

    key = bytes(range(256))[:length]
    unit = unit_key(key)
    assert offload_key(unit) == key
    if length < 96:
        assert len(unit) == 96 and header_length(unit) % 64 == 0
    # one unit key per offload key, also for keys that look like padded ones
    tricky = [key, key + bytes(1), unit[:-1], unit, unit + bytes(1)]
    assert len({unit_key(k) for k in tricky}) == len(set(tricky))


def test_the_tiers_read_threads_prefer_loads(plugin_registered, models, tmp_path):
    """vLLM's n_read_threads / n_write_threads become the pool's read- and write-priority
    workers (loads never wait behind a burst of cascades)."""
    tier = {**fs_tier(tmp_path), "n_read_threads": 3, "n_write_threads": 1}
    engine = SchedulerEngine(models["llama8"], [tier])
    [canonical] = engine.tiers
    assert (canonical._io.threads, canonical._io.read_threads) == (4, 3)
