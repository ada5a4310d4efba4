"""One prefix, every engine (issue 31), vLLM 0.33's side.

Key scheme v2 is checked bit for bit against vLLM's own ``hash_block_tokens`` and
``init_none_hash`` (both reproducible algorithms, default and fixed seeds). Then a whole vLLM
engine (its scheduler connector with ``TieringOffloadingManager`` and a ``shared_prefix`` tier,
and TP=4 worker connectors running our worker over the same shared region) stores a real
prompt keyed by vLLM's own block hashes; the standalone engine (tests/helpers/shared_prefix.py,
in this venv) loads it at TP=1 and TP=2 bit-exact, and stores what vLLM then loads. The keys
and namespace are pinned there for tests/sglang_plugin/test_shared_prefix.py (SGLang's side).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import uuid

import numpy as np
import pytest
import torch
from helpers import shared_prefix as sp
from helpers.redis_server import RedisServer
from helpers.vllm_harness import Job, Layer
from tiering import SchedulerEngine, engine_factory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from canonical_ops.units import StoreSecret
from canonical_ops.units.token_keys import TEST_VECTORS_V2, TokenKeyScheme, store_key
from canonical_ops.vllm import CanonicalOffloadingWorker
from canonical_ops.vllm.shared import SharedPrefix, check_worker_rows

engines = pytest.fixture(engine_factory)

SPLIT = [Layer(f"model.layers.{i}.self_attn.attn", "split_nhd") for i in range(sp.LAYERS)]
SHARED = {"total_kv_heads": sp.HEADS, "head_size": sp.HEAD_SIZE, "packing": "split"}


@pytest.fixture
def vllm_hash_state(monkeypatch):
    """vLLM's NONE_HASH and seed, restored after the test (init_none_hash sets globals)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    saved = dict(vars(kv_cache_utils))
    yield
    for name in ("NONE_HASH", "_NONE_HASH_SEED"):
        if name in saved:
            setattr(kv_cache_utils, name, saved[name])
        elif hasattr(kv_cache_utils, name):
            delattr(kv_cache_utils, name)


def vllm_block_hashes(tokens, block: int, algorithm: str = "sha256") -> list[bytes]:
    """vLLM's own chain: ``init_none_hash`` then ``hash_block_tokens`` per whole block."""
    fn = get_hash_fn_by_name(algorithm)
    kv_cache_utils.init_none_hash(fn)
    out, parent = [], None
    for at in range(0, len(tokens) - block + 1, block):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, list(tokens[at : at + block]))
        out.append(bytes(parent))
    return out


# --------------------------------------------------------------------------- the key scheme


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("seed", [None, "0", "fleet-7"])
def test_scheme_is_vllms_block_hash(vllm_hash_state, monkeypatch, algorithm, seed):
    if seed is not None:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    rng = np.random.default_rng(11)
    for block, length in ((16, 16 * 9 + 5), (1, 7), (32, 96)):
        tokens = rng.integers(0, 1 << 31, length).tolist()
        expected = vllm_block_hashes(tokens, block, algorithm)
        scheme = TokenKeyScheme(algorithm, block)
        assert scheme.none_hash == bytes(kv_cache_utils.NONE_HASH)
        assert scheme.block_hashes(tokens) == expected
        assert scheme.unit_keys(tokens, block) == [
            store_key(make_offload_key(h, 0)) for h in expected
        ]


def test_pinned_vectors_are_vllms(vllm_hash_state, monkeypatch):
    for algorithm, block, seed, tokens, expected in TEST_VECTORS_V2:
        if seed == "vllm-none-hash":
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        assert vllm_block_hashes(tokens, block, algorithm)[-1].hex() == expected
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hashes = vllm_block_hashes(sp.PROMPT, sp.BLOCK)
    assert tuple(h.hex() for h in hashes) == sp.BLOCK_HASHES_HEX


# --------------------------------------------------------------------------- a whole engine


