"""A hybrid model's attention pages and Mamba / GDN state through the file store, across TP.

The model (Qwen3-Next-like, with one Mamba2 layer to exercise group replication):
model layers [gdn, gdn, gdn, attn, mamba2, gdn, gdn, attn]. A writer engine at
one TP stores a request's KV blocks and its state (every rank through the
ops, into the stage's regions; the StageCaches persist them into a FileStore);
a new engine at another TP, with empty regions, fetches both from the files
and loads them into its own caches. Every byte is compared with each rank's
shard sliced from the unsharded truth with numpy (vLLM's sharding rule:
``engine.hybrid.state_shard``, written independently of layouts.state's mappings).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

import canonical_ops
from canonical_ops.engine.cache import StageCache, pp_layer_range
from canonical_ops.engine.hybrid import (
    StateWorker,
    explain_state_miss,
    hybrid_namespace,
    split_stage_layers,
    state_page_manager,
    state_shard,
)
from canonical_ops.engine.pages import PageManager
from canonical_ops.units.files import FileStore
from canonical_ops.units.namespace import (
    ModelIdentity,
    StateReshardError,
    StoreNamespace,
)
from layouts import LayerSpec, RankContext, derive_group_mappings
from layouts.state import StateSpec
from tests.helpers.layout_truth import Topology, local_page, random_truth
from tests.helpers.ops import typed_view

MODEL = ModelIdentity("test/qwen3-next-like", "r1")
KINDS = ["gdn", "gdn", "gdn", "attn", "mamba2", "gdn", "gdn", "attn"]
IS_STATE = [k != "attn" for k in KINDS]
KV_HEADS, HEAD, BLOCK, BLOCKS = 8, 16, 4, 3
DTYPES = dict(conv_kernel=4, conv_dtype="bfloat16", ssm_dtype="float32")
GDN = StateSpec.gdn(num_k_heads=8, num_v_heads=16, head_k_dim=4, head_v_dim=4, **DTYPES)
MAMBA2 = StateSpec.mamba2(
    num_heads=8, head_dim=4, n_groups=1, state_size=8, conv_layout="DS", **DTYPES
)
NP_DTYPES = {"bfloat16": np.uint16, "float32": np.uint32}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# Mamba2 with n_groups=2: TP=4 cannot prove the sharding (vLLM replicates only one group).
REFUSED = StateSpec.mamba2(num_heads=8, head_dim=4, n_groups=2, state_size=8, **DTYPES)
HASHES = [b"block-%02d" % i for i in range(BLOCKS)]
STATE_KEY = HASHES[-1]  # the state after the prefix's last block
SLOTS = 3  # state slots per rank; the request lives in slot 1 (writer), slot 2 (reader)


def state_specs(kinds=KINDS, gdn=GDN, mamba2=MAMBA2) -> list[StateSpec]:
    return [gdn if k == "gdn" else mamba2 for k in kinds if k != "attn"]


def attn_spec(tp: int) -> LayerSpec:
    return LayerSpec("full", BLOCK, max(1, KV_HEADS // tp), HEAD, "bfloat16", "packed", "NHD")


# --------------------------------------------------------------------------- truth


@dataclass
class Truth:
    kv: list[np.ndarray]  # per attention layer, per block: (2, heads, tokens, bytes)
    states: list[dict[str, np.ndarray]]  # per state layer: segment -> (outer, channels, inner)


def make_truth(specs: list[StateSpec], seed: int = 7) -> Truth:
    rng = np.random.default_rng(seed)
    kv = [
        random_truth(rng, "full", KV_HEADS, BLOCK * BLOCKS, HEAD * 2) for k in KINDS if k == "attn"
    ]
    states = []
    for spec in specs:
        states.append(
            {
                name: rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(NP_DTYPES[dt])
                for name, dt, shape, _ in spec.canonical_layout()
            }
        )
    return Truth(kv, states)


def unit_paths(namespace_dir: str) -> list[tuple[str, int, int]]:
    """(path, first, end) of every unit file below a namespace directory
    (``<kd[:2]>/<kd>/<first>-<end>.ckv``)."""
    out = []
    for dirpath, _, names in os.walk(namespace_dir):
        for name in names:
            if name.endswith(".ckv") and os.path.relpath(dirpath, namespace_dir).count(os.sep) == 1:
                first, end = map(int, name[: -len(".ckv")].split("-"))
                out.append((os.path.join(dirpath, name), first, end))
    return sorted(out)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as signed integers of the element width (bit-exact compares)."""
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def from_bits(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(
        np.ascontiguousarray(data).view(np.int16 if data.itemsize == 2 else np.int32)
    )


def _ctx(tp: int, rank: int = 0) -> RankContext:
    return RankContext(tp, KV_HEADS, rank)


# --------------------------------------------------------------------------- engines


@dataclass
class Engine:
    """One engine of ``tp`` ranks (x ``pp`` stages): namespaces, managers, regions, caches."""

    tp: int
    pp: int
    namespace: StoreNamespace
    stages: list[dict]

    def close(self) -> None:
        for stage in self.stages:
            for cache in (stage["kv_cache"], stage["state_cache"]):
                cache.close()
            for store in stage["stores"]:
                store.close()


def open_engine(root, tp: int, pp: int = 1, specs=None) -> Engine:
    specs = state_specs() if specs is None else specs
    sizes = [None if s.local_shapes(tp) else (128, 32) for s in specs]  # make_state_caches
    namespace = hybrid_namespace(
        MODEL, [attn_spec(tp)] * KINDS.count("attn"), specs, _ctx(tp), state_tensor_bytes=sizes
    )
    stages = []
    for stage in range(pp):
        (a0, a1), (s0, s1) = split_stage_layers(IS_STATE, *pp_layer_range(len(KINDS), stage, pp))
        kv_store = FileStore(root, namespace)
        state_store = FileStore(root, namespace.state_units())
        groups = [derive_group_mappings(attn_spec(tp), tp, KV_HEADS) for _ in range(a0, a1)]
        kv_manager = PageManager.from_mappings(8, groups)
        kv_rows = torch.zeros(8, namespace.layer_bytes(a0, a1), dtype=torch.uint8)
        state_ns = namespace.state_units()
        state_rows = torch.zeros(4, state_ns.layer_bytes(s0, s1), dtype=torch.uint8)
        workers, kv_bases = [], []
        for rank in range(tp):
            caches = [make_state_caches(specs[i], tp) for i in range(s0, s1)]
            workers.append(StateWorker(caches, specs[s0:s1], _ctx(tp, rank), state_rows))
            kv_bases.append(
                [
                    torch.zeros(BLOCKS + 1, attn_spec(tp).page_size_bytes, dtype=torch.uint8)
                    for _ in range(a0, a1)
                ]
            )
        state_manager = state_page_manager(4, workers[0].groups)
        stages.append(
            dict(
                attn=(a0, a1),
                state=(s0, s1),
                groups=groups,
                kv_manager=kv_manager,
                kv_rows=kv_rows,
                kv_bases=kv_bases,
                state_manager=state_manager,
                state_rows=state_rows,
                workers=workers,
                kv_cache=StageCache(kv_manager, kv_rows, (a0, a1), namespace, [kv_store]),
                state_cache=StageCache(
                    state_manager, state_rows, (s0, s1), state_ns, [state_store]
                ),
                stores=[kv_store, state_store],
            )
        )
    return Engine(tp, pp, namespace, stages)


def make_state_caches(spec: StateSpec, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    shapes = spec.local_shapes(tp)
    if shapes is None:  # a layer that cannot be resharded: some per-rank slot, stored whole
        shapes = ((4, 16), (2, 4))
    return tuple(
        torch.full((SLOTS, *shape), 7, dtype=TORCH_DTYPES[dtype])
        for shape, dtype in zip(shapes, spec.dtypes)
    )


def write(engine: Engine, truth: Truth, specs: list[StateSpec]) -> None:
    """Every rank stores its shard of the request's KV blocks and state; persist both."""
    topo = Topology(engine.tp)
    block_ids = torch.arange(1, BLOCKS + 1)
    for stage in engine.stages:
        a0, a1 = stage["attn"]
        s0, s1 = stage["state"]
        kv_pages = stage["kv_manager"].allocate(HASHES)
        [state_page] = stage["state_manager"].allocate([STATE_KEY])
        for rank in range(engine.tp):
            bases = stage["kv_bases"][rank]
            caches = [typed_view(base, attn_spec(engine.tp)) for base in bases]
            for layer, base in zip(range(a0, a1), bases):
                for b in range(BLOCKS):
                    tokens = slice(b * BLOCK, (b + 1) * BLOCK)
                    page = local_page(
                        truth.kv[layer][:, :, tokens], attn_spec(engine.tp), topo, KV_HEADS, rank
                    )
                    base[b + 1] = torch.from_numpy(page)
            if a1 > a0:
                plan = canonical_ops.make_plan(
                    [g[rank] for g in stage["groups"]], caches, stage["kv_rows"]
                )
                canonical_ops.store(caches, stage["kv_rows"], plan, block_ids, kv_pages)
            worker = stage["workers"][rank]
            for layer, pair in zip(range(s0, s1), worker.state_caches):
                spec = specs[layer]
                if spec.local_shapes(engine.tp) is None:  # opaque: the rank's own bytes
                    for t in pair:
                        t[1] = torch.arange(t[1].numel()).view(t[1].shape).to(t.dtype) + rank
                    continue
                conv, ssm = state_shard(spec, truth.states[layer], engine.tp, rank)
                for tensor, data in zip(pair, (conv, ssm)):
                    bits(tensor[1])[:] = from_bits(data)
            worker.store(slot_ids=[1], page_ids=[state_page])
            for page in kv_pages:
                if rank in stage["kv_manager"].writer_ranks(page):
                    gen = stage["kv_manager"].generation(page)
                    stage["kv_manager"].complete_store(page, rank, generation=gen)
            if rank in stage["state_manager"].writer_ranks(state_page):
                gen = stage["state_manager"].generation(state_page)
                stage["state_manager"].complete_store(state_page, rank, generation=gen)
        assert stage["kv_cache"].persist(HASHES).submitted == BLOCKS
        assert stage["state_cache"].persist([STATE_KEY], [BLOCKS - 1]).submitted == 1
        events = stage["kv_cache"].drain() + stage["state_cache"].drain()
        assert [e.status for e in events] == ["ok"] * (BLOCKS + 1), events


def read(engine: Engine) -> list[dict]:
    """Fetch the prefix's KV and state from the files, load into every rank; events."""
    out = []
    for stage in engine.stages:
        kv_found = stage["kv_cache"].lookup(HASHES, timeout=30)
        state_found = stage["state_cache"].lookup([STATE_KEY], timeout=30)
        stage["kv_cache"].fetch(HASHES, kv_found)
        stage["state_cache"].fetch([STATE_KEY], state_found)
        kv_events, state_events = stage["kv_cache"].drain(), stage["state_cache"].drain()
        out.append(dict(kv=kv_found, state=state_found, events=kv_events + state_events))
        out[-1]["state_events"] = state_events
    return out


def load_and_check(engine: Engine, truth: Truth, specs: list[StateSpec]) -> int:
    """Load the fetched pages and state into every rank; compare every byte. Bytes checked."""
    topo = Topology(engine.tp)
    checked = 0
    for stage in engine.stages:
        a0, a1 = stage["attn"]
        s0, s1 = stage["state"]
        assert stage["kv_manager"].lookup(HASHES) == BLOCKS
        assert stage["state_manager"].lookup([STATE_KEY]) == 1
        kv_pages = [stage["kv_manager"].page_of(h) for h in HASHES]
        state_page = stage["state_manager"].page_of(STATE_KEY)
        for rank in range(engine.tp):
            bases = stage["kv_bases"][rank]
            caches = [typed_view(base, attn_spec(engine.tp)) for base in bases]
            if a1 > a0:
                plan = canonical_ops.make_plan(
                    [g[rank] for g in stage["groups"]], caches, stage["kv_rows"]
                )
                canonical_ops.load(caches, stage["kv_rows"], plan, torch.arange(BLOCKS), kv_pages)
            for layer, base in zip(range(a0, a1), bases):
                for b in range(BLOCKS):
                    tokens = slice(b * BLOCK, (b + 1) * BLOCK)
                    expected = local_page(
                        truth.kv[layer][:, :, tokens], attn_spec(engine.tp), topo, KV_HEADS, rank
                    )
                    got = base[b].numpy()
                    np.testing.assert_array_equal(got, expected)
                    checked += got.size
            worker = stage["workers"][rank]
            worker.load(slot_ids=[2], page_ids=[state_page])
            for layer, pair in zip(range(s0, s1), worker.state_caches):
                spec = specs[layer]
                if spec.local_shapes(engine.tp) is None:
                    for t in pair:
                        want = torch.arange(t[2].numel()).view(t[2].shape).to(t.dtype) + rank
                        assert torch.equal(bits(t[2]), bits(want))
                        checked += t[2].numel() * t.element_size()
                    continue
                conv, ssm = state_shard(spec, truth.states[layer], engine.tp, rank)
                for tensor, data in zip(pair, (conv, ssm)):
                    got = bits(tensor[2]).numpy().view(data.dtype)
                    np.testing.assert_array_equal(got, data)
                    # the slots the reader did not load are untouched
                    assert torch.all(tensor[0] == 7) and torch.all(tensor[1] == 7)
                    checked += data.nbytes
    return checked


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("writer", "reader"),
    [((4, 1), (2, 1)), ((1, 1), (8, 1)), ((4, 1), (2, 2)), ((2, 2), (4, 1))],
    ids=["tp4-to-tp2", "tp1-to-tp8", "tp4-to-tp2xpp2", "tp2xpp2-to-tp4"],
)
def test_attention_pages_and_state_restart_at_another_topology(tmp_path, writer, reader):
    specs = state_specs()
    truth = make_truth(specs)
    engine = open_engine(tmp_path, *writer)
    write(engine, truth, specs)
    engine.close()
    later = open_engine(tmp_path, *reader)
    assert later.namespace == engine.namespace  # certified: parallelism free
    for result in read(later):
        assert result["kv"].from_tiers == BLOCKS and result["state"].from_tiers == 1
        assert {e.status for e in result["events"]} == {"ok"}
    checked = load_and_check(later, truth, specs)
    state_bytes = sum(s.canonical_bytes for s in specs)
    assert checked >= state_bytes + 2 * BLOCKS * BLOCK * KV_HEADS * HEAD * 2 * 2
    later.close()


def test_state_units_are_their_own_kind(tmp_path):
    engine = open_engine(tmp_path, 2)
    ns = engine.namespace
    state_ns = ns.state_units()
    assert state_ns.hex != ns.hex and state_ns.unit_kind == "state"
    assert state_ns.num_layers == sum(IS_STATE) and ns.num_layers == KINDS.count("attn")
    assert state_ns.layer_bytes(0, state_ns.num_layers) == sum(
        s.canonical_bytes for s in state_specs()
    )
    assert state_ns.kv_units() == ns and ns.state_units().state_units() == state_ns
    for described in (ns, state_ns):
        again = StoreNamespace.from_description(json.loads(json.dumps(described.describe())))
        assert again == described and again.hex == described.hex
    # A model without state layers is described as before (existing digests unchanged).
    plain = StoreNamespace.from_specs(MODEL, [attn_spec(2)], _ctx(2))
    assert set(plain.describe()) == {
        "schema",
        "format_id",
        "model",
        "kv_quant",
        "num_layers",
        "layers",
    }
    assert (
        replace(ns, states=()).hex
        == StoreNamespace.from_specs(MODEL, [attn_spec(2)] * 2, _ctx(2)).hex
    )
    write(engine, make_truth(state_specs()), state_specs())
    engine.close()
    dirs = sorted(os.listdir(tmp_path))
    assert ns.hex in dirs and state_ns.hex in dirs
    [(_, first, end)] = unit_paths(os.path.join(tmp_path, state_ns.hex))
    assert (first, end) == (0, 6)


def test_foreign_state_geometry_is_a_miss(tmp_path):
    specs = state_specs()
    engine = open_engine(tmp_path, 4)
    write(engine, make_truth(specs), specs)
    engine.close()
    other_gdn = replace(GDN, dims=tuple((k, 3 if k == "conv_kernel" else v) for k, v in GDN.dims))
    foreign = state_specs(gdn=other_gdn)
    later = open_engine(tmp_path, 2, specs=foreign)
    assert later.namespace.hex != engine.namespace.hex
    [result] = read(later)
    assert result["kv"].from_tiers == 0 and result["state"].from_tiers == 0
    stage = later.stages[0]
    assert stage["state_manager"].lookup([STATE_KEY]) == 0
    assert explain_state_miss(tmp_path, later.namespace, _ctx(2)) is None  # not a topology issue
    later.close()


def test_corrupt_state_unit_is_a_miss_and_writes_nothing(tmp_path):
    specs = state_specs()
    engine = open_engine(tmp_path, 4)
    write(engine, make_truth(specs), specs)
    engine.close()
    state_dir = os.path.join(tmp_path, engine.namespace.state_units().hex)
    [(path, _, _)] = unit_paths(state_dir)
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    later = open_engine(tmp_path, 2)
    [result] = read(later)
    assert result["state"].from_tiers == 1  # listed; the fetch verifies
    states = result["state_events"]
    assert [e.status for e in states] == ["miss"] and "checksum" in states[0].detail
    stage = later.stages[0]
    assert stage["state_manager"].lookup([STATE_KEY]) == 0  # never ready, never loaded
    assert stage["state_manager"].page_of(STATE_KEY) is None
    assert stage["kv_manager"].lookup(HASHES) == BLOCKS  # the KV units were fine
    for worker in stage["workers"]:
        for pair in worker.state_caches:
            assert all(torch.all(t == 7) for t in pair)  # no state byte written anywhere
    metrics = stage["state_cache"].metrics().tiers[0]
    assert metrics.fills_missed == 1 and metrics.fills_ok == 0
    later.close()


def test_state_that_cannot_be_resharded_stays_with_its_topology(tmp_path):
    """Mamba2 with n_groups=2 at TP=4: not provable (vLLM replicates only n_groups == 1).
    The same topology reads it back; another gets a miss, and the store says why."""
    specs = state_specs(mamba2=REFUSED)
    truth = make_truth(specs)
    engine = open_engine(tmp_path, 4, specs=specs)
    assert engine.namespace.topology_bound
    worker = engine.stages[0]["workers"][0]
    assert list(worker.fallback_reasons) == [3] and "n_groups=2" in worker.fallback_reasons[3]
    assert not worker.is_topology_independent
    write(engine, truth, specs)
    engine.close()
    same = open_engine(tmp_path, 4, specs=specs)
    assert same.namespace == engine.namespace
    [result] = read(same)
    assert result["state"].from_tiers == 1
    assert load_and_check(same, truth, specs) > 0
    same.close()
    # TP=2 certifies n_groups=2 (2 | 2) but the writer's units are TP=4's whole slots.
    other = open_engine(tmp_path, 2, specs=specs)
    assert other.namespace.hex != engine.namespace.hex
    [result] = read(other)
    assert result["state"].from_tiers == 0 and result["kv"].from_tiers == 0
    error = explain_state_miss(tmp_path, other.namespace, _ctx(2))
    assert isinstance(error, StateReshardError)
    assert error.kind == "mamba2" and error.layer == 3
    assert "n_groups=2" in str(error) and "tp=4" in str(error) and "tp=2" in str(error)
    with pytest.raises(StateReshardError, match=r"state layer 3 \(mamba2\) cannot be resharded"):
        engine.namespace.check_state_readable(_ctx(2))
    engine.namespace.check_state_readable(_ctx(4))  # the writer's own topology reads it
    other.close()


def test_a_reader_that_cannot_reshard_certified_state_is_told_why(tmp_path):
    """The other direction: TP=2 certifies Mamba2 n_groups=2 and stores it parallelism free;
    TP=4 cannot reshard it (its own units are opaque), so it misses. explain_state_miss only
    asked whether the writer's units were bound to another topology and said nothing."""
    specs = state_specs(mamba2=REFUSED)
    engine = open_engine(tmp_path, 2, specs=specs)
    assert not engine.namespace.topology_bound
    write(engine, make_truth(specs), specs)
    engine.close()
    other = open_engine(tmp_path, 4, specs=specs)
    assert other.namespace.topology_bound
    [result] = read(other)
    assert result["state"].from_tiers == 0  # a miss, never a load
    error = explain_state_miss(tmp_path, other.namespace, _ctx(4))
    assert isinstance(error, StateReshardError)
    assert error.kind == "mamba2" and error.layer == 3 and "n_groups=2" in error.reason
    message = str(error)
    assert "\n" not in message and "state layer 3 (mamba2) cannot be resharded" in message
    assert "tp=4" in message and "stored certified" in message
    other.close()


def test_worker_refuses_tensors_that_are_not_the_spec(tmp_path):
    rows = torch.zeros(2, GDN.canonical_bytes, dtype=torch.uint8)
    good = [make_state_caches(GDN, 2)]
    StateWorker(good, [GDN], _ctx(2, 1), rows)
    conv, ssm = good[0]
    with pytest.raises(ValueError, match=r"state_caches\[0\]\[0\]: expected slots of shape"):
        StateWorker([(conv[:, :, :-1].contiguous(), ssm)], [GDN], _ctx(2), rows)
    with pytest.raises(ValueError, match=r"state_caches\[0\]\[1\]: expected dtype float32"):
        StateWorker([(conv, ssm.to(torch.bfloat16))], [GDN], _ctx(2), rows)
    with pytest.raises(ValueError, match="each slot contiguous"):
        StateWorker([(conv.transpose(1, 2), ssm)], [GDN], _ctx(2), rows)
    with pytest.raises(ValueError, match="rows: expected rows of exactly"):
        StateWorker(good, [GDN], _ctx(2), torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="specs: expected one StateSpec"):
        StateWorker(good, [GDN, GDN], _ctx(2), rows)


def _namespace(tp: int, specs: list[StateSpec]) -> StoreNamespace:
    sizes = [None if s.local_shapes(tp) else (128, 32) for s in specs]  # as make_state_caches
    return hybrid_namespace(
        MODEL, [attn_spec(tp)] * KINDS.count("attn"), specs, _ctx(tp), state_tensor_bytes=sizes
    )


def test_explain_state_miss_reads_only_private_regular_files(tmp_path):
    """issue 26: it opened every <namespace>/namespace.json under the root as it found it: a
    FIFO there blocked the reader forever, and another user's directory was believed."""
    specs = state_specs(mamba2=REFUSED)
    writer, reader = _namespace(4, specs).state_units(), _namespace(2, specs)
    directory = tmp_path / writer.hex
    directory.mkdir(mode=0o700)
    description = directory / "namespace.json"
    description.write_text(json.dumps(writer.describe()))
    description.chmod(0o600)
    assert isinstance(explain_state_miss(tmp_path, reader, _ctx(2)), StateReshardError)
    if os.geteuid() == 0:  # a directory of another user is not read
        os.chown(directory, 4242, 4242)
        assert explain_state_miss(tmp_path, reader, _ctx(2)) is None
        os.chown(directory, 0, 0)
    elsewhere = tmp_path / "elsewhere"
    directory.rename(elsewhere)
    directory.symlink_to(elsewhere)  # a symlinked namespace directory is not followed
    assert explain_state_miss(tmp_path, reader, _ctx(2)) is None
    directory.unlink()
    elsewhere.rename(directory)
    description.unlink()
    os.mkfifo(description, 0o600)  # a FIFO: refused at once, never waited on
    answers: list = []
    thread = threading.Thread(
        target=lambda: answers.append(explain_state_miss(tmp_path, reader, _ctx(2))), daemon=True
    )
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and answers == [None]


def test_explain_state_miss_does_not_blame_the_topology_for_another_conv_layout(tmp_path):
    """Units of a conv layout other than the reader's are unreadable at every topology: they
    used to be explained as "readable only at tp=4" (the conv layout was not compared)."""
    writer = _namespace(4, state_specs(mamba2=replace(REFUSED, conv_layout="DS")))
    reader = _namespace(2, state_specs(mamba2=REFUSED))  # conv_layout "SD"
    directory = tmp_path / writer.state_units().hex
    directory.mkdir(mode=0o700)
    (directory / "namespace.json").write_text(json.dumps(writer.state_units().describe()))
    (directory / "namespace.json").chmod(0o600)
    assert explain_state_miss(tmp_path, reader, _ctx(2)) is None
    same_layout = _namespace(2, state_specs(mamba2=replace(REFUSED, conv_layout="DS")))
    assert isinstance(explain_state_miss(tmp_path, same_layout, _ctx(2)), StateReshardError)


def test_state_shard_is_vllms_split():
    """Each rank's conv channels and SSM heads: its own 1/tp of every segment, side by
    side; Mamba2's single group whole on every rank; the per-slot shapes vLLM allocates."""
    for spec in (GDN, MAMBA2):
        rng = np.random.default_rng(3)
        full = {
            name: rng.integers(0, 1 << 16, size=shape).astype(NP_DTYPES[dtype])
            for name, dtype, shape, _ in spec.canonical_layout()
        }
        for tp in (1, 2, 4, 8):
            shards = [state_shard(spec, full, tp, rank) for rank in range(tp)]
            for conv, ssm in shards:
                assert (conv.shape, ssm.shape) == spec.local_shapes(tp)
            heads = np.concatenate([ssm for _, ssm in shards])  # the heads, in rank order
            np.testing.assert_array_equal(heads.reshape(full["ssm"].shape), full["ssm"])
            channels = 0 if spec.conv_layout == "DS" else 1  # the conv's channel axis
            for seg in spec.segments[:-1]:
                width = seg.channels // tp if seg.units % tp == 0 else seg.channels
                lo = sum(
                    (s.channels // tp if s.units % tp == 0 else s.channels)
                    for s in spec.segments[: spec.segments.index(seg)]
                )
                for rank, (conv, _) in enumerate(shards):
                    got = np.take(conv, range(lo, lo + width), axis=channels)
                    start = rank * width if seg.units % tp == 0 else 0
                    want = full[seg.name][:, start : start + width]
                    want = want[0] if spec.conv_layout == "DS" else want[:, :, 0]
                    np.testing.assert_array_equal(got, want)
    full = make_truth([GDN]).states[0]
    with pytest.raises(ValueError, match=r"tp: conv\.q has 8 units, which tp=3 cannot shard"):
        state_shard(GDN, full, 3, 0)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 1\], got 2"):
        state_shard(GDN, full, 2, 2)
    with pytest.raises(ValueError, match="full: expected segment 'ssm'"):
        state_shard(GDN, {k: v for k, v in full.items() if k != "ssm"}, 2, 0)


def test_split_stage_layers():
    assert split_stage_layers(IS_STATE, 0, 8) == ((0, 2), (0, 6))
    assert split_stage_layers(IS_STATE, 0, 4) == ((0, 1), (0, 3))
    assert split_stage_layers(IS_STATE, 4, 8) == ((1, 2), (3, 6))
    assert split_stage_layers(IS_STATE, 4, 5) == ((1, 1), (3, 4))
    with pytest.raises(ValueError, match="end"):
        split_stage_layers(IS_STATE, 4, 9)


def test_state_units_through_redis_tp4_to_tp2(tmp_path):
    """The same state unit through the Redis tier: TP=4 ranks store, TP=2 ranks load."""
    from helpers.redis_server import RedisBinaryMissing, RedisServer, redis_binaries

    from canonical_ops.units import RedisStore

    try:
        redis_binaries()
    except RedisBinaryMissing as error:
        pytest.fail(str(error))
    specs = state_specs()
    truth = make_truth(specs)
    state_ns = hybrid_namespace(MODEL, [attn_spec(4)] * 2, specs, _ctx(4)).state_units()
    server = RedisServer(str(tmp_path / "redis")).start()
    try:
        rows = {}
        for tp in (4, 2):
            rows[tp] = torch.zeros(1, state_ns.total_bytes, dtype=torch.uint8)
            workers = [
                StateWorker([make_state_caches(s, tp) for s in specs], specs, _ctx(tp, r), rows[tp])
                for r in range(tp)
            ]
            with RedisStore(server.url, state_ns) as store:
                if tp == 4:
                    for rank, worker in enumerate(workers):
                        for layer, pair in enumerate(worker.state_caches):
                            shard = state_shard(specs[layer], truth.states[layer], tp, rank)
                            for tensor, data in zip(pair, shard):
                                bits(tensor[1])[:] = from_bits(data)
                        worker.store(slot_ids=[1], page_ids=[0])
                    assert store.store(STATE_KEY, 0, rows[tp][0], BLOCKS - 1).status == "ok"
                    continue
                assert store.lookup([STATE_KEY], 0, len(specs)) == 1
                assert store.load(STATE_KEY, 0, len(specs), rows[tp][0]).status == "ok"
            for rank, worker in enumerate(workers):
                worker.load(slot_ids=[2], page_ids=[0])
                for layer, pair in enumerate(worker.state_caches):
                    shard = state_shard(specs[layer], truth.states[layer], tp, rank)
                    for tensor, data in zip(pair, shard):
                        np.testing.assert_array_equal(
                            bits(tensor[2]).numpy().view(data.dtype), data
                        )
        assert torch.equal(rows[2], rows[4])  # the canonical unit is the same bytes
    finally:
        server.stop()