def shared_tier(location, **over) -> dict:
    if "://" in str(location):
        tier = {"type": "canonical_redis", "url": location}
    else:
        tier = {"type": "canonical_fs", "root_dir": str(location)}
    return {**tier, "model_name": sp.MODEL_NAME, "shared_prefix": SHARED, **over}


class VllmEngine:
    """A vLLM engine: the scheduler connector (tiering manager, tiers) and TP worker
    connectors running our worker over the same shared region, KV = ``sp``'s prompt."""

    def __init__(
        self, engines, models, tier: dict, tp: int, seed: int = 5, layers=SPLIT, extra=None
    ) -> None:
        self.sched: SchedulerEngine = engines(
            models["llama8"], [tier], tp=tp, layers=layers, seed=seed,
            spec="CanonicalOffloadingSpec", extra=extra,
        )  # fmt: skip
        self.tier = self.sched.tiers[0]
        kcc = self.sched.model.kv_cache_config(tp)
        self.workers, self.kv = [], []
        for rank in range(tp):
            self.sched.config.parallel_config.rank = rank
            connector = OffloadingConnector(self.sched.config, KVConnectorRole.WORKER, kcc)
            self.kv.append(self.sched.model.rank_kv(tp, rank, zero=False))
            connector.register_kv_caches(self.kv[-1])
            self.workers.append(connector)
        self._jobs = 0

    def truth(self) -> list[torch.Tensor]:
        """Per layer, (blocks, 2, tokens, heads, head_size): GPU block j holds unit j."""
        return [
            self.sched.model.truth[layer.name].permute(0, 3, 2, 1, 4).contiguous()
            for layer in SPLIT
        ]

    def _run(self, store: bool, chunks, blocks) -> None:
        for connector in self.workers:
            worker = connector.connector_worker.worker
            self._jobs += 1
            job = Job([list(blocks)], [0], [int(c) for c in chunks])
            if store:
                assert worker.submit_store(self._jobs, job.gpu_spec(), job.cpu_spec())
            else:
                assert worker.submit_load(self._jobs, job.cpu_spec(), job.gpu_spec())
            worker.wait({self._jobs})
            assert all(r.success for r in worker.get_finished())

    def store(self, keys: list[bytes], bpc: int = 1) -> None:
        """A request's first ``len(keys)`` chunks of ``bpc`` blocks: GPU -> primary rows
        (workers) -> tiers."""
        manager = self.sched.manager
        with manager.lock:
            ctx = ReqContext(req_id=f"req-{uuid.uuid4().hex[:6]}")
            manager.on_new_request(ctx)
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, sp.BLOCK * bpc * (i + 1))
            out = manager.prepare_store(keys, ctx)
            self._run(True, out.store_spec.chunk_ids, range(len(keys) * bpc))
            manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
        self.sched.settle()

    def load(self, keys: list[bytes], into: int = 8, bpc: int = 1) -> int:
        """Lookups, then the hits' promotion and load into GPU blocks ``into..``: how many
        leading chunks of ``bpc`` blocks loaded (each compared by the caller)."""
        results, ctx = self.sched.lookup(keys)
        hits = 0
        while hits < len(keys) and results[hits] is LookupResult.HIT:
            hits += 1
        manager = self.sched.manager
        with manager.lock:
            if hits:
                spec = manager.prepare_load(keys[:hits], ctx)
                self._run(False, spec.chunk_ids, range(into, into + hits * bpc))
                manager.complete_load(keys[:hits], ctx)
            manager.on_request_finished(ctx)
        return hits

    def check_loaded(self, hits: int, into: int = 8) -> None:
        for kv in self.kv:
            for name, tensor in kv.items():
                got, want = tensor[into : into + hits], tensor[:hits]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name

    def shutdown(self) -> None:
        for connector in self.workers:
            connector.shutdown()
        self.workers = []
        self.sched.shutdown()


def offload_keys(units: int = sp.UNITS) -> list[bytes]:
    return [make_offload_key(bytes.fromhex(h), 0) for h in sp.BLOCK_HASHES_HEX[:units]]


@pytest.fixture
def server(tmp_path):
    server = RedisServer(str(tmp_path / "redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["files", "redis"])
def location(request, tmp_path):
    if request.param == "files":
        return str(tmp_path / "store")
    return request.getfixturevalue("server").url


def test_vllm_tp4_stores_the_standalone_engine_loads_at_tp1_and_tp2(
    plugin_registered, models, engines, vllm_hash_state, location, caplog
):
    keys = [make_offload_key(h, 0) for h in vllm_block_hashes(sp.PROMPT, sp.BLOCK)]
    assert keys == offload_keys()  # vLLM's own hashing of the prompt
    with caplog.at_level(logging.INFO):
        vllm = VllmEngine(engines, models, shared_tier(location), tp=4)
    try:
        assert vllm.tier.namespace.hex == sp.namespace().hex == sp.NAMESPACE_HEX
        assert [m for m in caplog.messages if "KV shared with every engine" in m]
        vllm.store(keys[:3])  # a partial prefix: the first 3 units
        truth = vllm.truth()
        for tp in (1, 2):
            found, caches = sp.engine_load(location, tp)
            assert found == 3
            sp.check_engine_caches(found, caches, truth, tp)
        # Every unit is exactly the canonical pages vLLM's workers wrote (bit for bit).
        ns = sp.namespace()
        with sp.open_store(location, ns) as store:
            for j, key in enumerate(sp.SCHEME.unit_keys(sp.PROMPT, sp.BLOCK)[:3]):
                row = np.zeros(ns.total_bytes, np.uint8)
                assert store.load(key, 0, sp.LAYERS, row).status == "ok"
                assert np.array_equal(row, sp.canonical_unit(truth, j))
        # Another model or dtype: another namespace, a miss.
        other = sp.namespace(model_name="test/other")
        with sp.open_store(location, other) as store:
            assert store.lookup(sp.SCHEME.unit_keys(sp.PROMPT, sp.BLOCK), 0, sp.LAYERS) == 0
        with sp.open_store(location, sp.namespace(dtype="float16")) as store:
            assert store.lookup(sp.SCHEME.unit_keys(sp.PROMPT, sp.BLOCK), 0, sp.LAYERS) == 0
    finally:
        vllm.shutdown()


def test_the_standalone_engine_stores_vllm_tp4_loads(
    plugin_registered, models, engines, vllm_hash_state, location
):
    probe = VllmEngine(engines, models, shared_tier(location), tp=4)
    truth = probe.truth()
    probe.shutdown()
    sp.engine_store(location, truth, tp=2, units=sp.UNITS)
    vllm_block_hashes(sp.PROMPT, sp.BLOCK)  # the engine's NONE_HASH, as vLLM sets it
    # A fresh vLLM engine whose GPU blocks 8.. are empty: the loads fill them.
    reader = VllmEngine(engines, models, shared_tier(location), tp=4)
    try:
        for kv in reader.kv:
            for tensor in kv.values():
                tensor[8:].zero_()
        hits = reader.load(offload_keys())
        assert hits == sp.UNITS
        reader.check_loaded(hits)
    finally:
        reader.shutdown()


def test_a_corrupt_unit_is_a_miss_in_both_engines(
    plugin_registered, models, engines, vllm_hash_state, tmp_path
):
    location = str(tmp_path / "store")
    vllm_block_hashes(sp.PROMPT, sp.BLOCK)
    writer = VllmEngine(engines, models, shared_tier(location), tp=4)
    writer.store(offload_keys())
    writer.shutdown()
    # Flip one payload byte of unit 1 (the file named by its key's digest).
    from canonical_ops.units.unit import key_digest

    digest = key_digest(sp.SCHEME.unit_keys(sp.PROMPT, sp.BLOCK)[1])
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(location) for f in fs if digest in d]
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    found, _ = sp.engine_load(location, 1)
    assert found == 1  # the prefix ends before the corrupt unit
    reader = VllmEngine(engines, models, shared_tier(location), tp=4)
    try:
        for kv in reader.kv:
            for tensor in kv.values():
                tensor[8:].zero_()
        hits = reader.load(offload_keys())
        assert hits == 1  # the corrupt unit is a miss (its failed promotion), never loaded
        reader.check_loaded(hits)
        for kv in reader.kv:
            assert all(int(t[9:].count_nonzero()) == 0 for t in kv.values())
    finally:
        reader.shutdown()


def test_authenticated_sharing_needs_the_same_secret(
    plugin_registered, models, engines, vllm_hash_state, tmp_path, monkeypatch
):
    location = str(tmp_path / "store")
    secret = "fleet-secret-" + "s" * 20
    monkeypatch.setenv("CANONICAL_KV_STORE_SECRET", secret)
    vllm_block_hashes(sp.PROMPT, sp.BLOCK)
    writer = VllmEngine(engines, models, shared_tier(location, authenticated=True), tp=4)
    truth = writer.truth()
    writer.store(offload_keys())
    assert writer.tier.namespace.hex == sp.namespace().hex  # the secret is the store's
    writer.shutdown()
    found, caches = sp.engine_load(location, 1, secret=StoreSecret(secret))
    assert found == sp.UNITS
    sp.check_engine_caches(found, caches, truth, 1)
    assert sp.engine_load(location, 1)[0] == 0  # no secret: another namespace
    assert sp.engine_load(location, 1, secret=StoreSecret("x" * 32))[0] == 0


# --------------------------------------------------------------------------- refusals


def test_what_cannot_be_shared_is_said_in_one_line(
    plugin_registered, models, engines, vllm_hash_state, tmp_path, caplog
):
    with caplog.at_level(logging.WARNING):
        # vLLM's own spec: nothing checks the workers' geometry.
        plain = engines(
            models["llama8"], [shared_tier(tmp_path / "a")], tp=4, spec="TieringOffloadingSpec"
        ).tiers[0]
    assert plain.namespace.key_scheme == ""  # this engine's own namespace
    lines = [m for m in caplog.messages if "not sharing KV" in m]
    assert len(lines) == 1 and "CanonicalOffloadingSpec" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        big = shared_tier(tmp_path / "b", shared_prefix={**SHARED, "head_size": 4096})
        tier = engines(models["llama8"], [big], tp=4, spec="CanonicalOffloadingSpec").tiers[0]
    assert tier.namespace.key_scheme == ""
    assert [m for m in caplog.messages if "not sharing KV" in m and "row" in m]
    with pytest.raises(ValueError, match="shared_prefix: unknown fields"):
        SharedPrefix.from_option({**SHARED, "heads": 8})
    with pytest.raises(ValueError, match="shared_prefix: algorithm"):
        SharedPrefix.from_option({**SHARED, "hash_algorithm": "xxhash"})


def test_a_random_or_other_hash_seed_keeps_the_engine_alone(
    plugin_registered, models, engines, vllm_hash_state, tmp_path, caplog, monkeypatch
):
    location = str(tmp_path / "store")
    tier = engines(
        models["llama8"], [shared_tier(location)], tp=4, spec="CanonicalOffloadingSpec"
    ).tiers[0]
    shared = tier.namespace.hex
    monkeypatch.setenv("PYTHONHASHSEED", "another-fleet")
    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))  # vLLM chose another seed
    with caplog.at_level(logging.WARNING):
        tier.on_schedule_end(None)
    assert tier.namespace.hex != shared and tier.namespace.key_scheme == ""
    assert len([m for m in caplog.messages if "not sharing KV" in m]) == 1


def test_the_worker_refuses_a_geometry_that_is_not_its_kv(
    plugin_registered, models, engines, vllm_hash_state, tmp_path
):
    vllm = VllmEngine(engines, models, shared_tier(tmp_path / "s"), tp=2)
    try:
        worker: CanonicalOffloadingWorker = vllm.workers[0].connector_worker.worker
        config = vllm.workers[0].connector_worker.spec.config
        from helpers.vllm_harness import vllm_canonical_kv_caches

        kcc = vllm.sched.model.kv_cache_config(2)
        vllm.sched.config.parallel_config.rank = 0
        ckv = vllm_canonical_kv_caches(vllm.sched.config, kcc, vllm.kv[0])
        check_worker_rows(SharedPrefix.from_option(SHARED), ckv, config, worker)
        # (Heads x head size of the same product place the same bytes: another namespace,
        # never other bytes, so that is not refused.)
        for wrong in ({"packing": "packed"}, {"head_size": 64}, {"total_kv_heads": 2}):
            with pytest.raises(RuntimeError, match="does not describe this engine's KV cache"):
                check_worker_rows(
                    SharedPrefix.from_option({**SHARED, **wrong}), ckv, config, worker
                )
        # An engine the tier keeps alone (here: PP) is not checked: it starts, working alone.
        alone = dataclasses.replace(
            config,
            parallel=dataclasses.replace(config.parallel, pp_size=2, is_parallelism_agnostic=False),
        )
        check_worker_rows(SharedPrefix.from_option({**SHARED, "head_size": 64}), ckv, alone, worker)
    finally:
        vllm.shutdown()


def test_chunks_of_two_blocks_are_units_of_32_tokens_in_every_packing(
    plugin_registered, models, engines, vllm_hash_state, tmp_path
):
    """blocks_per_chunk=2: a row holds two pages of 16 tokens per layer. Packed NHD pages
    concatenate into the page of 32 tokens; split pages are regrouped (layouts.tokens) on the
    I/O pool, both ways. Either way the unit is the canonical page of 32 tokens."""
    packed = [Layer(f"model.layers.{i}.self_attn.attn", "packed_nhd") for i in range(sp.LAYERS)]
    hashes = [bytes.fromhex(h) for h in sp.BLOCK_HASHES_HEX]
    chunk_keys = [make_offload_key(h, 0) for h in hashes[1::2]]
    keys = sp.SCHEME.unit_keys(sp.PROMPT, 32)
    vllm_block_hashes(sp.PROMPT, sp.BLOCK)
    for kind, layers in (("packed", packed), ("split", SPLIT)):
        location = str(tmp_path / kind)
        tier = shared_tier(location, shared_prefix={**SHARED, "packing": kind})
        vllm = VllmEngine(engines, models, tier, tp=2, layers=layers, extra={"block_size": 32})
        try:
            assert vllm.tier.namespace.unit_tokens == 32
            assert (vllm.tier._chunk_pages is None) == (kind == "packed")  # regrouped: split
            vllm.store(chunk_keys, bpc=2)
            ns = vllm.tier.namespace
            truth = vllm.truth() if kind == "split" else None
            with sp.open_store(location, ns) as store:
                for j, key in enumerate(keys):
                    unit = np.zeros(ns.total_bytes, np.uint8)
                    assert store.load(key, 0, sp.LAYERS, unit).status == "ok"
                    if kind == "split":
                        want = sp.canonical_unit(sp.regroup(truth, 32), j)
                    else:  # (blocks, heads, tokens, 2, dim) -> packed NHD (tokens, heads, 2*dim)
                        want = torch.cat([
                            vllm.sched.model.truth[layer.name][2 * j : 2 * j + 2]
                            .permute(0, 2, 1, 3, 4).reshape(-1).view(torch.uint8)
                            for layer in packed
                        ]).numpy()  # fmt: skip
                    assert np.array_equal(unit, want), (kind, j)
        finally:
            vllm.shutdown()
    # The standalone engine's 32-token split units, loaded by a fresh vLLM at TP=4 (chunks of
    # 2 blocks): the rows are regrouped back into two pages of 16 per layer.
    location = str(tmp_path / "engine")
    reader = VllmEngine(engines, models, shared_tier(location), tp=4, extra={"block_size": 32})
    try:
        assert reader.tier.namespace.hex == sp.namespace(tokens=32).hex
        sp.engine_store(location, reader.truth(), tp=1, tokens=32, units=2)
        for kv in reader.kv:
            for tensor in kv.values():
                tensor[8:].zero_()
        assert reader.load(chunk_keys, bpc=2) == 2
        reader.check_loaded(4)
    finally:
        reader.shutdown()
